// Multi-LoRA over adapter rank rows read in place in the pools, shrink and expand in one pass:
//   y[tok[i], offs[s]:offs[s+1]] += scal[g] * sum_r (x[tok[i]] . a[s, rows[g] + r]) * b[rows[g] + r, offs[s]:offs[s+1]]
// for the tokens i of group g (tok[seg[g]:seg[g+1]]), r < ranks[g]. x rows of stride xs; a [S, R, K] and b [R, N]
// in rows of ak and bn elements (Pools; float32, bfloat16 or float16: with_type's code, widened as read); y rows of
// stride ys; seg [G+1], rows / ranks [G] int32; scal [G] float32; tok int64.
//
// Work items are tiles of up to LORA_MAX_TILE tokens of one group (fewer when that would leave threads idle), in
// parallel: a group's tokens are its own rows of y, so no two items write one row. Register tiles keep loads per
// FMA low: the shrink takes up to 3 tokens x 4 rank rows at a time (each x and A vector loaded once for all of
// them), the expand up to 4 tokens x 16 columns (each B vector loaded once for all the tokens). A decode token
// (a tile of one) reads its adapter's rows once, front to back; a prefill chunk on one adapter costs its FLOPs,
// its A and B rows staying in cache across the tile. As in the reference, the rank-space products stay in float32
// scratch and each token's delta is summed on its own before it is added to y (scaled) once.

namespace {

constexpr int64_t LORA_MAX_TILE = 32;

// Token rows per shrink block: AVX-512 keeps two rank rows in a vector (below), so 4 rows give 8 fma chains.
#ifdef __AVX512F__
constexpr int SHRINK_ROWS = 4;
#else
constexpr int SHRINK_ROWS = 3;
#endif

// Rank rows of A as the shrink reads them, N at a time: a pair of rows' 8 columns from k side by side (AVX-512), one
// row's 8 (AVX2), one element (tails). In the pool (RowPtrs: the pair from two rows, put side by side), or packed by
// pack_pair (PairedRows: one load).
template <class T, int N>
struct RowPtrs {
  const T* r[N];
#ifdef __AVX512F__
  __m512 pair(int h, int64_t k) const { return load_pair(r[2 * h] + k, r[2 * h + 1] + k); }
#endif
#ifdef __AVX2__
  __m256 row8(int j, int64_t k) const { return load8(r[j] + k); }
#endif
  float at(int j, int64_t k) const { return to_f32(r[j][k]); }
};

template <int N>
struct PairedRows {
  const float* p[N / 2];
  int64_t k8, tail;  // columns side by side; the rest, a row after the other
#ifdef __AVX512F__
  __m512 pair(int h, int64_t k) const { return _mm512_loadu_ps(p[h] + 2 * k); }
#endif
#ifdef __AVX2__
  __m256 row8(int j, int64_t k) const { return _mm256_loadu_ps(p[j / 2] + 2 * k + 8 * (j & 1)); }
#endif
  float at(int j, int64_t k) const {
    return k < k8 ? p[j / 2][(k & ~int64_t(7)) + k + 8 * (j & 1)] : p[j / 2][2 * k8 + (j & 1) * tail + k - k8];
  }
};

// An adapter slice's rank rows in the pool, ld elements apart: block<N>(r0) reads rows r0 .. r0 + N - 1 (past the
// rank: its last row, whose products land in padding)
template <class T>
struct InPool {
  const T* a;
  int64_t ld, rank;
  template <int N>
  RowPtrs<T, N> block(int64_t r0) const {
    RowPtrs<T, N> rows;
    for (int j = 0; j < N; ++j) rows.r[j] = a + std::min<int64_t>(r0 + j, rank - 1) * ld;
    return rows;
  }
};

// The same rows packed by pack_pair: 2K floats a pair of rows (past the rank: its last pair)
struct Paired {
  const float* a;
  int64_t K, rank;
  template <int N>
  PairedRows<N> block(int64_t r0) const {
    PairedRows<N> rows;
    const int64_t last = (rank - 1) / 2;
    for (int h = 0; h < N / 2; ++h) rows.p[h] = a + std::min<int64_t>(r0 / 2 + h, last) * 2 * K;
    rows.k8 = K / 8 * 8;
    rows.tail = K - rows.k8;
    return rows;
  }
};

// floats of one slice's rows packed by pack_pair
inline int64_t paired_floats(int64_t rank, int64_t K) { return (rank + 1) / 2 * 2 * K; }

// Pair h of rank rows [rank, K] (ld elements apart) -> Paired's layout (2K floats from out + 2hK): rows 2h and
// min(2h + 1, rank - 1), their first K / 8 * 8 columns 8 at a time side by side, then the first row's tail, then the
// second's. A prefill chunk's shrink then loads a pair of rows' 8 columns whole (a pool's rows are put side by side a
// shuffle each).
template <class T>
void pack_pair(const T* a, int64_t ld, int64_t rank, int64_t K, int64_t h, float* out) {
  const int64_t k8 = K / 8 * 8;
  out += 2 * h * K;
  const T *r0 = a + 2 * h * ld, *r1 = a + std::min(2 * h + 1, rank - 1) * ld;
  for (int64_t k = 0; k < k8; k += 8) {
    widen(r0 + k, out + 2 * k, 8);
    widen(r1 + k, out + 2 * k + 8, 8);
  }
  widen(r0 + k8, out + 2 * k8, K - k8);
  widen(r1 + k8, out + K + k8, K - k8);
}

#ifdef __AVX2__
// The shrink kernels' x-row fetch (shrink_tile's fetch_x): at column k (a step of 8), lines k / 4 and k / 4 + 1 of the
// pf_lines from pf into L2 (two lines a step: four times the pace a row is read at, so the next rows are asked for
// while this one is read)
__attribute__((always_inline)) inline void fetch_two_lines(const char* pf, int64_t pf_lines, int64_t k) {
  if (k / 4 < pf_lines) {
    _mm_prefetch(pf + 16 * k, _MM_HINT_T1);
    _mm_prefetch(pf + 16 * k + 64, _MM_HINT_T1);
  }
}
#endif

// x's 8 floats from p in both halves of a vector
#ifdef __AVX512F__
inline __m512 twice8(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))));
}
// x's 8 bfloat16 from p widened (exact), in both halves: a bfloat16 layer's prefill chunk is shrunk from its own
// rows, not from a float32 copy of them
inline __m512 twice8(const bf16_t* p) {
  const __m512 v = _mm512_castps256_ps512(load8(p));
  return _mm512_shuffle_f32x4(v, v, 0x44);
}
#endif

// out[i * 4 + j] = x_i . a_j for TI token rows and 4 rank rows (A: RowPtrs or PairedRows) of K floats: per (i, j) 8
// lanes of fma chains over k = lane mod 8, then hsum. With AVX-512 a vector holds two rank rows' 8 lanes side by
// side, so each lane's arithmetic, and the result, is the AVX2 loop's to the bit at twice the width (a prefill chunk
// of 2,048 tokens on one adapter, every layer of the default model, Zen 5 core: 195-252 -> 103-145 ms added to the
// GEMMs, of which about 95 are the LoRA's FLOPs at the GEMMs' rate).
template <int TI, class A, class X>
inline void shrink_block(const X* const* x, const A& a, int64_t K, float* out, const char* pf = nullptr,
                         int64_t pf_lines = 0) {
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 acc[TI][2];
  for (int i = 0; i < TI; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    fetch_two_lines(pf, pf_lines, k);
    const __m512 a01 = a.pair(0, k), a23 = a.pair(1, k);
    for (int i = 0; i < TI; ++i) {
      const __m512 xv = twice8(x[i] + k);
      acc[i][0] = _mm512_fmadd_ps(xv, a01, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, a23, acc[i][1]);
    }
  }
  for (int i = 0; i < TI; ++i)
    for (int h = 0; h < 2; ++h) {
      out[i * 4 + 2 * h] = hsum(lo256(acc[i][h]));
      out[i * 4 + 2 * h + 1] = hsum(hi256(acc[i][h]));
    }
#elif defined(__AVX2__)
  __m256 acc[TI][4];
  for (int i = 0; i < TI; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    fetch_two_lines(pf, pf_lines, k);
    const __m256 a0 = a.row8(0, k), a1 = a.row8(1, k), a2 = a.row8(2, k), a3 = a.row8(3, k);
    for (int i = 0; i < TI; ++i) {
      const __m256 xv = load8(x[i] + k);
      acc[i][0] = _mm256_fmadd_ps(xv, a0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, a1, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(xv, a2, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(xv, a3, acc[i][3]);
    }
  }
  for (int i = 0; i < TI; ++i)
    for (int j = 0; j < 4; ++j) out[i * 4 + j] = hsum(acc[i][j]);
#else
  (void)pf, (void)pf_lines;
  for (int i = 0; i < TI * 4; ++i) out[i] = 0.f;
#endif
  for (; k < K; ++k)
    for (int i = 0; i < TI; ++i)
      for (int j = 0; j < 4; ++j) out[i * 4 + j] += to_f32(x[i][k]) * a.at(j, k);
}

// y_i[c] += sc * sum_r coef_i[r] * b_r[c] for columns [c0, c1) of nt token rows, one column at a time. STORE: y_i[c]
// = the sum (unscaled), for lora_combine to add later with the same arithmetic.
template <bool STORE = false, class T>
inline void expand_cols(float* const* y, int64_t nt, const float* const* coef, const T* b, int64_t ldb,
                        int64_t rank, float sc, int64_t c0, int64_t c1) {
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t c = c0; c < c1; ++c) {
      float d = 0.f;
      for (int64_t r = 0; r < rank; ++r) d += coef[i][r] * to_f32(b[r * ldb + c]);
      if constexpr (STORE)
        y[i][c] = d;
      else
        y[i][c] += sc * d;
    }
}

// y_i[c : c + 16] += sc * sum_r coef_i[r] * b_r[c : c + 16] for TI token rows (b_r = b + r * ldb). The rank sum
// is formed on its own and added to y once (as the reference adds its delta), not term by term into y.
template <int TI, bool STORE = false, class T>
inline void expand_block(float* const* y, const float* const* coef, const T* b, int64_t ldb, int64_t rank,
                         float sc) {
#if defined(__AVX512F__)  // one vector a row: each column's arithmetic as below
  __m512 acc[TI];
  for (int i = 0; i < TI; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    const __m512 bv = load16(b + r * ldb);
    for (int i = 0; i < TI; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(coef[i][r]), bv, acc[i]);
  }
  const __m512 s = _mm512_set1_ps(sc);
  for (int i = 0; i < TI; ++i)
    _mm512_storeu_ps(y[i], STORE ? acc[i] : _mm512_fmadd_ps(s, acc[i], _mm512_loadu_ps(y[i])));
#elif defined(__AVX2__)
  __m256 acc[TI][2];
  for (int i = 0; i < TI; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    const __m256 b0 = load8(b + r * ldb), b1 = load8(b + r * ldb + 8);
    for (int i = 0; i < TI; ++i) {
      const __m256 c = _mm256_broadcast_ss(coef[i] + r);
      acc[i][0] = _mm256_fmadd_ps(c, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(c, b1, acc[i][1]);
    }
  }
  const __m256 s = _mm256_set1_ps(sc);
  for (int i = 0; i < TI; ++i) {
    _mm256_storeu_ps(y[i], STORE ? acc[i][0] : _mm256_fmadd_ps(s, acc[i][0], _mm256_loadu_ps(y[i])));
    _mm256_storeu_ps(y[i] + 8, STORE ? acc[i][1] : _mm256_fmadd_ps(s, acc[i][1], _mm256_loadu_ps(y[i] + 8)));
  }
#else
  expand_cols<STORE>(y, TI, coef, b, ldb, rank, sc, 0, 16);
#endif
}

#ifdef __AVX512F__
// More independent chains than shrink_block's two per token and expand_block's one: up to 4 tokens x 8 rank rows
// (four chains a token, the 8 rows' vectors loaded once for the tokens) and, for a decode tile of one token, 48
// columns (three chains); each row's and column's lanes and arithmetic as in shrink_block and expand_block, so the
// same bits. Every layer of the default model, one thread, paired rounds: 32 decode tokens on 32 adapters 5.0 ms less
// a step with bfloat16 rows (14 of 15 rounds faster), 4.6 ms with float32 (11 of 15; two threads, the pass beside
// the GEMM: no change); then the 8 rows for every tile: one adapter's decode step -0.3 / -0.6 ms (two / one thread,
// 10 of 15), a 2,048-token prefill chunk +20 and -33 ms (one adapter, two runs), -66 ms (32 adapters, bfloat16, 7
// of 7) of ~2.4 s.
template <int TI, class A, class X>
inline void shrink_rows8(const X* const* x, const A& a, int64_t K, float* out, const char* pf = nullptr,
                         int64_t pf_lines = 0) {
  __m512 acc[TI][4];
  for (int i = 0; i < TI; ++i)
    for (int h = 0; h < 4; ++h) acc[i][h] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    fetch_two_lines(pf, pf_lines, k);
    __m512 av[4];
    for (int h = 0; h < 4; ++h) av[h] = a.pair(h, k);
    for (int i = 0; i < TI; ++i) {
      const __m512 xv = twice8(x[i] + k);
      for (int h = 0; h < 4; ++h) acc[i][h] = _mm512_fmadd_ps(xv, av[h], acc[i][h]);
    }
  }
  for (int i = 0; i < TI; ++i)
    for (int h = 0; h < 4; ++h) {
      out[i * 8 + 2 * h] = hsum(lo256(acc[i][h]));
      out[i * 8 + 2 * h + 1] = hsum(hi256(acc[i][h]));
    }
  for (; k < K; ++k)
    for (int i = 0; i < TI; ++i)
      for (int j = 0; j < 8; ++j) out[i * 8 + j] += to_f32(x[i][k]) * a.at(j, k);
}

template <bool STORE, class T>
inline void expand_row48(float* y, const float* coef, const T* b, int64_t ldb, int64_t rank, float sc) {
  __m512 acc[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t r = 0; r < rank; ++r) {
    const __m512 cr = _mm512_set1_ps(coef[r]);
    for (int v = 0; v < 3; ++v) acc[v] = _mm512_fmadd_ps(cr, load16(b + r * ldb + 16 * v), acc[v]);
  }
  const __m512 s = _mm512_set1_ps(sc);
  for (int v = 0; v < 3; ++v)
    _mm512_storeu_ps(y + 16 * v, STORE ? acc[v] : _mm512_fmadd_ps(s, acc[v], _mm512_loadu_ps(y + 16 * v)));
}
#endif

// The tile's shrink: buf[i * rank_pad + r] = x_i . a_r (a: InPool or Paired), rank rows in blocks of 4 (the last
// block repeats rows; the extra products land in the padding and are never read), with AVX-512 8 rows at a time first.
// fetch_x: the first block of rank rows, which reads x rows from memory, asks for the next token block's x rows into L2
// while it computes one (up to two lines a kernel's 8 columns), and its last token block for [next, next + next_lines
// lines) (nullable: the token block the caller runs next).
template <class Rows, class X>
void shrink_tile(const X* const* x, int64_t nt, const Rows& a, int64_t K, int64_t rank, float* buf,
                 int64_t rank_pad, bool fetch_x = false, const char* next = nullptr, int64_t next_lines = 0) {
  float out[SHRINK_ROWS * 4];
  int64_t r0 = 0;
  // what the call for token block i0 asks for
  const auto ahead = [&](int64_t i0) {
    if (!fetch_x || r0 > 0) return std::pair<const char*, int64_t>{nullptr, 0};
    const int64_t j0 = i0 + SHRINK_ROWS, j1 = std::min<int64_t>(nt, j0 + SHRINK_ROWS);
    if (j0 >= nt) return std::pair<const char*, int64_t>{next, next ? next_lines : 0};
    const char* p = reinterpret_cast<const char*>(x[j0]);
    return std::pair<const char*, int64_t>{p, (reinterpret_cast<const char*>(x[j1 - 1] + K) - p + 63) / 64};
  };
#ifdef __AVX512F__
  float out8[SHRINK_ROWS * 8];
  for (; r0 + 8 <= rank; r0 += 8) {
    const auto rows = a.template block<8>(r0);
    for (int64_t i0 = 0; i0 < nt; i0 += SHRINK_ROWS) {
      const int64_t ti = std::min<int64_t>(SHRINK_ROWS, nt - i0);
      const auto f = ahead(i0);
      with_rows<SHRINK_ROWS>(ti, [&](auto r) {
        shrink_rows8<decltype(r)::value>(x + i0, rows, K, out8, f.first, f.second);
      });
      for (int64_t i = 0; i < ti; ++i)
        for (int j = 0; j < 8; ++j) buf[(i0 + i) * rank_pad + r0 + j] = out8[i * 8 + j];
    }
  }
#endif
  for (; r0 < rank; r0 += 4) {
    const auto rows = a.template block<4>(r0);
    for (int64_t i0 = 0; i0 < nt; i0 += SHRINK_ROWS) {
      const int64_t ti = std::min<int64_t>(SHRINK_ROWS, nt - i0);
      const auto f = ahead(i0);
      with_rows<SHRINK_ROWS>(ti, [&](auto r) {
        shrink_block<decltype(r)::value>(x + i0, rows, K, out, f.first, f.second);
      });
      for (int64_t i = 0; i < ti; ++i)
        for (int j = 0; j < 4; ++j) buf[(i0 + i) * rank_pad + r0 + j] = out[i * 4 + j];
    }
  }
}

// The tile's expand over columns [c0, c1) of y and b: 16 at a time (a decode tile 48 first), then the tail column by
// column
template <bool STORE = false, class T>
void expand_tile(float* const* y, int64_t nt, const float* buf, int64_t rank_pad, const T* b, int64_t ldb,
                 int64_t rank, float sc, int64_t c0, int64_t c1) {
  const float* cf_all[LORA_MAX_TILE];
  for (int64_t i = 0; i < nt; ++i) cf_all[i] = buf + i * rank_pad;
  int64_t c = c0;
#ifdef __AVX512F__
  if (nt == 1)  // a decode tile: 48 columns at a time first
    for (; c + 48 <= c1; c += 48) expand_row48<STORE>(y[0] + c, cf_all[0], b + c, ldb, rank, sc);
#endif
  for (; c + 16 <= c1; c += 16)
    for (int64_t i0 = 0; i0 < nt; i0 += 4) {
      float* yr[4];
      const int64_t ti = std::min<int64_t>(4, nt - i0);
      for (int64_t i = 0; i < ti; ++i) yr[i] = y[i0 + i] + c;
      switch (ti) {
        case 4: expand_block<4, STORE>(yr, cf_all + i0, b + c, ldb, rank, sc); break;
        case 3: expand_block<3, STORE>(yr, cf_all + i0, b + c, ldb, rank, sc); break;
        case 2: expand_block<2, STORE>(yr, cf_all + i0, b + c, ldb, rank, sc); break;
        default: expand_block<1, STORE>(yr, cf_all + i0, b + c, ldb, rank, sc); break;
      }
    }
  if (c < c1) expand_cols<STORE>(y, nt, cf_all, b, ldb, rank, sc, c, c1);
}

// One token's delta over columns [c0, c1) of its y row (all in one slice), with expand_tile's arithmetic column for
// column: a column in the 16-wide part of its slice (c < vec_end) sums the rank with fused multiply-adds and adds
// sc * delta fused; a tail column (and every column without AVX2) multiplies and adds separately. So a GEMM that adds
// the delta to its output tile (loom_gemm_lora) gives bitwise what loom_lora_apply adds to that output. b: B's rows
// in the pool's element type T, widened as read.
template <class T>
inline void expand_row(float* y, const float* coef, const T* b, int64_t ldb, int64_t rank, float sc, int64_t c0,
                       int64_t c1, int64_t vec_end) {
  int64_t c = c0;
#ifdef __AVX2__
  const int64_t v1 = std::min(c1, vec_end);
#ifdef __AVX512F__
  for (; c + 48 <= v1; c += 48) expand_row48<false>(y + c, coef, b + c, ldb, rank, sc);
#endif
  for (; c + 24 <= v1; c += 24) {  // three independent fma chains
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 cr = _mm256_broadcast_ss(coef + r);
      const T* br = b + r * ldb + c;
      a0 = _mm256_fmadd_ps(cr, load8(br), a0);
      a1 = _mm256_fmadd_ps(cr, load8(br + 8), a1);
      a2 = _mm256_fmadd_ps(cr, load8(br + 16), a2);
    }
    const __m256 sv = _mm256_set1_ps(sc);
    _mm256_storeu_ps(y + c, _mm256_fmadd_ps(sv, a0, _mm256_loadu_ps(y + c)));
    _mm256_storeu_ps(y + c + 8, _mm256_fmadd_ps(sv, a1, _mm256_loadu_ps(y + c + 8)));
    _mm256_storeu_ps(y + c + 16, _mm256_fmadd_ps(sv, a2, _mm256_loadu_ps(y + c + 16)));
  }
  for (; c + 8 <= v1; c += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r)
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(coef + r), load8(b + r * ldb + c), acc);
    _mm256_storeu_ps(y + c, _mm256_fmadd_ps(_mm256_set1_ps(sc), acc, _mm256_loadu_ps(y + c)));
  }
  for (; c < v1; ++c) {
    float d = 0.f;
    for (int64_t r = 0; r < rank; ++r) d = std::fma(coef[r], to_f32(b[r * ldb + c]), d);
    y[c] = std::fma(sc, d, y[c]);
  }
#else
  (void)vec_end;
#endif
  if (c < c1) expand_cols(&y, 1, &coef, b, ldb, rank, sc, c, c1);
}

// Cache lines to ask for ahead of their use, a chunk at a time: up to 8 byte ranges (adapter rows: a pass item's, or
// the next linear's) that the GEMM's tiles prefetch into L2 while their FMAs run (gemm_with_pass, gemm's fetch).
struct Ahead {
  static constexpr int MAX_RANGES = 8;
  const char* p[MAX_RANGES];
  int64_t n[MAX_RANGES];  // bytes
  static constexpr int per_k = 1;  // lines a k gemm_panel's tiles ask for (PassFetch may ask for more)
  int cnt = 0, cur = 0;
  int64_t off = 0;  // bytes of p[cur] already asked for

  void clear() { cnt = cur = 0, off = 0; }
  void add(const void* q, int64_t bytes) {
    if (bytes > 0 && cnt < MAX_RANGES) p[cnt] = static_cast<const char*>(q), n[cnt++] = bytes;
  }
  bool done() const { return cur >= cnt; }
  // cache lines left to ask for
  int64_t lines() const {
    int64_t l = 0;
    for (int i = cur; i < cnt; ++i) l += (n[i] - (i == cur ? off : 0) + 63) / 64;
    return l;
  }
  // the next up to `lines` cache lines, within one range: (start, lines)
  std::pair<const char*, int64_t> take(int64_t lines) {
    if (done()) return {nullptr, 0};
    const int64_t k = std::min(lines, (n[cur] - off + 63) / 64);
    const char* q = p[cur] + off;
    off += 64 * k;
    if (off >= n[cur]) ++cur, off = 0;
    return {q, k};
  }
  // what is left, read now (touch: plain loads, in order)
  void finish(float& sink) {
    for (; cur < cnt; ++cur, off = 0) touch(p[cur] + off, n[cur] - off, sink);
  }
};

// A linear's adapter pools as the kernels read them: A [S, R, K] and B [R, N], rows ak and bn elements apart (>= K, N:
// a CPU pool's rows may be padded, kernels/cpu_lora.py pool_row), elements of with_type's type dt. An adapter owns
// rank rows from `row` in both.
struct Pools {
  const void* a;
  const void* b;
  int dt;
  int64_t S, R, K, N, ak, bn;

  template <class T>
  const T* a_rows(int64_t s, int64_t row) const { return static_cast<const T*>(a) + (s * R + row) * ak; }
  template <class T>
  const T* b_rows(int64_t row) const { return static_cast<const T*>(b) + row * bn; }
  // bytes of an adapter's rows (with their padding)
  int64_t bytes(int64_t rank) const { return rank * (S * ak + bn) * type_bytes(dt); }
  // its rows as Ahead's ranges: A slice by slice, then B
  void rows(int64_t row, int64_t rank, Ahead& ah) const {
    const int64_t es = type_bytes(dt);
    for (int64_t s = 0; s < S; ++s) ah.add(static_cast<const char*>(a) + (s * R + row) * ak * es, rank * ak * es);
    ah.add(static_cast<const char*>(b) + row * bn * es, rank * bn * es);
  }

  // sweep: an adapter's A rows (every slice) and B rows loaded (touch) before a token's shrink and expand read them:
  // A's slices one after another beside B, two streams in flight. Unloaded, the shrink reads rank rows of A at a time
  // and the expand all rank rows of B 48 columns at a time, strided streams the hardware keeps few loads in flight for
  // (32 decode tokens on 32 adapters, all layers of the default model, Zen 5 core: 33.4-34.3 -> 23.5-25.3 ms added to
  // the GEMMs in scripts/bench_lora_floor.py; B alone loaded first: 26.2-27.9).
  template <class T>
  void sweep(int64_t row, int64_t rank, float& sink) const {
    const T* bb = b_rows<T>(row);
    const int64_t na = rank * ak, nb = rank * bn;
    int64_t ib = 0;
    for (int64_t s = 0; s < S; ++s) {
      const T* as = a_rows<T>(s, row);
      const int64_t n = std::min(na, nb - ib) / 16 * 16;  // beside the next part of B
      touch(as, bb + ib, n, sink);
      touch(as + n, na - n, sink);
      ib += n;
    }
    touch(bb + ib, nb - ib, sink);
  }
};

// Work items of a LoRA pass: tiles of up to LORA_MAX_TILE tokens of one group with a rank (fewer tokens per tile
// when that would leave threads idle).
struct LoraItems {
  std::vector<int64_t> g, t0;
  int64_t tile = 1, max_rank = 0;
  LoraItems(const int32_t* seg, const int32_t* ranks, int64_t G, int nthreads) {
    const int64_t per_thread = (seg[G] - seg[0] + nthreads - 1) / std::max(1, nthreads);
    tile = std::min<int64_t>(LORA_MAX_TILE, std::max<int64_t>(1, per_thread));
    for (int64_t k = 0; k < G; ++k) {
      if (ranks[k] <= 0) continue;
      max_rank = std::max<int64_t>(max_rank, ranks[k]);
      for (int64_t t = seg[k]; t < seg[k + 1]; t += tile) {
        g.push_back(k);
        t0.push_back(t);
      }
    }
  }
  int64_t size() const { return int64_t(g.size()); }
};

// One LoRA pass's arguments (loom_lora_apply's) and its work item: a tile of one group's tokens, its adapter's rows
// loaded, shrunk and expanded. STORE: each token's unscaled delta goes to `out` instead of being added to y, row i
// (stride out_ld) for tok[i] (lora_combine adds it later, bitwise as the add here).
struct LoraPass {
  const float* x;
  int64_t xs;
  Pools pools;
  const int64_t* offs;
  float* y;
  int64_t ys;
  const int64_t *tok;
  const int32_t *seg, *rows, *ranks;
  const float* scal;
  int64_t G;
  LoraItems items;

  struct Scratch {
    std::vector<float> buf;  // [slice][tile token][rank]
    std::vector<const float*> xr;
    std::vector<float*> yr;
    float sink = 0.f;  // touch's loads
    explicit Scratch(const LoraPass& p)
        : buf(p.items.tile * p.pools.S * p.rank_pad()), xr(p.items.tile), yr(p.items.tile) {}
  };
  int64_t rank_pad() const { return (items.max_rank + 3) / 4 * 4; }

  // item w's adapter rows (A slice by slice, then B)
  void rows_of(int64_t w, Ahead& ah) const {
    const int64_t g = items.g[w];
    ah.clear();
    pools.rows(rows[g], ranks[g], ah);
  }
  // bytes of item w's adapter rows
  int64_t bytes_of(int64_t w) const { return pools.bytes(ranks[items.g[w]]); }
  // cache lines of all the items' adapter rows
  int64_t lines() const {
    int64_t n = 0;
    for (int64_t w = 0; w < items.size(); ++w) n += (bytes_of(w) + 63) / 64;
    return n;
  }

  // FETCHED: the rows are in cache already (rows_of's ranges, asked for ahead), so no Pools::sweep first
  template <bool STORE = false, bool FETCHED = false>
  void run(int64_t w, Scratch& sc, float* out = nullptr, int64_t out_ld = 0) const {
    const int64_t g = items.g[w], t0 = items.t0[w], nt = std::min<int64_t>(items.tile, seg[g + 1] - t0);
    const int64_t tile = items.tile, rp = rank_pad();
    for (int64_t i = 0; i < nt; ++i) {
      sc.xr[i] = x + tok[t0 + i] * xs;
      sc.yr[i] = STORE ? out + (t0 + i) * out_ld : y + tok[t0 + i] * ys;
    }
    const Pools& p = pools;
    with_type(p.dt, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!FETCHED) p.sweep<T>(rows[g], ranks[g], sc.sink);
      for (int64_t s = 0; s < p.S; ++s)
        shrink_tile(sc.xr.data(), nt, InPool<T>{p.a_rows<T>(s, rows[g]), p.ak, ranks[g]}, p.K, ranks[g],
                    sc.buf.data() + s * tile * rp, rp);
      for (int64_t s = 0; s < p.S; ++s)
        expand_tile<STORE>(sc.yr.data(), nt, sc.buf.data() + s * tile * rp, rp, p.b_rows<T>(rows[g]), p.bn, ranks[g],
                           scal[g], offs[s], offs[s + 1]);
    });
  }
};

// y += scal * d for one token's row, slice by slice, with expand_tile's arithmetic for each column: a column in the
// 16-wide part of its slice gets a fused multiply-add (with AVX2), a tail column a multiply, then an add.
inline void lora_combine(float* y, const float* d, const int64_t* offs, int64_t S, float sc) {
  for (int64_t s = 0; s < S; ++s) {
    int64_t c = offs[s];
#ifdef __AVX2__
    const int64_t vec_end = offs[s] + (offs[s + 1] - offs[s]) / 16 * 16;
    const __m256 sv = _mm256_set1_ps(sc);
    for (; c < vec_end; c += 8)
      _mm256_storeu_ps(y + c, _mm256_fmadd_ps(sv, _mm256_loadu_ps(d + c), _mm256_loadu_ps(y + c)));
#endif
    for (; c < offs[s + 1]; ++c) y[c] += sc * d[c];
  }
}

// loom_lora_apply's work: the pass's items in parallel
void run_pass(const LoraPass& pass, int nthreads) {
  const int64_t n_items = pass.items.size();
  if (n_items == 0) return;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(nthreads, n_items)))
  {
    LoraPass::Scratch sc(pass);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) pass.run(w, sc);
    keep(sc.sink);
  }
}

// run_pass on bfloat16 rows x and y: the groups' token rows of x and of y's first offs[S] columns widened to float32
// (exact) into scratch, the float32 pass over them, each rounded back to bfloat16 once. Bitwise what widening all of
// x and y, the pass and rounding all of y give (a row no group changes comes back as it was), the bfloat16 engine's
// LoRA both where its Python layers run it (loom_lora_apply_bf16) and where the C++ layer does (layer.cpp), without
// two passes over all of x and y.
void run_pass_bf16(const bf16_t* x, int64_t xs, const Pools& pools, const int64_t* offs, bf16_t* y, int64_t ys,
                   const int64_t* tok, const int32_t* seg, const int32_t* rows, const int32_t* ranks, const float* scal,
                   int64_t G, int nthreads) {
  const int64_t first = G > 0 ? seg[0] : 0, n = G > 0 ? seg[G] - first : 0, K = pools.K, N = offs[pools.S];
  if (n <= 0) return;
  std::unique_ptr<float[]> xw(new float[n * K]), yw(new float[n * N]);
  std::vector<int64_t> idx(first + n);  // the pass's token indices: token t's rows of xw and yw
  for (int64_t t = first; t < first + n; ++t) idx[t] = t - first;
  // threads only for a prefill chunk's rows: a decode step's few rows cost less than waking them
  const int nt = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, n)));
  const bool many = n * (K + N) >= (int64_t(1) << 18);
#pragma omp parallel for num_threads(nt) if (many)
  for (int64_t i = 0; i < n; ++i) {
    widen(x + tok[first + i] * xs, xw.get() + i * K, K);
    widen(y + tok[first + i] * ys, yw.get() + i * N, N);
  }
  run_pass(LoraPass{xw.get(), K, pools, offs, yw.get(), N, idx.data(), seg, rows, ranks, scal, G,
                    LoraItems(seg, ranks, G, nthreads)},
           nthreads);
#pragma omp parallel for num_threads(nt) if (many)
  for (int64_t i = 0; i < n; ++i) narrow(yw.get() + i * N, y + tok[first + i] * ys, N);
}

}  // namespace

extern "C" {

void loom_lora_apply(const float* x, int64_t xs, const void* a, int dt, int64_t S, int64_t R, int64_t K, int64_t ak,
                     const void* b, int64_t N, int64_t bn, const int64_t* offs, float* y, int64_t ys,
                     const int64_t* tok, const int32_t* seg, const int32_t* rows, const int32_t* ranks,
                     const float* scal, int64_t G, int nthreads) {
  run_pass(LoraPass{x, xs, Pools{a, b, dt, S, R, K, N, ak, bn}, offs, y, ys, tok, seg, rows, ranks, scal, G,
                    LoraItems(seg, ranks, G, nthreads)},
           nthreads);
}

// loom_lora_apply on bfloat16 x and y (run_pass_bf16)
void loom_lora_apply_bf16(const bf16_t* x, int64_t xs, const void* a, int dt, int64_t S, int64_t R, int64_t K,
                          int64_t ak, const void* b, int64_t N, int64_t bn, const int64_t* offs, bf16_t* y, int64_t ys,
                          const int64_t* tok, const int32_t* seg, const int32_t* rows, const int32_t* ranks,
                          const float* scal, int64_t G, int nthreads) {
  run_pass_bf16(x, xs, Pools{a, b, dt, S, R, K, N, ak, bn}, offs, y, ys, tok, seg, rows, ranks, scal, G, nthreads);
}

}  // extern "C"
