// Device-agnostic drivers of the log-prob / entropy ops (csrc/cpu/logprob.cpp, csrc/cuda/logprob.cu).
//
// Every op reduces to two per-device kernels, supplied by a backend class K:
//   K::stats_update(x [rows, cols], labels [rows], col0, vocab_start, ignore, inv_t, m, S, T, target)
//       folds one chunk of logits into each row's online-softmax state (all double [rows]):
//       m = running max of z = x * inv_t, S = sum exp(z - m), T = sum exp(z - m) (z - m).
//       Keeping T shifted by m means the entropy log S - T / S never subtracts two large numbers.
//   K::grad_chunk(x [rows, cols], out [rows, cols], labels, col0, vocab_start, ignore, inv_t, lse, H, c, gh, glp)
//       writes d(loss)/dx for one chunk given the row's final lse and entropy H (see grad formula below).
// The drivers here chunk the work (GEMMs through at::mm, which is BLAS on CPU and cuBLAS on CUDA), check
// arguments and finish the O(N) statistics with ATen ops, so both backends share one code path.
//
// Vocab sharding: a tensor of logits (or weight rows) may hold the contiguous vocab slice starting at
// `vocab_start` of a vocabulary of `vocab_size` entries. The target's logit is then taken only by the shard
// that owns the label (0 elsewhere), so callers can all-reduce it (Megatron's convention).
//
// Non-finite logits (one rule for every backend, the pure-PyTorch references included): -inf is a token of
// probability 0 (masked vocabulary), so a target at -inf has log-prob -inf; a NaN or +inf logit in a row, or a
// row of nothing but -inf, has no softmax, and its log-prob, entropy and gradient are NaN (as log_softmax
// gives), never a finite or infinite number that a loss could take for a value. The kernels keep such a row's
// online state NaN from the first bad block on (`merge` never folds a NaN state away).
//
// Gradient: with p_j = exp(z_j - lse), logprob = z_y - lse, H = lse - sum_j p_j z_j,
//   d logprob / d z_j = [j = y] - p_j,  d H / d z_j = -p_j (z_j - lse + H),  d lse / d z_j = p_j,
// so  d loss / d x_j = inv_t * (glp [j = y] + p_j (c - gh (z_j - lse + H))),  c = g_lse - g_logprob.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "verl/checks.h"

namespace verl {
namespace logprob {

using at::Tensor;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;

// Outputs are float32 for float32/bfloat16/float16 inputs and float64 for float64: log-probs feed
// importance ratios exp(logp - old_logp), where bfloat16's 8 bits of mantissa are far too few.
inline at::ScalarType out_dtype(at::ScalarType in) { return in == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_temperature(double temperature, const char* op) {
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), op, ": `temperature` must be a finite number > 0, got ",
              temperature, " (sampling at temperature 0 is greedy; use temperature=1.0 for raw log-probs)");
}

inline void check_chunks(int64_t chunk_n, int64_t chunk_v, const char* op) {
  TORCH_CHECK(chunk_n > 0, op, ": `chunk_n` must be > 0, got ", chunk_n);
  TORCH_CHECK(chunk_v > 0, op, ": `chunk_v` must be > 0, got ", chunk_v);
}

// labels [N], integer, every entry in [0, vocab_size) or == ignore_index. Returns int64 contiguous labels.
inline Tensor checked_labels(const Tensor& labels, int64_t n, int64_t vocab_size, int64_t ignore_index,
                             const Tensor& like, const char* op, const char* rows_of) {
  TORCH_CHECK(labels.dim() == 1, op, ": `labels` must be 1-D [N], got shape ", labels.sizes());
  TORCH_CHECK(labels.size(0) == n, op, ": `labels` has ", labels.size(0), " entries but `", rows_of, "` has N=", n,
              " rows; they must match");
  TORCH_CHECK(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt, op,
              ": `labels` must be int64 or int32, got ", labels.scalar_type());
  check_same_device(like, labels, op, rows_of, "labels");
  Tensor lab = labels.to(at::kLong).contiguous();
  if (n == 0) return lab;
  const Tensor bad = lab.ne(ignore_index).logical_and_(lab.lt(0).logical_or_(lab.ge(vocab_size)));
  if (bad.any().item<bool>()) {
    const int64_t i = bad.nonzero().select(1, 0)[0].item<int64_t>();
    TORCH_CHECK(false, op, ": `labels`[", i, "] = ", lab[i].item<int64_t>(), " is outside the vocabulary [0, ",
                vocab_size, ") and is not ignore_index=", ignore_index);
  }
  return lab;
}

// Rows whose last dim is contiguous are read in place (a [B, T-1, V] slice of logits need not be copied).
inline Tensor rows_view(const Tensor& x) { return x.stride(1) == 1 ? x : x.contiguous(); }

struct State {
  Tensor m, S, T, target;  // double [N]
};

inline State new_state(int64_t n, const Tensor& like) {
  auto opts = like.options().dtype(at::kDouble);
  return {at::full({n}, -std::numeric_limits<double>::infinity(), opts), at::zeros({n}, opts), at::zeros({n}, opts),
          at::zeros({n}, opts)};
}

// (target logit, lse, entropy) of each row, 0 on ignored rows, in the ops' output dtype.
inline Tensor3 finish(const State& st, const Tensor& labels, int64_t ignore_index, at::ScalarType dt) {
  const Tensor valid = labels.ne(ignore_index);
  const Tensor logS = st.S.log();
  const Tensor zero = at::zeros({}, st.S.options());
  const Tensor lse = at::where(valid, st.m + logS, zero);
  const Tensor ent = at::where(valid, logS - st.T / st.S, zero);
  const Tensor tgt = at::where(valid, st.target, zero);
  return {tgt.to(dt), lse.to(dt), ent.to(dt)};
}

inline Tensor3 as_logprob(const Tensor3& stats) {
  const auto& [tgt, lse, ent] = stats;
  return {tgt - lse, ent, lse};  // ignored rows: 0 - 0
}

inline Tensor grad_or_zeros(const std::optional<Tensor>& g, int64_t n, const Tensor& like) {
  if (g.has_value() && g->defined()) return g->to(at::kDouble).contiguous();
  return at::zeros({n}, like.options().dtype(at::kDouble));
}

// Per-row scalars of the backward: c = g_lse - g_logprob, gh = g_entropy, glp = g_logprob; lse and H
// double. Ignored rows get no gradient at all (the kernels skip them).
struct RowGrads {
  Tensor lse, H, c, gh, glp;
};

inline RowGrads row_grads(const std::optional<Tensor>& grad_logprob, const std::optional<Tensor>& grad_entropy,
                          const std::optional<Tensor>& grad_lse, const Tensor& lse, const Tensor& entropy, int64_t n,
                          const Tensor& like, const char* op) {
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == n, op, ": `lse` must have shape [", n, "], got ", lse.sizes());
  TORCH_CHECK(entropy.dim() == 1 && entropy.size(0) == n, op, ": `entropy` must have shape [", n, "], got ",
              entropy.sizes());
  RowGrads r;
  r.glp = grad_or_zeros(grad_logprob, n, like);
  r.gh = grad_or_zeros(grad_entropy, n, like);
  r.c = grad_or_zeros(grad_lse, n, like) - r.glp;
  r.lse = lse.to(at::kDouble).contiguous();
  r.H = entropy.to(at::kDouble).contiguous();
  return r;
}

inline RowGrads narrow_rows(const RowGrads& g, int64_t n0, int64_t len) {
  return {g.lse.narrow(0, n0, len), g.H.narrow(0, n0, len), g.c.narrow(0, n0, len), g.gh.narrow(0, n0, len),
          g.glp.narrow(0, n0, len)};
}

// ------------------------------------------------------------------------------------------ from logits

inline Tensor checked_logits(const Tensor& logits, const char* op) {
  TORCH_CHECK(logits.dim() == 2, op, ": `logits` must be 2-D [N, V], got shape ", logits.sizes(),
              " (flatten leading dims first; verl.ops does it for you)");
  check_floating(logits, op, "logits");
  TORCH_CHECK(logits.size(1) > 0, op, ": `logits` has an empty vocabulary dimension (V=0)");
  return rows_view(logits);
}

template <class K>
Tensor3 shard_stats(const Tensor& logits_in, const Tensor& labels_in, double temperature, int64_t vocab_start,
                    int64_t vocab_size, int64_t ignore_index, const char* op) {
  check_temperature(temperature, op);
  const Tensor x = checked_logits(logits_in, op);
  const int64_t n = x.size(0), v = x.size(1);
  TORCH_CHECK(vocab_start >= 0 && vocab_start + v <= vocab_size, op, ": the shard [vocab_start=", vocab_start,
              ", vocab_start + V=", vocab_start + v, ") does not fit in the vocabulary of vocab_size=", vocab_size);
  const Tensor lab = checked_labels(labels_in, n, vocab_size, ignore_index, x, op, "logits");
  State st = new_state(n, x);
  if (n > 0) K::stats_update(x, lab, 0, vocab_start, ignore_index, 1.0 / temperature, st.m, st.S, st.T, st.target);
  return finish(st, lab, ignore_index, out_dtype(x.scalar_type()));
}

template <class K>
Tensor3 logprob_entropy(const Tensor& logits, const Tensor& labels, double temperature, int64_t ignore_index) {
  TORCH_CHECK(logits.dim() == 2, "logprob_entropy: `logits` must be 2-D [N, V], got shape ", logits.sizes());
  return as_logprob(shard_stats<K>(logits, labels, temperature, 0, logits.size(1), ignore_index, "logprob_entropy"));
}

template <class K>
Tensor3 logprob_entropy_shard(const Tensor& logits, const Tensor& labels, double temperature, int64_t vocab_start,
                              int64_t vocab_size, int64_t ignore_index) {
  return shard_stats<K>(logits, labels, temperature, vocab_start, vocab_size, ignore_index, "logprob_entropy_shard");
}

template <class K>
Tensor logprob_entropy_backward(const std::optional<Tensor>& grad_logprob, const std::optional<Tensor>& grad_entropy,
                                const std::optional<Tensor>& grad_lse, const Tensor& logits_in, const Tensor& labels_in,
                                const Tensor& lse, const Tensor& entropy, double temperature, int64_t vocab_start,
                                int64_t ignore_index) {
  const char* op = "logprob_entropy_backward";
  check_temperature(temperature, op);
  const Tensor x = checked_logits(logits_in, op);
  const int64_t n = x.size(0);
  const Tensor lab = checked_labels(labels_in, n, std::numeric_limits<int64_t>::max(), ignore_index, x, op, "logits");
  const RowGrads g = row_grads(grad_logprob, grad_entropy, grad_lse, lse, entropy, n, x, op);
  Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (n > 0) K::grad_chunk(x, out, lab, 0, vocab_start, ignore_index, 1.0 / temperature, g.lse, g.H, g.c, g.gh, g.glp);
  return out;
}

// ------------------------------------------------------------------------------ fused with the LM head

struct Linear {
  Tensor h, w;
  int64_t n, hdim, v;
};

inline Linear checked_linear(const Tensor& hidden, const Tensor& weight, const char* op) {
  TORCH_CHECK(hidden.dim() == 2, op, ": `hidden` must be 2-D [N, H], got shape ", hidden.sizes());
  TORCH_CHECK(weight.dim() == 2, op, ": `weight` must be 2-D [V, H], got shape ", weight.sizes());
  check_floating(hidden, op, "hidden");
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), op, ": `weight` has dtype ", weight.scalar_type(),
              " but `hidden` has ", hidden.scalar_type(), "; cast one of them so both match");
  check_same_device(hidden, weight, op, "hidden", "weight");
  TORCH_CHECK(weight.size(1) == hidden.size(1), op, ": `weight` [V, H] has H=", weight.size(1),
              " but `hidden` [N, H] has H=", hidden.size(1),
              "; pass the LM head weight as [vocab, hidden] (as nn.Linear stores it)");
  TORCH_CHECK(weight.size(0) > 0, op, ": `weight` has an empty vocabulary dimension (V=0)");
  return {hidden.contiguous(), weight.contiguous(), hidden.size(0), hidden.size(1), weight.size(0)};
}

// A flat scratch buffer of chunk_n * chunk_v elements, viewed as [rows, cols] for each chunk: the only
// O(chunk) allocation, reused by every chunk.
inline Tensor chunk_view(const Tensor& scratch, int64_t rows, int64_t cols) {
  return scratch.narrow(0, 0, rows * cols).view({rows, cols});
}

// Rows whose label is ignore_index give zeros and get no gradient, so the GEMMs skip them (padding and
// prompt tokens can be half the batch in RL): when some rows are ignored, the valid rows of hidden are
// gathered once ([N_valid, H], independent of V, no larger than grad_hidden) and results are scattered
// back. When every row is valid, nothing is copied (one nonzero; a host sync on CUDA).
struct Rows {
  Tensor index;   // positions of the computed rows in [0, N); undefined when every row is valid
  Tensor h, lab;  // the computed rows of hidden and their labels
};

inline Rows valid_rows(const Tensor& h, const Tensor& lab, int64_t ignore_index) {
  const Tensor idx = lab.ne(ignore_index).nonzero().view({-1});
  if (idx.size(0) == lab.size(0)) return {Tensor(), h, lab};
  return {idx, h.index_select(0, idx), lab.index_select(0, idx)};
}

inline RowGrads select_rows(const RowGrads& g, const Rows& r) {
  if (!r.index.defined()) return g;
  return {g.lse.index_select(0, r.index), g.H.index_select(0, r.index), g.c.index_select(0, r.index),
          g.gh.index_select(0, r.index), g.glp.index_select(0, r.index)};
}

// x [N_valid, ...] -> [N, ...] with zeros on the skipped rows.
inline Tensor scatter_rows(const Rows& r, const Tensor& x, int64_t n) {
  if (!r.index.defined()) return x;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[0] = n;
  return at::zeros(sizes, x.options()).index_copy_(0, r.index, x);
}

template <class K>
Tensor3 linear_shard_stats(const Tensor& hidden, const Tensor& weight, const Tensor& labels, double temperature,
                           int64_t vocab_start, int64_t vocab_size, int64_t ignore_index, int64_t chunk_n,
                           int64_t chunk_v, const char* op) {
  check_temperature(temperature, op);
  check_chunks(chunk_n, chunk_v, op);
  const Linear L = checked_linear(hidden, weight, op);
  TORCH_CHECK(vocab_start >= 0 && vocab_start + L.v <= vocab_size, op, ": the shard [vocab_start=", vocab_start,
              ", vocab_start + V=", vocab_start + L.v, ") does not fit in the vocabulary of vocab_size=", vocab_size);
  const Tensor lab = checked_labels(labels, L.n, vocab_size, ignore_index, L.h, op, "hidden");
  const Rows R = valid_rows(L.h, lab, ignore_index);
  const int64_t nr = R.h.size(0);
  State st = new_state(nr, L.h);
  const int64_t cn = std::min(chunk_n, std::max<int64_t>(nr, 1)), cv = std::min(chunk_v, L.v);
  const Tensor scratch = at::empty({cn * cv}, L.h.options());
  const double inv_t = 1.0 / temperature;
  for (int64_t n0 = 0; n0 < nr; n0 += cn) {
    const int64_t rn = std::min(cn, nr - n0);
    const Tensor hc = R.h.narrow(0, n0, rn);
    const Tensor lc = R.lab.narrow(0, n0, rn);
    Tensor m = st.m.narrow(0, n0, rn), S = st.S.narrow(0, n0, rn), T = st.T.narrow(0, n0, rn),
           tg = st.target.narrow(0, n0, rn);
    for (int64_t v0 = 0; v0 < L.v; v0 += cv) {
      const int64_t rv = std::min(cv, L.v - v0);
      Tensor z = chunk_view(scratch, rn, rv);
      at::mm_out(z, hc, L.w.narrow(0, v0, rv).t());
      K::stats_update(z, lc, v0, vocab_start, ignore_index, inv_t, m, S, T, tg);
    }
  }
  const auto [tgt, lse, ent] = finish(st, R.lab, ignore_index, out_dtype(L.h.scalar_type()));
  return {scatter_rows(R, tgt, L.n), scatter_rows(R, lse, L.n), scatter_rows(R, ent, L.n)};
}

template <class K>
Tensor3 linear_logprob_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& labels, double temperature,
                               int64_t ignore_index, int64_t chunk_n, int64_t chunk_v) {
  TORCH_CHECK(weight.dim() == 2, "linear_logprob_entropy: `weight` must be 2-D [V, H], got shape ", weight.sizes());
  return as_logprob(linear_shard_stats<K>(hidden, weight, labels, temperature, 0, weight.size(0), ignore_index, chunk_n,
                                          chunk_v, "linear_logprob_entropy"));
}

template <class K>
Tensor3 linear_logprob_entropy_shard(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                                     double temperature, int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                                     int64_t chunk_n, int64_t chunk_v) {
  return linear_shard_stats<K>(hidden, weight, labels, temperature, vocab_start, vocab_size, ignore_index, chunk_n,
                               chunk_v, "linear_logprob_entropy_shard");
}

// Recomputes each [chunk_n, chunk_v] block of logits, turns it into d loss / d logits in place and
// accumulates grad_hidden += G W_c and grad_weight_c += G^T h_c, both GEMMs reading the same G while it is
// still in cache. The vocab loop is outermost so each weight chunk's gradient is finished (and, for 16-bit
// inputs, rounded) once. The first product into each gradient block overwrites it (beta = 0), so no pass
// is spent zeroing. 16-bit inputs accumulate in float32 buffers: summing many bfloat16 partial products
// would lose the small ones.
template <class K>
std::tuple<Tensor, Tensor> linear_logprob_entropy_backward(
    const std::optional<Tensor>& grad_logprob, const std::optional<Tensor>& grad_entropy,
    const std::optional<Tensor>& grad_lse, const Tensor& hidden, const Tensor& weight, const Tensor& labels,
    const Tensor& lse, const Tensor& entropy, double temperature, int64_t vocab_start, int64_t ignore_index,
    int64_t chunk_n, int64_t chunk_v) {
  const char* op = "linear_logprob_entropy_backward";
  check_temperature(temperature, op);
  check_chunks(chunk_n, chunk_v, op);
  const Linear L = checked_linear(hidden, weight, op);
  const Tensor lab = checked_labels(labels, L.n, std::numeric_limits<int64_t>::max(), ignore_index, L.h, op, "hidden");
  const Rows R = valid_rows(L.h, lab, ignore_index);
  const int64_t nr = R.h.size(0);
  const RowGrads g = select_rows(row_grads(grad_logprob, grad_entropy, grad_lse, lse, entropy, L.n, L.h, op), R);
  if (nr == 0) return {at::zeros({L.n, L.hdim}, L.h.options()), at::zeros({L.v, L.hdim}, L.w.options())};
  const bool wide = L.h.scalar_type() == at::kFloat || L.h.scalar_type() == at::kDouble;
  const auto acc_opts = L.h.options().dtype(wide ? L.h.scalar_type() : at::kFloat);
  Tensor grad_h = at::empty({nr, L.hdim}, acc_opts);  // the computed rows
  Tensor grad_w = at::empty({L.v, L.hdim}, L.w.options());
  const int64_t cn = std::min(chunk_n, nr), cv = std::min(chunk_v, L.v);
  const Tensor scratch = at::empty({cn * cv}, L.h.options());
  const double inv_t = 1.0 / temperature;
  for (int64_t v0 = 0; v0 < L.v; v0 += cv) {
    const int64_t rv = std::min(cv, L.v - v0);
    const Tensor wc = L.w.narrow(0, v0, rv);
    Tensor gw = wide ? grad_w.narrow(0, v0, rv) : at::empty({rv, L.hdim}, acc_opts);
    for (int64_t n0 = 0; n0 < nr; n0 += cn) {
      const int64_t rn = std::min(cn, nr - n0);
      const Tensor hc = R.h.narrow(0, n0, rn);
      Tensor z = chunk_view(scratch, rn, rv);
      at::mm_out(z, hc, wc.t());
      const RowGrads gc = narrow_rows(g, n0, rn);
      K::grad_chunk(z, z, R.lab.narrow(0, n0, rn), v0, vocab_start, ignore_index, inv_t, gc.lse, gc.H, gc.c, gc.gh,
                    gc.glp);
      Tensor gh_rows = grad_h.narrow(0, n0, rn);
      if (wide) {
        if (v0 == 0) at::mm_out(gh_rows, z, wc);
        else gh_rows.addmm_(z, wc);
        if (n0 == 0) at::mm_out(gw, z.t(), hc);
        else gw.addmm_(z.t(), hc);
      } else {
        if (v0 == 0) gh_rows.copy_(at::mm(z, wc));
        else gh_rows.add_(at::mm(z, wc));
        if (n0 == 0) gw.copy_(at::mm(z.t(), hc));
        else gw.add_(at::mm(z.t(), hc));
      }
    }
    if (!wide) grad_w.narrow(0, v0, rv).copy_(gw);
  }
  return {scatter_rows(R, wide ? grad_h : grad_h.to(L.h.scalar_type()), L.n), grad_w};
}

}  // namespace logprob
}  // namespace verl
