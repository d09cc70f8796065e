"""Per-step snapshots for elastic recovery (`trainer.recovery`, docs/RELIABILITY.md).

Under `torchrun --max-restarts=N` a rank that dies makes torchrun's agent stop and restart the whole worker
group; the restarted trainer continues by itself from the newest state every rank still holds. That state is a
snapshot each rank takes of its own part after every step: the tensors a checkpoint holds (`checkpoint.
checkpoint_tensors`, this rank's local shards: a torch engine's whole model and optimizer, FSDP2's DTensor
shards, megatron's TP / PP shard and optimizer blob), its RNG and the trainer state (data position, KL
controller, LR schedules, the batches a one_step_off run carries). On the critical path only the copy into CPU
memory (and a wait for the previous write when it has not finished: two buffers, one being written); a
background thread writes it to `<root>/<run id>/<config digest>-w<world>/rank_<r>/step_<k>.pt`, root being
/dev/shm/verl (memory on the node, readable by a restarted process on it) unless `trainer.snapshot_dir` says
otherwise. A full root makes later snapshots go to output_dir/.snapshots (disk), with a warning.

Each rank keeps its `keep` newest snapshots (two by default). In lockstep the steps are collective, so ranks are at
most one step apart, and the newest step every rank holds exists whatever the moment of the kill; a restarted run
takes it when it is newer than the newest checkpoint (else the checkpoint: a node replaced since, another world
size or another config). In async mode the rollout's ranks label theirs with the training steps they fit (the
batches generated ahead of step k go in the snapshot labelled k) and the actor's ranks keep `lag + 1`, as the
trainer can be up to that many steps past the rollout's newest label.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from verl.errors import VerlConfigError

FORMAT = "verl-snapshot-v1"
DEFAULT_ROOT = Path("/dev/shm/verl")
_FILE = re.compile(r"^step_(\d+)\.pt$")
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)
MAX_KEEP = 8  # the most snapshots a rank keeps (`common_steps` gathers this many steps from each rank)


def torchrun_restarts() -> tuple[int, int]:
    """(how often torchrun has restarted this worker group, how often it may): (0, 0) outside torchrun."""
    def num(name: str) -> int:
        try:
            return int(os.environ.get(name, "0"))
        except ValueError:
            return 0
    return num("TORCHELASTIC_RESTART_COUNT"), num("TORCHELASTIC_MAX_RESTARTS")


def process_start_time() -> float | None:
    """When this process started (wall clock, from /proc: the kernel's record, before any Python ran, to 10 ms);
    None where /proc is absent."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def recovery_enabled(setting: str) -> bool:
    """trainer.recovery: 'auto' snapshots when torchrun may restart the workers (--max-restarts above 0)."""
    return setting == "on" or (setting == "auto" and torchrun_restarts()[1] > 0)


def config_digest(config: dict) -> str:
    """What a snapshot must have been taken under: the whole config, trainer.resume aside (a restarted run resumes
    whatever its command line said)."""
    cfg = {**config, "trainer": {k: v for k, v in config.get("trainer", {}).items() if k != "resume"}}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:15]  # 60 bits: an int64


def local_copy(tree: Any) -> Any:
    """`tree` with every tensor copied to CPU memory (a DTensor: this rank's shard); other values as they are
    (plain numbers, strings, bytes: immutable)."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().to("cpu", copy=True)
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: local_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_copy(v) for v in tree)
    return tree


def fill(target: Any, saved: Any, where: str = "") -> Any:
    """`target` (the tensors a checkpoint loads into) holding `saved`'s values: tensors copied in place (a
    DTensor's local shard), anything else replaced. A key or shape that does not match is a VerlConfigError."""
    if isinstance(target, DTensor) or isinstance(target, torch.Tensor):
        local = target.to_local() if isinstance(target, DTensor) else target
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise VerlConfigError(f"snapshot value {where or '.'} is {got}, this rank holds {tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(saved)
        return target
    if isinstance(target, dict):
        if not isinstance(saved, dict) or set(saved) != set(target):
            extra = sorted(map(str, set(saved) ^ set(target))) if isinstance(saved, dict) else "?"
            raise VerlConfigError(f"snapshot entry {where or '.'} has other keys than this rank's state ({extra})")
        for k in target:
            target[k] = fill(target[k], saved[k], f"{where}/{k}")
        return target
    if isinstance(target, (list, tuple)) and isinstance(saved, (list, tuple)) and len(target) == len(saved):
        return type(target)(fill(t, s, f"{where}/{i}") for i, (t, s) in enumerate(zip(target, saved)))
    return saved


class Snapshots:
    """This rank's snapshots of run `run_id` (see the module docstring)."""

    def __init__(self, root: Path, fallback: Path, run_id: str, rank: int, world_size: int, digest: str,
                 keep: int = 2):
        if not 1 <= keep <= MAX_KEEP:
            raise VerlConfigError(f"a rank keeps 1 to {MAX_KEEP} snapshots, not {keep}")
        self.keep = keep
        self.roots = [root] if fallback == root else [root, fallback]
        self.run_id, self.rank, self.world_size, self.digest = run_id, rank, world_size, digest
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self.disabled = False
        self.last_write_s = 0.0

    def dir(self, root: Path) -> Path:
        return root / self.run_id / f"{self.digest}-w{self.world_size}" / f"rank_{self.rank:05d}"

    # -- writing ---------------------------------------------------------------------------------------------
    def save(self, step: int, tensors: Any, trainer_state: dict, rng: dict) -> float:
        """Copies this rank's state and hands it to the writer thread; returns the seconds spent here."""
        t0 = time.perf_counter()
        self.wait()
        if self.disabled:
            return 0.0
        payload = {"format": FORMAT, "run_id": self.run_id, "step": step, "rank": self.rank,
                   "world_size": self.world_size, "digest": self.digest, "rng": rng, "trainer": trainer_state,
                   "tensors": local_copy(tensors)}
        self._thread = threading.Thread(target=self._write, args=(step, payload), name="verl-snapshot", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def wait(self) -> None:
        """Until the write in flight has finished; a write that failed turns snapshots off, with a warning
        (recovery then restarts from the newest checkpoint)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None and not self.disabled:
            self.disabled = True
            warnings.warn(f"verl: rank {self.rank} could not write its snapshot ({self._failure}): snapshots are off "
                          f"for the rest of the run, and a restart resumes from the newest checkpoint", stacklevel=3)

    def _write(self, step: int, payload: dict) -> None:
        t0 = time.perf_counter()
        while True:
            d = self.dir(self.roots[0])
            tmp = d / f".step_{step:06d}.tmp"
            try:
                d.mkdir(parents=True, exist_ok=True)
                torch.save(payload, tmp)
                os.replace(tmp, d / f"step_{step:06d}.pt")
                for old in sorted(self._steps_in(d))[:-self.keep]:
                    (d / f"step_{old:06d}.pt").unlink(missing_ok=True)
                self.last_write_s = time.perf_counter() - t0
                return
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if e.errno in _FULL and len(self.roots) > 1:
                    full = self.roots.pop(0)
                    print(f"verl: warning: {full} is full ({e.strerror}); rank {self.rank} writes its snapshots to "
                          f"{self.roots[0]} (disk) from step {step} on", flush=True)
                    continue
                self._failure = f"{type(e).__name__}: {e}"
                return
            except Exception as e:  # the main thread reports it at the next snapshot
                tmp.unlink(missing_ok=True)
                self._failure = f"{type(e).__name__}: {e}"
                return

    # -- reading ---------------------------------------------------------------------------------------------
    @staticmethod
    def _steps_in(d: Path) -> list[int]:
        if not d.is_dir():
            return []
        return [int(m.group(1)) for p in d.iterdir() if (m := _FILE.match(p.name))]

    def available(self) -> dict[int, Path]:
        """step -> this rank's complete snapshot of it (every root: a full one's older steps count too)."""
        out: dict[int, Path] = {}
        for root in reversed(self.roots):
            d = self.dir(root)
            out.update({s: d / f"step_{s:06d}.pt" for s in self._steps_in(d)})
        return out

    def others(self) -> list[str]:
        """This run's snapshots taken under another config or world size (why they are not used), in words."""
        seen = []
        for root in self.roots:
            run = root / self.run_id
            if run.is_dir():
                seen += [p.name for p in run.iterdir() if p.name != f"{self.digest}-w{self.world_size}"]
        return [f"{n.split('-w')[1]} processes" if n.split("-w")[0] == self.digest else "another config"
                for n in sorted(set(seen)) if "-w" in n]

    def common_steps(self, distributed: bool) -> list[int]:
        """Collective: the steps every rank holds a snapshot of, newest first (as a tensor: no pickle between
        ranks)."""
        mine = sorted(self.available())[-MAX_KEEP:]
        if not distributed:
            return mine[::-1]
        from verl.distributed.placement import comm_device
        t = torch.full((MAX_KEEP,), -1, dtype=torch.int64, device=comm_device())
        t[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
        everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, t)
        common = set.intersection(*({int(v) for v in e.tolist() if v >= 0} for e in everyone))
        return sorted(common, reverse=True)

    def load(self, step: int) -> dict:
        """This rank's snapshot of `step`, checked to be this run's, config's, world's and rank's."""
        path = self.available().get(step)
        if path is None:
            raise VerlConfigError(f"rank {self.rank} has no snapshot of step {step}")
        payload = torch.load(path, map_location="cpu", weights_only=True)
        want = {"format": FORMAT, "run_id": self.run_id, "step": step, "rank": self.rank,
                "world_size": self.world_size, "digest": self.digest}
        wrong = {k: payload.get(k) for k, v in want.items() if not isinstance(payload, dict) or payload.get(k) != v}
        if wrong:
            raise VerlConfigError(f"snapshot {path} is not this rank's state of step {step}: {wrong} (expected "
                                  f"{ {k: want[k] for k in wrong} })")
        return payload

    def clear_stale(self, run_ids: list[str]) -> None:
        """Removes this rank's snapshots of the runs `run_ids` under any config or world size: what an earlier
        session of the folder left when it ended in an error (a start that is not a torchrun restart never uses
        them, and memory under /dev/shm is the node's)."""
        for root in self.roots:
            for run in run_ids:
                for d in (root / run).glob(f"*/rank_{self.rank:05d}") if (root / run).is_dir() else []:
                    _remove(d, root / run)

    def clear(self) -> None:
        """Removes this rank's snapshots, and the run's folders once empty (a run that ended needs none)."""
        self.wait()
        for root in self.roots:
            _remove(self.dir(root), root / self.run_id)


def _remove(rank_dir: Path, run_dir: Path) -> None:
    """`rank_dir`, then its config folder and `run_dir` where no other rank's snapshots remain."""
    shutil.rmtree(rank_dir, ignore_errors=True)
    for parent in (rank_dir.parent, run_dir):
        try:
            parent.rmdir()
        except OSError:
            pass
