"""The 3D-HybridEngine: before each generation phase, reshards the actor from the training layout into the
generation layout and pushes the weights into the rollout engine; training continues on the untouched
training shards afterwards.

    he = HybridEngine(layout, Placement.layout(tp=2, pp=1, dp=2), HybridEngineConfig(generation_tp=1))
    stats = he.sync(local_params, rollout)      # every rank calls it; rollout.update_weights(stream)

`layout` is a `verl.models.layout.ModelLayout`; the seams build it (and the local params) for a model:
`hybrid_engine_for` / `megatron_local_params` (verl.models' megatron GPT) and `hybrid_engine_for_module` /
`module_local_params` (a Hugging Face torch module, whole on every rank or FSDP2-sharded). With `train_ranks`
and `gen_ranks` the two layouts live on different ranks of `group` (a rollout on its own ranks,
`hybrid_engine_across`): the training ranks call `sync(local_params, None)` and only send, the generation
ranks call `sync({}, rollout)` and only receive.

A failing engine (or a name it does not know) surfaces as VerlRuntimeError on EVERY rank: the failing rank
keeps draining the stream so the other ranks' point-to-point messages still pair up, then all ranks agree
on the failure. Training shards are only ever read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.hybrid_engine.executor import ExecutorStats, ReshardExecutor, agree
from verl.distributed.placement import Placement
from verl.hybrid_engine.planner import RANK_MAPPINGS, ReshardPlan, plan_reshard
from verl.hybrid_engine.targets import FORMATS
from verl.models.layout import ModelLayout

__all__ = ["HybridEngineConfig", "HybridEngine"]


@dataclass(kw_only=True, slots=True)
class HybridEngineConfig:
    """How the actor's weights reach the rollout engine."""

    generation_tp: int = 1
    """Tensor-parallel size of the generation layout (TP_g); DP_g = world / TP_g."""
    bucket_mb: float = 64.0
    """Per-rank bound on one bucket (targets received plus slices sent), in MiB."""
    weight_format: str = "hf"
    """"hf": HF-named q/k/v, gate/up tensors; "vllm": fused qkv_proj / gate_up_proj per TP_g shard."""
    engine_dtype: torch.dtype | None = None
    """The dtype the engine holds its weights in (None: the training tensors'); the sync casts into it."""
    delta: bool = False
    """Send per bucket only the elements whose engine-dtype value changed since the last sync (rollout.sync=delta;
    verl.hybrid_engine.delta); the engine then has to offer `weight_tensors()`."""
    verify_every: int = 0
    """delta: every N-th sync the receivers checksum all their weights against the senders' fresh ones (0: never)."""
    rank_mapping: str = "hybrid"
    """"hybrid": generation ranks that gather only inside their merged TP group; "contiguous": rank r is
    generation TP rank r % TP_g."""

    def __post_init__(self):
        if self.generation_tp < 1:
            raise VerlConfigError(f"generation_tp={self.generation_tp} must be >= 1")
        if self.bucket_mb <= 0:
            raise VerlConfigError(f"bucket_mb={self.bucket_mb} must be positive")
        if self.weight_format not in FORMATS:
            raise VerlConfigError(f"weight_format={self.weight_format!r}; choose one of {FORMATS}")
        if self.rank_mapping not in RANK_MAPPINGS:
            raise VerlConfigError(f"rank_mapping={self.rank_mapping!r}; choose one of {RANK_MAPPINGS}")


class _Tracked:
    """Wraps the stream so that what the consumer left unread can be drained after it fails."""

    def __init__(self, it: Iterator):
        self.it = it

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def drain(self) -> None:
        for _ in self.it:
            pass


class HybridEngine:
    """Plans once (metadata only), then moves weights on every `sync` / `stream`."""

    def __init__(self, layout: ModelLayout, training: Placement, config: HybridEngineConfig | None = None,
                 *, group=None, train_ranks: Sequence[int] | None = None, gen_ranks: Sequence[int] | None = None,
                 device: torch.device | None = None):
        self.config = config or HybridEngineConfig()
        self.group, self.device = group, device
        self.plan: ReshardPlan = plan_reshard(layout, training, self.config.generation_tp,
                                              fmt=self.config.weight_format,
                                              bucket_bytes=int(self.config.bucket_mb * (1 << 20)),
                                              mapping=self.config.rank_mapping, train_ranks=train_ranks,
                                              gen_ranks=gen_ranks)
        self.last_stats: ExecutorStats | None = None
        self.delta_state = None  # rollout.sync=delta: what this rank remembers between syncs (delta.DeltaState)

    def stream(self, local_params: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's generation weights as (name, tensor) pairs; every rank must drain its stream."""
        ex = ReshardExecutor(self.plan, local_params, group=self.group, device=self.device,
                             out_dtype=self.config.engine_dtype)
        self.last_stats = ex.stats
        return ex.stream()

    def sync(self, local_params: Mapping[str, torch.Tensor], rollout) -> ExecutorStats:
        """Pushes this rank's generation weights into `rollout` (anything with `update_weights(iterable)`; None
        on a rank that only sends)."""
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self._check_names(rollout, rank)
        stream = _Tracked(self.stream(local_params))
        error: BaseException | None = None
        try:
            if rollout is not None:
                rollout.update_weights(stream)
        except Exception as e:  # noqa: BLE001 - reported below, after every rank has finished its messages
            error = e
        try:
            stream.drain()
        except VerlRuntimeError:
            raise
        except Exception as e:  # noqa: BLE001
            raise VerlRuntimeError(f"resharding failed: {e}", rank=rank, cause=e) from e
        everyone_ok = agree(error is None, self.group)
        if error is not None:
            if isinstance(error, VerlRuntimeError):
                raise error
            raise VerlRuntimeError(f"the rollout engine failed while receiving weights: {type(error).__name__}: "
                                   f"{error}", rank=rank, cause=error) from error
        if not everyone_ok:
            raise VerlRuntimeError("another rank's rollout engine failed while receiving weights (see its error); "
                                   "this rank's engine may hold a partial update", rank=rank)
        return self.last_stats

    def sync_delta(self, local_params: Mapping[str, torch.Tensor], rollout):
        """rollout.sync=delta: writes only the changed elements into `rollout`'s weights in place (None on a rank
        that only sends); the first sync, and any sync after the engine's weights changed otherwise, is full.
        Returns the `verl.hybrid_engine.delta.DeltaStats` of this rank."""
        import uuid

        from verl.hybrid_engine.delta import DeltaExecutor, DeltaState
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self._check_names(rollout, rank)
        if self.delta_state is None:
            self.delta_state = DeltaState(token=uuid.uuid4().hex)
        dtype = self.config.engine_dtype
        if dtype is None:
            dtypes = {s.dtype for s in self.plan.specs.values()}
            if len(dtypes) != 1:
                raise VerlConfigError(f"delta sync of parameters in several dtypes {sorted(map(str, dtypes))}: set "
                                      f"the engine's dtype (rollout.dtype)")
            dtype = dtypes.pop()
        every, index = self.config.verify_every, self.delta_state.version + 1  # this sync's index (0: the first)
        verify = bool(every) and index > 0 and index % every == 0
        ex = DeltaExecutor(self.plan, local_params, self.delta_state, group=self.group, device=self.device,
                           engine_dtype=dtype, verify=verify)
        self.last_stats = ex.stats
        return ex.run(rollout)

    def _check_names(self, rollout, rank: int) -> None:
        """Fails on every rank, before any byte moves, when an engine does not know a name it would receive."""
        known = rollout.weight_names() if hasattr(rollout, "weight_names") else None
        unknown = []
        if known is not None:
            unknown = sorted({t.target.name for t in self.plan.targets_of(rank)} - set(known))
        if not agree(not unknown, self.group):
            if unknown:
                raise VerlRuntimeError(f"the rollout engine has no weight named {unknown[0]!r} ({len(unknown)} unknown "
                                       f"names); check HybridEngineConfig.weight_format (hf / vllm) and that the "
                                       f"engine's model matches the actor", rank=rank)
            raise VerlRuntimeError("another rank's rollout engine does not know some weight names (see its error); "
                                   "nothing was moved", rank=rank)
