namespace {
// Rows in parallel from this many elements on (a prefill chunk); below it (a decode step's rows) a parallel region
// costs more than it saves. Rows are independent: the same bits either way.
constexpr int64_t POINTWISE_PARALLEL_MIN = 1 << 16;

// out[t, i] = act(x[t, i]) * x[t, I + i], act(v) = v * sigmoid(z) = v / (1 + exp(-z)) with z = v (SiLU) or, GELU_TANH,
// z = 2 sqrt(2 / pi) (v + 0.044715 v^3) (GELU's tanh approximation: 0.5 v (1 + tanh(z / 2))); x rows of stride xs,
// out rows of I
template <bool GELU_TANH>
inline void act_row(const float* g, const float* u, float* o, int64_t I) {
  constexpr float c = 2.f * 0.7978845608028654f, c3 = 0.044715f;
  {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
      const __m256 v = _mm256_loadu_ps(g + i);
      __m256 z = v;
      if constexpr (GELU_TANH)
        z = _mm256_mul_ps(_mm256_set1_ps(c),
                          _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(c3), _mm256_mul_ps(_mm256_mul_ps(v, v), v))));
      const __m256 e = exp256(_mm256_sub_ps(zero, z));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; ++i) {
      const float v = g[i], z = GELU_TANH ? c * (v + c3 * v * v * v) : v;
      o[i] = v / (1.f + std::exp(-z)) * u[i];
    }
  }
}

// T: the element type of x and out (bfloat16: a row widened to float32, the same math, rounded once)
template <bool GELU_TANH, class T>
void act_mul(const T* x, int64_t xs, T* out, int64_t T_, int64_t I, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (T_ * I >= POINTWISE_PARALLEL_MIN)
  {
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : 3 * I);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_; ++t) {
      if constexpr (std::is_same_v<T, float>) {
        act_row<GELU_TANH>(x + t * xs, x + t * xs + I, out + t * I, I);
      } else {
        widen(x + t * xs, buf.data(), 2 * I);
        act_row<GELU_TANH>(buf.data(), buf.data() + I, buf.data() + 2 * I, I);
        narrow(buf.data() + 2 * I, out + t * I, I);
      }
    }
  }
}

// res_out = x + res (or x), rounded to T; out = res_out * (1 / sqrt(mean(res_out^2) + eps)) * w, per row of N; the
// math in float32 on the rounded res_out (the residual stream the next layer reads), as the reference
template <class T, class W>
void rms_norm(const T* x, int64_t xs, const T* res, int64_t rs, const W* w, float eps, T* out, int64_t os, T* res_out,
              int64_t ros, int64_t T_, int64_t N, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (T_ * N >= POINTWISE_PARALLEL_MIN)
  {
    std::vector<float> buf(std::is_same_v<T, float> && std::is_same_v<W, float> ? 0 : 3 * N);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_; ++t) {
      const T* xr = x + t * xs;
      T* ro = res_out + t * ros;
      T* o = out + t * os;
      if constexpr (std::is_same_v<T, float> && std::is_same_v<W, float>) {
        for (int64_t i = 0; i < N; ++i) ro[i] = res ? xr[i] + res[t * rs + i] : xr[i];
        const float inv = 1.f / std::sqrt(dot(ro, ro, N) / float(N) + eps);
        for (int64_t i = 0; i < N; ++i) o[i] = ro[i] * inv * w[i];
      } else {
        float *r = buf.data(), *a = r + N, *wf = a + N;
        widen(xr, r, N);
        if (res) {
          widen(res + t * rs, a, N);
          for (int64_t i = 0; i < N; ++i) r[i] += a[i];
        }
        narrow(r, ro, N);
        widen(ro, r, N);  // the rounded sum, as the reference normalises it
        widen(w, wf, N);
        const float inv = 1.f / std::sqrt(dot(r, r, N) / float(N) + eps);
        for (int64_t i = 0; i < N; ++i) a[i] = r[i] * inv * wf[i];
        narrow(a, o, N);
      }
    }
  }
}

// neox rotary in place (see loom_rotary) on rows of T, cos / sin float32
template <class T>
void rotary(const int64_t* pos, const float* cs, int64_t D, T* q, int64_t qs0, int64_t qs1, int64_t H, T* k,
            int64_t ks0, int64_t ks1, int64_t KVH, int64_t T_, int nthreads) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T_ * (H + KVH) * D >= POINTWISE_PARALLEL_MIN)
  for (int64_t t = 0; t < T_; ++t) {
    const float* c = cs + pos[t] * D;
    const float* sn = c + half;
    for (int64_t which = 0; which < 2; ++which) {
      T* base = which ? k + t * ks0 : q + t * qs0;
      const int64_t heads = which ? KVH : H, hs = which ? ks1 : qs1;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = base + h * hs;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
          put(x + i, x1 * c[i] - x2 * sn[i]);
          put(x + i + half, x2 * c[i] + x1 * sn[i]);
        }
      }
    }
  }
}
}  // namespace

extern "C" {

// ---- pointwise work between the GEMMs (one call per layer part instead of ~10 small torch ops)

// res_out = x + res (or x); out = res_out * (1 / sqrt(mean(res_out^2) + eps)) * w, per row of N
void loom_rms_norm(const float* x, int64_t xs, const float* res, int64_t rs, const float* w, float eps, float* out,
                   int64_t os, float* res_out, int64_t ros, int64_t T, int64_t N, int nthreads) {
  rms_norm(x, xs, res, rs, w, eps, out, os, res_out, ros, T, N, nthreads);
}

// loom_rms_norm on bfloat16 rows; w bfloat16 (w_f32 0) or float32 (1: Gemma's 1 + w)
void loom_rms_norm_bf16(const bf16_t* x, int64_t xs, const bf16_t* res, int64_t rs, const void* w, int w_f32,
                        float eps, bf16_t* out, int64_t os, bf16_t* res_out, int64_t ros, int64_t T, int64_t N,
                        int nthreads) {
  if (w_f32)
    rms_norm(x, xs, res, rs, static_cast<const float*>(w), eps, out, os, res_out, ros, T, N, nthreads);
  else
    rms_norm(x, xs, res, rs, static_cast<const bf16_t*>(w), eps, out, os, res_out, ros, T, N, nthreads);
}

// neox rotary in place: for each head row x of q [T, H, D] and k [T, KVH, D] (strides s0 per token, s1 per head),
// x[i], x[i + D/2] = x[i] cos - x[i + D/2] sin, x[i + D/2] cos + x[i] sin; cos / sin from cs[pos[t]] (D floats)
void loom_rotary(const int64_t* pos, const float* cs, int64_t D, float* q, int64_t qs0, int64_t qs1, int64_t H,
                 float* k, int64_t ks0, int64_t ks1, int64_t KVH, int64_t T, int nthreads) {
  rotary(pos, cs, D, q, qs0, qs1, H, k, ks0, ks1, KVH, T, nthreads);
}

// loom_rotary on bfloat16 q / k (cos / sin float32)
void loom_rotary_bf16(const int64_t* pos, const float* cs, int64_t D, bf16_t* q, int64_t qs0, int64_t qs1, int64_t H,
                      bf16_t* k, int64_t ks0, int64_t ks1, int64_t KVH, int64_t T, int nthreads) {
  rotary(pos, cs, D, q, qs0, qs1, H, k, ks0, ks1, KVH, T, nthreads);
}

void loom_silu_mul(const float* x, int64_t xs, float* out, int64_t T, int64_t I, int nthreads) {
  act_mul<false>(x, xs, out, T, I, nthreads);
}

void loom_gelu_tanh_mul(const float* x, int64_t xs, float* out, int64_t T, int64_t I, int nthreads) {
  act_mul<true>(x, xs, out, T, I, nthreads);
}

void loom_silu_mul_bf16(const bf16_t* x, int64_t xs, bf16_t* out, int64_t T, int64_t I, int nthreads) {
  act_mul<false>(x, xs, out, T, I, nthreads);
}

void loom_gelu_tanh_mul_bf16(const bf16_t* x, int64_t xs, bf16_t* out, int64_t T, int64_t I, int nthreads) {
  act_mul<true>(x, xs, out, T, I, nthreads);
}

}  // extern "C"
