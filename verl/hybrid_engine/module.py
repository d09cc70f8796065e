"""The seam between a Hugging Face torch module trained data-parallel and the hybrid engine.

    he = hybrid_engine_for_module(model, HybridEngineConfig(generation_tp=1, weight_format="vllm"))
    he.sync(module_local_params(model), rollout)             # every rank of `group`

Two training layouts, both Placement.layout(tp=1, pp=1, dp=world): plain data parallelism (every rank holds
every parameter whole — a single process, or DistributedDataParallel), where every target is built from
the rank's own copy and nothing moves; and FSDP2 (`torch.distributed.fsdp.fully_shard` on a 1-D mesh
over the group, or HSDP's 2-D mesh with the group being this rank's shard group), where rank k holds dim-0
chunk k of every parameter and each generation rank gathers only the rows its targets need. Parameter
names are the module's HF names; a tied `lm_head.weight` is the embedding itself and not a separate target
(vLLM and the torch engine share it too).

A rollout on its own ranks (`hybrid_engine_across`): the same training layouts on the actor's ranks, the
generation layout on the rollout's, one plan over a group spanning both. Only the actor's ranks hold the
module and only the rollout's know the generation settings, so each side's half travels in one object
all-gather before planning.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from verl.errors import VerlConfigError
from verl.hybrid_engine.engine import HybridEngine, HybridEngineConfig
from verl.distributed.placement import Placement
from verl.models.layout import ModelLayout, hf_model_layout

__all__ = ["module_layout", "module_local_params", "hybrid_engine_for_module", "hybrid_engine_across"]


def _bare(module: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    return module.module if isinstance(module, DistributedDataParallel) else module


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _shard_ranks(p) -> list[int] | None:
    """The ranks a DTensor is cut over along dim 0 — FSDP2's Shard(0) on a 1-D mesh, or HSDP's
    (Replicate, Shard(0)) on a 2-D one, this rank's shard group — or None for any other placement."""
    from torch.distributed.tensor import Replicate, Shard
    placements, mesh = tuple(p.placements), p.device_mesh
    if mesh.ndim == 1 and placements == (Shard(0),):
        return mesh.mesh.tolist()
    if mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
        return dist.get_process_group_ranks(mesh.get_group(1))
    return None


def _fsdp_shards(params: dict[str, torch.Tensor], group) -> int:
    """1 for whole parameters; the shard-group size for FSDP2 dim-0 shards over exactly `group`, in its rank
    order (under HSDP `group` is this rank's shard group: every replica holds one whole copy)."""
    sharded = [n for n, p in params.items() if _is_dtensor(p)]
    if not sharded:
        return 1
    if len(sharded) != len(params):
        whole = sorted(set(params) - set(sharded))
        raise VerlConfigError(f"{whole[:3]} are not sharded while {sharded[:3]} are (FSDP2); the hybrid engine "
                              f"needs every parameter whole or every parameter fully_shard-ed on one mesh")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    for n in sharded:
        p = params[n]
        if _shard_ranks(p) != ranks:
            raise VerlConfigError(f"{n} is a DTensor with placements {tuple(p.placements)} on mesh "
                                  f"{p.device_mesh.mesh.tolist()}; the hybrid engine serves FSDP2's Shard(0) (or "
                                  f"HSDP's Replicate, Shard(0)) cut over the ranks {ranks} of its group")
    return len(ranks)


def module_layout(module: torch.nn.Module, group=None, params: dict[str, torch.Tensor] | None = None) -> ModelLayout:
    """The ModelLayout of `module` (metadata only, no communication); `params`: the tensors the sync moves by
    the names the engine receives (a LoRA view, verl.models.lora.sync_tensors(..., local=False)), default all."""
    bare = _bare(module)
    params = dict(bare.named_parameters()) if params is None else dict(params)
    shards = _fsdp_shards(params, group) if dist.is_initialized() else 1
    config = getattr(bare, "config", None)
    return hf_model_layout(params, config, shards=shards,
                           architecture=None if config is not None else type(bare).__name__)


def module_local_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's training tensors by HF name: the live parameters, or their FSDP2 local chunks (views)."""
    out = {}
    for name, p in _bare(module).named_parameters():
        t = p.detach()
        out[name] = t.to_local() if _is_dtensor(t) else t
    return out


def _fingerprint(layout: ModelLayout) -> str:
    """What every rank of a plan must agree on: the parameters' names, shapes, dtypes and cut dims."""
    text = repr([(s.name, s.global_shape, str(s.dtype), s.dim) for s in layout.params])
    return hashlib.sha256(text.encode()).hexdigest()


def _same_everywhere(layout: ModelLayout, group) -> None:
    """Every rank must plan the same model, or the point-to-point messages would not pair up."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = _fingerprint(layout)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    odd = [r for r, h in enumerate(everyone) if h != everyone[0]]
    if odd:
        raise VerlConfigError(f"ranks {odd} hold a different model (parameter names, shapes or dtypes) than rank 0; "
                              f"every rank of the group must hold the same actor")


def hybrid_engine_for_module(module: torch.nn.Module, config: HybridEngineConfig | None = None,
                             group=None, params: dict[str, torch.Tensor] | None = None) -> HybridEngine:
    """A HybridEngine planned for a Hugging Face module trained data-parallel over `group` (collective);
    `params` as in `module_layout`."""
    layout = module_layout(module, group, params)
    _same_everywhere(layout, group)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    return HybridEngine(layout, Placement.layout(tp=1, pp=1, dp=world), config, group=group)


def hybrid_engine_across(module: torch.nn.Module | None, config: HybridEngineConfig | None, *, group,
                         actor_ranks: tuple[int, ...], rollout_ranks: tuple[int, ...], shard_group=None,
                         device: torch.device | None = None,
                         params: dict[str, torch.Tensor] | None = None) -> HybridEngine:
    """A HybridEngine from a module trained data-parallel on `actor_ranks` (whole copies, or FSDP2 dim-0 shards
    over `shard_group`, which must span all of them) to a generation layout on the disjoint `rollout_ranks`
    (world ranks). Collective over `group`, a process group over exactly both sets. `module` is given on the
    actor's ranks (None elsewhere), `config` (the generation settings) on the rollout's; `device` is where a
    rollout rank receives."""
    members = dist.get_process_group_ranks(group)
    if sorted(members) != sorted(set(actor_ranks) | set(rollout_ranks)) or set(actor_ranks) & set(rollout_ranks):
        raise VerlConfigError(f"the weight-sync group spans ranks {members}; it must be exactly the disjoint union "
                              f"of actor ranks {list(actor_ranks)} and rollout ranks {list(rollout_ranks)}")
    me = dist.get_rank()
    layout = module_layout(module, shard_group, params) if me in actor_ranks else None
    mine = (layout if me == actor_ranks[0] else None, None if layout is None else _fingerprint(layout),
            config if me == rollout_ranks[0] else None)
    everyone: list = [None] * len(members)
    dist.all_gather_object(everyone, mine, group=group)
    by_rank = dict(zip(members, everyone))
    layout, config = by_rank[actor_ranks[0]][0], by_rank[rollout_ranks[0]][2]
    odd = [r for r in actor_ranks if by_rank[r][1] != by_rank[actor_ranks[0]][1]]
    if odd:
        raise VerlConfigError(f"actor ranks {odd} hold a different model (parameter names, shapes or dtypes) than "
                              f"actor rank {actor_ranks[0]}; every actor rank must hold the same actor")
    shards = {s.parts for s in layout.params if s.dim is not None}
    if shards and shards != {len(actor_ranks)}:
        raise VerlConfigError(f"the actor's parameters are sharded over {sorted(shards)} ranks but the actor runs on "
                              f"{len(actor_ranks)}; a rollout on its own ranks needs every parameter whole or "
                              f"sharded over all actor ranks (fsdp.shard_size=-1, no HSDP)")
    return HybridEngine(layout, Placement.layout(tp=1, pp=1, dp=len(actor_ranks)), config, group=group,
                        train_ranks=[dist.get_group_rank(group, r) for r in actor_ranks],
                        gen_ranks=[dist.get_group_rank(group, r) for r in rollout_ranks], device=device)
