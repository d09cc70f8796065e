"""The reshard planner: a pure function from parameter metadata and two layouts to "which rank sends which
slice to which rank". No tensors, no process group: it runs (and is tested) on one process.

Training layout TP × PP × DP (megatron-core's default rank order tp-dp-pp: rank = t + TP·(d + DP·p));
generation layout TP_g × DP_g over the same world, no pipeline. With the default `hybrid` rank mapping
(HybridFlow's), generation ranks are assigned so that a rank's own training shard is part of what it
needs: for TP_g = TP/k the k training TP ranks t = k·j … k·j+k-1 all become generation TP rank j (as k
distinct generation DP replicas), so each rank gathers only inside its group of k and TP_g = TP moves
nothing at all. Pipeline stages other than a rank's own send it their layers point to point.

A source among equal replicas (DP copies, or all TP ranks for replicated tensors) is chosen as the rank
itself when it holds the data, else a replica in the rank's own training DP group (same data-parallel
index: the merged TP group), else the least loaded one, so that senders share the work.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from verl.errors import VerlConfigError
from verl.hybrid_engine.specs import FORMATS, ParamSpec, Target, generation_targets, training_segments

__all__ = ["TrainingLayout", "Piece", "TargetPlan", "Bucket", "ReshardPlan", "plan_reshard", "generation_coords",
           "RANK_MAPPINGS"]

RANK_MAPPINGS = ("hybrid", "contiguous")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingLayout:
    """Megatron's training layout over the world (rank order tp-dp-pp, megatron-core's default)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    dp: int = 1
    """Data-parallel size."""

    def __post_init__(self):
        for k in ("tp", "pp", "dp"):
            if getattr(self, k) < 1:
                raise VerlConfigError(f"TrainingLayout.{k}={getattr(self, k)} must be >= 1")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, t: int, d: int, p: int) -> int:
        return t + self.tp * (d + self.dp * p)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp index, dp index, pp stage) of `rank`."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)


def generation_coords(train: TrainingLayout, tp_g: int, mapping: str = "hybrid") -> list[tuple[int, int]]:
    """(generation TP index, generation DP index) of every rank."""
    world = train.world
    if tp_g < 1 or world % tp_g:
        raise VerlConfigError(f"generation TP={tp_g} must divide the world size {world} (TP×PP×DP = "
                              f"{train.tp}×{train.pp}×{train.dp})")
    if mapping not in RANK_MAPPINGS:
        raise VerlConfigError(f"unknown rank mapping {mapping!r}; choose one of {RANK_MAPPINGS}")
    if mapping == "contiguous":
        return [(r % tp_g, r // tp_g) for r in range(world)]
    out = []
    for r in range(world):
        t, d, p = train.coords(r)
        j = d + train.dp * p  # index of the rank's training TP group
        if train.tp % tp_g == 0:
            k = train.tp // tp_g
            out.append((t // k, t % k + k * j))
        elif tp_g % train.tp == 0:
            m = tp_g // train.tp
            out.append((t + train.tp * (j % m), j // m))
        else:
            raise VerlConfigError(f"generation TP={tp_g} must divide training TP={train.tp} or be a multiple of it "
                                  f"for the hybrid mapping; use mapping='contiguous' for other sizes")
    return out


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows [src_offset, +length) of the source rank's local shard → rows [dst_offset, +length) of a target."""

    src_rank: int
    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """One tensor a generation rank receives, and the pieces (in target order) that build it."""

    rank: int
    param: str
    target: Target
    pieces: tuple[Piece, ...]
    element_size: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.target.shape) * self.element_size

    def piece_nbytes(self, piece: Piece) -> int:
        return self.nbytes // self.target.shape[self.target.dim] * piece.length


@dataclass(slots=True)
class Bucket:
    """A run of consecutive parameters (in layer order) whose transfers happen together."""

    index: int
    params: list[str] = field(default_factory=list)
    targets: list[TargetPlan] = field(default_factory=list)


@dataclass(slots=True)
class ReshardPlan:
    """The whole plan: identical on every rank, so sends and receives pair up without negotiation."""

    train: TrainingLayout
    tp_g: int
    fmt: str
    coords: list[tuple[int, int]]
    specs: dict[str, ParamSpec]
    buckets: list[Bucket]
    bucket_bytes: int

    @property
    def world(self) -> int:
        return self.train.world

    def targets_of(self, rank: int) -> list[TargetPlan]:
        return [t for b in self.buckets for t in b.targets if t.rank == rank]

    def local_params(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Megatron name → local shard shape of every parameter `rank` holds in the training layout."""
        t, _, p = self.train.coords(rank)
        out = {}
        for spec in self.specs.values():
            if spec.stage == p:
                rows = sum(s.length for s in training_segments(spec, self.train.tp, t))
                shape = list(spec.hf_shapes[0])
                shape[spec.dim] = rows
                out[spec.name] = tuple(shape)
        return out

    def traffic(self) -> dict[str, list[int]]:
        """Bytes each rank sends to and receives from OTHER ranks, and the largest bucket it holds."""
        sent, recv, peak = [0] * self.world, [0] * self.world, [0] * self.world
        for b in self.buckets:
            held = [0] * self.world
            for tp in b.targets:
                held[tp.rank] += tp.nbytes
                for pc in tp.pieces:
                    if pc.src_rank != tp.rank:
                        n = tp.piece_nbytes(pc)
                        sent[pc.src_rank] += n
                        recv[tp.rank] += n
                        held[pc.src_rank] += n
                        held[tp.rank] += n
            peak = [max(a, c) for a, c in zip(peak, held)]
        return {"sent": sent, "received": recv, "bucket_peak": peak}


def _order_key(spec: ParamSpec) -> tuple[int, int]:
    if spec.layer is not None:
        return (1, spec.layer)
    return (0, 0) if spec.stage == 0 and "embed" in spec.name else (2, 0)


class _SourceIndex:
    """For one spec: which training TP rank holds which HF rows, and at which local offset."""

    def __init__(self, spec: ParamSpec, tp: int):
        self.by_name: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)  # (t, local, start, length)
        ranks = [0] if spec.layout == "replicated" else range(tp)
        for t in ranks:
            local = 0
            for seg in training_segments(spec, tp, t):
                if seg.hf_name is not None:
                    self.by_name[seg.hf_name].append((t, local, seg.start, seg.length))
                local += seg.length

    def cover(self, hf_name: str, start: int, length: int) -> list[tuple[int, int, int, int]]:
        """(tp rank, local offset, offset into the request, length) blocks covering the requested rows."""
        out, end = [], start + length
        for t, local, s, n in self.by_name.get(hf_name, ()):
            lo, hi = max(start, s), min(end, s + n)
            if lo < hi:
                out.append((t, local + lo - s, lo - start, hi - lo))
        if sum(b[3] for b in out) != length:
            raise VerlConfigError(f"no training shard holds rows [{start}, {end}) of {hf_name}; the parameter "
                                  f"metadata is inconsistent")
        return sorted(out, key=lambda b: b[2])


class _SourceChooser:
    def __init__(self, train: TrainingLayout):
        self.train = train
        self.load = [0] * train.world

    def choose(self, spec: ParamSpec, t: int, dst: int, nbytes: int) -> int:
        tr = self.train
        ts = range(tr.tp) if spec.layout == "replicated" else [t]
        candidates = [tr.rank(tt, d, spec.stage) for tt in ts for d in range(tr.dp)]
        if dst in candidates:
            return dst
        _, d_dst, _ = tr.coords(dst)
        best = min(candidates, key=lambda c: (tr.coords(c)[1] != d_dst, self.load[c], c))
        self.load[best] += nbytes
        return best


def _merge(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if (q is not None and q.src_rank == p.src_rank and q.src_offset + q.length == p.src_offset
                and q.dst_offset + q.length == p.dst_offset):
            out[-1] = Piece(q.src_rank, q.src_offset, q.dst_offset, q.length + p.length)
        else:
            out.append(p)
    return out


def _plan_target(spec: ParamSpec, index: _SourceIndex, target: Target, rank: int, chooser: _SourceChooser,
                 row_bytes: int) -> TargetPlan:
    pieces, dst = [], 0
    for seg in target.segments:
        for t, local, off, n in index.cover(seg.hf_name, seg.start, seg.length):
            src = chooser.choose(spec, t, rank, n * row_bytes)
            # A replicated tensor is held whole by every TP rank of the stage: same local offsets.
            pieces.append(Piece(src, local, dst + off, n))
        dst += seg.length
    return TargetPlan(rank, spec.name, target, tuple(_merge(pieces)), spec.element_size)


def plan_reshard(specs: Sequence[ParamSpec], train: TrainingLayout, tp_g: int, *, fmt: str = "hf",
                 bucket_bytes: int = 64 << 20, mapping: str = "hybrid") -> ReshardPlan:
    """Plans the move of `specs` from `train` to a generation layout with TP size `tp_g`.

    bucket_bytes bounds, per rank, the bytes of one bucket (targets received plus slices sent); a single
    parameter larger than that forms a bucket of its own.
    """
    if fmt not in FORMATS:
        raise VerlConfigError(f"unknown generation weight format {fmt!r}; choose one of {FORMATS}")
    if bucket_bytes <= 0:
        raise VerlConfigError(f"bucket_bytes={bucket_bytes} must be positive")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise VerlConfigError(f"parameter names must be unique; repeated: {dup[:3]}")
    for s in specs:
        if not 0 <= s.stage < train.pp:
            raise VerlConfigError(f"{s.name} is on pipeline stage {s.stage} but the training layout has PP={train.pp}")
    coords = generation_coords(train, tp_g, mapping)
    chooser = _SourceChooser(train)
    ordered = sorted(specs, key=_order_key)
    buckets: list[Bucket] = [Bucket(0)]
    held = [0] * train.world
    for spec in ordered:
        index = _SourceIndex(spec, train.tp)
        row_bytes = spec.row_numel() * spec.element_size
        unit = [_plan_target(spec, index, tgt, r, chooser, row_bytes)
                for r, (tg, _) in enumerate(coords) for tgt in generation_targets(spec, tp_g, tg, fmt)]
        cost = [0] * train.world
        for tp in unit:
            cost[tp.rank] += tp.nbytes
            for pc in tp.pieces:
                if pc.src_rank != tp.rank:
                    cost[pc.src_rank] += tp.piece_nbytes(pc)
        if buckets[-1].params and any(h + c > bucket_bytes for h, c in zip(held, cost)):
            buckets.append(Bucket(len(buckets)))
            held = [0] * train.world
        buckets[-1].params.append(spec.name)
        buckets[-1].targets.extend(unit)
        held = [h + c for h, c in zip(held, cost)]
    return ReshardPlan(train, tp_g, fmt, coords, {s.name: s for s in ordered}, buckets, bucket_bytes)
