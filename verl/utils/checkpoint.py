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

Ownership: a fresh run draws a run id, which every manifest it writes carries and a resumed run keeps. Pruning
deletes only this run's checkpoints; a fresh run refuses an output folder an earlier run used unless
``trainer.overwrite=true`` (which deletes that run's checkpoints and metrics first).
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
import shutil
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
from verl.errors import VerlConfigError

FORMAT = "verl-checkpoint-v1"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint `path`; ValueError saying what is wrong with it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / MANIFEST} is unreadable ({e})") from e
    ok = (isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)
          and isinstance(manifest.get("step"), int) and isinstance(manifest.get("run_id"), str))
    if not ok:
        raise ValueError(f"{path / MANIFEST} is not a {FORMAT} manifest")
    return manifest


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
def _broadcast_json(obj: Any, world: Placement) -> Any:
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


def _all_ok(ok: bool, world: Placement) -> bool:
    if not world.distributed:
        return ok
    t = torch.tensor([int(ok)], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _dcp_state(modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
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


def _frozen(model: torch.nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


Modules = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]


class CheckpointManager:
    """Saves and restores models, optimizers and trainer state under `root`; keeps this run's newest `keep`.

    `trust`: load checkpoints without a manifest, and unpickle DCP's metadata unrestricted (trainer.trust_checkpoint).
    """

    def __init__(self, root: str | Path, world: Placement, keep: int = 2, *, trust: bool = False):
        self.root, self.world, self.keep, self.trust = Path(root), world, keep, trust
        self.run_id = uuid.uuid4().hex  # `resolve` replaces it with the resumed run's
        self._auto = False
        self._fallbacks: list[Path] = []  # rank 0, resume=auto: older checkpoints not yet tried, newest first
        self._skipped: list[str] = []

    def list(self) -> list[Path]:
        """The step directories, oldest first (unverified)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    # -- choosing what to resume -----------------------------------------------------------------------------
    def resolve(self, resume: str | None, *, overwrite: bool = False,
                run_files: Sequence[str | Path] = ()) -> Path | None:
        """`resume` setting → a verified checkpoint directory (None: start fresh), the same on every rank.

        'auto' takes the newest checkpoint that verifies and starts fresh when none was saved. Without `resume`
        the run claims the folder: `root` must be empty and `run_files` (metrics.jsonl) absent, unless
        `overwrite`, which deletes them. Sets `run_id`: the resumed checkpoint's, or a new one."""
        self._auto = resume == "auto"
        decision, failure = None, None
        if self.world.is_main:
            try:
                decision = self._decide(resume, overwrite, [Path(f) for f in run_files])
            except Exception as e:  # the other ranks wait on the broadcast: tell them before raising
                decision, failure = {"error": str(e)}, e
        decision = _broadcast_json(decision, self.world)
        if failure is not None:
            raise failure
        if "error" in decision:
            raise VerlConfigError(f"rank 0 could not resolve trainer.resume={resume!r}: {decision['error']}")
        self.run_id = decision["run_id"]
        return Path(decision["path"]) if decision["path"] else None

    def _decide(self, resume: str | None, overwrite: bool, run_files: list[Path]) -> dict[str, Any]:
        self._recover_replaced()
        if resume is None:
            self._claim(overwrite, run_files)
            return {"path": None, "run_id": uuid.uuid4().hex}
        if resume == "auto":
            self._fallbacks, self._skipped = self.list()[::-1], []
            path = self._next_valid()
            if path is None and self._skipped:
                raise VerlConfigError(f"trainer.resume=auto found no usable checkpoint in {self.root}: "
                                      f"{'; '.join(self._skipped)}. Repair or remove these, or start over with "
                                      f"trainer.overwrite=true and trainer.resume unset")
            return {"path": str(path) if path else None, "run_id": self._run_id_of(path)}
        path = Path(resume)
        problem = self._problem(path)
        if problem is not None:
            raise VerlConfigError(f"trainer.resume={resume!r} is not a complete verl checkpoint: {problem}. Pick "
                                  f"another one, or trainer.resume=auto for the newest valid one in {self.root}")
        return {"path": str(path), "run_id": self._run_id_of(path)}

    def _problem(self, path: Path) -> str | None:
        problem = verify(path)
        if problem is not None and self.trust and not (path / MANIFEST).exists() and (path / ".metadata").is_file():
            warnings.warn(f"{path} has no {MANIFEST}: loading it unverified, with DCP's unrestricted unpickling, "
                          f"because trainer.trust_checkpoint=true", stacklevel=4)
            return None
        return problem

    def _next_valid(self) -> Path | None:
        """Rank 0: pops `_fallbacks` up to the first checkpoint that verifies, warning about each one skipped."""
        while self._fallbacks:
            path = self._fallbacks.pop(0)
            problem = self._problem(path)
            if problem is None:
                return path
            self._skipped.append(problem)
            warnings.warn(f"trainer.resume=auto skips {path}: {problem}", stacklevel=4)
        return None

    def _run_id_of(self, path: Path | None) -> str:
        """The run a checkpoint belongs to (a trusted one without a manifest starts a new run id)."""
        try:
            return read_manifest(path)["run_id"] if path is not None else uuid.uuid4().hex
        except ValueError:
            return uuid.uuid4().hex

    def _claim(self, overwrite: bool, run_files: list[Path]) -> None:
        """A fresh run owns its folder: it refuses an earlier run's files, or deletes them under `overwrite`."""
        used = [self.root] if self.root.is_dir() and any(self.root.iterdir()) else []
        used += [f for f in run_files if f.exists()]
        if not used:
            return
        if not overwrite:
            raise VerlConfigError(f"trainer.output_dir={str(self.root.parent)!r} holds an earlier run "
                                  f"({', '.join(map(str, used))}) and trainer.resume is not set: continue that run "
                                  f"with trainer.resume=auto, or start over with trainer.overwrite=true (deletes "
                                  f"its checkpoints and metrics), or pick another trainer.output_dir")
        for path in used:
            warnings.warn(f"trainer.overwrite=true: deleting {path} of the earlier run", stacklevel=4)
            if path.is_dir():
                trash = path.with_name(f".deleting-{path.name}-{uuid.uuid4().hex[:8]}")
                os.rename(path, trash)  # gone from view at once, whatever a kill during the delete leaves
                shutil.rmtree(trash)
            else:
                path.unlink()

    def _recover_replaced(self) -> None:
        """Rank 0: finishes a replacement a kill interrupted (see `_move_into_place`)."""
        for old in self.root.glob(".old-step_*") if self.root.is_dir() else []:
            final = old.with_name(old.name[len(".old-"):])
            if final.exists():
                shutil.rmtree(old)  # the replacement is in place
            else:
                os.rename(old, final)
                warnings.warn(f"restored {final}: a save that was replacing it was interrupted", stacklevel=4)

    # -- saving ----------------------------------------------------------------------------------------------
    def save(self, step: int, modules: Modules, sharded: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """`modules` (torch models and optimizers) and `sharded` (engines that lay out their own per-rank
        state, e.g. megatron's: `dcp_state(for_load)` / `load_dcp_state(state, source)`) go into one DCP
        checkpoint; `trainer_state` must be JSON-serialisable."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}"
        if self.world.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-step_*"):  # leftovers of crashed saves
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier(self.world)
        with warnings.catch_warnings():  # DCP warns that a lone process saves without a process group
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(_dcp_state(modules, sharded, for_load=False), checkpoint_id=str(tmp))
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
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.root / "latest")
            self._prune()
        barrier(self.world)
        return final

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        """Rename-then-delete: at every moment `final` or `.old-<final>` holds a complete checkpoint."""
        if final.exists():  # re-saving a step (e.g. a run resumed from an earlier one reaching it again)
            old = final.with_name(f".old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)

    def _prune(self) -> None:
        """Deletes this run's checkpoints beyond the newest `keep`; never another run's."""
        if self.keep <= 0:
            return
        mine = [p for p in self.list() if self._owner(p) == self.run_id]
        for old in mine[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def _owner(path: Path) -> str | None:
        try:
            return read_manifest(path)["run_id"]
        except ValueError:
            return None

    # -- loading ---------------------------------------------------------------------------------------------
    def load(self, path: str | Path, modules: Modules, sharded: dict[str, Any] | None = None) -> dict[str, Any]:
        """Restores `modules` and `sharded` engines in place and this rank's RNG; returns the trainer state.

        After `resolve('auto')`, a checkpoint that verified but does not load gives way, with a warning, to the
        next older one that verifies; otherwise the failure is a VerlConfigError naming the checkpoint."""
        path = Path(path)
        while True:
            state, problem = self._try_load(path, modules, sharded or {})
            if problem is None:
                return state
            older = self._fall_back(path, problem)
            if older is None:
                raise VerlConfigError(
                    f"checkpoint {str(path)!r} could not be loaded: {problem}. If the model, the number of processes "
                    f"or the parallel layout changed, resume with the ones it was saved with; if its files are "
                    f"damaged, resume from an earlier checkpoint (trainer.resume=auto falls back to the newest one "
                    f"that verifies)")
            path = older

    def _try_load(self, path: Path, modules: Modules, sharded: dict[str, Any]) -> tuple[dict | None, str | None]:
        """(trainer state, None) or (None, what went wrong), agreed by every rank."""
        state, problem = None, None
        rng_file = path / f"rng_rank{self.world.rank}.json"
        try:
            tensors = _dcp_state(modules, sharded, for_load=True)
            self._dcp_load(tensors, path)
            self._apply(tensors, modules, sharded, path)
            if not rng_file.is_file():
                raise VerlConfigError(f"it has no RNG state for rank {self.world.rank} ({rng_file.name}): it was "
                                      f"written by fewer ranks; resume with the same number of processes")
            set_rng_state(json.loads(rng_file.read_text()))
            state = json.loads((path / TRAINER_STATE).read_text())
        except VerlConfigError as e:
            problem = str(e)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            problem = _describe(e)
        if not _all_ok(problem is None, self.world):
            return None, problem or "another rank could not load it (see that rank's error)"
        return state, None

    def _dcp_load(self, tensors: dict[str, Any], path: Path) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if self.trust:
                dcp.load(tensors, checkpoint_id=str(path))
            else:
                dcp.load(tensors, storage_reader=_SafeReader(str(path)), planner=_SafeLoadPlanner())

    @staticmethod
    def _apply(tensors: dict[str, Any], modules: Modules, sharded: dict[str, Any], path: Path) -> None:
        for name, (model, optim) in modules.items():
            if optim is None:
                model.load_state_dict(tensors[name]["model"])
            else:
                set_state_dict(model, optim, model_state_dict=tensors[name]["model"],
                               optim_state_dict=tensors[name]["optim"],
                               options=StateDictOptions(strict=not _frozen(model)))
        for name, eng in sharded.items():
            eng.load_dcp_state(tensors[name], str(path))

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
        decision = _broadcast_json(decision, self.world)
        if decision["path"] is None:
            return None
        self.run_id = decision["run_id"]
        return Path(decision["path"])
