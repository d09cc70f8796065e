"""KL penalties between policy and reference log-probs, selected by name: `get_kl("low_var_kl")(logprob, ref)`.

Calling convention: fn(logprob [B, T], ref_logprob [B, T]) -> per-token KL estimate [B, T], differentiable.
Built-ins (fused kernels): kl / k1, abs, mse / k2, low_var_kl / k3, and the straight-through k1+ / k3+ (value of
k1 / k3, gradient of k2). `kl_loss(name, ...)` aggregates over the mask; for the built-ins that is one fused
kernel, for a registered Python function it is fn followed by verl.algos.agg_loss.
"""

from __future__ import annotations

import torch

from verl.registry import Registry
from verl.ops.losses import KL_KINDS, Aggregation, agg_loss, kl_penalty
from verl.ops.losses import kl_loss as _fused_kl_loss

__all__ = ["KLS", "register_kl", "get_kl", "kl_loss", "fused_kl_kind"]

KLS: Registry = Registry("KL penalty", required=("logprob", "ref_logprob"))
_FUSED: dict[str, str] = {}


def register_kl(name: str, *aliases: str):
    """Decorator registering a per-token KL estimator fn(logprob, ref_logprob) -> [B, T]."""
    return KLS.register(name, *aliases)


def get_kl(name: str):
    """The per-token KL function registered as `name`; unknown names list the known ones."""
    return KLS.get(name)


def kl_loss(name: str, logprob: torch.Tensor, ref_logprob: torch.Tensor, response_mask: torch.Tensor,
            agg: Aggregation | str = "token-mean") -> torch.Tensor:
    """KL penalty `name` aggregated over the mask into a 0-d loss (fused for the built-in kinds)."""
    fn = get_kl(name)
    kind = _FUSED.get(name)
    if kind is not None and getattr(fn, "_verl_builtin", False):
        return _fused_kl_loss(logprob, ref_logprob, response_mask, kind, agg)
    return agg_loss(fn(logprob, ref_logprob), response_mask, agg)


def fused_kl_kind(name: str) -> str | None:
    """The fused kernels' kind of KL `name` when it is a built-in (unknown names list the known ones), else None."""
    fn = get_kl(name)
    return _FUSED.get(name) if getattr(fn, "_verl_builtin", False) else None


def _builtin(kind: str):
    def fn(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        return kl_penalty(logprob, ref_logprob, kind)
    fn.__name__ = fn.__qualname__ = kind.replace("+", "_plus")
    fn.__doc__ = f"Per-token KL estimator {kind!r} ([B, T], [B, T] -> [B, T]); see verl.ops.kl_penalty."
    fn._verl_builtin = True
    return fn


for _canonical in dict.fromkeys(KL_KINDS.values()):
    _aliases = [a for a, c in KL_KINDS.items() if c == _canonical and a != _canonical]
    register_kl(_canonical, *_aliases)(_builtin(_canonical))
    for _n in (_canonical, *_aliases):
        _FUSED[_n] = _canonical
