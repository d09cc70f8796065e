"""The rollout worker: owns a `verl.rollout` engine (hf / torch / vllm / sglang, chosen by `rollout.engine`),
turns prompt rows into a `RolloutBatch` of n sampled responses per prompt, and brings the actor's weights to
the engine before each generation phase.

Prompt rows become engine prompts in one place: the engine's `Tokenizer` (the model's own special-token rule,
its chat template for chat messages). Weight sync runs through the 3D-HybridEngine from the actor's local
shards to the generation layout (`rollout.tp`), bucketed and bit-exact; a torch / hf engine that generates with
the actor's own module needs no copy at all and says so (`perf/sync_shared`).

A rollout on its own ranks (rollout.ranks disjoint from actor.ranks) gets the weights over a `WeightLink`: one
plan over a group of both rank sets, the actor's ranks sending (the sending spread over its data-parallel
copies), the rollout's receiving its generation shards; `sync_rollout_weights` is the one call for both cases.
Under trainer.mode=async the link streams instead: the actor publishes each new version without waiting for
the rollout, a thread on each side moves it, and the rollout takes the newest it has received when it is ready
(between batches, or between tokens with rollout.partial).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from verl.distributed import Placement
from verl.engines import rollout_engine
from verl.distributed.sender import Sender
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout import RolloutConfig, RolloutEngine
from verl.workers.batch import RolloutBatch, batch_from_outputs

__all__ = ["RolloutWorker", "WeightLink", "WeightStream", "sync_rollout_weights"]


def _chunk(n: int, parts: int, index: int) -> slice:
    per = n // parts
    return slice(index * per, (index + 1) * per)


class RolloutWorker:
    """Generation for the PPO flow: `generate(rows)` and `sync_weights(actor)`.

    The generation layout is its own: `rollout.tp` ranks (consecutive in rank order) form one generation
    replica, and the step's prompts are split evenly over the world / rollout.tp replicas. When that differs
    from the training layout (e.g. megatron TP=2 trained, TP=1 generated: two generation replicas per training
    replica), the samples are exchanged afterwards so that every rank gets its training replica's batch.
    """

    def __init__(self, engine: RolloutEngine, cfg: RolloutConfig, *, max_prompt_length: int,
                 placement: Placement | None = None, agent=None):
        """`agent`: a `verl.agents.loop.AgentLoop`: every sample is then a multi-turn episode of its environment."""
        self.engine, self.cfg = engine, cfg
        self.agent = agent
        self._agent_metrics: dict[str, float] = {}
        self.max_prompt_length = max_prompt_length
        self.placement = placement or Placement()
        self._hybrid = None       # the 3D-HybridEngine, planned at the first sync (collective)
        self._engine_bytes = 0    # what each sync hands the engine on this rank (from the plan)
        self.link: WeightLink | None = None
        """Set when the rollout runs on its own ranks: where its weights come from."""
        self.stream: WeightStream | None = None
        """trainer.mode=async: the versions arriving over the link in the background."""

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, rows: list[dict]) -> list[list[int]]:
        """The rows' prompts (text or chat messages) as token ids, checked against data.max_prompt_length."""
        ids = [self.tokenizer.encode_prompt(r["prompt"]) for r in rows]
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        if len(ids[longest]) > self.max_prompt_length:
            raise VerlConfigError(f"prompt {str(rows[longest]['prompt'])[:60]!r} is {len(ids[longest])} tokens, "
                                  f"longer than data.max_prompt_length={self.max_prompt_length}; raise "
                                  f"data.max_prompt_length or shorten the prompts")
        return ids

    def rows_of_rank(self, count: int) -> slice:
        """Which of `count` rows given to `generate` come back in this rank's batch (the rest are dropped when
        `count` is not a multiple of the data-parallel size)."""
        return _chunk(count, self.placement.dp_size, self.placement.dp_rank)

    @torch.no_grad()
    def generate(self, rows: list[dict], n: int | None = None, greedy: bool = False,
                 seed: int | None = None, sampling: dict | None = None) -> RolloutBatch:
        """n samples per row of the step's prompts (`rows`: all of them, every rank the same list) for rollout.n
        (or `n`; greedy for ReMax's baseline), returned as this rank's training batch. `seed` seeds the samples
        by the row's place in `rows` (verl.rollout's per-sample streams), so the split over generation replicas
        never changes what is sampled; None draws from the global RNG. `sampling` overrides SamplingParams
        fields (validation's temperature, top_p, top_k)."""
        n = self.cfg.n if n is None else n
        p, tp_g = self.placement, self.cfg.tp
        mine = self.rows_of_rank(len(rows))
        gen = _chunk(len(rows), p.world_size // tp_g, p.rank // tp_g)
        params = self.cfg.sampling(n=n, greedy=greedy)
        for key, value in (sampling or {}).items():
            setattr(params, key, value)
        params.seed = None if seed is None else seed + gen.start * n
        if self.engine.released:
            self.engine.resume()
        if self.agent is not None:
            outs, self._agent_metrics = self.agent.rollout(self.engine, rows[gen], params)
        else:
            outs = self.engine.generate(self.encode(rows[gen]), params)
        if gen != mine:
            outs = self._exchange(outs, gen, mine, n)
        return batch_from_outputs(outs, rows[mine], n, self.cfg.max_new_tokens, self.tokenizer.pad_token_id)

    def take_metrics(self) -> dict[str, float]:
        """The engine's own metrics since the last call (torch: padded share) and the last rollout's agent metrics
        (turns, tool calls, tool errors and latency, append-only check)."""
        out = {**getattr(self.engine, "take_metrics", dict)(), **self._agent_metrics}
        self._agent_metrics = {}
        return out

    def close(self) -> None:
        """Stops the agent loop's tool thread and shuts the engine down."""
        if self.agent is not None:
            self.agent.close()
        self.engine.close()

    def _exchange(self, outs: list, gen: slice, mine: slice, n: int) -> list:
        """Every generation replica's samples to every rank (one object all-gather); this rank keeps its
        training replica's rows."""
        everyone: list = [None] * self.placement.world_size
        first_of_replica = self.placement.rank % self.cfg.tp == 0
        dist.all_gather_object(everyone, (gen.start, outs) if first_of_replica else None,
                               group=self.placement.group)
        by_row = {}
        for item in everyone:
            if item is not None:
                start, chunk = item
                for k, o in enumerate(chunk):
                    by_row[(start + k // n, k % n)] = o
        return [by_row[(i, j)] for i in range(mine.start, mine.stop) for j in range(n)]

    # -- memory (rollout.cpu_offload: the runtime calls these around the generation nodes) ------------------
    def onload(self, device: torch.device) -> None:
        if self.engine.released:
            self.engine.resume()

    def offload(self) -> None:
        self.engine.release()

    # -- weights ----------------------------------------------------------------------------------------------
    @property
    def weight_format(self) -> str:
        """What the engine is handed: full HF tensors (its own loaders fuse and shard them), or, for a
        tensor-parallel vLLM / SGLang engine, each rank's fused shard exactly as its parameters hold it (their
        loaders would expect full tensors and shard them again)."""
        return "vllm" if self.cfg.tp > 1 and "vllm" in rollout_engine(self.cfg.engine).weight_formats else "hf"

    def shares_module(self, actor) -> bool:
        """The engine generates with the actor's own module (torch / hf engine beside a torch actor)."""
        return getattr(self.engine, "model", None) is not None and \
            getattr(actor.engine, "module", None) is self.engine.model

    def hybrid_config(self):
        """The generation side of the weight sync: rollout.tp, the engine's format and dtype, rollout.sync_bucket_mb,
        rollout.sync (full or delta)."""
        from verl.hybrid_engine import HybridEngineConfig
        dtype = None if self.cfg.dtype == "auto" else getattr(torch, self.cfg.dtype)
        return HybridEngineConfig(generation_tp=self.cfg.tp, bucket_mb=self.cfg.sync_bucket_mb,
                                  weight_format=self.weight_format, rank_mapping="contiguous", engine_dtype=dtype,
                                  delta=self.cfg.sync == "delta", verify_every=self.cfg.delta_verify_every)

    def sync_weights(self, actor) -> dict[str, float]:
        """Moves the actor's current weights into the engine; returns perf/sync_* metrics of this transfer.
        `actor` is None on a rollout on its own ranks: the weights arrive over `self.link`."""
        if actor is None:
            if self.link is None:
                raise VerlConfigError("this rollout has no actor on its ranks and no WeightLink to receive the "
                                      "weights over; the trainer sets one when rollout.ranks differ from actor.ranks")
            if self.engine.released:
                self.engine.resume()
            return self.link.sync(None, self)
        if self.shares_module(actor):
            return {"perf/sync_s": 0.0, "perf/sync_bytes": 0.0, "perf/sync_comm_bytes": 0.0,
                    "perf/sync_peak_bytes": 0.0,
                    "perf/sync_shared": 1.0}
        if self.engine.released:
            self.engine.resume()
        if self._hybrid is None:
            self._hybrid = actor.engine.hybrid_engine(self.hybrid_config())
            # the plan numbers the ranks of the engine's group (the role's ranks, or an HSDP shard group)
            rank = dist.get_rank(self._hybrid.group) if dist.is_initialized() else 0
            self._engine_bytes = target_bytes(self._hybrid, rank)
        baseline = {}
        if self.cfg.compare_full_gather:
            baseline = self._full_sync(actor) if self.cfg.sync == "delta" else self._full_gather(actor)
        t0 = time.perf_counter()
        m = run_sync(self._hybrid, actor.engine.local_params(), self.engine, self._engine_bytes)
        return {"perf/sync_s": time.perf_counter() - t0, **m, **baseline}

    def _full_sync(self, actor) -> dict[str, float]:
        """rollout.sync=delta with compare_full_gather: the same weights moved the full way through the same plan
        (into a sink that copies each tensor as an engine would), timed beside the delta."""
        t0 = time.perf_counter()
        sink = _Staged(None)
        self._hybrid.sync(actor.engine.local_params(), sink)
        return {"perf/full_sync_s": time.perf_counter() - t0,
                "perf/full_sync_bytes": float(sum(t.nbytes for _, t in sink.tensors))}

    def _full_gather(self, actor) -> dict[str, float]:
        """The old transfer, timed (rollout.compare_full_gather): gather everything, broadcast, load whole."""
        t0 = time.perf_counter()
        weights = actor.engine.full_gather_weights()
        self.engine.update_weights(weights.items())
        return {"perf/full_gather_s": time.perf_counter() - t0,
                "perf/full_gather_bytes": float(sum(t.nbytes for t in weights.values()))}


class WeightLink:
    """The actor's weights to a rollout on its own ranks, through the 3D-HybridEngine over `group` (exactly the
    actor's and the rollout's ranks, disjoint). Planned at the first `sync` (collective over `group`: the layout
    comes from the actor's first rank, the generation settings from the rollout's first), then each sync sends
    the actor's training layout (whole copies or FSDP2 shards) to the generation layout (rollout.tp over the
    rollout's ranks) in buckets of rollout.sync_bucket_mb."""

    def __init__(self, group, actor_ranks: tuple[int, ...], rollout_ranks: tuple[int, ...]):
        self.group, self.actor_ranks, self.rollout_ranks = group, tuple(actor_ranks), tuple(rollout_ranks)
        self._hybrid = None
        self._engine_bytes = 0  # what each sync hands this rank's engine (from the plan; 0 on the actor's ranks)

    def _plan(self, actor, rollout: RolloutWorker | None):
        from verl.hybrid_engine.module import hybrid_engine_across
        from verl.workers.engine import ModuleEngine
        if actor is not None and not isinstance(actor.engine, ModuleEngine):
            raise VerlConfigError(f"a rollout on its own ranks receives from torch or fsdp actors; this actor runs on "
                                  f"{type(actor.engine).__name__}: set rollout.ranks to actor.ranks")
        return hybrid_engine_across(
            None if actor is None else actor.engine.module, None if rollout is None else rollout.hybrid_config(),
            group=self.group, actor_ranks=self.actor_ranks, rollout_ranks=self.rollout_ranks,
            shard_group=None if actor is None else actor.engine.shard_group,
            device=None if rollout is None else rollout.placement.device,
            params=None if actor is None else actor.engine.sync_layout_params())

    def sync(self, actor, rollout: RolloutWorker | None) -> dict[str, float]:
        """Every rank of the group calls it: the actor's ranks with (actor, None), the rollout's with (None,
        rollout). Returns this rank's perf/sync_* metrics (senders report sent bytes, receivers received)."""
        t0 = time.perf_counter()
        if self._hybrid is None:
            self._hybrid = self._plan(actor, rollout)
            if rollout is not None:
                self._engine_bytes = target_bytes(self._hybrid, dist.get_rank(self.group))
        local = {} if actor is None else actor.engine.local_params()
        m = run_sync(self._hybrid, local, None if rollout is None else rollout.engine, self._engine_bytes)
        stats = self._hybrid.last_stats
        m["perf/sync_s"] = time.perf_counter() - t0
        if rollout is None:
            return {**m, "perf/sync_sent_bytes": float(stats.bytes_sent)}
        return {**m, "perf/sync_received_bytes": float(stats.bytes_received)}


def target_bytes(hybrid, rank: int) -> int:
    """Bytes a full sync hands the engine on `rank` (its targets, in the engine's dtype when it casts)."""
    dtype = hybrid.config.engine_dtype
    es = None if dtype is None else torch.empty((), dtype=dtype).element_size()
    return sum(t.nbytes if es is None else t.nbytes // t.element_size * es for t in hybrid.plan.targets_of(rank))


def run_sync(hybrid, local_params: dict, engine, engine_bytes: int) -> dict[str, float]:
    """One sync through `hybrid` (full, or delta under rollout.sync=delta) into `engine` (None on a rank that only
    sends); its perf/sync_* metrics: bytes between ranks, and where an engine receives the bytes handed to it
    (for a delta also the changed share, the full sync's bytes and the counts of forced full syncs, resent
    buckets and failed checks; for a full sync the engine's swap time)."""
    m = {"perf/sync_shared": 0.0}
    if hybrid.config.delta:
        d = hybrid.sync_delta(local_params, engine)
        m["perf/sync_full"] = float(d.full)
        if engine is not None:
            m.update({"perf/sync_bytes": float(d.engine_bytes), "perf/sync_full_bytes": float(d.full_bytes),
                      "perf/sync_changed_frac": d.changed / d.elements if d.elements else 0.0,
                      "perf/sync_forced_full": float(d.forced_full),
                      "perf/sync_bucket_resyncs": float(d.bucket_resyncs),
                      "perf/sync_verify_failures": float(d.verify_failures)})
    else:
        hybrid.sync(local_params, engine)
        if engine is not None:
            m["perf/sync_bytes"] = float(engine_bytes)
            if hasattr(engine, "last_swap_s"):
                m["perf/sync_swap_s"] = engine.last_swap_s
    stats = hybrid.last_stats
    m.update({"perf/sync_comm_bytes": float(stats.bytes_sent + stats.bytes_received),
              "perf/sync_peak_bytes": float(stats.peak_bytes)})
    return m


class _Staged:
    """One received version, held for the rollout's main thread (the engine may be generating meanwhile): the
    receiving side of a hybrid-engine sync, copying each tensor out of the bucket it arrives in."""

    def __init__(self, names: set[str] | None):
        self.names = names
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def weight_names(self) -> set[str] | None:
        return self.names

    def update_weights(self, named_tensors) -> int:
        self.tensors = [(name, t.clone()) for name, t in named_tensors]
        return len(self.tensors)


class WeightStream:
    """trainer.mode=async: every version the actor publishes reaches the rollout's ranks in the background.

    Over a `WeightLink` already planned (the first, blocking sync): on the actor's ranks `publish` snapshots the
    local weights and hands them to a sender thread (it waits only while the previous version is still being
    sent); on the rollout's ranks a receiver thread stages every version as it arrives (only the newest is
    kept: at most two copies wait beside the engine's weights), and the generating thread `take`s the newest
    staged one into the engine when it can (between batches; between tokens as the
    torch engine's pause hook under rollout.partial) or `wait_for`s a minimum version (the staleness bound).
    Each version is announced by a one-int broadcast from the actor's first rank (-1 ends the stream), then moved
    like a sync. Each rollout rank takes versions on its own, so a generation replica must be one rank
    (rollout.tp=1). A failure on one side surfaces on the other at its next publish / take, or when the link's
    group times out. `pinned` (trainer.async_versions=pinned): every version received stays staged until the
    generating thread asks for it by number (`wait_for(..., exact=True)`), so each batch gets exactly the version
    the schedule names."""

    def __init__(self, link: WeightLink, actor, rollout: RolloutWorker | None, version: int, pinned: bool = False):
        self.link, self.version, self.pinned = link, version, pinned
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._staged: dict[int, list] = {}
        self._sender: Sender | None = None
        self._thread: threading.Thread | None = None
        if rollout is None:  # one version waits while the one before it is sent
            self._sender = Sender(self._send, 1, "verl-weight-stream", self._failed)
        else:
            self._thread = threading.Thread(target=self._receive_loop, args=(rollout,), name="verl-weight-stream",
                                            daemon=True)
            self._thread.start()

    def _announce(self, version: int) -> int:
        header = torch.tensor([version], dtype=torch.int64, device=self._device())
        dist.broadcast(header, src=self.link.actor_ranks[0], group=self.link.group)
        return int(header.item())

    def _device(self) -> torch.device:
        from verl.distributed.placement import comm_device
        return torch.device("cpu") if dist.get_backend(self.link.group) == "gloo" else comm_device()

    def _send(self, item: tuple[int, dict | None]) -> None:
        version, params = item
        self._announce(version)
        if version >= 0:  # -1 ends the stream
            self.link._hybrid.sync(params, None)

    def _receive_loop(self, rollout: RolloutWorker) -> None:
        names = rollout.engine.weight_names()
        try:
            while True:
                version = self._announce(0)
                if version < 0:
                    return
                staged = _Staged(names)
                self.link._hybrid.sync({}, staged)
                with self._cond:  # `take` loads only the newest: an older one not yet taken is dropped now
                    if self.pinned:  # unless the generating thread will ask for it by number
                        self._staged[version] = staged.tensors
                    else:
                        self._staged = {version: staged.tensors}
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised by the next take in the main thread
            self._error = exc
            with self._cond:
                self._cond.notify_all()

    def _failed(self, exc: BaseException) -> VerlRuntimeError:
        return VerlRuntimeError(f"the weight stream between actor ranks {list(self.link.actor_ranks)} and rollout "
                                f"ranks {list(self.link.rollout_ranks)} failed: {type(exc).__name__}: {exc}",
                                rank=dist.get_rank(), cause=exc)

    def _check(self) -> None:
        if self._error is not None:
            raise self._failed(self._error)

    # -- the actor's side ---------------------------------------------------------------------------------------
    def publish(self, actor, version: int) -> dict[str, float]:
        """Hands version `version` of the actor's weights to the sender; returns perf/publish_* metrics."""
        t0 = time.perf_counter()
        params = {k: v.detach().clone() for k, v in actor.engine.local_params().items()}
        copied = time.perf_counter()
        self._sender.hand((version, params))
        self.version = version
        return {"perf/publish_s": time.perf_counter() - t0, "perf/publish_wait_s": time.perf_counter() - copied,
                "perf/publish_bytes": float(sum(t.nbytes for t in params.values()))}

    # -- the rollout's side -------------------------------------------------------------------------------------
    def take(self, rollout: RolloutWorker, version: int | None = None) -> int:
        """Loads the newest version received since the last take into the engine (older ones are skipped), or
        staged version `version` itself (pinned: newer ones stay staged); returns the version the engine now
        holds. Never waits."""
        with self._cond:
            want = max(self._staged, default=-1) if version is None else version
            tensors = self._staged.pop(want) if want > self.version and want in self._staged else None
            self._staged = {v: t for v, t in self._staged.items() if v > want}
        if tensors is not None:
            if rollout.engine.released:
                rollout.engine.resume()
            rollout.engine.update_weights(iter(tensors))
            self.version = want
        self._check()
        return self.version

    def wait_for(self, rollout: RolloutWorker, version: int, timeout_s: float, exact: bool = False) -> float:
        """Takes the newest version, first waiting (at most `timeout_s`) until one >= `version` has arrived
        (`exact`: takes version `version` itself, newer ones staying staged; none when the engine holds it or a
        newer one already); returns the seconds waited."""
        t0 = time.perf_counter()
        if exact and version <= self.version:
            self._check()
            return 0.0
        with self._cond:
            while max(self._staged, default=self.version) < version and self._error is None \
                    and self._thread.is_alive():
                if time.perf_counter() - t0 > timeout_s:
                    raise VerlRuntimeError(f"the rollout waited {timeout_s:g} s for weight version {version} (it "
                                           f"holds {self.version}); the actor's ranks stopped publishing",
                                           rank=dist.get_rank())
                self._cond.wait(0.2)
        self.take(rollout, version if exact else None)
        if self.version < version:
            self._check()
            raise VerlRuntimeError(f"the weight stream ended at version {self.version} while the rollout needed "
                                   f"{version}", rank=dist.get_rank())
        return time.perf_counter() - t0

    def close(self, rollout: RolloutWorker | None, timeout_s: float) -> None:
        """Ends the stream: the actor's side sends the end marker after its last version; the rollout's side
        waits for it and takes the last version, so both engines end equal."""
        unfinished = VerlRuntimeError(f"the weight stream did not end within {timeout_s:g} s", rank=dist.get_rank())
        if self._sender is not None:
            self._sender.finish(timeout_s, unfinished, (-1, None))  # -1: the receivers' end marker
            return
        self._thread.join(timeout_s)
        self._check()
        if self._thread.is_alive():
            raise unfinished
        self.take(rollout)
        self._check()


def sync_rollout_weights(actor, rollout: RolloutWorker | None) -> dict[str, float]:
    """The actor's current weights into the rollout engine, on every rank that holds either: in place where both
    share the ranks, else sent over the rollout's `WeightLink` (a rank then holds one side, the other is None)."""
    if rollout is not None:
        return rollout.sync_weights(actor)
    if actor is None or actor.weight_link is None:
        raise VerlConfigError("sync_rollout_weights needs the actor or the rollout on this rank, and an actor "
                              "without its rollout needs a WeightLink (the trainer sets one when rollout.ranks differ)")
    return actor.weight_link.sync(actor, None)
