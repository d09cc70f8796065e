"""Rollout (generation) engines behind one interface: `torch`, `vllm`, `sglang`.

    from verl.rollout import RolloutConfig, SamplingParams, build_rollout
    engine = build_rollout(RolloutConfig(engine="torch"), model=hf_model, tokenizer=tok)
    engine = build_rollout(RolloutConfig(engine="vllm", model_path="/ckpt/actor"))     # the one-value switch
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=1.0, seed=0, logprobs=True))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.errors import VerlConfigError
from verl.rollout.base import FINISH_REASONS, GenerationOutput, RolloutEngine, SamplingParams
from verl.rollout.tokenizer import Tokenizer
from verl.rollout.torch_engine import TorchRollout, TorchRolloutConfig

__all__ = ["ENGINES", "RolloutConfig", "build_rollout", "SamplingParams", "GenerationOutput", "RolloutEngine",
           "Tokenizer", "TorchRollout", "TorchRolloutConfig", "FINISH_REASONS"]

ENGINES = ("torch", "vllm", "sglang")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Which engine generates, and its settings; switching engines is the one value `engine`."""

    engine: str = "torch"
    """"torch", "vllm" or "sglang"."""
    model_path: str | None = None
    """HF model directory: what vLLM/SGLang load at start-up; the torch engine loads it when no model is given."""
    dtype: str = "float32"
    """Weights dtype for engines that load `model_path`."""
    tensor_parallel_size: int = 1
    """Generation TP (vllm / sglang)."""
    max_batch_size: int = 64
    """torch: sequences per decode batch; vllm: max_num_seqs."""
    max_model_len: int | None = None
    """vllm: longest prompt + response (None: the model's max_position_embeddings)."""
    kv_cache_memory_bytes: int = 256 << 20
    """vllm: KV-cache bytes (always set on CPU, else vLLM claims 0.9 × RAM)."""
    enable_sleep_mode: bool = False
    """vllm: release()/resume() free the KV cache and weights (GPU builds)."""
    in_process: bool = True
    """vllm: run the engine in this process."""
    seed: int = 0
    """Engine seed."""
    extra: dict = field(default_factory=dict)
    """Engine-specific keyword arguments passed through."""

    def __post_init__(self):
        if self.engine not in ENGINES:
            import difflib
            near = difflib.get_close_matches(self.engine, ENGINES, n=1)
            raise VerlConfigError(f"unknown rollout engine {self.engine!r}; choose one of {ENGINES}"
                                  f"{f' (did you mean {near[0]!r}?)' if near else ''}")


def build_rollout(config: RolloutConfig, *, model=None, tokenizer=None) -> RolloutEngine:
    """Builds the engine `config.engine` names. torch: `model` (any causal LM) or `config.model_path`."""
    if config.engine == "torch":
        if model is None:
            if config.model_path is None:
                raise VerlConfigError("the torch rollout engine needs `model=` or RolloutConfig.model_path")
            import torch
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=getattr(torch, config.dtype))
        tok = tokenizer if tokenizer is not None else config.model_path
        return TorchRollout(model, tok, TorchRolloutConfig(max_batch_size=config.max_batch_size, **config.extra))
    if config.model_path is None:
        raise VerlConfigError(f"the {config.engine} rollout engine loads a model directory: set RolloutConfig."
                              f"model_path (save the actor with save_pretrained first)")
    if config.engine == "vllm":
        from verl.rollout.vllm_engine import VLLMRollout, VLLMRolloutConfig
        return VLLMRollout(VLLMRolloutConfig(
            model_path=config.model_path, dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size,
            max_model_len=config.max_model_len, max_num_seqs=config.max_batch_size,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes, enable_sleep_mode=config.enable_sleep_mode,
            in_process=config.in_process, seed=config.seed, extra=dict(config.extra)), tokenizer)
    from verl.rollout.sglang_engine import SGLangRollout, SGLangRolloutConfig
    return SGLangRollout(SGLangRolloutConfig(model_path=config.model_path, dtype=config.dtype,
                                             tensor_parallel_size=config.tensor_parallel_size, seed=config.seed,
                                             extra=dict(config.extra)), tokenizer)
