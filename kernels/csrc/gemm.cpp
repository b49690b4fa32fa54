namespace {

// ---- GEMM for linear layers: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W packed once into panels of NR columns
// (panel p: K rows of W[NR p : NR p + NR] transposed, zero-padded), an MR x NR register tile: 4 x 24 (12 ymm
// accumulators) with AVX2, 8 x 48 (24 zmm) with AVX-512, twice the FMA width. Every output element is one fma chain
// over k in order whatever the tile, so both give the same bits.
// While a panel's row tiles run, they prefetch the next panel into L2, so streaming the weights from memory
// overlaps the FMAs instead of stalling the first tile of every panel.
#ifdef __AVX512F__
constexpr int64_t NR = 48;
constexpr int MR = 8;
#else
constexpr int64_t NR = 24;
constexpr int MR = 4;
#endif

#ifdef __AVX512F__
template <int R, bool AHEAD>
inline void gemm_tile(const float* A, int64_t lda, const float* B, int64_t K, float* C, int64_t ldc, int64_t nc,
                      const float* bias, const char* pf, int64_t pf_lines, const char* q, int64_t q_lines,
                      const char* q2, int64_t q2_lines) {
  __m512 c[R][3];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
    _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v) c[i][v] = _mm512_setzero_ps();
  const auto step = [&](int64_t k) __attribute__((always_inline)) {
    const __m512 b0 = _mm512_loadu_ps(B + NR * k), b1 = _mm512_loadu_ps(B + NR * k + 16),
                 b2 = _mm512_loadu_ps(B + NR * k + 32);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(A[i * lda + k]);
      c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
      c[i][2] = _mm512_fmadd_ps(a, b2, c[i][2]);
    }
  };
  // one prefetch per k (a 48-column panel row is 3 cache lines), two k per iteration
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    if (k < pf_lines) _mm_prefetch(pf + 64 * k, _MM_HINT_T1);
    if (k + 1 < pf_lines) _mm_prefetch(pf + 64 * (k + 1), _MM_HINT_T1);
    if constexpr (AHEAD) {
      if (k < q_lines) _mm_prefetch(q + 64 * k, _MM_HINT_T1);
      if (k + 1 < q_lines) _mm_prefetch(q + 64 * (k + 1), _MM_HINT_T1);
      if (k < q2_lines) _mm_prefetch(q2 + 64 * k, _MM_HINT_T1);
      if (k + 1 < q2_lines) _mm_prefetch(q2 + 64 * (k + 1), _MM_HINT_T1);
    }
    step(k);
    step(k + 1);
  }
  for (; k < K; ++k) step(k);
  if (nc == NR) {
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
      _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v)
        _mm512_storeu_ps(C + i * ldc + 16 * v,
                         bias ? _mm512_add_ps(c[i][v], _mm512_loadu_ps(bias + 16 * v)) : c[i][v]);
    return;
  }
  alignas(64) float tmp[NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
    _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v) _mm512_store_ps(tmp + 16 * v, c[i][v]);
    float* row = C + i * ldc;
    for (int64_t j = 0; j < nc; ++j) row[j] = bias ? tmp[j] + bias[j] : tmp[j];
  }
}
#elif defined(__AVX2__)
template <int MR, bool AHEAD>
inline void gemm_tile(const float* A, int64_t lda, const float* B, int64_t K, float* C, int64_t ldc, int64_t nc,
                      const float* bias, const char* pf, int64_t pf_lines, const char* q, int64_t q_lines,
                      const char* q2, int64_t q2_lines) {
  __m256 c[MR][3];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v) c[i][v] = _mm256_setzero_ps();
  // one k: the panel row's 3 vectors times MR broadcast values of A
  const auto step = [&](int64_t k) __attribute__((always_inline)) {
    const __m256 b0 = _mm256_loadu_ps(B + NR * k), b1 = _mm256_loadu_ps(B + NR * k + 8),
                 b2 = _mm256_loadu_ps(B + NR * k + 16);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(A + i * lda + k);
      c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
      c[i][2] = _mm256_fmadd_ps(a, b2, c[i][2]);
    }
  };
  // four k per iteration, one prefetch each: at one k per iteration the loop's own instructions (counter, prefetch
  // test) bring it close to the front end's limit; measured, its speed moved by up to 1.4x with its code alignment
  // and with other load on the core, and the four-k loop's did not move with its alignment
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    if ((k >> 2) < pf_lines) _mm_prefetch(pf + 64 * (k >> 2), _MM_HINT_T1);
    if constexpr (AHEAD) {
      if (k < q_lines)
        for (int j = 0; j < 4; ++j) _mm_prefetch(q + 64 * std::min<int64_t>(k + j, q_lines - 1), _MM_HINT_T1);
      if (k < q2_lines)
        for (int j = 0; j < 4; ++j) _mm_prefetch(q2 + 64 * std::min<int64_t>(k + j, q2_lines - 1), _MM_HINT_T1);
    }
    step(k);
    step(k + 1);
    step(k + 2);
    step(k + 3);
  }
  for (; k < K; ++k) step(k);
  if (nc == NR) {  // whole vectors: an epilogue that reads the tile back gets them forwarded from the stores
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
      _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v)
        _mm256_storeu_ps(C + i * ldc + 8 * v, bias ? _mm256_add_ps(c[i][v], _mm256_loadu_ps(bias + 8 * v)) : c[i][v]);
    return;
  }
  alignas(32) float tmp[NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
    _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v) _mm256_store_ps(tmp + 8 * v, c[i][v]);
    float* row = C + i * ldc;
    for (int64_t j = 0; j < nc; ++j) row[j] = bias ? tmp[j] + bias[j] : tmp[j];
  }
}
#else
template <int MR, bool>
inline void gemm_tile(const float* A, int64_t lda, const float* B, int64_t K, float* C, int64_t ldc, int64_t nc,
                      const float* bias, const char*, int64_t, const char*, int64_t, const char*, int64_t) {
  float c[MR][NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < MR; ++i)
      for (int64_t j = 0; j < NR; ++j) c[i][j] += A[i * lda + k] * B[NR * k + j];
  for (int i = 0; i < MR; ++i)
    for (int64_t j = 0; j < nc; ++j) C[i * ldc + j] = bias ? c[i][j] + bias[j] : c[i][j];
}
#endif

// The LoRA deltas a packed GEMM adds to its output tiles while they are in L1 (loom_gemm_lora): per token its group
// (-1: none) and its shrink coefficients (shrink, each row block's before its panels).
struct LoraEpilogue {
  // a group: its rows in the pools from row (B read in place, widened as loaded: exact), rank and scaling; its A rows
  // packed by pack_pair (its slices one after another), or (packed null) read in the pools
  struct Group {
    int64_t row, rank;
    float scale;
    const float* packed;
  };
  float* coef;
  int64_t coef_ld, rank_pad;
  const int64_t* offs;  // slice column offsets [pools.S + 1]
  Pools pools;
  std::vector<Group> groups;
  std::vector<int32_t> group;

  const Group* of(int64_t m) const { return group[m] < 0 ? nullptr : &groups[group[m]]; }

  // coef for rows [m0, m1), shared out by an omp for in the GEMM's parallel region, whose barrier comes before the
  // panels' epilogues read them: chunks of up to `chunk` rows, in each the runs of one adapter's rows. A long prefill
  // chunk's row block is read from memory here, once, and the panels then find it in L2, where a shrink over all rows
  // first read x from memory once more (2,048 tokens on one adapter, K 576, N 576, rank 16, one thread: that shrink
  // alone took 0.86 ms against 0.35 for its FLOPs at the GEMM's rate).
  //
  // The first slice's shrink asks for x rows a token block ahead (shrink_tile's fetch_x), the chunk's last block for
  // the first rows of the chunk this thread likely takes next (its thread count ahead): x has mostly left the
  // last-level cache since the layer's previous linear wrote it, and read on demand its lines stalled the shrink
  // (packed, 2,048 x 576 on three slices, one thread, the last-level cache flushed first: 1.09 -> 1.23 ms; 2,048 x
  // 1,536: 0.93 -> 1.26). The bench_lora setting, the same build with and without, rounds alternating in one process,
  // median adapter / no-LoRA ratio: one adapter, one thread 0.9461 -> 0.9507 (7 of 7 rounds), two 0.9487 -> 0.9494
  // (6 of 9); 32 distinct, two threads 0.8450 -> 0.8459; the same tokens.
  template <class X>
  void shrink(const X* A, int64_t lda, int64_t K, int64_t m0, int64_t m1, int64_t chunk) const {
    const X* xr[LORA_MAX_TILE];
    const int64_t n_chunks = (m1 - m0 + chunk - 1) / chunk, ahead = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t end = std::min(m1, m0 + (c + 1) * chunk);
      // the first token block of the chunk this thread likely takes next
      const int64_t n0 = std::min(m1, m0 + (c + ahead) * chunk), n1 = std::min<int64_t>(m1, n0 + SHRINK_ROWS);
      const char* next = n1 > n0 ? reinterpret_cast<const char*>(A + n0 * lda) : nullptr;
      const int64_t next_lines = n1 > n0 ? ((n1 - n0 - 1) * lda + K) * int64_t(sizeof(X)) / 64 + 1 : 0;
      for (int64_t m = m0 + c * chunk, n; m < end; m += n) {
        for (n = 1; m + n < end && group[m + n] == group[m]; ++n) {
        }
        const Group* gr = of(m);
        if (!gr) continue;
        for (int64_t i = 0; i < n; ++i) xr[i] = A + (m + i) * lda;
        const int64_t rk = gr->rank;
        // after the run's last token block: the next run's first row, or for the chunk's last run the next chunk's
        const bool last = m + n >= end;
        const char* nx = last ? next : reinterpret_cast<const char*>(A + (m + n) * lda);
        const int64_t nl = last ? next_lines : K * int64_t(sizeof(X)) / 64 + 1;
        for (int64_t s = 0; s < pools.S; ++s) {
          float* out = coef + m * coef_ld + s * rank_pad;
          const bool fx = s == 0;  // the first slice reads the run's x rows from memory; the others find them in L2
          if (gr->packed)
            shrink_tile(xr, n, Paired{gr->packed + s * paired_floats(rk, K), K, rk}, K, rk, out, coef_ld, fx, nx, nl);
          else
            with_type(pools.dt, [&](auto tag) {
              using T = decltype(tag);
              shrink_tile(xr, n, InPool<T>{pools.a_rows<T>(s, gr->row), pools.ak, rk}, K, rk, out, coef_ld, fx, nx,
                          nl);
            });
        }
      }
    }
  }

  // rows m .. m + mr - 1 of y, columns [c0, c1): each token's delta, slice by slice; C holds y's rows from row0 (the
  // bfloat16 GEMM's epilogue: a tile's rows widened into scratch)
  void apply(float* C, int64_t ldc, int64_t N, int64_t m, int64_t mr, int64_t c0, int64_t c1,
             int64_t row0 = 0) const {
    with_type(pools.dt, [&](auto tag) {
      apply_rows(C, ldc, m, mr, c0, c1, row0, static_cast<const decltype(tag)*>(pools.b));
    });
  }

  template <class T>
  void apply_rows(float* C, int64_t ldc, int64_t m, int64_t mr, int64_t c0, int64_t c1, int64_t row0,
                  const T* b) const {
    const Group* gm = of(m);
    const int64_t ldb = pools.bn;
#if defined(__AVX512F__)
    if (c1 - c0 == NR && gm && same_group(m, mr)) {  // a whole tile's width of one group: shared loads
      for (int64_t s = 0; s < pools.S; ++s)
        if (offs[s] <= c0 && c1 <= offs[s] + (offs[s + 1] - offs[s]) / 16 * 16) {
          float* y = C + (m - row0) * ldc + c0;
          const float* cf = coef + m * coef_ld + s * rank_pad;
          const T* bb = b + gm->row * ldb + c0;
          with_rows<MR>(mr, [&](auto r) { tile<decltype(r)::value>(y, ldc, cf, bb, ldb, gm->rank, gm->scale); });
          return;
        }
    }
#elif defined(__AVX2__)
    if (c1 - c0 == NR && mr == 4 && gm && same_group(m, 4)) {  // a whole tile of one group: shared loads
      for (int64_t s = 0; s < pools.S; ++s)
        if (offs[s] <= c0 && c1 <= offs[s] + (offs[s + 1] - offs[s]) / 16 * 16) {
          tile4(C + (m - row0) * ldc + c0, ldc, coef + m * coef_ld + s * rank_pad, b + gm->row * ldb + c0, ldb,
                gm->rank, gm->scale);
          return;
        }
    }
#endif
    for (int64_t t = m; t < m + mr; ++t) {
      const Group* gt = of(t);
      if (!gt) continue;
      for (int64_t s = 0; s < pools.S; ++s) {
        const int64_t lo = std::max(c0, offs[s]), hi = std::min(c1, offs[s + 1]);
        if (lo >= hi) continue;
        const int64_t vec_end = offs[s] + (offs[s + 1] - offs[s]) / 16 * 16;  // as expand_tile: 16 at a time
        expand_row(C + (t - row0) * ldc, coef + t * coef_ld + s * rank_pad, b + gt->row * ldb, ldb, gt->rank,
                   gt->scale, lo, hi, vec_end);
      }
    }
  }

  // Ask for the B rows that apply(m, .., c0, c0 + NR) will read (row m's group): rank rows, strided, read once
  // per tile. A tile's worth of GEMM ahead, they arrive during it instead of stalling its epilogue (2,048 tokens
  // on 32 adapters of 64 tokens, every layer of the default model, Zen 5 core: 267-285 -> 140-184 ms added to the
  // GEMMs in scripts/bench_lora_floor.py --tokens 2048 --adapters 32).
  void prefetch(int64_t m, int64_t N, int64_t c0) const {
    const Group* gm = of(m);
    if (!gm) return;
    const int64_t es = type_bytes(pools.dt), row = pools.bn * es;
    const char* bb = static_cast<const char*>(pools.b) + (gm->row * pools.bn + c0) * es;
    for (int64_t r = 0; r < gm->rank; ++r) {  // the lines of the row's NR elements
      const char* p = bb + r * row;
      for (int64_t c = 0; c < NR * es; c += 64) __builtin_prefetch(p + c, 0, 3);
      __builtin_prefetch(p + NR * es - 1, 0, 3);  // (16-bit rows: a tile's columns need not start a line)
    }
  }

  bool same_group(int64_t m, int64_t n) const {
    for (int64_t i = 1; i < n; ++i)
      if (group[m + i] != group[m]) return false;
    return true;
  }

#if defined(__AVX512F__)
  // R rows x 48 columns of one group, in the 16-wide part of their slice: 3R independent fma chains over the rank
  // (each column's arithmetic as expand_block's), every B vector loaded once for the R rows
  template <int R, class T>
  void tile(float* y, int64_t ldc, const float* cf, const T* bb, int64_t ldb, int64_t rk, float sc) const {
    __m512 acc[R][3];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rk; ++r) {
      const __m512 b0 = load16(bb + r * ldb), b1 = load16(bb + r * ldb + 16), b2 = load16(bb + r * ldb + 32);
      _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {
        const __m512 c = _mm512_set1_ps(cf[i * coef_ld + r]);
        acc[i][0] = _mm512_fmadd_ps(c, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(c, b1, acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(c, b2, acc[i][2]);
      }
    }
    const __m512 sv = _mm512_set1_ps(sc);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i)
      _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v) {
        float* yr = y + i * ldc + 16 * v;
        _mm512_storeu_ps(yr, _mm512_fmadd_ps(sv, acc[i][v], _mm512_loadu_ps(yr)));
      }
  }
#elif defined(__AVX2__)
  // 4 rows x 24 columns of one group, in the 16-wide part of their slice: 12 independent fma chains over the rank
  // (each column's arithmetic as expand_block's), every B vector loaded once for the 4 rows
  template <class T>
  void tile4(float* y, int64_t ldc, const float* cf, const T* bb, int64_t ldb, int64_t rk, float sc) const {
    __m256 acc[4][3];
    for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = _mm256_setzero_ps();
    for (int64_t r = 0; r < rk; ++r) {
      const __m256 b0 = load8(bb + r * ldb), b1 = load8(bb + r * ldb + 8), b2 = load8(bb + r * ldb + 16);
      _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
        const __m256 c = _mm256_broadcast_ss(cf + i * coef_ld + r);
        acc[i][0] = _mm256_fmadd_ps(c, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(c, b1, acc[i][1]);
        acc[i][2] = _mm256_fmadd_ps(c, b2, acc[i][2]);
      }
    }
    const __m256 sv = _mm256_set1_ps(sc);
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i)
      _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v) {
        float* yr = y + i * ldc + 8 * v;
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(sv, acc[i][v], _mm256_loadu_ps(yr)));
      }
  }
#endif
};

// lines of an Ahead's ranges one gemm_panel tile asks for (per_k times this): one a k of its loop over K / 4 * 4
inline int64_t tile_fetch_lines(int64_t K) { return K / 4 * 4; }

// Panel p of the output over rows [m0, m1): its row tiles, each prefetching a share of the next panel and (ahead:
// nullable) up to ahead->per_k lines per k of what it lists
template <class Fetch = Ahead>
inline void gemm_panel(const float* A, int64_t lda, int64_t m0, int64_t m1, int64_t K, const float* Bp, int64_t N,
                       int64_t p, const float* bias, float* C, int64_t ldc, const LoraEpilogue* lora,
                       Fetch* ahead = nullptr) {
  const int64_t P = (N + NR - 1) / NR, panel_lines = (K * NR * 4 + 63) / 64;
  const int64_t tiles = (m1 - m0 + MR - 1) / MR, per_tile = (panel_lines + tiles - 1) / tiles;
  const float* B = Bp + p * K * NR;
  const char* next = reinterpret_cast<const char*>(p + 1 < P ? B + K * NR : B);
  const int64_t nc = std::min(NR, N - p * NR);
  const float* bp = bias ? bias + p * NR : nullptr;
  for (int64_t t = 0, m = m0; m < m1; ++t, m += MR) {
    const int64_t lo = std::min(panel_lines, t * per_tile), n = std::min(panel_lines, lo + per_tile) - lo;
    const float* a = A + m * lda;
    float* c = C + m * ldc + p * NR;
    const int64_t mr = std::min<int64_t>(MR, m1 - m);
    const auto [q, qn] = ahead ? ahead->take(tile_fetch_lines(K)) : std::pair<const char*, int64_t>{nullptr, 0};
    const auto [q2, qn2] =
        ahead && ahead->per_k > 1 ? ahead->take(tile_fetch_lines(K)) : std::pair<const char*, int64_t>{nullptr, 0};
    with_rows<MR>(mr, [&](auto r) {
      if (qn > 0)
        gemm_tile<decltype(r)::value, true>(a, lda, B, K, c, ldc, nc, bp, next + 64 * lo, n, q, qn, q2, qn2);
      else
        gemm_tile<decltype(r)::value, false>(a, lda, B, K, c, ldc, nc, bp, next + 64 * lo, n, q, qn, q2, qn2);
    });
    if (lora) {
      if (m + MR < m1) lora->prefetch(m + MR, N, p * NR);  // the next tile's, while this one's epilogue runs
      lora->apply(C, ldc, N, m, mr, p * NR, p * NR + nc);
    }
  }
}

// rows per chunk of LoraEpilogue::shrink over n rows: a share per thread, a multiple of 4 (shrink_tile's token
// blocks), at most LORA_MAX_TILE
int64_t shrink_chunk(int64_t n, int nthreads) {
  const int64_t chunks = nthreads * ((n + nthreads * LORA_MAX_TILE - 1) / (nthreads * LORA_MAX_TILE));
  return std::max<int64_t>(4, (n + 4 * chunks - 1) / (4 * chunks) * 4);
}

// A group of this many tokens has its A rows packed for the shrink (pack_pair: one load for two rows' 8 columns
// instead of two and a shuffle); smaller ones read them in the pool, where packing costs more than it saves. Default
// model's four linear layers, rank 16, against reading every group in the pool, one / two threads, ms a layer: 2,048
// tokens on one adapter 8.17 -> 7.88 / 4.16 -> 3.97; packing groups of 64 too, 32 adapters of 64 tokens went 9.94 ->
// 10.38 / 5.31 -> 5.67.
constexpr int64_t PACK_MIN_TOKENS = 256;

// rows per block of gemm (see below) for mc as asked
int64_t row_block_rows(int64_t M, int64_t mc) { return mc >= M || mc <= 0 ? M : std::max<int64_t>(MR, mc / MR * MR); }

// Rows are taken in blocks of mc (a multiple of MR; >= M: one block) and every panel passes over one block before
// the next: where x is larger than the last-level cache can keep beside the weights (a long prefill chunk), a block
// of x stays in L2 while the panels stream over it instead of x streaming from memory once per panel. Each output
// element's arithmetic does not depend on mc.
//
// fetch (nullable): byte ranges that the next call will read (the next linear's adapter rows, see layer.cpp), which
// every thread's tiles ask for into L2, a line a k, while their FMAs run: over the last panels of its share of the
// last row block, as many as the lines need and one more. Asked for at the start, they had left L2 again by the end
// under the weights streaming through it (gate|up's 7 MB). Decode steps of the bench_lora setting on one adapter, the
// same build with and without, rounds alternating in one process, median step, ms added by the adapter: one thread 4.79
// -> 4.51, two 2.68 -> 2.58; the prefill step (two threads, 12 rounds) 127.6 -> 122.7, 32 adapters' 151.2 -> 148.3.
void gemm(const float* A, int64_t lda, int64_t M, int64_t K, const float* Bp, int64_t N, const float* bias, float* C,
          int64_t ldc, int64_t mc, int nthreads, const LoraEpilogue* lora, const Ahead* fetch = nullptr) {
  const int64_t P = (N + NR - 1) / NR;
  mc = row_block_rows(M, mc);
  for (int64_t m0 = 0; m0 < M; m0 += mc) {
    const int64_t m1 = std::min(M, m0 + mc);
#pragma omp parallel num_threads(nthreads)
    {
      if (lora) lora->shrink(A, lda, K, m0, m1, shrink_chunk(m1 - m0, nthreads));
      // this thread's panels: a contiguous share, so that it knows which are its last
      const int nt = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
      Ahead ah;
      int64_t from = p1;  // the first panel whose tiles ask for fetch's lines
      if (fetch && m1 == M) {
        ah = *fetch;
        const int64_t per_panel = (m1 - m0 + MR - 1) / MR * tile_fetch_lines(K);
        from = std::max(p0, p1 - (ah.lines() + per_panel - 1) / per_panel - 1);
      }
      for (int64_t p = p0; p < p1; ++p)
        gemm_panel(A, lda, m0, m1, K, Bp, N, p, bias, C, ldc, lora, p < from || ah.done() ? nullptr : &ah);
    }
  }
}

// Bytes of pass items whose rows a thread has asked for and not yet run: a quarter of a 1 MiB L2 (Zen 4 and 5), beside
// the GEMM's panels and x. 32 decode tokens on 32 adapters, every layer of the default model, LoRA added to the GEMMs,
// one item at a time / this, alternating in one process: one thread 20.9 -> 17.4 ms, two 24.8 -> 22.3 ms; 128 KiB no
// gain (a q|k|v item is 171 KiB), 512 KiB to 4 MiB as 256.
constexpr int64_t PASS_AHEAD_BYTES = 256 << 10;

// The items of a LoRA pass one thread claims and has its GEMM tiles ask for (into L2, per_k lines a k): as soon as one
// item's rows were all asked for, the next item is claimed and its rows asked for, in the same tile, until the items
// asked for and not yet run hold PASS_AHEAD_BYTES; those asked for whole run at the next panel boundary, from cache.
// With one item at a time a panel's slots after its item's rows went unused, so where items are small against a
// panel (o, down: one item a panel) most of them ran unfetched after the panels.
struct PassFetch {
  static constexpr int RING = 8;
  const LoraPass& pass;
  std::atomic<int64_t>& next_item;
  int per_k;  // lines a k gemm_panel's tiles ask for
  Ahead ah;  // the ranges of ring[n - 1], the item being asked for
  int64_t ring[RING];  // claimed items, in order; all but ring[n - 1] asked for whole
  int n = 0;
  int64_t bytes = 0;  // rows of the items in ring
  bool out = false;   // no item left to claim

  PassFetch(const LoraPass& p, std::atomic<int64_t>& next, int lines_per_k)
      : pass(p), next_item(next), per_k(lines_per_k) {
    grow();
  }
  // claim the next item and start asking for its rows, where there is room
  bool grow() {
    if (out || n == RING || (n > 0 && bytes >= PASS_AHEAD_BYTES)) return false;
    const int64_t w = next_item.fetch_add(1, std::memory_order_relaxed);
    if (w >= pass.items.size()) return out = true, false;
    ring[n++] = w;
    bytes += pass.bytes_of(w);
    pass.rows_of(w, ah);
    return true;
  }
  std::pair<const char*, int64_t> take(int64_t lines) {
    if (ah.done() && !grow()) return {nullptr, 0};
    return ah.take(lines);
  }
  // at a panel boundary (all: at the end, the last item's rest read now): run the items asked for whole
  void run_ready(LoraPass::Scratch& sc, float* delta, int64_t ld, bool all = false) {
    if (all) ah.finish(sc.sink);
    const int ready = ah.done() ? n : n - 1;
    for (int i = 0; i < ready; ++i) {
      pass.run<true, true>(ring[i], sc, delta, ld);
      bytes -= pass.bytes_of(ring[i]);
    }
    for (int i = ready; i < n; ++i) ring[i - ready] = ring[i];
    n -= ready;
    if (n == 0 && !all) grow();
  }
};

// The GEMM (one row block) and a LoRA pass (loom_lora_apply's work items) interleaved on every thread: the pass's
// adapter rows stream from memory while the GEMM is bound by its FMAs, so each thread's GEMM tiles ask for the rows of
// the pass items it runs next (PassFetch) and they run between two panels, from cache. Items left when the panels run
// out run as in the pass (rows swept first). The pass keeps each token's delta in scratch, added to y once all is
// done (lora_combine: bitwise the pass's own add). 32 decode tokens on 32 adapters, every layer of the default model,
// Zen 5 VM, the previous library (one thread: the pass after the GEMM; more: the pass and the GEMM on different
// threads) and this one alternating in one process, LoRA added to the GEMMs: float32 pools 35.0 -> 26.0 ms at one
// thread (15 of 15 rounds faster), 20.3 -> 18.8 at two (13 of 15); bfloat16 23.8 -> 17.8 (14 of 15), 16.7 -> 13.2 (13
// of 15).
void gemm_with_pass(const float* A, int64_t lda, int64_t M, int64_t K, const float* Bp, int64_t N, const float* bias,
                    float* C, int64_t ldc, int nthreads, const LoraEpilogue* lora, const LoraPass& pass) {
  const int64_t P = (N + NR - 1) / NR, n_items = pass.items.size();
  const int64_t n_tok = pass.seg[pass.G];
  const std::unique_ptr<float[]> delta(new float[n_tok * N]);  // a row per token of the pass, written whole
  // two lines a k where one would leave rows unasked for when the panels end (q|k|v: more adapter rows than weights)
  const int64_t slots = P * ((M + MR - 1) / MR) * tile_fetch_lines(K);
  const int per_k = pass.lines() > slots ? 2 : 1;
  std::atomic<int64_t> next_panel{0}, next_item{0};
#pragma omp parallel num_threads(nthreads)
  {
    if (lora) lora->shrink(A, lda, K, 0, M, shrink_chunk(M, nthreads));
    LoraPass::Scratch sc(pass);
    PassFetch pf(pass, next_item, per_k);
    for (int64_t p; (p = next_panel.fetch_add(1, std::memory_order_relaxed)) < P;) {
      pf.run_ready(sc, delta.get(), N);
      gemm_panel(A, lda, 0, M, K, Bp, N, p, bias, C, ldc, lora, &pf);
    }
    pf.run_ready(sc, delta.get(), N, true);
    for (int64_t w; (w = next_item.fetch_add(1, std::memory_order_relaxed)) < n_items;)
      pass.run<true>(w, sc, delta.get(), N);
    keep(sc.sink);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < pass.G; ++g) {
      if (pass.ranks[g] <= 0) continue;
      for (int64_t i = pass.seg[g]; i < pass.seg[g + 1]; ++i)
        lora_combine(C + pass.tok[i] * ldc, delta.get() + i * N, pass.offs, pass.pools.S, pass.scal[g]);
    }
  }
}

// A linear's LoRA groups split: fused into the GEMM's output tiles (at least fuse_min tokens: a prefill chunk, many
// decode tokens of one adapter) and the rest (a pass of their own), each a list of groups over its own token list
struct GroupSplit {
  struct Part {
    std::vector<int64_t> tok;
    std::vector<int32_t> seg{0}, rows, ranks;
    std::vector<float> scal;
    void add(const int64_t* t, int64_t n, int32_t row, int32_t rank, float sc) {
      tok.insert(tok.end(), t, t + n);
      seg.push_back(int32_t(tok.size()));
      rows.push_back(row);
      ranks.push_back(rank);
      scal.push_back(sc);
    }
    int64_t groups() const { return int64_t(rows.size()); }
  } big, small;
  GroupSplit(const int64_t* tok, const int32_t* seg, const int32_t* rows, const int32_t* ranks, const float* scal,
             int64_t G, int64_t fuse_min) {
    for (int64_t g = 0; g < G; ++g) {
      if (ranks[g] <= 0) continue;
      const int64_t n = seg[g + 1] - seg[g];
      (n >= fuse_min ? big : small).add(tok + seg[g], n, rows[g], ranks[g], scal[g]);
    }
  }
  // the small groups' pass over x (lda) into y (ldc)
  LoraPass pass(const float* x, int64_t lda, const Pools& pools, const int64_t* offs, float* y, int64_t ldc,
                int nthreads) const {
    return LoraPass{x, lda, pools, offs, y, ldc, small.tok.data(), small.seg.data(), small.rows.data(),
                    small.ranks.data(), small.scal.data(), small.groups(),
                    LoraItems(small.seg.data(), small.ranks.data(), small.groups(), nthreads)};
  }
};

// The fused groups' epilogue (LoraEpilogue) over a GEMM of M rows, with the scratch it reads: their A rows packed
// for the shrink (pack_pair) where the group has tokens enough to pay for it, else read in the pool; the shrink
// coefficients. B is read in the pool (16-bit rows widened as loaded). Empty (null `get`) without fused groups.
struct FusedLora {
  std::unique_ptr<float[]> paired, coef;
  LoraEpilogue ep{};

  FusedLora(const GroupSplit::Part& big, const Pools& pools, const int64_t* offs, int64_t M, int nthreads) {
    if (!big.groups()) return;
    const int64_t K = pools.K, S = pools.S;
    int64_t max_rank = 0;
    for (const int32_t r : big.ranks) max_rank = std::max<int64_t>(max_rank, r);
    std::vector<int64_t> a_at(big.groups() + 1, 0);  // group g's packed slices from a_at[g] (none: a_at[g + 1])
    for (int64_t g = 0; g < big.groups(); ++g) {
      const bool pack = big.seg[g + 1] - big.seg[g] >= PACK_MIN_TOKENS;
      a_at[g + 1] = a_at[g] + (pack ? S * paired_floats(big.ranks[g], K) : 0);
    }
    paired.reset(new float[a_at.back()]);  // written whole before it is read
    // the packing shared out over the threads (one adapter's prefill chunk is one group): group g's items from
    // item_at[g], a pair of A rows of a slice each
    std::vector<int64_t> item_at(big.groups() + 1, 0);
    for (int64_t g = 0; g < big.groups(); ++g)
      item_at[g + 1] = item_at[g] + (a_at[g + 1] > a_at[g] ? S * ((big.ranks[g] + 1) / 2) : 0);
    if (item_at.back())
      with_type(pools.dt, [&](auto tag) {
        using T = decltype(tag);
#pragma omp parallel for num_threads(std::min<int64_t>(nthreads, item_at.back())) schedule(dynamic, 1)
        for (int64_t w = 0; w < item_at.back(); ++w) {
          const int64_t g = std::upper_bound(item_at.begin(), item_at.end(), w) - item_at.begin() - 1;
          const int64_t rk = big.ranks[g], half = (rk + 1) / 2, i = w - item_at[g];
          pack_pair(pools.a_rows<T>(i / half, big.rows[g]), pools.ak, rk, K, i % half,
                    paired.get() + a_at[g] + i / half * paired_floats(rk, K));
        }
      });
    const int64_t rank_pad = (max_rank + 3) / 4 * 4, coef_ld = S * rank_pad;
    // written by the shrink wherever an epilogue reads it (a fused group's tokens, each slice, ranks below the group's)
    coef.reset(new float[M * coef_ld]);
    ep = LoraEpilogue{coef.get(), coef_ld, rank_pad, offs, pools, {}, std::vector<int32_t>(M, -1)};
    for (int64_t g = 0; g < big.groups(); ++g) {
      ep.groups.push_back(
          {big.rows[g], big.ranks[g], big.scal[g], a_at[g + 1] > a_at[g] ? paired.get() + a_at[g] : nullptr});
      for (int64_t i = big.seg[g]; i < big.seg[g + 1]; ++i) ep.group[big.tok[i]] = int32_t(g);
    }
  }
  const LoraEpilogue* get() const { return coef ? &ep : nullptr; }
};

// loom_gemm_lora's work; fetch (nullable): gemm's, for the fused groups' GEMM
void gemm_lora(const float* A, int64_t lda, int64_t M, const float* Bp, const float* bias, float* C, int64_t ldc,
               const Pools& pools, const int64_t* offs, const int64_t* tok, const int32_t* seg, const int32_t* rows,
               const int32_t* ranks, const float* scal, int64_t G, int64_t fuse_min, int64_t mc, int nthreads,
               const Ahead* fetch) {
  const int64_t K = pools.K, N = pools.N;
  const GroupSplit split(tok, seg, rows, ranks, scal, G, fuse_min);
  const FusedLora fused(split.big, pools, offs, M, nthreads);
  if (!split.small.groups()) {
    gemm(A, lda, M, K, Bp, N, bias, C, ldc, mc, nthreads, fused.get(), fetch);
    return;
  }
  const LoraPass pass = split.pass(A, lda, pools, offs, C, ldc, nthreads);
  if (row_block_rows(M, mc) == M) {
    gemm_with_pass(A, lda, M, K, Bp, N, bias, C, ldc, nthreads, fused.get(), pass);
  } else {
    gemm(A, lda, M, K, Bp, N, bias, C, ldc, mc, nthreads, fused.get(), fetch);
    run_pass(pass, nthreads);
  }
}

}  // namespace

extern "C" {

// columns per packed panel: what loom_gemm_pack lays out and loom_gemm reads
int64_t loom_gemm_panel_width() { return NR; }

// W [N, K] row-major -> panels Bp [ceil(N / NR), K, NR]
void loom_gemm_pack(const float* W, int64_t N, int64_t K, float* Bp) {
  const int64_t P = (N + NR - 1) / NR;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < NR; ++j) {
        const int64_t n = p * NR + j;
        Bp[(p * K + k) * NR + j] = n < N ? W[n * K + k] : 0.f;
      }
}

// y [M, N] (row stride ldc) = x [M, K] (row stride lda) @ W^T + bias (nullable), W packed by loom_gemm_pack;
// rows in blocks of mc (see gemm), parallel over panels.
void loom_gemm(const float* A, int64_t lda, int64_t M, int64_t K, const float* Bp, int64_t N, const float* bias,
               float* C, int64_t ldc, int64_t mc, int nthreads) {
  gemm(A, lda, M, K, Bp, N, bias, C, ldc, mc, nthreads, nullptr);
}

// loom_gemm, then y[tok] += the LoRA delta of tok's group per slice: the same groups (tok, seg, rows, ranks, scal, G)
// and pools (a [S, R, K], b [R, N], rows ak and bn elements apart) as loom_lora_apply, slice offsets offs [S + 1];
// bitwise loom_gemm followed by loom_lora_apply. A group of at least `fuse_min` tokens (a prefill chunk) has its deltas
// added to each output tile as soon as the tile is computed, so y is not read back from memory for them (its shrink
// coefficients are computed first, into [M, S * rank_pad] scratch); smaller groups (decode tokens, each reading its own
// adapter's rows) take loom_lora_apply's pass: interleaved with the GEMM's panels where x is one row block
// (gemm_with_pass), else afterwards.
//
// Pools of 16-bit floats (dt, with_type's code): rows are widened as they are loaded (exact, so the bits are those of
// float32 pools), and a fused group's A rows packed to float32 for the shrink where it has tokens enough (pack_pair).
// The fused groups' B rows were widened into float32 scratch first until the tiles read them in place: 32 adapters
// of 64 tokens, bfloat16 layers, with x's rows shrunk in place (gemm_bf16.cpp), the prefill step 693 -> 671 ms (one
// adapter 659 -> 645), medians of 14 rounds alternating the two builds in one process.
void loom_gemm_lora(const float* A, int64_t lda, int64_t M, int64_t K, const float* Bp, int64_t N, const float* bias,
                    float* C, int64_t ldc, const void* a, int dt, int64_t R, int64_t ak, const void* b, int64_t bn,
                    const int64_t* offs, int64_t S, const int64_t* tok, const int32_t* seg, const int32_t* rows,
                    const int32_t* ranks, const float* scal, int64_t G, int64_t fuse_min, int64_t mc, int nthreads) {
  gemm_lora(A, lda, M, Bp, bias, C, ldc, Pools{a, b, dt, S, R, K, N, ak, bn}, offs, tok, seg, rows, ranks, scal, G,
            fuse_min, mc, nthreads, nullptr);
}

}  // extern "C"
