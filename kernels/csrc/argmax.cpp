// Greedy sampling's argmax over the vocabulary.

extern "C" {

// out[t] = the index of the largest value of row t (V floats, rows of stride xs): the first one on ties, and, as
// torch.argmax, a NaN counts as the largest (the first NaN's index). Two passes over the row (the second from
// cache): the maximum and whether there is a NaN, then the first index that holds it. Rows in parallel past the
// pointwise kernels' threshold.
void loom_argmax(const float* x, int64_t xs, int64_t T, int64_t V, int64_t* out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * V >= POINTWISE_PARALLEL_MIN)
  for (int64_t t = 0; t < T; ++t) {
    const float* r = x + t * xs;
    float m = NEG_INF;
    bool nan = false;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 vm = _mm256_set1_ps(NEG_INF), vnan = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(r + i);
      vm = _mm256_max_ps(v, vm);  // a NaN in v gives vm's lane: NaNs are tracked apart
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan = _mm256_movemask_ps(vnan) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    for (const float l : lanes) m = std::max(m, l);
#endif
    for (; i < V; ++i) {
      nan |= std::isnan(r[i]);
      m = std::max(m, r[i]);
    }
    int64_t best = 0;
    if (nan) {
      while (!std::isnan(r[best])) ++best;
    } else {
      i = 0;
#ifdef __AVX2__
      const __m256 target = _mm256_set1_ps(m);
      for (; i + 8 <= V; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), target, _CMP_EQ_OQ));
        if (hit) break;
      }
#endif
      while (i < V && r[i] != m) ++i;
      best = i < V ? i : 0;
    }
    out[t] = best;
  }
}

}  // extern "C"
