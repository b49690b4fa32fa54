// ---- Weight-only quantized GEMM over bfloat16 activations: y[M, N] = x[M, K] @ dequant(W)^T (+ bias), x bfloat16,
// W int8 / int4 with a float32 scale (and, asymmetric, zero point) per (output column, group of input columns), y
// bfloat16 (or float32). The unsigned q values are exact in bfloat16 (q < 256), so a group's dot product runs on
// VDPBF16PS over bfloat16 q (int4: a 16-entry VPERMW table lookup per nibble; int8: widened through float32), in
// float32, and the group's scale and zero point apply once per group and column after it:
//   y = sum over groups g of scale_g * (sum_{k in g} x_k q_k - zero_g * sum_{k in g} x_k)
// (symmetric: zero_g = zc, 8 or 128). Not the bits of a GEMM over the dequantised weights (the float32 kernel,
// quant_gemm.cpp, gives those): the error is bounded by the accumulation length (tests/kernels/test_cpu_quant_bf16.py).
//
// Layout (kernels/cpu_quant_bf16.py packs it once at load): panels of QB_NR = 48 output columns, three blocks of 16;
//   int8: [P, Kp / 2, 3, 32] bytes, byte 2j + h of a block = q(column j, k = 2 pp + h) (VDPBF16PS's pair order);
//   int4: [P, Kp / 4, 3, 32] bytes, byte 2j + h = q(j, 4 u + h) | q(j, 4 u + 2 + h) << 4 (low nibbles: the pair
//         (4u, 4u+1), high: (4u+2, 4u+3));
//   scale, zero: float32 [P, G, 48] as quant_gemm.cpp's; gb: int32 [G + 1] group bounds, each a multiple of the unit
//   (2 int8, 4 int4) but the last, Kp; x padded with zeros to Kp columns.
// M <= QB_MR: register tiles straight over the packed bytes; larger M: each panel decoded once into a per-thread
// bfloat16 scratch that every tile of QB_MR rows reads. QB_CH dot chains per 16 columns and row (VDPBF16PS's latency
// at M = 1), the same for every tile: a row's bits do not depend on M.
//
// Compiled twice from quant_bf16_body.inc: qbf_native under avx512bf16 (called only where the CPU has the flags:
// kernels/cpu_linear.loom_bf16_gemm), and qbf_emu, the same algorithm over 16-lane arrays in plain C++ on any CPU
// (VDPBF16PS as its pseudo-code: the odd product added, then the even one, each rounded): tests run it everywhere.

namespace {
constexpr int64_t QB_NR = 48;
constexpr int QB_MR = 2;
constexpr int QB_CH = 4;  // dot chains per 16 columns and row: VDPBF16PS's latency hidden at M = 1

inline uint16_t bf16_bits_of_small_int(int i) {  // exact: |i| < 256
  const float f = float(i);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}
}  // namespace

// the native build needs GCC's target pragma (clang builds the emulated one only: loom_quant_gemm_bf16_built() 0)
#if LOOM_HAVE_BF16_GEMM && !defined(__clang__)
#define LOOM_HAVE_QUANT_BF16 1
#else
#define LOOM_HAVE_QUANT_BF16 0
#endif

#if LOOM_HAVE_QUANT_BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
namespace qbf_native {
namespace {
#define QBF_ATTR
using V = __m512;
using W = __m512i;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vfnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
inline V vdp(V acc, uint32_t xpair, W w) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_set1_epi32(int32_t(xpair))),
                          reinterpret_cast<__m512bh>(w));
}
inline void vstore_bf16(uint16_t* p, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
inline W table16() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = bf16_bits_of_small_int(i & 15);
  return _mm512_load_si512(t);
}
inline W wload(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline void wstore(uint16_t* p, W w) { _mm512_storeu_si512(p, w); }
// 32 bytes of nibble pairs -> the pairs of the low nibbles and of the high ones, as bfloat16 words
inline void w4(const uint8_t* p, W tab, W& lo, W& hi) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  lo = _mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0xf)), tab);
  hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), tab);
}
// 32 bytes -> 32 bfloat16 words (through float32: exact)
inline W w8(const uint8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}
#include "quant_bf16_body.inc"
#undef QBF_ATTR
}  // namespace
}  // namespace qbf_native
#pragma GCC pop_options
#endif

namespace qbf_emu {
namespace {
#define QBF_ATTR
struct V {
  float f[16];
};
struct W {
  uint16_t w[32];
};
inline float bf(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline V vzero() { return V{}; }
inline V vset1(float f) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = f;
  return r;
}
inline V vload(const float* p) {
  V r;
  std::memcpy(r.f, p, sizeof r.f);
  return r;
}
inline void vstore(float* p, V v) { std::memcpy(p, v.f, sizeof v.f); }
inline V vadd(V a, V b) {
  for (int i = 0; i < 16; ++i) a.f[i] += b.f[i];
  return a;
}
inline V vfma(V a, V b, V c) {
  for (int i = 0; i < 16; ++i) c.f[i] = std::fma(a.f[i], b.f[i], c.f[i]);
  return c;
}
inline V vfnmadd(V a, V b, V c) {
  for (int i = 0; i < 16; ++i) c.f[i] = std::fma(-a.f[i], b.f[i], c.f[i]);
  return c;
}
inline V vdp(V acc, uint32_t xpair, W w) {  // VDPBF16PS's pseudo-code (the products are exact in float32)
  const float x0 = bf(uint16_t(xpair)), x1 = bf(uint16_t(xpair >> 16));
  for (int i = 0; i < 16; ++i) {
    acc.f[i] += x1 * bf(w.w[2 * i + 1]);
    acc.f[i] += x0 * bf(w.w[2 * i]);
  }
  return acc;
}
inline void vstore_bf16(uint16_t* p, V v) {
  for (int i = 0; i < 16; ++i) p[i] = to_bf16(v.f[i]).v;
}
inline W table16() {
  W t;
  for (int i = 0; i < 32; ++i) t.w[i] = bf16_bits_of_small_int(i & 15);
  return t;
}
inline W wload(const uint16_t* p) {
  W r;
  std::memcpy(r.w, p, sizeof r.w);
  return r;
}
inline void wstore(uint16_t* p, W w) { std::memcpy(p, w.w, sizeof w.w); }
inline void w4(const uint8_t* p, const W& tab, W& lo, W& hi) {
  for (int i = 0; i < 32; ++i) {
    lo.w[i] = tab.w[p[i] & 15];
    hi.w[i] = tab.w[p[i] >> 4];
  }
}
inline W w8(const uint8_t* p) {
  W r;
  for (int i = 0; i < 32; ++i) r.w[i] = bf16_bits_of_small_int(p[i]);
  return r;
}
#include "quant_bf16_body.inc"
#undef QBF_ATTR
}  // namespace
}  // namespace qbf_emu

namespace {
// per-call sums of each row's x over each group (float32, in k order), and per-thread decoded panels
inline float* qbf_group_sums(const uint16_t* A, int64_t lda, int64_t M, const int32_t* gb, int64_t G) {
  static thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < M * G) buf.resize(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = gb[g]; k < gb[g + 1]; ++k) s += to_f32(bf16_t{A[m * lda + k]});
      buf[m * G + g] = s;
    }
  return buf.data();
}
inline uint16_t* qbf_scratch(int64_t n) {
  static thread_local std::vector<uint16_t> buf;
  if (int64_t(buf.size()) < n) buf.resize(n);
  return buf.data();
}
}  // namespace

extern "C" {

int64_t loom_quant_gemm_bf16_panel_width() { return QB_NR; }

// 1 where the library has the VDPBF16PS build of loom_quant_gemm_bf16; the CPU's flags decide the rest
int64_t loom_quant_gemm_bf16_built() { return LOOM_HAVE_QUANT_BF16; }

// y [M, N] (row stride ldc; bfloat16, or float32 with out_f32) = x [M, Kp] bfloat16 (row stride lda, zero past the
// weight's K) @ dequant(W)^T + bias (float32, nullable), W packed by kernels/cpu_quant_bf16.py (u4: int4 nibble
// pairs, else int8 bytes); scales / zero points (nullable: every zero point zc) [P, G, 48]; gb [G + 1]. emulate: the
// plain C++ build of the same algorithm (any CPU); else VDPBF16PS (only where the CPU has avx512_bf16; a library
// built without it does nothing).
void loom_quant_gemm_bf16(const uint16_t* A, int64_t lda, int64_t M, int64_t Kp, const uint8_t* Bq, int u4,
                          const float* S, const float* Z, float zc, const int32_t* gb, int64_t G, int64_t N,
                          const float* bias, void* C, int64_t ldc, int out_f32, int nthreads, int emulate) {
  if (M <= 0) return;
  const float* sx = qbf_group_sums(A, lda, M, gb, G);
  const int64_t P = (N + QB_NR - 1) / QB_NR;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(nthreads, P)))
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    uint16_t* scratch = M > QB_MR ? qbf_scratch(Kp * QB_NR) : nullptr;
    if (emulate) {
      if (u4)
        qbf_emu::panels<true>(A, lda, M, Kp, Bq, S, Z, zc, gb, G, N, bias, C, ldc, out_f32, sx, scratch, t, nt);
      else
        qbf_emu::panels<false>(A, lda, M, Kp, Bq, S, Z, zc, gb, G, N, bias, C, ldc, out_f32, sx, scratch, t, nt);
    } else {
#if LOOM_HAVE_QUANT_BF16
      if (u4)
        qbf_native::panels<true>(A, lda, M, Kp, Bq, S, Z, zc, gb, G, N, bias, C, ldc, out_f32, sx, scratch, t, nt);
      else
        qbf_native::panels<false>(A, lda, M, Kp, Bq, S, Z, zc, gb, G, N, bias, C, ldc, out_f32, sx, scratch, t, nt);
#endif
    }
  }
}

}  // extern "C"
