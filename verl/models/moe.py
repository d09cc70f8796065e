"""verl's mixture-of-experts layer on megatron-core: its MoELayer with verl's router and token dispatch.

megatron-core builds the layer from a module spec (`moe_layer_spec`), so verl plugs in three classes there
instead of patching anything:

* `VerlRouter` (megatron's TopKRouter): the checkpoint's softmax top-k routing in float32 on any device, the
  load-balancing auxiliary loss and z-loss through megatron's own machinery, and per forward a `RouteContext`:
  routes to replay instead of routing (router replay, R3), the rollout's routes to compare with
  (`moe/router_mismatch_frac`), which tokens are real; `RouteStats` keep what the metrics need.
* `VerlTokenDispatcher` (megatron's all-to-all dispatcher): permutation to expert-contiguous rows and the
  combine back through `verl.ops.moe_permute` / `moe_unpermute` (one fused gather each way, verl._C); the
  expert-parallel all-to-all and the ETP gather / reduce-scatter stay megatron's.
* `ProjectionRMSNorm`: OLMoE's q / k RMSNorm over the whole projection, the sum of squares all-reduced over TP.

Token order: megatron runs a micro-batch as [s, b, H] (with sequence parallelism each TP rank holds s / TP
consecutive positions), and a router sees its tokens flattened in that order. Routes in verl's batches are
[b, s, L, K] (L: the MoE layers, in layer order; -1 where the rollout recorded none); `route_contexts` maps them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl.errors import VerlRuntimeError

__all__ = ["RouteContext", "RouteStats", "ProjectionRMSNorm", "check_routes", "moe_layer_spec", "route_stats",
           "routers", "set_route_contexts"]


@dataclass(slots=True)
class RouteContext:
    """What one router does in its next forward (set per micro-batch, consumed by that forward)."""

    replay: torch.Tensor | None = None
    """[T, K] expert ids to use instead of routing; rows of -1 route themselves (tokens the rollout never fed)."""
    reference: torch.Tensor | None = None
    """[T, K] the rollout's expert ids (-1: unknown), compared with the ids used (`RouteStats.mismatch`)."""
    valid: torch.Tensor | None = None
    """[T] bool: real tokens (padding is excluded from the statistics)."""


@dataclass(slots=True)
class RouteStats:
    """A router's statistics since the last `route_stats` (device tensors: no host sync while running)."""

    load: torch.Tensor | None = None
    """[E] float64: real tokens sent to each expert."""
    aux: torch.Tensor | None = None
    """float64: sum over forwards of the load-balancing loss value E * sum_e f_e P_e (1 when balanced)."""
    forwards: int = 0
    mismatch: torch.Tensor | None = None
    """float64 [2]: (routing decisions that differ from the reference, decisions compared)."""
    extra: dict = field(default_factory=dict)


def _topk_weights(logits: torch.Tensor, ids: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The checkpoint's normalisation of the chosen experts' weights: softmax over the chosen logits (equal to
    renormalising the top-k of the softmax), or the full softmax gathered."""
    if normalize:
        return torch.softmax(logits.gather(1, ids), dim=-1)
    return torch.softmax(logits, dim=-1).gather(1, ids)


def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    class VerlRouter(TopKRouter):
        """megatron-core's top-k router with replay, recording and statistics (see the module docstring)."""

        def __init__(self, *, config, pg_collection=None):
            super().__init__(config=config, pg_collection=pg_collection)
            self.context: RouteContext | None = None
            self.stats = RouteStats()
            self.last_ids: torch.Tensor | None = None

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            # float32 logits on any device (megatron's gating moves the weight to CUDA and needs TE's GEMM)
            bias = None if self.bias is None else self.bias.float()
            return F.linear(input.float(), self.weight.float(), bias)

        def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            seq, bsz = logits.shape[:2]
            logits = self.apply_z_loss(logits.view(-1, self.config.num_moe_experts), padding_mask=padding_mask)
            ctx, self.context = self.context or RouteContext(), None
            ids = torch.topk(logits, self.topk, dim=-1).indices
            if ctx.replay is not None:
                replay = ctx.replay.to(ids.device)
                ids = torch.where((replay >= 0).all(-1, keepdim=True), replay, ids)
            weights = _topk_weights(logits, ids, not self.config.moe_router_pre_softmax)
            probs = torch.zeros_like(logits).scatter(1, ids, weights.to(logits.dtype))
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)
            if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
                scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
                probs = self._apply_aux_loss(probs, scores, routing_map)
            self.last_ids = ids
            self._update_stats(logits.detach(), ids, ctx)
            return probs, routing_map

        @torch.no_grad()
        def _update_stats(self, logits: torch.Tensor, ids: torch.Tensor, ctx: RouteContext) -> None:
            E, k, st = self.config.num_moe_experts, self.topk, self.stats
            valid = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device) if ctx.valid is None \
                else ctx.valid.to(ids.device)
            counts = torch.bincount(ids[valid].reshape(-1), minlength=E).double()
            n = valid.sum().clamp(min=1).double()
            p_mean = torch.softmax(logits[valid], dim=-1).double().sum(0) / n
            aux = E * (p_mean * counts / (n * k)).sum()
            st.load = counts if st.load is None else st.load + counts
            st.aux = aux if st.aux is None else st.aux + aux
            st.forwards += 1
            if ctx.reference is not None:
                ref = ctx.reference.to(ids.device)
                known = (ref >= 0).all(-1) & valid
                differ = (ids.sort(-1).values != ref.sort(-1).values).any(-1) & known
                pair = torch.stack([differ.sum(), known.sum()]).double()
                st.mismatch = pair if st.mismatch is None else st.mismatch + pair

    return VerlRouter


def _dispatcher_class():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from verl.ops.moe import moe_permute, moe_unpermute

    class VerlTokenDispatcher(MoEAlltoAllTokenDispatcher):
        """megatron-core's all-to-all dispatcher whose local permutation (before the all-to-all) and combine
        (after it) are verl's fused kernels, fed the router's top-k ids and weights."""

        topk: tuple[torch.Tensor, torch.Tensor] | None = None

        def dispatch_preprocess(self, hidden_states, routing_map, probs):
            self.hidden_shape = hidden_states.shape
            self.probs, self.routing_map = probs, routing_map
            hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
            self.tokens_per_expert = self.preprocess(routing_map)
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
            self.hidden_shape_before_permute = hidden_states.shape
            ids, weights = self.topk
            self.topk = None
            out = moe_permute(hidden_states, ids, weights, self.num_experts)
            self.dst_of = out.dst_of
            return out.permuted, out.permuted_probs

        def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
            out = super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
            # megatron turns the all-to-all splits into host numbers only when they live on a GPU; on the CPU
            # they stay tensors, which torch.distributed's all_to_all_single does not take as split sizes
            for name in ("input_splits", "output_splits"):
                value = getattr(self, name)
                if torch.is_tensor(value) and not value.is_cuda:
                    setattr(self, name, value.tolist())
            return out

        def combine_postprocess(self, permutated_local_input_tokens):
            # megatron's experts already scaled their rows by the routing weights: the combine only sums
            output = moe_unpermute(permutated_local_input_tokens, self.dst_of)
            self.dst_of = None
            return output.view(self.hidden_shape)

    return VerlTokenDispatcher


def _layer_class():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    dispatcher = _dispatcher_class()

    class VerlMoELayer(MoELayer):
        """MoELayer whose dispatcher is `VerlTokenDispatcher` (its router is the spec's `VerlRouter`)."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
            if config.moe_token_dispatcher_type != "alltoall":
                raise VerlRuntimeError(f"verl's MoE layer dispatches all-to-all; the config asks for "
                                       f"{config.moe_token_dispatcher_type!r}")
            pg_collection = pg_collection or get_default_pg_collection()
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             pg_collection=pg_collection)
            self.token_dispatcher = dispatcher(self.num_local_experts, self.local_expert_indices, config=self.config,
                                               pg_collection=pg_collection)

        def route(self, hidden_states, padding_mask=None):
            probs, routing_map = self.router(hidden_states, padding_mask)
            ids = self.router.last_ids
            # the weights come out of `probs`, to which the router attached the auxiliary loss's gradient
            self.token_dispatcher.topk = (ids, probs.gather(1, ids))
            return probs, routing_map

    return VerlMoELayer


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group whose every member's output feeds its own loss: the backward sums the gradients too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over a whole q or k projection (OLMoE), applied to this TP rank's heads [s, b, heads, head_dim]:
    the sum of squares of every head's entries is all-reduced over TP, the weight is this rank's heads' rows."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, heads: int, tp_group=None):
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
        tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
        self.full, self.eps, self.tp_group, self.tp = heads * hidden_size, eps, tp_group, tp
        self.weight = torch.nn.Parameter(torch.ones(self.full // tp, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], -1).float()
        ss = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            ss = _AllReduceSum.apply(ss, self.tp_group)
        y = (flat * torch.rsqrt(ss / self.full + self.eps)).to(x.dtype)
        return (self.weight * y).view(shape)


def moe_layer_spec(base, arch, *, tp_group=None):
    """`base` (megatron's GPT layer spec built with num_experts, or a dense one) with verl's MoE classes and,
    for a projection q/k norm, `ProjectionRMSNorm`."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec
    spec = copy.deepcopy(base)
    mlp = spec.submodules.mlp
    if hasattr(mlp.submodules, "router"):
        mlp.module = _layer_class()
        mlp.submodules.router = _router_class()
    if arch.qk_norm == "projection":
        attn = spec.submodules.self_attention.submodules
        attn.q_layernorm = ModuleSpec(module=ProjectionRMSNorm, params={"heads": arch.num_heads, "tp_group": tp_group})
        attn.k_layernorm = ModuleSpec(module=ProjectionRMSNorm, params={"heads": arch.num_kv_heads,
                                                                       "tp_group": tp_group})
    return spec


# --------------------------------------------------------------------------- routes in, statistics out

def routers(gpt) -> list:
    """This stage's routers in layer order, with each one's index among the model's MoE layers."""
    out = []
    for layer in gpt.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None and hasattr(router, "context"):
            out.append((layer.layer_number - 1, router))
    return out


def check_routes(routes: torch.Tensor, num_moe_layers: int, num_experts: int, layers: tuple[int, ...],
                 rows: torch.Tensor | None = None) -> None:
    """Replayed routes [B, S, L, K] must have one entry per MoE layer and expert ids in [0, E) (or -1: none)."""
    if routes.dim() != 4 or routes.shape[2] != num_moe_layers:
        raise VerlRuntimeError(f"the batch's routes have shape {tuple(routes.shape)} but the model has "
                               f"{num_moe_layers} MoE layers {list(layers)}: replayed routes must be [batch, tokens, "
                               f"{num_moe_layers}, top_k], recorded by a rollout of this model")
    bad = (routes < -1) | (routes >= num_experts)
    if bool(bad.any()):
        b, t, layer, _ = (int(i) for i in bad.nonzero()[0])
        sample = b if rows is None else int(rows[b])
        raise VerlRuntimeError(f"replayed route of token {t} of sample {sample} at MoE layer {layers[layer]} is "
                               f"expert {int(routes[b, t, layer].max())}, outside [0, {num_experts}); the routes "
                               f"were recorded by another model or are corrupt")


def _layer_routes(routes: torch.Tensor, layer: int, length: int, tp_rank: int, tp: int) -> torch.Tensor:
    """[b, s, L, K] routes of MoE layer `layer` in megatron's token order for this rank: [s', b] flattened,
    padded with -1 to `length` positions, this rank's sequence chunk under sequence parallelism."""
    r = routes[:, :, layer]
    if r.shape[1] < length:
        r = F.pad(r, (0, 0, 0, length - r.shape[1]), value=-1)
    r = r.transpose(0, 1)
    if tp > 1:
        r = r.chunk(tp, dim=0)[tp_rank]
    return r.reshape(-1, r.shape[-1])


def set_route_contexts(gpt, arch, mb: dict, length: int, *, sequence_parallel: bool, tp_rank: int, tp: int) -> None:
    """Gives each router of this stage its context for the micro-batch `mb` run at `length` positions: its
    routes ("routes" [b, s, L, K]: compared, and replayed when mb["replay_routes"]), and which tokens are real."""
    routes, replay = mb.get("routes"), bool(mb.get("replay_routes", False))
    split = tp if sequence_parallel else 1
    valid = mb["attention_mask"].long()
    valid = (F.pad(valid, (0, length - valid.shape[1])) > 0).transpose(0, 1)
    valid = (valid.chunk(split, dim=0)[tp_rank] if split > 1 else valid).reshape(-1)
    index = {layer: i for i, layer in enumerate(arch.moe.layers)}
    for layer, router in routers(gpt):
        ctx = RouteContext(valid=valid)
        if routes is not None:
            r = _layer_routes(routes, index[layer], length, tp_rank, split).long()
            ctx.reference = r
            ctx.replay = r if replay else None
        router.context = ctx


def route_stats(gpt, groups: list) -> dict[str, float]:
    """The MoE metrics since the last call (resets them), summed over `groups` (the ranks that saw other tokens
    of the same layers: data parallel, and TP under sequence parallelism). Collective over `groups`."""
    stages = routers(gpt)
    if not stages:
        return {}
    zeros = functools.partial(torch.zeros, dtype=torch.float64, device=stages[0][1].weight.device)
    load = torch.stack([r.stats.load if r.stats.load is not None else zeros(r.config.num_moe_experts)
                        for _, r in stages])
    aux = torch.stack([(r.stats.aux / max(r.stats.forwards, 1)) if r.stats.aux is not None else zeros(())
                       for _, r in stages])
    mism = torch.stack([r.stats.mismatch if r.stats.mismatch is not None else zeros(2) for _, r in stages])
    for _, r in stages:
        r.stats = RouteStats()
    flat = torch.cat([load.reshape(-1), aux, mism.reshape(-1)])
    for g in groups:
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(flat, group=g)
    n = load.numel()
    load, aux, mism = flat[:n].view_as(load), flat[n:n + len(stages)], flat[n + len(stages):].view(-1, 2)
    ranks = 1
    for g in groups:
        ranks *= dist.get_world_size(g) if g is not None and dist.is_initialized() else 1
    out = {"moe/aux_loss": float(aux.mean() / ranks),
           "moe/expert_load_max_over_mean": float((load.max(-1).values / load.mean(-1).clamp(min=1e-12)).mean())}
    if float(mism[:, 1].sum()) > 0:
        out["moe/router_mismatch_frac"] = float(mism[:, 0].sum() / mism[:, 1].sum())
    return out
