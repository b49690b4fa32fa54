// Shared by every kernel file (they are compiled as one translation unit, this file first): includes and the
// vector helpers.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

const float NEG_INF = -std::numeric_limits<float>::infinity();

// f(std::integral_constant<int, mr>{}) for 1 <= mr <= R: register tiles take their row count as a template argument
template <int R, class F>
inline void with_rows(int64_t mr, F&& f) {
  if constexpr (R > 1)
    if (mr < R) return with_rows<R - 1>(mr, f);
  f(std::integral_constant<int, R>{});
}

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#ifdef __AVX512F__
// [lo | hi] and its halves: a 512-bit vector as two 8-lane ones side by side, so that AVX-512 code can run two of
// the AVX2 code's 8-lane computations at once with the same lanes, i.e. the same bits (AVX-512F has only 64-bit-lane
// inserts and extracts).
inline __m512 pair256(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline __m256 lo256(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 hi256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#endif

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

// Adapter pools may hold 16-bit floats (lora_dtype): element tags for bfloat16 and float16, widened to float32
// where they are read. Widening is exact, so a kernel gives the bits it gives on a float32 pool of the same values.
struct bf16_t {
  uint16_t v;
};
struct f16_t {
  uint16_t v;
};

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t h) {
  const uint32_t u = uint32_t(h.v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_f32(f16_t h) {
  const uint32_t sign = uint32_t(h.v & 0x8000u) << 16, e = (h.v >> 10) & 0x1fu, m = h.v & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24
    const float f = std::ldexp(float(m), -24);
    return sign ? -f : f;
  }
  const uint32_t u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// [p[0:8] | q[0:8]] widened, as pair256(load8(p), load8(q)): 16-bit elements 16 at a time (a decode step on 32
// adapters of bfloat16 rows, one thread: 0.5 ms less of ~16 added by the LoRA, 15 of 21 paired rounds)
inline __m512 load_pair(const float* p, const float* q) { return pair256(load8(p), load8(q)); }
inline __m256i pair128(const void* p, const void* q) {
  const __m128i lo = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), _mm_loadu_si128(static_cast<const __m128i*>(q)), 1);
}
inline __m512 load_pair(const bf16_t* p, const bf16_t* q) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pair128(p, q)), 16));
}
inline __m512 load_pair(const f16_t* p, const f16_t* q) { return _mm512_cvtph_ps(pair128(p, q)); }
#endif
#endif

// dst[0:n] = src[0:n] widened to float32
template <class T>
inline void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_f32(src[i]);
}

// float32 -> bfloat16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays a quiet NaN
inline bf16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}
// *p = v in p's element type (16-bit activations and KV caches: bfloat16 storage, float32 math)
inline void put(float* p, float v) { *p = v; }
inline void put(bf16_t* p, float v) { *p = to_bf16(v); }

#ifdef __AVX2__
// 8 floats rounded to bfloat16 (nearest even, as to_bf16 for all but NaNs with payload bits in the low half)
inline __m128i bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16x8(v)); }
#endif

// dst[0:n] = src[0:n] rounded to T (float: copied)
template <class T>
inline void narrow(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
#endif
    for (; i < n; ++i) put(dst + i, src[i]);
  }
}

// f(T{}) for the element type of activations and KV caches a kernel takes: 0 float32, 1 bfloat16
template <class F>
inline void with_act(int code, F&& f) {
  if (code == 1)
    f(bf16_t{});
  else
    f(float{});
}

// f(T{}) for an adapter pool's element type code (kernels/cpu_ext.py ADAPTER_TYPES): 0 float32, 1 bfloat16,
// 2 float16
template <class F>
inline void with_type(int code, F&& f) {
  if (code == 1)
    f(bf16_t{});
  else if (code == 2)
    f(f16_t{});
  else
    f(float{});
}

// bytes of an element of that type
inline int64_t type_bytes(int code) {
  int64_t n = 0;
  with_type(code, [&](auto t) { n = sizeof(t); });
  return n;
}

// Loads one byte of every cache line of p[0:n], in address order, into `sink` (which the caller keeps, so that the
// loads are not compiled away). A core keeps more of these plain loads in flight than software prefetches, and an
// ascending sweep is what the hardware prefetchers follow: data read soon after, in another order, comes from cache.
template <class T>
inline void touch(const T* p, int64_t n, float& sink) {
  const char* c = reinterpret_cast<const char*>(p);
  int s = 0;
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) s += c[i];
  sink += float(s);
}

// touch() of p[0:n] and q[0:n] side by side: two streams in flight at once
template <class T>
inline void touch(const T* p, const T* q, int64_t n, float& sink) {
  const char *c = reinterpret_cast<const char*>(p), *d = reinterpret_cast<const char*>(q);
  int s = 0;
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) s += c[i] + d[i];
  sink += float(s);
}

// The end of a sink's life: its value is used, so that the loads that fed it stay.
inline void keep(float sink) {
  volatile float v = sink;
  (void)v;
}

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

}  // namespace
