"""The one rollout config: the trainer's `rollout` subtree, consumed as it is by every generation engine.

    verl train rollout.engine=vllm rollout.tp=2          # the engine switch is this one value
    build_rollout(RolloutConfig(engine="torch"), model=hf_model, tokenizer=tok)

Sampling settings (n, max_new_tokens, temperature, top_p, top_k, ignore_eos) are what the trainer samples
with; engine settings are read only by the engine they name in their docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from verl.config.base import Range, check_ranges
from verl.engines import engines, rollout_engine
from verl.errors import VerlConfigError

__all__ = ["RolloutConfig"]


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Which engine generates, how it samples, and how the actor's weights reach it."""

    engine: str = "torch"
    """Generation engine, one of the rollout engines of `verl.engines` (`verl doctor` lists them): hf
    (transformers generate), torch (verl's batched KV-cache engine), vllm or sglang."""
    n: Annotated[int, Range(1, 1 << 16)] = 8
    """Responses sampled per prompt (the GRPO group size)."""
    max_new_tokens: Annotated[int, Range(1, 1 << 20)] = 8
    """Response length limit."""
    temperature: float = 1.0
    """Sampling temperature (also applied to the log-probs the actor trains on); 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 disables)."""
    top_k: Annotated[int, Range(0, 1 << 24)] = 0
    """Top-k sampling (0 disables)."""
    ignore_eos: bool = False
    """Keep sampling past EOS up to max_new_tokens (fixed-length responses, e.g. for benchmarks)."""
    max_model_len: Annotated[int | None, Range(2, 1 << 24)] = None
    """Longest prompt + response, enforced by every engine alike (a longer prompt is an error; a response stops
    with finish_reason 'length' there). None: the model's max_position_embeddings."""
    tp: Annotated[int, Range(1, 1024)] = 1
    """Tensor-parallel size of the generation layout (TP_g): the 3D-HybridEngine reshards the actor into it.
    vllm / sglang shard their model over TP_g ranks; torch and hf need 1."""
    sync_bucket_mb: float = 64.0
    """Per-rank bound (MiB) on one bucket of the weight sync (targets received plus slices sent)."""
    sync: Literal["full", "delta"] = "full"
    """What each weight sync moves. full: every weight. delta: per bucket only the elements whose value in the
    engine's dtype changed since the last sync (index + value, or a bitmask + values, whichever is smaller),
    with a checksum verified on arrival; a generation copy in a narrower dtype (rollout.dtype=bfloat16 beside
    float32 training) is where it pays: a small update rarely moves a bfloat16 value. Full fine-tuning only
    (LoRA moves just the adapter), engines with delta_sync in verl.engines, trainer.mode sync or one_step_off."""
    delta_verify_every: int = 100
    """rollout.sync=delta: every N-th sync the receiver recomputes the checksum of all its weights and compares
    it with the sender's (a mismatch is a full resync, counted in perf/sync_verify_failures); 0: never."""
    compare_full_gather: bool = False
    """Benchmark: before each sync also move the weights the way the 3D-HybridEngine replaced (megatron actors:
    the whole model gathered to one rank, broadcast to the model-parallel group, loaded whole) and log its time
    as perf/full_gather_s beside perf/sync_s, measured in the same run; with rollout.sync=delta (any actor on the
    rollout's ranks), the full sync of the same weights through the same plan, as perf/full_sync_s."""
    partial: bool = False
    """Partial rollouts (trainer.mode=async): generation in flight when a new weight version arrives is paused
    and resumed with the new weights, recording per token the version that produced it. It needs an engine
    that can pause (`EngineSpec.pausable` in `verl.engines`): the torch engine calls its pause hook between
    tokens, rebuilds the KV cache from the tokens so far when the weights moved, and records per-token versions
    (vllm, sglang and hf cannot pause, so true with them is refused before step 1). With
    trainer.async_versions=pinned the switch is scheduled instead (partial_switch_token)."""
    partial_switch_token: Annotated[int, Range(0, 1 << 20)] = 0
    """rollout.partial with trainer.async_versions=pinned: batch b (lag L) generates its first this many decode
    steps on a rank with version b - L and the rest with version b - L + 1, waiting for that version when it has
    not arrived yet (the actor makes it from batch b - L, already generated), so each token's version is fixed
    by the schedule and the run is reproducible and recovered exactly, as with pinned whole batches. 0: half of
    max_new_tokens. Only with partial and pinned versions (newest takes each version whenever it arrives)."""
    seed: Annotated[int, Range(0, (1 << 32) - 1)] = 0
    """Seed of the sampling streams (sample j of a prompt uses seed + j; see verl.rollout.base)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype of the generation copy (auto: the actor's). vllm / sglang load their model in it; torch /
    hf given another dtype than the actor's keep their own copy in it (instead of generating with the actor's
    module), and every sync casts the weights into it."""
    max_batch_size: Annotated[int, Range(1, 1 << 20)] = 1024
    """torch / hf: sequences decoded together; vllm: max_num_seqs."""
    decoder: Literal["fast", "model", "train"] = "fast"
    """torch: how tokens are decoded. fast: verl's static-cache decoder for Llama-family models (other
    architectures fall back to model); model: the model's own forward with its KV cache; train: the training
    forward itself over the whole [batch, prompt + response] buffer at every step (no KV cache, batches of
    max_batch_size rows, which the trainer sets to actor.micro_batch_size), so the samples come from exactly
    the distribution the trainer computes and the rollout/train log-prob mismatch is 0 bit for bit (the actor
    then trains on that padded layout too: actor.padding_free is turned off); it costs a full forward per
    generated token."""
    quantization: Literal["none", "int8"] = "none"
    """Weights of the generation copy only (the trained copy stays full precision). int8: weight-only, per
    output row, quantized by the engine after every weight sync and decoded by verl's int8 kernel
    (verl.ops.int8_linear; engines with int8 in `EngineSpec.quantization`: the torch engine's fast decoder). The
    sampling distribution then differs a little from the trained policy's: the run reports rollout/mismatch_kl
    and turns token-level truncated IS on (algorithm.rollout_correction.is_level=auto)."""
    kv_cache: bool = True
    """torch, decoder=model: reuse keys/values across steps; false recomputes the whole sequence (models
    without a cache)."""
    kv_cache_memory_mb: Annotated[int, Range(0, 1 << 30)] = 256
    """vllm: KV-cache size. Always set on CPU, where vLLM would otherwise claim 0.9 × RAM."""
    gpu_memory_utilization: float = 0.5
    """vllm (when kv_cache_memory_mb is 0) and sglang (mem_fraction_static): GPU memory fraction for weights
    and KV cache."""
    enforce_eager: bool = True
    """vllm: no CUDA graphs or compilation (fast start-up; required in-process on CPU)."""
    in_process: bool = True
    """vllm: run the engine inside this process (weights stream straight in); false: vLLM's own process."""
    cpu_offload: bool = False
    """Release the engine's memory while training runs, after each generation phase: torch / hf move the
    weights to the CPU, vllm / sglang enter sleep mode (KV cache and weights freed; GPU builds only).
    resume() before the next weight sync brings them back."""
    ranks: list[int] | None = None
    """World ranks that generate (None: trainer.placement decides): actor.ranks (the weights reach the engine in
    place), or ranks disjoint from them (the 3D-HybridEngine sends the weights there each step)."""
    engine_kwargs: dict = field(default_factory=dict)
    """Further keyword arguments passed to the engine's constructor (vllm.LLM, sglang.Engine)."""

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        spec = rollout_engine(self.engine, "rollout.engine")
        check_ranges(self)  # runs at construction (__post_init__), before from_dict would check them
        if not 0 <= self.temperature < math.inf:  # written so that NaN fails too
            raise VerlConfigError(f"rollout.temperature={self.temperature} must be a finite number >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise VerlConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if not 0 < self.sync_bucket_mb < math.inf:
            raise VerlConfigError(f"rollout.sync_bucket_mb={self.sync_bucket_mb} must be > 0")
        if not spec.tensor_parallel and self.tp != 1:
            raise VerlConfigError(f"rollout.tp={self.tp} with rollout.engine={self.engine}: the {self.engine} engine "
                                  f"runs one model replica per rank; use rollout.tp=1, or one of "
                                  f"{list(engines('rollout', tensor_parallel=True))} for tensor-parallel generation")
        if self.delta_verify_every < 0:
            raise VerlConfigError(f"rollout.delta_verify_every={self.delta_verify_every} must be >= 0 (0: never)")
        if self.sync == "delta" and not spec.delta_sync:
            raise VerlConfigError(f"rollout.sync=delta writes the changed elements into the engine's weights in "
                                  f"place, which rollout.engine={self.engine} does not let the sync do; use "
                                  f"rollout.sync=full, or one of {list(engines('rollout', delta_sync=True))}")
        if self.quantization != "none" and self.quantization not in spec.quantization:
            able = [n for n in engines("rollout") if self.quantization in rollout_engine(n).quantization]
            raise VerlConfigError(f"rollout.quantization={self.quantization} with rollout.engine={self.engine}: that "
                                  f"engine cannot generate with {self.quantization} weights; use rollout.quantization"
                                  f"=none, or one of {able}")
        if self.quantization != "none" and (self.decoder != "fast" or not self.kv_cache):
            raise VerlConfigError(f"rollout.quantization={self.quantization} runs in the torch engine's fast decoder, "
                                  f"but rollout.decoder={self.decoder} / rollout.kv_cache={self.kv_cache} does not "
                                  f"use it; set rollout.decoder=fast and rollout.kv_cache=true, or "
                                  f"rollout.quantization=none")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise VerlConfigError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")

    def sampling(self, *, n: int | None = None, greedy: bool = False, logprobs: bool = True):
        """The SamplingParams these settings describe (n and greedy overridable, e.g. for ReMax's baseline)."""
        from verl.rollout.base import SamplingParams
        return SamplingParams(max_new_tokens=self.max_new_tokens, n=self.n if n is None else n,
                              temperature=0.0 if greedy else self.temperature, top_p=self.top_p, top_k=self.top_k,
                              ignore_eos=self.ignore_eos, seed=None, logprobs=logprobs)
