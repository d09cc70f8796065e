"""Delta weight sync (rollout.sync=delta): each sync sends, per bucket, only the elements whose value in the
engine's dtype changed since the last sync, and the receiver proves it holds what a full sync would give.

The unit is an *image*: for one bucket of the `ReshardPlan`, one sender rank s and one receiving generation
rank g (s may be g), the concatenation of the pieces s contributes to g's targets, in plan order, cast to the
engine's dtype — exactly the flat buffer a full sync would pack. The sender keeps its last image per (bucket,
g) (`mirror`); the receiver keeps none: its image lives in the engine's weights, each position mapped to one
element of one target tensor (`_PieceMap`).

Per image and sync the sender sends a header (`Header`) and a payload, and the payload is the cheaper of
- index + value: int32 positions of the changed elements, then their new values;
- bitmask + value: one bit per element (padded to 8 bytes), then the changed values in position order;
(nothing at all when nothing changed; the whole image at a full sync). "Changed" compares bit patterns, so -0.0
vs 0.0 and NaN payloads count as changes and the result is bit-exact.

Checksum: `image_checksum` is a position-weighted sum over the image's 16-bit words, exact in int64 (weights
below 2^16, words shifted to [1, 2^16]; exact for images below 2^31 words, i.e. buckets below 4 GiB). It is
additive, so the sender updates it from the changed elements alone, and the receiver predicts it from the old
and new values of the elements it is about to write: a corrupted index or value (or a base that is not the
sender's) fails the comparison *before* anything is written, and the bucket is resent whole (counted in
`DeltaStats.bucket_resyncs`). Every `verify_every`-th sync the sender checksums its fresh image and the receiver
its whole image as the engine holds it; a mismatch (e.g. the engine's memory changed behind the sync) resends
that bucket whole too (`verify_failures`). It is not cryptographic: it detects transport and bookkeeping errors.

Versions: both sides count the syncs of one `HybridEngine` (`DeltaState.version`); the engine carries the tag of
the last sync written into it (`RolloutEngine.sync_base`, cleared by any other write). At the start of a sync
every rank contributes its version (a receiver whose engine tag differs contributes -1), and unless all agree
the sync is a full one (`forced_full` when it was not the first): no delta is ever applied to another base.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verl.errors import VerlRuntimeError
from verl.hybrid_engine.executor import ReshardExecutor, agree
from verl.hybrid_engine.planner import Bucket, TargetPlan
from verl.ops.reshard import reshard_pack

__all__ = ["DeltaState", "DeltaStats", "DeltaExecutor", "decode_delta", "encode_delta", "image_checksum",
           "word_checksum_delta", "NONE", "FULL", "INDEX", "BITMASK"]

NONE, FULL, INDEX, BITMASK = 0, 1, 2, 3
KIND_NAMES = {NONE: "none", FULL: "full", INDEX: "index", BITMASK: "bitmask"}
_HEADER = 7  # kind, numel, changed, payload bytes, checksum after, base version, verify
_CHUNK = 1 << 20
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ----------------------------------------------------------------------------------------------- pure parts

def _words(t: torch.Tensor) -> torch.Tensor:
    """The 16-bit words of a flat tensor, as int64 in [1, 2^16] (1-byte dtypes: one word per byte)."""
    if t.element_size() == 1:
        return t.view(torch.uint8).long() + 1
    return t.contiguous().view(torch.int16).long() + 32769


def _coef(pos: torch.Tensor) -> torch.Tensor:
    """Odd weights below 2^16 for word positions (int64): a multiplicative hash of the position."""
    return (((pos * 0x9E3779B1) >> 15) & 0xFFFF) | 1


def image_checksum(image: torch.Tensor) -> int:
    """Σ_j coef(j) · word_j over the image's 16-bit words (see the module docstring), in chunks."""
    words = _words(image.reshape(-1))
    total = 0
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK]
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
        total += int((_coef(pos) * w).sum())
    return total


def word_checksum_delta(positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """How the checksum moves when the elements at `positions` (element indices, int64) go from `old` to `new`."""
    if positions.numel() == 0:
        return 0
    per = max(1, new.element_size() // 2)
    words_new, words_old = _words(new).view(-1, per), _words(old).view(-1, per)
    pos = positions[:, None] * per + torch.arange(per, device=positions.device)
    return int((_coef(pos) * (words_new - words_old)).sum())


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """One bit per element (little-endian within a byte), padded to a multiple of 8 bytes."""
    n = mask.numel()
    padded = torch.zeros(-(-n // 64) * 64, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(-1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).reshape(-1)[:n].bool()


def encode_delta(new: torch.Tensor, old: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(kind, payload bytes, changed positions) taking flat image `old` to `new` (same dtype and size): the
    smaller of index + value and bitmask + value, NONE when nothing changed."""
    itype = _INT[new.element_size()]
    changed = new.view(itype) != old.view(itype)
    idx = changed.nonzero().view(-1)
    n, es = idx.numel(), new.element_size()
    if n == 0:
        return NONE, torch.empty(0, dtype=torch.uint8, device=new.device), idx
    values = _as_bytes(new[idx])
    index_bytes, mask_bytes = n * 4, -(-new.numel() // 64) * 8
    if index_bytes <= mask_bytes:
        return INDEX, torch.cat([_as_bytes(idx.to(torch.int32)), values]), idx
    return BITMASK, torch.cat([_pack_bits(changed), values]), idx


def decode_delta(kind: int, payload: torch.Tensor, numel: int, changed: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64, values) of an encoded delta (`encode_delta`'s payload)."""
    es = torch.empty((), dtype=dtype).element_size()
    if kind == NONE:
        return torch.empty(0, dtype=torch.int64, device=payload.device), torch.empty(0, dtype=dtype,
                                                                                      device=payload.device)
    if kind == INDEX:
        idx = payload[:4 * changed].view(torch.int32).long()
        values = payload[4 * changed:].view(dtype)
    elif kind == BITMASK:
        nbytes = -(-numel // 64) * 8
        idx = _unpack_bits(payload[:nbytes], numel).nonzero().view(-1)
        values = payload[nbytes:].view(dtype)
    else:
        raise VerlRuntimeError(f"delta sync: unknown payload kind {kind}")
    if idx.numel() != changed or values.numel() * es != changed * es or values.numel() != changed:
        raise VerlRuntimeError(f"delta sync: a {KIND_NAMES.get(kind, kind)} payload announced {changed} changed "
                               f"elements but holds {idx.numel()} positions and {values.numel()} values")
    return idx, values


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
    sent_sums: dict = field(default_factory=dict)
    """Sender: (bucket, receiver) → checksum of that image."""
    held_sums: dict = field(default_factory=dict)
    """Receiver: (bucket, sender) → checksum of the image its engine holds from that sender."""


@dataclass(kw_only=True, slots=True)
class DeltaStats:
    """One rank's view of one delta sync."""

    full: bool = False
    """This sync sent whole images (first sync, or forced)."""
    forced_full: int = 0
    """1 when the versions disagreed after an earlier sync (a delta refused, a full sync instead)."""
    bucket_resyncs: int = 0
    """Buckets resent whole because a payload's checksum did not match on arrival."""
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
    """Where each position of one (bucket, sender) image lives in the receiver's engine tensors."""

    def __init__(self, items: list[tuple[TargetPlan, int]], tensors: dict[str, torch.Tensor]):
        self.blocks = []  # (engine tensor, dim, dst offset, block shape, image start, numel)
        start = 0
        for tp, i in items:
            pc, t = tp.pieces[i], tensors[tp.target.name]
            shape = list(tp.target.shape)
            shape[tp.dim] = pc.length
            n = math.prod(shape)
            self.blocks.append((t, tp.dim, pc.dst_offset, tuple(shape), start, n))
            start += n
        self.numel = start
        self.starts = torch.tensor([b[4] for b in self.blocks] + [start], dtype=torch.int64)

    def write_all(self, image: torch.Tensor) -> None:
        for t, dim, off, shape, start, n in self.blocks:
            t.narrow(dim, off, shape[dim]).copy_(image[start:start + n].view(shape))

    def read_all(self) -> torch.Tensor:
        return torch.cat([t.narrow(dim, off, shape[dim]).reshape(-1) for t, dim, off, shape, _, _ in self.blocks])

    def _split(self, positions: torch.Tensor):
        """(block, flat element indices into its tensor, slice of `positions`) for every block hit."""
        which = torch.searchsorted(self.starts, positions.cpu(), right=True) - 1
        bounds = torch.searchsorted(which, torch.arange(len(self.blocks) + 1))
        for b, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            if lo == hi:
                continue
            t, dim, off, shape, start, _ = self.blocks[b]
            q = positions[lo:hi] - start
            flat = torch.zeros_like(q)
            for k in range(len(shape) - 1, -1, -1):
                coord = q % shape[k]
                q = q // shape[k]
                flat += (coord + (off if k == dim else 0)) * t.stride(k)
            yield t, flat, slice(lo, hi)

    def read(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(positions.numel(), dtype=dtype, device=positions.device)
        for t, flat, sl in self._split(positions):
            out[sl] = t.view(-1)[flat.to(t.device)].to(out.device)
        return out

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        for t, flat, sl in self._split(positions):
            t.view(-1)[flat.to(t.device)] = values[sl].to(t.device)


# ----------------------------------------------------------------------------------------------- executor

class DeltaExecutor(ReshardExecutor):
    """Runs one delta sync of `plan` on this rank (see the module docstring): `run(tensors)` writes into the
    engine's live tensors (`tensors`: target name → tensor; None on a rank that only sends)."""

    tamper = None
    """Tests only: called with (bucket index, sender, payload) on every received payload before it is used,
    to stand in for a transport that corrupts bytes."""

    def __init__(self, plan, local_params, state: DeltaState, *, group=None, device=None,
                 engine_dtype: torch.dtype, verify: bool = False):
        super().__init__(plan, local_params, group=group, device=device, out_dtype=engine_dtype)
        self.state, self.dtype, self.verify = state, engine_dtype, verify
        self._element_size = torch.empty((), dtype=engine_dtype).element_size()
        self.dstats = DeltaStats(verified=verify)
        # receiver: (bucket, sender) → its _PieceMap over the engine's tensors of this sync (an engine may have
        # replaced a tensor object since the last one)
        self.maps: dict = {}

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
        st.full = full
        st.forced_full = int(full and self.state.version >= 0)
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
            key = (bucket.index, s)
            if key not in self.maps:
                self.maps[key] = _PieceMap(inc[s], tensors)
            a, b = self._apply(key, header, payload)
            ok, verify_ok = ok and a, verify_ok and b
        return ok, verify_ok

    def _encode(self, b: int, g: int, blocks: list[torch.Tensor], full: bool):
        """(header, payload) of image (bucket b → receiver g); updates the mirror and its checksum."""
        image = self._cast(reshard_pack(blocks))
        key, st = (b, g), self.dstats
        old = self.state.mirror.get(key)
        if full or old is None:
            kind, payload, n = FULL, _as_bytes(image), image.numel()
            self.state.mirror[key] = image
            self.state.sent_sums[key] = image_checksum(image)
        else:
            kind, payload, idx = encode_delta(image, old)
            n = idx.numel()
            self.state.sent_sums[key] += word_checksum_delta(idx, old[idx], image[idx])
            old[idx] = image[idx]
            if self.verify:  # the fresh image's own checksum: proves the mirror's bookkeeping too
                self.state.sent_sums[key] = image_checksum(image)
        st.kinds[KIND_NAMES[kind]] += 1
        header = torch.tensor([kind, image.numel(), n, payload.numel(), self.state.sent_sums[key],
                               self.state.version, int(self.verify)], dtype=torch.int64)
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

    def _apply(self, key, header: torch.Tensor, payload: torch.Tensor) -> tuple[bool, bool]:
        """Checks one image's payload against its checksum and writes it into the engine: (payload ok, full
        check ok). Nothing is written when the payload fails."""
        kind, numel, changed, _, expect, base, verify = (int(x) for x in header.tolist())
        pmap, st, es = self.maps[key], self.dstats, self._element_size
        st.elements += numel
        st.changed += changed
        st.engine_bytes += payload.numel() + 8 * _HEADER
        st.full_bytes += numel * es
        if numel != pmap.numel:
            return False, True
        if kind == FULL:
            if payload.numel() != numel * es:
                return False, True
            image = payload.view(self.dtype)
            if image_checksum(image) != expect:
                return False, True
            pmap.write_all(image)
            self.state.held_sums[key] = expect
        else:
            if base != self.state.version or key not in self.state.held_sums:
                return False, True
            try:
                idx, values = decode_delta(kind, payload, numel, changed, self.dtype)
            except VerlRuntimeError:
                return False, True
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
                return False, True
            predicted = self.state.held_sums[key] + word_checksum_delta(idx, pmap.read(idx, self.dtype), values)
            if predicted != expect:
                return False, True
            pmap.write(idx, values)
            self.state.held_sums[key] = expect
        if verify:
            return True, image_checksum(pmap.read_all()) == expect
        return True, True
