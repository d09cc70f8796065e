// Argument checks shared by the CPU and CUDA kernels. Every message names the op and the argument,
// so a user who passes a bad tensor learns which one and what to change.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

namespace verl {

// A mask marks valid positions: any real dtype, nonzero = valid. It must have the values' shape
// exactly (no broadcasting: a silently broadcast mask is the classic source of wrong RL losses).
inline void check_same_shape(const at::Tensor& a, const at::Tensor& b, const char* op, const char* a_name,
                             const char* b_name) {
  TORCH_CHECK(a.sizes() == b.sizes(), op, ": `", b_name, "` must have the shape of `", a_name, "` ",
              a.sizes(), ", got ", b.sizes());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* a_name,
                              const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), op, ": `", b_name, "` is on ", b.device(), " but `", a_name,
              "` is on ", a.device(), "; move both to one device");
}

inline void check_floating(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": `", name,
              "` must be a floating-point tensor (float32, float64, bfloat16 or float16), got ", t.scalar_type());
}

inline void check_mask(const at::Tensor& values, const at::Tensor& mask, const char* op) {
  check_same_device(values, mask, op, "values", "mask");
  check_same_shape(values, mask, op, "values", "mask");
  TORCH_CHECK(!at::isComplexType(mask.scalar_type()), op,
              ": `mask` must be bool or a real dtype (nonzero = valid), got ", mask.scalar_type());
}

// Masks are read as bytes (0 / 1) by every kernel; converting once here keeps kernels dtype-free.
inline at::Tensor mask_as_bool(const at::Tensor& mask) {
  return mask.scalar_type() == at::kBool ? mask.contiguous() : mask.ne(0).contiguous();
}

// Normalises an optional reduction dim against `ndim`; returns -1 for "reduce everything".
inline int64_t normalize_dim(std::optional<int64_t> dim, int64_t ndim, const char* op) {
  if (!dim.has_value()) return -1;
  int64_t d = *dim;
  TORCH_CHECK(ndim > 0, op, ": `dim` given for a 0-d tensor; pass dim=None");
  TORCH_CHECK(d >= -ndim && d < ndim, op, ": `dim`=", d, " is out of range for a tensor with ", ndim,
              " dimensions");
  return d < 0 ? d + ndim : d;
}

}  // namespace verl

// ---- reshard copies (csrc/cpu/reshard.cpp, csrc/cuda/reshard.cu) -----------------------------------
namespace verl {

// Every tensor of a bucket shares one dtype and one device: a bucket is a single flat buffer.
inline void check_same_dtype_device(at::TensorList tensors, const char* op, const char* name) {
  TORCH_CHECK(!tensors.empty(), op, ": `", name, "` is empty; pass at least one tensor");
  for (size_t i = 1; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].scalar_type() == tensors[0].scalar_type(), op, ": `", name, "[", i, "]` has dtype ",
                tensors[i].scalar_type(), " but `", name, "[0]` has ", tensors[0].scalar_type(),
                "; bucket tensors of one dtype together");
    TORCH_CHECK(tensors[i].device() == tensors[0].device(), op, ": `", name, "[", i, "]` is on ",
                tensors[i].device(), " but `", name, "[0]` is on ", tensors[0].device(), "; move them to one device");
  }
}

}  // namespace verl
