"""Rollout (generation) engines behind one interface: `hf`, `torch`, `vllm`, `sglang`.

    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    engine = build_rollout(RolloutConfig(engine="torch"), model=hf_model, tokenizer=tok)
    engine = build_rollout(RolloutConfig(engine="vllm"), model_path="/ckpt/actor")      # the one-value switch

The engines and what each can do are the table in `verl.engines`.
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=1.0, seed=0, logprobs=True))
"""

from __future__ import annotations

from verl.engines import engines, rollout_engine
from verl.rollout.base import FINISH_REASONS, GenerationOutput, RolloutEngine, SamplingParams
from verl.rollout.config import RolloutConfig
from verl.rollout.tokenizer import Tokenizer
from verl.rollout.torch_engine import TorchRollout

__all__ = ["RolloutConfig", "build_rollout", "engine_available", "pausable_engines", "SamplingParams",
           "GenerationOutput", "RolloutEngine", "Tokenizer", "TorchRollout", "FINISH_REASONS"]


def engine_available(engine: str) -> tuple[bool, str]:
    """(whether `engine` can run here, what to install or change when it cannot): checked before any work."""
    return rollout_engine(engine, "rollout.engine").check_available()


def build_rollout(config: RolloutConfig, *, model=None, model_path: str | None = None,
                  tokenizer=None) -> RolloutEngine:
    """The engine `config.engine` names (`verl.engines`). Engines that share the actor's module (hf, torch) run
    `model` (any causal LM; loaded from `model_path` when no model is given); engines that load a model
    directory (vllm, sglang) load `model_path` and receive later weights through update_weights."""
    spec = rollout_engine(config.engine, "rollout.engine")
    spec.require("rollout.engine")
    return spec.load().from_config(config, model=model, model_path=model_path, tokenizer=tokenizer)


def pausable_engines() -> tuple[str, ...]:
    """Engines that can pause a generation in flight for new weights (rollout.partial)."""
    return engines("rollout", pausable=True)
