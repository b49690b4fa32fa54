"""C++ CPU kernels: paged attention reading the KV cache in place, multi-LoRA over adapter rows in place.

Plain C++ with a C ABI (no torch headers: it builds in seconds), compiled once per machine with the system
compiler into a cache folder keyed by a hash of the source, flags and compiler, and called through ctypes
(which releases the GIL). Float32 only. AVX2/FMA intrinsics when the CPU has them (exp: the Cephes
polynomial, about 1 ulp), plain loops otherwise. Parallel with OpenMP over independent work items, with
torch's thread count; the library links libgomp.so.1, which resolves to the copy torch already loaded, so
both share one thread pool. `load()` returns None when there is no compiler or the build fails: the
callers then run the PyTorch references.
"""
from __future__ import annotations

import ctypes
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

// s[j] = q . k_j for n key rows (D floats each); four rows at a time share the loads of q
inline void dots(const float* __restrict q, const float* const* keys, int64_t n, int64_t D, float* s) {
  int64_t j = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; j + 4 <= n; j += 4) {
      const float *k0 = keys[j], *k1 = keys[j + 1], *k2 = keys[j + 2], *k3 = keys[j + 3];
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
      }
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      _mm_storeu_ps(s + j, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
  }
#endif
  for (; j < n; ++j) s[j] = dot(q, keys[j], D);
}

#ifdef __AVX2__
// acc[0:8*NC] += sum_j p[j] * v_j[0:8*NC], the accumulator held in registers
template <int NC>
inline void pv_block(float* acc, const float* p, const float* const* vals, int64_t n, int64_t off) {
  __m256 a[NC];
  for (int c = 0; c < NC; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(p[j]);
    const float* v = vals[j] + off;
    for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
#endif

// acc[0:D] += sum_j p[j] * v_j
inline void pv(float* acc, const float* p, const float* const* vals, int64_t n, int64_t D) {
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      switch (std::min<int64_t>(8, (D - d0) / 8)) {
        case 8: pv_block<8>(acc + d0, p, vals, n, d0); break;
        case 7: pv_block<7>(acc + d0, p, vals, n, d0); break;
        case 6: pv_block<6>(acc + d0, p, vals, n, d0); break;
        case 5: pv_block<5>(acc + d0, p, vals, n, d0); break;
        case 4: pv_block<4>(acc + d0, p, vals, n, d0); break;
        case 3: pv_block<3>(acc + d0, p, vals, n, d0); break;
        case 2: pv_block<2>(acc + d0, p, vals, n, d0); break;
        default: pv_block<1>(acc + d0, p, vals, n, d0); break;
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) axpy(acc, vals[j], p[j], D);
}

constexpr int64_t KEY_TILE = 128;  // keys per online-softmax step (their K/V rows stay in L1/L2 for all rows)

struct Cache {
  const float* k;
  const float* v;
  const int32_t* table;  // this sequence's row of the block table
  int64_t block_size, row_stride, head_off, D;
  int64_t slot(int64_t p) const {
    return (table[p / block_size] * block_size + p % block_size) * row_stride + head_off;
  }
};

struct Scratch {
  std::vector<const float*> kp, vp;
  std::vector<float> s, acc, m, l;
};

// Attention of nq query rows of one sequence and one kv head (row r at absolute position qpos[r]) over the keys
// lo(r) <= k <= qpos[r], lo(r) = window > 0 ? qpos[r] - window + 1 : 0, read in place through the block table:
// flash-style over tiles of KEY_TILE keys (online softmax), each tile's K/V rows read from memory once for all
// rows. qpos is ascending.
void attend_rows(const float* q, int64_t q_stride, const int64_t* qpos, int64_t nq, const Cache& c, float scale,
                 int64_t window, float softcap, float* o, int64_t o_stride, Scratch& w) {
  const int64_t D = c.D;
  auto lo_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, qpos[r] - window + 1) : int64_t(0); };
  const int64_t kmin = lo_of(0), kmax = qpos[nq - 1];
  w.kp.resize(KEY_TILE);
  w.vp.resize(KEY_TILE);
  w.s.resize(KEY_TILE);
  w.acc.assign(nq * D, 0.f);
  w.m.assign(nq, NEG_INF);
  w.l.assign(nq, 0.f);
  for (int64_t t0 = kmin; t0 <= kmax; t0 += KEY_TILE) {
    const int64_t t1 = std::min(kmax + 1, t0 + KEY_TILE);
    for (int64_t p = t0; p < t1; ++p) {
      const int64_t off = c.slot(p);
      w.kp[p - t0] = c.k + off;
      w.vp[p - t0] = c.v + off;
    }
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t a = std::max(t0, lo_of(r)), b = std::min(t1, qpos[r] + 1);
      if (a >= b) continue;
      const int64_t n = b - a;
      float* s = w.s.data();
      dots(q + r * q_stride, w.kp.data() + (a - t0), n, D, s);
      float mt = NEG_INF;
      for (int64_t j = 0; j < n; ++j) {
        float x = s[j] * scale;
        if (softcap > 0.f) x = softcap * std::tanh(x / softcap);
        s[j] = x;
        mt = std::max(mt, x);
      }
      const float m_new = std::max(w.m[r], mt);
      const float alpha = w.m[r] == NEG_INF ? 0.f : std::exp(w.m[r] - m_new);
      float* acc = w.acc.data() + r * D;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
      w.l[r] = w.l[r] * alpha + exp_sum(s, n, m_new);
      w.m[r] = m_new;
      pv(acc, s, w.vp.data() + (a - t0), n, D);
    }
  }
  for (int64_t r = 0; r < nq; ++r) {  // a row that saw no key (empty sequence) stays zero
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) o[r * o_stride + d] = w.acc[r * D + d] * inv;
  }
}

}  // namespace

extern "C" {

// q [B, H, D] (strides qs0, qs1; D contiguous); caches [blocks, block_size, KVH, D] contiguous;
// block_tables [B, M] int32 contiguous; seq_lens [B] int32; out like q (strides os0, os1).
void loom_paged_decode(const float* q, int64_t qs0, int64_t qs1, const float* kc, const float* vc,
                       int64_t block_size, int64_t KVH, int64_t D, const int32_t* bt, int64_t M,
                       const int32_t* seq_lens, int64_t B, int64_t H, float* out, int64_t os0, int64_t os1,
                       float scale, int64_t window, float softcap, int nthreads) {
  const int64_t G = H / KVH;
#pragma omp parallel num_threads(nthreads)
  {
    Scratch scratch;
    std::vector<int64_t> qpos(G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < B * KVH; ++i) {
      const int64_t b = i / KVH, h = i % KVH;
      std::fill(qpos.begin(), qpos.end(), int64_t(seq_lens[b]) - 1);
      const Cache c{kc, vc, bt + b * M, block_size, KVH * D, h * D, D};
      attend_rows(q + b * qs0 + h * G * qs1, qs1, qpos.data(), G, c, scale, window, softcap,
                  out + b * os0 + h * G * os1, os1, scratch);
    }
  }
}

// q [T, H, D]; sequence s owns query rows [cu[s], cu[s+1]) at positions seq_lens[s] - q_len + i.
// Work items: (sequence, query tile of `tile` rows, head).
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
  const int64_t n_items = int64_t(item_seq.size()) * H;
#pragma omp parallel num_threads(nthreads)
  {
    Scratch scratch;
    std::vector<int64_t> qpos(tile);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) {
      const int64_t it = w / H, h = w % H, s = item_seq[it], t0 = item_t0[it];
      const int64_t nq = std::min<int64_t>(tile, cu[s + 1] - t0);
      const int64_t first = int64_t(seq_lens[s]) - (cu[s + 1] - cu[s]);  // position of the first query row
      for (int64_t r = 0; r < nq; ++r) qpos[r] = first + (t0 - cu[s]) + r;
      const Cache c{kc, vc, bt + s * M, block_size, KVH * D, (h / G) * D, D};
      attend_rows(q + t0 * qs0 + h * qs1, qs0, qpos.data(), nq, c, scale, window, softcap, out + t0 * os0 + h * os1,
                  os0, scratch);
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
}


def _isa_flags() -> list[str]:
    """AVX2+FMA when this CPU has them (the build is cached per flag set)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return ["-mavx2", "-mfma"] if "avx2" in flags and "fma" in flags else []


def cache_dir() -> Path:
    root = os.environ.get("LOOM_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                            os.path.expanduser("~/.cache"), "loom")
    return Path(root) / "cpu_kernels"


def _compile(cxx: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(_SOURCE)
        out = Path(tmp) / target.name
        subprocess.run([cxx, *flags, str(src), "-o", str(out)], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(out, target)  # atomic: a concurrent build of the same source writes the same file


@functools.lru_cache(maxsize=None)
def _build():
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        log.warning("loom CPU kernels unavailable (no C++ compiler %r); using the PyTorch references", cxx)
        return None
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-std=c++17", *_isa_flags()]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256("\0".join([_SOURCE, version, *flags]).encode()).hexdigest()[:20]
        target = cache_dir() / f"loom_cpu_kernels_{key}.so"
        if not target.exists():
            _compile(cxx, flags, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:  # a failed build: the references still work
        detail = getattr(e, "stderr", "") or ""
        log.warning("loom CPU kernels unavailable (%s: %s %s); using the PyTorch references", type(e).__name__, e,
                    detail[-2000:])
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
        return _build()


def usable(*tensors: torch.Tensor) -> bool:
    """True when every tensor is float32 on CPU (what the C++ kernels take)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def nthreads() -> int:
    return torch.get_num_threads()
