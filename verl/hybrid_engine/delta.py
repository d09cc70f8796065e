"""Delta weight sync (rollout.sync=delta): each sync sends, per bucket, only the elements whose value in the
engine's dtype changed since the last sync, and the receiver proves it holds what a full sync would give.

The unit is an *image*: for one bucket of the `ReshardPlan`, one sender rank s and one receiving generation
rank g (s may be g), the concatenation of the pieces s contributes to g's targets, in plan order, cast to the
engine's dtype — exactly the flat buffer a full sync would pack. The sender keeps its last image per (bucket,
g) (`DeltaState.mirror`: one engine-dtype copy of what the rank sends); the receiver keeps none: its image lives
in the engine's weights, each position one element of a target tensor (`_PieceMap`), written in place.

Per image and sync the sender sends a 7-int header (kind, elements, changed, payload bytes, payload checksum, base
version, image checksum or -1) and a payload, the cheaper of
- index + value: int32 positions of the changed elements, then their new values;
- bitmask + value: one bit per element (padded to 8 bytes), then the changed values in position order;
(nothing when nothing changed; the whole image at a full sync). "Changed" compares bit patterns, so -0.0 vs 0.0
and NaN payloads count as changes and the result is bit-exact.

Checks, each counted when it fires:
- on arrival: the CRC-32 (`checksum`) of the payload against the header's, and the decoded sizes against the
  header; a mismatch writes nothing and the bucket is resent whole (`DeltaStats.bucket_resyncs`);
- every `verify_every`-th sync the sender also sends the CRC-32 of its fresh image, and the receiver compares it
  with the CRC-32 of the image as the engine holds it after the write: equal means (up to CRC collisions) the
  engine holds exactly the cast of the current training weights; a mismatch (the engine's memory changed
  behind the sync) resends that bucket whole (`verify_failures`).
CRC-32 catches transport and bookkeeping errors, not an adversary.

Versions: both sides count the syncs of one `HybridEngine` (`DeltaState.version`); the engine carries the tag of
the last sync written into it (`RolloutEngine.sync_base`, cleared by any other write). At the start of a sync
every rank contributes its version (a receiver whose engine tag differs contributes -1), and unless all agree
the sync is a full one (`forced_full` when it was not the first): no delta is ever applied to another base.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verl.errors import VerlRuntimeError
from verl.hybrid_engine.executor import ReshardExecutor, agree
from verl.hybrid_engine.planner import Bucket, TargetPlan

__all__ = ["DeltaState", "DeltaStats", "DeltaExecutor", "checksum", "decode_delta", "encode_delta", "NONE", "FULL",
           "INDEX", "BITMASK"]

NONE, FULL, INDEX, BITMASK = 0, 1, 2, 3
KIND_NAMES = {NONE: "none", FULL: "full", INDEX: "index", BITMASK: "bitmask"}
_HEADER = 7  # kind, numel, changed, payload bytes, payload checksum, base version, image checksum (or -1)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ----------------------------------------------------------------------------------------------- pure parts

def checksum(t: torch.Tensor) -> int:
    """CRC-32 of `t`'s bytes (zlib's; a copy to the host first for device tensors): every error burst of up to
    32 bits, and all but 2^-32 of the rest, change it."""
    raw = t.detach().contiguous().view(torch.uint8).reshape(-1).cpu()
    return zlib.crc32(raw.numpy()) if raw.numel() else 0


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """One bit per element (element i at bit i % 8 of byte i // 8), padded to a multiple of 8 bytes: each run of
    8 bools, read as one int64 of 0/1 bytes, folds its bytes' low bits into its low byte by three shift-ors."""
    n = mask.numel()
    padded = torch.zeros(-(-n // 64) * 64, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.view(torch.uint8)
    x = padded.view(torch.int64)
    x = x | (x >> 7)
    x = x | (x >> 14)
    x = x | (x >> 28)
    return (x & 0xFF).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `_pack_bits`: each byte's bits spread back over 8 bytes of 0/1 (three shift-ors), as bools."""
    x = packed.long()
    x = x | (x << 28)
    x = x | (x << 14)
    x = x | (x << 7)
    return (x & 0x0101010101010101).view(torch.uint8)[:n].view(torch.bool)


def encode_delta(new: torch.Tensor, old: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """(kind, payload bytes, changed count) taking flat image `old` to `new` (same dtype and size): the smaller of
    index + value and bitmask + value, NONE when nothing changed. Changes are compared as bit patterns."""
    itype = _INT[new.element_size()]
    changed = new.view(itype) != old.view(itype)
    n = int(torch.count_nonzero(changed))
    if n == 0:
        return NONE, torch.empty(0, dtype=torch.uint8, device=new.device), 0
    values = _as_bytes(new[changed])
    if 4 * n <= -(-new.numel() // 64) * 8:  # the values cost the same either way
        return INDEX, torch.cat([_as_bytes(changed.nonzero().view(-1).to(torch.int32)), values]), n
    return BITMASK, torch.cat([_pack_bits(changed), values]), n


def decode_delta(kind: int, payload: torch.Tensor, numel: int, changed: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(where, values) of an encoded delta: `where` is int64 positions (INDEX) or a bool mask over the image
    (BITMASK); values in position order. Sizes that disagree with the header raise VerlRuntimeError."""
    es = torch.empty((), dtype=dtype).element_size()
    if kind == INDEX:
        where, values = payload[:4 * changed].view(torch.int32).long(), payload[4 * changed:]
        if where.numel() and (int(where.min()) < 0 or int(where.max()) >= numel):
            raise VerlRuntimeError(f"delta sync: an index payload points outside its {numel}-element image")
    elif kind == BITMASK:
        nbytes = -(-numel // 64) * 8
        where, values = _unpack_bits(payload[:nbytes], numel), payload[nbytes:]
        marked = int(torch.count_nonzero(where))
        if marked != changed:
            raise VerlRuntimeError(f"delta sync: a bitmask payload marks {marked} elements, its header {changed}")
    else:
        raise VerlRuntimeError(f"delta sync: unknown payload kind {kind}")
    if values.numel() != changed * es:
        raise VerlRuntimeError(f"delta sync: a {KIND_NAMES[kind]} payload holds {values.numel()} value bytes for "
                               f"{changed} changed elements")
    return where, values.view(dtype)


# ----------------------------------------------------------------------------------------------- state

@dataclass(slots=True)
class DeltaState:
    """What one HybridEngine remembers between delta syncs on this rank."""

    token: str
    """This engine's identity in the tag it leaves on the rollout engine."""
    version: int = -1
    """Syncs completed (-1: none: the next is full)."""
    mirror: dict = field(default_factory=dict)
    """Sender: (bucket, receiver) → the last image sent (engine dtype)."""


@dataclass(kw_only=True, slots=True)
class DeltaStats:
    """One rank's view of one delta sync."""

    full: bool = False
    """This sync sent whole images (first sync, or forced)."""
    forced_full: int = 0
    """1 when the versions disagreed after an earlier sync (a delta refused, a full sync instead)."""
    bucket_resyncs: int = 0
    """Buckets resent whole because a payload's checksum (or its sizes) did not match on arrival."""
    verify_failures: int = 0
    """Buckets resent whole because the periodic full check found the engine's image differing."""
    verified: bool = False
    """This sync ran the full check."""
    elements: int = 0
    """Elements of this rank's targets."""
    changed: int = 0
    """Of those, changed since the last sync (all of them at a full sync)."""
    engine_bytes: int = 0
    """Payload and header bytes handed to this rank's engine (local pieces included)."""
    full_bytes: int = 0
    """What a full sync hands this rank's engine (its targets in the engine's dtype)."""
    kinds: dict = field(default_factory=lambda: defaultdict(int))
    """Payload kind name → images sent by this rank with it."""


class _PieceMap:
    """Where each position of one (bucket, sender) image lives in the receiver's engine tensors: blocks of
    target tensors (a piece's rows along its dim), in image order."""

    def __init__(self, items: list[tuple[TargetPlan, int]], tensors: dict[str, torch.Tensor]):
        self.blocks = []  # (block view into the engine tensor, its tensor, dim, dst offset, image start, numel)
        start = 0
        for tp, i in items:
            pc, t = tp.pieces[i], tensors[tp.target.name]
            view = t.narrow(tp.dim, pc.dst_offset, pc.length)
            self.blocks.append((view, t, tp.dim, pc.dst_offset, start, view.numel()))
            start += view.numel()
        self.numel = start

    def write_all(self, image: torch.Tensor) -> None:
        for view, _, _, _, start, n in self.blocks:
            view.copy_(image[start:start + n].view(view.shape))

    def read_all(self) -> torch.Tensor:
        return torch.cat([view.reshape(-1) for view, *_ in self.blocks])

    def write_mask(self, mask: torch.Tensor, values: torch.Tensor) -> None:
        taken = 0
        for view, _, _, _, start, n in self.blocks:
            m = mask[start:start + n]
            k = int(torch.count_nonzero(m))
            if k:
                view.masked_scatter_(m.view(view.shape).to(view.device), values[taken:taken + k].to(view.device))
                taken += k

    def write_index(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        starts = torch.tensor([b[4] for b in self.blocks] + [self.numel], dtype=torch.int64)
        bounds = torch.searchsorted(positions.cpu(), starts).tolist()
        for (view, t, dim, off, start, _), lo, hi in zip(self.blocks, bounds[:-1], bounds[1:]):
            if lo == hi:
                continue
            q = positions[lo:hi] - start
            if dim == 0:  # rows of a contiguous tensor: one flat range
                flat = q + off * (t.stride(0) if t.dim() else 1)
            else:
                flat = torch.zeros_like(q)
                for k in range(view.dim() - 1, -1, -1):
                    flat += (q % view.shape[k] + (off if k == dim else 0)) * t.stride(k)
                    q = q // view.shape[k]
            t.view(-1)[flat.to(t.device)] = values[lo:hi].to(t.device)


# ----------------------------------------------------------------------------------------------- executor

class DeltaExecutor(ReshardExecutor):
    """Runs one delta sync of `plan` on this rank (see the module docstring): `run(engine)` writes into the
    engine's live tensors (`engine.weight_tensors()`; None on a rank that only sends)."""

    tamper = None
    """Tests only: called with (bucket index, sender, payload) on every received payload before it is used,
    to stand in for a transport that corrupts bytes."""

    def __init__(self, plan, local_params, state: DeltaState, *, group=None, device=None,
                 engine_dtype: torch.dtype, verify: bool = False):
        super().__init__(plan, local_params, group=group, device=device, out_dtype=engine_dtype)
        self.state, self.dtype, self.verify = state, engine_dtype, verify
        self._element_size = torch.empty((), dtype=engine_dtype).element_size()
        self.dstats = DeltaStats(verified=verify)

    # -- the whole sync ---------------------------------------------------------------------------------------
    def run(self, engine) -> DeltaStats:
        problem = self.check_params()
        if not agree(problem is None, self.group):
            raise VerlRuntimeError(problem or "another rank's training shards do not match the reshard plan; "
                                   "see that rank's error", rank=self.rank)
        tensors, error = None, None
        try:
            tensors = None if engine is None else self._engine_tensors(engine)
        except VerlRuntimeError as e:
            error = e
        if not agree(error is None, self.group):
            raise error or VerlRuntimeError("another rank's engine cannot take a delta sync (see its error)",
                                            rank=self.rank)
        full = not self._versions_agree(engine)
        st = self.dstats
        st.full, st.forced_full = full, int(full and self.state.version >= 0)
        for bucket in self.plan.buckets:
            ok, verify_ok = self._bucket(bucket, tensors, full)
            if not agree(ok and verify_ok, self.group):
                st.bucket_resyncs += int(not ok)
                st.verify_failures += int(ok and not verify_ok)
                ok, verify_ok = self._bucket(bucket, tensors, True)
                if not agree(ok and verify_ok, self.group):
                    raise VerlRuntimeError(f"delta sync: bucket {bucket.index} still differs after a full resend; "
                                           f"the engine's weights cannot be trusted", rank=self.rank)
            self.stats.buckets += 1
        self.state.version += 1
        if engine is not None:
            engine.sync_base = (self.state.token, self.state.version)
        return st

    def _engine_tensors(self, engine) -> dict[str, torch.Tensor]:
        tensors = engine.weight_tensors()
        for tp in self.plan.targets_of(self.rank):
            t = tensors.get(tp.target.name)
            if t is None or tuple(t.shape) != tuple(tp.target.shape) or t.dtype != self.dtype or not t.is_contiguous():
                got = None if t is None else (tuple(t.shape), t.dtype, t.is_contiguous())
                raise VerlRuntimeError(f"delta sync: the engine's {tp.target.name!r} is {got}, but the sync writes "
                                       f"a contiguous {tuple(tp.target.shape)} {self.dtype} tensor in place",
                                       rank=self.rank)
        return tensors

    def _versions_agree(self, engine) -> bool:
        mine = self.state.version
        if engine is not None and getattr(engine, "sync_base", None) != (self.state.token, mine):
            mine = -1
        if not dist.is_initialized():
            return mine >= 0
        t = torch.tensor([mine, -mine], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0]) >= 0 and int(t[0]) == -int(t[1])

    # -- one bucket ---------------------------------------------------------------------------------------------
    def _pieces(self, bucket: Bucket):
        """sender side: receiver → [block to send]; receiver side: sender → [(target plan, piece index)]."""
        out, inc = defaultdict(list), defaultdict(list)
        for tp in bucket.targets:
            for i, pc in enumerate(tp.pieces):
                if pc.src_rank == self.rank:
                    out[tp.rank].append(self._source(tp, pc).narrow(tp.dim, pc.src_offset, pc.length))
                if tp.rank == self.rank:
                    inc[pc.src_rank].append((tp, i))
        return out, inc

    def _bucket(self, bucket: Bucket, tensors, full: bool) -> tuple[bool, bool]:
        out, inc = self._pieces(bucket)
        sends = {g: self._encode(bucket.index, g, blocks, full) for g, blocks in sorted(out.items())}
        received = self._trade(bucket, sends, inc)
        ok = verify_ok = True
        for s, (header, payload) in sorted(received.items()):
            if self.tamper is not None:
                payload = self.tamper(bucket.index, s, payload)
            a, b = self._apply(_PieceMap(inc[s], tensors), header, payload)
            ok, verify_ok = ok and a, verify_ok and b
        return ok, verify_ok

    def _image(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The blocks, flattened in order and cast to the engine's dtype in one copy each."""
        image = torch.empty(sum(b.numel() for b in blocks), dtype=self.dtype, device=blocks[0].device)
        start = 0
        for b in blocks:
            image[start:start + b.numel()].view(b.shape).copy_(b)
            start += b.numel()
        return image

    def _encode(self, b: int, g: int, blocks: list[torch.Tensor], full: bool):
        """(header, payload) of image (bucket b → receiver g); the image becomes the mirror."""
        image = self._image(blocks)
        old = self.state.mirror.get((b, g))
        if full or old is None:
            kind, payload, n = FULL, _as_bytes(image), image.numel()
        else:
            kind, payload, n = encode_delta(image, old)
        self.state.mirror[(b, g)] = image
        self.dstats.kinds[KIND_NAMES[kind]] += 1
        image_sum = checksum(image) if self.verify and kind != FULL else -1
        header = torch.tensor([kind, image.numel(), n, payload.numel(), checksum(payload), self.state.version,
                               image_sum], dtype=torch.int64)
        return header, payload

    def _trade(self, bucket: Bucket, sends: dict, inc: dict) -> dict:
        """Headers, then payloads, between every (sender, receiver) pair of the bucket; own pieces stay local."""
        received = {s: sends[self.rank] for s in inc if s == self.rank}
        peers_in = sorted(s for s in inc if s != self.rank)
        peers_out = sorted(g for g in sends if g != self.rank)
        headers = {s: torch.empty(_HEADER, dtype=torch.int64, device=self.device) for s in peers_in}
        ops = [dist.P2POp(dist.isend, sends[g][0].to(self.device), self._peer(g), self.group) for g in peers_out]
        ops += [dist.P2POp(dist.irecv, headers[s], self._peer(s), self.group) for s in peers_in]
        self._exchange(ops, bucket)
        payloads = {s: torch.empty(int(headers[s][3]), dtype=torch.uint8, device=self.device) for s in peers_in}
        ops = [dist.P2POp(dist.isend, sends[g][1].to(self.device), self._peer(g), self.group, tag=1)
               for g in peers_out if sends[g][1].numel()]
        ops += [dist.P2POp(dist.irecv, payloads[s], self._peer(s), self.group, tag=1) for s in peers_in
                if payloads[s].numel()]
        self._exchange(ops, bucket)
        self.stats.bytes_sent += sum(sends[g][1].numel() + 8 * _HEADER for g in peers_out)
        self.stats.bytes_received += sum(payloads[s].numel() + 8 * _HEADER for s in peers_in)
        received.update({s: (headers[s].cpu(), payloads[s]) for s in peers_in})
        return received

    def _apply(self, pmap: _PieceMap, header: torch.Tensor, payload: torch.Tensor) -> tuple[bool, bool]:
        """Checks one image's payload against its checksum and writes it into the engine: (payload ok, full
        check ok). Nothing is written when the payload fails its checks."""
        kind, numel, changed, _, payload_sum, base, image_sum = (int(x) for x in header.tolist())
        st, es = self.dstats, self._element_size
        st.elements += numel
        st.changed += changed
        st.engine_bytes += payload.numel() + 8 * _HEADER
        st.full_bytes += numel * es
        if numel != pmap.numel or checksum(payload) != payload_sum:
            return False, True
        if kind == FULL:
            if payload.numel() != numel * es:
                return False, True
            pmap.write_all(payload.view(self.dtype))
        elif kind != NONE:
            if base != self.state.version:
                return False, True
            try:
                where, values = decode_delta(kind, payload, numel, changed, self.dtype)
            except VerlRuntimeError:
                return False, True
            (pmap.write_index if kind == INDEX else pmap.write_mask)(where, values)
        if image_sum >= 0:
            return True, checksum(pmap.read_all()) == image_sum
        return True, True
