// Paged attention reading the KV cache in place (decode and prefill), and the KV store.

namespace {

// The cache is [blocks, KVH, block_size, D] (kernels/kv_layout.py): a kv head's rows of one block are contiguous.
// Decode reads the cache through the block table: blocks scattered in memory, a pattern the hardware prefetchers do
// not follow across blocks, and software prefetches did not keep enough loads in flight (at most 14 GB/s of a core's
// 37, measured on the former position-major layout). So decode sweeps the rows itself: one plain load per cache line,
// the rows of the next key tile spread between the kv heads' passes over the current one, which then read from cache
// (decode attention of the default model, 32 sequences at 175 tokens, 30 layers, Zen 5 core: 17.7 -> 12.9 ms,
// 2 threads 9.6 -> 7.8). Prefill reads each key range once per query tile, mostly from cache: no sweep there.

// Up to 3 query rows that share a kv head and a key range (the query heads of one kv head, GQA) go through
// the keys together: each key / value vector is loaded once for all of them.

// Keys and values of KT: float, or bfloat16 (a 16-bit cache, widened as they are loaded; the math float32).

// q . k over n elements, k of any element type (the vector paths below cover D % 8 == 0)
template <class KT>
inline float dot_any(const float* q, const KT* k, int64_t n) {
  if constexpr (std::is_same_v<KT, float>) {
    return dot(q, k, n);
  } else {
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += q[i] * to_f32(k[i]);
    return s;
  }
}

// s[g * ld + j] = q_g . (k_j + off), g < GR, for n key rows of D elements
template <int GR, class KT>
inline void dots(const float* const* q, const KT* const* keys, int64_t off, int64_t n, int64_t D, float* s,
                 int64_t ld) {
  int64_t j = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; j + 4 <= n; j += 4) {
      __m256 acc[GR][4];
      _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g)
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
      const KT* k[4] = {keys[j] + off, keys[j + 1] + off, keys[j + 2] + off, keys[j + 3] + off};
      for (int64_t d = 0; d < D; d += 8) {
        __m256 qv[GR];
        _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g) qv[g] = _mm256_loadu_ps(q[g] + d);
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
          const __m256 kv = load8(k[i] + d);
          _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g) acc[g][i] = _mm256_fmadd_ps(qv[g], kv, acc[g][i]);
        }
      }
      _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g) {
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
        _mm_storeu_ps(s + g * ld + j, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
      }
    }
  }
#endif
  for (; j < n; ++j)
    for (int g = 0; g < GR; ++g) s[g * ld + j] = dot_any(q[g], keys[j] + off, D);
}

#ifdef __AVX2__
// acc_g[0:8*NC] += sum_j p[g * ld + j] * (v_j + off)[0:8*NC], the accumulators held in registers
template <int GR, int NC, class KT>
inline void pv_block(float* const* acc, const float* p, int64_t ld, const KT* const* vals, int64_t off,
                     int64_t n) {
  __m256 a[GR][NC];
  _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g)
    _Pragma("GCC unroll 4") for (int c = 0; c < NC; ++c) a[g][c] = _mm256_loadu_ps(acc[g] + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const KT* v = vals[j] + off;
    __m256 w[GR];
    _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g) w[g] = _mm256_set1_ps(p[g * ld + j]);
    _Pragma("GCC unroll 4") for (int c = 0; c < NC; ++c) {
      const __m256 vv = load8(v + 8 * c);
      _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g) a[g][c] = _mm256_fmadd_ps(w[g], vv, a[g][c]);
    }
  }
  _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g)
    _Pragma("GCC unroll 4") for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc[g] + 8 * c, a[g][c]);
}
#endif

// acc_g[0:D] += sum_j p[g * ld + j] * (v_j + off), g < GR
template <int GR, class KT>
inline void pv(float* const* acc, const float* p, int64_t ld, const KT* const* vals, int64_t off, int64_t n,
               int64_t D) {
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {  // 32 floats at a time: GR x 4 accumulators stay in registers
      float* a[GR];
      for (int g = 0; g < GR; ++g) a[g] = acc[g] + d0;
      switch (std::min<int64_t>(4, (D - d0) / 8)) {
        case 4: pv_block<GR, 4, KT>(a, p, ld, vals, off + d0, n); break;
        case 3: pv_block<GR, 3, KT>(a, p, ld, vals, off + d0, n); break;
        case 2: pv_block<GR, 2, KT>(a, p, ld, vals, off + d0, n); break;
        default: pv_block<GR, 1, KT>(a, p, ld, vals, off + d0, n); break;
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int g = 0; g < GR; ++g) {
      if constexpr (std::is_same_v<KT, float>) {
        axpy(acc[g], vals[j] + off, p[g * ld + j], D);
      } else {
        const KT* v = vals[j] + off;
        for (int64_t d = 0; d < D; ++d) acc[g][d] += p[g * ld + j] * to_f32(v[d]);
      }
    }
}

constexpr int64_t KEY_TILE = 128;  // keys per online-softmax step (their K/V rows stay in L1/L2 for all rows)

// One query row: its vector, where its output goes, its absolute position, its kv head's offset in a cache block.
struct Row {
  const float* q;
  float* o;
  int64_t qpos, head_off;
};

template <class KT>
struct Cache {
  const KT* k;
  const KT* v;
  const int32_t* table;  // this sequence's row of the block table
  int64_t block_size, KVH, D;  // a block: KVH runs of block_size rows of D

  int64_t block_stride() const { return KVH * block_size * D; }
  int64_t head_off(int64_t h) const { return h * block_size * D; }
};

template <class KT>
struct Scratch {
  std::vector<const KT*> kp, vp;
  std::vector<float> s, acc, m, l;
  std::vector<int64_t> heads;  // the head offsets the query rows read
  float sink = 0.f;  // where the sweep's loads go (touch)
};

// Attention of query rows of one sequence over its cached keys lo(r) <= k <= qpos(r), lo(r) = window > 0 ?
// qpos(r) - window + 1 : 0, read in place through the block table: flash-style over tiles of KEY_TILE positions
// (online softmax); each tile's positions are located once (a pointer to a position's row of kv head 0) and read
// from memory once for all query rows, which may belong to several kv heads. Rows are ordered by ascending qpos.
// `sweep`: load the rows ahead of use (decode, above).
template <class KT>
void attend_rows(const Row* rows, int64_t nq, const Cache<KT>& c, float scale, int64_t window, float softcap,
                 Scratch<KT>& w, bool sweep) {
  const int64_t D = c.D, bs = c.block_size;
  auto lo_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, rows[r].qpos - window + 1) : int64_t(0); };
  int64_t kmin = lo_of(0);
  for (int64_t r = 1; r < nq; ++r) kmin = std::min(kmin, lo_of(r));
  const int64_t kmax = rows[nq - 1].qpos;
  auto group_size = [&](int64_t r) {  // rows r .. r + n - 1 share a kv head and a position (so a key range), n <= 3
    int64_t n = 1;
    while (n < 3 && r + n < nq && rows[r + n].qpos == rows[r].qpos && rows[r + n].head_off == rows[r].head_off) ++n;
    return n;
  };
  w.kp.resize(kmax + 1 - kmin);
  w.vp.resize(kmax + 1 - kmin);
  w.s.resize(3 * KEY_TILE);
  w.acc.assign(nq * D, 0.f);
  w.m.assign(nq, NEG_INF);
  w.l.assign(nq, 0.f);
  for (int64_t p = kmin; p <= kmax;) {  // one block-table lookup per block, not per position
    const int64_t in = p % bs, end = std::min(kmax + 1, p - in + bs);
    int64_t off = int64_t(c.table[p / bs]) * c.block_stride() + in * D;
    for (; p < end; ++p, off += D) {
      w.kp[p - kmin] = c.k + off;
      w.vp[p - kmin] = c.v + off;
    }
  }
  // the sweep: the kv heads these query rows read (every one, or one), and how many positions of the next tile to
  // load after each group's pass (a group: the query rows of one kv head, as below)
  w.heads.clear();
  int64_t groups = 0;
  for (int64_t r = 0; r < nq; ++r)
    if (std::find(w.heads.begin(), w.heads.end(), rows[r].head_off) == w.heads.end())
      w.heads.push_back(rows[r].head_off);
  for (int64_t r = 0; r < nq; r += group_size(r)) ++groups;
  const int64_t share = (KEY_TILE + groups - 1) / groups, n_rows = kmax + 1 - kmin;
  int64_t swept = 0;  // positions [0, swept) of kp / vp were loaded
  auto sweep_to = [&](int64_t to) {
    if (!sweep) return;
    for (to = std::min(to, n_rows); swept < to; ++swept)
      for (const int64_t h : w.heads) touch(w.kp[swept] + h, w.vp[swept] + h, D, w.sink);
  };
  for (int64_t t0 = kmin; t0 <= kmax; t0 += KEY_TILE) {
    const int64_t t1 = std::min(kmax + 1, t0 + KEY_TILE);
    sweep_to(t1 - kmin);  // the first tile; later ones were loaded during the previous tile's passes
    for (int64_t r = 0; r < nq;) {
      const int64_t gr = group_size(r);
      const int64_t a = std::max(t0, lo_of(r)), b = std::min(t1, rows[r].qpos + 1);
      if (a >= b) {
        r += gr;
        continue;
      }
      const int64_t n = b - a, off = rows[r].head_off;
      float* s = w.s.data();
      const float* qs[3] = {rows[r].q, gr > 1 ? rows[r + 1].q : nullptr, gr > 2 ? rows[r + 2].q : nullptr};
      float* accs[3] = {w.acc.data() + r * D, gr > 1 ? w.acc.data() + (r + 1) * D : nullptr,
                        gr > 2 ? w.acc.data() + (r + 2) * D : nullptr};
      const KT* const* kp = w.kp.data() + (a - kmin);
      const KT* const* vp = w.vp.data() + (a - kmin);
      if (gr == 3) dots<3>(qs, kp, off, n, D, s, KEY_TILE);
      else if (gr == 2) dots<2>(qs, kp, off, n, D, s, KEY_TILE);
      else dots<1>(qs, kp, off, n, D, s, KEY_TILE);
      for (int64_t g = 0; g < gr; ++g) {
        float* sg = s + g * KEY_TILE;
        float mt = NEG_INF;
        for (int64_t j = 0; j < n; ++j) {
          float x = sg[j] * scale;
          if (softcap > 0.f) x = softcap * std::tanh(x / softcap);
          sg[j] = x;
          mt = std::max(mt, x);
        }
        const float m_old = w.m[r + g], m_new = std::max(m_old, mt);
        const float alpha = m_old == NEG_INF ? 0.f : std::exp(m_old - m_new);
        if (alpha != 1.f)
          for (int64_t d = 0; d < D; ++d) accs[g][d] *= alpha;
        w.l[r + g] = w.l[r + g] * alpha + exp_sum(sg, n, m_new);
        w.m[r + g] = m_new;
      }
      if (gr == 3) pv<3>(accs, s, KEY_TILE, vp, off, n, D);
      else if (gr == 2) pv<2>(accs, s, KEY_TILE, vp, off, n, D);
      else pv<1>(accs, s, KEY_TILE, vp, off, n, D);
      sweep_to(swept + share);
      r += gr;
    }
  }
  for (int64_t r = 0; r < nq; ++r) {  // a row that saw no key (empty sequence) stays zero
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) rows[r].o[d] = w.acc[r * D + d] * inv;
  }
}


// Query and output rows of QT: float read and written in place; bfloat16 widened into float32 rows first, the
// outputs rounded once at the end (QRows).
template <class QT>
struct QRows {
  std::vector<float> q, o;
  QRows(int64_t rows, int64_t D) : q(std::is_same_v<QT, float> ? 0 : rows * D), o(q.size()) {}
  // the Row fields of query row i < rows (its q at qp, its output at op, D elements)
  std::pair<const float*, float*> at(int64_t i, const QT* qp, QT* op, int64_t D) {
    if constexpr (std::is_same_v<QT, float>) {
      return {qp, op};
    } else {
      widen(qp, q.data() + i * D, D);
      return {q.data() + i * D, o.data() + i * D};
    }
  }
  void done(int64_t i, QT* op, int64_t D) {
    if constexpr (!std::is_same_v<QT, float>) narrow(o.data() + i * D, op, D);
  }
};

template <class QT, class KT>
void paged_decode(const QT* q, int64_t qs0, int64_t qs1, const KT* kc, const KT* vc, int64_t block_size, int64_t KVH,
                  int64_t D, const int32_t* bt, int64_t M, const int32_t* seq_lens, int64_t B, int64_t H, QT* out,
                  int64_t os0, int64_t os1, float scale, int64_t window, float softcap, int nthreads) {
  const int64_t G = H / KVH, split = B >= 2 * nthreads ? 1 : KVH, per = KVH / split;
#pragma omp parallel num_threads(nthreads)
  {
    Scratch<KT> scratch;
    QRows<QT> qr(per * G, D);
    std::vector<Row> rows(per * G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < B * split; ++i) {
      const int64_t b = i / split, h0 = (i % split) * per;
      const Cache<KT> c{kc, vc, bt + b * M, block_size, KVH, D};
      for (int64_t r = 0; r < per * G; ++r) {
        const int64_t h = h0 * G + r;  // query head
        const auto [qp, op] = qr.at(r, q + b * qs0 + h * qs1, out + b * os0 + h * os1, D);
        rows[r] = {qp, op, int64_t(seq_lens[b]) - 1, c.head_off(h / G)};
      }
      attend_rows(rows.data(), per * G, c, scale, window, softcap, scratch, true);
      for (int64_t r = 0; r < per * G; ++r) qr.done(r, out + b * os0 + (h0 * G + r) * os1, D);
    }
    keep(scratch.sink);
  }
}

template <class QT, class KT>
void paged_prefill(const QT* q, int64_t qs0, int64_t qs1, const KT* kc, const KT* vc, int64_t block_size, int64_t KVH,
                   int64_t D, const int32_t* cu, const int32_t* seq_lens, int64_t S, const int32_t* bt, int64_t M,
                   int64_t H, QT* out, int64_t os0, int64_t os1, float scale, int64_t window, float softcap,
                   int64_t tile, int nthreads) {
  const int64_t G = H / KVH;
  std::vector<int64_t> item_seq, item_t0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; t += tile) {
      item_seq.push_back(s);
      item_t0.push_back(t);
    }
  const int64_t n_items = int64_t(item_seq.size()) * KVH;
#pragma omp parallel num_threads(nthreads)
  {
    Scratch<KT> scratch;
    QRows<QT> qr(tile * G, D);
    std::vector<Row> rows(tile * G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) {
      const int64_t it = w / KVH, h = w % KVH, s = item_seq[it], t0 = item_t0[it];
      const int64_t nq = std::min<int64_t>(tile, cu[s + 1] - t0);
      const int64_t first = int64_t(seq_lens[s]) - (cu[s + 1] - cu[s]) + (t0 - cu[s]);  // position of row t0
      const Cache<KT> c{kc, vc, bt + s * M, block_size, KVH, D};
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t t = t0 + i, qh = h * G + g;
          const auto [qp, op] = qr.at(i * G + g, q + t * qs0 + qh * qs1, out + t * os0 + qh * os1, D);
          rows[i * G + g] = {qp, op, first + i, c.head_off(h)};
        }
      attend_rows(rows.data(), nq * G, c, scale, window, softcap, scratch, false);
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) qr.done(i * G + g, out + (t0 + i) * os0 + (h * G + g) * os1, D);
    }
  }
}

template <class T>
void store_kv(const T* k, int64_t ks, const T* v, int64_t vs, T* kc, T* vc, const int64_t* slots, int64_t n,
              int64_t block_size, int64_t KVH, int64_t D) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    const int64_t at = (s / block_size) * KVH * block_size * D + (s % block_size) * D;  // kv head 0's row
    for (int64_t h = 0; h < KVH; ++h) {
      std::memcpy(kc + at + h * block_size * D, k + t * ks + h * D, D * sizeof(T));
      std::memcpy(vc + at + h * block_size * D, v + t * vs + h * D, D * sizeof(T));
    }
  }
}

}  // namespace

extern "C" {

// q [B, H, D] (strides qs0, qs1; D contiguous); caches [blocks, KVH, block_size, D] contiguous;
// block_tables [B, M] int32 contiguous; seq_lens [B] int32; out like q (strides os0, os1).
// Work items: a sequence with all its heads (each position's row of K/V read once, whole), or - with too few
// sequences to keep the threads busy - a sequence's kv head with its query heads.
void loom_paged_decode(const float* q, int64_t qs0, int64_t qs1, const float* kc, const float* vc,
                       int64_t block_size, int64_t KVH, int64_t D, const int32_t* bt, int64_t M,
                       const int32_t* seq_lens, int64_t B, int64_t H, float* out, int64_t os0, int64_t os1,
                       float scale, int64_t window, float softcap, int nthreads) {
  paged_decode(q, qs0, qs1, kc, vc, block_size, KVH, D, bt, M, seq_lens, B, H, out, os0, os1, scale, window, softcap,
               nthreads);
}

// loom_paged_decode with bfloat16 q, caches and out (read in place, widened; float32 math)
void loom_paged_decode_bf16(const bf16_t* q, int64_t qs0, int64_t qs1, const bf16_t* kc, const bf16_t* vc,
                            int64_t block_size, int64_t KVH, int64_t D, const int32_t* bt, int64_t M,
                            const int32_t* seq_lens, int64_t B, int64_t H, bf16_t* out, int64_t os0, int64_t os1,
                            float scale, int64_t window, float softcap, int nthreads) {
  paged_decode(q, qs0, qs1, kc, vc, block_size, KVH, D, bt, M, seq_lens, B, H, out, os0, os1, scale, window, softcap,
               nthreads);
}

// q [T, H, D]; sequence s owns query rows [cu[s], cu[s+1]) at positions seq_lens[s] - q_len + i.
// Work items: (sequence, tile of `tile` queries, kv head) with the tile's queries of all the kv head's query heads.
void loom_paged_prefill(const float* q, int64_t qs0, int64_t qs1, const float* kc, const float* vc,
                        int64_t block_size, int64_t KVH, int64_t D, const int32_t* cu, const int32_t* seq_lens,
                        int64_t S, const int32_t* bt, int64_t M, int64_t H, float* out, int64_t os0, int64_t os1,
                        float scale, int64_t window, float softcap, int64_t tile, int nthreads) {
  paged_prefill(q, qs0, qs1, kc, vc, block_size, KVH, D, cu, seq_lens, S, bt, M, H, out, os0, os1, scale, window,
                softcap, tile, nthreads);
}

void loom_paged_prefill_bf16(const bf16_t* q, int64_t qs0, int64_t qs1, const bf16_t* kc, const bf16_t* vc,
                             int64_t block_size, int64_t KVH, int64_t D, const int32_t* cu, const int32_t* seq_lens,
                             int64_t S, const int32_t* bt, int64_t M, int64_t H, bf16_t* out, int64_t os0,
                             int64_t os1, float scale, int64_t window, float softcap, int64_t tile, int nthreads) {
  paged_prefill(q, qs0, qs1, kc, vc, block_size, KVH, D, cu, seq_lens, S, bt, M, H, out, os0, os1, scale, window,
                softcap, tile, nthreads);
}

// k/v rows of T tokens (row strides ks / vs, each KVH * D contiguous floats) into cache slots (-1: skip) of caches
// [blocks, KVH, block_size, D]
void loom_store_kv(const float* k, int64_t ks, const float* v, int64_t vs, float* kc, float* vc, const int64_t* slots,
                   int64_t T, int64_t block_size, int64_t KVH, int64_t D) {
  store_kv(k, ks, v, vs, kc, vc, slots, T, block_size, KVH, D);
}

void loom_store_kv_bf16(const bf16_t* k, int64_t ks, const bf16_t* v, int64_t vs, bf16_t* kc, bf16_t* vc,
                        const int64_t* slots, int64_t T, int64_t block_size, int64_t KVH, int64_t D) {
  store_kv(k, ks, v, vs, kc, vc, slots, T, block_size, KVH, D);
}

}  // extern "C"
