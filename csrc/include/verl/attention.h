// One decode step's attention (csrc/cpu/attention.cpp, csrc/cuda/attention.cu; Python side verl/ops/attention.py).
//
//   out[b, h, g] = sum_t softmax_t(scale * q[b, h, g] . k[b, h, t] over t with mask[b, t]) * v[b, h, t]
//
// q [B, H, G, d] float32: the G query heads that share key/value head h (grouped-query attention; G = 1 without
// grouping). k, v [B, H, T, d] float32, each head's rows of d floats contiguous (the strides of B, H and T are
// free, so a view of the first T columns of a larger cache is read in place). mask [B, T] bool: the cached
// positions row b attends to; masked positions change nothing, whatever they hold. A row with no valid position
// gives zeros. out [B, H, G, d] float32. Not differentiable: generation only.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "verl/checks.h"

namespace verl {

inline void check_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& mask) {
  const char* op = "decode_attention";
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, op,
              ": `q` must be float32 [rows, kv_heads, queries_per_kv_head, head_dim], got ", q.scalar_type(), " ",
              q.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k, "k"}, {v, "v"}}) {
    TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kFloat, op, ": `", name,
                "` must be float32 [rows, kv_heads, positions, head_dim], got ", t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(3) == q.size(3), op, ": `", name,
                "` ", t.sizes(), " does not match `q` ", q.sizes(), " in rows, kv_heads or head_dim");
    TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, op, ": `", name,
                "`'s head_dim must be contiguous (stride 1), got strides ", t.strides());
    check_same_device(q, t, op, "q", name);
  }
  TORCH_CHECK(v.size(2) == k.size(2), op, ": `k` has ", k.size(2), " positions but `v` has ", v.size(2));
  TORCH_CHECK(mask.dim() == 2 && mask.scalar_type() == at::kBool && mask.size(0) == q.size(0) &&
                  mask.size(1) == k.size(2),
              op, ": `mask` must be bool [", q.size(0), ", ", k.size(2), "] (rows, positions), got ",
              mask.scalar_type(), " ", mask.sizes());
  check_same_device(q, mask, op, "q", "mask");
}

}  // namespace verl
