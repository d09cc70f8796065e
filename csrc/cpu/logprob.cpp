// CPU kernels of the log-prob / entropy ops; the chunking, GEMMs and argument checks are shared with
// CUDA in verl/logprob.h. Rows run in parallel (at::parallel_for); within a row the logits stream through
// an L1-sized block: convert + scale, block max, then sum exp(z - max) and exp(z - max)(z - max) in one
// vectorised loop, and the block folds into the row's running state (an online softmax over blocks).
//
// float32 / 16-bit inputs compute in float with a polynomial exp that the compiler vectorises (libm's
// expf is a call per element); float64 inputs use std::exp throughout, so float64 results are exact to
// rounding and the tests can hold the kernels to tight tolerances there.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "verl/cpu_math.h"
#include "verl/logprob.h"

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
// One build serves any x86-64 CPU; the loader picks the AVX2+FMA clone where the CPU has it.
#define VERL_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VERL_SIMD_CLONES
#endif

namespace verl {
namespace {

constexpr int64_t kBlock = 512;  // floats per block: 2 KiB, stays in L1 between the block's passes
// exp(-87) is the smallest normal float's order; clamping there keeps exp(d) * d finite for -inf logits
// (masked vocabulary entries), where the unclamped product would be 0 * -inf = NaN.
constexpr float kMinExpArgF = -87.0f;
constexpr double kMinExpArgD = -708.0;


VERL_SIMD_CLONES float block_max(const float* z, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = z[i] > mx ? z[i] : mx;
  return mx;
}

VERL_SIMD_CLONES void block_sums(const float* z, int64_t n, float mx, float* out_s, float* out_t) {
  float s = 0.0f, t = 0.0f;
#pragma omp simd reduction(+ : s, t)
  for (int64_t i = 0; i < n; ++i) {
    float d = z[i] - mx;
    d = d < kMinExpArgF ? kMinExpArgF : d;
    const float e = exp_poly(d);
    s += e;
    t += e * d;
  }
  *out_s = s;
  *out_t = t;
}

// z (scaled logits) -> d loss / d x in place, for one row block.
VERL_SIMD_CLONES void block_grad(float* z, int64_t n, float lse, float ent, float c, float gh, float inv_t) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float d = z[i] - lse;
    d = d < kMinExpArgF ? kMinExpArgF : d;
    z[i] = inv_t * exp_poly(d) * (c - gh * (d + ent));
  }
}

double block_max(const double* z, int64_t n) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = z[i] > mx ? z[i] : mx;
  return mx;
}

void block_sums(const double* z, int64_t n, double mx, double* out_s, double* out_t) {
  double s = 0.0, t = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::max(z[i] - mx, kMinExpArgD);
    const double e = std::exp(d);
    s += e;
    t += e * d;
  }
  *out_s = s;
  *out_t = t;
}

void block_grad(double* z, int64_t n, double lse, double ent, double c, double gh, double inv_t) {
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::max(z[i] - lse, kMinExpArgD);
    z[i] = inv_t * std::exp(d) * (c - gh * (d + ent));
  }
}

// Folds a block's (max bm, S and T shifted by bm) into a row's running (m, S, T): rescale whichever side
// has the smaller max by a = exp(small - big); T shifts by S (small - big) when its reference moves.
inline void merge(double& m, double& S, double& T, double bm, double bS, double bT) {
  if (!(bS > 0.0)) return;
  if (!(S > 0.0)) {
    m = bm, S = bS, T = bT;
    return;
  }
  if (bm > m) {
    const double a = std::exp(m - bm);
    T = a * (T + S * (m - bm)) + bT;
    S = a * S + bS;
    m = bm;
  } else {
    const double a = std::exp(bm - m);
    T += a * (bT + bS * (bm - m));
    S += a * bS;
  }
}

template <typename scalar_t, typename acc_t>
inline void load_scaled(const scalar_t* x, int64_t n, acc_t inv_t, acc_t* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<acc_t>(x[i]) * inv_t;
}

template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

struct CpuKernels {
  static void stats_update(const at::Tensor& x, const at::Tensor& labels, int64_t col0, int64_t vocab_start,
                           int64_t ignore_index, double inv_t, at::Tensor& m, at::Tensor& S, at::Tensor& T,
                           at::Tensor& target) {
    const int64_t rows = x.size(0), cols = x.size(1), ld = x.stride(0);
    const int64_t* lab = labels.data_ptr<int64_t>();
    double *pm = m.data_ptr<double>(), *pS = S.data_ptr<double>(), *pT = T.data_ptr<double>(),
           *pt = target.data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "verl_logprob_stats", [&] {
      using acc_t = acc_type_t<scalar_t>;
      const scalar_t* px = x.const_data_ptr<scalar_t>();
      const acc_t scale = static_cast<acc_t>(inv_t);
      at::parallel_for(0, rows, row_grain(cols), [&](int64_t b, int64_t e) {
        acc_t buf[kBlock];
        for (int64_t r = b; r < e; ++r) {
          if (lab[r] == ignore_index) continue;
          const scalar_t* xr = px + r * ld;
          double rm = pm[r], rS = pS[r], rT = pT[r];
          for (int64_t j = 0; j < cols; j += kBlock) {
            const int64_t len = std::min(kBlock, cols - j);
            load_scaled(xr + j, len, scale, buf);
            const acc_t bm = block_max(buf, len);
            acc_t bS, bT;
            block_sums(buf, len, bm, &bS, &bT);
            merge(rm, rS, rT, bm, bS, bT);
          }
          pm[r] = rm, pS[r] = rS, pT[r] = rT;
          const int64_t local = lab[r] - vocab_start - col0;
          if (local >= 0 && local < cols) pt[r] = static_cast<double>(xr[local]) * inv_t;
        }
      });
    });
  }

  static void grad_chunk(const at::Tensor& x, at::Tensor& out, const at::Tensor& labels, int64_t col0,
                         int64_t vocab_start, int64_t ignore_index, double inv_t, const at::Tensor& lse,
                         const at::Tensor& ent, const at::Tensor& c, const at::Tensor& gh, const at::Tensor& glp) {
    const int64_t rows = x.size(0), cols = x.size(1), ldx = x.stride(0), ldo = out.stride(0);
    const int64_t* lab = labels.data_ptr<int64_t>();
    const double *plse = lse.const_data_ptr<double>(), *pent = ent.const_data_ptr<double>(),
                 *pc = c.const_data_ptr<double>(), *pgh = gh.const_data_ptr<double>(),
                 *pglp = glp.const_data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "verl_logprob_grad", [&] {
      using acc_t = acc_type_t<scalar_t>;
      const scalar_t* px = x.const_data_ptr<scalar_t>();
      scalar_t* po = out.data_ptr<scalar_t>();
      const acc_t scale = static_cast<acc_t>(inv_t);
      at::parallel_for(0, rows, row_grain(cols), [&](int64_t b, int64_t e) {
        acc_t buf[kBlock];
        for (int64_t r = b; r < e; ++r) {
          scalar_t* orow = po + r * ldo;
          if (lab[r] == ignore_index) {
            std::fill(orow, orow + cols, scalar_t(0));
            continue;
          }
          const scalar_t* xr = px + r * ldx;
          const acc_t rl = static_cast<acc_t>(plse[r]), rh = static_cast<acc_t>(pent[r]),
                      rc = static_cast<acc_t>(pc[r]), rg = static_cast<acc_t>(pgh[r]);
          const int64_t local = lab[r] - vocab_start - col0;
          const bool owns = local >= 0 && local < cols;
          // Read before the row is overwritten (x and out may be the same buffer).
          const acc_t at_target = owns ? static_cast<acc_t>(xr[local]) : acc_t(0);
          for (int64_t j = 0; j < cols; j += kBlock) {
            const int64_t len = std::min(kBlock, cols - j);
            if (std::is_same_v<scalar_t, acc_t>) {  // no staging copy: compute in the output row
              acc_t* o = reinterpret_cast<acc_t*>(orow + j);  // same type on this branch
              load_scaled(xr + j, len, scale, o);
              block_grad(o, len, rl, rh, rc, rg, scale);
            } else {
              load_scaled(xr + j, len, scale, buf);
              block_grad(buf, len, rl, rh, rc, rg, scale);
              for (int64_t i = 0; i < len; ++i) orow[j + i] = static_cast<scalar_t>(buf[i]);
            }
          }
          if (owns) {
            // The target's entry gets the extra inv_t * g_logprob; recomputed from its saved logit so the
            // sum happens in acc_t, not in a 16-bit output.
            acc_t one = at_target * scale;
            block_grad(&one, 1, rl, rh, rc, rg, scale);
            orow[local] = static_cast<scalar_t>(one + scale * static_cast<acc_t>(pglp[r]));
          }
        }
      });
    });
  }
};

using K = CpuKernels;

}  // namespace

TORCH_LIBRARY_IMPL(verl, CPU, m) {
  m.impl("logprob_entropy", &logprob::logprob_entropy<K>);
  m.impl("logprob_entropy_shard", &logprob::logprob_entropy_shard<K>);
  m.impl("logprob_entropy_backward", &logprob::logprob_entropy_backward<K>);
  m.impl("linear_logprob_entropy", &logprob::linear_logprob_entropy<K>);
  m.impl("linear_logprob_entropy_shard", &logprob::linear_logprob_entropy_shard<K>);
  m.impl("linear_logprob_entropy_backward", &logprob::linear_logprob_entropy_backward<K>);
}

}  // namespace verl
