"""The seam between verl.models' megatron GPT and the hybrid engine: the model's `ModelLayout` (every stage's
ShardSpecs, via one all-gather of small dataclasses), this rank's local shards by canonical name, and the
training layout.

    he = hybrid_engine_for(model, HybridEngineConfig(generation_tp=1))
    he.sync(megatron_local_params(model), rollout)          # every rank; rollout gets HF-named tensors
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.errors import VerlConfigError
from verl.hybrid_engine.engine import HybridEngine, HybridEngineConfig
from verl.distributed.placement import Placement
from verl.models.layout import ModelLayout, ShardSpec, megatron_model_layout

__all__ = ["megatron_layout", "megatron_local_params", "megatron_training_layout", "hybrid_engine_for"]


def _exported(model) -> list[ShardSpec]:
    return [s for s in model.shard_specs() if s.exported]


def megatron_layout(model, group=None) -> ModelLayout:
    """The ModelLayout of every pipeline stage of `model` (collective: one all_gather_object)."""
    specs = _exported(model)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, specs, group=group)
        merged: dict[str, ShardSpec] = {}
        for rank_specs in everyone:
            for s in rank_specs:
                merged.setdefault(s.name, s)
        specs = list(merged.values())
    return megatron_model_layout(model.arch, model.layout, params=specs, value_head=model.options.value_head)


def megatron_local_params(model) -> dict[str, torch.Tensor]:
    """This rank's training shards by canonical (global-layer) name; the tensors are the live parameters."""
    params = dict(model.gpt.named_parameters())
    return {s.name: params[s.local_name].data for s in _exported(model)}


def megatron_training_layout(model) -> Placement:
    """The Placement of the model's process groups (checks that the rank order is megatron's tp-dp-pp)."""
    pg = model.pg
    layout = Placement.layout(tp=pg.tp_size, pp=pg.pp_size, dp=pg.dp_size, ep=pg.ep_size, etp=pg.etp_size)
    if dist.is_initialized():
        want = layout.rank_of(pg.tp_rank, pg.dp_rank, pg.pp_rank)
        if dist.get_rank() != want:
            raise VerlConfigError(f"rank {dist.get_rank()} has (tp, dp, pp) = ({pg.tp_rank}, {pg.dp_rank}, "
                                  f"{pg.pp_rank}) but the hybrid engine expects megatron's rank order tp-dp-pp "
                                  f"(rank {want}); build the process groups with order 'tp-cp-ep-dp-pp'")
    return layout


def hybrid_engine_for(model, config: HybridEngineConfig | None = None) -> HybridEngine:
    """A HybridEngine planned for `model` (collective)."""
    return HybridEngine(megatron_layout(model), megatron_training_layout(model), config)
