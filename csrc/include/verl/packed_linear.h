// float32 linear with the weight packed once for few-row products (csrc/cpu/packed_linear.cpp,
// csrc/cuda/packed_linear.cu; Python side verl/ops/packed_linear.py).
//
//   out[m, n] = sum_k x[m, k] * w[n, k] + bias[n],   packed[p, k, j] = w[16 p + j, k] (0 past the last row)
//
// x [M, K] float32 (callers flatten leading dims); packed [P, K, 16] float32 with P = ceil(N / 16); bias [N]
// float32 or absent; out [M, N] float32. Every output is one running sum over k in order, whatever M is, so a
// row's result is the same bit for bit whatever the number of rows beside it and the thread count.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

#include "verl/checks.h"

namespace verl {

inline void check_packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                int64_t n) {
  const char* op = "packed_linear";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": `x` must be float32 [rows, in_features], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == at::kFloat, op,
              ": `packed` must be float32 [ceil(out_features / 16), in_features, 16] (verl.ops.pack_linear_weight), "
              "got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(packed.size(1) == x.size(1), op, ": `packed` has ", packed.size(1), " in_features but `x` has ",
              x.size(1));
  TORCH_CHECK(n > 16 * (packed.size(0) - 1) && n <= 16 * packed.size(0), op, ": out_features ", n,
              " does not fit `packed`'s ", packed.size(0), " panels of 16");
  check_same_device(x, packed, op, "x", "packed");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat, op,
                ": `bias` must be float32 [", n, "], got ", bias->scalar_type(), " ", bias->sizes());
    check_same_device(x, *bias, op, "x", "bias");
  }
}

}  // namespace verl
