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

    History is append-only: nothing already in the file is rewritten or truncated. A run resumed from step s
    first appends the marker `{"step": s, "resumed_from_step": s}`; `metrics_view` (what the plot reads) shows
    one record per step, in which the rows a resumed run writes replace those of the steps after s written before
    the resume (the stretch it redoes). A kill mid-write leaves a torn last line: the resumed run ends it with a
    newline, and readers skip a torn line that is followed by a resume marker, with a warning. TensorBoard gets a
    new event file per session (its purge step hides the redone stretch; no event file is rewritten).
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, tensorboard: bool, start_step: int = 0,
                 filename: str = "metrics.jsonl"):
        self.enabled = enabled
        self.path = Path(output_dir) / filename
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            if f.tell() and not _ends_with_newline(self.path):
                warnings.warn(f"{self.path}: the last line was cut short (a kill mid-write); it stays, ended by a "
                              f"newline, and readers skip it", stacklevel=2)
                f.write(b"\n")
            if start_step > 0:
                f.write((json.dumps({"step": start_step, "resumed_from_step": start_step}) + "\n").encode())
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v if isinstance(v, list) else float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if not isinstance(v, list) and math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl as written (see `metrics_view` for one per step). A torn line (a kill
    mid-write) is skipped with a warning when it is the last one or a resume marker follows it; an unreadable line
    elsewhere is a VerlConfigError naming it."""
    path = Path(path)
    lines = [(i, line) for i, line in enumerate(path.read_text().split("\n")) if line.strip()]
    out = []
    for j, (i, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if _is_torn(lines, j):
                warnings.warn(f"{path}: skipping the torn line {i + 1} ({line[:60]!r}...)", stacklevel=2)
                continue
            raise VerlConfigError(f"{path} line {i + 1} is not a JSON record ({e}): {line[:80]!r}; delete that "
                                  f"line (or the file) to go on") from e
        out.append(record)
    return out


def _is_torn(lines: list[tuple[int, str]], j: int) -> bool:
    if j == len(lines) - 1:
        return True
    try:
        nxt = json.loads(lines[j + 1][1])
    except ValueError:
        return False
    return isinstance(nxt, dict) and "resumed_from_step" in nxt


def metrics_view(records: list[dict]) -> list[dict]:
    """One record per step, in step order of first appearance: rows of a step merge (later values win), and a
    resume marker of step s drops the rows of steps after s written before it (the resumed run redoes them)."""
    merged: dict[object, dict] = {}
    for r in records:
        if "resumed_from_step" in r:
            s = r["resumed_from_step"]
            merged = {k: v for k, v in merged.items() if not (isinstance(k, (int, float)) and k > s)}
        merged.setdefault(r.get("step"), {}).update(r)
    return list(merged.values())


VAL_CURVE = "val/reward_mean"
"""Drawn on the reward panel when the run validated (verl.trainer.validation)."""
CURVES = (("reward/mean", "mean reward"), ("actor/kl", "KL to reference (rollout policy without one)"),
          ("actor/entropy", "entropy"))
AGENT_CURVES = (("rollout/tool_use_rate", "tool-use rate (trajectories calling a tool)"),
                ("rollout/turns_mean", "turns per trajectory"))
"""Panels added when the run logged them (multi-turn rollouts, verl.agents)."""


def plot_curves(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Reward (with the held-out reward of validation, when there is one), KL and entropy against step, one panel
    each (Agg backend; no display needed); an agent run's tool-use rate and turns too."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = metrics_view(read_metrics(metrics_path))
    curves = CURVES + tuple(c for c in AGENT_CURVES if any(c[0] in r for r in records))
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.2))
    for ax, (key, label) in zip(axes, curves):
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
