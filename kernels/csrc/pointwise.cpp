namespace {
// Rows in parallel from this many elements on (a prefill chunk); below it (a decode step's rows) a parallel region
// costs more than it saves. Rows are independent: the same bits either way.
constexpr int64_t POINTWISE_PARALLEL_MIN = 1 << 16;

// out[t, i] = act(x[t, i]) * x[t, I + i], act(v) = v * sigmoid(z) = v / (1 + exp(-z)) with z = v (SiLU) or, GELU_TANH,
// z = 2 sqrt(2 / pi) (v + 0.044715 v^3) (GELU's tanh approximation: 0.5 v (1 + tanh(z / 2))); x rows of stride xs,
// out rows of I
template <bool GELU_TANH>
void act_mul(const float* x, int64_t xs, float* out, int64_t T, int64_t I, int nthreads) {
  constexpr float c = 2.f * 0.7978845608028654f, c3 = 0.044715f;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * I >= POINTWISE_PARALLEL_MIN)
  for (int64_t t = 0; t < T; ++t) {
    const float* g = x + t * xs;
    const float* u = g + I;
    float* o = out + t * I;
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
}  // namespace

extern "C" {

// ---- pointwise work between the GEMMs (one call per layer part instead of ~10 small torch ops)

// res_out = x + res (or x); out = res_out * (1 / sqrt(mean(res_out^2) + eps)) * w, per row of N
void loom_rms_norm(const float* x, int64_t xs, const float* res, int64_t rs, const float* w, float eps, float* out,
                   int64_t os, float* res_out, int64_t ros, int64_t T, int64_t N, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * N >= POINTWISE_PARALLEL_MIN)
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * xs;
    float* ro = res_out + t * ros;
    for (int64_t i = 0; i < N; ++i) ro[i] = res ? xr[i] + res[t * rs + i] : xr[i];
    const float inv = 1.f / std::sqrt(dot(ro, ro, N) / float(N) + eps);
    float* o = out + t * os;
    for (int64_t i = 0; i < N; ++i) o[i] = ro[i] * inv * w[i];
  }
}

// neox rotary in place: for each head row x of q [T, H, D] and k [T, KVH, D] (strides s0 per token, s1 per head),
// x[i], x[i + D/2] = x[i] cos - x[i + D/2] sin, x[i + D/2] cos + x[i] sin; cos / sin from cs[pos[t]] (D floats)
void loom_rotary(const int64_t* pos, const float* cs, int64_t D, float* q, int64_t qs0, int64_t qs1, int64_t H,
                 float* k, int64_t ks0, int64_t ks1, int64_t KVH, int64_t T, int nthreads) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * (H + KVH) * D >= POINTWISE_PARALLEL_MIN)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cs + pos[t] * D;
    const float* sn = c + half;
    for (int64_t which = 0; which < 2; ++which) {
      float* base = which ? k + t * ks0 : q + t * qs0;
      const int64_t heads = which ? KVH : H, hs = which ? ks1 : qs1;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = base + h * hs;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * sn[i];
          x[i + half] = x2 * c[i] + x1 * sn[i];
        }
      }
    }
  }
}


void loom_silu_mul(const float* x, int64_t xs, float* out, int64_t T, int64_t I, int nthreads) {
  act_mul<false>(x, xs, out, T, I, nthreads);
}

void loom_gelu_tanh_mul(const float* x, int64_t xs, float* out, int64_t T, int64_t I, int nthreads) {
  act_mul<true>(x, xs, out, T, I, nthreads);
}

}  // extern "C"
