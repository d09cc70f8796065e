"""What a run owns under ``trainer.output_dir``: it touches only what it wrote.

The run manifest ``<output_dir>/verl_run.json`` holds the run id and every file and folder the run created,
as paths relative to the output folder, each with its kind:

    file        a file (metrics.jsonl, curves.png, a trace, checkpoints/latest, an exported model's file)
    dir         a folder the run created; what is inside is recorded entry by entry
    checkpoint  a checkpoint's step folder; its files are the ones its own manifest.json lists
    tree        a temporary folder only this run writes into (a save or an export in progress)

Rules:
- Record, then create: an entry enters the manifest before it exists, so a kill leaves nothing unrecorded.
- A fresh run in a folder holding an earlier run's manifest is refused without ``trainer.overwrite=true``; with
  it, exactly the entries that manifest names are deleted. A folder left holding files no run recorded is kept,
  with a warning naming them.
- A file at one of the run's destinations that no manifest names is in the way: an error naming it, before the
  first step (overwrite does not delete it either). A trace is the exception: it is written beside, under a free
  name, so that no trace is ever replaced.
- Exports (hf_actor/, .init_hf/) are written to a temporary sibling and renamed into place; the copy they replace
  must be this run's entirely. Deleting never follows a symbolic link, and never leaves the output folder.
- Dangerous destinations are refused when the config is loaded (`check_output_dir`): the filesystem root, the
  home directory and the folders above it, the verl checkout (or the folder verl is installed in) and the folders
  above it, verl's own package, and an artefact path that is a symbolic link leaving the output folder.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.utils.state_check import Dict, Int, List, StateError, Str, read_json, validate

RUN_MANIFEST = "verl_run.json"
FORMAT = "verl-run-v1"
ARTEFACTS = (RUN_MANIFEST, "metrics.jsonl", "val_generations.jsonl", "tensorboard", "curves.png", "checkpoints",
             "hf_actor", "hf_actor_merged", ".init_hf", "hang")
"""What a run writes directly under its output folder (plus trace_step_N*.json)."""
KINDS = ("file", "dir", "checkpoint", "tree")
_MANIFEST_LIMIT = 64 << 20
_MANIFEST_SPEC = Dict({
    "format": Str(choices=(FORMAT,)), "run_id": Str(64, pattern=r"[0-9a-f]{8,64}"),
    "entries": Dict({}, extra=Str(choices=KINDS), max_len=1 << 20),
    "history": List(Dict({"event": Str(32), "run_id": Str(64), "time": Int(0, 1 << 40)}), max_len=1 << 16),
})


# -- dangerous destinations, refused when the config is loaded --------------------------------------------------
def check_output_dir(value: str, key: str = "trainer.output_dir") -> Path:
    """The resolved output folder for the setting `value`; VerlConfigError naming the reason for a destination
    a run must not write into or delete from (see the module docstring)."""
    if not str(value).strip():
        raise VerlConfigError(f"{key} is empty, which would write the run into the current directory; name a "
                              f"folder for it (e.g. {key}=outputs/my_run)")
    if str(value).startswith("~"):
        raise VerlConfigError(f"{key}={value!r}: '~' is not expanded here (it would create a folder named '~' in "
                              f"the current directory); write the path out, e.g. {os.path.expanduser(value)}")
    _check_name_lengths(str(value), key)
    resolved = Path(os.path.realpath(os.path.abspath(value)))
    _check_name_lengths(str(resolved), key)
    shown = f"{key}={value!r}" + (f" (resolves to {resolved})" if str(resolved) != str(value) else "")
    if resolved.exists() and not resolved.is_dir():
        raise VerlConfigError(f"{shown} is a file, not a folder; pick a folder for the run's outputs")
    why = _danger(resolved)
    if why:
        raise VerlConfigError(f"{shown} is {why}: a run writes checkpoints/, metrics.jsonl and more there and, with "
                              f"trainer.overwrite=true, deletes its earlier files; pick a folder of its own (e.g. "
                              f"{key}=outputs/my_run)")
    for path in _artefact_paths(resolved):
        if path.is_symlink():
            target = Path(os.path.realpath(path))
            if not target.is_relative_to(resolved):
                raise VerlConfigError(f"{shown}: {path} is a symbolic link to {target}, outside the output folder; "
                                      f"verl writes, replaces and deletes files there, so it refuses to follow it. "
                                      f"Replace the link by a folder, or point {key} at the folder you mean")
    return resolved


def _check_name_lengths(path: str, key: str) -> None:
    """The filesystem's limits on a path (every file the run writes goes below it), checked before any stat."""
    name_max, path_max = 255, 4096
    try:
        name_max, path_max = os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError):
        pass
    longest = max(path.split(os.sep), key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > name_max:
        raise VerlConfigError(f"config key {key!r}: a folder name of {len(os.fsencode(longest))} bytes "
                              f"({longest[:40]}...) is longer than the filesystem allows ({name_max}); pick a "
                              f"shorter name")
    if len(os.fsencode(path)) > path_max - 256:  # room for the run's own files below it
        raise VerlConfigError(f"config key {key!r}: a path of {len(os.fsencode(path))} bytes leaves no room under the "
                              f"filesystem's limit of {path_max} bytes for the run's files; pick a shorter path")


def _danger(path: Path) -> str | None:
    if path == Path(path.anchor):
        return "the filesystem root"
    places = []
    try:
        places.append(("your home directory", Path(os.path.realpath(Path.home()))))
    except (RuntimeError, KeyError):  # no home directory known
        pass
    import verl
    package = Path(os.path.realpath(Path(verl.__file__).parent))
    checkout = package.parent
    name = "the verl checkout" if (checkout / "setup.py").exists() or (checkout / ".git").exists() else \
        "the folder verl is installed in"
    places.append((name, checkout))
    for what, place in places:
        if path == place:
            return f"{what}"
        if place.is_relative_to(path):
            return f"a folder above {what} ({place})"
    if path.is_relative_to(package) or path.is_relative_to(checkout / ".git"):
        return f"inside verl's own sources ({path})"
    return None


def _artefact_paths(root: Path) -> list[Path]:
    """The paths a run writes at (symbolic links among them are checked), one level into its folders."""
    out = [root / name for name in ARTEFACTS]
    if root.is_dir():
        out += sorted(root.glob("trace_step_*.json"))
    for folder in ("checkpoints", "hf_actor", "hf_actor_merged", "tensorboard", ".init_hf", "hang"):
        if (root / folder).is_dir() and not (root / folder).is_symlink():
            out += sorted((root / folder).iterdir())
    return out


# -- the run manifest -------------------------------------------------------------------------------------------
class RunFolder:
    """Rank 0's record of what this run created under `root` (on other ranks, `active=False`: every method that
    writes is a no-op, so callers need not ask which rank they are on)."""

    def __init__(self, root: str | Path, active: bool = True):
        self.root, self.active = Path(root), active
        self.run_id: str | None = None
        self.entries: dict[str, str] = {}
        self.history: list[dict[str, Any]] = []

    # -- reading and writing the manifest
    def read(self) -> dict[str, Any] | None:
        """The manifest an earlier session left (validated), or None; VerlConfigError when it is unreadable."""
        path = self.root / RUN_MANIFEST
        if not path.exists() and not path.is_symlink():
            return None
        try:
            if path.is_symlink() or not path.is_file():
                raise StateError(str(path), "is not a regular file")
            manifest = validate(read_json(path, _MANIFEST_LIMIT), _MANIFEST_SPEC)
            for rel in manifest["entries"]:
                self._check_rel(rel)
        except StateError as e:
            raise VerlConfigError(f"the run manifest {path} cannot be used: {e.why if e.where == str(path) else e}. "
                                  f"It records what an earlier run wrote here; without it verl cannot tell that "
                                  f"run's files from others: move the folder's contents away yourself, or pick "
                                  f"another trainer.output_dir") from None
        return manifest

    def load(self, manifest: dict[str, Any]) -> None:
        """Continues the run `manifest` describes."""
        self.run_id, self.entries, self.history = manifest["run_id"], dict(manifest["entries"]), manifest["history"]

    def start(self, run_id: str, event: str) -> None:
        """Begins (or, for a resumed run, continues) the manifest of run `run_id`; `event`: fresh / resume."""
        import time
        self.run_id = run_id
        self.history = [*self.history[-1000:], {"event": event, "run_id": run_id, "time": int(time.time())}]
        self._write()

    def _write(self) -> None:
        if not self.active:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{RUN_MANIFEST}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "run_id": self.run_id, "entries": self.entries, "history": self.history},
                      f, indent=0)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / RUN_MANIFEST)

    def _check_rel(self, rel: str) -> None:
        p = Path(rel)
        if not rel or p.is_absolute() or ".." in p.parts or p.as_posix() != rel or rel == RUN_MANIFEST:
            raise StateError(f"entries.{rel}", "is not a path inside the output folder")

    # -- entries
    def record(self, rel: str, kind: str) -> None:
        """Records `rel` (relative to the root) as this run's, before it is created."""
        if self.entries.get(rel) != kind:
            self.entries[rel] = kind
            self._write()

    def record_all(self, entries: dict[str, str]) -> None:
        """Records several entries (rel -> kind) before they are created, with one write of the manifest."""
        new = {rel: kind for rel, kind in entries.items() if self.entries.get(rel) != kind}
        if new:
            self.entries.update(new)
            self._write()

    def record_tree(self, rel: str) -> None:
        """Records the folder `rel` and everything in it (after an export wrote it), then the manifest, once."""
        self.entries[rel] = "dir"
        for p in sorted((self.root / rel).rglob("*")):
            self.entries[p.relative_to(self.root).as_posix()] = "dir" if p.is_dir() else "file"
        self._write()

    def forget(self, *rels: str) -> None:
        """Drops `rels` and everything recorded under them (after they were deleted or renamed)."""
        prefixes = tuple(f"{r}/" for r in rels)
        gone = [e for e in self.entries if e in rels or e.startswith(prefixes)]
        for e in gone:
            del self.entries[e]
        if gone:
            self._write()

    def owns(self, rel: str) -> bool:
        return rel in self.entries

    def foreign(self, rel: str, whole: bool = False) -> list[str]:
        """What exists at `rel` that this run did not record: `rel` itself, or (`whole`: a folder the run
        replaces as a whole) any entry inside it. Empty when `rel` is absent or entirely this run's."""
        path = self.root / rel
        if not os.path.lexists(path):
            return []
        if path.is_symlink() and self.entries.get(rel) != "file":
            return [rel]
        if not whole or not path.is_dir():
            return [] if self.owns(rel) else [rel]
        inside = [p.relative_to(self.root).as_posix() for p in sorted(path.rglob("*"))
                  if not self.owns(p.relative_to(self.root).as_posix())]
        return inside or ([] if self.owns(rel) else [rel])

    def free_stem(self, stem: str, suffixes: tuple[str, ...]) -> str:
        """`stem`, or `stem-2`, `stem-3`, ...: the first for which no `stem + suffix` exists (so that a trace of
        a step run twice, e.g. after a resume, is written beside the earlier one instead of over it)."""
        name, k = stem, 1
        while any(os.path.lexists(self.root / f"{name}{s}") for s in suffixes):
            k += 1
            name = f"{stem}-{k}"
        return name

    # -- deleting what the run owns
    def remove(self, rel: str) -> None:
        """Deletes the entry `rel` and what is recorded under it, per kind; keeps anything unrecorded (warning)."""
        if not self.active:
            return
        under = sorted((e for e in self.entries if e == rel or e.startswith(f"{rel}/")),
                       key=lambda e: e.count("/"), reverse=True)
        for entry in under:
            self._delete(entry, self.entries[entry])
        self.forget(rel)

    def remove_all(self) -> None:
        """Deletes every entry of the manifest (trainer.overwrite=true), then the manifest itself."""
        if not self.active:
            return
        for entry in sorted(self.entries, key=lambda e: e.count("/"), reverse=True):
            self._delete(entry, self.entries[entry])
        self.entries = {}
        (self.root / RUN_MANIFEST).unlink(missing_ok=True)

    def _delete(self, rel: str, kind: str) -> None:
        path = self.root / rel
        if not os.path.lexists(path):
            return
        if not Path(os.path.realpath(path.parent)).is_relative_to(os.path.realpath(self.root)):
            warnings.warn(f"kept {path}: a symbolic link above it leads out of {self.root}", stacklevel=3)
            return
        if path.is_symlink() and kind != "file":
            warnings.warn(f"kept {path}: this run created a folder there, which is now a symbolic link", stacklevel=3)
        elif kind == "file":
            if path.is_dir() and not path.is_symlink():
                warnings.warn(f"kept {path}: this run wrote a file there, which is now a folder", stacklevel=3)
            else:
                path.unlink()
        elif kind == "tree":
            shutil.rmtree(path, ignore_errors=True)
        elif kind == "checkpoint":
            for name in checkpoint_files(path):
                if (path / name).is_file() and not (path / name).is_symlink():
                    (path / name).unlink()
            self._rmdir(path)
        else:
            self._rmdir(path)

    def _rmdir(self, path: Path) -> None:
        left = sorted(p.name for p in path.iterdir())
        if left:
            shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            warnings.warn(f"kept {path}: it holds files no verl run recorded ({shown})", stacklevel=4)
        else:
            path.rmdir()

    # -- replacing what the run owns
    def publish(self, tmp_rel: str, rel: str) -> None:
        """Renames the folder `tmp_rel` (a finished export, recorded as a tree) to `rel`, replacing this run's
        earlier copy; VerlRuntimeError, with the new export left at `tmp_rel`, when `rel` holds files this run
        did not write."""
        if not self.active:
            return
        dest, tmp = self.root / rel, self.root / tmp_rel
        foreign = self.foreign(rel, whole=True)
        if foreign:
            raise VerlRuntimeError(f"{dest} holds files this run did not write ({', '.join(foreign[:8])}), so verl "
                                   f"does not replace it; the new export is in {tmp}. Move those files away and "
                                   f"rename it, or set trainer.output_dir to a folder of the run's own")
        old_rel = None
        if os.path.lexists(dest):
            old_rel = f".old-{rel.replace('/', '_')}-{uuid.uuid4().hex[:8]}"
            self.record(old_rel, "tree")
            os.rename(dest, self.root / old_rel)
            self.forget(rel)
        self.record(rel, "dir")
        os.rename(tmp, dest)
        self.forget(tmp_rel)
        self.record_tree(rel)
        if old_rel is not None:
            self.remove(old_rel)

    def replace_file(self, tmp: Path, rel: str) -> None:
        """Moves the finished file `tmp` to `rel` (this run's, or absent: checked before the run started)."""
        if not self.active:
            return
        if self.foreign(rel):
            tmp.unlink(missing_ok=True)
            raise VerlRuntimeError(f"{self.root / rel} is not this run's file (it appeared during the run); "
                                   f"verl does not replace it: move it away")
        self.record(rel, "file")
        os.replace(tmp, self.root / rel)


def checkpoint_files(path: Path) -> list[str]:
    """The files of the checkpoint folder `path` that verl wrote: those its manifest.json lists, and the manifest
    (for an unreadable manifest, the names a verl checkpoint uses)."""
    try:
        listed = read_json(path / "manifest.json", _MANIFEST_LIMIT)["files"]
        names = [str(n) for n in listed if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")]
        return [*names, "manifest.json"]
    except (OSError, ValueError, KeyError, TypeError):  # StateError is a ValueError
        return [p.name for p in path.iterdir() if p.name in (".metadata", "trainer_state.json", "manifest.json")
                or (p.name.startswith("__") and p.name.endswith(".distcp"))
                or (p.name.startswith("rng_rank") and p.name.endswith(".json"))]


def existing(root: Path, rels: Iterable[str]) -> list[str]:
    """The paths among `rels` that exist under `root`."""
    return [r for r in rels if os.path.lexists(root / r)]
