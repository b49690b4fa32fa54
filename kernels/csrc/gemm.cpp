namespace {

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
