// The one place where every verl op's schema is declared (TORCH_LIBRARY(verl, m)).
// Implementations register per backend: CPU in csrc/cpu/*.cpp, CUDA in csrc/cuda/*.cu.
// Python gives each op a fake (meta) implementation and autograd in verl/ops/.
//
// The module itself only provides PyInit__C (plain CPython API, no pybind11 functions: free pybind11
// functions are opaque to torch.compile) and two attributes describing the build.
#include <Python.h>
#include <torch/library.h>

#ifndef VERL_WITH_CUDA
#define VERL_WITH_CUDA 0
#endif
#ifndef VERL_CUDA_ARCHS
#define VERL_CUDA_ARCHS ""
#endif

TORCH_LIBRARY(verl, m) {
  // ---- masked reductions (verl/ops/masked.py) --------------------------------------------------
  // mask: same shape as values, any real dtype, nonzero = valid. dim=None reduces every element.
  // An all-zero mask (or row) gives 0 for sum, mean, var and whiten, never NaN.
  m.def("masked_sum(Tensor values, Tensor mask, int? dim=None) -> Tensor");
  m.def("masked_mean(Tensor values, Tensor mask, int? dim=None) -> Tensor");
  m.def("masked_var(Tensor values, Tensor mask, bool unbiased=True) -> Tensor");
  m.def("masked_whiten(Tensor values, Tensor mask, bool shift_mean=True, float eps=1e-8) -> Tensor");
  // Backward ops (called by the autograd formulas registered in Python).
  m.def("masked_reduce_backward(Tensor grad, Tensor mask, int? dim, bool mean) -> Tensor");
  m.def("masked_var_backward(Tensor grad, Tensor values, Tensor mask, bool unbiased) -> Tensor");
  m.def("masked_whiten_backward(Tensor grad, Tensor values, Tensor mask, bool shift_mean, float eps) -> Tensor");

  // ---- reshard copies (verl/ops/reshard.py; the 3D-HybridEngine's bucket and layout kernels) -----
  // reshard_pack: every tensor (one dtype and device, any strides) flattened into one 1-D bucket, in order.
  // reshard_unpack: the inverse; `shapes` is every output shape concatenated, `ndims` their ranks.
  // reshard_gather: builds a tensor of `out_shape` from blocks of `sources` along `dim`; plan is int64
  // [n, 4] rows of (source index, source start, out start, length). It is the gather-and-permute of
  // Megatron's fused QKV / gate-up shards into the engine's layout: one pass, every out row covered once.
  m.def("reshard_pack(Tensor[] tensors) -> Tensor");
  m.def("reshard_unpack(Tensor flat, int[] shapes, int[] ndims) -> Tensor[]");
  m.def("reshard_gather(Tensor[] sources, Tensor plan, int dim, int[] out_shape) -> Tensor");

  // ---- mixture-of-experts token dispatch (verl/ops/moe.py; driver in verl/moe.h, kernels in {cpu,cuda}/moe) --
  // hidden [T, H], expert_ids [T, K] (int64/int32, each in [0, num_experts)), probs [T, K] or None.
  // moe_permute orders the T*K (token, slot) pairs by (expert, token, slot): permuted [T*K, H] and permuted_probs
  // [T*K] (an empty [0] tensor without probs) in that order, dst_of [T, K] int64 (the row of each pair), and
  // tokens_per_expert [E] int64. moe_unpermute: out [T, H] = sum_k probs[t, k] * permuted[dst_of[t, k]] (probs None:
  // a plain sum), accumulated in float (double for double). The backward of moe_permute is moe_unpermute; that of
  // moe_unpermute is moe_unpermute_backward, which reads `permuted` only for grad_probs (an empty [0] tensor
  // without probs).
  m.def("moe_permute(Tensor hidden, Tensor expert_ids, Tensor? probs, int num_experts) -> "
        "(Tensor permuted, Tensor permuted_probs, Tensor dst_of, Tensor tokens_per_expert)");
  m.def("moe_unpermute(Tensor permuted, Tensor dst_of, Tensor? probs) -> Tensor");
  m.def("moe_unpermute_backward(Tensor grad, Tensor dst_of, Tensor? probs, Tensor? permuted) -> "
        "(Tensor grad_permuted, Tensor grad_probs)");

  // ---- RL advantages (verl/ops/rl.py; drivers in verl/rl_advantage.h, kernels in {cpu,cuda}/rl_advantage) --
  // Shapes: B sequences x T response tokens; every [B, T] tensor comes with `mask` (nonzero = valid).
  // `num_nonfinite` outputs count valid positions whose rewards (or values) are NaN/inf, so callers can
  // raise instead of training on NaN. gae with `whiten_eps` whitens the advantages over the mask
  // (verl.ops.masked_whiten semantics: mean 0, unbiased variance, eps inside the square root).
  m.def("gae(Tensor rewards, Tensor? values, Tensor mask, float gamma, float lam, float? whiten_eps=None) -> "
        "(Tensor advantages, Tensor returns, Tensor num_nonfinite)");
  m.def("outcome_advantage(Tensor rewards, Tensor mask, Tensor index, str estimator, float eps, bool norm_by_std, "
        "Tensor? baseline) -> (Tensor advantages, Tensor num_nonfinite)");

  // ---- RL losses (verl/ops/losses.py; drivers in verl/rl_loss.h, kernels in {cpu,cuda}/rl_loss) ----------
  // kl_penalty: the per-token KL estimate; its backward op gives d / d logprob (d / d ref is the negation).
  m.def("kl_penalty(Tensor logprob, Tensor ref_logprob, str kind) -> Tensor");
  m.def("kl_penalty_backward(Tensor grad, Tensor logprob, Tensor ref_logprob, str kind) -> Tensor");
  // Loss ops reduce [B, T] per-token losses to a 0-d loss with one aggregation (`mode`, see verl/rl_loss.h):
  // loss = sum_b w_b * sum_t mask_bt * loss_bt. With `with_grad`, kl_loss / policy_loss / value_loss also
  // return d loss / d (their first input) at grad_output = 1, written in the same pass over the inputs, and
  // their backward is loss_grad_scale(grad, that tensor); without, that output is an empty [0] tensor.
  // agg_loss returns the row weights w_b [B] (float64), which are all its backward, agg_loss_backward, reads.
  m.def("agg_loss(Tensor loss, Tensor mask, str mode, float? global_tokens, float? global_seqs, int dp_size, "
        "float? norm_len) -> (Tensor out, Tensor row_weight)");
  m.def("agg_loss_backward(Tensor grad, Tensor mask, Tensor row_weight) -> Tensor");
  m.def("kl_loss(Tensor logprob, Tensor ref_logprob, Tensor mask, str kind, str mode, float? global_tokens, "
        "float? global_seqs, int dp_size, float? norm_len, bool with_grad) -> (Tensor loss, Tensor grad_logprob)");
  m.def("policy_loss(Tensor logprob, Tensor old_logprob, Tensor advantages, Tensor mask, str loss_type, "
        "float clip_low, float clip_high, float clip_c, str mode, float? global_tokens, float? global_seqs, "
        "int dp_size, float? norm_len, bool with_grad) -> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, "
        "Tensor ppo_kl, Tensor grad_logprob)");
  m.def("value_loss(Tensor values, Tensor old_values, Tensor returns, Tensor mask, float clip, str mode, "
        "float? global_tokens, float? global_seqs, int dp_size, float? norm_len, bool with_grad) -> "
        "(Tensor loss, Tensor clipfrac, Tensor grad_values)");
  m.def("loss_grad_scale(Tensor grad, Tensor saved_grad) -> Tensor");

  // ---- log-prob and entropy (verl/ops/logprob.py) ---------------------------------------------
  // logits [N, V] (any float dtype; rows may be strided), labels [N] int64/int32, z = logits / temperature.
  // Returns float32 (float64 for float64 inputs) [N] each: logprob = log softmax(z)[label],
  // entropy = -sum softmax(z) log softmax(z), lse = logsumexp(z). Rows with label == ignore_index give
  // 0 in all three and no gradient. One streaming pass over V; softmax is never stored.
  m.def("logprob_entropy(Tensor logits, Tensor labels, float temperature=1.0, int ignore_index=-100) "
        "-> (Tensor logprob, Tensor entropy, Tensor lse)");
  // The same over a vocab shard logits[:, j] = full[:, vocab_start + j] of a vocabulary of vocab_size:
  // (target logit z[label] if this shard owns the label else 0, shard lse, shard entropy), for callers that
  // all-reduce them across tensor-parallel ranks.
  m.def("logprob_entropy_shard(Tensor logits, Tensor labels, float temperature, int vocab_start, int vocab_size, "
        "int ignore_index=-100) -> (Tensor target_logit, Tensor lse, Tensor entropy)");
  // d loss / d logits (logits' dtype) from the grads of (logprob, entropy, lse) (None = 0) and the full
  // vocabulary's lse and entropy; vocab_start says which slice `logits` is (0 for the whole vocabulary).
  m.def("logprob_entropy_backward(Tensor? grad_logprob, Tensor? grad_entropy, Tensor? grad_lse, Tensor logits, "
        "Tensor labels, Tensor lse, Tensor entropy, float temperature, int vocab_start=0, int ignore_index=-100) "
        "-> Tensor");
  // Fused with the LM head: logits = hidden [N, H] @ weight [V, H]^T computed chunk_n x chunk_v at a time
  // (at::mm: BLAS / cuBLAS), never [N, V] whole; outputs as logprob_entropy. hidden and weight share a dtype.
  m.def("linear_logprob_entropy(Tensor hidden, Tensor weight, Tensor labels, float temperature=1.0, "
        "int ignore_index=-100, int chunk_n=1024, int chunk_v=4096) -> (Tensor logprob, Tensor entropy, Tensor lse)");
  m.def("linear_logprob_entropy_shard(Tensor hidden, Tensor weight, Tensor labels, float temperature, "
        "int vocab_start, int vocab_size, int ignore_index=-100, int chunk_n=1024, int chunk_v=4096) "
        "-> (Tensor target_logit, Tensor lse, Tensor entropy)");
  // Recomputes the chunk logits; returns (grad_hidden [N, H], grad_weight [V, H]) in the inputs' dtype.
  m.def("linear_logprob_entropy_backward(Tensor? grad_logprob, Tensor? grad_entropy, Tensor? grad_lse, "
        "Tensor hidden, Tensor weight, Tensor labels, Tensor lse, Tensor entropy, float temperature, "
        "int vocab_start=0, int ignore_index=-100, int chunk_n=1024, int chunk_v=4096) -> (Tensor, Tensor)");

  // ---- the fused RL loss head (verl/ops/rl_head.py; driver in verl/rl_head.h) ------------------------------
  // hidden [B*T, H] x weight [V, H] -> the actor's loss policy_loss - entropy_coeff * agg(entropy) +
  // kl_coef * kl_loss, aggregated over mask [B, T] (`mode` and the counts as the loss ops). labels [B, T] are the
  // response tokens; advantages, old_logprob (None: on-policy, old = this logprob) and ref_logprob (None: no KL)
  // are [B, T]. stats: float32 [8] = (pg_loss, kl_loss, entropy_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl,
  // entropy, kl). logprob / entropy [B, T] (0 where mask is 0). With `with_grad`, grad_hidden [B*T, H] and
  // grad_weight [V, H] are d loss / d input at grad_output = 1, computed in this forward pass (3 GEMMs in all);
  // the backward is loss_grad_scale of each. chunk_n: valid tokens per chunk (0 = the backend's default).
  // grad_weight=False (a frozen head): grad_weight is an empty [0] tensor and its GEMM is skipped (2 GEMMs).
  m.def("linear_rl_loss(Tensor hidden, Tensor weight, Tensor labels, Tensor mask, Tensor advantages, "
        "Tensor? old_logprob, Tensor? ref_logprob, float temperature, str loss_type, float clip_low, "
        "float clip_high, float clip_c, str kl_kind, float kl_coef, float entropy_coeff, str mode, "
        "float? global_tokens, float? global_seqs, int dp_size, float? norm_len, int chunk_n, bool with_grad, "
        "bool grad_weight=True) -> "
        "(Tensor loss, Tensor stats, Tensor logprob, Tensor entropy, Tensor grad_hidden, Tensor grad_weight)");

  // ---- int8 weight-only linear (verl/ops/quant.py; contract in verl/int8_linear.h, kernels in {cpu,cuda}) --
  // out [M, N] = (x [M, K] @ qweight[N, K]^T) * scale[N] + bias[N], float32 with int8 weights quantized per
  // output row (verl.ops.quantize_int8). Generation only: not differentiable.
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");

  // ---- one decode step's attention (verl/ops/attention.py; contract in verl/attention.h, kernels in {cpu,cuda}) --
  // q [B, H, G, d]: the G query heads sharing each key/value head; k, v [B, H, T, d] (a view of a larger cache is
  // read in place); mask bool [B, T]. out [B, H, G, d]. Generation only: not differentiable.
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");

  // ---- float32 linear, packed weight (verl/ops/packed_linear.py; contract in verl/packed_linear.h, {cpu,cuda}) --
  // out [M, n] = x [M, K] @ w[n, K]^T + bias[n], w given as packed [ceil(n / 16), K, 16] (pack_linear_weight).
  // Generation only: not differentiable.
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

static struct PyModuleDef verl_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                           "verl C++/CUDA ops; the ops live in torch.ops.verl", -1, nullptr};

extern "C" PyObject* PyInit__C(void) {
  PyObject* m = PyModule_Create(&verl_c_module);
  if (m == nullptr) return nullptr;
  PyModule_AddIntConstant(m, "with_cuda", VERL_WITH_CUDA);
  PyModule_AddStringConstant(m, "cuda_archs", VERL_CUDA_ARCHS);
  return m;
}
