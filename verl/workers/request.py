"""What the trainer hands a training engine: `EngineRequest`, one role's module, layout and optimizer.

    spec = training_engine(cfg.actor.engine)          # verl.engines: the engine table
    engine = spec.load().from_role(EngineRequest(role="actor", policy=model, ...))

Every training engine class (TorchEngine, FSDPEngine, MegatronEngine, or a new one) builds itself from this in a
classmethod `from_role(request)`, so the trainer never names an engine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from verl.config.ppo import OptimConfig, PPOConfig
from verl.distributed import Placement
from verl.workers.critic import ValueModel

__all__ = ["EngineRequest"]


@dataclass(kw_only=True, slots=True)
class EngineRequest:
    """One role's training engine, as the job's config describes it."""

    role: str
    """actor, ref or critic."""
    policy: torch.nn.Module
    """The warm-started policy (a Hugging Face causal LM). The actor's torch engine trains it in place, which is
    what lets a colocated torch / hf rollout generate with the same module."""
    init_dir: Path | None
    """The policy saved as a Hugging Face directory, for engines that load one (`EngineSpec.needs_model_dir`)."""
    placement: Placement
    """This rank's place among the role's ranks."""
    cfg: PPOConfig
    """The job's config (engine-specific sections: actor.megatron, actor.fsdp / critic.fsdp)."""
    cpu_offload: bool = False
    """The role keeps its memory on the CPU between its nodes."""

    @property
    def optim(self) -> OptimConfig | None:
        return {"actor": self.cfg.actor.optim, "ref": None, "critic": self.cfg.critic.optim}[self.role]

    @property
    def head(self) -> str:
        """'value' for the critic, else 'lm'."""
        return "value" if self.role == "critic" else "lm"

    @property
    def total_steps(self) -> int:
        return self.cfg.trainer.total_steps

    @property
    def sync_view(self) -> str:
        """What the weight sync moves from this role's engine (verl.models.lora.SYNC_VIEWS): with actor.lora the
        actor's adapters ("adapter") or its merged weights ("merged"), else every weight."""
        lora = self.cfg.actor.lora
        return lora.sync if self.role == "actor" and lora.enabled else "all"

    def module(self, *, share: bool = True) -> torch.nn.Module:
        """The role's torch module: a value model on the policy's trunk for the critic (without the actor's LoRA
        adapters: the critic trains every weight), else the policy itself for the actor (when `share`) and a
        copy for the reference."""
        if self.role == "critic":
            from verl.models.lora import has_lora, strip_lora
            value = ValueModel.from_causal_lm(self.policy)
            return strip_lora(value) if has_lora(value) else value
        return self.policy if share and self.role == "actor" else copy.deepcopy(self.policy)
