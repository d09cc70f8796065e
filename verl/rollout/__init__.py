"""Rollout (generation) engines behind one interface: `hf`, `torch`, `vllm`, `sglang`.

    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    engine = build_rollout(RolloutConfig(engine="torch"), model=hf_model, tokenizer=tok)
    engine = build_rollout(RolloutConfig(engine="vllm"), model_path="/ckpt/actor")      # the one-value switch
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=1.0, seed=0, logprobs=True))
"""

from __future__ import annotations

from verl.errors import VerlConfigError
from verl.rollout.base import FINISH_REASONS, GenerationOutput, RolloutEngine, SamplingParams
from verl.rollout.config import ENGINES, RolloutConfig
from verl.rollout.tokenizer import Tokenizer
from verl.rollout.torch_engine import TorchRollout

__all__ = ["ENGINES", "PAUSABLE", "RolloutConfig", "build_rollout", "can_pause", "engine_available", "require_engine", "SamplingParams", "GenerationOutput",
           "RolloutEngine", "Tokenizer", "TorchRollout", "FINISH_REASONS"]


PAUSABLE: tuple[str, ...] = ("torch",)
"""Engines that can pause a generation in flight at a weight update and resume it with the new weights, as
rollout.partial needs: the torch engine calls its `pause_hook` between tokens, rebuilds the KV cache of every
live row from the tokens so far when the weight version moved, and records each token's version
(GenerationOutput.token_versions)."""


def can_pause(engine: str) -> bool:
    """Whether `engine` supports partial rollouts (rollout.partial)."""
    return engine in PAUSABLE


def engine_available(engine: str) -> tuple[bool, str]:
    """(whether `engine` can run here, what to install or change when it cannot): checked before any work."""
    if engine == "vllm":
        from verl.rollout.vllm_engine import vllm_available
        return vllm_available()
    if engine == "sglang":
        from verl.rollout.sglang_engine import sglang_available
        return sglang_available()
    return True, ""


def require_engine(engine: str) -> None:
    """Raises naming what to install when `engine` cannot run here (before any work is done)."""
    ok, why = engine_available(engine)
    if not ok:
        raise VerlConfigError(f"rollout.engine={engine} cannot run here: {why}")


def build_rollout(config: RolloutConfig, *, model=None, model_path: str | None = None,
                  tokenizer=None) -> RolloutEngine:
    """The engine `config.engine` names. hf / torch run `model` (any causal LM; loaded from `model_path` when
    no model is given); vllm / sglang load `model_path` (a Hugging Face directory) and receive later weights
    through update_weights."""
    require_engine(config.engine)
    if config.engine in ("hf", "torch"):
        if model is None:
            if model_path is None:
                raise VerlConfigError(f"the {config.engine} rollout engine needs `model=` (a causal LM) or "
                                      f"`model_path=` (a Hugging Face directory)")
            import torch
            from transformers import AutoModelForCausalLM
            dtype = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        tok = tokenizer if tokenizer is not None else model_path
        if config.engine == "hf":
            from verl.rollout.hf_engine import HFRollout
            return HFRollout(model, tok, config)
        return TorchRollout(model, tok, config)
    if model_path is None:
        raise VerlConfigError(f"the {config.engine} rollout engine loads a model directory: pass model_path= "
                              f"(save the actor with save_pretrained first)")
    if config.engine == "vllm":
        from verl.rollout.vllm_engine import VLLMRollout
        return VLLMRollout(config, model_path, tokenizer)
    from verl.rollout.sglang_engine import SGLangRollout
    return SGLangRollout(config, model_path, tokenizer)
