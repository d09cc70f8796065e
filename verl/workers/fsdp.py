"""The FSDP2 training engine: any Hugging Face causal LM (or a `ValueModel` critic) sharded with
`torch.distributed.fsdp.fully_shard` — one FSDP unit per decoder layer, then the root — behind the same calls
as the plain-torch engine (`forward`, `train_step`, `aggregation`, `hybrid_engine`, ...), so the actor,
reference and critic workers are the same classes on every engine.

Chosen with `actor.engine=fsdp` (`actor.fsdp` / `critic.fsdp` configure it). The device mesh is built from
the role's data-parallel group (`Placement.dp`), never the world, so a role may own any subset of the ranks:
1-D (every parameter cut along dim 0 over all of them) or, with `shard_size` smaller than the group, 2-D HSDP
(replicas × shard groups). Gradients are reduce-scattered by FSDP itself; clipping takes the global norm over
the DTensor shards. Weights reach the rollout engine as dim-0 shards through the 3D-HybridEngine (each
generation rank gathers only the rows it needs; no full state dict per step). Checkpoints are the trainer's
DCP checkpoint of `module` + `optimizer` (sharded state dicts, `get_state_dict` / `set_state_dict`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from verl.config.ppo import FSDPConfig, OptimConfig
from verl.distributed import Placement, new_group
from verl.errors import VerlConfigError
from verl.workers.batch import RolloutBatch
from verl.workers.engine import ModuleEngine, build_optimizer, head_outputs, packed_head_outputs
from verl.workers.packing import PackedBatch

__all__ = ["FSDPEngine", "build_mesh", "decoder_layers"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _group_of(placement: Placement):
    if not dist.is_initialized():
        raise VerlConfigError("engine=fsdp needs torch.distributed initialised, even on one process (launch with "
                              "torchrun, or init_placement(..., process_group=True))")
    if placement.dp is not None:
        return placement.dp
    # a one-rank role in a larger job shards over its own group: the world's other ranks never build this engine
    return placement.group if placement.group is not None else dist.group.WORLD


def build_mesh(placement: Placement, cfg: FSDPConfig):
    """The role's device mesh over the ranks of its data-parallel group: 1-D ("shard",) or, when
    cfg.shard_size is a smaller divisor, 2-D ("replicate", "shard") with consecutive ranks sharing a shard."""
    from torch.distributed.device_mesh import DeviceMesh
    group = _group_of(placement)
    ranks = dist.get_process_group_ranks(group)
    replicas, size = cfg.mesh_shape(len(ranks))
    device_type = placement.device.type
    if replicas == 1:
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))
    mesh = torch.tensor(ranks).view(replicas, size)
    row, col = divmod(ranks.index(dist.get_rank()), size)
    # only the members of each sub-group create it, so a role over a subset of the world never waits on the rest
    shard = new_group(mesh[row].tolist(), use_local_synchronization=True)
    replicate = new_group(mesh[:, col].tolist(), use_local_synchronization=True)
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=mesh, mesh_dim_names=("replicate", "shard"))


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: modules whose class a Hugging Face model lists in
    `_no_split_modules` (its decoder layer), else the children of the longest ModuleList."""
    names = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    found = [m for m in module.modules() if m is not module and type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


class _Root(torch.nn.Module):
    """The root FSDP unit: the whole head computation runs inside its forward, so the root's parameters
    (embeddings, final norm, LM or value head) are gathered for it and their gradients reduce-scattered."""

    def __init__(self, model: torch.nn.Module, head: str):
        super().__init__()
        self.model, self.head = model, head

    def forward(self, input_ids, attention_mask, position_ids, responses, prompt_length: int, temperature: float,
                packed: PackedBatch | None = None, loss_head=None):
        out = (packed_head_outputs(self.model, self.head, packed, temperature, loss_head) if packed is not None else
               head_outputs(self.model, self.head, input_ids, attention_mask, position_ids, responses, prompt_length,
                            temperature, loss_head))
        # FSDP hooks backward onto the root's outputs; a slice (the values) would lose the hook to an in-place op
        return {k: v.clone() if v._base is not None else v for k, v in out.items()}


class FSDPEngine(ModuleEngine):
    """Owns a module sharded in place (pass a copy when the caller keeps using the original), and, unless
    frozen, its optimizer. `module` keeps the Hugging Face names; its parameters become DTensors."""

    @classmethod
    def from_role(cls, req) -> "FSDPEngine":
        """Shards a copy of the role's module in place (the policy stays whole for a colocated rollout)."""
        fsdp = req.cfg.critic.fsdp if req.role == "critic" else req.cfg.actor.fsdp
        engine = cls(req.module(share=False), req.optim, req.placement, fsdp, head=req.head,
                     total_steps=req.total_steps, cpu_offload=req.cpu_offload)
        engine.sync_view = req.sync_view
        return engine

    def __init__(self, module: torch.nn.Module, optim: OptimConfig | None, placement: Placement, cfg: FSDPConfig, *,
                 head: str = "lm", total_steps: int = 1, cpu_offload: bool = False):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        self.placement, self.head, self.optim_cfg, self.cfg = placement, head, optim, cfg
        self.hf_class = type(module)  # fully_shard swaps the class for an FSDP subclass; export rebuilds this one
        self.module = module.to(placement.device)
        self.mesh = build_mesh(placement, cfg)
        self._broadcast_parameters()
        if optim is None:
            self.module.requires_grad_(False)
            self.module.eval()
        kw = dict(mesh=self.mesh, reshard_after_forward=cfg.reshard_after_forward,
                  mp_policy=MixedPrecisionPolicy(param_dtype=_DTYPES[cfg.param_dtype],
                                                 reduce_dtype=_DTYPES[cfg.reduce_dtype]),
                  offload_policy=CPUOffloadPolicy(pin_memory=placement.device.type == "cuda")
                  if cpu_offload else OffloadPolicy())
        for layer in decoder_layers(self.module):
            fully_shard(layer, **kw)
        self.root = fully_shard(_Root(self.module, head), **kw)
        self.optimizer, self.scheduler = build_optimizer(self.module, optim, total_steps) if optim else (None, None)

    def _broadcast_parameters(self) -> None:
        """Every rank shards the same weights: the group's first rank's (before any rank keeps only its chunk)."""
        group = _group_of(self.placement)
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) > 1:
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=ranks[0], group=group)

    def _forward(self, mb: RolloutBatch, temperature: float, packed: PackedBatch | None = None,
                 loss_head=None) -> dict[str, torch.Tensor]:
        return self.root(mb.input_ids, mb.attention_mask, mb.position_ids, mb.responses, mb.prompt_length,
                         temperature, packed, loss_head)

    def _gradient_sync(self, last_micro_batch: bool) -> None:
        # earlier micro-batches accumulate unsharded local gradients; the last one reduce-scatters their sum once
        self.root.set_requires_gradient_sync(last_micro_batch)

    def _reduce_grads(self) -> None:
        """Nothing left to do: FSDP reduce-scattered (and, under HSDP, all-reduced) the mean in backward, so
        a rank's own non-finite gradient cannot be told from its peers' here (the loss still can)."""

    def onload(self, device: torch.device) -> None:
        """cpu_offload is FSDP's own CPUOffloadPolicy (shards stay on the CPU, each unit is gathered to the
        device for its forward / backward), so there is nothing to move around a node."""

    def offload(self) -> None:
        """See `onload`."""

    @property
    def shard_group(self):
        """The group each parameter is cut over (the whole role, or under HSDP this rank's shard group)."""
        return self.mesh.get_group("shard")

    def hybrid_engine(self, config):
        """The 3D-HybridEngine planned over this rank's shard group (which holds one whole copy; under HSDP
        every replica syncs its own rollout ranks), collective over that group."""
        from verl.hybrid_engine.module import hybrid_engine_for_module
        return hybrid_engine_for_module(self.module, config, group=self.mesh.get_group("shard"),
                                        params=self.sync_layout_params())

    def export_hf(self, path: Path, tokenizer=None) -> None:
        """Writes the model as a Hugging Face directory from the group's first rank (collective: every tensor
        is gathered from its shards one at a time, so no rank but the writer holds the whole model)."""
        from torch.distributed.tensor import DTensor

        from verl.utils.hf import export_hf
        group = _group_of(self.placement)
        writer = dist.get_rank() == dist.get_process_group_ranks(group)[0]
        full = {}
        for name, t in self.module.state_dict().items():
            t = t.full_tensor() if isinstance(t, DTensor) else t
            if writer:
                full[name] = t.detach().cpu()
        if writer:
            with torch.device("meta"):
                plain = self.hf_class._from_config(self.module.config)
            plain.load_state_dict(full, assign=True)
            plain.tie_weights()
            export_hf(plain, tokenizer, Path(path))
        dist.barrier(group)
