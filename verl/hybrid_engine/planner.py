"""The reshard planner: a pure function from a `ModelLayout` (verl.models.layout) and two layouts to "which
rank sends which slice to which rank". No tensors, no process group: it runs (and is tested) on one process.

The generation side comes from the architecture: each `TensorGroup` (q/k/v, gate/up, or one HF tensor)
becomes per-rank `Target`s in the chosen format (verl.hybrid_engine.targets). The training side is a set
of `ShardSpec`s; every row of a target is looked up among the training parameters that hold it, so one
target may be built from several parameters (vLLM's qkv_proj from a Hugging Face module's q, k and v), and
a parameter may be a megatron TP shard, an FSDP2 dim-0 chunk, or a whole tensor on every rank.

Training layout TP × PP × DP (megatron-core's default rank order tp-dp-pp: rank = t + TP·(d + DP·p));
generation layout TP_g × DP_g over the same world, no pipeline. With the default `hybrid` rank mapping
(HybridFlow's), generation ranks are assigned so that a rank's own training shard is part of what it
needs: for TP_g = TP/k the k training TP ranks t = k·j … k·j+k-1 all become generation TP rank j (as k
distinct generation DP replicas), so each rank gathers only inside its group of k and TP_g = TP moves
nothing at all. Pipeline stages other than a rank's own send it their layers point to point.

Routed experts of mixture-of-experts layers are cut differently (verl.models.layout): expert e lives on the
ranks of expert-parallel index `spec.ep` (megatron-core's expert rank order, `Placement.expert_coords`), its
matrices split over expert TP; everything else is held by every EP rank of its stage. So an EP × ETP layout
resharded to generation TP 1 moves each rank exactly the experts it lacks.

A source among equal replicas (DP copies, or all TP ranks for replicated tensors) is chosen as the rank
itself when it holds the data, else a replica in the rank's own training DP group (same data-parallel
index: the merged TP group), else the least loaded one, so that senders share the work. A rank that holds
every tensor whole (data-parallel HF module) therefore builds all its targets from its own copy: no bytes
move. Buckets follow the training parameters' order (megatron: named_parameters, by layer).

Across rank sets (a rollout on its own ranks): `train_ranks` and `gen_ranks` name the ranks of the process
group (the union of both sets) that hold the training layout and the generation layout. Generation rank i of
`gen_ranks` is TP rank i % TP_g of replica i // TP_g (consecutive ranks form a replica), and every byte it
receives comes from a training rank: among equal replicas the least loaded sends, so the actor's data-parallel
copies share the sending.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from verl.distributed.placement import Placement
from verl.errors import VerlConfigError
from verl.hybrid_engine.targets import FORMATS, Target, generation_targets
from verl.models.layout import ModelLayout, Segment, ShardSpec, TensorGroup

__all__ = ["Piece", "TargetPlan", "Bucket", "ReshardPlan", "plan_reshard", "generation_coords",
           "RANK_MAPPINGS"]

RANK_MAPPINGS = ("hybrid", "contiguous")


def generation_coords(train: Placement, tp_g: int, mapping: str = "hybrid") -> list[tuple[int, int]]:
    """(generation TP index, generation DP index) of every rank."""
    world = train.world_size
    if tp_g < 1 or world % tp_g:
        raise VerlConfigError(f"generation TP={tp_g} must divide the world size {world} (TP×PP×DP = "
                              f"{train.tp_size}×{train.pp_size}×{train.dp_size})")
    if mapping not in RANK_MAPPINGS:
        raise VerlConfigError(f"unknown rank mapping {mapping!r}; choose one of {RANK_MAPPINGS}")
    if mapping == "contiguous":
        return [(r % tp_g, r // tp_g) for r in range(world)]
    out = []
    for r in range(world):
        t, d, p = train.coords(r)
        j = d + train.dp_size * p  # index of the rank's training TP group
        if train.tp_size % tp_g == 0:
            k = train.tp_size // tp_g
            out.append((t // k, t % k + k * j))
        elif tp_g % train.tp_size == 0:
            m = tp_g // train.tp_size
            out.append((t + train.tp_size * (j % m), j // m))
        else:
            raise VerlConfigError(f"generation TP={tp_g} must divide training TP={train.tp_size} or be a multiple "
                                  f"of it for the hybrid mapping; use mapping='contiguous' for other sizes")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Rows [src_offset, +length) of training parameter `param` on `src_rank` → rows [dst_offset, +length)
    of a target (along the TargetPlan's `dim`)."""

    param: str
    src_rank: int
    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetPlan:
    """One tensor a generation rank receives, and the pieces (in target order) that build it."""

    rank: int
    target: Target
    pieces: tuple[Piece, ...]
    dtype: torch.dtype
    dim: int
    """The dim the pieces run along: the target's, or the sources' cut dim when they are cut across it."""
    narrow: tuple[int, int, int] | None = None
    """(dim, start, length) taken of every source before the pieces: an FSDP2 dim-0 chunk read for a target
    cut along dim 1 (o_proj / down_proj at generation TP > 1)."""

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.target.shape) * self.element_size

    def piece_nbytes(self, piece: Piece) -> int:
        return self.nbytes // self.target.shape[self.dim] * piece.length


@dataclass(slots=True)
class Bucket:
    """A run of consecutive tensor groups (in training-parameter order) whose transfers happen together."""

    index: int
    groups: list[TensorGroup] = field(default_factory=list)
    targets: list[TargetPlan] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class ReshardPlan:
    """The whole plan: identical on every rank, so sends and receives pair up without negotiation. Ranks are
    those of the process group the executor runs on."""

    train: Placement
    """The training layout; training rank r lives on group rank `train_ranks[r]`."""
    tp_g: int
    fmt: str
    coords: list[tuple[int, int] | None]
    """(generation TP index, generation DP index) of every group rank; None for a rank that does not generate."""
    specs: dict[str, ShardSpec]
    buckets: list[Bucket]
    bucket_bytes: int
    train_ranks: tuple[int, ...]
    """The group rank of each training rank (0 … train.world_size - 1 when both layouts share the ranks)."""
    world: int
    """Ranks of the process group (training and generation ranks together)."""

    def targets_of(self, rank: int) -> list[TargetPlan]:
        return [t for b in self.buckets for t in b.targets if t.rank == rank]

    def local_params(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Parameter name → local shape of every training parameter `rank` holds (none on a generation-only rank)."""
        if rank not in self.train_ranks:
            return {}
        r = self.train_ranks.index(rank)
        t, d, p = self.train.coords(r)
        et, e, _, _ = self.train.expert_coords(r)
        return {s.name: s.local_shape(s.chunk_index(tp=t, dp=d, etp=et)) for s in self.specs.values()
                if s.stage == p and (s.ep is None or s.ep == e)}

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


def _order_key(spec: ShardSpec) -> tuple[int, int]:
    if spec.layer is not None:
        return (1, spec.layer)
    return (0, 0) if spec.stage == 0 and "embed" in spec.name else (2, 0)


@dataclass(frozen=True, slots=True)
class _Holder:
    """Chunk k of `spec` holds HF rows [start, +length) at `local` in the chunk (along spec.cut_dim)."""

    spec: ShardSpec
    k: int
    local: int
    start: int
    length: int


class _SourceIndex:
    """Which chunk of which training parameter holds which HF rows."""

    def __init__(self, specs: Sequence[ShardSpec]):
        self.by_name: dict[str, list[_Holder]] = defaultdict(list)
        for spec in specs:
            for k in range(1 if spec.dim is None else spec.parts):
                for seg, local in spec.local_segments(k):
                    if seg.hf_name is not None:
                        self.by_name[seg.hf_name].append(_Holder(spec, k, local, seg.start, seg.length))

    def cover(self, hf_name: str, start: int, length: int, dim: int) -> list[tuple[_Holder, int, int, int]]:
        """(holder, offset in its chunk, offset into the request, length) blocks covering the requested rows."""
        out, end = [], start + length
        for h in self.by_name.get(hf_name, ()):
            s, n = h.start, h.length
            if dim != h.spec.cut_dim:
                if h.spec.dim is not None or len(h.spec.segments) != 1:
                    continue
                s, n = 0, h.spec.global_shape[dim]  # the whole HF tensor: its own offsets along every dim
            lo, hi = max(start, s), min(end, s + n)
            if lo < hi:
                out.append((h, h.local + lo - s, lo - start, hi - lo))
        if sum(b[3] for b in out) != length:
            raise VerlConfigError(f"the training parameters hold rows [{start}, {end}) of {hf_name} along dim {dim} "
                                  f"{sum(b[3] for b in out)} times instead of once; the parameter metadata is "
                                  f"inconsistent")
        return sorted(out, key=lambda b: b[2])


class _SourceChooser:
    """Picks the group rank that sends a chunk: `dst` itself when it holds it, else a replica in dst's training
    DP group, else the least loaded replica (a generation-only dst has no DP group: load alone decides)."""

    def __init__(self, train: Placement, train_ranks: Sequence[int], world: int):
        self.train, self.host = train, list(train_ranks)
        self.load = [0] * world

    def _candidates(self, spec: ShardSpec, k: int) -> list[int]:
        """The training ranks holding chunk k of `spec`."""
        tr = self.train
        if spec.ep is not None:  # a routed expert: its EP index, every expert-DP copy, ETP index k
            ts = range(tr.etp_size) if spec.dim is None else [k]
            return [tr.expert_rank_of(t, spec.ep, d, spec.stage) for t in ts for d in range(tr.edp_size)]
        if spec.dim is None:
            candidates = [tr.rank_of(t, d, spec.stage) for t in range(tr.tp_size) for d in range(tr.dp_size)]
        elif spec.axis == "tp":
            candidates = [tr.rank_of(k, d, spec.stage) for d in range(tr.dp_size)]
        else:
            candidates = [tr.rank_of(t, k, spec.stage) for t in range(tr.tp_size)]
        return candidates

    def choose(self, spec: ShardSpec, k: int, dst: int, nbytes: int) -> int:
        tr = self.train
        candidates = self._candidates(spec, k)
        hosts = [self.host[c] for c in candidates]
        if dst in hosts:
            return dst
        if dst in self.host:
            _, d_dst, _ = tr.coords(self.host.index(dst))
            key = lambda c: (tr.coords(c)[1] != d_dst, self.load[self.host[c]], c)  # noqa: E731
        else:
            key = lambda c: (self.load[self.host[c]], c)  # noqa: E731
        best = self.host[min(candidates, key=key)]
        self.load[best] += nbytes
        return best


def _merge(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if (q is not None and q.param == p.param and q.src_rank == p.src_rank
                and q.src_offset + q.length == p.src_offset and q.dst_offset + q.length == p.dst_offset):
            out[-1] = Piece(param=q.param, src_rank=q.src_rank, src_offset=q.src_offset, dst_offset=q.dst_offset,
                            length=q.length + p.length)
        else:
            out.append(p)
    return out


def _assembly(target: Target, index: _SourceIndex) -> tuple[int, tuple[Segment, ...], tuple[int, int, int] | None]:
    """(dim the pieces run along, segments along it, narrowing of every source) for `target`.

    Sources cut along the target's own dim (megatron) or not cut (whole copies) serve the target's segments
    directly. Sources cut along another dim (FSDP2's dim 0 for a column-split o_proj) are read as their
    chunks along that dim, each narrowed to the target's columns first."""
    cut = {h.spec.dim for s in target.segments for h in index.by_name.get(s.hf_name, ())} - {None, target.dim}
    if not cut:
        return target.dim, target.segments, None
    if len(cut) > 1 or len(target.segments) != 1:
        raise VerlConfigError(f"{target.name}: its training parameters are cut along dims {sorted(cut)}, across the "
                              f"generation cut along dim {target.dim}, which the planner serves for single-tensor "
                              f"targets only; use weight_format='hf' or a training layout cut along dim {target.dim}")
    (d,) = cut
    seg = target.segments[0]
    return d, (Segment(hf_name=seg.hf_name, start=0, length=target.shape[d]),), (target.dim, seg.start, seg.length)


def _plan_target(target: Target, index: _SourceIndex, rank: int, chooser: _SourceChooser) -> TargetPlan:
    dim, segments, narrow = _assembly(target, index)
    blocks, dst = [], 0
    for seg in segments:
        covered = index.cover(seg.hf_name, seg.start, seg.length, dim)
        blocks += [(h, local, dst + off, n) for h, local, off, n in covered]
        dst += seg.length
    dtypes = {h.spec.dtype for h, *_ in blocks}
    if len(dtypes) != 1:
        raise VerlConfigError(f"{target.name} would be built from parameters of dtypes {sorted(map(str, dtypes))}; "
                              f"cast the training model to one dtype")
    dtype = dtypes.pop()
    row_bytes = math.prod(target.shape) // target.shape[dim] * torch.empty((), dtype=dtype).element_size()
    pieces = []
    for h, local, off, n in blocks:
        src = chooser.choose(h.spec, h.k, rank, n * row_bytes)
        pieces.append(Piece(param=h.spec.name, src_rank=src, src_offset=local, dst_offset=off, length=n))
    return TargetPlan(rank=rank, target=target, pieces=tuple(_merge(pieces)), dtype=dtype, dim=dim, narrow=narrow)


def _check(layout: ModelLayout, train: Placement, tp_g: int, fmt: str, bucket_bytes: int) -> None:
    if fmt not in FORMATS:
        raise VerlConfigError(f"unknown generation weight format {fmt!r}; choose one of {FORMATS}")
    if bucket_bytes <= 0:
        raise VerlConfigError(f"bucket_bytes={bucket_bytes} must be positive")
    if layout.unknown and (tp_g > 1 or fmt != "hf"):
        raise VerlConfigError(
            f"architecture {layout.architecture!r}: the hybrid engine knows how to cut and fuse the weights of "
            f"the families verl.models.config supports only ({layout.unknown}); for other models use "
            f"weight_format='hf' with generation_tp=1 (got weight_format={fmt!r}, generation_tp={tp_g})")
    names = [s.name for s in layout.params]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise VerlConfigError(f"parameter names must be unique; repeated: {dup[:3]}")
    for s in layout.params:
        if not 0 <= s.stage < train.pp_size:
            raise VerlConfigError(f"{s.name} is on pipeline stage {s.stage} but the training layout has "
                                  f"PP={train.pp_size}")
        size = {"tp": train.tp_size, "dp": train.dp_size, "etp": train.etp_size}[s.axis]
        if s.ep is not None and not 0 <= s.ep < train.ep_size:
            raise VerlConfigError(f"{s.name} is held by expert-parallel rank {s.ep} but the training layout has "
                                  f"EP={train.ep_size}; describe the parameters for this layout")
        if s.dim is not None and s.parts != size:
            raise VerlConfigError(f"{s.name} is cut into {s.parts} chunks along the training {s.axis.upper()} axis but "
                                  f"the training layout has {s.axis.upper()}={size}; describe the parameters for "
                                  f"this layout")


def _ordered_groups(layout: ModelLayout, index: _SourceIndex) -> list[TensorGroup]:
    """The groups in the order of the first training parameter holding them (layer order)."""
    order = {s.name: i for i, s in enumerate(sorted(layout.params, key=_order_key))}
    wanted = {n for g in layout.groups for n in g.names}
    extra = sorted(set(index.by_name) - wanted)
    if extra:
        raise VerlConfigError(f"training parameters hold {extra[:3]}, which no generation tensor of "
                              f"{layout.architecture!r} includes; the ModelLayout's groups and params disagree")
    missing = sorted(wanted - set(index.by_name))
    if missing:
        raise VerlConfigError(f"no training parameter holds {missing[:3]} ({len(missing)} tensors); the "
                              f"ModelLayout's groups and params disagree")
    return sorted(layout.groups, key=lambda g: min(order[h.spec.name] for n in g.names for h in index.by_name[n]))


def _rank_sets(train: Placement, tp_g: int, mapping: str, train_ranks: Sequence[int] | None,
               gen_ranks: Sequence[int] | None) -> tuple[tuple[int, ...], int, list[tuple[int, int] | None]]:
    """(group rank of each training rank, group size, generation coords of every group rank)."""
    if gen_ranks is None:
        if train_ranks is not None and tuple(train_ranks) != tuple(range(train.world_size)):
            raise VerlConfigError(f"train_ranks={list(train_ranks)} without gen_ranks: name the generation ranks "
                                  f"too when the training layout does not start at group rank 0")
        return tuple(range(train.world_size)), train.world_size, list(generation_coords(train, tp_g, mapping))
    hosts = tuple(range(train.world_size)) if train_ranks is None else tuple(train_ranks)
    gens = tuple(gen_ranks)
    world = len(set(hosts) | set(gens))
    if len(hosts) != train.world_size or len(set(hosts)) != len(hosts) or len(set(gens)) != len(gens) \
            or not set(hosts) | set(gens) <= set(range(world)):
        raise VerlConfigError(f"train_ranks={list(hosts)} (one per rank of the {train.world_size}-rank training "
                              f"layout) and gen_ranks={list(gens)} must each name distinct ranks that together "
                              f"are the group's ranks 0..{world - 1}")
    if not gens or len(gens) % tp_g:
        raise VerlConfigError(f"generation TP={tp_g} must divide the {len(gens)} generation ranks {list(gens)}")
    coords: list[tuple[int, int] | None] = [None] * world
    for i, r in enumerate(gens):
        coords[r] = (i % tp_g, i // tp_g)
    return hosts, world, coords


def plan_reshard(layout: ModelLayout, train: Placement, tp_g: int, *, fmt: str = "hf",
                 bucket_bytes: int = 64 << 20, mapping: str = "hybrid", train_ranks: Sequence[int] | None = None,
                 gen_ranks: Sequence[int] | None = None) -> ReshardPlan:
    """Plans the move of `layout`'s weights from `train` to a generation layout with TP size `tp_g`.

    bucket_bytes bounds, per rank, the bytes of one bucket (targets received plus slices sent); a single
    tensor group larger than that forms a bucket of its own. `train_ranks` / `gen_ranks` (group ranks) place
    the two layouts on different ranks of one group; by default both span the same ranks (`mapping` then
    assigns the generation coordinates).
    """
    _check(layout, train, tp_g, fmt, bucket_bytes)
    hosts, world, coords = _rank_sets(train, tp_g, mapping, train_ranks, gen_ranks)
    index = _SourceIndex(layout.params)
    chooser = _SourceChooser(train, hosts, world)
    buckets: list[Bucket] = [Bucket(0)]
    held = [0] * world
    for group in _ordered_groups(layout, index):
        unit = [_plan_target(tgt, index, r, chooser) for r, c in enumerate(coords) if c is not None
                for tgt in generation_targets(group, tp_g, c[0], fmt)]
        cost = [0] * world
        for tp in unit:
            cost[tp.rank] += tp.nbytes
            for pc in tp.pieces:
                if pc.src_rank != tp.rank:
                    cost[pc.src_rank] += tp.piece_nbytes(pc)
        if buckets[-1].groups and any(h + c > bucket_bytes for h, c in zip(held, cost)):
            buckets.append(Bucket(len(buckets)))
            held = [0] * world
        buckets[-1].groups.append(group)
        buckets[-1].targets.extend(unit)
        held = [h + c for h, c in zip(held, cost)]
    specs = {s.name: s for s in sorted(layout.params, key=_order_key)}
    return ReshardPlan(train=train, tp_g=tp_g, fmt=fmt, coords=coords, specs=specs, buckets=buckets,
                       bucket_bytes=bucket_bytes, train_ranks=hosts, world=world)
