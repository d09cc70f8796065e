// Device-agnostic drivers of the mixture-of-experts token dispatch (csrc/cpu/moe.cpp, csrc/cuda/moe.cu).
//
// A top-k router sends token t (of T) to experts ids[t, 0..K-1]. The experts run on expert-contiguous rows, so
// the N = T*K (token, slot) pairs are put in order (expert, then token, then slot): a stable counting sort. The
// permutation is kept as `dst_of` [T, K]: the row of pair (t, k) in that order. Every op is then a gather:
//   moe_permute    permuted[dst_of[t, k]] = hidden[t],  permuted_probs[dst_of[t, k]] = probs[t, k]
//   moe_unpermute  out[t] = sum_k w[t, k] * permuted[dst_of[t, k]]      (w = probs, or 1 when none)
// and so are the gradients, which is why no op needs atomics or a scatter-add:
//   d hidden[t]      = sum_k d permuted[dst_of[t, k]]                   (moe_unpermute without weights)
//   d permuted[p]    = w_p * d out[src_of[p]]                            (gather_rows with scale)
//   d w[t, k]        = < d out[t], permuted[dst_of[t, k]] >              (combine_backward)
// The order is megatron-core's (its `permute` reads the routing map expert-major), so tokens_per_expert and the
// all-to-all splits computed from the routing map describe our rows as well.
//
// The backend K supplies four kernels (contiguous inputs):
//   K::route_index(ids [T, K] int64, E, dst_of [T, K], src_of [N], counts [E])   the stable counting sort (and
//       its inverse src_of[dst_of[t, k]] = t); ids outside [0, E) are an error naming the token and slot
//   K::gather_rows(x [R, H], src [N] int64, scale [N] acc or undefined, out [N, H])   out[p] = scale[p] * x[src[p]]
//   K::combine_rows(x [N, H], dst_of [T, K], w [T, K] acc or undefined, out [T, H])   out[t] = sum_k w x[dst[t,k]]
//   K::combine_backward(g [T, H], x [N, H], dst_of [T, K], gw [T, K] acc)           gw[t,k] = <g[t], x[dst[t,k]]>
// Weights and sums are in the accumulation type (float for float/half/bfloat16 rows, double for double).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <tuple>

#include "verl/checks.h"

namespace verl {
namespace moe {

using at::Tensor;

inline at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// expert ids [T, K] integer -> int64 contiguous (range is checked by the backend's route_index).
inline Tensor checked_ids(const Tensor& hidden, const Tensor& ids, int64_t num_experts, const char* op) {
  TORCH_CHECK(hidden.dim() == 2, op, ": `hidden` must be [tokens, hidden], got shape ", hidden.sizes());
  check_floating(hidden, op, "hidden");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == hidden.size(0), op, ": `expert_ids` must be [tokens, top_k] with ",
              hidden.size(0), " tokens (the rows of `hidden`), got shape ", ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, op,
              ": `expert_ids` must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK(num_experts >= 1, op, ": `num_experts` must be >= 1, got ", num_experts);
  check_same_device(hidden, ids, op, "hidden", "expert_ids");
  return ids.to(at::kLong).contiguous();
}

// Optional routing weights [T, K] as the accumulation type (undefined when not given).
inline Tensor checked_weights(const std::optional<Tensor>& probs, at::IntArrayRef tk, const Tensor& like,
                              const char* op, const char* name) {
  if (!probs.has_value() || !probs->defined()) return Tensor();
  check_floating(*probs, op, name);
  check_same_device(like, *probs, op, "hidden", name);
  TORCH_CHECK(probs->sizes() == tk, op, ": `", name, "` must have the shape of `expert_ids` / `dst_of` ", tk,
              ", got ", probs->sizes());
  return probs->to(acc_dtype(like.scalar_type())).contiguous();
}

inline void check_dst_of(const Tensor& permuted, const Tensor& dst_of, const char* op) {
  TORCH_CHECK(permuted.dim() == 2, op, ": `permuted` must be [tokens * top_k, hidden], got shape ", permuted.sizes());
  check_floating(permuted, op, "permuted");
  TORCH_CHECK(dst_of.dim() == 2 && dst_of.scalar_type() == at::kLong, op,
              ": `dst_of` must be int64 [tokens, top_k] (moe_permute's third output), got ", dst_of.scalar_type(), " ",
              dst_of.sizes());
  TORCH_CHECK(dst_of.numel() == permuted.size(0), op, ": `dst_of` maps ", dst_of.numel(), " (token, slot) pairs but ",
              "`permuted` has ", permuted.size(0), " rows; pass the permutation `permuted` was made with");
  check_same_device(permuted, dst_of, op, "permuted", "dst_of");
}

// (permuted [T*K, H], permuted_probs [T*K] (empty [0] without probs), dst_of [T, K], tokens_per_expert [E]).
template <class K>
std::tuple<Tensor, Tensor, Tensor, Tensor> permute(const Tensor& hidden_in, const Tensor& expert_ids,
                                                   const std::optional<Tensor>& probs, int64_t num_experts) {
  const char* op = "moe_permute";
  const Tensor ids = checked_ids(hidden_in, expert_ids, num_experts, op);
  const Tensor w = checked_weights(probs, ids.sizes(), hidden_in, op, "probs");
  const Tensor hidden = hidden_in.contiguous();
  const int64_t n = ids.numel();
  const auto long_opts = ids.options();
  Tensor dst_of = at::empty(ids.sizes(), long_opts);
  Tensor src_of = at::empty({n}, long_opts);
  Tensor counts = at::zeros({num_experts}, long_opts);
  if (n > 0) K::route_index(ids, num_experts, dst_of, src_of, counts);
  const Tensor flat = dst_of.view({-1});
  Tensor permuted = at::empty({n, hidden.size(1)}, hidden.options());
  if (n > 0 && hidden.size(1) > 0) K::gather_rows(hidden, src_of, Tensor(), permuted);
  Tensor permuted_probs = at::empty({0}, hidden.options().dtype(w.defined() ? probs->scalar_type() : at::kFloat));
  if (w.defined()) {
    permuted_probs = at::empty({n}, probs->options());
    permuted_probs.index_put_({flat}, probs->reshape({-1}));
  }
  return {permuted, permuted_probs, dst_of, counts};
}

// out [T, H] = sum_k w[t, k] * permuted[dst_of[t, k]] (w = 1 without probs), in permuted's dtype.
template <class K>
Tensor unpermute(const Tensor& permuted_in, const Tensor& dst_of_in, const std::optional<Tensor>& probs) {
  const char* op = "moe_unpermute";
  check_dst_of(permuted_in, dst_of_in, op);
  const Tensor dst_of = dst_of_in.contiguous();
  const Tensor w = checked_weights(probs, dst_of.sizes(), permuted_in, op, "probs");
  const Tensor permuted = permuted_in.contiguous();
  Tensor out = at::empty({dst_of.size(0), permuted.size(1)}, permuted.options());
  if (out.numel() > 0) K::combine_rows(permuted, dst_of, w, out);
  return out;
}

// (d permuted [T*K, H] in grad's dtype, d probs [T, K] in probs' dtype, or an empty [0] tensor without probs).
// `permuted` (moe_unpermute's input) is read only for d probs, so without probs autograd need not keep it.
template <class K>
std::tuple<Tensor, Tensor> unpermute_backward(const Tensor& grad_in, const Tensor& dst_of_in,
                                              const std::optional<Tensor>& probs,
                                              const std::optional<Tensor>& permuted_opt) {
  const char* op = "moe_unpermute_backward";
  check_floating(grad_in, op, "grad");
  TORCH_CHECK(dst_of_in.dim() == 2 && dst_of_in.scalar_type() == at::kLong && grad_in.dim() == 2 &&
                  grad_in.size(0) == dst_of_in.size(0), op, ": `grad` must be [tokens, hidden] and `dst_of` int64 ",
              "[tokens, top_k] (moe_permute's), got ", grad_in.sizes(), " and ", dst_of_in.scalar_type(), " ",
              dst_of_in.sizes());
  check_same_device(grad_in, dst_of_in, op, "grad", "dst_of");
  const Tensor dst_of = dst_of_in.contiguous();
  const Tensor grad = grad_in.contiguous();
  const Tensor w = checked_weights(probs, dst_of.sizes(), grad, op, "probs");
  TORCH_CHECK(!w.defined() || (permuted_opt.has_value() && permuted_opt->defined()), op,
              ": `permuted` is needed for the gradient of `probs`");
  const int64_t n = dst_of.numel();
  const Tensor flat = dst_of.view({-1});
  Tensor src_of = at::empty({n}, dst_of.options());
  Tensor w_perm;
  if (n > 0) {
    src_of.index_put_({flat}, at::arange(dst_of.size(0), dst_of.options()).repeat_interleave(dst_of.size(1)));
    if (w.defined()) {
      w_perm = at::empty({n}, w.options());
      w_perm.index_put_({flat}, w.view({-1}));
    }
  }
  Tensor grad_permuted = at::empty({n, grad.size(1)}, grad.options());
  if (grad_permuted.numel() > 0) K::gather_rows(grad, src_of, w_perm, grad_permuted);
  if (!w.defined()) return {grad_permuted, at::empty({0}, grad.options())};
  check_dst_of(*permuted_opt, dst_of, op);
  const Tensor permuted = permuted_opt->to(grad.scalar_type()).contiguous();
  TORCH_CHECK(permuted.size(1) == grad.size(1), op, ": `permuted` has ", permuted.size(1), " columns but `grad` ",
              grad.size(1));
  Tensor grad_w = at::zeros(dst_of.sizes(), w.options());
  if (n > 0 && permuted.size(1) > 0) K::combine_backward(grad, permuted, dst_of, grad_w);
  return {grad_permuted, grad_w.to(probs->scalar_type())};
}

}  // namespace moe
}  // namespace verl
