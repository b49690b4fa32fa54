// ---- one decoder layer of a Llama-class or Gemma model in one call (kernels/cpu_layer.py): the same kernel calls,
// with the same arguments and in the same order, as the Python layer path makes one by one (so the same bits), without
// the ~115 us of Python around them a layer, during which the other compute threads only wait.
//
//   h, r = rms_norm(x + residual) ; qkv = h @ Wqkv (+ LoRA) ; q, k, v = contiguous copies
//   [q, k = rms_norm per head (Qwen3)] ; rope(q, k) on the first rotary_dim dims of each head
//   store k, v ; attention (decodes, then prefills) ; o = att @ Wo (+ LoRA) ; [o = rms_norm(o) (Gemma)]
//   h2, r2 = rms_norm(o + r) ; x_out = act_mul(h2 @ Wgate_up (+ LoRA)) @ Wdown (+ LoRA) ; [x_out = rms_norm(x_out)
//   (Gemma)] ; res_out = r2 ; act: SiLU, or GELU's tanh approximation (Gemma). A MoE layer stops at h2 (its block
//   runs in Python after the call).
//
// Float32 or bfloat16 activations, caches and weights (act): bfloat16 runs the kernels' bfloat16 variants (16-bit
// storage, float32 math) and loom's bfloat16 GEMM (gemm_bf16.cpp), as the Python path does where the policy picked that
// GEMM, each linear's LoRA on its output (in its output tiles in decode).
//
// A linear whose weight a quantized checkpoint keeps quantized (layers/quant_linear.py) runs the weight-only GEMM its
// Python layer runs (quant_gemm.cpp's float32-math kernel, or for bfloat16 activations quant_gemm_bf16.cpp's
// VDPBF16PS one, native or emulated) on the rows that layer hands it (act-order gathered, padded, widened), then its
// LoRA pass on the output, as the Python layer does (there is no fused LoRA epilogue for these kernels).

namespace {

// One weight-only quantized part of a linear (kernels/cpu_quant.py, cpu_quant_bf16.py): its columns [col, col + N)
// of the output, as layers/quant_linear.py's parts.
struct LoomQuant {
  const uint8_t* q;       // the packed bytes
  int64_t col, N;
  int64_t kernel;         // 0: quant_gemm's; 1: loom_quant_gemm_bf16's (VDPBF16PS); 2: its emulation
  int64_t kind;           // kernel 0: QU8, QU4 or QF8; 1, 2: 1 for int4 (else int8)
  const float* scale;     // [P, G, panel width]
  const float* zero;      // nullable: symmetric, every zero point zc
  float zc;
  const int32_t* gb;      // group bounds [G + 1]
  int64_t groups;
  const int64_t* perm;    // act-order: the input column of each packed k, or null
  int64_t kp;             // the packed K (kernels 1, 2: K rounded up to the unit; x zero past K)
};

// One packed linear layer (kernels/cpu_linear.py) or quantized one, and, when adapters may target it, its LoRA pools.
struct LoomLinear {
  const void* panels;     // float32 panels (gemm.cpp) or bfloat16 ones (gemm_bf16.cpp); null when quantized
  int64_t N;
  const float* bias;      // nullable
  const void* lora_a;     // [S, R, K] or null: no pools
  const void* lora_b;     // [R, N]
  int64_t dt;             // the pools' element type (with_type's code)
  int64_t S, R;
  int64_t ak, bn;         // the pools' row strides (elements)
  const int64_t* offs;    // slice column offsets [S + 1]
  const LoomQuant* parts;  // quantized: its parts in column order (else null)
  int64_t nparts;

  Pools pools(int64_t K) const { return Pools{lora_a, lora_b, int(dt), S, R, K, N, ak, bn}; }
};

struct LoomLayer {
  LoomLinear qkv, o, gate_up, down;
  const void* norm_in;    // norm weights: act's type, or float32 with norm_f32
  const void* norm_post;
  float eps;
  int64_t hidden, heads, kv_heads, head_dim, inter;
  const float* cos_sin;  // rope cache [positions, head_dim]
  void* k_cache;
  void* v_cache;         // [blocks, kv_heads, block_size, head_dim] of act's type
  int64_t block_size;
  float scale;
  int64_t window;
  float softcap;
  const void* q_norm;    // per-head norms of q and k before rope, or null
  const void* k_norm;
  float qk_eps;
  int64_t rotary_dim;    // head_dim, or fewer (partial rotary)
  const void* norm_post_attn;  // Gemma: the attention's and the MLP's outputs normalised (else null)
  const void* norm_post_ff;
  int64_t gelu;          // the MLP's activation: GELU-tanh (else SiLU)
  int64_t attn_only;     // no dense MLP (a MoE layer): x_out gets the MLP's input, the caller runs the block
  int64_t act;           // activations, caches and panels: 0 float32, 1 bfloat16 (with_act's code)
  int64_t norm_f32;      // bfloat16: the norm weights are float32 (Gemma's 1 + w)
};

// What every layer of one step shares: the batch, its attention metadata, its LoRA groups.
struct LoomStep {
  int64_t T;
  const int64_t* positions;
  const int64_t* slots;
  int64_t num_decode;  // decode tokens first, one per sequence
  const int32_t* dec_bt;
  int64_t dec_bt_width;
  const int32_t* dec_sl;
  int64_t num_prefill;  // prefill sequences after them
  const int32_t* pre_cu;
  const int32_t* pre_sl;
  const int32_t* pre_bt;
  int64_t pre_bt_width;
  int64_t prefill_tile;
  const int64_t* tok;  // LoRA groups (loom_lora_apply's arrays); lora_mask bit i: linear i (qkv, o, gate_up, down)
  const int32_t* seg;
  const int32_t* rows;
  const int32_t* ranks;
  const float* scal;
  int64_t groups, fuse_min, lora_mask;
  int64_t mc_hidden, mc_q, mc_inter;  // the GEMMs' row blocks for K = hidden, heads x head_dim, inter
  int nthreads;
};

// Adapter rows a linear's fused LoRA groups (a prefill chunk, or fuse_min decode tokens on one adapter) will read:
// the previous linear's GEMM asks for them while it computes (gemm's fetch), so this one's shrink and epilogue find
// them in cache where they came from memory (the other layers' weights stream through the last-level cache between
// two steps). Up to FETCH_BYTES, which half an L2 holds beside a GEMM's panels. The bench_lora setting (32 requests,
// 64-token prompts, 32 new tokens) on one adapter, rounds alternating in one process, median of 9, one adapter /
// no LoRA: one thread 0.944 -> 0.949, two 0.940 -> 0.945 (the same tokens).
constexpr int64_t FETCH_BYTES = 512 << 10;

Ahead rows_to_fetch(const LoomLinear& l, bool lora, const LoomStep& st, int64_t K) {
  Ahead ah;
  if (!lora || !l.lora_a) return ah;
  const Pools pools = l.pools(K);
  int64_t bytes = 0;
  for (int64_t g = 0; g < st.groups; ++g) {
    const int64_t rk = st.ranks[g], more = pools.bytes(rk);
    if (rk <= 0 || st.seg[g + 1] - st.seg[g] < st.fuse_min) continue;
    if (ah.cnt + l.S + 1 > Ahead::MAX_RANGES || bytes + more > FETCH_BYTES) break;
    pools.rows(st.rows[g], rk, ah);
    bytes += more;
  }
  return ah;
}

// A quantized part's input rows as its kernel reads them (PackedQuantBase._input_rows and the __call__s): columns in
// the packed K order (act-order), zero past K up to kp, of the kernel's type X (widened from A where they differ); x
// itself where that is what it already is.
template <class X, class A>
const X* quant_rows(const LoomQuant& p, const A* x, int64_t K, int64_t T) {
  if (!p.perm && p.kp == K && std::is_same_v<A, X>) return reinterpret_cast<const X*>(x);
  static thread_local std::vector<X> buf;
  if (int64_t(buf.size()) < T * p.kp) buf.resize(T * p.kp);
  for (int64_t t = 0; t < T; ++t) {
    const A* row = x + t * K;
    X* out = buf.data() + t * p.kp;
    for (int64_t k = 0; k < K; ++k) {
      const A v = row[p.perm ? p.perm[k] : k];
      if constexpr (std::is_same_v<A, X>) out[k] = v;
      else out[k] = to_f32(v);
    }
    for (int64_t k = K; k < p.kp; ++k) out[k] = X{};
  }
  return buf.data();
}

// y's columns of part p (row stride ldy) by quant_gemm (PackedQuantWeight's GEMM)
template <class A>
void part_f32(const LoomQuant& p, const A* x, int64_t K, int64_t T, int64_t mc, const float* bias, float* y,
              int64_t ldy, int nt) {
  quant_gemm(quant_rows<float>(p, x, K, T), p.kp, T, K, p.q, int(p.kind), p.scale, p.zero, p.zc, p.gb, p.groups, p.N,
             bias, y + p.col, ldy, mc, nt);
}

// quant_linear_parts' bias after the parts' GEMMs (several parts): y + bias in y's type (bfloat16: the bias rounded
// to it, the sum rounded, as torch adds bfloat16 tensors)
void add_bias(float* y, const float* b, int64_t T, int64_t N) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) y[t * N + n] += b[n];
}
void add_bias(bf16_t* y, const float* b, int64_t T, int64_t N) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) y[t * N + n] = to_bf16(to_f32(y[t * N + n]) + to_f32(to_bf16(b[n])));
}

// float32: each part's PackedQuantWeight GEMM into its columns (quant_linear_parts), then loom_lora_apply's pass
// (dispatch.lora_apply's on the Python path)
void quant_linear(const LoomLinear& l, bool lora, const LoomStep& st, const float* x, int64_t K, int64_t mc,
                  float* y) {
  const bool one = l.nparts == 1;
  for (int64_t i = 0; i < l.nparts; ++i) part_f32(l.parts[i], x, K, st.T, mc, one ? l.bias : nullptr, y, l.N,
                                                  st.nthreads);
  if (!one && l.bias) add_bias(y, l.bias, st.T, l.N);
  if (lora && l.lora_a)
    run_pass(LoraPass{x, K, l.pools(K), l.offs, y, l.N, st.tok, st.seg, st.rows, st.ranks, st.scal, st.groups,
                      LoraItems(st.seg, st.ranks, st.groups, st.nthreads)},
             st.nthreads);
}

// bfloat16: each part's PackedQuantBf16 GEMM, or (no avx512_bf16, or a kind it does not take) PackedQuantWeight's on
// widened rows with the output rounded, then the bfloat16 LoRA pass (lora_apply_cpu_bf16's)
void quant_linear(const LoomLinear& l, bool lora, const LoomStep& st, const bf16_t* x, int64_t K, int64_t mc,
                  bf16_t* y) {
  const int64_t T = st.T;
  const bool one = l.nparts == 1;
  for (int64_t i = 0; i < l.nparts; ++i) {
    const LoomQuant& p = l.parts[i];
    const float* bias = one ? l.bias : nullptr;
    if (p.kernel == 0) {
      static thread_local std::vector<float> out;
      if (int64_t(out.size()) < T * p.N) out.resize(T * p.N);
      LoomQuant own = p;  // into out's columns [0, N)
      own.col = 0;
      part_f32(own, x, K, T, mc, bias, out.data(), p.N, st.nthreads);
      for (int64_t t = 0; t < T; ++t) narrow(out.data() + t * p.N, y + t * l.N + p.col, p.N);
    } else {
      loom_quant_gemm_bf16(reinterpret_cast<const uint16_t*>(quant_rows<bf16_t>(p, x, K, T)), p.kp, T, p.kp, p.q,
                           int(p.kind), p.scale, p.zero, p.zc, p.gb, p.groups, p.N, bias, y + p.col, l.N, 0,
                           st.nthreads, int(p.kernel == 2));
    }
  }
  if (!one && l.bias) add_bias(y, l.bias, T, l.N);
  if (lora && l.lora_a)
    run_pass_bf16(x, K, l.pools(K), l.offs, y, l.N, st.tok, st.seg, st.rows, st.ranks, st.scal, st.groups,
                  st.nthreads);
}

// fetch: the next linear's rows_to_fetch (a hint the quantized kernels do not take)
void layer_linear(const LoomLinear& l, bool lora, const LoomStep& st, const float* x, int64_t K, int64_t mc, float* y,
                  const Ahead& fetch) {
  if (l.parts) return quant_linear(l, lora, st, x, K, mc, y);
  const Ahead* f = fetch.done() ? nullptr : &fetch;
  if (lora && l.lora_a)  // adapters of the step target this linear, and it has pools
    gemm_lora(x, K, st.T, static_cast<const float*>(l.panels), l.bias, y, l.N, l.pools(K), l.offs, st.tok, st.seg, st.rows, st.ranks, st.scal,
              st.groups, st.fuse_min, mc, st.nthreads, f);
  else
    gemm(x, K, st.T, K, static_cast<const float*>(l.panels), l.N, l.bias, y, l.N, mc, st.nthreads, nullptr, f);
}

// bfloat16: loom's bfloat16 GEMM and the LoRA pass on its bfloat16 output (the Python layers' GEMM and
// lora_apply_cpu_bf16: the same bits), as gemm_bf16_lora runs them: a decode step's items interleaved with the
// GEMM's panels, larger groups' deltas in its output tiles.
void layer_linear(const LoomLinear& l, bool lora, const LoomStep& st, const bf16_t* x, int64_t K, int64_t mc,
                  bf16_t* y, const Ahead&) {
  if (l.parts) return quant_linear(l, lora, st, x, K, mc, y);
  const auto* xa = reinterpret_cast<const uint16_t*>(x);
  const auto* panels = static_cast<const uint16_t*>(l.panels);
  if (lora && l.lora_a)  // adapters of the step target this linear, and it has pools
    gemm_bf16_lora(xa, K, st.T, K, panels, l.N, l.bias, y, l.N, l.pools(K), l.offs, st.tok, st.seg, st.rows,
                   st.ranks, st.scal, st.groups, st.fuse_min, st.nthreads);
  else
    gemm_bf16(xa, K, st.T, K, panels, l.N, l.bias, y, l.N, false, st.nthreads);
}

// the kernels by activation type: float32 or bfloat16 (the bfloat16 norm takes float32 or bfloat16 weights)
void norm_rows(const float* x, int64_t xs, const float* res, int64_t rs, const void* w, bool, float eps, float* out,
               int64_t os, float* ro, int64_t ros, int64_t T, int64_t N, int nt) {
  loom_rms_norm(x, xs, res, rs, static_cast<const float*>(w), eps, out, os, ro, ros, T, N, nt);
}
void norm_rows(const bf16_t* x, int64_t xs, const bf16_t* res, int64_t rs, const void* w, bool w_f32, float eps,
               bf16_t* out, int64_t os, bf16_t* ro, int64_t ros, int64_t T, int64_t N, int nt) {
  loom_rms_norm_bf16(x, xs, res, rs, w, w_f32, eps, out, os, ro, ros, T, N, nt);
}
void rope(const int64_t* pos, const float* cs, int64_t D, float* q, int64_t qs0, int64_t qs1, int64_t H, float* k,
          int64_t ks0, int64_t ks1, int64_t KVH, int64_t T, int nt) {
  loom_rotary(pos, cs, D, q, qs0, qs1, H, k, ks0, ks1, KVH, T, nt);
}
void rope(const int64_t* pos, const float* cs, int64_t D, bf16_t* q, int64_t qs0, int64_t qs1, int64_t H, bf16_t* k,
          int64_t ks0, int64_t ks1, int64_t KVH, int64_t T, int nt) {
  loom_rotary_bf16(pos, cs, D, q, qs0, qs1, H, k, ks0, ks1, KVH, T, nt);
}
void store(const float* k, int64_t ks, const float* v, int64_t vs, void* kc, void* vc, const int64_t* slots, int64_t T,
           int64_t bs, int64_t KVH, int64_t D) {
  loom_store_kv(k, ks, v, vs, static_cast<float*>(kc), static_cast<float*>(vc), slots, T, bs, KVH, D);
}
void store(const bf16_t* k, int64_t ks, const bf16_t* v, int64_t vs, void* kc, void* vc, const int64_t* slots,
           int64_t T, int64_t bs, int64_t KVH, int64_t D) {
  loom_store_kv_bf16(k, ks, v, vs, static_cast<bf16_t*>(kc), static_cast<bf16_t*>(vc), slots, T, bs, KVH, D);
}
void decode(const float* q, int64_t qs0, int64_t qs1, const void* kc, const void* vc, int64_t bs, int64_t KVH,
            int64_t D, const int32_t* bt, int64_t M, const int32_t* sl, int64_t B, int64_t H, float* out, int64_t os0,
            int64_t os1, float scale, int64_t window, float softcap, int nt) {
  loom_paged_decode(q, qs0, qs1, static_cast<const float*>(kc), static_cast<const float*>(vc), bs, KVH, D, bt, M, sl, B,
                    H, out, os0, os1, scale, window, softcap, nt);
}
void decode(const bf16_t* q, int64_t qs0, int64_t qs1, const void* kc, const void* vc, int64_t bs, int64_t KVH,
            int64_t D, const int32_t* bt, int64_t M, const int32_t* sl, int64_t B, int64_t H, bf16_t* out,
            int64_t os0, int64_t os1, float scale, int64_t window, float softcap, int nt) {
  loom_paged_decode_bf16(q, qs0, qs1, static_cast<const bf16_t*>(kc), static_cast<const bf16_t*>(vc), bs, KVH, D, bt,
                         M, sl, B, H, out, os0, os1, scale, window, softcap, nt);
}
void prefill(const float* q, int64_t qs0, int64_t qs1, const void* kc, const void* vc, int64_t bs, int64_t KVH,
             int64_t D, const int32_t* cu, const int32_t* sl, int64_t S, const int32_t* bt, int64_t M, int64_t H,
             float* out, int64_t os0, int64_t os1, float scale, int64_t window, float softcap, int64_t tile, int nt) {
  loom_paged_prefill(q, qs0, qs1, static_cast<const float*>(kc), static_cast<const float*>(vc), bs, KVH, D, cu, sl, S,
                     bt, M, H, out, os0, os1, scale, window, softcap, tile, nt);
}
void prefill(const bf16_t* q, int64_t qs0, int64_t qs1, const void* kc, const void* vc, int64_t bs, int64_t KVH,
             int64_t D, const int32_t* cu, const int32_t* sl, int64_t S, const int32_t* bt, int64_t M, int64_t H,
             bf16_t* out, int64_t os0, int64_t os1, float scale, int64_t window, float softcap, int64_t tile, int nt) {
  loom_paged_prefill_bf16(q, qs0, qs1, static_cast<const bf16_t*>(kc), static_cast<const bf16_t*>(vc), bs, KVH, D, cu,
                          sl, S, bt, M, H, out, os0, os1, scale, window, softcap, tile, nt);
}
void act_and_mul(bool gelu, const float* x, int64_t xs, float* out, int64_t T, int64_t I, int nt) {
  (gelu ? loom_gelu_tanh_mul : loom_silu_mul)(x, xs, out, T, I, nt);
}
void act_and_mul(bool gelu, const bf16_t* x, int64_t xs, bf16_t* out, int64_t T, int64_t I, int nt) {
  (gelu ? loom_gelu_tanh_mul_bf16 : loom_silu_mul_bf16)(x, xs, out, T, I, nt);
}

// loom_decoder_layer's work on activations of type A
template <class A>
void decoder_layer(const LoomLayer* L, const LoomStep* s, const A* x, const A* residual, A* ws, A* x_out, A* res_out,
                   const LoomLayer* next) {
  const LoomStep& st = *s;
  const int64_t T = st.T, Hd = L->hidden, H = L->heads, KVH = L->kv_heads, D = L->head_dim, I = L->inter;
  const int64_t q_n = H * D, kv_n = KVH * D, qkv_n = q_n + 2 * kv_n;
  A* h = ws;
  A* r = h + T * Hd;
  A* qkv = r + T * Hd;
  A* q = qkv + T * qkv_n;
  A* k = q + T * q_n;
  A* v = k + T * kv_n;
  A* att = v + T * kv_n;
  A* o = att + T * q_n;
  A* h2 = o + T * Hd;
  A* gu = h2 + T * Hd;
  A* act = gu + T * 2 * I;
  if (T == 0) return;

  norm_rows(x, Hd, residual, residual ? Hd : 0, L->norm_in, L->norm_f32, L->eps, h, Hd, r, Hd, T, Hd, st.nthreads);
  layer_linear(L->qkv, st.lora_mask & 1, st, h, Hd, st.mc_hidden, qkv,
               rows_to_fetch(L->o, st.lora_mask & 2, st, q_n));
  for (int64_t t = 0; t < T; ++t) {  // q, k, v out of the fused rows, each contiguous
    const A* row = qkv + t * qkv_n;
    std::memcpy(q + t * q_n, row, q_n * sizeof(A));
    std::memcpy(k + t * kv_n, row + q_n, kv_n * sizeof(A));
    std::memcpy(v + t * kv_n, row + q_n + kv_n, kv_n * sizeof(A));
  }
  if (L->q_norm) {  // in place, over rows of one head; att (written only by the attention below) takes res_out
    norm_rows(q, D, nullptr, 0, L->q_norm, L->norm_f32, L->qk_eps, q, D, att, D, T * H, D, st.nthreads);
    norm_rows(k, D, nullptr, 0, L->k_norm, L->norm_f32, L->qk_eps, k, D, att, D, T * KVH, D, st.nthreads);
  }
  rope(st.positions, L->cos_sin, L->rotary_dim, q, q_n, D, H, k, kv_n, D, KVH, T, st.nthreads);
  store(k, kv_n, v, kv_n, L->k_cache, L->v_cache, st.slots, T, L->block_size, KVH, D);
  const int64_t d = st.num_decode;
  if (d)
    decode(q, q_n, D, L->k_cache, L->v_cache, L->block_size, KVH, D, st.dec_bt, st.dec_bt_width, st.dec_sl, d, H, att,
           q_n, D, L->scale, L->window, L->softcap, st.nthreads);
  if (st.num_prefill && d < T)
    prefill(q + d * q_n, q_n, D, L->k_cache, L->v_cache, L->block_size, KVH, D, st.pre_cu, st.pre_sl,
            st.num_prefill, st.pre_bt, st.pre_bt_width, H, att + d * q_n, q_n, D, L->scale, L->window,
            L->softcap, st.prefill_tile, st.nthreads);
  layer_linear(L->o, st.lora_mask & 2, st, att, q_n, st.mc_q, o,
               L->attn_only ? Ahead{} : rows_to_fetch(L->gate_up, st.lora_mask & 4, st, Hd));
  if (L->norm_post_attn)  // in place; h2 (written next) takes res_out
    norm_rows(o, Hd, nullptr, 0, L->norm_post_attn, L->norm_f32, L->eps, o, Hd, h2, Hd, T, Hd, st.nthreads);
  if (L->attn_only) {
    norm_rows(o, Hd, r, Hd, L->norm_post, L->norm_f32, L->eps, x_out, Hd, res_out, Hd, T, Hd, st.nthreads);
    return;
  }
  norm_rows(o, Hd, r, Hd, L->norm_post, L->norm_f32, L->eps, h2, Hd, res_out, Hd, T, Hd, st.nthreads);
  layer_linear(L->gate_up, st.lora_mask & 4, st, h2, Hd, st.mc_hidden, gu,
               rows_to_fetch(L->down, st.lora_mask & 8, st, I));
  act_and_mul(L->gelu, gu, 2 * I, act, T, I, st.nthreads);
  // the next layer's q|k|v rows: without them its first linear, the only one with no GEMM before it to ask for them,
  // read them from memory. Decode steps of the bench_lora setting on one adapter, the same build with and without,
  // rounds alternating in one process, median step, ms added by the adapter: one thread 5.57 -> 4.77 (8 rounds), two
  // 3.19 -> 2.72 (10 rounds)
  const Ahead after = next ? rows_to_fetch(next->qkv, st.lora_mask & 1, st, next->hidden) : Ahead{};
  if (L->norm_post_ff) {  // the MLP's output into o (free by now), normalised into x_out; h takes res_out
    layer_linear(L->down, st.lora_mask & 8, st, act, I, st.mc_inter, o, after);
    norm_rows(o, Hd, nullptr, 0, L->norm_post_ff, L->norm_f32, L->eps, x_out, Hd, h, Hd, T, Hd, st.nthreads);
  } else {
    layer_linear(L->down, st.lora_mask & 8, st, act, I, st.mc_inter, x_out, after);
  }
}


}  // namespace

extern "C" {

// Elements (float32 or bfloat16, act's type) of workspace loom_decoder_layer needs for T tokens.
int64_t loom_decoder_layer_workspace(const LoomLayer* L, int64_t T) {
  const int64_t q = L->heads * L->head_dim, kv = L->kv_heads * L->head_dim;
  return T * (4 * L->hidden + (q + 2 * kv) + 2 * q + 2 * kv + 3 * L->inter);
}

// x, residual (null in the first layer) [T, hidden] -> x_out (the MLP's output), res_out [T, hidden], all of act's type
// (ws too). next (nullable): the layer that runs after this one, whose q|k|v adapter rows the last GEMM asks for (only
// read as addresses to ask for: they need not be current, only still allocated).
void loom_decoder_layer(const LoomLayer* L, const LoomStep* s, const void* x, const void* residual, void* ws,
                        void* x_out, void* res_out, const LoomLayer* next) {
  with_act(int(L->act), [&](auto tag) {
    using A = decltype(tag);
    decoder_layer(L, s, static_cast<const A*>(x), static_cast<const A*>(residual), static_cast<A*>(ws),
                  static_cast<A*>(x_out), static_cast<A*>(res_out), next);
  });
}

}  // extern "C"
