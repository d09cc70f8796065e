"""The plain-torch training engine: one model replica per rank, gradients averaged over ranks (data
parallel with explicit all-reduce, so it runs on gloo as well as NCCL), AdamW with linear warm-up and
global-norm clipping. The megatron engine offers the same three calls (forward under `module`, `step`,
`state`) for TP/PP models.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.config.ppo import OptimConfig
from verl.utils.distributed import World


class TorchEngine:
    """Owns a module and (unless frozen) its optimizer and LR schedule."""

    def __init__(self, module: torch.nn.Module, optim: OptimConfig | None, world: World):
        self.module = module.to(world.device)
        self.world = world
        self.optim_cfg = optim
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        if optim is None:
            self.module.requires_grad_(False)
            self.module.eval()
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                           weight_decay=optim.weight_decay, foreach=False)
        warm = max(optim.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.broadcast_parameters()

    def broadcast_parameters(self) -> None:
        """Makes every rank start from rank 0's weights."""
        if self.world.distributed:
            for p in self.module.parameters():
                dist.broadcast(p.data, src=0)

    def _all_reduce_grads(self) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not self.world.distributed or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def step(self) -> float:
        """All-reduces gradients, clips, steps the optimizer and schedule; returns the pre-clip grad norm."""
        assert self.optimizer is not None, "frozen engine has no optimizer"
        self._all_reduce_grads()
        params = [p for p in self.module.parameters() if p.grad is not None]
        clip = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=False) if params else torch.tensor(0.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0
