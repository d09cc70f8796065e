// CPU kernels of the masked reductions: masked_sum / masked_mean (over everything or one dim),
// masked_var and masked_whiten (over everything), and their backward ops.
//
// Accumulation is in double whatever the input dtype: these reductions feed advantage whitening,
// where a float32 running sum over millions of tokens loses digits that matter.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>

#include "verl/checks.h"

namespace verl {
namespace {

constexpr int64_t kGrain = 32768;
using Acc2 = std::array<double, 2>;

// Sums two per-element quantities over [0, n) in parallel; `body(begin, end)` returns partial sums.
template <typename F>
Acc2 parallel_sum2(int64_t n, const F& body) {
  return at::parallel_reduce(0, n, kGrain, Acc2{0.0, 0.0}, body,
                             [](const Acc2& a, const Acc2& b) { return Acc2{a[0] + b[0], a[1] + b[1]}; });
}

std::vector<int64_t> reduced_shape(const at::Tensor& values, int64_t d) {
  if (d < 0) return {};
  std::vector<int64_t> shape = values.sizes().vec();
  shape.erase(shape.begin() + d);
  return shape;
}

// The values laid out as [rows, cols] with the reduced dim last (rows = 1 for a full reduction).
struct RowView {
  at::Tensor x, m;
  int64_t rows, cols, dim;  // dim = -1 for a full reduction
};

RowView row_view(const at::Tensor& values, const at::Tensor& mask, std::optional<int64_t> dim, const char* op) {
  check_floating(values, op, "values");
  check_mask(values, mask, op);
  const int64_t d = normalize_dim(dim, values.dim(), op);
  RowView v;
  v.dim = d;
  if (d < 0) {
    v.x = values.contiguous();
    v.m = mask_as_bool(mask);
    v.rows = 1;
    v.cols = values.numel();
  } else {
    v.x = values.movedim(d, -1).contiguous();
    v.m = mask_as_bool(mask.movedim(d, -1));
    v.cols = values.size(d);
    v.rows = c10::multiply_integers(reduced_shape(values, d));
  }
  return v;
}

template <typename scalar_t>
Acc2 sum_count(const scalar_t* x, const bool* m, int64_t n) {
  return parallel_sum2(n, [&](int64_t b, int64_t e, const Acc2&) {
    double s = 0.0, c = 0.0;
    for (int64_t i = b; i < e; ++i) {
      // A select, not keep * x: 0 * NaN (or inf) at a padded position would poison the sum.
      s += m[i] ? static_cast<double>(x[i]) : 0.0;
      c += m[i] ? 1.0 : 0.0;
    }
    return Acc2{s, c};
  });
}

struct Stats {
  double mean = 0.0, var = 0.0, count = 0.0, denom = 0.0;
};

// Mean and variance over the mask, two-pass (centered) for accuracy. denom = count - 1 when unbiased;
// with denom <= 0 the variance is defined as 0.
template <typename scalar_t>
Stats masked_stats(const scalar_t* x, const bool* m, int64_t n, bool unbiased) {
  Stats st;
  const Acc2 sc = sum_count(x, m, n);
  st.count = sc[1];
  if (st.count == 0.0) return st;
  st.mean = sc[0] / st.count;
  const double mean = st.mean;
  const Acc2 ss = parallel_sum2(n, [&](int64_t b, int64_t e, const Acc2&) {
    double s = 0.0;
    for (int64_t i = b; i < e; ++i) {
      const double dx = static_cast<double>(x[i]) - mean;
      s += m[i] ? dx * dx : 0.0;
    }
    return Acc2{s, 0.0};
  });
  st.denom = unbiased ? st.count - 1.0 : st.count;
  st.var = st.denom > 0.0 ? ss[0] / st.denom : 0.0;
  return st;
}

at::Tensor masked_reduce_cpu(const at::Tensor& values, const at::Tensor& mask, std::optional<int64_t> dim, bool mean,
                             const char* op) {
  RowView v = row_view(values, mask, dim, op);
  at::Tensor out = at::empty(reduced_shape(values, v.dim), values.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_masked", [&] {
    const scalar_t* x = v.x.data_ptr<scalar_t>();
    const bool* m = v.m.data_ptr<bool>();
    scalar_t* o = out.data_ptr<scalar_t>();
    auto finish = [mean](const Acc2& sc) { return mean ? (sc[1] > 0.0 ? sc[0] / sc[1] : 0.0) : sc[0]; };
    if (v.rows == 1) {
      o[0] = static_cast<scalar_t>(finish(sum_count(x, m, v.cols)));
      return;
    }
    const int64_t cols = v.cols;
    at::parallel_for(0, v.rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        double s = 0.0, c = 0.0;
        const scalar_t* xr = x + r * cols;
        const bool* mr = m + r * cols;
        for (int64_t j = 0; j < cols; ++j) {
          s += mr[j] ? static_cast<double>(xr[j]) : 0.0;
          c += mr[j] ? 1.0 : 0.0;
        }
        o[r] = static_cast<scalar_t>(finish(Acc2{s, c}));
      }
    });
  });
  return out;
}

at::Tensor masked_sum_cpu(const at::Tensor& values, const at::Tensor& mask, std::optional<int64_t> dim) {
  return masked_reduce_cpu(values, mask, dim, /*mean=*/false, "masked_sum");
}

at::Tensor masked_mean_cpu(const at::Tensor& values, const at::Tensor& mask, std::optional<int64_t> dim) {
  return masked_reduce_cpu(values, mask, dim, /*mean=*/true, "masked_mean");
}

// grad_values[..., j] = mask[..., j] * grad[...] (/ count of the row when mean).
at::Tensor masked_reduce_backward_cpu(const at::Tensor& grad, const at::Tensor& mask, std::optional<int64_t> dim,
                                      bool mean) {
  const char* op = "masked_reduce_backward";
  check_floating(grad, op, "grad");
  check_same_device(grad, mask, op, "grad", "mask");
  const int64_t d = normalize_dim(dim, mask.dim(), op);
  const at::Tensor m = d < 0 ? mask_as_bool(mask) : mask_as_bool(mask.movedim(d, -1));
  const at::Tensor g = grad.contiguous();
  const int64_t cols = d < 0 ? mask.numel() : mask.size(d);
  const int64_t rows = d < 0 ? 1 : c10::multiply_integers(reduced_shape(mask, d));
  TORCH_CHECK(g.numel() == rows, op, ": `grad` has ", g.numel(), " elements, but reducing `mask` ", mask.sizes(),
              " gives ", rows);
  at::Tensor out = at::empty(m.sizes(), grad.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "verl_masked", [&] {
    const bool* mp = m.data_ptr<bool>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    if (rows == 1) {
      double scale = static_cast<double>(gp[0]);
      if (mean) {
        const Acc2 cnt = parallel_sum2(cols, [&](int64_t b, int64_t e, const Acc2&) {
          double c = 0.0;
          for (int64_t i = b; i < e; ++i) c += mp[i] ? 1.0 : 0.0;
          return Acc2{c, 0.0};
        });
        scale = cnt[0] > 0.0 ? scale / cnt[0] : 0.0;
      }
      const auto s = static_cast<scalar_t>(scale);
      at::parallel_for(0, cols, kGrain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) o[i] = mp[i] ? s : scalar_t(0);
      });
      return;
    }
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const bool* mr = mp + r * cols;
        double scale = static_cast<double>(gp[r]);
        if (mean) {
          double c = 0.0;
          for (int64_t j = 0; j < cols; ++j) c += mr[j] ? 1.0 : 0.0;
          scale = c > 0.0 ? scale / c : 0.0;
        }
        const auto s = static_cast<scalar_t>(scale);
        for (int64_t j = 0; j < cols; ++j) o[r * cols + j] = mr[j] ? s : scalar_t(0);
      }
    });
  });
  return d < 0 ? out : out.movedim(-1, d).contiguous();
}

at::Tensor masked_var_cpu(const at::Tensor& values, const at::Tensor& mask, bool unbiased) {
  RowView v = row_view(values, mask, std::nullopt, "masked_var");
  at::Tensor out = at::empty({}, values.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "masked_var", [&] {
    const Stats st = masked_stats(v.x.data_ptr<scalar_t>(), v.m.data_ptr<bool>(), v.cols, unbiased);
    out.data_ptr<scalar_t>()[0] = static_cast<scalar_t>(st.var);
  });
  return out;
}

// d var / d x_i = 2 m_i (x_i - mean) / denom (the mean's own gradient term sums to zero).
at::Tensor masked_var_backward_cpu(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& mask,
                                   bool unbiased) {
  RowView v = row_view(values, mask, std::nullopt, "masked_var_backward");
  TORCH_CHECK(grad.numel() == 1, "masked_var_backward: `grad` must have one element, got ", grad.sizes());
  at::Tensor out = at::empty(values.sizes(), values.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "masked_var_backward", [&] {
    const scalar_t* x = v.x.data_ptr<scalar_t>();
    const bool* m = v.m.data_ptr<bool>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const Stats st = masked_stats(x, m, v.cols, unbiased);
    const double g = grad.to(at::kDouble).item<double>();
    const double scale = st.denom > 0.0 ? 2.0 * g / st.denom : 0.0;
    at::parallel_for(0, v.cols, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        o[i] = m[i] ? static_cast<scalar_t>(scale * (static_cast<double>(x[i]) - st.mean)) : scalar_t(0);
    });
  });
  return out;
}

// y_i = m_i * ((x_i - mean) * r (+ mean when !shift_mean)), r = 1 / sqrt(var + eps), var unbiased.
at::Tensor masked_whiten_cpu(const at::Tensor& values, const at::Tensor& mask, bool shift_mean, double eps) {
  TORCH_CHECK(eps >= 0.0, "masked_whiten: `eps` must be >= 0, got ", eps);
  RowView v = row_view(values, mask, std::nullopt, "masked_whiten");
  at::Tensor out = at::empty(values.sizes(), values.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "masked_whiten", [&] {
    const scalar_t* x = v.x.data_ptr<scalar_t>();
    const bool* m = v.m.data_ptr<bool>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const Stats st = masked_stats(x, m, v.cols, /*unbiased=*/true);
    const double r = 1.0 / std::sqrt(st.var + eps);
    const double add = shift_mean ? 0.0 : st.mean;
    at::parallel_for(0, v.cols, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        o[i] = m[i] ? static_cast<scalar_t>((static_cast<double>(x[i]) - st.mean) * r + add) : scalar_t(0);
    });
  });
  return out;
}

// With S_g = sum_j m_j g_j and S_gx = sum_j m_j g_j (x_j - mean):
// dx_i = m_i [ r (g_i - S_g / n) - r^3 (x_i - mean) S_gx / denom  (+ S_g / n when !shift_mean) ].
at::Tensor masked_whiten_backward_cpu(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& mask,
                                      bool shift_mean, double eps) {
  const char* op = "masked_whiten_backward";
  RowView v = row_view(values, mask, std::nullopt, op);
  check_same_shape(values, grad, op, "values", "grad");
  const at::Tensor gc = grad.contiguous().to(values.scalar_type());
  at::Tensor out = at::empty(values.sizes(), values.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_masked", [&] {
    const scalar_t* x = v.x.data_ptr<scalar_t>();
    const bool* m = v.m.data_ptr<bool>();
    const scalar_t* g = gc.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t n = v.cols;
    const Stats st = masked_stats(x, m, n, /*unbiased=*/true);
    const double mean = st.mean;
    const Acc2 sums = parallel_sum2(n, [&](int64_t b, int64_t e, const Acc2&) {
      double sg = 0.0, sgx = 0.0;
      for (int64_t i = b; i < e; ++i) {
        if (!m[i]) continue;
        const double gi = static_cast<double>(g[i]);
        sg += gi;
        sgx += gi * (static_cast<double>(x[i]) - mean);
      }
      return Acc2{sg, sgx};
    });
    const double r = 1.0 / std::sqrt(st.var + eps);
    const double mean_g = st.count > 0.0 ? sums[0] / st.count : 0.0;
    const double k = st.denom > 0.0 ? r * r * r * sums[1] / st.denom : 0.0;
    const double add = shift_mean ? 0.0 : mean_g;
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const double xi = static_cast<double>(x[i]) - mean;
        o[i] = m[i] ? static_cast<scalar_t>(r * (static_cast<double>(g[i]) - mean_g) - k * xi + add) : scalar_t(0);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CPU, m) {
  m.impl("masked_sum", &masked_sum_cpu);
  m.impl("masked_mean", &masked_mean_cpu);
  m.impl("masked_var", &masked_var_cpu);
  m.impl("masked_whiten", &masked_whiten_cpu);
  m.impl("masked_reduce_backward", &masked_reduce_backward_cpu);
  m.impl("masked_var_backward", &masked_var_backward_cpu);
  m.impl("masked_whiten_backward", &masked_whiten_backward_cpu);
}

}  // namespace verl
