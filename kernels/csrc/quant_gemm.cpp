namespace {

// ---- Weight-only quantized GEMM: y[M, N] = x[M, K] @ W^T (+ bias), x float32, W int8 / int4 / FP8 (e4m3) with a
// float32 scale (and, asymmetric, zero point) per (output column, group of input columns), dequantised in registers:
// w = (q - zero) * scale (FP8: e4m3(q) * scale), exactly the float dequantize(qw) gives, then one fma chain over k in
// order per output element, as gemm_tile's: the bits of the float32 GEMM over the dequantised weight, whatever M.
//
// Layout (kernels/cpu_quant.py packs it once at load): panels of NR output columns as the float GEMM's,
//   q: 8-bit [P, K, NR] bytes (unsigned ints, or e4m3 bits); 4-bit [P, K / 2, NR] bytes, k even in the low nibble,
//      k + 1 in the high one (K even);
//   scale, zero: float32 [P, G, NR] (zero nullable: symmetric, zero point zc for every group);
//   gb: int32 [G + 1], group g's input columns are [gb[g], gb[g + 1]) (act-order checkpoints have their K permuted
//      at load so that a group's columns are adjacent; x's columns are gathered by the same permutation at each
//      call); 4-bit: every group of even length.
// M <= MR (decode) runs a register tile straight over the packed bytes; larger M dequantises each panel once into a
// per-thread float32 panel (L2) and runs the float GEMM's tile over it for every MR rows.

constexpr int QU8 = 0, QU4 = 1, QF8 = 2;  // kinds: unsigned 8-bit ints, 4-bit ints (nibble pairs), e4m3 bytes

// e4m3 bits -> float32, exactly: the 7 magnitude bits moved to a float32's exponent|mantissa position (bit 20 up)
// read as a float32 (e4m3 subnormals land on float32 subnormals) times 2**120 (the exponent biases' difference),
// then the sign. NaN (0x7f / 0xff) is not decoded (no quantized weight holds it).
inline float e4m3_scalar(uint8_t b) {
  const uint32_t u = uint32_t(b & 0x7f) << 20;
  float f;
  std::memcpy(&f, &u, sizeof f);
  f *= 1.329227995784916e36f;  // 2**120
  return (b & 0x80) ? -f : f;
}

// the dequantised panel [K, NR] of float32 (for M > MR, and every M in the build without AVX2)
inline void dequant_panel(int kind, const uint8_t* q, const float* S, const float* Z, float zc, const int32_t* gb,
                          int64_t G, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    const float* s = S + g * NR;
    const float* z = Z ? Z + g * NR : nullptr;
    for (int64_t k = gb[g]; k < gb[g + 1]; ++k) {
      float* o = out + k * NR;
      if (kind == QF8) {
        const uint8_t* r = q + k * NR;
        for (int64_t j = 0; j < NR; ++j) o[j] = e4m3_scalar(r[j]) * s[j];
      } else if (kind == QU8) {
        const uint8_t* r = q + k * NR;
        for (int64_t j = 0; j < NR; ++j) o[j] = (float(r[j]) - (z ? z[j] : zc)) * s[j];
      } else {
        const uint8_t* r = q + (k >> 1) * NR;
        const int sh = (k & 1) * 4;
        for (int64_t j = 0; j < NR; ++j) o[j] = (float((r[j] >> sh) & 0xf) - (z ? z[j] : zc)) * s[j];
      }
    }
  }
}

#ifdef __AVX2__
#ifdef __AVX512F__
using QV = __m512;
using QI = __m512i;
constexpr int QL = 16;
inline QI q_bytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline QV q_float(QI v) { return _mm512_cvtepi32_ps(v); }
inline QI q_lo4(QI v) { return _mm512_and_si512(v, _mm512_set1_epi32(0xf)); }
inline QI q_hi4(QI v) { return _mm512_srli_epi32(v, 4); }
inline QV q_e4m3(QI v) {
  const QV mag = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7f)), 20)),
                               _mm512_set1_ps(1.329227995784916e36f));
  const QI sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}
inline QV q_load(const float* p) { return _mm512_loadu_ps(p); }
inline void q_store(float* p, QV v) { _mm512_storeu_ps(p, v); }
inline QV q_set1(float v) { return _mm512_set1_ps(v); }
inline QV q_zero() { return _mm512_setzero_ps(); }
inline QV q_fma(QV a, QV b, QV c) { return _mm512_fmadd_ps(a, b, c); }
inline QV q_sub(QV a, QV b) { return _mm512_sub_ps(a, b); }
inline QV q_mul(QV a, QV b) { return _mm512_mul_ps(a, b); }
inline QV q_add(QV a, QV b) { return _mm512_add_ps(a, b); }
#else
using QV = __m256;
using QI = __m256i;
constexpr int QL = 8;
inline QI q_bytes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline QV q_float(QI v) { return _mm256_cvtepi32_ps(v); }
inline QI q_lo4(QI v) { return _mm256_and_si256(v, _mm256_set1_epi32(0xf)); }
inline QI q_hi4(QI v) { return _mm256_srli_epi32(v, 4); }
inline QV q_e4m3(QI v) {
  const QV mag = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 20)),
                               _mm256_set1_ps(1.329227995784916e36f));
  const QI sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
}
inline QV q_load(const float* p) { return _mm256_loadu_ps(p); }
inline void q_store(float* p, QV v) { _mm256_storeu_ps(p, v); }
inline QV q_set1(float v) { return _mm256_set1_ps(v); }
inline QV q_zero() { return _mm256_setzero_ps(); }
inline QV q_fma(QV a, QV b, QV c) { return _mm256_fmadd_ps(a, b, c); }
inline QV q_sub(QV a, QV b) { return _mm256_sub_ps(a, b); }
inline QV q_mul(QV a, QV b) { return _mm256_mul_ps(a, b); }
inline QV q_add(QV a, QV b) { return _mm256_add_ps(a, b); }
#endif
constexpr int QVN = NR / QL;  // vectors per panel row: 3 (48 / 16 with AVX-512, 24 / 8 with AVX2)

// A group's scale and zero point vectors.
template <bool ZERO>
struct GroupVecs {
  QV s[QVN], z[QVN];
  explicit GroupVecs(float zc) {
    for (int v = 0; v < QVN; ++v) z[v] = q_set1(zc);
  }
  inline void load(const float* S, const float* Z, int64_t g) {
    for (int v = 0; v < QVN; ++v) {
      s[v] = q_load(S + g * NR + QL * v);
      if constexpr (ZERO) z[v] = q_load(Z + g * NR + QL * v);
    }
  }
  inline QV deq_int(QI q, int v) const { return q_mul(q_sub(q_float(q), z[v]), s[v]); }
};

// rows [0, R) of one panel's output straight over its packed bytes (R <= MR)
template <int KIND, bool ZERO, int R>
inline void quant_tile(const float* A, int64_t lda, const uint8_t* q, const float* S, const float* Z, float zc,
                       const int32_t* gb, int64_t G, float* C, int64_t ldc, int64_t nc, const float* bias) {
  QV c[R][QVN];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
    _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v) c[i][v] = q_zero();
  GroupVecs<ZERO> g(zc);
  const auto row = [&](int64_t k, const QV* w) __attribute__((always_inline)) {
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const QV a = q_set1(A[i * lda + k]);
      _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v) c[i][v] = q_fma(a, w[v], c[i][v]);
    }
  };
  for (int64_t gi = 0; gi < G; ++gi) {  // a group's columns, its scales (and zero points) in registers
    g.load(S, Z, gi);
    const int64_t k0 = gb[gi], k1 = gb[gi + 1];
    if constexpr (KIND == QU4) {  // groups of even length (cpu_quant.py packs no other)
      for (int64_t k = k0; k < k1; k += 2) {
        const uint8_t* p = q + (k >> 1) * NR;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 16 * NR, _MM_HINT_T0);
        QI b[QVN];
        QV w[QVN];
        _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v) b[v] = q_bytes(p + QL * v);
        _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v) w[v] = g.deq_int(q_lo4(b[v]), v);
        row(k, w);
        _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v) w[v] = g.deq_int(q_hi4(b[v]), v);
        row(k + 1, w);
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        const uint8_t* p = q + k * NR;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 16 * NR, _MM_HINT_T0);
        QV w[QVN];
        _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v) {
          const QI b = q_bytes(p + QL * v);
          if constexpr (KIND == QF8)
            w[v] = q_mul(q_e4m3(b), g.s[v]);
          else
            w[v] = g.deq_int(b, v);
        }
        row(k, w);
      }
    }
  }
  if (nc == NR) {
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
      _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v)
        q_store(C + i * ldc + QL * v, bias ? q_add(c[i][v], q_load(bias + QL * v)) : c[i][v]);
    return;
  }
  alignas(64) float tmp[NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
    _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v) q_store(tmp + QL * v, c[i][v]);
    float* out = C + i * ldc;
    for (int64_t j = 0; j < nc; ++j) out[j] = bias ? tmp[j] + bias[j] : tmp[j];
  }
}

// the SIMD dequantisation of a panel (the scratch of M > MR)
template <int KIND, bool ZERO>
inline void dequant_panel_simd(const uint8_t* q, const float* S, const float* Z, float zc, const int32_t* gb,
                               int64_t G, float* out) {
  GroupVecs<ZERO> g(zc);
  for (int64_t gi = 0; gi < G; ++gi) {
    g.load(S, Z, gi);
    for (int64_t k = gb[gi]; k < gb[gi + 1]; ++k) {
      const uint8_t* p = KIND == QU4 ? q + (k >> 1) * NR : q + k * NR;
      _Pragma("GCC unroll 3") for (int v = 0; v < QVN; ++v) {
        const QI b = q_bytes(p + QL * v);
        QV w;
        if constexpr (KIND == QF8)
          w = q_mul(q_e4m3(b), g.s[v]);
        else if constexpr (KIND == QU4)
          w = g.deq_int((k & 1) ? q_hi4(b) : q_lo4(b), v);
        else
          w = g.deq_int(b, v);
        q_store(out + k * NR + QL * v, w);
      }
    }
  }
}

template <class F>
inline void with_quant(int kind, bool zero, F&& f) {
  const auto z = [&](auto k) {
    if (zero)
      f(k, std::true_type{});
    else
      f(k, std::false_type{});
  };
  if (kind == QU8) z(std::integral_constant<int, QU8>{});
  else if (kind == QU4) z(std::integral_constant<int, QU4>{});
  else z(std::integral_constant<int, QF8>{});
}
#endif

// per-thread float32 panel for M > MR
inline float* panel_scratch(int64_t n) {
  static thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < n) buf.resize(n);
  return buf.data();
}

void quant_gemm(const float* A, int64_t lda, int64_t M, int64_t K, const uint8_t* Bq, int kind, const float* S,
                const float* Z, float zc, const int32_t* gb, int64_t G, int64_t N, const float* bias, float* C,
                int64_t ldc, int64_t mc, int nthreads) {
  const int64_t P = (N + NR - 1) / NR, panel_bytes = (kind == QU4 ? K / 2 : K) * NR;
#ifdef __AVX2__
  const bool direct = M <= MR;
#else
  const bool direct = false;
#endif
  mc = direct ? M : row_block_rows(M, mc);
  for (int64_t m0 = 0; m0 < M; m0 += mc) {
    const int64_t m1 = std::min(M, m0 + mc);
#pragma omp parallel num_threads(nthreads)
    {
      const int nt = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
      float* scratch = direct ? nullptr : panel_scratch(K * NR);
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* q = Bq + p * panel_bytes;
        const float* s = S + p * G * NR;
        const float* z = Z ? Z + p * G * NR : nullptr;
        const int64_t nc = std::min(NR, N - p * NR);
        const float* bp = bias ? bias + p * NR : nullptr;
        float* c = C + p * NR;
#ifdef __AVX2__
        if (direct) {
          with_quant(kind, z != nullptr, [&](auto kd, auto zr) {
            with_rows<MR>(M, [&](auto r) {
              quant_tile<decltype(kd)::value, decltype(zr)::value, decltype(r)::value>(A, lda, q, s, z, zc, gb, G, c,
                                                                                       ldc, nc, bp);
            });
          });
          continue;
        }
        with_quant(kind, z != nullptr, [&](auto kd, auto zr) {
          dequant_panel_simd<decltype(kd)::value, decltype(zr)::value>(q, s, z, zc, gb, G, scratch);
        });
#else
        dequant_panel(kind, q, s, z, zc, gb, G, scratch);
#endif
        for (int64_t m = m0; m < m1; m += MR) {
          with_rows<MR>(std::min<int64_t>(MR, m1 - m), [&](auto r) {
            gemm_tile<decltype(r)::value, false>(A + m * lda, lda, scratch, K, c + m * ldc, ldc, nc, bp, nullptr, 0,
                                                 nullptr, 0, nullptr, 0);
          });
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// y [M, N] (row stride ldc) = x [M, K] (row stride lda) @ dequant(W)^T + bias (nullable), W packed by
// kernels/cpu_quant.py (see quant_gemm above): kind 0 uint8, 1 uint4 pairs, 2 e4m3; scales / zero points (nullable:
// every zero point zc) [P, G, NR]; gb [G + 1] the groups' first input columns; rows in blocks of mc (M > MR).
void loom_quant_gemm(const float* A, int64_t lda, int64_t M, int64_t K, const uint8_t* Bq, int kind, const float* S,
                     const float* Z, float zc, const int32_t* gb, int64_t G, int64_t N, const float* bias, float* C,
                     int64_t ldc, int64_t mc, int nthreads) {
  quant_gemm(A, lda, M, K, Bq, kind, S, Z, zc, gb, G, N, bias, C, ldc, mc, nthreads);
}

// rows per register tile: the largest M the kernel runs straight over the packed bytes (larger M: dequantised panels)
int64_t loom_quant_gemm_direct_rows() {
#ifdef __AVX2__
  return MR;
#else
  return 0;
#endif
}

}  // extern "C"
