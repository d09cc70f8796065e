// int8 weight-only linear (csrc/cpu/int8_linear.cpp, csrc/cuda/int8_linear.cu; Python side verl/ops/quant.py).
//
//   out[m, n] = scale[n] * sum_k x[m, k] * qweight[n, k] + bias[n]
//
// qweight [N, K] int8 holds round(w / scale) per output row (symmetric, |q| <= 127), scale [N] float32. The
// product is accumulated in float32 on the int8 values and scaled once per output: the dequantized weight
// (qweight * scale) never exists in memory, so a decode step streams a quarter of the fp32 weight bytes.
// x [M, K] float32 (callers flatten leading dims); bias [N] float32 or absent; out [M, N] float32.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

#include "verl/checks.h"

namespace verl {

inline void check_int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                              const std::optional<at::Tensor>& bias) {
  const char* op = "int8_linear";
  TORCH_CHECK(x.dim() == 2, op, ": `x` must be [rows, in_features], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": `x` must be float32, got ", x.scalar_type(),
              " (cast it, or use the reference int8_linear_ref for other dtypes)");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, op,
              ": `qweight` must be int8 [out_features, in_features], got ", qweight.scalar_type(), " ",
              qweight.sizes());
  TORCH_CHECK(qweight.size(1) == x.size(1), op, ": `qweight` has ", qweight.size(1), " in_features but `x` has ",
              x.size(1));
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == qweight.size(0) && scale.scalar_type() == at::kFloat, op,
              ": `scale` must be float32 [", qweight.size(0), "] (one per output row), got ", scale.scalar_type(),
              " ", scale.sizes());
  check_same_device(x, qweight, op, "x", "qweight");
  check_same_device(x, scale, op, "x", "scale");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == qweight.size(0) && bias->scalar_type() == at::kFloat, op,
                ": `bias` must be float32 [", qweight.size(0), "], got ", bias->scalar_type(), " ", bias->sizes());
    check_same_device(x, *bias, op, "x", "bias");
  }
}

}  // namespace verl
