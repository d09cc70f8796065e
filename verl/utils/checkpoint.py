"""Atomic checkpoints with torch.distributed.checkpoint (DCP).

Layout of ``<output_dir>/checkpoints``::

    step_000010/            # complete checkpoints only (renamed into place when fully written)
        .metadata, __*_*.distcp    # DCP: every model and optimizer (torch engines: de-duplicated across
                                   # ranks; megatron engines: each rank's TP/PP shard and optimizer state)
        trainer_state.pt    # step, data position, KL controller, LR schedulers (rank 0)
        rng_rank{r}.pt      # each rank's torch / CUDA / Python / NumPy RNG states
    latest                  # name of the newest complete checkpoint (replaced atomically)

A save writes into ``.tmp-step_000010`` and renames it only after every rank finished, so a crash mid-save
leaves the previous checkpoints untouched and ``resume=auto`` never sees a partial directory.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from verl.errors import VerlConfigError
from verl.distributed import Placement
from verl.distributed.collectives import barrier

_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dcp_state(modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
               sharded: dict[str, Any], for_load: bool) -> dict[str, Any]:
    """The one state dict DCP saves / loads into: torch modules by state-dict names, sharded engines' own."""
    out = {name: eng.dcp_state(for_load=for_load) for name, eng in sharded.items()}
    for name, (model, optim) in modules.items():
        if optim is None:
            out[name] = {"model": model.state_dict()}
        else:
            msd, osd = get_state_dict(model, optim)
            out[name] = {"model": msd, "optim": osd}
    return out


class CheckpointManager:
    """Saves and restores models, optimizers and trainer state under `root`; keeps the newest `keep`."""

    def __init__(self, root: str | Path, world: Placement, keep: int = 2):
        self.root, self.world, self.keep = Path(root), world, keep

    def list(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        ckpts = self.list()
        return ckpts[-1] if ckpts else None

    def resolve(self, resume: str | None) -> Path | None:
        """`resume` setting → checkpoint dir (None: start fresh). 'auto' with nothing saved starts fresh."""
        if resume is None:
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not (path / ".metadata").is_file() or not (path / "trainer_state.pt").is_file():
            raise VerlConfigError(f"trainer.resume={resume!r} is not a complete verl checkpoint directory "
                                  f"(expected {self.root}/step_NNNNNN); use trainer.resume=auto for the newest one")
        return path

    def save(self, step: int, modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
             sharded: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """`modules` (torch models and optimizers) and `sharded` (engines that lay out their own per-rank
        state, e.g. megatron's: `dcp_state(for_load)` / `load_dcp_state(state, source)`) go into one DCP checkpoint."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}"
        if self.world.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save
            tmp.mkdir()
        barrier(self.world)
        with warnings.catch_warnings():  # DCP warns that a lone process saves without a process group
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(_dcp_state(modules, sharded, for_load=False), checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / f"rng_rank{self.world.rank}.pt")
        if self.world.is_main:
            torch.save(trainer_state, tmp / "trainer_state.pt")
        barrier(self.world)
        if self.world.is_main:
            if final.exists():  # re-saving a step (e.g. a resumed run reaching it again) replaces it whole
                shutil.rmtree(final)
            os.rename(tmp, final)
            pointer = self.root / ".latest.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.root / "latest")
            self._prune()
        barrier(self.world)
        return final

    def _prune(self) -> None:
        if self.keep > 0:
            for old in self.list()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: str | Path, modules: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
             sharded: dict[str, Any] | None = None) -> dict[str, Any]:
        """Restores `modules` and `sharded` engines in place and this rank's RNG; returns the trainer state."""
        path = Path(path)
        sharded = sharded or {}
        state = _dcp_state(modules, sharded, for_load=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            try:
                dcp.load(state, checkpoint_id=str(path))
            except Exception as e:  # DCP names the missing keys; a different layout is the usual cause
                raise VerlConfigError(f"checkpoint {str(path)!r} does not fit this run ({e}); resume with the same "
                                      f"number of processes and the same model/parallel layout") from e
        for name, (model, optim) in modules.items():
            if optim is None:
                model.load_state_dict(state[name]["model"])
            else:
                set_state_dict(model, optim, model_state_dict=state[name]["model"],
                               optim_state_dict=state[name]["optim"])
        for name, eng in sharded.items():
            eng.load_dcp_state(state[name], str(path))
        rng_file = path / f"rng_rank{self.world.rank}.pt"
        if not rng_file.is_file():
            raise VerlConfigError(f"checkpoint {str(path)!r} has no RNG state for rank {self.world.rank}: it was "
                                  f"written by fewer ranks; resume with the same number of processes")
        set_rng_state(torch.load(rng_file, weights_only=False))
        return torch.load(path / "trainer_state.pt", weights_only=False)
