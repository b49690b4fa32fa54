// ---- the experts of a sparse MoE block over packed weights (kernels/cpu_moe.py): fused_moe_ref's loop in one call.
// Per expert that received tokens, in expert order: gather its tokens' rows, gate|up GEMM, SiLU-and-mul, down GEMM,
// then out[t] += w * y row by row in the pairs' order (the reference's index_add_: a product, then a sum, each
// rounded). Pairs (t, k) of expert e are taken in increasing t * K + k, as the reference's stable sort gives them.

extern "C" {

// x [T, H]; p13[e] / p2[e]: expert e's packed gate|up [2I, H] and down [H, I] panels; topk_w [T, K] float32,
// topk_ids [T, K] int64; out [T, H] float32 (overwritten). An expert's x rows above block_above bytes go through its
// GEMMs in blocks of mc13 / mc2 rows (kernels/cpu_linear.py's row_block, per expert; the result does not depend on it).
void loom_moe_experts(const float* x, int64_t T, int64_t H, int64_t I, int64_t E, const float* const* p13,
                      const float* const* p2, const float* topk_w, const int64_t* topk_ids, int64_t K, float* out,
                      int64_t block_above, int64_t mc13, int64_t mc2, int nthreads) {
  std::memset(out, 0, sizeof(float) * T * H);
  const int64_t P = T * K;
  std::vector<int64_t> count(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) ++count[topk_ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  {
    std::vector<int64_t> at(count.begin(), count.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[at[topk_ids[p]]++] = p;  // stable: pairs in increasing order per expert
  }
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, count[e + 1] - count[e]);
  std::vector<float> xg(most * H), gu(most * 2 * I), act(most * I), y(most * H);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = count[e + 1] - count[e];
    if (n == 0) continue;
    const int64_t* pairs = order.data() + count[e];
    const bool parallel = n * H >= POINTWISE_PARALLEL_MIN;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (parallel)
    for (int64_t j = 0; j < n; ++j) std::memcpy(xg.data() + j * H, x + pairs[j] / K * H, sizeof(float) * H);
    loom_gemm(xg.data(), H, n, H, p13[e], 2 * I, nullptr, gu.data(), 2 * I, n * H * 4 > block_above ? mc13 : 0,
              nthreads);
    loom_silu_mul(gu.data(), 2 * I, act.data(), n, I, nthreads);
    loom_gemm(act.data(), I, n, I, p2[e], H, nullptr, y.data(), H, n * I * 4 > block_above ? mc2 : 0, nthreads);
    // column blocks in parallel, the pairs in order within each: a token twice on one expert adds in pair order
#pragma omp parallel for schedule(static) num_threads(nthreads) if (parallel)
    for (int64_t h0 = 0; h0 < H; h0 += 64) {
      const int64_t h1 = std::min(H, h0 + 64);
      for (int64_t j = 0; j < n; ++j) {
        float* o = out + pairs[j] / K * H;
        const float* yr = y.data() + j * H;
        const float w = topk_w[pairs[j]];
        for (int64_t h = h0; h < h1; ++h) o[h] += yr[h] * w;
      }
    }
  }
}

// The same loop in bfloat16 (a bfloat16 model on a CPU with avx512_bf16, kernels/cpu_moe.py): x [T, H] and the
// experts' weights bfloat16, the latter packed by loom_gemm_bf16_pack; each GEMM's output and the SiLU-and-mul rounded
// to bfloat16 as the reference's matmuls are, the weighted sums in float32 (out [T, H] float32, overwritten).
void loom_moe_experts_bf16(const bf16_t* x, int64_t T, int64_t H, int64_t I, int64_t E, const uint16_t* const* p13,
                           const uint16_t* const* p2, const float* topk_w, const int64_t* topk_ids, int64_t K,
                           float* out, int nthreads) {
  std::memset(out, 0, sizeof(float) * T * H);
  const int64_t P = T * K;
  std::vector<int64_t> count(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) ++count[topk_ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  {
    std::vector<int64_t> at(count.begin(), count.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[at[topk_ids[p]]++] = p;
  }
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, count[e + 1] - count[e]);
  std::vector<bf16_t> xg(most * H), gu(most * 2 * I), act(most * I), y(most * H);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = count[e + 1] - count[e];
    if (n == 0) continue;
    const int64_t* pairs = order.data() + count[e];
    const bool parallel = n * H >= POINTWISE_PARALLEL_MIN;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (parallel)
    for (int64_t j = 0; j < n; ++j) std::memcpy(xg.data() + j * H, x + pairs[j] / K * H, sizeof(bf16_t) * H);
    loom_gemm_bf16(reinterpret_cast<const uint16_t*>(xg.data()), H, n, H, p13[e], 2 * I, nullptr, gu.data(), 2 * I,
                   0, nthreads);
    loom_silu_mul_bf16(gu.data(), 2 * I, act.data(), n, I, nthreads);
    loom_gemm_bf16(reinterpret_cast<const uint16_t*>(act.data()), I, n, I, p2[e], H, nullptr, y.data(), H, 0,
                   nthreads);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (parallel)
    for (int64_t h0 = 0; h0 < H; h0 += 64) {
      const int64_t h1 = std::min(H, h0 + 64);
      for (int64_t j = 0; j < n; ++j) {
        float* o = out + pairs[j] / K * H;
        const bf16_t* yr = y.data() + j * H;
        const float w = topk_w[pairs[j]];
        for (int64_t h = h0; h < h1; ++h) o[h] += to_f32(yr[h]) * w;
      }
    }
  }
}

}  // extern "C"
