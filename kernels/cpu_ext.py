"""C++ CPU kernels: paged attention reading the KV cache in place, multi-LoRA over adapter rows in place, the
GEMM of linear layers over weights packed once into register-tile panels, and the pointwise work between them.

Plain C++ with a C ABI (no torch headers: it builds in seconds), compiled once per machine with the system
compiler into a per-user cache folder (never the repository) keyed by a hash of the source, flags and compiler
(concurrent first builds take turns on a lock file; the library appears by atomic rename), and called through ctypes
(which releases the GIL). Float32 only. AVX2/FMA intrinsics when the CPU has them (exp: the Cephes
polynomial, about 1 ulp), plain loops otherwise. Parallel with OpenMP over independent work items, with
torch's thread count; the library links libgomp.so.1, which resolves to the copy torch already loaded, so
both share one thread pool. `load()` returns None when there is no compiler or the build fails: the
callers then run the PyTorch references.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("loom")

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

const float NEG_INF = -std::numeric_limits<float>::infinity();

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 or moderate x: Cephes' expf (range reduction by ln 2, degree-5 polynomial)
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX2__
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, const float* __restrict x, float a, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

// x[i] = exp(x[i] - m); returns the sum
inline float exp_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX2__
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  s = hsum(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
}

// Up to 3 query rows that share a kv head and a key range (the query heads of one kv head, GQA) go through
// the keys together: each key / value vector is loaded once for all of them.

// s[g * ld + j] = q_g . (k_j + off), g < GR, for n key rows of D floats
template <int GR>
inline void dots(const float* const* q, const float* const* keys, int64_t off, int64_t n, int64_t D, float* s,
                 int64_t ld) {
  int64_t j = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; j + 4 <= n; j += 4) {
      __m256 acc[GR][4];
      _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g)
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
      const float* k[4] = {keys[j] + off, keys[j + 1] + off, keys[j + 2] + off, keys[j + 3] + off};
      for (int64_t d = 0; d < D; d += 8) {
        __m256 qv[GR];
        _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g) qv[g] = _mm256_loadu_ps(q[g] + d);
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
          const __m256 kv = _mm256_loadu_ps(k[i] + d);
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
    for (int g = 0; g < GR; ++g) s[g * ld + j] = dot(q[g], keys[j] + off, D);
}

#ifdef __AVX2__
// acc_g[0:8*NC] += sum_j p[g * ld + j] * (v_j + off)[0:8*NC], the accumulators held in registers
template <int GR, int NC>
inline void pv_block(float* const* acc, const float* p, int64_t ld, const float* const* vals, int64_t off,
                     int64_t n) {
  __m256 a[GR][NC];
  _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g)
    _Pragma("GCC unroll 4") for (int c = 0; c < NC; ++c) a[g][c] = _mm256_loadu_ps(acc[g] + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = vals[j] + off;
    __m256 w[GR];
    _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g) w[g] = _mm256_set1_ps(p[g * ld + j]);
    _Pragma("GCC unroll 4") for (int c = 0; c < NC; ++c) {
      const __m256 vv = _mm256_loadu_ps(v + 8 * c);
      _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g) a[g][c] = _mm256_fmadd_ps(w[g], vv, a[g][c]);
    }
  }
  _Pragma("GCC unroll 3") for (int g = 0; g < GR; ++g)
    _Pragma("GCC unroll 4") for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc[g] + 8 * c, a[g][c]);
}
#endif

// acc_g[0:D] += sum_j p[g * ld + j] * (v_j + off), g < GR
template <int GR>
inline void pv(float* const* acc, const float* p, int64_t ld, const float* const* vals, int64_t off, int64_t n,
               int64_t D) {
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {  // 32 floats at a time: GR x 4 accumulators stay in registers
      float* a[GR];
      for (int g = 0; g < GR; ++g) a[g] = acc[g] + d0;
      switch (std::min<int64_t>(4, (D - d0) / 8)) {
        case 4: pv_block<GR, 4>(a, p, ld, vals, off + d0, n); break;
        case 3: pv_block<GR, 3>(a, p, ld, vals, off + d0, n); break;
        case 2: pv_block<GR, 2>(a, p, ld, vals, off + d0, n); break;
        default: pv_block<GR, 1>(a, p, ld, vals, off + d0, n); break;
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int g = 0; g < GR; ++g) axpy(acc[g], vals[j] + off, p[g * ld + j], D);
}

constexpr int64_t KEY_TILE = 128;  // keys per online-softmax step (their K/V rows stay in L1/L2 for all rows)

// One query row: its vector, where its output goes, its absolute position, its kv head's offset in a cache row.
struct Row {
  const float* q;
  float* o;
  int64_t qpos, head_off;
};

struct Cache {
  const float* k;
  const float* v;
  const int32_t* table;  // this sequence's row of the block table
  int64_t block_size, row_stride, D;  // row_stride = KVH * D: one position's keys of every kv head
};

struct Scratch {
  std::vector<const float*> kp, vp;
  std::vector<float> s, acc, m, l;
};

// Attention of query rows of one sequence over its cached keys lo(r) <= k <= qpos(r), lo(r) = window > 0 ?
// qpos(r) - window + 1 : 0, read in place through the block table: flash-style over tiles of KEY_TILE positions
// (online softmax); each tile's rows (all kv heads of a position are contiguous) are located once and read from
// memory once for all query rows, which may belong to several kv heads. Rows are ordered by ascending qpos.
void attend_rows(const Row* rows, int64_t nq, const Cache& c, float scale, int64_t window, float softcap,
                 Scratch& w) {
  const int64_t D = c.D, bs = c.block_size;
  auto lo_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, rows[r].qpos - window + 1) : int64_t(0); };
  int64_t kmin = lo_of(0);
  for (int64_t r = 1; r < nq; ++r) kmin = std::min(kmin, lo_of(r));
  const int64_t kmax = rows[nq - 1].qpos;
  w.kp.resize(KEY_TILE);
  w.vp.resize(KEY_TILE);
  w.s.resize(3 * KEY_TILE);
  w.acc.assign(nq * D, 0.f);
  w.m.assign(nq, NEG_INF);
  w.l.assign(nq, 0.f);
  for (int64_t t0 = kmin; t0 <= kmax; t0 += KEY_TILE) {
    const int64_t t1 = std::min(kmax + 1, t0 + KEY_TILE);
    for (int64_t p = t0; p < t1;) {  // one block-table lookup per block, not per position
      const int64_t in = p % bs, end = std::min(t1, p - in + bs);
      int64_t off = (int64_t(c.table[p / bs]) * bs + in) * c.row_stride;
      for (; p < end; ++p, off += c.row_stride) {
        w.kp[p - t0] = c.k + off;
        w.vp[p - t0] = c.v + off;
      }
    }
    for (int64_t r = 0; r < nq;) {
      // rows r .. r + gr - 1 share a kv head and a position (so a key range): at most 3 at a time
      int64_t gr = 1;
      while (gr < 3 && r + gr < nq && rows[r + gr].qpos == rows[r].qpos && rows[r + gr].head_off == rows[r].head_off)
        ++gr;
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
      const float* const* kp = w.kp.data() + (a - t0);
      const float* const* vp = w.vp.data() + (a - t0);
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
      r += gr;
    }
  }
  for (int64_t r = 0; r < nq; ++r) {  // a row that saw no key (empty sequence) stays zero
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) rows[r].o[d] = w.acc[r * D + d] * inv;
  }
}

// ---- GEMM for linear layers: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W packed once into panels of 24 columns
// (panel p: K rows of W[24p : 24p+24] transposed, zero-padded), a 4 x 24 register tile (12 accumulators).
// While a panel's row tiles run, they prefetch the next panel into L2, so streaming the weights from memory
// overlaps the FMAs instead of stalling the first tile of every panel.
constexpr int64_t NR = 24;

#ifdef __AVX2__
template <int MR>
inline void gemm_tile(const float* A, int64_t lda, const float* B, int64_t K, float* C, int64_t ldc, int64_t nc,
                      const float* bias, const char* pf, int64_t pf_lines) {
  __m256 c[MR][3];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v) c[i][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + NR * k), b1 = _mm256_loadu_ps(B + NR * k + 8),
                 b2 = _mm256_loadu_ps(B + NR * k + 16);
    if ((k & 3) == 0 && (k >> 2) < pf_lines) _mm_prefetch(pf + 64 * (k >> 2), _MM_HINT_T1);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(A + i * lda + k);
      c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
      c[i][2] = _mm256_fmadd_ps(a, b2, c[i][2]);
    }
  }
  alignas(32) float tmp[NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
    _Pragma("GCC unroll 3") for (int v = 0; v < 3; ++v) _mm256_store_ps(tmp + 8 * v, c[i][v]);
    float* row = C + i * ldc;
    for (int64_t j = 0; j < nc; ++j) row[j] = bias ? tmp[j] + bias[j] : tmp[j];
  }
}
#else
template <int MR>
inline void gemm_tile(const float* A, int64_t lda, const float* B, int64_t K, float* C, int64_t ldc, int64_t nc,
                      const float* bias, const char*, int64_t) {
  float c[MR][NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < MR; ++i)
      for (int64_t j = 0; j < NR; ++j) c[i][j] += A[i * lda + k] * B[NR * k + j];
  for (int i = 0; i < MR; ++i)
    for (int64_t j = 0; j < nc; ++j) C[i * ldc + j] = bias ? c[i][j] + bias[j] : c[i][j];
}
#endif

}  // namespace

extern "C" {

// q [B, H, D] (strides qs0, qs1; D contiguous); caches [blocks, block_size, KVH, D] contiguous;
// block_tables [B, M] int32 contiguous; seq_lens [B] int32; out like q (strides os0, os1).
// Work items: a sequence with all its heads (each position's row of K/V read once, whole), or - with too few
// sequences to keep the threads busy - a sequence's kv head with its query heads.
void loom_paged_decode(const float* q, int64_t qs0, int64_t qs1, const float* kc, const float* vc,
                       int64_t block_size, int64_t KVH, int64_t D, const int32_t* bt, int64_t M,
                       const int32_t* seq_lens, int64_t B, int64_t H, float* out, int64_t os0, int64_t os1,
                       float scale, int64_t window, float softcap, int nthreads) {
  const int64_t G = H / KVH, split = B >= 2 * nthreads ? 1 : KVH, per = KVH / split;
#pragma omp parallel num_threads(nthreads)
  {
    Scratch scratch;
    std::vector<Row> rows(per * G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < B * split; ++i) {
      const int64_t b = i / split, h0 = (i % split) * per;
      for (int64_t r = 0; r < per * G; ++r) {
        const int64_t h = h0 * G + r;  // query head
        rows[r] = {q + b * qs0 + h * qs1, out + b * os0 + h * os1, int64_t(seq_lens[b]) - 1, (h / G) * D};
      }
      const Cache c{kc, vc, bt + b * M, block_size, KVH * D, D};
      attend_rows(rows.data(), per * G, c, scale, window, softcap, scratch);
    }
  }
}

// q [T, H, D]; sequence s owns query rows [cu[s], cu[s+1]) at positions seq_lens[s] - q_len + i.
// Work items: (sequence, tile of `tile` queries, kv head) with the tile's queries of all the kv head's query heads.
void loom_paged_prefill(const float* q, int64_t qs0, int64_t qs1, const float* kc, const float* vc,
                        int64_t block_size, int64_t KVH, int64_t D, const int32_t* cu, const int32_t* seq_lens,
                        int64_t S, const int32_t* bt, int64_t M, int64_t H, float* out, int64_t os0, int64_t os1,
                        float scale, int64_t window, float softcap, int64_t tile, int nthreads) {
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
    Scratch scratch;
    std::vector<Row> rows(tile * G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) {
      const int64_t it = w / KVH, h = w % KVH, s = item_seq[it], t0 = item_t0[it];
      const int64_t nq = std::min<int64_t>(tile, cu[s + 1] - t0);
      const int64_t first = int64_t(seq_lens[s]) - (cu[s + 1] - cu[s]) + (t0 - cu[s]);  // position of row t0
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t t = t0 + i, qh = h * G + g;
          rows[i * G + g] = {q + t * qs0 + qh * qs1, out + t * os0 + qh * os1, first + i, h * D};
        }
      const Cache c{kc, vc, bt + s * M, block_size, KVH * D, D};
      attend_rows(rows.data(), nq * G, c, scale, window, softcap, scratch);
    }
  }
}

// LoRA for groups of at most max_tokens tokens (the caller runs bigger ones as GEMMs): each rank row of A and B
// is read once per group, in place. seg [G+1], rows / ranks [G] int32; scalings [G] float32; tok [T] int64.
// shrink: buf[s, i, r] = x[tok[i]] . a[s, rows[g] + r]   (x rows of stride xs; a [S, R, K]; buf [S, T, MR])
void loom_lora_shrink(const float* x, int64_t xs, const float* a, int64_t S, int64_t R, int64_t K,
                      const int64_t* tok, float* buf, int64_t T, int64_t MR, const int32_t* seg, const int32_t* rows,
                      const int32_t* ranks, int64_t G, int64_t max_tokens, int nthreads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t w = 0; w < G * S; ++w) {
    const int64_t g = w / S, s = w % S, a0 = seg[g], a1 = seg[g + 1];
    if (a1 == a0 || a1 - a0 > max_tokens) continue;
    for (int64_t r = 0; r < ranks[g]; ++r) {
      const float* arow = a + (s * R + rows[g] + r) * K;
      for (int64_t i = a0; i < a1; ++i) buf[(s * T + i) * MR + r] = dot(x + tok[i] * xs, arow, K);
    }
  }
}

// expand: y[tok[i], offs[s]:offs[s+1]] += scalings[g] * sum_r buf[s, i, r] * b[rows[g] + r, offs[s]:offs[s+1]]
// (b [R, N]; y rows of stride ys). One work item per group: groups own disjoint tokens, so no two threads
// write one row of y.
void loom_lora_expand(const float* buf, int64_t T, int64_t MR, const float* b, int64_t N, float* y, int64_t ys,
                      const int64_t* tok, const int64_t* offs, int64_t S, const int32_t* seg, const int32_t* rows,
                      const int32_t* ranks, const float* scalings, int64_t G, int64_t max_tokens, int nthreads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t g = 0; g < G; ++g) {
    const int64_t a0 = seg[g], a1 = seg[g + 1];
    if (a1 == a0 || a1 - a0 > max_tokens) continue;
    for (int64_t r = 0; r < ranks[g]; ++r) {
      const float* brow = b + (rows[g] + r) * N;
      for (int64_t i = a0; i < a1; ++i) {
        float* yrow = y + tok[i] * ys;
        for (int64_t s = 0; s < S; ++s)
          axpy(yrow + offs[s], brow + offs[s], scalings[g] * buf[(s * T + i) * MR + r], offs[s + 1] - offs[s]);
      }
    }
  }
}


// k/v rows of T tokens (row strides ks / vs, each KVH * D contiguous floats) into cache slots (-1: skip)
void loom_store_kv(const float* k, int64_t ks, const float* v, int64_t vs, float* kc, float* vc, const int64_t* slots,
                   int64_t T, int64_t row) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    std::memcpy(kc + s * row, k + t * ks, row * sizeof(float));
    std::memcpy(vc + s * row, v + t * vs, row * sizeof(float));
  }
}

// ---- pointwise work between the GEMMs (one call per layer part instead of ~10 small torch ops)

// res_out = x + res (or x); out = res_out * (1 / sqrt(mean(res_out^2) + eps)) * w, per row of N
void loom_rms_norm(const float* x, int64_t xs, const float* res, int64_t rs, const float* w, float eps, float* out,
                   int64_t os, float* res_out, int64_t ros, int64_t T, int64_t N) {
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
                 float* k, int64_t ks0, int64_t ks1, int64_t KVH, int64_t T) {
  const int64_t half = D / 2;
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

// out[t, i] = silu(x[t, i]) * x[t, I + i], silu(v) = v / (1 + exp(-v)); x rows of stride xs, out rows of I
void loom_silu_mul(const float* x, int64_t xs, float* out, int64_t T, int64_t I) {
  for (int64_t t = 0; t < T; ++t) {
    const float* g = x + t * xs;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
      const __m256 v = _mm256_loadu_ps(g + i);
      const __m256 e = exp256(_mm256_sub_ps(zero, v));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

// W [N, K] row-major -> panels Bp [ceil(N / 24), K, 24]
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
// parallel over panels.
void loom_gemm(const float* A, int64_t lda, int64_t M, int64_t K, const float* Bp, int64_t N, const float* bias,
               float* C, int64_t ldc, int nthreads) {
  constexpr int MR = 4;
  const int64_t P = (N + NR - 1) / NR, tiles = (M + MR - 1) / MR;
  const int64_t panel_lines = (K * NR * 4 + 63) / 64, per_tile = (panel_lines + tiles - 1) / tiles;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t p = 0; p < P; ++p) {
    const float* B = Bp + p * K * NR;
    const char* next = reinterpret_cast<const char*>(p + 1 < P ? B + K * NR : B);
    const int64_t nc = std::min(NR, N - p * NR);
    const float* bp = bias ? bias + p * NR : nullptr;
    for (int64_t t = 0, m = 0; m < M; ++t, m += MR) {
      const int64_t lo = std::min(panel_lines, t * per_tile), n = std::min(panel_lines, lo + per_tile) - lo;
      const float* a = A + m * lda;
      float* c = C + m * ldc + p * NR;
      switch (std::min<int64_t>(MR, M - m)) {
        case 4: gemm_tile<4>(a, lda, B, K, c, ldc, nc, bp, next + 64 * lo, n); break;
        case 3: gemm_tile<3>(a, lda, B, K, c, ldc, nc, bp, next + 64 * lo, n); break;
        case 2: gemm_tile<2>(a, lda, B, K, c, ldc, nc, bp, next + 64 * lo, n); break;
        default: gemm_tile<1>(a, lda, B, K, c, ldc, nc, bp, next + 64 * lo, n); break;
      }
    }
  }
}

}  // extern "C"
"""

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "loom_paged_decode": [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, _I64, _I64,
                          _F32, _I64, _F32, _I32],
    "loom_paged_prefill": [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _P, _I64, _I64,
                           _F32, _I64, _F32, _I64, _I32],
    "loom_lora_shrink": [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _P, _I64, _I64, _I32],
    "loom_lora_expand": [_P, _I64, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I32],
    "loom_store_kv": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64],
    "loom_rms_norm": [_P, _I64, _P, _I64, _P, _F32, _P, _I64, _P, _I64, _I64, _I64],
    "loom_rotary": [_P, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64],
    "loom_silu_mul": [_P, _I64, _P, _I64, _I64],
    "loom_gemm_pack": [_P, _I64, _I64, _P],
    "loom_gemm": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32],
}


@functools.lru_cache(maxsize=None)
def native_isa() -> tuple[str, ...]:
    """AVX2+FMA when this CPU has them, else nothing (plain loops); the build is cached per flag set."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return ("-mavx2", "-mfma") if "avx2" in flags and "fma" in flags else ()


def cache_dir() -> Path:
    """Per user and machine, never the repository: $LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom or ~/.cache/loom."""
    root = os.environ.get("LOOM_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                            os.path.expanduser("~/.cache"), "loom")
    return Path(root) / "cpu_kernels"


def _compile(cxx: str, flags: list[str], target: Path) -> None:
    """Concurrent first builds (two server instances, two test processes) take turns on a lock file; the library
    appears under its final name only once complete (rename), so no process ever loads a partial file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if target.exists():  # another process built it while this one waited
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "kernels.cpp"
            src.write_text(_SOURCE)
            out = Path(tmp) / target.name
            subprocess.run([cxx, *flags, str(src), "-o", str(out)], check=True, capture_output=True, text=True,
                           timeout=300)
            os.replace(out, target)


@functools.lru_cache(maxsize=None)
def build(isa: tuple[str, ...]):
    """The library built with these instruction-set flags (cached on disk by source, flags and compiler), or None
    after one warning when it cannot be built or loaded: no compiler, a failed compile, an unwritable cache."""
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        log.warning("loom CPU kernels unavailable (no C++ compiler %r; set CXX); using the PyTorch references", cxx)
        return None
    # no FMA contraction of plain C++ expressions: the pointwise kernels round like the PyTorch references
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c++17", *isa]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256("\0".join([_SOURCE, version, *flags]).encode()).hexdigest()[:20]
        target = cache_dir() / f"loom_cpu_kernels_{key}.so"
        if not target.exists():
            _compile(cxx, flags, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:  # a failed build: the references still work
        detail = (getattr(e, "stderr", "") or "").strip()
        log.warning("loom CPU kernels unavailable (%s: %s%s); using the PyTorch references", type(e).__name__, e,
                    f"\n{detail[-2000:]}" if detail else "")
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib


_lock = threading.Lock()


def enabled() -> bool:
    """LOOM_CPU_KERNELS=0 turns loom's CPU fast paths off (these kernels, pre-packed GEMMs): the references run."""
    return os.environ.get("LOOM_CPU_KERNELS", "1") != "0"


def load():
    """The library (ctypes.CDLL; functions loom_*), or None (turned off, or it cannot be built). Builds on first
    use (a few seconds, once per machine: later starts load it from cache_dir())."""
    if not enabled():
        return None
    with _lock:  # the engine thread and a test thread may race to build it
        return build(native_isa())


def describe() -> str:
    """One line for the engine's start: which CPU path runs and why."""
    if not enabled():
        return "CPU kernels off (LOOM_CPU_KERNELS=0): the PyTorch references run"
    lib = load()
    if lib is None:
        return "CPU kernels unavailable (see the warning above): the PyTorch references run"
    return f"CPU kernels: loom C++ ({'AVX2' if native_isa() else 'no AVX2'}) from {lib._name}"


def usable(*tensors: torch.Tensor) -> bool:
    """True when every tensor is float32 on CPU (what the C++ kernels take)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def nthreads() -> int:
    return torch.get_num_threads()
