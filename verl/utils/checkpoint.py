"""Checkpoints as data: DCP tensors, JSON metadata and a manifest written last; nothing of ours is a pickle.

Layout of ``<output_dir>/checkpoints``::

    step_000010/
        .metadata, __*_*.distcp    # DCP: every model and optimizer (torch engines: de-duplicated across
                                   # ranks; megatron engines: each rank's TP/PP shard and optimizer state)
        trainer_state.json  # step, data position, KL controller, LR schedulers, config (rank 0)
        rng_rank{r}.json    # each rank's torch / CUDA / Python / NumPy RNG states, restored exactly
        manifest.json       # written last: format, run id, step, world size, every file's size and sha256
    latest                  # name of the newest complete checkpoint (informational)

Saving: every rank writes into ``.tmp-step_000010``; after a barrier rank 0 hashes the files, writes
``manifest.json`` and renames the directory into place. Re-saving a step renames the old directory to
``.old-step_000010``, the new one in, then deletes the old: a kill at any moment leaves one complete copy (a lone
``.old-`` directory is renamed back at the next start).

Resuming verifies the manifest (every file present, with its size and sha256) before anything is parsed.
``trainer.resume=auto`` takes the newest checkpoint that verifies and loads, warning about each newer one it
skips and why (empty, no manifest, truncated, corrupted); an explicit path that fails is a `VerlConfigError`
naming the file and what is wrong.

Pickle: DCP writes its ``.metadata`` file, and non-tensor values such as optimizer hyper-parameters, as Python
pickles, and unpickling can run arbitrary code. The manifest catches truncation and corruption but not a crafted
checkpoint (whoever crafts one can write a matching manifest), so verl also reads ``.metadata`` with an
unpickler that admits only DCP's own metadata classes, and non-tensor values with
``torch.load(weights_only=True)``. A checkpoint without a manifest is refused. ``trainer.trust_checkpoint=true``
lifts both the manifest requirement and the restricted unpickling: only for checkpoints you trust.

Ownership (`verl.utils.run_folder`): a fresh run draws a run id, which every manifest it writes carries and a
resumed run keeps, and records each step folder in the run manifest before creating it. Pruning, replacing a step
and ``trainer.overwrite=true`` delete only what that manifest names (a step folder's files: those its own
manifest lists); a folder holding an earlier run refuses a fresh run without overwrite, and ``resume=auto`` with
no checkpoint to resume from refuses a folder that holds an earlier run's history.

Restored values are checked before use: the manifest, each RNG state and the trainer state (against the spec
the caller gives) for type and range, every JSON file for size (``trainer.max_state_mb`` bounds
trainer_state.json, when written and when read).

World size: a checkpoint of N processes resumed by M != N is resharded by DCP when every model is a torch or
FSDP2 module (saved by state-dict names): rank r < N restores rank r's RNG state, a rank r >= N seeds torch,
Python and NumPy from (seed, step, r) (`derived_seed`), the saved states of ranks >= M go unused, and the
change is reported. Engines that save per-rank shards (megatron's TP/PP layout) cannot be resharded: refused,
naming both sizes.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pickle
import random
import re
import uuid
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from verl.distributed import Placement
from verl.distributed.collectives import barrier
from verl.distributed.placement import comm_device
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.utils.run_folder import RUN_MANIFEST, RunFolder
from verl.utils.state_check import (MAX_STEP, Dict, Each, Float, Int, List, Opt, Spec, StateError, Str,
                                    check_json_size, read_json, validate)

FORMAT = "verl-checkpoint-v1"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_OLD_DIR = re.compile(r"^\.old-(step_\d+)(-[0-9a-f]{8})?$")
_SMALL_JSON = 64 << 20  # manifest.json, rng_rank*.json: kilobytes in practice
# append-only: a resumed run may continue an unrecorded one
_LOGS = ("metrics.jsonl", "samples.jsonl", "val_generations.jsonl")


# -- RNG states as JSON (torch / CUDA states are byte tensors, Python's and NumPy's are integer tuples) ---------
def bytes_to_b64(t: torch.Tensor) -> str:
    """A byte tensor (uint8) as base64 text, for the JSON files of a checkpoint."""
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def b64_to_bytes(s: str) -> torch.Tensor:
    """The uint8 tensor `bytes_to_b64` wrote (writable: it owns its buffer)."""
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {"torch": bytes_to_b64(torch.get_rng_state()),
             "python": {"version": version, "state": list(internal), "gauss_next": gauss},
             "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes_to_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _b64_bytes(n: int) -> Spec:
    """Base64 text of exactly `n` bytes."""
    def check(value: Any, where: str) -> None:
        Str(max_len=4 * (n + 2) // 3 + 4, pattern=r"[A-Za-z0-9+/]*={0,2}").check(value, where)
        if len(base64.b64decode(value)) != n:
            raise StateError(where, f"holds {len(base64.b64decode(value))} bytes of generator state, not {n}")
    return Each(check)


def rng_spec() -> Spec:
    """What a rng_rank{r}.json must hold (the sizes of this torch's / Python's / NumPy's generator states)."""
    word = Int(0, 2**32 - 1)
    cuda_bytes = torch.cuda.get_rng_state().numel() if torch.cuda.is_available() else 1 << 20
    return Dict({"torch": _b64_bytes(torch.get_rng_state().numel()),
                 "python": Dict({"version": Int(3, 3), "state": List(word, length=625), "gauss_next": Opt(Float())}),
                 "numpy": Dict({"kind": Str(choices=("MT19937",)), "keys": List(word, length=624), "pos": Int(0, 624),
                                "has_gauss": Int(0, 1), "cached_gaussian": Float()}),
                 "cuda": List(Str(max_len=4 * cuda_bytes // 3 + 4), max_len=1024)}, optional=("cuda",))


def derived_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank that has no saved RNG state (a resume on more processes than saved the checkpoint)."""
    return int.from_bytes(hashlib.sha256(f"verl-rng:{seed}:{step}:{rank}".encode()).digest()[:8], "little")


def seed_rng(seed: int) -> None:
    """Seeds torch (CPU and CUDA), Python and NumPy from one integer."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(b64_to_bytes(state["torch"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([b64_to_bytes(s) for s in state["cuda"]])


# -- reading DCP without running code ---------------------------------------------------------------------------
_DCP_MD = "torch.distributed.checkpoint.metadata"
# every global a DCP `.metadata` pickle names (found by listing them for torch 2.x checkpoints of verl's states):
# plain dataclasses, enums, torch.Size and a layout lookup by name; none runs code with attacker arguments
_METADATA_GLOBALS = {
    *((_DCP_MD, n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                             "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"), ("pathlib._local", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP checkpoint metadata; refused, since "
                                     f"unpickling it could run code")


class _SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through the allow-list above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{name} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor values are unpickled with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)  # refuses anything but tensors and plain values
        clean = io.BytesIO()
        torch.save(obj, clean)  # the parent unpickles unrestricted: hand it our own re-serialisation
        clean.seek(0)
        super().load_bytes(read_item, clean)


def _describe(e: BaseException) -> str:
    """One line per failing rank of a DCP error (its str() is a traceback per rank)."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {_describe(exc)}" for r, (exc, _) in sorted(e.failures.items()))
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    # torch's weights_only refusal is a page of advice; its one line that names the offending global:
    line = next((x for x in lines if x.startswith("WeightsUnpickler error:")), lines[0])
    if isinstance(e, pickle.UnpicklingError) and "could run code" not in line:
        line += " (refused: unpickling it could run code)"
    return f"{type(e).__name__}: {line}"


# -- manifests --------------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(directory: Path) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    with ThreadPoolExecutor(max_workers=4) as pool:  # hashlib releases the GIL on large buffers
        digests = list(pool.map(_sha256, files))
    return {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": d}
            for p, d in zip(files, digests)}


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FILE_SPEC = Dict({"size": Int(0, 1 << 50), "sha256": Str(64, pattern="[0-9a-f]{64}")})
_MANIFEST_SPEC = Dict({"format": Str(choices=(FORMAT,)), "run_id": Str(64, pattern=r"[0-9a-f]{8,64}"),
                       "step": Int(0, MAX_STEP), "world_size": Int(1, 1 << 20),
                       "files": Dict({}, extra=_FILE_SPEC, max_len=1 << 20)})


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint `path`; ValueError saying what is wrong with it."""
    file = path / MANIFEST
    try:
        manifest = read_json(file, _SMALL_JSON)
    except OSError as e:
        raise ValueError(f"{file} is unreadable ({e})") from e
    except StateError as e:
        raise ValueError(f"{file} is unreadable ({e.why})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{file} is not a {FORMAT} manifest")
    try:
        return validate(manifest, _MANIFEST_SPEC)
    except StateError as e:
        raise ValueError(f"{file} is not a valid {FORMAT} manifest: {e}") from e


def verify(path: str | Path) -> str | None:
    """What is wrong with the checkpoint directory `path`, in words (None: complete and intact)."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    if not any(path.iterdir()):
        return f"{path} is empty"
    if not (path / MANIFEST).is_file():
        return f"{path} has no {MANIFEST} (an interrupted save, or not written by this verl)"
    try:
        manifest = read_manifest(path)
    except ValueError as e:
        return str(e)
    for required in (".metadata", TRAINER_STATE):
        if required not in manifest["files"]:
            return f"{path / MANIFEST} does not list {required}"
    for rel, want in manifest["files"].items():
        f = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"{path / MANIFEST} names a file outside the checkpoint: {rel!r}"
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != want.get("size"):
            return f"{f} has {f.stat().st_size} bytes, its manifest says {want.get('size')} (truncated or overwritten)"
        if _sha256(f) != want.get("sha256"):
            return f"{f} does not match the sha256 in its manifest (corrupted)"
    return None


# -- agreement between ranks (JSON over a byte tensor: no pickle between ranks either) -------------------------
def broadcast_json(obj: Any, world: Placement) -> Any:
    """Rank 0's `obj` (JSON data) on every rank of `world` (collective)."""
    if not world.distributed:
        return obj
    dev = comm_device()
    data = json.dumps(obj).encode() if world.is_main else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if world.is_main
           else torch.empty(int(size), dtype=torch.uint8, device=dev))
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def all_ok(ok: bool, world: Placement) -> bool:
    if not world.distributed:
        return ok
    t = torch.tensor([int(ok)], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def checkpoint_tensors(modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
                       sharded: dict[str, Any], for_load: bool) -> dict[str, Any]:
    """The one state dict DCP saves / loads into: torch modules by state-dict names, sharded engines' own."""
    out = {name: eng.dcp_state(for_load=for_load) for name, eng in sharded.items()}
    for name, (model, optim) in modules.items():
        if optim is None:
            out[name] = {"model": model.state_dict()}
        else:  # a frozen base (LoRA: only the adapters train) is the model it was loaded from: not saved
            msd, osd = get_state_dict(model, optim, options=StateDictOptions(ignore_frozen_params=True))
            frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
            out[name] = {"model": {k: v for k, v in msd.items() if k not in frozen}, "optim": osd}
    return out


def apply_state(tensors: dict[str, Any], modules: Modules, sharded: dict[str, Any], source: str) -> None:
    """Loads what `checkpoint_tensors(..., for_load=True)` holds once filled (from a checkpoint or a snapshot)
    into the models, optimizers and sharded engines."""
    for name, (model, optim) in modules.items():
        if optim is None:
            model.load_state_dict(tensors[name]["model"])
        else:
            set_state_dict(model, optim, model_state_dict=tensors[name]["model"],
                           optim_state_dict=tensors[name]["optim"],
                           options=StateDictOptions(strict=not _frozen(model)))
    for name, eng in sharded.items():
        eng.load_dcp_state(tensors[name], source)


def _frozen(model: torch.nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


Modules = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]


class CheckpointManager:
    """Saves and restores models, optimizers and trainer state under `root`; keeps this run's newest `keep`.

    `trust`: load checkpoints without a manifest, and unpickle DCP's metadata unrestricted (trainer.trust_checkpoint).
    `folder`: the run's `RunFolder` (the trainer's, at trainer.output_dir, with `root` inside it); without one the
    manager keeps its own run manifest in `root`. `seed`: trainer.seed, for ranks a checkpoint has no RNG state
    for. `max_state_bytes`: the bound on trainer_state.json (trainer.max_state_mb).
    """

    def __init__(self, root: str | Path, world: Placement, keep: int = 2, *, trust: bool = False,
                 folder: RunFolder | None = None, seed: int = 0, max_state_bytes: int = 1 << 30):
        self.root, self.world, self.keep, self.trust = Path(root), world, keep, trust
        self.folder = folder if folder is not None else RunFolder(self.root, active=world.is_main)
        inner = self.root.relative_to(self.folder.root).as_posix()
        self._prefix = "" if inner == "." else inner + "/"
        self.seed, self.max_state_bytes = seed, max_state_bytes
        self.run_id = uuid.uuid4().hex  # `resolve` replaces it with the resumed run's
        self.saved_world_size: int | None = None  # the number of processes that wrote the checkpoint `load` took
        self.from_snapshot: int | None = None  # `resolve`: the recovery snapshot step to restore instead
        self._auto = False
        self._prior_run: str | None = None  # rank 0: the run the output folder's manifest names
        self._fallbacks: list[Path] = []  # rank 0, resume=auto: older checkpoints not yet tried, newest first
        self._skipped: list[str] = []

    def list(self) -> list[Path]:
        """The step directories, oldest first (unverified)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def _rel(self, path: Path) -> str:
        return self._prefix + path.name

    # -- choosing what to resume -----------------------------------------------------------------------------
    def resolve(self, resume: str | None, *, overwrite: bool = False,
                destinations: Sequence[tuple[str, bool]] = (), snapshot_step: int | None = None) -> Path | None:
        """`resume` setting → a verified checkpoint directory (None: start fresh), the same on every rank.

        `destinations`: (path relative to the run folder, replaced as a whole?) of what the run writes besides
        checkpoints (metrics.jsonl, hf_actor, ...). Without `resume` the run claims the folder: an earlier run's
        (its manifest) is refused unless `overwrite`, which deletes exactly that run's entries. 'auto' takes the
        newest checkpoint of the folder's run that verifies; with none, it starts fresh only where no earlier
        run left history. Anything at a destination that no manifest names is refused. Sets `run_id`.

        `snapshot_step`: the newest step every rank holds a recovery snapshot of, for the folder's run
        (`verl.utils.snapshot`): with resume='auto', taken (None returned, `from_snapshot` set) when no
        checkpoint is as new."""
        self._auto = resume == "auto"
        self.from_snapshot = None
        decision, failure = None, None
        if self.world.is_main:
            try:
                decision = self._decide(resume, overwrite, [*destinations, (self._prefix + "latest", False)],
                                        snapshot_step)
            except Exception as e:  # the other ranks wait on the broadcast: tell them before raising
                decision, failure = {"error": str(e)}, e
        decision = broadcast_json(decision, self.world)
        if failure is not None:
            raise failure
        if "error" in decision:
            raise VerlConfigError(f"rank 0 could not resolve trainer.resume={resume!r}: {decision['error']}")
        self.run_id = decision["run_id"]
        self.from_snapshot = decision.get("snapshot")
        return Path(decision["path"]) if decision["path"] else None

    def _decide(self, resume: str | None, overwrite: bool, destinations: list[tuple[str, bool]],
                snapshot_step: int | None = None) -> dict[str, Any]:
        prior = self.folder.read()
        if prior is not None:
            self.folder.load(prior)
        self._prior_run = prior["run_id"] if prior is not None else None
        self._recover_replaced()
        if resume is None:
            return self._fresh(prior, overwrite, destinations)
        if resume == "auto":
            self._fallbacks, self._skipped = self.list()[::-1], []
            path = self._next_valid()
            if snapshot_step is not None and prior is not None and (path is None or _step_of(path) < snapshot_step):
                self._continue(prior, prior["run_id"], snapshot_step, None, destinations)
                return {"path": None, "run_id": prior["run_id"], "snapshot": snapshot_step}
            if path is None and self._skipped:
                raise VerlConfigError(f"trainer.resume=auto found no usable checkpoint in {self.root}: "
                                      f"{'; '.join(self._skipped)}. Repair or remove these, or start over with "
                                      f"trainer.overwrite=true and trainer.resume unset")
            if path is None:
                return self._restart(prior, destinations)
        else:
            path = Path(resume)
            problem = self._problem(path)
            if problem is not None:
                raise VerlConfigError(f"trainer.resume={resume!r} is not a complete verl checkpoint: {problem}. Pick "
                                      f"another one, or trainer.resume=auto for the newest valid one in {self.root}")
        run_id = self._run_id_of(path)
        self._continue(prior, run_id, _step_of(path), path, destinations)
        return {"path": str(path), "run_id": run_id}

    def _fresh(self, prior: dict | None, overwrite: bool, destinations: list[tuple[str, bool]]) -> dict[str, Any]:
        """A new run: refuses an earlier run's folder (or deletes that run's entries under `overwrite`)."""
        where = f"trainer.output_dir={str(self.folder.root)!r}"
        if prior is not None:
            shown = _shown(sorted(e for e in prior["entries"] if os.path.lexists(self.folder.root / e)))
            if not overwrite:
                raise VerlConfigError(f"{where} holds an earlier run (run {prior['run_id'][:8]}: {shown}) and "
                                      f"trainer.resume is not set: continue that run with trainer.resume=auto, or "
                                      f"start over with trainer.overwrite=true (deletes exactly what that run "
                                      f"recorded in {RUN_MANIFEST}), or pick another trainer.output_dir")
            warnings.warn(f"trainer.overwrite=true: deleting the earlier run {prior['run_id'][:8]} ({shown})",
                          stacklevel=5)
            self.folder.remove_all()
        self._refuse_foreign(destinations, self.list())
        run_id = uuid.uuid4().hex
        self.folder.start(run_id, "fresh")
        return {"path": None, "run_id": run_id}

    def _restart(self, prior: dict | None, destinations: list[tuple[str, bool]]) -> dict[str, Any]:
        """resume=auto without a checkpoint: fresh, unless an earlier run left history here (an error naming it:
        starting over would put a second run's steps after the first's)."""
        rels = {rel for rel, _ in destinations} | set(self.folder.entries)
        history = sorted(r for r in rels if self.folder.entries.get(r) != "tree" and _has_content(self.folder.root / r))
        if history:
            raise VerlConfigError(f"trainer.resume=auto found no checkpoint to resume from in {self.root}, but "
                                  f"trainer.output_dir={str(self.folder.root)!r} holds an earlier run's history "
                                  f"({_shown(history)}), which a fresh start would continue as if it were its own. "
                                  f"Resume from a checkpoint elsewhere (trainer.resume=PATH), start over with "
                                  f"trainer.overwrite=true and trainer.resume unset, or pick another "
                                  f"trainer.output_dir")
        if prior is None:
            return self._fresh(None, False, destinations)
        for rel, kind in list(self.folder.entries.items()):  # a run killed before it wrote anything: again
            if kind == "tree":
                self.folder.remove(rel)
        self.folder.start(prior["run_id"], "restart")
        return {"path": None, "run_id": prior["run_id"]}

    def _continue(self, prior: dict | None, run_id: str, step: int, path: Path | None,
                  destinations: list[tuple[str, bool]]) -> None:
        """Resuming run `run_id` at `step` from checkpoint `path` (None: from the recovery snapshots): the output
        folder must be that run's (or hold no run manifest)."""
        if prior is not None and prior["run_id"] != run_id:
            raise VerlConfigError(f"{path} belongs to run {run_id[:8]}, but trainer.output_dir="
                                  f"{str(self.folder.root)!r} holds run {prior['run_id'][:8]} ({RUN_MANIFEST}); a "
                                  f"resumed run writes into its own folder: set trainer.output_dir to that run's "
                                  f"folder, or to a new one")
        if prior is None:  # a folder without a run manifest: its checkpoints of this run say so in theirs
            for p in self.list():
                if self._owner(p) == run_id:
                    self.folder.entries[self._rel(p)] = "checkpoint"
        newer = [p for p in self.list() if _step_of(p) > step] if path is None or path.parent == self.root else []
        logs = [(r, w) for r, w in destinations if r in _LOGS and self.folder.foreign(r)]
        for rel, _ in logs:
            warnings.warn(f"{self.folder.root / rel} is recorded by no run manifest (a folder from an earlier "
                          f"verl?): the resumed run appends to it and never rewrites it", stacklevel=5)
        self._refuse_foreign([d for d in destinations if d not in logs], newer)
        self.folder.start(run_id, "resume")

    def _refuse_foreign(self, destinations: list[tuple[str, bool]], steps: list[Path]) -> None:
        blocking = [r for rel, whole in destinations for r in self.folder.foreign(rel, whole)]
        blocking += [self._rel(p) for p in steps if not self.folder.owns(self._rel(p)) and _has_content(p)]
        if blocking:
            raise VerlConfigError(f"trainer.output_dir={str(self.folder.root)!r} has files that no run recorded "
                                  f"({RUN_MANIFEST}) where this run writes: {_shown(sorted(blocking))}. verl never "
                                  f"replaces or deletes them (trainer.overwrite=true included): move them away, or "
                                  f"pick another trainer.output_dir")

    def _problem(self, path: Path) -> str | None:
        problem = verify(path)
        if problem is not None and self.trust and not (path / MANIFEST).exists() and (path / ".metadata").is_file():
            warnings.warn(f"{path} has no {MANIFEST}: loading it unverified, with DCP's unrestricted unpickling, "
                          f"because trainer.trust_checkpoint=true", stacklevel=4)
            return None
        return problem

    def _next_valid(self) -> Path | None:
        """Rank 0: pops `_fallbacks` up to the first checkpoint of the folder's run that verifies, warning about
        each one skipped."""
        while self._fallbacks:
            path = self._fallbacks.pop(0)
            problem = self._problem(path)
            owner = self._owner(path)
            if problem is None and self._prior_run is not None and owner is not None and owner != self._prior_run:
                problem = (f"{path} belongs to run {owner[:8]}, not to this folder's run {self._prior_run[:8]} "
                           f"({RUN_MANIFEST})")
            if problem is None:
                return path
            self._skipped.append(problem)
            warnings.warn(f"trainer.resume=auto skips {path}: {problem}", stacklevel=4)
        return None

    def _run_id_of(self, path: Path | None) -> str:
        """The run a checkpoint belongs to (a trusted one without a manifest: the output folder's run, if any,
        else a new run id)."""
        try:
            return read_manifest(path)["run_id"] if path is not None else uuid.uuid4().hex
        except ValueError:
            return self._prior_run or uuid.uuid4().hex

    def _recover_replaced(self) -> None:
        """Rank 0: finishes a replacement of this run's that a kill interrupted (see `_move_into_place`)."""
        for old in sorted(self.root.glob(".old-step_*")) if self.root.is_dir() else []:
            m = _OLD_DIR.match(old.name)
            if m is None or not self.folder.owns(self._rel(old)):
                continue  # not this run's: left alone
            final = old.with_name(m.group(1))
            if final.exists():
                self.folder.remove(self._rel(old))  # the replacement is in place
            else:
                self.folder.record(self._rel(final), "checkpoint")
                os.rename(old, final)
                self.folder.forget(self._rel(old))
                warnings.warn(f"restored {final}: a save that was replacing it was interrupted", stacklevel=4)

    # -- saving ----------------------------------------------------------------------------------------------
    def save(self, step: int, modules: Modules, sharded: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """`modules` (torch models and optimizers) and `sharded` (engines that lay out their own per-rank
        state, e.g. megatron's: `dcp_state(for_load)` / `load_dcp_state(state, source)`) go into one DCP
        checkpoint; `trainer_state` (the same on every rank) must be JSON data within `max_state_bytes`."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}"
        try:
            check_json_size(trainer_state, self.max_state_bytes, TRAINER_STATE)
        except StateError as e:
            raise VerlRuntimeError(f"checkpoint of step {step}: {e}; raise trainer.max_state_mb "
                                   f"(now {self.max_state_bytes / 2**20:g}) if that is expected") from None
        problem = None
        if self.world.is_main:
            try:
                problem = self._prepare(final, tmp)
            except Exception as e:  # the other ranks wait on the broadcast: tell them before raising
                problem = f"{type(e).__name__}: {e}"
        problem = broadcast_json(problem, self.world)
        if problem is not None:
            raise VerlRuntimeError(f"checkpoint of step {step} not written: {problem}")
        with warnings.catch_warnings():  # DCP warns that a lone process saves without a process group
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(checkpoint_tensors(modules, sharded, for_load=False), checkpoint_id=str(tmp))
        _write_json(tmp / f"rng_rank{self.world.rank}.json", rng_state())
        if self.world.is_main:
            _write_json(tmp / TRAINER_STATE, trainer_state)
        barrier(self.world)
        if self.world.is_main:
            _write_json(tmp / MANIFEST, {"format": FORMAT, "run_id": self.run_id, "step": step,
                                         "world_size": self.world.world_size, "files": _hash_files(tmp)})
            _fsync_dir(tmp)
            self._move_into_place(tmp, final)
            pointer = self.root / ".latest.tmp"
            self.folder.record(self._rel(pointer), "file")
            self.folder.record(self._prefix + "latest", "file")
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.root / "latest")
            self._prune()
        barrier(self.world)
        return final

    def _prepare(self, final: Path, tmp: Path) -> str | None:
        """Rank 0, before a save: the temporary folder recorded and created; what is in the way, in words."""
        self._ensure_started()
        if not os.path.lexists(self.root):
            if self._prefix:
                self.folder.record(self._prefix.rstrip("/"), "dir")
            self.root.mkdir(parents=True)
        for stale in self.root.glob(".tmp-step_*"):  # leftovers of this run's crashed saves
            if self.folder.owns(self._rel(stale)):
                self.folder.remove(self._rel(stale))
        if os.path.lexists(tmp):
            return f"{tmp} is in the way and is not this run's (no {RUN_MANIFEST} entry names it): move it away"
        if final.is_dir() and not final.is_symlink() and not self.folder.owns(self._rel(final)) and \
                not _has_content(final):
            warnings.warn(f"replacing the empty folder {final} (no run recorded it) by this step's checkpoint",
                          stacklevel=4)
            final.rmdir()
        if os.path.lexists(final) and not self.folder.owns(self._rel(final)):
            return (f"{final} exists and is not this run's (no {RUN_MANIFEST} entry names it), so verl does not "
                    f"replace it: move it away")
        self.folder.record(self._rel(tmp), "tree")
        tmp.mkdir()
        return None

    def _ensure_started(self) -> None:
        """Rank 0: a manager that saves without `resolve` claims a new folder (or continues its own run)."""
        if self.folder.run_id is not None:
            return
        prior = self.folder.read()
        if prior is not None and prior["run_id"] != self.run_id:
            raise VerlConfigError(f"{self.folder.root} holds run {prior['run_id'][:8]} ({RUN_MANIFEST}); call "
                                  f"resolve() before saving, to continue or replace it")
        if prior is not None:
            self.folder.load(prior)
        self.folder.start(self.run_id, "fresh" if prior is None else "resume")

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        """Rename-then-delete: at every moment `final` or `.old-<final>-<id>` holds a complete checkpoint."""
        old_rel = None
        if os.path.lexists(final):  # re-saving a step (e.g. a run resumed from an earlier one reaching it again)
            old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
            old_rel = self._rel(old)
            self.folder.record(old_rel, "checkpoint")
            os.rename(final, old)
        self.folder.record(self._rel(final), "checkpoint")
        os.rename(tmp, final)
        self.folder.forget(self._rel(tmp))
        _fsync_dir(self.root)
        if old_rel is not None:
            self.folder.remove(old_rel)  # only the files its manifest lists: anything added by hand stays

    def _prune(self) -> None:
        """Deletes this run's checkpoints beyond the newest `keep`; never another run's, nor unrecorded ones."""
        if self.keep <= 0:
            return
        mine = [p for p in self.list() if self.folder.owns(self._rel(p)) and self._owner(p) == self.run_id]
        for old in mine[:-self.keep]:
            self.folder.remove(self._rel(old))

    @staticmethod
    def _owner(path: Path) -> str | None:
        try:
            return read_manifest(path)["run_id"]
        except ValueError:
            return None

    # -- loading ---------------------------------------------------------------------------------------------
    def load(self, path: str | Path, modules: Modules, sharded: dict[str, Any] | None = None,
             state_spec: Spec | None = None) -> dict[str, Any]:
        """Restores `modules` and `sharded` engines in place and this rank's RNG; returns the trainer state,
        checked against `state_spec` (and its step against the manifest's) before anything is restored.

        After `resolve('auto')`, a checkpoint that verified but does not load gives way, with a warning, to the
        next older one that verifies; otherwise the failure is a VerlConfigError naming the checkpoint."""
        path = Path(path)
        while True:
            state, problem = self._try_load(path, modules, sharded or {}, state_spec)
            if problem is None:
                self._report_resharding(path)
                return state
            older = self._fall_back(path, problem)
            if older is None:
                raise VerlConfigError(
                    f"checkpoint {str(path)!r} could not be loaded: {problem}. Resume from another checkpoint "
                    f"(trainer.resume=auto falls back to the newest one that verifies and loads); if the model or "
                    f"the parallel layout changed, resume with the ones it was saved with")
            path = older

    def _try_load(self, path: Path, modules: Modules, sharded: dict[str, Any],
                  state_spec: Spec | None) -> tuple[dict | None, str | None]:
        """(trainer state, None) or (None, what went wrong), agreed by every rank."""
        state, problem, saved = None, None, None
        try:
            saved = self._saved_world(path)
            if saved != self.world.world_size and sharded:
                raise VerlConfigError(f"it was written by {saved} processes and this run has "
                                      f"{self.world.world_size}: the engines of {', '.join(sharded)} save each rank's "
                                      f"shard under keys of its own (megatron's TP/PP layout), which cannot be "
                                      f"resharded; resume with {saved} processes (torchrun --nproc_per_node={saved})")
            rng = self._read_rng(path, saved)
            state = self._read_state(path, state_spec)
            tensors = checkpoint_tensors(modules, sharded, for_load=True)
            self._dcp_load(tensors, path)
            apply_state(tensors, modules, sharded, str(path))
            if rng is not None:
                set_rng_state(rng)
            else:  # a rank the checkpoint has no state for (more processes now than then)
                seed_rng(derived_seed(self.seed, state["step"] if isinstance(state, dict) else 0, self.world.rank))
        except VerlConfigError as e:
            problem = str(e)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            problem = _describe(e)
        if not all_ok(problem is None, self.world):
            return None, problem or "another rank could not load it (see that rank's error)"
        self.saved_world_size = saved
        return state, None

    def _saved_world(self, path: Path) -> int:
        """How many processes wrote checkpoint `path` (its manifest; trusted manifest-less: its RNG files)."""
        try:
            return read_manifest(path)["world_size"]
        except ValueError:
            ranks = [int(m.group(1)) for p in path.glob("rng_rank*.json") if (m := re.match(r"rng_rank(\d+)\.json$",
                                                                                             p.name))]
            return max(ranks) + 1 if ranks else self.world.world_size

    def _read_rng(self, path: Path, saved: int) -> dict[str, Any] | None:
        """This rank's saved RNG state, checked (None for a rank beyond those that saved)."""
        rank = self.world.rank
        if rank >= saved:
            return None
        f = path / f"rng_rank{rank}.json"
        if not f.is_file():
            raise VerlConfigError(f"it has no RNG state for rank {rank} ({f.name}), though {saved} processes "
                                  f"wrote it")
        try:
            return validate(read_json(f, _SMALL_JSON), rng_spec())
        except StateError as e:
            raise VerlConfigError(f"{f.name}: {e.why if e.where == str(f) else e}") from None

    def _read_state(self, path: Path, spec: Spec | None) -> Any:
        """trainer_state.json, bounded, checked against `spec`, its step equal to the manifest's."""
        f = path / TRAINER_STATE
        try:
            state = read_json(f, self.max_state_bytes)
            if spec is not None:
                validate(state, spec)
        except StateError as e:
            raise VerlConfigError(f"{TRAINER_STATE}: {e.why if e.where == str(f) else e}"
                                  + (" (trainer.max_state_mb)" if "above the limit" in e.why else "")) from None
        try:
            want = read_manifest(path)["step"]
        except ValueError:
            return state  # trusted, without a manifest
        if not isinstance(state, dict) or state.get("step") != want:
            got = state.get("step") if isinstance(state, dict) else state
            raise VerlConfigError(f"{TRAINER_STATE}: step {got!r} disagrees with its manifest's step {want}")
        return state

    def _report_resharding(self, path: Path) -> None:
        n, m = self.saved_world_size, self.world.world_size
        if n == m or n is None or not self.world.is_main:
            return
        seeded = f"ranks {n}..{m - 1} seed theirs from (trainer.seed, step, rank)" if m > n else \
            f"the saved states of ranks {m}..{n - 1} are unused"
        warnings.warn(f"resuming {path}, written by {n} processes, on {m}: DCP reshards the model and optimizer "
                      f"states by name; RNG: ranks 0..{min(n, m) - 1} restore their own saved states, {seeded}",
                      stacklevel=3)

    def _dcp_load(self, tensors: dict[str, Any], path: Path) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if self.trust:
                dcp.load(tensors, checkpoint_id=str(path))
            else:
                dcp.load(tensors, storage_reader=_SafeReader(str(path)), planner=_SafeLoadPlanner())

    def _fall_back(self, failed: Path, problem: str) -> Path | None:
        """Collective: the next older checkpoint that verifies, after resume=auto (else None)."""
        decision = None
        if self.world.is_main:
            older = None
            if self._auto:
                warnings.warn(f"trainer.resume=auto: {failed} could not be loaded ({problem}); trying an older "
                              f"checkpoint", stacklevel=3)
                older = self._next_valid()
            decision = {"path": str(older) if older else None, "run_id": self._run_id_of(older)}
            if older is not None and decision["run_id"] != self.folder.run_id:
                self.folder.start(decision["run_id"], "resume")
        decision = broadcast_json(decision, self.world)
        if decision["path"] is None:
            return None
        self.run_id = decision["run_id"]
        return Path(decision["path"])


def _step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def _has_content(path: Path) -> bool:
    """A non-empty file, or a folder with anything in it (what counts as a run's history)."""
    if path.is_symlink() or path.is_file():
        return path.is_symlink() or path.stat().st_size > 0
    return path.is_dir() and any(path.iterdir())


def _shown(rels: Sequence[str], n: int = 8) -> str:
    """Paths for a message: a folder stands for what is listed inside it."""
    rels = [r for r in rels if not any(r.startswith(f"{o}/") for o in rels)]
    return ", ".join(rels[:n]) + (f" and {len(rels) - n} more" if len(rels) > n else "") if rels else "nothing"
