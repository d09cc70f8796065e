"""The one learning-rate schedule of every training engine: lr = optim.lr × optim.lr_factor(step, total_steps)
(`verl.config.ppo.OptimConfig`: linear warm-up, then constant, linear or cosine decay to min_lr).

    schedule = LRSchedule(optimizer, optim_cfg, total_steps)    # sets the step-0 learning rate
    optimizer.step(); schedule.step()                            # after each applied update

It writes `lr` into the optimizer's `param_groups` (a torch optimizer, or megatron-core's, which exposes its
inner optimizer's groups the same way), and its state is the one number `step`, so a checkpoint of any engine
restores the same schedule.
"""

from __future__ import annotations

__all__ = ["LRSchedule"]


class LRSchedule:
    """Steps an optimizer's learning rate along `optim.lr_factor`."""

    def __init__(self, optimizer, optim, total_steps: int):
        self.optimizer, self.optim, self.total_steps = optimizer, optim, max(1, int(total_steps))
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        lr = self.optim.lr * self.optim.lr_factor(self.last_step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """Advances one optimizer step."""
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        step = state.get("last_step") if isinstance(state, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"an LR schedule state needs 'last_step', an int >= 0; got {state!r}")
        self.last_step = step
        self._apply()
