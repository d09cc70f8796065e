"""The seam between verl.models' megatron GPT and the hybrid engine: parameter metadata (every stage's, via
one all-gather of small dataclasses), this rank's local shards by canonical name, and the training layout.

    he = hybrid_engine_for(model, HybridEngineConfig(generation_tp=1))
    he.sync(megatron_local_params(model), rollout)          # every rank; rollout gets HF-named tensors
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from verl.errors import VerlConfigError
from verl.hybrid_engine.engine import HybridEngine, HybridEngineConfig
from verl.hybrid_engine.planner import TrainingLayout
from verl.hybrid_engine.specs import ParamSpec, Segment

__all__ = ["megatron_param_specs", "megatron_local_params", "megatron_training_layout", "hybrid_engine_for"]

_KINDS = {"qkv-fused": "qkv", "gate-up-fused": "gate_up", "column": "column", "row": "row", "vocab": "vocab",
          "replicated": "replicated", "value-head": "replicated"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _params_by_local_name(model) -> dict[str, torch.nn.Parameter]:
    return dict(model.gpt.named_parameters())


def _local_specs(model) -> list[ParamSpec]:
    from verl.models.layout import hf_tensor_shapes
    arch = model.arch
    shapes = hf_tensor_shapes(arch, value_head=model.options.value_head)
    if arch.tie_word_embeddings or model.options.value_head:
        shapes.setdefault("model.embed_tokens.weight", (arch.vocab_size, arch.hidden_size))
    params = _params_by_local_name(model)
    out = []
    for s in model.shard_specs():
        if not s.exported:
            continue
        kind = _KINDS.get(s.kind)
        if kind is None:
            raise VerlConfigError(f"{s.name}: layout kind {s.kind!r} is unknown to the hybrid engine")
        m = _LAYER.match(s.name)
        out.append(ParamSpec(
            name=s.name, hf_names=s.hf_names, hf_shapes=tuple(shapes[n] for n in s.hf_names), layout=kind,
            dim=s.partition_dim or 0, layer=int(m.group(1)) if m else None, stage=model.pg.pp_rank,
            dtype=params[s.local_name].dtype, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim, padded_rows=model.layout.padded_vocab_size if kind == "vocab" else 0,
            global_segments=tuple(Segment(g.hf_name, g.start, g.length) for g in s.segments)))
    return out


def megatron_param_specs(model, group=None) -> list[ParamSpec]:
    """ParamSpecs of every exported parameter of every pipeline stage (collective: one all_gather_object)."""
    local = _local_specs(model)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    merged: dict[str, ParamSpec] = {}
    for specs in everyone:
        for s in specs:
            merged.setdefault(s.name, s)
    return list(merged.values())


def megatron_local_params(model) -> dict[str, torch.Tensor]:
    """This rank's training shards by canonical (global-layer) name; the tensors are the live parameters."""
    params = _params_by_local_name(model)
    return {s.name: params[s.local_name].data for s in model.shard_specs() if s.exported}


def megatron_training_layout(model) -> TrainingLayout:
    """The TrainingLayout of the model's process groups (checks that the rank order is megatron's tp-dp-pp)."""
    pg = model.pg
    layout = TrainingLayout(tp=pg.tp_size, pp=pg.pp_size, dp=pg.dp_size)
    if dist.is_initialized():
        want = layout.rank(pg.tp_rank, pg.dp_rank, pg.pp_rank)
        if dist.get_rank() != want:
            raise VerlConfigError(f"rank {dist.get_rank()} has (tp, dp, pp) = ({pg.tp_rank}, {pg.dp_rank}, "
                                  f"{pg.pp_rank}) but the hybrid engine expects megatron's rank order tp-dp-pp "
                                  f"(rank {want}); build the process groups with order 'tp-cp-ep-dp-pp'")
    return layout


def hybrid_engine_for(model, config: HybridEngineConfig | None = None) -> HybridEngine:
    """A HybridEngine planned for `model` (collective)."""
    return HybridEngine(megatron_param_specs(model), megatron_training_layout(model), config)
