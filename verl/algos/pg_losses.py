"""Policy losses in plain PyTorch: CISPO, SAPO, GPG, DPPO (binary TV / KL), Clip-Cov, KL-Cov, GMPO and DRO.

All follow verl.algos.policy_losses' calling convention and are registered on import. None has a fused kernel:
each is a handful of elementwise ops followed by the fused aggregation (verl.ops.agg_loss, one kernel with its
own autograd), and at the [B, T] sizes of a policy loss the elementwise part is memory-bound and small next to
the LM head; Clip-Cov and KL-Cov also select tokens data-dependently (top-k / random subset over the batch),
which a one-pass kernel cannot do. Each loss's hyperparameters are a dataclass built from
`actor.policy_loss_params`; like upstream verl, CISPO, DPPO and GMPO read their bounds from the actor's
clip_ratio_low / clip_ratio_high (/ clip_ratio_c), and SAPO aggregates per sequence. Where a loss differs from
upstream verl's implementation, its docstring says how (and `verl algos` lists it).

Shared conventions (as the fused built-ins): log-ratio = clamp(logp - old, +-20) wherever a ratio is
exponentiated; statistics are float32 token means over this batch's valid tokens; `ppo_kl` is the token mean of
old - logp; gradients flow to `logprob` only (old log-probs, advantages and rollout IS weights are constants).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from verl.algos.policy_losses import register_policy_loss
from verl.errors import VerlConfigError
from verl.ops.checks import check_bt, valid_mask
from verl.ops.losses import Aggregation, PolicyLossOutput, agg_loss

__all__ = ["ClipCovParams", "DROParams", "KLCovParams", "SAPOParams"]


def _nonneg(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not (v >= 0 and math.isfinite(v)):
            raise VerlConfigError(f"policy_loss_params.{n} must be a finite number >= 0, got {v}")


def _positive(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not (v > 0 and math.isfinite(v)):
            raise VerlConfigError(f"policy_loss_params.{n} must be a finite number > 0, got {v}")


@dataclass(kw_only=True, slots=True)
class SAPOParams:
    """SAPO's gate temperatures."""

    tau_pos: float = 1.0
    """Temperature of the sigmoid gate on tokens with positive advantage."""
    tau_neg: float = 1.05
    """Temperature on tokens with advantage <= 0 (larger: negative updates fade faster off-policy)."""

    def check(self) -> None:
        _positive(self, "tau_pos", "tau_neg")


@dataclass(kw_only=True, slots=True)
class ClipCovParams:
    """Clip-Cov: detach the gradient of a random few tokens whose covariance term is in (cov_lb, cov_ub)."""

    clip_cov_ratio: float = 0.0002
    """Share of the batch's valid tokens detached (at least one)."""
    cov_lb: float = 1.0
    """Only tokens with (A - mean A)(logp - mean logp) above this are candidates."""
    cov_ub: float = 5.0
    """... and below this."""

    def check(self) -> None:
        _positive(self, "clip_cov_ratio")
        if not self.cov_lb < self.cov_ub:
            raise VerlConfigError(f"policy_loss_params.cov_lb={self.cov_lb} must be < cov_ub={self.cov_ub}")


@dataclass(kw_only=True, slots=True)
class KLCovParams:
    """KL-Cov: a |log-ratio| penalty on the tokens with the largest covariance term."""

    kl_cov_ratio: float = 0.0002
    """Share of the batch's valid tokens penalised (at least one)."""
    ppo_kl_coef: float = 0.1
    """Weight of |logp - old| on the selected tokens."""

    def check(self) -> None:
        _positive(self, "kl_cov_ratio")
        _nonneg(self, "ppo_kl_coef")


@dataclass(kw_only=True, slots=True)
class DROParams:
    """DRO's quadratic log-ratio penalty."""

    beta: float | None = None
    """Weight of 0.5 * (logp - old)^2; required (no default: its scale depends on the reward's)."""

    def check(self) -> None:
        if self.beta is None:
            raise VerlConfigError("policy loss 'dro' needs actor.policy_loss_params.beta > 0 (the weight of its "
                                  "0.5 (logp - old)^2 penalty), e.g. actor.policy_loss_params.beta=0.1")
        _positive(self, "beta")


# ---------------------------------------------------------------------------------------------- helpers

def _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, name: str):
    check_bt(logprob, response_mask, name, "logprob")
    for what, t in (("old_logprob", old_logprob), ("advantages", advantages), ("rollout_is_weights",
                                                                                 rollout_is_weights)):
        if t is not None and t.shape != logprob.shape:
            raise ValueError(f"{name}: `{what}` must have the shape of `logprob` {tuple(logprob.shape)}, "
                             f"got {tuple(t.shape)}")
    valid = valid_mask(response_mask)
    w = None if rollout_is_weights is None else rollout_is_weights.detach()
    return old_logprob.detach(), advantages.detach(), valid, w


def _log_ratio(logprob, old):
    return torch.clamp(logprob - old, -20.0, 20.0)


@torch.no_grad()
def _stat(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (torch.where(valid, x.float(), 0.0).sum() / valid.sum().clamp(min=1)).float()


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=like.device)


def _finish(per_token, response_mask, agg, w, valid, log_ratio, clipfrac=None, lower=None) -> PolicyLossOutput:
    """Weights the per-token loss by the rollout IS weights, aggregates it, and packs the statistics."""
    if w is not None:
        per_token = per_token * w
    per_token = torch.where(valid, per_token, 0.0)  # padding may hold anything; keep it out of the gradient
    loss = agg_loss(per_token, response_mask, agg)
    z = _zero(per_token)
    return PolicyLossOutput(loss, z if clipfrac is None else clipfrac, z if lower is None else lower,
                            _stat(-log_ratio.detach(), valid))


# ---------------------------------------------------------------------------------------------- losses

@register_policy_loss("cispo", clip="weight")
def cispo(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
          agg="token-mean", rollout_is_weights=None) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585), plain PyTorch: l = -sg(clip(r, 1 - lo, 1 + hi)) * A * logp, so every
    token keeps a gradient (the weight, not the update, is clipped). lo, hi: the actor's clip_ratio_low / high, as
    upstream verl reads them (the paper's practice of no lower bound is clip_ratio_low >= 1, e.g. 10 as verl's
    example). pg_clipfrac: share with r > 1 + hi; pg_clipfrac_lower: share with r < 1 - lo (upstream reports one
    share of either and 0)."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "cispo")
    hi = clip_low if clip_high is None else clip_high
    lr = _log_ratio(logprob, old)
    ratio = lr.detach().exp()
    weight = torch.clamp(ratio, min=1.0 - clip_low, max=1.0 + hi)
    per = -weight * adv * logprob
    return _finish(per, response_mask, agg, w, valid, lr, _stat(ratio > 1.0 + hi, valid),
                   _stat(ratio < 1.0 - clip_low, valid))


@register_policy_loss("sapo", params=SAPOParams, clip="none", agg="seq-mean-token-mean")
def sapo(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
         agg="token-mean", rollout_is_weights=None, params: SAPOParams = SAPOParams()) -> PolicyLossOutput:
    """SAPO (arXiv:2511.20347), plain PyTorch: l = -A * f(r, tau), f(r, tau) = sigmoid(tau (r - 1)) * 4 / tau with
    tau = tau_pos for A > 0 else tau_neg: a smooth trust region whose gradient equals the policy gradient at
    r = 1 and fades as r leaves 1. Aggregated per sequence (seq-mean-token-mean) whatever actor.loss_agg_mode says,
    as upstream verl does. No clip statistics (both 0)."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "sapo")
    lr = _log_ratio(logprob, old)
    tau = torch.where(adv > 0, logprob.new_tensor(params.tau_pos), logprob.new_tensor(params.tau_neg))
    gate = torch.sigmoid(tau * (lr.exp() - 1.0)) * (4.0 / tau)
    seq_agg = dataclasses.replace(_as_agg(agg), mode="seq-mean-token-mean")
    return _finish(-gate * adv, response_mask, seq_agg, w, valid, lr)


@register_policy_loss("gpg", clip="none")
def gpg(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
        agg="token-mean", rollout_is_weights=None) -> PolicyLossOutput:
    """GPG (arXiv:2504.02546), plain PyTorch: the plain policy gradient l = -A * logp (no ratio, no clip); pair it
    with algorithm.adv_estimator=gpg. No clip statistics."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "gpg")
    return _finish(-adv * logprob, response_mask, agg, w, valid, _log_ratio(logprob, old))


def _dppo(logprob, old, adv, valid, w, response_mask, agg, lr, keep, is_cap) -> PolicyLossOutput:
    ratio = lr.detach().exp()
    keep = keep.detach()
    per = -adv * torch.clamp(ratio, max=is_cap) * logprob * keep.to(logprob.dtype)
    return _finish(per, response_mask, agg, w, valid, lr, _stat(~keep, valid), _stat((ratio > is_cap) & keep, valid))


@register_policy_loss("dppo_tv", clip="divergence")
def dppo_tv(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
            agg="token-mean", rollout_is_weights=None) -> PolicyLossOutput:
    """DPPO-Binary-TV (arXiv:2602.04879), plain PyTorch: l = -A * sg(min(r, C)) * logp * M, where the mask M keeps
    a token unless its probability moved past the TV bound in the advantage's direction (A > 0: p - p_old <=
    clip_high; A <= 0: p - p_old >= -clip_low). The thresholds are the actor's clip_ratio_low / high and C its
    clip_ratio_c, as upstream verl reads them (the paper's 0.15 thresholds and large C are settings of those).
    pg_clipfrac: share masked; pg_clipfrac_lower: share kept whose ratio was truncated at C."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "dppo_tv")
    hi = clip_low if clip_high is None else clip_high
    dp = logprob.detach().exp() - old.exp()
    keep = torch.where(adv > 0, dp <= hi, dp >= -clip_low)
    return _dppo(logprob, old, adv, valid, w, response_mask, agg, _log_ratio(logprob, old), keep, clip_c)


@register_policy_loss("dppo_kl", clip="divergence")
def dppo_kl(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
            agg="token-mean", rollout_is_weights=None) -> PolicyLossOutput:
    """DPPO-Binary-KL (arXiv:2602.04879), plain PyTorch: as dppo_tv with the binary KL of the sampled token,
    KL = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)) (the 1e-8 as upstream), as
    the divergence: A > 0 keeps a token if KL <= clip_high or p <= p_old; A <= 0 if KL <= clip_low or p >= p_old
    (the actor's clip_ratio_low / high, C its clip_ratio_c, as upstream reads them)."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "dppo_kl")
    lp = logprob.detach()
    p, p_old = lp.exp(), old.exp()
    bkl = p_old * (old - lp) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    hi = clip_low if clip_high is None else clip_high
    keep = torch.where(adv > 0, (bkl <= hi) | (p <= p_old), (bkl <= clip_low) | (p >= p_old))
    return _dppo(logprob, old, adv, valid, w, response_mask, agg, _log_ratio(logprob, old), keep, clip_c)


@torch.no_grad()
def _covariance(logprob, adv, valid):
    """(A - mean A) (logp - mean logp) per token, means over this batch's valid tokens (0 where invalid)."""
    n = valid.sum().clamp(min=1)
    lp = logprob.detach()
    mean_a = torch.where(valid, adv, 0.0).sum() / n
    mean_lp = torch.where(valid, lp, 0.0).sum() / n
    return torch.where(valid, (adv - mean_a) * (lp - mean_lp), 0.0)


@register_policy_loss("clip_cov", params=ClipCovParams, clip="ratio",
                      upstream="the log-ratio is clamped to +-20 before exp (upstream: unclamped)")
def clip_cov(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
             agg="token-mean", rollout_is_weights=None, params: ClipCovParams = ClipCovParams()) -> PolicyLossOutput:
    """Clip-Cov (arXiv:2505.22617), plain PyTorch: the PPO clip max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    (the actor's clip, no dual clip), with the gradient of max(1, int(clip_cov_ratio * valid tokens)) tokens
    cut: drawn uniformly (torch.randperm on the default CPU generator, over candidates in row-major order) among
    the valid, not already clipped tokens whose covariance term lies in (cov_lb, cov_ub). Covariance means are
    over this micro-batch, as upstream. The ratio's log is clamped to +-20 (upstream: unclamped).
    pg_clipfrac: share of tokens cut."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "clip_cov")
    hi = clip_low if clip_high is None else clip_high
    lr = _log_ratio(logprob, old)
    ratio = lr.exp()
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + hi)
    cov = _covariance(logprob, adv, valid)
    cand = valid & ~(pg2 > pg1).detach() & (cov > params.cov_lb) & (cov < params.cov_ub)
    keep = torch.ones_like(valid)
    n_valid = int(valid.sum())
    if n_valid:
        idx = cand.flatten().nonzero().squeeze(-1)
        n_cut = min(max(int(params.clip_cov_ratio * n_valid), 1), idx.numel())
        keep.view(-1)[idx[torch.randperm(idx.numel())[:n_cut].to(idx.device)]] = False
    per = torch.maximum(pg1, pg2) * keep.to(logprob.dtype)
    return _finish(per, response_mask, agg, w, valid, lr, _stat(~keep, valid))


@register_policy_loss("kl_cov", params=KLCovParams, clip="none",
                      upstream="the log-ratio is clamped to +-20 before exp (upstream: unclamped)")
def kl_cov(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
           agg="token-mean", rollout_is_weights=None, params: KLCovParams = KLCovParams()) -> PolicyLossOutput:
    """KL-Cov (arXiv:2505.22617), plain PyTorch: -A r on every token, plus ppo_kl_coef * |logp - old| on the
    max(1, int(kl_cov_ratio * valid tokens)) valid tokens with the largest covariance term (torch.topk; means
    over this micro-batch, as upstream). ppo_kl reports the token mean of |logp - old|, as upstream. The log-ratio
    is clamped to +-20 (upstream: unclamped)."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "kl_cov")
    lr = _log_ratio(logprob, old)
    per = -adv * lr.exp()
    n_valid = int(valid.sum())
    if n_valid:
        pos = valid.flatten().nonzero().squeeze(-1)
        k = max(int(params.kl_cov_ratio * n_valid), 1)
        top = pos[torch.topk(_covariance(logprob, adv, valid).flatten()[pos], k).indices]
        sel = torch.zeros_like(valid)
        sel.view(-1)[top] = True
        per = per + params.ppo_kl_coef * lr.abs() * sel.to(logprob.dtype)
    out = _finish(per, response_mask, agg, w, valid, lr)
    return out._replace(ppo_kl=_stat(lr.detach().abs(), valid))


def _as_agg(agg) -> Aggregation:
    return Aggregation(mode=agg) if isinstance(agg, str) else (agg or Aggregation())


@register_policy_loss("geo_mean", "gmpo", clip="log_ratio", agg="seq-mean-token-mean",
                      upstream="the mean of the sequence losses over the step's sequences with a valid token (global "
                      "counts: independent of micro-batching); upstream takes torch.mean over each micro-batch's "
                      "rows, padded rows included")
def geo_mean(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
             agg="token-mean", rollout_is_weights=None) -> PolicyLossOutput:
    """GMPO (arXiv:2507.20673), plain PyTorch: per sequence, L = -mean_t(A) * exp(mean_t(d_t)) with the token
    log-ratio clipped in log space against the advantage's sign, d = sgn(A) min(sgn(A) lr, sgn(A) clamp(lr,
    -clip_low, clip_high)), so a token with A = 0 contributes d = 0 (as upstream). A sequence-level objective:
    whatever actor.loss_agg_mode says, it is the mean of L over the step's sequences with a valid token
    (upstream: torch.mean over the micro-batch's rows, fully padded rows included as 0). Rollout IS weights enter
    as their per-sequence geometric mean, as upstream. The log-space bounds are the actor's clip_ratio_low / high,
    as upstream reads them (the paper's (-0.4, 0.4) is clip_ratio_low=clip_ratio_high=0.4). Statistics: share of
    tokens whose log-ratio is outside the bounds, with A > 0 (pg_clipfrac) and A < 0 (pg_clipfrac_lower)."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "geo_mean")
    lr = _log_ratio(logprob, old)
    hi = clip_low if clip_high is None else clip_high
    lr_c = torch.clamp(lr, -clip_low, hi)
    sgn = torch.sign(adv)
    d = torch.where(valid, sgn * torch.minimum(sgn * lr, sgn * lr_c), 0.0)
    n = valid.sum(-1).clamp(min=1).to(logprob.dtype)
    seq_adv = torch.where(valid, adv, 0.0).sum(-1) / n
    seq_loss = -seq_adv * torch.exp(d.sum(-1) / n)
    if w is not None:
        seq_loss = seq_loss * torch.exp(torch.where(valid, torch.log(w.clamp(min=1e-30)), 0.0).sum(-1) / n)
    per = seq_loss.unsqueeze(-1).expand_as(logprob)
    clipped = lr.detach() != lr_c.detach()
    seq_agg = dataclasses.replace(_as_agg(agg), mode="seq-mean-token-mean")
    return _finish(per, response_mask, seq_agg, None, valid, lr, _stat(clipped & (adv > 0), valid),
                   _stat(clipped & (adv < 0), valid))


@register_policy_loss("dro", params=DROParams, clip="none")
def dro(logprob, old_logprob, advantages, response_mask, *, clip_low=0.2, clip_high=None, clip_c=3.0,
        agg="token-mean", rollout_is_weights=None, params: DROParams = DROParams()) -> PolicyLossOutput:
    """DRO (Richemond et al., "Offline Regularised RL for LLM Alignment"), plain PyTorch:
    l = -(A logp - beta/2 (logp - old)^2), i.e. the policy gradient with a quadratic pull back to the old policy
    (unclamped, as upstream). Statistics: ppo_kl only."""
    old, adv, valid, w = _inputs(logprob, old_logprob, advantages, response_mask, rollout_is_weights, "dro")
    if params.beta is None:
        params.check()
    per = -(adv * logprob - 0.5 * params.beta * (logprob - old).square())
    return _finish(per, response_mask, agg, w, valid, _log_ratio(logprob, old))
