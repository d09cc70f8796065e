// Shared by the CPU and CUDA reshard kernels: argument checks and the lowering of every reshard op to
// one list of contiguous byte runs ("copy n bytes from here to there"). Lowering to bytes makes the
// kernels dtype-free and therefore bit-exact for every dtype, including float8 and bfloat16.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "verl/checks.h"

namespace verl {

struct ByteRun {
  const char* src;
  char* dst;
  int64_t nbytes;
};

// Output shapes of reshard_unpack, validated against the flat buffer's length.
inline std::vector<std::vector<int64_t>> unpack_shapes(const at::Tensor& flat, at::IntArrayRef shapes,
                                                       at::IntArrayRef ndims) {
  const char* op = "reshard_unpack";
  TORCH_CHECK(flat.dim() == 1, op, ": `flat` must be 1-D (a bucket from reshard_pack), got shape ", flat.sizes());
  std::vector<std::vector<int64_t>> out;
  size_t pos = 0;
  int64_t total = 0;
  for (size_t i = 0; i < ndims.size(); ++i) {
    TORCH_CHECK(ndims[i] >= 0, op, ": `ndims[", i, "]`=", ndims[i], " is negative");
    TORCH_CHECK(pos + ndims[i] <= shapes.size(), op, ": `shapes` has ", shapes.size(), " entries but `ndims` asks for ",
                "more (", pos + ndims[i], " by output ", i, "); pass every output shape concatenated");
    std::vector<int64_t> s(shapes.begin() + pos, shapes.begin() + pos + ndims[i]);
    int64_t n = 1;
    for (int64_t d : s) {
      TORCH_CHECK(d >= 0, op, ": output ", i, " has a negative size in ", at::IntArrayRef(s));
      n *= d;
    }
    total += n;
    pos += ndims[i];
    out.push_back(std::move(s));
  }
  TORCH_CHECK(pos == shapes.size(), op, ": `shapes` has ", shapes.size(), " entries but `ndims` sums to ", pos);
  TORCH_CHECK(total == flat.numel(), op, ": the output shapes hold ", total, " elements but `flat` has ", flat.numel(),
              "; the shapes must describe the bucket exactly");
  return out;
}

// Geometry of reshard_gather: every tensor seen as [outer, size(dim), inner].
struct GatherGeometry {
  int64_t outer = 1, inner = 1, out_dim = 0;
};

inline GatherGeometry check_gather(at::TensorList sources, const at::Tensor& plan, int64_t dim,
                                   at::IntArrayRef out_shape) {
  const char* op = "reshard_gather";
  check_same_dtype_device(sources, op, "sources");
  const int64_t nd = static_cast<int64_t>(out_shape.size());
  TORCH_CHECK(nd >= 1, op, ": `out_shape` must have at least one dimension");
  TORCH_CHECK(dim >= 0 && dim < nd, op, ": `dim`=", dim, " is out of range for `out_shape` ", out_shape);
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 2 && plan.size(1) == 4, op,
              ": `plan` must be an int64 tensor of shape [n, 4] (source, source start, out start, length), got ",
              plan.scalar_type(), " ", plan.sizes());
  TORCH_CHECK(plan.device().is_cpu(), op, ": `plan` must be a CPU tensor (it is metadata), got ", plan.device());
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& s = sources[i];
    TORCH_CHECK(s.dim() == nd, op, ": `sources[", i, "]` has ", s.dim(), " dims but `out_shape` ", out_shape,
                " has ", nd);
    for (int64_t d = 0; d < nd; ++d) {
      TORCH_CHECK(d == dim || s.size(d) == out_shape[d], op, ": `sources[", i, "]` has shape ", s.sizes(),
                  " which differs from `out_shape` ", out_shape, " outside `dim`=", dim);
    }
  }
  GatherGeometry g;
  for (int64_t d = 0; d < dim; ++d) g.outer *= out_shape[d];
  for (int64_t d = dim + 1; d < nd; ++d) g.inner *= out_shape[d];
  g.out_dim = out_shape[dim];
  std::vector<char> covered(static_cast<size_t>(g.out_dim), 0);
  auto p = plan.contiguous();
  const int64_t* row = p.data_ptr<int64_t>();
  for (int64_t r = 0; r < p.size(0); ++r, row += 4) {
    const int64_t src = row[0], s0 = row[1], o0 = row[2], len = row[3];
    TORCH_CHECK(src >= 0 && src < static_cast<int64_t>(sources.size()), op, ": plan row ", r, " names source ", src,
                " but there are ", sources.size(), " sources");
    TORCH_CHECK(len > 0 && s0 >= 0 && s0 + len <= sources[src].size(dim), op, ": plan row ", r, " reads [", s0, ", ",
                s0 + len, ") of `sources[", src, "]` whose size along dim ", dim, " is ", sources[src].size(dim));
    TORCH_CHECK(o0 >= 0 && o0 + len <= g.out_dim, op, ": plan row ", r, " writes [", o0, ", ", o0 + len,
                ") but `out_shape`[", dim, "] is ", g.out_dim);
    for (int64_t k = o0; k < o0 + len; ++k) {
      TORCH_CHECK(!covered[k], op, ": plan row ", r, " writes out index ", k, " along dim ", dim,
                  " which an earlier row already wrote; every out row must come from exactly one block");
      covered[k] = 1;
    }
  }
  for (int64_t k = 0; k < g.out_dim; ++k) {
    TORCH_CHECK(covered[k], op, ": no plan row writes out index ", k, " along dim ", dim,
                "; the plan must cover the whole output");
  }
  return g;
}

// Allocates reshard_pack's flat output and returns its byte runs: one per contiguous non-empty tensor, in
// order; non-contiguous tensors are copied into their slice of `flat` right here (a strided copy).
inline std::vector<ByteRun> pack_runs(at::TensorList tensors, at::Tensor& flat) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  flat = at::empty({total}, tensors[0].options());
  const int64_t es = flat.element_size();
  std::vector<ByteRun> runs;
  int64_t off = 0;
  for (const auto& t : tensors) {
    if (t.numel() == 0) continue;
    if (t.is_contiguous()) {
      runs.push_back({static_cast<const char*>(t.data_ptr()), static_cast<char*>(flat.data_ptr()) + off * es,
                      t.numel() * es});
    } else {
      flat.narrow(0, off, t.numel()).view(t.sizes()).copy_(t);
    }
    off += t.numel();
  }
  return runs;
}

// Allocates reshard_unpack's outputs (`outs`, one per shape, in order) from the contiguous `flat` and returns
// the byte runs that fill them.
inline std::vector<ByteRun> unpack_runs(const at::Tensor& flat, const std::vector<std::vector<int64_t>>& shapes,
                                        std::vector<at::Tensor>& outs) {
  const int64_t es = flat.element_size();
  std::vector<ByteRun> runs;
  int64_t off = 0;
  for (const auto& s : shapes) {
    at::Tensor o = at::empty(s, flat.options());
    if (o.numel() > 0) {
      runs.push_back({static_cast<const char*>(flat.data_ptr()) + off * es, static_cast<char*>(o.data_ptr()),
                      o.numel() * es});
    }
    off += o.numel();
    outs.push_back(std::move(o));
  }
  return runs;
}

// Byte runs of reshard_gather; `srcs` are the contiguous sources.
inline std::vector<ByteRun> gather_runs(const std::vector<at::Tensor>& srcs, const at::Tensor& plan, int64_t dim,
                                        const GatherGeometry& g, at::Tensor& out) {
  const int64_t es = out.element_size();
  auto p = plan.contiguous();
  const int64_t* row = p.data_ptr<int64_t>();
  std::vector<ByteRun> runs;
  runs.reserve(static_cast<size_t>(p.size(0) * g.outer));
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t r = 0; r < p.size(0); ++r, row += 4) {
    const at::Tensor& s = srcs[row[0]];
    const int64_t sdim = s.size(dim);
    const char* base = static_cast<const char*>(s.data_ptr());
    const int64_t nbytes = row[3] * g.inner * es;
    for (int64_t o = 0; o < g.outer; ++o) {
      runs.push_back({base + ((o * sdim + row[1]) * g.inner) * es, dst + ((o * g.out_dim + row[2]) * g.inner) * es,
                      nbytes});
    }
  }
  return runs;
}

}  // namespace verl
