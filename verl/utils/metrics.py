"""Metrics sinks: JSONL (one record per step), TensorBoard, and a PNG of the reward / KL / entropy curves."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from verl.errors import VerlConfigError


class MetricsLogger:
    """Appends `{"step": s, ...}` lines to metrics.jsonl and TensorBoard scalars; inactive off rank 0.

    On resume the JSONL keeps only records up to the resumed step, one per step (a kill mid-write may have torn
    the last line: it is dropped with a warning), so the file reads as one run. Rewrites are atomic.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, tensorboard: bool, start_step: int = 0):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        self._last_step = -1
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step] if self.path.exists() else []
        kept = dedup_by_step(kept)
        _write_rows(self.path, kept)
        self._last_step = max((r.get("step", 0) for r in kept), default=-1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if step <= self._last_step:  # a step already on file (the resumed one): merge, keeping one row per step
            _write_rows(self.path, dedup_by_step([*read_metrics(self.path), record]))
        else:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self._last_step = step
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl. A torn last line (a kill mid-write) is dropped with a warning; an
    unreadable line elsewhere is a VerlConfigError naming it."""
    path = Path(path)
    lines = path.read_text().split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines) - 1:  # no newline after it: the write was cut short
                warnings.warn(f"{path}: dropping the torn last line {i + 1} ({line[:60]!r}...)", stacklevel=2)
                continue
            raise VerlConfigError(f"{path} line {i + 1} is not a JSON record ({e}): {line[:80]!r}; delete that "
                                  f"line (or the file) to go on") from e
        out.append(record)
    return out


def dedup_by_step(records: list[dict]) -> list[dict]:
    """One record per step, in order of first appearance; later values of a step win."""
    merged: dict[object, dict] = {}
    for r in records:
        merged.setdefault(r.get("step"), {}).update(r)
    return list(merged.values())


def _write_rows(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


VAL_CURVE = "val/reward_mean"
"""Drawn on the reward panel when the run validated (verl.trainer.validation)."""
CURVES = (("reward/mean", "mean reward"), ("actor/kl", "KL to reference (rollout policy without one)"),
          ("actor/entropy", "entropy"))


def plot_curves(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Reward (with the held-out reward of validation, when there is one), KL and entropy against step, one panel
    each (Agg backend; no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.2))
    for ax, (key, label) in zip(axes, CURVES):
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            steps, values = zip(*pts)
            ax.plot(steps, values, marker=".", linewidth=0.8, alpha=0.5)
            k = max(1, len(values) // 20)  # running mean over ~5% of the run, for the trend
            smooth = [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1])
                      for i in range(len(values))]
            ax.plot(steps, smooth, linewidth=2)
        held_out = [(r["step"], r[VAL_CURVE]) for r in records if VAL_CURVE in r] if key == "reward/mean" else []
        if held_out:  # validation's reward on held-out prompts, on the same scale as the training reward
            ax.plot(*zip(*held_out), marker="o", linewidth=1.5, color="black", label="held-out (val/reward_mean)")
            ax.legend(fontsize=8)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def peak_memory_mb() -> float:
    """This process's peak memory so far: allocated GPU memory under CUDA, else the resident set's high-water
    mark (VmHWM)."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
