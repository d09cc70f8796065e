// The fused RL loss head (schema in csrc/ops.cpp, Python in verl/ops/rl_head.py): from hidden states [N, H] and
// the LM head weight [V, H] straight to the actor's scalar loss
//
//   loss = pg_loss(logprob) - entropy_coeff * agg(entropy) + kl_coef * kl_loss(logprob, ref_logprob)
//
// with logprob / entropy of softmax(hidden W^T / temperature), every term aggregated over the mask as the
// rl_loss ops do (loss = sum_b w_b sum_t m_bt l_bt, row weights w_b from the mask alone; verl/rl_loss.h).
//
// Why the gradient can be made in the forward pass. Each token's loss depends on the logits of its row only
// through (logprob, entropy), and every other input (old log-prob, advantage, reference log-prob, mask, w_b) is
// known before the op runs. So once a row's log-sum-exp is known, d loss / d logprob (glp) and d loss / d entropy
// (gh) are per-token numbers, and d loss / d logits follows elementwise (formula in verl/logprob.h, with
// g_lse = 0). The driver therefore walks the valid tokens in chunks of rows, each chunk over the WHOLE vocabulary:
//
//   Z = h_c W^T                               GEMM 1   [rows, V] in one scratch buffer
//   K::stats_update(Z)                        one streaming pass: max / sum-exp / entropy / target logit
//   per-token loss, statistics, glp, gh       O(rows) ATen math in double, below
//   K::grad_chunk(Z -> G in place)            one streaming pass: d loss / d logits
//   grad_h_c = G W                            GEMM 2
//   grad_W  += G^T h_c                        GEMM 3 (skipped for a frozen head: grad_weight=false)
//
// Forward + backward is 3 GEMMs over the vocabulary (the unfused chunked path recomputes Z: 4), the [N, V] logits
// are never whole (one [rows, V] buffer, reused), and the backward op only multiplies the two saved gradients by
// grad_output (loss_grad_scale). Chunks are `chunk_n` valid tokens; GSPO's sequence ratio needs a whole sequence,
// so for it chunks end on sequence boundaries (a sequence longer than chunk_n is one chunk of its own).
//
// Tokens with mask 0 are left out of everything (compacted once, like the ignore_index rows of the log-prob ops):
// logprob / entropy 0, no GEMM time, no gradient; their labels are never read.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "verl/checks.h"
#include "verl/logprob.h"
#include "verl/rl_loss.h"

namespace verl {
namespace rl_head {

using at::Tensor;

// Statistics output, float32 [kStats]: the additive loss parts first, then token means over the valid tokens.
enum Stat : int64_t {
  kPgLoss = 0, kKlLoss, kEntropyLoss, kClipfrac, kClipfracLower, kPpoKl, kEntropy, kKl, kStats
};

// Logits rows per chunk when chunk_n = 0 are the backend's choice, K::rl_head_chunk_rows(V) (memory against GEMM
// efficiency: every chunk reads and writes all of grad_W, 8 V H bytes in float32, against 6 rows V H flops).

struct Params {
  rl::PgParams pg;
  rl::Kl kl = rl::Kl::K3;
  double kl_coef = 0.0, entropy_coeff = 0.0, inv_t = 1.0;
  bool has_old = false, has_ref = false;
};

// The per-token inputs of the valid tokens (compacted, row-major), float64, and what each chunk accumulates.
struct Tokens {
  Tensor adv, old, ref, w;  // [Nv]; old / ref undefined when not given
  Tensor row;               // [Nv] int64: the sequence b of each valid token
  Tensor count;             // [B] float64 valid tokens per sequence
};

struct ChunkOut {
  Tensor glp, gh;  // [rows] float64: d loss / d logprob, d loss / d entropy
  Tensor sums;     // [kStats] float64: this chunk's weighted loss parts and unnormalised statistic sums
};

// One token of the policy loss as ATen math on [rows] float64 tensors: pg_token_t (verl/rl_loss.h) written
// with whole-tensor ops, the same clamps and branches. Returns (loss, d loss / d log_ratio, clipped, lower).
inline std::tuple<Tensor, Tensor, Tensor, Tensor> pg_terms(const Tensor& log_ratio, const Tensor& adv,
                                                           const rl::PgParams& p) {
  const Tensor lr = log_ratio.clamp(-20.0, 20.0);
  const Tensor ratio = lr.exp();
  const Tensor live = lr.eq(log_ratio).to(at::kDouble);
  if (p.type == rl::Pg::Reinforce) {
    const Tensor l = -adv * ratio;
    return {l, l * live, at::zeros_like(l), at::zeros_like(l)};
  }
  const double lo = 1.0 - p.clip_low, hi = 1.0 + p.clip_high;
  const double c = p.type == rl::Pg::Gspo ? 1e30 : std::min(p.clip_c, 1e30);
  const Tensor neg = adv.lt(0.0).to(at::kDouble), pos = adv.gt(0.0).to(at::kDouble);
  const Tensor lo_eff = neg * lo, hi_eff = hi + neg * (c - hi);
  const Tensor q = at::minimum(at::maximum(ratio, lo_eff), hi_eff);
  const Tensor inside = ratio.ge(lo_eff).logical_and(ratio.le(hi_eff)).to(at::kDouble);
  const Tensor clipped = pos * ratio.gt(hi).to(at::kDouble) + neg * ratio.lt(lo).to(at::kDouble);
  const Tensor lower = p.type == rl::Pg::Gspo ? at::zeros_like(ratio) : neg * ratio.clamp_min(lo).gt(c).to(at::kDouble);
  return {-adv * q, -adv * ratio * inside * live, clipped, lower};
}

// kl_token_t (verl/rl_loss.h) on tensors: (value, d value / d logprob).
inline std::pair<Tensor, Tensor> kl_terms(const Tensor& lp, const Tensor& ref, rl::Kl kind) {
  const Tensor d = lp - ref;
  switch (kind) {
    case rl::Kl::K1: return {d, at::ones_like(d)};
    case rl::Kl::Abs: return {d.abs(), d.sign()};
    case rl::Kl::K2: return {0.5 * d * d, d};
    case rl::Kl::K1Plus: return {d, d};
    default: break;
  }
  const Tensor dr = ref - lp;
  const Tensor dc = dr.clamp(-20.0, 20.0);
  const Tensor e = dc.exp();
  const Tensor raw = e - dc - 1.0;
  const Tensor val = raw.clamp(-10.0, 10.0);
  if (kind == rl::Kl::K3Plus) return {val, d};
  const Tensor live = dc.eq(dr).logical_and(raw.le(10.0)).to(at::kDouble);
  return {val, live * (1.0 - e)};
}

// GSPO's sequence log-ratio mean_t(logp - old) of each token's sequence; the chunk holds whole sequences.
inline Tensor seq_log_ratio(const Tensor& d, const Tensor& row, const Tensor& count) {
  const int64_t b0 = row[0].item<int64_t>();
  const Tensor local = row - b0;
  const int64_t nrows = row[-1].item<int64_t>() - b0 + 1;
  const Tensor sums = at::zeros({nrows}, d.options()).index_add_(0, local, d);
  return (sums / count.narrow(0, b0, nrows).clamp_min(1.0)).index_select(0, local);
}

// The loss terms of one chunk of tokens from their (logprob, entropy), double [rows].
inline ChunkOut chunk_terms(const Tensor& lp, const Tensor& ent, const Tokens& tok, int64_t t0, int64_t rows,
                            const Params& p) {
  const Tensor adv = tok.adv.narrow(0, t0, rows), w = tok.w.narrow(0, t0, rows);
  const Tensor old = p.has_old ? tok.old.narrow(0, t0, rows) : lp;  // on-policy: ratio 1, gradient -A
  const Tensor d = lp - old;
  const Tensor log_ratio = p.pg.type == rl::Pg::Gspo ? seq_log_ratio(d, tok.row.narrow(0, t0, rows), tok.count) : d;
  const auto [pg, pg_grad, clipped, lower] = pg_terms(log_ratio, adv, p.pg);
  Tensor glp = w * pg_grad;
  const Tensor zero = at::zeros({}, lp.options());
  Tensor kl_loss = zero, kl_tok = zero;
  if (p.has_ref) {
    const Tensor ref = tok.ref.narrow(0, t0, rows);
    kl_tok = (lp - ref).sum();
    if (p.kl_coef != 0.0) {
      const auto [kv, kg] = kl_terms(lp, ref, p.kl);
      kl_loss = (w * kv).sum();
      glp = glp + (p.kl_coef * w) * kg;
    }
  }
  ChunkOut out;
  out.glp = glp;
  out.gh = w * (-p.entropy_coeff);
  out.sums = at::stack({(w * pg).sum(), kl_loss, (w * ent).sum(), clipped.sum(), lower.sum(),
                        -d.clamp(-20.0, 20.0).sum(), ent.sum(), kl_tok});
  return out;
}

// Chunk boundaries over the Nv valid tokens: every chunk_n, or (GSPO) at sequence ends with at most chunk_n tokens
// unless one sequence alone is longer.
inline std::vector<int64_t> chunk_bounds(int64_t nv, int64_t chunk_n, bool whole_rows, const Tensor& count) {
  std::vector<int64_t> cuts{0};
  if (nv == 0) return cuts;  // no chunk at all
  if (!whole_rows) {
    for (int64_t a = chunk_n; a < nv; a += chunk_n) cuts.push_back(a);
  } else {
    const Tensor ends = count.to(at::kCPU).to(at::kLong).cumsum(0);
    const int64_t* e = ends.const_data_ptr<int64_t>();
    int64_t last = 0;
    for (int64_t b = 0; b < ends.size(0); ++b) {
      if (e[b] == last) continue;  // a fully masked sequence
      if (e[b] - cuts.back() > chunk_n && last > cuts.back()) cuts.push_back(last);
      last = e[b];
    }
  }
  cuts.push_back(nv);
  return cuts;
}

struct Inputs {
  logprob::Linear L;
  Tensor lab, m;  // labels [N] int64, mask [N] bool
  int64_t B = 0, T = 0;
};

inline Tensor checked_bt_input(const std::optional<Tensor>& t, const Tensor& mask, const char* op, const char* name) {
  if (!t.has_value() || !t->defined()) return Tensor();
  check_floating(*t, op, name);
  check_same_device(mask, *t, op, "mask", name);
  check_same_shape(mask, *t, op, "mask", name);
  return t->to(at::kDouble).reshape({-1});
}

inline Inputs checked_inputs(const Tensor& hidden, const Tensor& weight, const Tensor& labels, const Tensor& mask,
                             const char* op) {
  Inputs in;
  in.L = logprob::checked_linear(hidden, weight, op);
  TORCH_CHECK(mask.dim() == 2, op, ": `mask` must be 2-D [B, T] (sequences x response tokens), got shape ",
              mask.sizes());
  check_same_device(hidden, mask, op, "hidden", "mask");
  TORCH_CHECK(!at::isComplexType(mask.scalar_type()), op, ": `mask` must be bool or a real dtype (nonzero = valid), "
              "got ", mask.scalar_type());
  in.B = mask.size(0), in.T = mask.size(1);
  TORCH_CHECK(in.L.n == in.B * in.T, op, ": `hidden` has N=", in.L.n, " rows but `mask` is [B, T] = ", mask.sizes(),
              "; pass hidden as [B * T, H] (one row per response token, row-major)");
  TORCH_CHECK(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt, op,
              ": `labels` must be int64 or int32, got ", labels.scalar_type());
  check_same_device(hidden, labels, op, "hidden", "labels");
  check_same_shape(mask, labels, op, "mask", "labels");
  in.m = mask_as_bool(mask).reshape({-1});
  in.lab = labels.to(at::kLong).reshape({-1});
  if (in.L.n > 0) {
    const Tensor bad = in.m.logical_and(in.lab.lt(0).logical_or_(in.lab.ge(in.L.v)));
    if (bad.any().item<bool>()) {
      const int64_t i = bad.nonzero().select(1, 0)[0].item<int64_t>();
      TORCH_CHECK(false, op, ": `labels`[", i / in.T, ", ", i % in.T, "] = ", in.lab[i].item<int64_t>(),
                  " is a valid (mask != 0) token outside the vocabulary [0, ", in.L.v, ")");
    }
  }
  return in;
}

// Per-sequence weights w_b of the aggregation (verl/rl_loss.h row_weight), from the mask's counts.
inline Tensor row_weights(const Tensor& count, rl::AggParams agg) {
  const Tensor c = count.to(at::kCPU).contiguous();
  const double* pc = c.const_data_ptr<double>();
  double tokens = 0.0, seqs = 0.0;
  for (int64_t b = 0; b < c.size(0); ++b) tokens += pc[b], seqs += pc[b] > 0.0 ? 1.0 : 0.0;
  rl::fill_local_counts(agg, tokens, seqs);
  Tensor w = at::empty({c.size(0)}, c.options());
  double* pw = w.data_ptr<double>();
  for (int64_t b = 0; b < c.size(0); ++b) pw[b] = rl::row_weight(agg, pc[b]);
  return w.to(count.device());
}

// Never equal to a label: the log-prob kernels' ignore_index, for chunks that hold valid tokens only.
constexpr int64_t kNoIgnore = std::numeric_limits<int64_t>::min();

// Gradient buffers of the valid tokens. 16-bit weights accumulate grad_W in float32 (summing a bfloat16 product
// per chunk would lose the small ones), through a [chunk_v, H] product buffer.
struct GradAcc {
  Tensor h;    // [N, H], hidden's dtype (each row is one GEMM over the whole vocabulary: no accumulation); zeros
               // on masked tokens
  Tensor w;    // [V, H], weight's dtype for float32 / float64, else float32
  Tensor tmp;  // 16-bit only: [min(V, 4096), H] product buffer
  bool wide = true;
};

// grad_weight false (a frozen head: LoRA, a frozen embedding tied to it): g.w stays an empty [0] tensor and
// GEMM 3 never runs.
inline GradAcc new_grads(const logprob::Linear& L, int64_t nv, bool grad_weight) {
  GradAcc g;
  g.wide = L.w.scalar_type() == at::kFloat || L.w.scalar_type() == at::kDouble;
  g.h = nv == L.n ? at::empty({L.n, L.hdim}, L.h.options()) : at::zeros({L.n, L.hdim}, L.h.options());
  if (!grad_weight) {
    g.w = at::empty({0}, L.w.options());
    return g;
  }
  g.w = nv == 0 ? at::zeros({L.v, L.hdim}, L.w.options().dtype(g.wide ? L.w.scalar_type() : at::kFloat))
                : at::empty({L.v, L.hdim}, L.w.options().dtype(g.wide ? L.w.scalar_type() : at::kFloat));
  if (!g.wide) g.tmp = at::empty({std::min<int64_t>(L.v, 4096), L.hdim}, L.w.options());
  return g;
}

// GEMMs 3 and 2 of one chunk, G = d loss / d logits [rows, V]: grad_W (+)= G^T h_c, grad_h rows = G W. The
// first chunk overwrites grad_W (beta = 0), so no pass is spent zeroing it. With masked tokens h_c is the
// chunk's gathered rows (hc_owned): GEMM 3 is its last reader, so GEMM 2 writes into it before the scatter.
inline void chunk_gemms(const Tensor& G, Tensor& hc, bool hc_owned, const Tensor& w, GradAcc& g, const Tensor& idx,
                        int64_t t0, bool first) {
  const int64_t rows = hc.size(0);
  if (g.w.numel() == 0) {
    // no grad_weight (new_grads): GEMM 2 alone
  } else if (g.wide) {
    if (first) at::mm_out(g.w, G.t(), hc);
    else g.w.addmm_(G.t(), hc);
  } else {
    const int64_t v = w.size(0), cv = g.tmp.size(0);
    for (int64_t v0 = 0; v0 < v; v0 += cv) {
      const int64_t rv = std::min(cv, v - v0);
      Tensor prod = g.tmp.narrow(0, 0, rv);
      at::mm_out(prod, G.narrow(1, v0, rv).t(), hc);
      if (first) g.w.narrow(0, v0, rv).copy_(prod);
      else g.w.narrow(0, v0, rv).add_(prod);
    }
  }
  if (!hc_owned) {
    Tensor gh_rows = g.h.narrow(0, t0, rows);
    at::mm_out(gh_rows, G, w);
  } else {  // straight to the tokens' rows: no [Nv, H] buffer to scatter at the end
    at::mm_out(hc, G, w);
    g.h.index_copy_(0, idx.narrow(0, t0, rows), hc);
  }
}

// x [Nv, ...] of the valid tokens -> [N, ...] with zeros on the masked ones.
inline Tensor scatter_tokens(const Tensor& x, const Tensor& idx, int64_t n, bool all_valid) {
  if (all_valid) return x;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes[0] = n;
  return at::zeros(sizes, x.options()).index_copy_(0, idx, x);
}

using Out6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

struct Setup {
  Inputs in;
  Params p;
  Tokens tok;
  Tensor idx, lab;  // valid token positions in [0, N) and their labels
  bool all_valid = true;
};

inline Setup setup(const Tensor& hidden, const Tensor& weight, const Tensor& labels, const Tensor& mask,
                   const Tensor& advantages, const std::optional<Tensor>& old_logprob,
                   const std::optional<Tensor>& ref_logprob, double temperature, c10::string_view loss_type,
                   double clip_low, double clip_high, double clip_c, c10::string_view kl_kind, double kl_coef,
                   double entropy_coeff, const rl::AggParams& agg_in, const char* op) {
  Setup s;
  logprob::check_temperature(temperature, op);
  TORCH_CHECK(std::isfinite(kl_coef), op, ": `kl_coef` must be finite, got ", kl_coef);
  TORCH_CHECK(std::isfinite(entropy_coeff), op, ": `entropy_coeff` must be finite, got ", entropy_coeff);
  s.p.pg = rl::make_pg(loss_type, clip_low, clip_high, clip_c, op);
  s.p.kl = rl::parse_kl(kl_kind, op);
  s.p.kl_coef = kl_coef, s.p.entropy_coeff = entropy_coeff, s.p.inv_t = 1.0 / temperature;
  s.in = checked_inputs(hidden, weight, labels, mask, op);
  const Tensor adv = checked_bt_input(advantages, mask, op, "advantages");
  const Tensor old = checked_bt_input(old_logprob, mask, op, "old_logprob");
  const Tensor ref = checked_bt_input(ref_logprob, mask, op, "ref_logprob");
  s.p.has_old = old.defined(), s.p.has_ref = ref.defined();
  s.tok.count = s.in.m.view({s.in.B, s.in.T}).sum(1).to(at::kDouble);
  const Tensor w_b = row_weights(s.tok.count, agg_in);
  s.idx = s.in.m.nonzero().view({-1});
  s.all_valid = s.idx.size(0) == s.in.L.n;
  auto pick = [&](const Tensor& t) { return !t.defined() ? t : (s.all_valid ? t : t.index_select(0, s.idx)); };
  s.tok.row = at::div(s.idx, std::max<int64_t>(s.in.T, 1), "floor");
  s.tok.adv = pick(adv), s.tok.old = pick(old), s.tok.ref = pick(ref);
  s.tok.w = w_b.index_select(0, s.tok.row);
  s.lab = pick(s.in.lab);  // hidden rows are gathered chunk by chunk: no [Nv, H] copy
  return s;
}

// The whole op on one device: see the header comment. Returns (loss, stats, logprob, entropy, grad_hidden,
// grad_weight); the gradients are empty [0] tensors without `with_grad`.
template <class K>
Out6 linear_rl_loss(const Tensor& hidden, const Tensor& weight, const Tensor& labels, const Tensor& mask,
                    const Tensor& advantages, const std::optional<Tensor>& old_logprob,
                    const std::optional<Tensor>& ref_logprob, double temperature, c10::string_view loss_type,
                    double clip_low, double clip_high, double clip_c, c10::string_view kl_kind, double kl_coef,
                    double entropy_coeff, c10::string_view mode, std::optional<double> global_tokens,
                    std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len,
                    int64_t chunk_n, bool with_grad, bool grad_weight) {
  const char* op = "linear_rl_loss";
  TORCH_CHECK(chunk_n >= 0, op, ": `chunk_n` must be >= 0 (0 = the backend's default chunk), got ", chunk_n);
  TORCH_CHECK(mask.dim() == 2, op, ": `mask` must be 2-D [B, T] (sequences x response tokens), got shape ",
              mask.sizes());
  const rl::AggParams agg = rl::make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, mask.size(1), op);
  at::DeviceGuard guard(hidden.device());
  const Setup s = setup(hidden, weight, labels, mask, advantages, old_logprob, ref_logprob, temperature, loss_type,
                        clip_low, clip_high, clip_c, kl_kind, kl_coef, entropy_coeff, agg, op);
  const logprob::Linear& L = s.in.L;
  const int64_t nv = s.idx.size(0);
  const std::vector<int64_t> cuts = chunk_bounds(nv, chunk_n > 0 ? chunk_n : K::rl_head_chunk_rows(L.v),
                                                 s.p.pg.type == rl::Pg::Gspo, s.tok.count);
  int64_t max_rows = 0;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) max_rows = std::max(max_rows, cuts[i + 1] - cuts[i]);
  const auto dopt = L.h.options().dtype(at::kDouble);
  Tensor sums = at::zeros({kStats}, dopt), lp_v = at::empty({nv}, dopt), ent_v = at::empty({nv}, dopt);
  GradAcc g = with_grad ? new_grads(L, nv, grad_weight) : GradAcc{};
  const Tensor scratch = at::empty({max_rows * L.v}, L.h.options());
  const Tensor hbuf = s.all_valid ? Tensor() : at::empty({max_rows, L.hdim}, L.h.options());
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const int64_t t0 = cuts[i], rows = cuts[i + 1] - cuts[i];
    const Tensor lc = s.lab.narrow(0, t0, rows);
    Tensor hc = s.all_valid ? L.h.narrow(0, t0, rows) : hbuf.narrow(0, 0, rows);
    if (!s.all_valid) at::index_select_out(hc, L.h, 0, s.idx.narrow(0, t0, rows));
    Tensor z = logprob::chunk_view(scratch, rows, L.v);
    at::mm_out(z, hc, L.w.t());
    logprob::State st = logprob::new_state(rows, L.h);
    K::stats_update(z, lc, 0, 0, kNoIgnore, s.p.inv_t, st.m, st.S, st.T, st.target);
    const Tensor logS = st.S.log();
    const Tensor lse = st.m + logS, ent = logS - st.T / st.S;
    const Tensor lp = st.target - lse;
    lp_v.narrow(0, t0, rows).copy_(lp);
    ent_v.narrow(0, t0, rows).copy_(ent);
    const ChunkOut co = chunk_terms(lp, ent, s.tok, t0, rows, s.p);
    sums.add_(co.sums);
    if (!with_grad) continue;
    K::grad_chunk(z, z, lc, 0, 0, kNoIgnore, s.p.inv_t, lse, ent, (-co.glp).contiguous(), co.gh.contiguous(),
                  co.glp.contiguous());
    chunk_gemms(z, hc, !s.all_valid, L.w, g, s.idx, t0, i == 0);
  }
  const at::ScalarType dt = logprob::out_dtype(L.h.scalar_type());
  Tensor stats = sums.clone();
  stats.narrow(0, kClipfrac, kStats - kClipfrac).div_(static_cast<double>(std::max<int64_t>(nv, 1)));
  const Tensor loss = (sums[kPgLoss] - entropy_coeff * sums[kEntropyLoss] + kl_coef * sums[kKlLoss]).to(dt);
  const int64_t n = L.n;
  Tensor lp_out = scatter_tokens(lp_v.to(dt), s.idx, n, s.all_valid).view({s.in.B, s.in.T});
  Tensor ent_out = scatter_tokens(ent_v.to(dt), s.idx, n, s.all_valid).view({s.in.B, s.in.T});
  if (!with_grad) {
    return {loss, stats.to(at::kFloat), lp_out, ent_out, at::empty({0}, L.h.options()), at::empty({0}, L.w.options())};
  }
  // g.w: an empty [0] tensor of the weight's dtype without grad_weight
  return {loss, stats.to(at::kFloat), lp_out, ent_out, g.h, g.wide ? g.w : g.w.to(L.w.scalar_type())};
}

}  // namespace rl_head
}  // namespace verl
