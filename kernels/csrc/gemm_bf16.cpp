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
                                     int64_t pf_lines, const char* q = nullptr, int64_t q_lines = 0) {
  __m512 c[R][3];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 3; ++v) c[i][v] = _mm512_setzero_ps();
  const int64_t K2 = K / 2;  // whole pairs; an odd K's last column below
  int64_t k2 = 0;
  for (; k2 < K2; ++k2) {
    if (k2 < pf_lines) _mm_prefetch(pf + 64 * k2, _MM_HINT_T1);  // a panel row of pairs is 3 lines: 1 of them a k2
    if (k2 < q_lines) _mm_prefetch(q + 64 * k2, _MM_HINT_T1);  // bf_gemm_pass's adapter rows
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

// The fused LoRA groups' deltas (LoraEpilogue, float32) on a bfloat16 GEMM's output tiles, each while it is in L1: a
// tile's rows of those groups' tokens widened into the thread's scratch (exact), their deltas added as the float32
// epilogue adds them, rounded back - each such row as run_pass_bf16 makes it (its output rounded, widened, the float32
// pass's delta added, rounded once more); rows of no such group are not touched.
struct BfLora {
  const LoraEpilogue& lora;
  float* buf;  // [BF_MR, N], the thread's

  void apply(bf16_t* C, int64_t ldc, int64_t N, int64_t m, int64_t mr, int64_t c0, int64_t c1) const {
    bool any = false;
    for (int64_t i = 0; i < mr; ++i) any = any || lora.group[m + i] >= 0;
    if (!any) return;
    for (int64_t i = 0; i < mr; ++i)
      if (lora.group[m + i] >= 0) widen(C + (m + i) * ldc + c0, buf + i * N + c0, c1 - c0);
    lora.apply(buf, N, N, m, mr, c0, c1, m);
    for (int64_t i = 0; i < mr; ++i)
      if (lora.group[m + i] >= 0) narrow(buf + i * N + c0, C + (m + i) * ldc + c0, c1 - c0);
  }
};

// panel p over rows [0, M): its row tiles, each prefetching a share of the next panel and (ahead: nullable) up to
// a line a k of what it lists; lora (nullable, bfloat16 output only): the fused groups' deltas on each tile
LOOM_BF16_TARGET void bf_panel(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                               int64_t p, const float* bias, void* C, int64_t ldc, bool out_f32,
                               PassFetch* ahead = nullptr, const BfLora* lora = nullptr) {
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
    const auto [q, qn] = ahead ? ahead->take(K / 2) : std::pair<const char*, int64_t>{nullptr, 0};
    switch (std::min<int64_t>(BF_MR, M - m)) {
      case 1: bf_tile<1>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, q, qn); break;
      case 2: bf_tile<2>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, q, qn); break;
      case 3: bf_tile<3>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, q, qn); break;
      case 4: bf_tile<4>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, q, qn); break;
      case 5: bf_tile<5>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, q, qn); break;
      case 6: bf_tile<6>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, q, qn); break;
      case 7: bf_tile<7>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, q, qn); break;
      default: bf_tile<8>(a, lda, B, K, c, ldc, out_f32, nc, bp, pf, n, q, qn); break;
    }
    if (lora)
      lora->apply(static_cast<bf16_t*>(C), ldc, N, m, std::min<int64_t>(BF_MR, M - m), p * BF_NR, p * BF_NR + nc);
  }
}

// a thread's contiguous share of the panels
LOOM_BF16_TARGET void bf_panels(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                                const float* bias, void* C, int64_t ldc, bool out_f32, int t, int nt) {
  const int64_t P = (N + BF_NR - 1) / BF_NR, p0 = P * t / nt, p1 = P * (t + 1) / nt;
  for (int64_t p = p0; p < p1; ++p) bf_panel(A, lda, M, K, Bp, N, p, bias, C, ldc, out_f32);
}

// A decode step's LoRA (groups under fuse_min tokens) in the bfloat16 GEMM, as gemm_with_pass (float32): the pass's
// items (a token's shrink and expand, in float32 on its widened x row, each token's delta kept in scratch) interleaved
// with the GEMM's panels on every thread, the tiles asking for the rows of the items their thread runs next
// (PassFetch), the items running between two panels from cache; then each token's output row widened, its delta added
// (lora_combine) and rounded once: bitwise the GEMM, then run_pass_bf16. A line a k: two ran the GEMM's tiles into
// memory stalls and left the items' rows not yet there. 32 tokens on 32 rank-16 adapters, all linears of the default
// model, bfloat16 pools, one thread (thread CPU time, libraries alternating in one process, load 3-5 from other
// work), GEMMs alone 15.5 ms: deltas added to each output tile after the shrink, rows unfetched 55.7 ms; those rows
// prefetched 39-40; this 27.6-28.5 (two lines a k 35.4, a line every 2-3 k 30-32).
LOOM_BF16_TARGET void bf_gemm_pass(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp,
                                   int64_t N, const float* bias, bf16_t* C, int64_t ldc, const Pools& pools,
                                   const int64_t* offs, const int64_t* tok, const int32_t* seg, const int32_t* rows,
                                   const int32_t* ranks, const float* scal, int64_t G, int nthreads) {
  const int64_t first = seg[0], n = seg[G] - first, P = (N + BF_NR - 1) / BF_NR;
  std::unique_ptr<float[]> xw(new float[n * K]), delta(new float[seg[G] * N]);  // delta: row i for tok[i]
  std::vector<int64_t> idx(first + n);  // the pass's token indices: token tok[i]'s row of xw
  for (int64_t i = first; i < first + n; ++i) {
    idx[i] = i - first;
    widen(reinterpret_cast<const bf16_t*>(A) + tok[i] * lda, xw.get() + (i - first) * K, K);
  }
  const LoraPass pass{xw.get(), K, pools, offs, nullptr, 0, idx.data(), seg, rows, ranks, scal, G,
                      LoraItems(seg, ranks, G, nthreads)};
  const int64_t n_items = pass.items.size();
  std::atomic<int64_t> next_panel{0}, next_item{0};
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(nthreads, P)))
  {
    LoraPass::Scratch sc(pass);
    PassFetch pf(pass, next_item, 1);
    for (int64_t p; (p = next_panel.fetch_add(1, std::memory_order_relaxed)) < P;) {
      pf.run_ready(sc, delta.get(), N);
      bf_panel(A, lda, M, K, Bp, N, p, bias, C, ldc, false, &pf);
    }
    pf.run_ready(sc, delta.get(), N, true);
    for (int64_t w; (w = next_item.fetch_add(1, std::memory_order_relaxed)) < n_items;)
      pass.run<true>(w, sc, delta.get(), N);
    keep(sc.sink);
    const std::unique_ptr<float[]> yw(new float[N]);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < G; ++g) {
      if (ranks[g] <= 0) continue;
      for (int64_t i = seg[g]; i < seg[g + 1]; ++i) {
        bf16_t* y = C + tok[i] * ldc;
        widen(y, yw.get(), N);
        lora_combine(yw.get(), delta.get() + i * N, offs, pools.S, scal[g]);
        narrow(yw.get(), y, N);
      }
    }
  }
}

// gemm_bf16_fused's GEMM: the fused groups' shrink (over x's bfloat16 rows, widened as read) shared out first, then
// every thread's panels with their deltas on each tile (BfLora)
LOOM_BF16_TARGET void bf_gemm_fused(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp,
                                    int64_t N, const float* bias, bf16_t* C, int64_t ldc, const LoraEpilogue& lora,
                                    int nthreads) {
  const int64_t P = (N + BF_NR - 1) / BF_NR;
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, P)));
#pragma omp parallel num_threads(nt)
  {
    // its omp for ends in a barrier: every coefficient is there
    lora.shrink(reinterpret_cast<const bf16_t*>(A), lda, K, 0, M, shrink_chunk(M, nt));
    const std::unique_ptr<float[]> buf(new float[BF_MR * N]);
    const BfLora bl{lora, buf.get()};
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int64_t p = P * t / T; p < P * (t + 1) / T; ++p)
      bf_panel(A, lda, M, K, Bp, N, p, bias, C, ldc, false, nullptr, &bl);
  }
}

#endif

// The product on a CPU without avx512_bf16, an element at a time in VDPBF16PS's documented order (each pair's odd
// term, then its even one: exact products added in float32, rounded to nearest even; no denormal flushing): loom's
// bfloat16 paths, which the tests compare with each other bit for bit, run on any x86 test host. Not a serving path:
// kernels/cpu_linear.py takes loom's bfloat16 GEMM only where the CPU has avx512_bf16.
void bf_gemm_plain(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                   const float* bias, void* C, int64_t ldc, bool out_f32, int nthreads) {
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
  }
}

// loom_gemm_bf16's work
void gemm_bf16(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N, const float* bias,
               void* C, int64_t ldc, bool out_f32, int nthreads) {
  if (M <= 0) return;
#if LOOM_HAVE_BF16_GEMM
  if (__builtin_cpu_supports("avx512bf16")) {
    const int64_t P = (N + BF_NR - 1) / BF_NR;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(nthreads, P)))
    bf_panels(A, lda, M, K, Bp, N, bias, C, ldc, out_f32, omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#endif
  bf_gemm_plain(A, lda, M, K, Bp, N, bias, C, ldc, out_f32, nthreads);
}

// the GEMM with a decode step's LoRA groups (all under fuse_min tokens): bf_gemm_pass, or on a CPU without
// avx512_bf16 the GEMM, then the pass
void gemm_bf16_pass(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                    const float* bias, bf16_t* C, int64_t ldc, const Pools& pools, const int64_t* offs,
                    const int64_t* tok, const int32_t* seg, const int32_t* rows, const int32_t* ranks,
                    const float* scal, int64_t G, int nthreads) {
  if (M <= 0) return;
#if LOOM_HAVE_BF16_GEMM
  if (G > 0 && seg[G] > seg[0] && __builtin_cpu_supports("avx512bf16")) {
    bf_gemm_pass(A, lda, M, K, Bp, N, bias, C, ldc, pools, offs, tok, seg, rows, ranks, scal, G, nthreads);
    return;
  }
#endif
  gemm_bf16(A, lda, M, K, Bp, N, bias, C, ldc, false, nthreads);
  run_pass_bf16(reinterpret_cast<const bf16_t*>(A), lda, pools, offs, C, ldc, tok, seg, rows, ranks, scal, G,
                nthreads);
}

// The bfloat16 GEMM with a step's LoRA groups where some have at least fuse_min tokens (a prefill chunk, many decode
// tokens on one adapter: the C++ layer's): those groups' deltas added to the GEMM's output tiles while they are in L1
// (FusedLora over their x rows widened to float32, as run_pass_bf16 widens them; BfLora), the other groups' pass after
// (run_pass_bf16). Bitwise the GEMM, then run_pass_bf16 over every group: a token's row gets its own group's delta
// only, and the float32 epilogue adds it as the float32 pass does (loom_gemm_lora). On a CPU without avx512_bf16,
// the GEMM, then that pass.
void gemm_bf16_fused(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                     const float* bias, bf16_t* C, int64_t ldc, const Pools& pools, const int64_t* offs,
                     const int64_t* tok, const int32_t* seg, const int32_t* rows, const int32_t* ranks,
                     const float* scal, int64_t G, int64_t fuse_min, int nthreads) {
  if (M <= 0) return;
  const auto* x = reinterpret_cast<const bf16_t*>(A);
#if LOOM_HAVE_BF16_GEMM
  if (__builtin_cpu_supports("avx512bf16")) {
    const GroupSplit split(tok, seg, rows, ranks, scal, G, fuse_min);
    const FusedLora fused(split.big, pools, offs, M, nthreads);
    if (fused.get()) {
      bf_gemm_fused(A, lda, M, K, Bp, N, bias, C, ldc, fused.ep, nthreads);
      const GroupSplit::Part& sm = split.small;
      if (sm.groups())
        run_pass_bf16(x, lda, pools, offs, C, ldc, sm.tok.data(), sm.seg.data(), sm.rows.data(), sm.ranks.data(),
                      sm.scal.data(), sm.groups(), nthreads);
      return;
    }
  }
#endif
  gemm_bf16(A, lda, M, K, Bp, N, bias, C, ldc, false, nthreads);
  run_pass_bf16(x, lda, pools, offs, C, ldc, tok, seg, rows, ranks, scal, G, nthreads);
}

// The bfloat16 GEMM with a step's LoRA groups (the C++ layer's linears, loom_gemm_bf16_lora): all under fuse_min
// tokens (decode), their pass items interleaved with the panels (gemm_bf16_pass); else the larger groups' deltas in
// the output tiles and the others' pass after (gemm_bf16_fused). Bitwise loom_gemm_bf16 followed by
// loom_lora_apply_bf16 either way. Prefill with adapters, bfloat16, the default model, 8 prompts of 512 tokens on one
// adapter (8 distinct), two threads, alternating rounds in one process: the LoRA added 485 (485) ms to the 1.5 s of the
// prompts without adapters as the GEMM, then the pass; 248 (256) fused.
void gemm_bf16_lora(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                    const float* bias, bf16_t* C, int64_t ldc, const Pools& pools, const int64_t* offs,
                    const int64_t* tok, const int32_t* seg, const int32_t* rows, const int32_t* ranks,
                    const float* scal, int64_t G, int64_t fuse_min, int nthreads) {
  bool small = true;
  for (int64_t g = 0; g < G; ++g) small = small && seg[g + 1] - seg[g] < fuse_min;
  if (small)
    gemm_bf16_pass(A, lda, M, K, Bp, N, bias, C, ldc, pools, offs, tok, seg, rows, ranks, scal, G, nthreads);
  else
    gemm_bf16_fused(A, lda, M, K, Bp, N, bias, C, ldc, pools, offs, tok, seg, rows, ranks, scal, G, fuse_min, nthreads);
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

// C [M, N] bfloat16 = loom_gemm_bf16's product plus each adapter token's LoRA delta (gemm_bf16_lora: the C++ layer's
// linears, groups of at least fuse_min tokens fused into the output tiles); pools and groups as loom_lora_apply_bf16
// takes them, N their width. Bitwise loom_gemm_bf16 followed by loom_lora_apply_bf16.
void loom_gemm_bf16_lora(const uint16_t* A, int64_t lda, int64_t M, int64_t K, const uint16_t* Bp, int64_t N,
                         const float* bias, bf16_t* C, int64_t ldc, const void* a, int dt, int64_t S, int64_t R,
                         int64_t ak, const void* b, int64_t bn, const int64_t* offs, const int64_t* tok,
                         const int32_t* seg, const int32_t* rows, const int32_t* ranks, const float* scal, int64_t G,
                         int64_t fuse_min, int nthreads) {
  gemm_bf16_lora(A, lda, M, K, Bp, N, bias, C, ldc, Pools{a, b, dt, S, R, K, N, ak, bn}, offs, tok, seg, rows, ranks,
                 scal, G, fuse_min, nthreads);
}

}  // extern "C"
