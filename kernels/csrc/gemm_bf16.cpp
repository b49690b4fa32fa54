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

// A decode step's LoRA in the bfloat16 GEMM (the C++ layer's linears): each adapter token's shrink first (coef), then
// each output tile's rows get their deltas right after the tile stored them, while they are in L1, instead of a pass
// over y after the GEMM. Bitwise run_pass_bf16 on the GEMM's output: the rounded output widened, expand_row's
// arithmetic (expand_tile's, column for column), rounded once. The rows come from memory in short strided streams the
// hardware prefetcher does not follow, so they are asked for ahead: the shrink's next 8 rank rows while a block runs,
// and the next panel's B lines of a tile's rows while the GEMM computes that tile (32 tokens on 32 rank-16 adapters,
// all linears of the default model, one thread, bfloat16 pools, A/B in one process: 54.2 -> 38.8 ms, GEMMs alone 14.6).
struct Bf16LoraEpilogue {
  Pools pools;
  const int64_t* offs;
  const int32_t *rows, *ranks;
  const float* scal;
  int64_t rank_pad = 0, ld = 0;  // coef: ld floats a token, slice s's rank products from s * rank_pad
  std::vector<float> coef;       // by row of y
  std::vector<int32_t> group;    // y row -> its group, -1: none

  Bf16LoraEpilogue(const bf16_t* x, int64_t xs, int64_t M, const Pools& p, const int64_t* offs_, const int64_t* tok,
                   const int32_t* seg, const int32_t* rows_, const int32_t* ranks_, const float* scal_, int64_t G,
                   int nthreads)
      : pools(p), offs(offs_), rows(rows_), ranks(ranks_), scal(scal_), group(M, -1) {
    int64_t max_rank = 0, tile = 1;  // tile: the most tokens shrunk together (a decode step: one or two)
    for (int64_t g = 0; g < G; ++g) {
      if (ranks[g] <= 0) continue;
      max_rank = std::max<int64_t>(max_rank, ranks[g]);
      tile = std::min<int64_t>(LORA_MAX_TILE, std::max<int64_t>(tile, seg[g + 1] - seg[g]));
      for (int64_t t = seg[g]; t < seg[g + 1]; ++t) group[tok[t]] = int32_t(g);
    }
    rank_pad = (max_rank + 3) / 4 * 4;
    ld = p.S * rank_pad;
    coef.resize(M * ld);
    const int64_t K = p.K;
    const int nth = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, G)));
#pragma omp parallel num_threads(nth)
    {
      std::unique_ptr<float[]> xw(new float[tile * K]), cf(new float[tile * ld]);
      const float* xr[LORA_MAX_TILE];
      // a thread's groups: those starting in its share of the tokens, in order, so that each block of rank rows asks
      // for the next one's rows while it computes (rows_ahead: this group's rows after its first block, then the
      // next group's first block)
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      const int64_t lo = seg[0] + (seg[G] - seg[0]) * t / n, hi = seg[0] + (seg[G] - seg[0]) * (t + 1) / n;
      const auto next_group = [&](int64_t g) {
        for (++g; g < G && seg[g] < hi; ++g)
          if (ranks[g] > 0) return g;
        return int64_t(-1);
      };
      int64_t g = 0;
      while (g < G && (seg[g] < lo || ranks[g] <= 0)) ++g;
      for (; g >= 0 && g < G && seg[g] < hi; g = next_group(g)) {
        const int64_t rk = ranks[g], gn = next_group(g);
        with_type(p.dt, [&](auto tag) {
          using T = decltype(tag);
          const int64_t es = sizeof(T), first = std::min<int64_t>(rk, 8);
          Ahead ah;
          ah.add(p.a_rows<T>(0, rows[g] + first), (rk - first) * p.ak * es);
          for (int64_t s = 1; s < p.S; ++s) ah.add(p.a_rows<T>(s, rows[g]), rk * p.ak * es);
          if (gn >= 0) ah.add(p.a_rows<T>(0, rows[gn]), std::min<int64_t>(ranks[gn], 8) * p.ak * es);
          for (int64_t t0 = seg[g]; t0 < seg[g + 1]; t0 += tile) {
            const int64_t nt = std::min<int64_t>(tile, seg[g + 1] - t0);
            for (int64_t i = 0; i < nt; ++i) {
              widen(x + tok[t0 + i] * xs, xw.get() + i * K, K);
              xr[i] = xw.get() + i * K;
            }
            for (int64_t s = 0; s < p.S; ++s)
              shrink_tile(xr, nt, InPool<T>{p.a_rows<T>(s, rows[g]), p.ak, rk}, K, rk, cf.get() + s * rank_pad, ld,
                          false, nullptr, 0, &ah);
            for (int64_t i = 0; i < nt; ++i)
              std::memcpy(coef.data() + tok[t0 + i] * ld, cf.get() + i * ld, ld * sizeof(float));
          }
        });
      }
    }
  }

  // the cache lines of B that apply(m, mr, c0, c1) reads (up to cap of them, to out): the GEMM's tile before asks for
  // them while it computes
  int64_t b_lines(int64_t m, int64_t mr, int64_t c0, int64_t c1, const char** out, int64_t cap) const {
    int64_t n = 0;
    const int64_t es = type_bytes(pools.dt);
    for (int64_t t = m; t < m + mr; ++t) {
      const int32_t g = group[t];
      if (g < 0 || (t > m && g == group[t - 1])) continue;  // the row before's lines already
      const char* b = static_cast<const char*>(pools.b) + rows[g] * pools.bn * es;
      for (int64_t r = 0; r < ranks[g]; ++r) {
        const uintptr_t p0 = reinterpret_cast<uintptr_t>(b + (r * pools.bn + c0) * es) & ~uintptr_t(63),
                        p1 = reinterpret_cast<uintptr_t>(b + (r * pools.bn + c1) * es);
        for (uintptr_t q = p0; q < p1 && n < cap; q += 64) out[n++] = reinterpret_cast<const char*>(q);
      }
    }
    return n;
  }

  // rows [m, m + mr) of y, columns [c0, c1) (at most BF_NR), just stored by the GEMM: each adapter row's delta
  void apply(bf16_t* y, int64_t ldy, int64_t m, int64_t mr, int64_t c0, int64_t c1) const {
    float tmp[BF_NR];
    for (int64_t t = m; t < m + mr; ++t) {
      const int32_t g = group[t];
      if (g < 0) continue;
      bf16_t* yr = y + t * ldy + c0;
      widen(yr, tmp, c1 - c0);
      with_type(pools.dt, [&](auto tag) {
        using T = decltype(tag);
        const T* b = pools.b_rows<T>(rows[g]) + c0;  // column c of the tile: tmp[c - c0], b[c - c0]
        for (int64_t s = 0; s < pools.S; ++s) {
          const int64_t lo = std::max(c0, offs[s]), hi = std::min(c1, offs[s + 1]);
          if (lo >= hi) continue;
          const int64_t vec_end = offs[s] + (offs[s + 1] - offs[s]) / 16 * 16;  // as expand_tile: 16 at a time
          expand_row(tmp, coef.data() + t * ld + s * rank_pad, b, pools.bn, ranks[g], scal[g], lo - c0, hi - c0,
                     vec_end - c0);
        }
      });
      narrow(tmp, yr, c1 - c0);
    }
  }
};

#if LOOM_HAVE_BF16_GEMM

// 16 float32 lanes rounded to bfloat16, nearest even (VCVTNEPS2BF16: NaN stays NaN)
LOOM_BF16_TARGET inline void bf_store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

template <int R>
LOOM_BF16_TARGET inline void bf_tile(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t K, void* C,
                                     int64_t ldc, bool out_f32, int64_t nc, const float* bias, const char* pf,
                                     int64_t pf_lines, const char* const* lines = nullptr, int64_t n_lines = 0) {
  __m512 c[R][3];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 3; ++v) c[i][v] = _mm512_setzero_ps();
  const int64_t K2 = K / 2;  // whole pairs; an odd K's last column below
  int64_t k2 = 0;
  for (; k2 < K2; ++k2) {
    if (k2 < pf_lines) _mm_prefetch(pf + 64 * k2, _MM_HINT_T1);  // a panel row of pairs is 3 lines: 1 of them a k2
    if (2 * k2 < n_lines) {  // the epilogue's next B lines, two a k2
      _mm_prefetch(lines[2 * k2], _MM_HINT_T1);
      if (2 * k2 + 1 < n_lines) _mm_prefetch(lines[2 * k2 + 1], _MM_HINT_T1);
    }
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
                               int64_t p, const float* bias, void* C, int64_t ldc, bool out_f32,
                               const Bf16LoraEpilogue* ep, bool next_ep) {
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
    // the epilogue's B lines for this tile's rows in the next panel (this thread's, next_ep)
    const char* bl[512];
    const int64_t nbl = next_ep ? ep->b_lines(m, std::min<int64_t>(BF_MR, M - m), (p + 1) * BF_NR,
                                              std::min(N, (p + 2) * BF_NR), bl, 512) : 0;
    switch (std::min<int64_t>(BF_MR, M - m)) {
      case 1: bf_tile<1>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, bl, nbl); break;
      case 2: bf_tile<2>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, bl, nbl); break;
      case 3: bf_tile<3>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, bl, nbl); break;
      case 4: bf_tile<4>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, bl, nbl); break;
      case 5: bf_tile<5>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, bl, nbl); break;
      case 6: bf_tile<6>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, bl, nbl); break;
      case 7: bf_tile<7>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, bl, nbl); break;
      default: bf_tile<8>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, bl, nbl); break;
    }
    if (ep) ep->apply(static_cast<bf16_t*>(C), ldc, m, std::min<int64_t>(BF_MR, M - m), p * BF_NR, p * BF_NR + nc);
  }
}

// a thread's contiguous share of the panels
LOOM_BF16_TARGET void bf_panels(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                                const float* bias, void* C, int64_t ldc, bool out_f32, int t, int nt,
                                const Bf16LoraEpilogue* ep) {
  const int64_t P = (N + BF_NR - 1) / BF_NR, p0 = P * t / nt, p1 = P * (t + 1) / nt;
  for (int64_t p = p0; p < p1; ++p) bf_panel(A, lda, M, K, Bp, N, p, bias, C, ldc, out_f32, ep, ep && p + 1 < p1);
}

#endif

// The product on a CPU without avx512_bf16, an element at a time in VDPBF16PS's documented order (each pair's odd
// term, then its even one: exact products added in float32, rounded to nearest even; no denormal flushing): loom's
// bfloat16 paths, which the tests compare with each other bit for bit, run on any x86 test host. Not a serving path:
// kernels/cpu_linear.py takes loom's bfloat16 GEMM only where the CPU has avx512_bf16.
void bf_gemm_plain(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                   const float* bias, void* C, int64_t ldc, bool out_f32, int nthreads, const Bf16LoraEpilogue* ep) {
  const int64_t K2 = (K + 1) / 2, P = (N + BF_NR - 1) / BF_NR;
#pragma omp parallel for num_threads(std::max<int64_t>(1, std::min<int64_t>(nthreads, P)))
  for (int64_t p = 0; p < P; ++p) {
    const int64_t c1 = std::min(N, (p + 1) * BF_NR);
    for (int64_t n = p * BF_NR; n < c1; ++n) {
      const uint16_t* B = Bp + (p * K2 * BF_NR + n % BF_NR) * 2;  // column n's pair at k2: B + 2 BF_NR k2
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
    if (ep) ep->apply(static_cast<bf16_t*>(C), ldc, 0, M, p * BF_NR, c1);
  }
}

// loom_gemm_bf16's work; ep (nullable, bfloat16 output only): the LoRA deltas added to each output tile
void gemm_bf16(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N, const float* bias,
               void* C, int64_t ldc, bool out_f32, int nthreads, const Bf16LoraEpilogue* ep = nullptr) {
  if (M <= 0) return;
#if LOOM_HAVE_BF16_GEMM
  if (__builtin_cpu_supports("avx512bf16")) {
    const int64_t P = (N + BF_NR - 1) / BF_NR;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(nthreads, P)))
    bf_panels(A, lda, M, K, Bp, N, bias, C, ldc, out_f32, omp_get_thread_num(), omp_get_num_threads(), ep);
    return;
  }
#endif
  bf_gemm_plain(A, lda, M, K, Bp, N, bias, C, ldc, out_f32, nthreads, ep);
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
  gemm_bf16(A, lda, M, K, Bp, N, bias, C, ldc, out_f32 != 0, nthreads);
}

// C [M, N] bfloat16 = loom_gemm_bf16's product, each adapter token's LoRA delta added to its output tiles as they are
// stored (Bf16LoraEpilogue: the C++ layer's decode linears); pools and groups as loom_lora_apply_bf16 takes them, N
// their width. Bitwise loom_gemm_bf16 followed by loom_lora_apply_bf16.
void loom_gemm_bf16_lora(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                         const float* bias, bf16_t* C, int64_t ldc, const void* a, int dt, int64_t S, int64_t R,
                         int64_t ak, const void* b, int64_t bn, const int64_t* offs, const int64_t* tok,
                         const int32_t* seg, const int32_t* rows, const int32_t* ranks, const float* scal, int64_t G,
                         int nthreads) {
  const Bf16LoraEpilogue ep(reinterpret_cast<const bf16_t*>(A), lda, M, Pools{a, b, dt, S, R, K, N, ak, bn}, offs, tok,
                            seg, rows, ranks, scal, G, nthreads);
  gemm_bf16(A, lda, M, K, Bp, N, bias, C, ldc, false, nthreads, &ep);
}

}  // extern "C"
