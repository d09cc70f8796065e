"""Float64 transcriptions of the published formulas every registered algorithm claims to compute, written here from
the papers and from upstream volcengine/verl's `verl/trainer/ppo/core_algos.py` (and `rollout_corr_helper.py`),
cited per function. Nothing here imports verl: these are the oracles tests/algos/test_formulas*.py compare the
implementation against.

Conventions: tensors are float64 [B, T] (`mask` 1 on valid response tokens, 0 on padding; padding values of the
inputs may be anything); a policy loss returns the per-token loss [B, T] (before aggregation) and its statistics;
`aggregate` turns it into the scalar. Where our implementation deliberately differs from upstream verl, the
function says so (and the tests assert our side of the difference).
"""

from __future__ import annotations

import math

import torch

UPSTREAM = "volcengine/verl verl/trainer/ppo/core_algos.py"


def where(mask, x, fill=0.0):
    return torch.where(mask.bool(), x, torch.as_tensor(fill, dtype=torch.float64))


def masked_mean(x, mask):
    m = mask.bool()
    return x[m].mean() if m.any() else torch.zeros((), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- aggregation

def aggregate(per, mask, mode, norm_len=None):
    """upstream agg_loss: token-mean = sum / #tokens; seq-mean-token-sum = mean over sequences with a token of
    their token sums; seq-mean-token-mean = mean over those sequences of their token means.
    seq-mean-token-sum-norm is Dr.GRPO's (Liu et al., arXiv:2503.20783, eq. 2): (1/G) sum_i sum_t l / L with L a
    constant (the response length). Deliberate difference: upstream divides by L only, not by the G sequences, so
    its loss scales with the batch. token-sum (the plain sum) is ours alone."""
    m = mask.bool()
    x = where(m, per)
    rows = m.any(-1)
    if mode == "token-mean":
        return x.sum() / m.sum()
    if mode == "token-sum":
        return x.sum()
    if mode == "seq-mean-token-sum":
        return x.sum(-1)[rows].mean()
    if mode == "seq-mean-token-mean":
        return (x.sum(-1)[rows] / m.sum(-1)[rows]).mean()
    if mode == "seq-mean-token-sum-norm":
        return x.sum(-1)[rows].sum() / (rows.sum() * (norm_len or per.shape[-1]))
    raise ValueError(mode)


# ---------------------------------------------------------------------------------------------- policy losses

def log_ratio(lp, old):
    """log pi/pi_old, clamped to +-20 before any exp (upstream compute_policy_loss_vanilla and most losses)."""
    return torch.clamp(lp - old, -20.0, 20.0)


def ppo(lp, old, adv, mask, clip_low, clip_high, clip_c):
    """PPO clip (Schulman et al., arXiv:1707.06347, eq. 7) with asymmetric bounds (DAPO's clip-higher,
    arXiv:2503.14476) and dual clip (Ye et al., arXiv:1912.09729): l = max(-A r, -A clip(r, 1-eps_l, 1+eps_h)),
    then for A < 0: min(l, -A c). As upstream compute_policy_loss_vanilla, statistics included."""
    r = torch.exp(log_ratio(lp, old))
    l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(l1, l2)
    l3 = -adv * clip_c
    per = torch.where(adv < 0, torch.minimum(clipped, l3), clipped)
    stats = {"pg_clipfrac": masked_mean((l2 > l1).double(), mask),
             "pg_clipfrac_lower": masked_mean(((clipped > l3) & (adv < 0)).double(), mask),
             "ppo_kl": masked_mean(-log_ratio(lp, old).detach(), mask)}
    return per, stats


def gspo(lp, old, adv, mask, clip_low, clip_high):
    """GSPO (Zheng et al., arXiv:2507.18071, eq. 5-7): the sequence ratio s_i = exp(mean_t log(pi/pi_old)) over the
    response, used per token as sg(s_i) * pi / sg(pi) (its value s_i, the token's gradient), in the PPO clip
    without dual clip; upstream compute_policy_loss_gspo. Upstream clamps log s_i at 10 (ours: the shared +-20)
    and reports ppo_kl of the unclamped log-ratios (ours: clamped, as every loss), and forces seq-mean-token-mean
    whatever loss_agg_mode says (ours aggregates by the configured mode)."""
    m = mask.bool()
    seq = where(m, lp - old).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = lp - lp.detach() + seq.detach().unsqueeze(-1)
    s = torch.exp(log_s)
    l1, l2 = -adv * s, -adv * torch.clamp(s, 1 - clip_low, 1 + clip_high)
    return torch.maximum(l1, l2), {"pg_clipfrac": masked_mean((l2 > l1).double(), mask),
                                   "ppo_kl": masked_mean(-log_ratio(lp, old).detach(), mask)}


def reinforce(lp, old, adv, mask):
    """REINFORCE (Williams 1992) as the importance-sampled surrogate -A * pi/pi_old: its gradient at pi = pi_old is
    the REINFORCE gradient -A grad log pi. Upstream's compute_policy_loss_reinforce (bypass mode) writes -A log pi
    instead: the same gradient on-policy, another value; ours keeps the ratio so that later epochs are
    importance-weighted (a deliberate difference, tested through the gradient)."""
    return -adv * torch.exp(log_ratio(lp, old)), {}


def cispo(lp, old, adv, mask, eps_low, eps_high):
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4-5): l = -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi: every token
    keeps its gradient, the IS weight is what is clipped. As upstream compute_policy_loss_cispo (the bounds are the
    actor's clip_ratio_low / high, as upstream reads them)."""
    r = torch.exp(log_ratio(lp, old)).detach()
    return -torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv * lp, {}


def sapo(lp, old, adv, mask, tau_pos, tau_neg):
    """SAPO (Gao et al., arXiv:2511.20347, eq. 6-8): l = -A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos
    where A > 0 else tau_neg; upstream compute_policy_loss_sapo, aggregated per sequence (seq-mean-token-mean)
    whatever the configured mode, as upstream (the registration declares it: PolicyLossInfo.agg)."""
    r = torch.exp(log_ratio(lp, old))
    tau = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=torch.float64),
                      torch.as_tensor(tau_neg, dtype=torch.float64))
    return -adv * torch.sigmoid(tau * (r - 1)) * 4 / tau, {}


def gpg_loss(lp, old, adv, mask):
    """GPG (Chu et al., arXiv:2504.02546, eq. 3): the plain policy gradient l = -A log pi; upstream
    compute_policy_loss_gpg."""
    return -adv * lp, {}


def dppo(lp, old, adv, mask, divergence, low, high, cap):
    """DPPO (Qi et al., "Rethinking the Trust Region in LLM RL", arXiv:2602.04879, Binary-TV and Binary-KL):
    l = -A sg(min(r, C)) log pi * M, the mask M dropping a token whose probability moved past the divergence bound
    in its advantage's direction. TV: A > 0 keeps p - p_old <= high, A <= 0 keeps p - p_old >= -low. KL (binary KL
    of the sampled token, with upstream's 1e-8): A > 0 keeps KL <= high or p <= p_old; A <= 0 keeps KL <= low or
    p >= p_old. As upstream (verl-project) compute_policy_loss_dppo_tv / _kl: the bounds are the actor's
    clip_ratio_low / high and C its clip_ratio_c."""
    p, p_old = lp.detach().exp(), old.exp()
    if divergence == "tv":
        keep = torch.where(adv > 0, p - p_old <= high, p - p_old >= -low)
    else:
        kl = p_old * (old - lp.detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        keep = torch.where(adv > 0, (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old))
    r = torch.exp(log_ratio(lp, old)).detach()
    per = -adv * torch.clamp(r, max=cap) * lp * keep.double()
    return per, {"pg_clipfrac": masked_mean((~keep).double(), mask),
                 "pg_clipfrac_lower": masked_mean(((r > cap) & keep).double(), mask)}


def _covariance(lp, adv, mask):
    """(A - mean A)(log pi - mean log pi), means over the batch's valid tokens (Cui et al., arXiv:2505.22617,
    eq. 11; upstream cov_all)."""
    m = mask.bool()
    return (adv - adv[m].mean()) * (lp.detach() - lp.detach()[m].mean())


def clip_cov(lp, old, adv, mask, clip_low, clip_high, ratio, lb, ub):
    """Clip-Cov (Cui et al., arXiv:2505.22617, sec. 4): the PPO clip (no dual clip), with the gradient of
    max(1, int(ratio * #valid)) tokens cut, drawn among the valid, not already clipped tokens whose covariance
    lies in (lb, ub); upstream compute_policy_loss_clip_cov. The draw is random; the tests choose `ratio` so that
    every candidate is cut (then the draw does not matter). Upstream leaves the log-ratio unclamped (ours: +-20)."""
    r = torch.exp(log_ratio(lp, old))
    l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - clip_low, 1 + clip_high)
    m = mask.bool()
    cov = _covariance(lp, adv, mask)
    cand = m & ~(l2 > l1) & (cov > lb) & (cov < ub)
    n_cut = max(int(ratio * int(m.sum())), 1)
    assert n_cut >= int(cand.sum()), "the oracle needs every candidate cut (a deterministic draw)"
    per = torch.maximum(l1, l2) * (~cand).double()
    return per, {"pg_clipfrac": masked_mean(cand.double(), mask)}


def kl_cov(lp, old, adv, mask, ratio, coef):
    """KL-Cov (Cui et al., arXiv:2505.22617, sec. 4): -A r on every token, plus coef |log pi - log pi_old| on the
    max(1, int(ratio * #valid)) valid tokens of largest covariance; upstream compute_policy_loss_kl_cov (its ppo_kl
    statistic: the mean |log-ratio|). Upstream leaves the log-ratio unclamped (ours: +-20)."""
    m = mask.bool()
    lr = log_ratio(lp, old)
    per = -adv * torch.exp(lr)
    k = max(1, int(int(m.sum()) * ratio))
    cov = torch.where(m, _covariance(lp, adv, mask), torch.tensor(-math.inf, dtype=torch.float64))
    top = torch.zeros(cov.numel(), dtype=torch.bool)
    top[torch.topk(cov.flatten(), k).indices] = True
    per = per + coef * lr.abs() * top.view_as(per).double()
    return per, {"ppo_kl": masked_mean(lr.detach().abs(), mask)}


def gmpo(lp, old, adv, mask, clip_low, clip_high):
    """GMPO (Zhao et al., arXiv:2507.20673, eq. 6): per sequence L = -mean_t(A) exp(mean_t d_t), d the log-ratio
    clipped against the advantage's sign in log space, d = sgn(A) min(sgn(A) lr, sgn(A) clamp(lr, -lo, hi));
    upstream compute_policy_loss_geo_mean. Returns the per-sequence losses [B] (0 for an empty row) and the
    statistics. Deliberate differences: ours averages over the sequences with a valid token (upstream: over all
    rows of the micro-batch, fully padded ones counting 0) and clamps lr to +-20 first like every other loss
    (upstream does not; the same within +-20); this transcription does both as ours."""
    m = mask.bool()
    lr = log_ratio(lp, old)
    sgn = torch.sign(adv)
    lr_c = torch.clamp(lr, -clip_low, clip_high)
    d = where(m, sgn * torch.minimum(sgn * lr, sgn * lr_c))
    n = m.sum(-1).clamp(min=1)
    seq = -(where(m, adv).sum(-1) / n) * torch.exp(d.sum(-1) / n)
    clipped = lr.detach() != lr_c.detach()
    return seq, {"pg_clipfrac": masked_mean((clipped & (adv > 0)).double(), mask),
                 "pg_clipfrac_lower": masked_mean((clipped & (adv < 0)).double(), mask)}


def dro(lp, old, adv, mask, beta):
    """DRO (Richemond et al., "Offline Regularised RL for LLM Alignment", arXiv:2405.19107, eq. 8-9): the policy
    part of its loss, whose gradient is -(A grad log pi - beta/2 grad (log pi - log pi_old)^2) per token, with the
    advantage A = r - V and the previous policy as the reference: l = -(A log pi - beta/2 (log pi - log pi_old)^2)."""
    return -(adv * lp - 0.5 * beta * (lp - old) ** 2), {}


# ---------------------------------------------------------------------------------------------- advantages

def whiten(x, mask, eps=1e-8):
    """Upstream verl_F.masked_whiten: (x - mean) / sqrt(unbiased var + eps) over the valid entries."""
    m = mask.bool()
    v = x[m]
    return where(m, (x - v.mean()) / torch.sqrt(v.var(unbiased=True) + eps))


def gae(rewards, values, mask, gamma, lam):
    """GAE (Schulman et al., arXiv:1506.02438, eq. 16): delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l
    (gamma lam)^l delta_{t+l}, over valid tokens only (a masked position is skipped: the next valid token's value
    and advantage carry across it, 0 after the last); returns = A + V; advantages whitened (upstream
    compute_gae_advantage_return). Written as the backward recursion, one token at a time."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        next_v, run = 0.0, 0.0
        for t in reversed(range(T)):
            if not mask[b, t]:
                continue
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            run = delta + gamma * lam * run
            adv[b, t], next_v = run, float(values[b, t])
    returns = where(mask, adv + values)
    return whiten(adv, mask), returns


def scores(rewards, mask):
    """Outcome score of each response: the sum of its valid token rewards."""
    return where(mask, rewards).sum(-1)


def _groups(index):
    out: dict = {}
    for i, g in enumerate(index):
        out.setdefault(int(g), []).append(i)
    return out


def broadcast(seq_adv, mask):
    return where(mask, seq_adv.unsqueeze(-1).expand(mask.shape))


def grpo(rewards, mask, index, eps=1e-6, norm_by_std=True):
    """GRPO (Shao et al., arXiv:2402.03300, sec. 4.1.2): (s - mean_g) / (std_g + eps), std unbiased as upstream
    (torch.std); norm_by_std=False is Dr.GRPO (Liu et al., arXiv:2503.20783): s - mean_g. Deliberate difference: a
    group of one response gets 0 here (no baseline, no signal); upstream uses mean 0 and std 1, i.e. A = s / (1 +
    eps). The caller skips singleton groups when comparing."""
    s = scores(rewards, mask)
    a = torch.zeros_like(s)
    for rows in _groups(index).values():
        g = s[rows]
        if len(rows) > 1:
            a[rows] = (g - g.mean()) / (g.std() + eps) if norm_by_std else g - g.mean()
    return broadcast(a, mask)


def rloo(rewards, mask, index):
    """RLOO (Ahmadian et al., arXiv:2402.14740, eq. 5; Kool et al. 2019): s_i - mean of the group's other scores;
    upstream compute_rloo_outcome_advantage (n/(n-1) (s - mean)). Singletons: 0 here, s upstream (as grpo)."""
    s = scores(rewards, mask)
    a = torch.zeros_like(s)
    for rows in _groups(index).values():
        for i in rows:
            others = [s[j] for j in rows if j != i]
            if others:
                a[i] = s[i] - sum(others) / len(others)
    return broadcast(a, mask)


def remax(rewards, mask, baseline):
    """ReMax (Li et al., arXiv:2310.10505, eq. 7): the sequence reward minus the reward of the greedy response,
    on every token. Upstream uses the reward-to-go (reverse cumulative sum) minus the baseline: equal when the
    reward sits on the last token (an outcome reward, how the trainer places it); with rewards on earlier tokens
    (KL in the reward) ours keeps the sequence reward, as the paper."""
    return broadcast(scores(rewards, mask) - baseline, mask)


def reinforce_pp(rewards, mask, gamma):
    """REINFORCE++ (Hu, arXiv:2501.03262, eq. 6-7): G_t = sum_{k>=t} gamma^(k-t) r_k over the response's valid
    tokens, whitened over the batch's valid tokens; returns are the raw G (upstream
    compute_reinforce_plus_plus_outcome_advantage, which resets the sum at padding)."""
    B, T = rewards.shape
    g = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        run = 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                run = float(rewards[b, t]) + gamma * run
                g[b, t] = run
    return whiten(g, mask), g


def reinforce_pp_baseline(rewards, mask, index):
    """REINFORCE++-baseline (Hu, arXiv:2501.03262, sec. 3.2): s - group mean, broadcast and whitened over the
    batch's valid tokens (upstream compute_reinforce_plus_plus_baseline_outcome_advantage). Singletons: 0 here
    before whitening (upstream: s)."""
    s = scores(rewards, mask)
    a = torch.zeros_like(s)
    for rows in _groups(index).values():
        if len(rows) > 1:
            a[rows] = s[rows] - s[rows].mean()
    return whiten(broadcast(a, mask), mask)


def opo(rewards, mask, index):
    """OPO (Hao et al., arXiv:2505.23585, eq. 7): the optimal baseline under on-policy sampling, the
    length-weighted mean score b = sum_j |o_j| s_j / sum_j |o_j|; A = s - b (upstream
    compute_opo_outcome_advantage). Singletons: 0 here (the formula's b is s itself); upstream special-cases b=0."""
    s = scores(rewards, mask)
    n = mask.bool().sum(-1).double()
    a = torch.zeros_like(s)
    for rows in _groups(index).values():
        if len(rows) > 1 and n[rows].sum() > 0:
            a[rows] = s[rows] - (n[rows] * s[rows]).sum() / n[rows].sum()
    return broadcast(a, mask)


def gpg_adv(rewards, mask, index):
    """GPG (Chu et al., arXiv:2504.02546, eq. 4-5): alpha (s - mean_g) / F_norm with F_norm = 1 and alpha = B /
    (B - M), M the responses in groups whose scores are all equal (they carry no gradient). Deliberate difference:
    upstream compute_gpg_outcome_advantage takes alpha = B / #(nonzero scores), which is not the paper's."""
    s = scores(rewards, mask)
    B = len(s)
    groups = _groups(index)
    flat = sum(len(rows) for rows in groups.values() if bool((s[rows] == s[rows][0]).all()))
    alpha = B / (B - flat) if B > flat else 1.0
    a = torch.zeros_like(s)
    for rows in groups.values():
        a[rows] = alpha * (s[rows] - s[rows].mean())
    return broadcast(a, mask)


def grpo_passk(rewards, mask, index, eps=1e-6, norm_by_std=True):
    """Pass@k training (Chen et al., arXiv:2503.19595, sec. 3): only the group's best response gets an advantage,
    r_max - r_second (ties: the first best, the second-largest counting the other tied one, so 0), divided by
    (std_g + eps) when norm_by_std (upstream compute_grpo_passk_outcome_advantage). Singletons: 0 (upstream
    raises)."""
    s = scores(rewards, mask)
    a = torch.zeros_like(s)
    for rows in _groups(index).values():
        if len(rows) < 2:
            continue
        g = [float(s[i]) for i in rows]
        best = max(range(len(g)), key=lambda k: (g[k], -k))
        second = max(g[k] for k in range(len(g)) if k != best)
        gap = g[best] - second
        if norm_by_std:
            gap = gap / (float(s[rows].std()) + eps)
        a[rows[best]] = gap
    return broadcast(a, mask)


# ---------------------------------------------------------------------------------------------- KL, value loss

def kl(lp, ref, kind):
    """Per-token KL(pi || ref) estimators (J. Schulman, "Approximating KL divergence", 2020; upstream kl_penalty /
    kl_penalty_forward): k1 = log pi - log ref; abs = |k1|; k2 = (k1)^2 / 2; k3 = exp(-k1) + k1 - 1 with the
    exponent clamped to +-20 and the value to +-10. "+" kinds are straight-through: the value of k1 / k3, the
    gradient of k2 (upstream's `backward_score - sg(backward_score) + sg(forward_score)`)."""
    d = lp - ref
    k2 = 0.5 * d ** 2
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return k2
    x = torch.clamp(ref - lp, -20.0, 20.0)
    k3 = torch.clamp(torch.exp(x) - x - 1, -10.0, 10.0)
    if kind in ("low_var_kl", "k3"):
        return k3
    forward = {"k1+": d, "kl+": d, "k3+": k3, "low_var_kl+": k3}[kind]
    return k2 - k2.detach() + forward.detach()


def value_loss(v, old, returns, mask, clip, mode="token-mean"):
    """PPO's clipped value loss (upstream compute_value_loss, after TRL): 0.5 * agg(max((v - R)^2,
    (clip(v, old - c, old + c) - R)^2)); clipfrac = share of tokens where the clipped term is larger."""
    vc = torch.maximum(torch.minimum(v, old + clip), old - clip)
    l1, l2 = (v - returns) ** 2, (vc - returns) ** 2
    return 0.5 * aggregate(torch.maximum(l1, l2), mask, mode), masked_mean((l2 > l1).double(), mask)


# ---------------------------------------------------------------------------------------------- rollout correction

SAFETY = 20.0


def is_weights(old, rollout, mask, level, cap):
    """Truncated IS (upstream rollout_corr_helper.compute_rollout_correction_weights; Yao et al., "Your efficient
    RL framework secretly brings you off-policy RL training", 2025): token w_t = min(exp(clamp(delta_t, +-20)), C);
    sequence w = min(exp(clamp(sum_t delta_t, +-20)), C) on every token; delta = log pi_old - log mu. Padding:
    upstream 0, ours 1 (it multiplies masked-out losses either way). Deliberate difference: ours clamps each delta_t
    to +-20 before summing and bounds only the top of the sum (log C), so a sequence below exp(-20) keeps its own
    tiny weight instead of exp(-20)."""
    m = mask.bool()
    d = torch.where(m, old - rollout, torch.zeros((), dtype=torch.float64))
    if level == "token":
        w = torch.exp(torch.clamp(d, -SAFETY, SAFETY))
    else:
        w = torch.exp(torch.clamp(d.sum(-1, keepdim=True), -SAFETY, SAFETY)).expand_as(d)
    return torch.where(m, torch.clamp(w, max=cap), torch.ones((), dtype=torch.float64))


def rejection_keep(old, rollout, mask, level, lower, upper):
    """Rejection by the IS ratio in [lower, upper] (upstream rollout_corr_helper.compute_rollout_rejection_mask at
    volcengine/verl 518bada21, "token" / "sequence" / "geometric": the token ratio, the sequence's product, or its
    geometric mean exp(mean_t delta_t); since replaced upstream by k1/k2/k3 divergence criteria). A rejected token
    (or every token of a rejected sequence) leaves the loss mask."""
    m = mask.bool()
    d = torch.where(m, old - rollout, torch.zeros((), dtype=torch.float64))
    if level == "token":
        stat = torch.clamp(d, -SAFETY, SAFETY)
    else:
        total = d.sum(-1, keepdim=True)
        if level == "geometric":
            total = total / m.sum(-1, keepdim=True).clamp(min=1)
        stat = torch.clamp(total, -SAFETY, SAFETY).expand_as(d)
    w = torch.exp(stat)
    return m & (w >= lower) & (w <= upper)
