"""Metrics sinks: JSONL (one record per step), TensorBoard, and a PNG of the reward / KL / entropy curves."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    """Appends `{"step": s, ...}` lines to metrics.jsonl and TensorBoard scalars; inactive off rank 0.

    On resume the JSONL keeps only records before the resumed step, so the file reads as one run.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, tensorboard: bool, start_step: int = 0):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step] if self.path.exists() else []
        with self.path.open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


CURVES = (("reward/mean", "mean reward"), ("actor/kl", "KL to reference (rollout policy without one)"),
          ("actor/entropy", "entropy"))


def plot_curves(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Reward, KL and entropy against step, one panel each (Agg backend; no display needed)."""
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
