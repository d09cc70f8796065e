"""Mixture-of-experts Hugging Face modules (transformers >= 5): verl's fused token dispatch as their experts'
implementation, and the routes their routers choose, recorded.

    install_experts(model)              # experts run on verl.ops.moe_permute / moe_unpermute ("verl")
    rec = RouteRecorder.attach(model)   # None for a dense or unknown model
    model(ids); rec.take()              # [B, S, L, K] int16: the experts of each token in each MoE layer

transformers keeps a layer's experts fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) and
calls them with the router's top-k ids and weights; its own implementations are a loop over one-hot masks
("eager") or torch's grouped GEMM. verl's registers in transformers' experts interface: tokens are permuted to
expert-contiguous rows with their weights, each expert runs one GEMM pair on its rows, and one fused gather
combines them back. Every supported family's router (`mlp.gate`) returns (logits, weights, ids).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl.errors import VerlConfigError

__all__ = ["EXPERTS_IMPLEMENTATION", "RouteRecorder", "install_experts", "verl_experts_forward"]

EXPERTS_IMPLEMENTATION = "verl"


def verl_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's forward on verl's dispatch kernels (same arguments and result)."""
    from verl.ops.moe import moe_permute, moe_unpermute
    p = moe_permute(hidden_states, top_k_index, None, self.num_experts)
    rows, start = [], 0
    for e, n in enumerate(p.tokens_per_expert.tolist()):
        if n == 0:
            continue
        x = p.permuted[start:start + n]
        h = self._apply_gate(F.linear(x, self.gate_up_proj[e]))
        rows.append(F.linear(h, self.down_proj[e]))
        start += n
    y = torch.cat(rows) if rows else p.permuted
    return moe_unpermute(y, p.dst_of, top_k_weights).to(hidden_states.dtype)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, verl_experts_forward)


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")
            and hasattr(m, "num_experts")]


def install_experts(model: torch.nn.Module) -> bool:
    """Runs `model`'s experts on verl's dispatch kernels when its experts modules are transformers' standard
    fused, bias-free, untransposed SwiGLU ones; returns whether it did (other models keep their own)."""
    experts = _experts_modules(model)
    if not experts or not hasattr(model, "set_experts_implementation"):
        return False
    if any(getattr(m, "has_bias", True) or getattr(m, "is_transposed", True) or not getattr(m, "has_gate", False)
           for m in experts):
        return False
    _register()
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return True


class RouteRecorder:
    """Forward hooks on a model's MoE routers: after each forward, `take()` gives the top-k expert ids every
    token of it went to, per MoE layer."""

    def __init__(self, routers: list[torch.nn.Module], top_k: int):
        self.top_k = top_k
        self._ids: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    @classmethod
    def attach(cls, model: torch.nn.Module) -> "RouteRecorder | None":
        """A recorder on `model`'s routers, or None when the layout model does not know it as an MoE model."""
        from verl.models.config import arch_from_hf
        try:
            arch = arch_from_hf(model.config)
        except (VerlConfigError, AttributeError):
            return None
        base = getattr(model, "model", None)
        if arch.moe is None or base is None or not hasattr(base, "layers"):
            return None
        return cls([base.layers[i].mlp.gate for i in arch.moe.layers], arch.moe.top_k)

    def _hook(self, i: int):
        def hook(_module, _inputs, output):
            self._ids[i] = output[2].detach()
        return hook

    def take(self, batch: int) -> torch.Tensor | None:
        """[batch, S, L, K] int16 of the last forward (S = its tokens per row); None if a router did not run."""
        if any(x is None for x in self._ids):
            return None
        ids = torch.stack([x.reshape(batch, -1, self.top_k) for x in self._ids], dim=2)
        self._ids = [None] * len(self._ids)
        return ids.to(device="cpu", dtype=torch.int16)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
