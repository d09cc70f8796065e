"""The one optimizer config, read by every training engine (plain torch / DDP, megatron-core)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from verl.errors import VerlConfigError

__all__ = ["OptimConfig"]


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warm-up + decay learning-rate schedule."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (linear / cosine)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after the warm-up, over the job's remaining steps."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up in optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    def check(self) -> None:
        if not self.lr > 0 or not self.min_lr >= 0 or self.min_lr > self.lr:
            raise VerlConfigError(f"optim: lr={self.lr} must be > 0 and 0 <= min_lr={self.min_lr} <= lr")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0 or not self.eps > 0:
            raise VerlConfigError(f"optim: warmup_steps={self.warmup_steps}, weight_decay={self.weight_decay} and "
                                  f"grad_clip={self.grad_clip} must be >= 0 and eps={self.eps} > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise VerlConfigError(f"optim.betas={self.betas} must be two numbers in [0, 1)")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of `lr` at optimizer step `step` of `total_steps` (warm-up, then the decay style)."""
        import math
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_decay_style == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        shape = 1.0 - progress if self.lr_decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        floor = self.min_lr / self.lr
        return floor + (1.0 - floor) * shape
