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
