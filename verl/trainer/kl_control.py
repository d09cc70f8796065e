"""KL-in-reward coefficient controllers (their state is part of a checkpoint)."""

from __future__ import annotations

from verl.config.ppo import KLControlConfig
from verl.errors import VerlConfigError
from verl.utils.state_check import Dict, Float, Spec


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])

    @staticmethod
    def state_spec() -> Spec:
        """A restored coefficient: finite and >= 0 (the adaptive update multiplies it by factors in [0.8, 1.2])."""
        return Dict({"value": Float(0.0)})


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019): move the coefficient so the measured KL approaches `target`, proportionally
    with the error clipped to ±20%, at a rate of n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if not target_kl > 0 or not horizon >= 1:  # update() divides by both
            raise VerlConfigError(f"algorithm.kl_ctrl: the adaptive controller needs target_kl > 0 and horizon >= 1, "
                                  f"got target_kl={target_kl}, horizon={horizon}")
        super().__init__(init_kl_coef)
        self.target, self.horizon = target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(cfg: KLControlConfig) -> FixedKLController:
    if cfg.type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    return FixedKLController(cfg.kl_coef)
