// ---- bfloat16 GEMM on avx512_bf16 (VDPBF16PS): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and W bfloat16, float32
// accumulation, y rounded once to bfloat16 (or left float32). Compiled into every build with a target attribute (the
// build's own flags need not include avx512_bf16: an AVX-512 CPU without it, or an AVX2 one, loads the same library)
// and called only where the CPU has the flag (kernels/cpu_linear.py asks cpu_ext.cpu_flags()).
//
// W is packed once into panels of BF_NR columns: panel p is [ceil(K / 2), BF_NR, 2] bfloat16, each 32-bit lane the
// pair (k, k + 1) of one column (VDPBF16PS's operand layout), zero-padded past N and K. A register tile of BF_MR rows x
// BF_NR columns (24 zmm accumulators) broadcasts each row's pair of x and does one VDPBF16PS per 16 columns: every
// output element is one chain over the k pairs in order, whatever the tile or thread count (the same bits at any M).
// While a panel's row tiles run, they prefetch the next panel into L2 (as the float32 GEMM, gemm.cpp).

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 10 || defined(__clang__))
#include <immintrin.h>
#define LOOM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define LOOM_HAVE_BF16_GEMM 1
#else
#define LOOM_HAVE_BF16_GEMM 0
#endif

namespace {

constexpr int64_t BF_NR = 48;
constexpr int BF_MR = 8;

#if LOOM_HAVE_BF16_GEMM

// 16 float32 lanes rounded to bfloat16, nearest even (VCVTNEPS2BF16: NaN stays NaN)
LOOM_BF16_TARGET inline void bf_store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

template <int R>
LOOM_BF16_TARGET inline void bf_tile(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t K, void* C,
                                     int64_t ldc, bool out_f32, int64_t nc, const float* bias, const char* pf,
                                     int64_t pf_lines) {
  __m512 c[R][3];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 3; ++v) c[i][v] = _mm512_setzero_ps();
  const int64_t K2 = K / 2;  // whole pairs; an odd K's last column below
  int64_t k2 = 0;
  for (; k2 < K2; ++k2) {
    if (k2 < pf_lines) _mm_prefetch(pf + 64 * k2, _MM_HINT_T1);  // a panel row of pairs is 3 lines: 1 of them a k2
    const uint16_t* b = B + 2 * BF_NR * k2;
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b)),
                   b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 32)),
                   b2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 64));
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, A + i * lda + 2 * k2, 4);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      c[i][0] = _mm512_dpbf16_ps(c[i][0], a, b0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], a, b1);
      c[i][2] = _mm512_dpbf16_ps(c[i][2], a, b2);
    }
  }
  if (K & 1) {  // the pair (K - 1, pad): x's half past the row is zero, not read
    const uint16_t* b = B + 2 * BF_NR * K2;
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b)),
                   b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 32)),
                   b2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 64));
    for (int i = 0; i < R; ++i) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int32_t(A[i * lda + K - 1])));
      c[i][0] = _mm512_dpbf16_ps(c[i][0], a, b0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], a, b1);
      c[i][2] = _mm512_dpbf16_ps(c[i][2], a, b2);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) float tmp[BF_NR];
    for (int v = 0; v < 3; ++v) {
      const __m512 r = bias ? _mm512_add_ps(c[i][v], _mm512_loadu_ps(bias + 16 * v)) : c[i][v];
      if (nc == BF_NR) {
        if (out_f32)
          _mm512_storeu_ps(static_cast<float*>(C) + i * ldc + 16 * v, r);
        else
          bf_store16(static_cast<uint16_t*>(C) + i * ldc + 16 * v, r);
      } else {
        _mm512_store_ps(tmp + 16 * v, r);
      }
    }
    if (nc < BF_NR) {  // the last panel's columns: bias was added over the padded width (zero-padded below)
      alignas(64) uint16_t h[BF_NR];
      if (out_f32) {
        std::memcpy(static_cast<float*>(C) + i * ldc, tmp, nc * sizeof(float));
      } else {
        for (int v = 0; v < 3; ++v) bf_store16(h + 16 * v, _mm512_load_ps(tmp + 16 * v));
        std::memcpy(static_cast<uint16_t*>(C) + i * ldc, h, nc * sizeof(uint16_t));
      }
    }
  }
}

// panel p over rows [0, M): its row tiles, each prefetching a share of the next panel
LOOM_BF16_TARGET void bf_panel(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                               int64_t p, const float* bias, void* C, int64_t ldc, bool out_f32) {
  const int64_t P = (N + BF_NR - 1) / BF_NR, K2 = (K + 1) / 2, panel_lines = (K2 * BF_NR * 4 + 63) / 64;
  const int64_t tiles = (M + BF_MR - 1) / BF_MR, per_tile = (panel_lines + tiles - 1) / tiles;
  const uint16_t* B = Bp + p * K2 * BF_NR * 2;
  const char* next = reinterpret_cast<const char*>(p + 1 < P ? B + K2 * BF_NR * 2 : B);
  const int64_t nc = std::min(BF_NR, N - p * BF_NR);
  const float* bp = bias ? bias + p * BF_NR : nullptr;
  const int64_t esz = out_f32 ? 4 : 2;
  for (int64_t t = 0, m = 0; m < M; ++t, m += BF_MR) {
    const int64_t lo = std::min(panel_lines, t * per_tile), n = std::min(panel_lines, lo + per_tile) - lo;
    const uint16_t* a = A + m * lda;
    void* c = static_cast<char*>(C) + (m * ldc + p * BF_NR) * esz;
    const char* pf = next + 64 * lo;
    switch (std::min<int64_t>(BF_MR, M - m)) {
      case 1: bf_tile<1>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n); break;
      case 2: bf_tile<2>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n); break;
      case 3: bf_tile<3>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n); break;
      case 4: bf_tile<4>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n); break;
      case 5: bf_tile<5>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n); break;
      case 6: bf_tile<6>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n); break;
      case 7: bf_tile<7>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n); break;
      default: bf_tile<8>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n); break;
    }
  }
}

// a thread's contiguous share of the panels
LOOM_BF16_TARGET void bf_panels(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                                const float* bias, void* C, int64_t ldc, bool out_f32, int t, int nt) {
  const int64_t P = (N + BF_NR - 1) / BF_NR, p0 = P * t / nt, p1 = P * (t + 1) / nt;
  for (int64_t p = p0; p < p1; ++p) bf_panel(A, lda, M, K, Bp, N, p, bias, C, ldc, out_f32);
}

#endif

// The product on a CPU without avx512_bf16, an element at a time in VDPBF16PS's documented order (each pair's odd
// term, then its even one: exact products added in float32, rounded to nearest even; no denormal flushing): loom's
// bfloat16 paths, which the tests compare with each other bit for bit, run on any x86 test host. Not a serving path:
// kernels/cpu_linear.py takes loom's bfloat16 GEMM only where the CPU has avx512_bf16.
void bf_gemm_plain(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                   const float* bias, void* C, int64_t ldc, bool out_f32, int nthreads) {
  const int64_t K2 = (K + 1) / 2;
#pragma omp parallel for num_threads(std::max<int64_t>(1, std::min<int64_t>(nthreads, N)))
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t* B = Bp + ((n / BF_NR) * K2 * BF_NR + n % BF_NR) * 2;  // column n's pair at k2: B + 2 BF_NR k2
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* a = A + m * lda;
      float acc = 0.f;
      for (int64_t k2 = 0; k2 < K2; ++k2) {
        const uint16_t* b = B + 2 * BF_NR * k2;
        const float odd = 2 * k2 + 1 < K ? to_f32(bf16_t{a[2 * k2 + 1]}) : 0.f;  // past an odd K: x's zero half
        acc += odd * to_f32(bf16_t{b[1]});
        acc += to_f32(bf16_t{a[2 * k2]}) * to_f32(bf16_t{b[0]});
      }
      const float r = bias ? acc + bias[n] : acc;
      if (out_f32)
        static_cast<float*>(C)[m * ldc + n] = r;
      else
        static_cast<bf16_t*>(C)[m * ldc + n] = to_bf16(r);
    }
  }
}

}  // namespace

extern "C" {

// 1 where the library has loom_gemm_bf16 (the compiler takes avx512_bf16 code); the CPU's flags decide the rest
int64_t loom_gemm_bf16_built() { return LOOM_HAVE_BF16_GEMM; }

int64_t loom_gemm_bf16_panel_width() { return BF_NR; }

// W [N, K] bfloat16 row-major -> panels [ceil(N / BF_NR), ceil(K / 2), BF_NR, 2] (any CPU)
void loom_gemm_bf16_pack(const uint16_t* W, int64_t N, int64_t K, uint16_t* Bp) {
  const int64_t P = (N + BF_NR - 1) / BF_NR, K2 = (K + 1) / 2;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t k2 = 0; k2 < K2; ++k2)
      for (int64_t j = 0; j < BF_NR; ++j)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t n = p * BF_NR + j, k = 2 * k2 + h;
          Bp[((p * K2 + k2) * BF_NR + j) * 2 + h] = n < N && k < K ? W[n * K + k] : uint16_t(0);
        }
}

// y [M, N] (row stride ldc, bfloat16, or float32 with out_f32) = x [M, K] bfloat16 (row stride lda) @ W^T + bias
// (float32, nullable), W packed by loom_gemm_bf16_pack; parallel over panels. On a CPU without avx512_bf16 (or a
// build without it), bf_gemm_plain: slow, for tests.
void loom_gemm_bf16(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                    const float* bias, void* C, int64_t ldc, int out_f32, int nthreads) {
  if (M <= 0) return;
#if LOOM_HAVE_BF16_GEMM
  if (__builtin_cpu_supports("avx512bf16")) {
    const int64_t P = (N + BF_NR - 1) / BF_NR;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(nthreads, P)))
    bf_panels(A, lda, M, K, Bp, N, bias, C, ldc, out_f32 != 0, omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#endif
  bf_gemm_plain(A, lda, M, K, Bp, N, bias, C, ldc, out_f32 != 0, nthreads);
}

}  // extern "C"
