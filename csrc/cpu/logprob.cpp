// CPU kernels of the log-prob / entropy ops; the chunking, GEMMs and argument checks are shared with
// CUDA in verl/logprob.h. Rows run in parallel (at::parallel_for); within a row the logits stream through
// an L1-sized block: a max pass, then one pass that sums exp(z - max) and exp(z - max)(z - max) with
// z = x / temperature formed on the fly, and the block folds into the row's running state (an online
// softmax over blocks). The backward is one pass per block.
//
// float32 / 16-bit inputs compute in float, eight lanes at a time (vf8 and the polynomial exp of
// verl/cpu_math.h; libm's expf is a call per element); float64 inputs use std::exp throughout, so float64
// results are exact to rounding and the tests can hold the kernels to tight tolerances there.
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
#include "verl/rl_head.h"

namespace verl {
namespace {

// Floats per block: 16 KiB, so a block read once from L2/L3 by the max pass stays in L1 for the exp pass.
// LM-head chunks (chunk_v columns) are usually a single block.
constexpr int64_t kBlock = 4096;
// exp(-87) is the smallest normal float's order; clamping there keeps exp(d) * d finite for -inf logits
// (masked vocabulary entries), where the unclamped product would be 0 * -inf = NaN.
constexpr float kMinExpArgF = -87.0f;
constexpr double kMinExpArgD = -708.0;

// The float kernels work on raw logits x and scale them (z = x * scale, scale = 1 / temperature > 0) on
// the fly, so no pass is spent writing z; max z = scale * max x because scale > 0.

// The block's max, and in *nan whether it holds a NaN (the max itself skips them: x > m is false for NaN).
VERL_SIMD_CLONES float block_max(const float* x, int64_t n, bool* nan) {
  const float ninf = -std::numeric_limits<float>::infinity();
  vf8 m0 = {ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf}, m1 = m0;
  vi8 n0 = {}, n1 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // two accumulators: the max pass is load-bound, not latency-bound
    vf8 a, b;
    load_vf8(a, x + i);
    load_vf8(b, x + i + 8);
    m0 = a > m0 ? a : m0;
    m1 = b > m1 ? b : m1;
    n0 |= a != a;
    n1 |= b != b;
  }
  m0 = m1 > m0 ? m1 : m0;
  n0 |= n1;
  float mx = hmax(m0);
  bool any = false;
  for (int k = 0; k < 8; ++k) any |= n0[k] != 0;
  for (; i < n; ++i) {
    mx = x[i] > mx ? x[i] : mx;
    any |= x[i] != x[i];
  }
  *nan = any;
  return mx;
}

// S = sum exp(d), T = sum exp(d) d with d = x * scale - mz (clamped), for one block.
VERL_SIMD_CLONES void block_sums(const float* x, int64_t n, float scale, float mz, float* out_s, float* out_t) {
  vf8 s = {}, t = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    vf8 d, e;
    load_vf8(d, x + i);
    d = d * scale - mz;
    d = d < kMinExpArgF ? kMinExpArgF : d;
    e = d;
    exp_poly_inplace(e);
    s += e;
    t += e * d;
  }
  float ss = hsum(s), ts = hsum(t);
  for (; i < n; ++i) {
    float d = x[i] * scale - mz;
    d = d < kMinExpArgF ? kMinExpArgF : d;
    const float e = exp_poly(d);
    ss += e;
    ts += e * d;
  }
  *out_s = ss;
  *out_t = ts;
}

// d loss / d x for one block (formula in logprob.h); out may be x itself.
VERL_SIMD_CLONES void block_grad(const float* x, float* out, int64_t n, float scale, float lse, float ent, float c,
                                 float gh) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    vf8 d, e;
    load_vf8(d, x + i);
    d = d * scale - lse;
    d = d < kMinExpArgF ? kMinExpArgF : d;
    e = d;
    exp_poly_inplace(e);
    e = scale * e * (c - gh * (d + ent));
    store_vf8(out + i, e);
  }
  for (; i < n; ++i) {
    float d = x[i] * scale - lse;
    d = d < kMinExpArgF ? kMinExpArgF : d;
    out[i] = scale * exp_poly(d) * (c - gh * (d + ent));
  }
}

// float64: std::exp, so float64 results are exact to rounding.
double block_max(const double* x, int64_t n, bool* nan) {
  double mx = -std::numeric_limits<double>::infinity();
  bool any = false;
  for (int64_t i = 0; i < n; ++i) {
    mx = x[i] > mx ? x[i] : mx;
    any |= x[i] != x[i];
  }
  *nan = any;
  return mx;
}

void block_sums(const double* x, int64_t n, double scale, double mz, double* out_s, double* out_t) {
  double s = 0.0, t = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::max(x[i] * scale - mz, kMinExpArgD);
    const double e = std::exp(d);
    s += e;
    t += e * d;
  }
  *out_s = s;
  *out_t = t;
}

void block_grad(const double* x, double* out, int64_t n, double scale, double lse, double ent, double c, double gh) {
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::max(x[i] * scale - lse, kMinExpArgD);
    out[i] = scale * std::exp(d) * (c - gh * (d + ent));
  }
}

// Folds a block's (max bm, S and T shifted by bm) into a row's running (m, S, T): rescale whichever side
// has the smaller max by a = exp(small - big); T shifts by S (small - big) when its reference moves.
inline void merge(double& m, double& S, double& T, double bm, double bS, double bT) {
  if (std::isnan(S)) return;  // a poisoned row stays NaN (see "Non-finite logits" in logprob.h)
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

template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// A block of a row in the compute type: float32/float64 rows are read in place, 16-bit ones converted into buf.
template <typename scalar_t, typename acc_t>
inline const acc_t* as_acc(const scalar_t* x, int64_t n, acc_t* buf) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return x;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<acc_t>(x[i]);
    return buf;
  }
}

// block_grad from scalar_t rows to scalar_t rows: float32/float64 straight into the output row (which may
// be the input row), 16-bit through buf.
template <typename scalar_t, typename acc_t>
inline void grad_block(const scalar_t* x, scalar_t* out, int64_t n, acc_t* buf, acc_t scale, acc_t lse, acc_t ent,
                       acc_t c, acc_t gh) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    block_grad(x, out, n, scale, lse, ent, c, gh);
  } else {
    block_grad(as_acc(x, n, buf), buf, n, scale, lse, ent, c, gh);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(buf[i]);
  }
}

// Rows per task: about 64K elements, so each task is worth far more than at::parallel_for's dispatch and
// a [1024, 1024] chunk still splits into 16 tasks for the threads to share.
int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1)); }

struct CpuKernels {
  // Fused RL loss head (verl/rl_head.h): about 6 * 2^20 logits (24 MiB of float32) per chunk, but at least 192
  // rows. The chunk buffer is the op's only memory beyond its gradient outputs (grad_W alone is V x H), and at
  // N=4096 it has to stay within eager's peak / 8 minus those outputs: 35 MiB at H=2048, V=32k. Below ~192 rows
  // the per-chunk passes over W (GEMMs 1, 2) and grad_W (GEMM 3) start to show in the time at single-thread
  // BLAS speed (benchmarks/kernels/bench_logprob.py --loss).
  static int64_t rl_head_chunk_rows(int64_t v) { return std::clamp<int64_t>((int64_t{6} << 20) / v, 192, 4096); }

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
          for (int64_t j = 0; j < cols && !std::isnan(rS); j += kBlock) {
            const int64_t len = std::min(kBlock, cols - j);
            const acc_t* blk = as_acc(xr + j, len, buf);
            bool nan = false;
            const acc_t bm = block_max(blk, len, &nan) * scale;
            if (nan || bm == std::numeric_limits<acc_t>::infinity()) {
              rm = rS = rT = std::numeric_limits<double>::quiet_NaN();
              break;
            }
            acc_t bS, bT;
            block_sums(blk, len, scale, bm, &bS, &bT);
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
            grad_block(xr + j, orow + j, len, buf, scale, rl, rh, rc, rg);
          }
          if (owns) {
            // The target's entry gets the extra inv_t * g_logprob; recomputed from its saved logit so the
            // sum happens in acc_t, not in a 16-bit output.
            acc_t one;
            block_grad(&at_target, &one, 1, scale, rl, rh, rc, rg);
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
  m.impl("linear_rl_loss", &rl_head::linear_rl_loss<K>);
}

}  // namespace verl
