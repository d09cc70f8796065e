"""The `sglang` rollout engine: an adapter over SGLang's offline `Engine` with the same interface.

SGLang runs only on GPUs (its CPU path needs a special build), so on machines without one the engine refuses
to start with the reason, and its tests skip with it. Weights are pushed with SGLang's
`update_weights_from_tensor` (bucketed), release/resume map to `release_memory_occupation` /
`resume_memory_occupation`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from verl.errors import VerlConfigError
from verl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from verl.rollout.tokenizer import Tokenizer

__all__ = ["SGLangRolloutConfig", "SGLangRollout", "sglang_available"]


def sglang_available() -> tuple[bool, str]:
    """(usable here, reason if not)."""
    try:
        import sglang  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, (f"sglang is not importable ({type(e).__name__}: {e}); it runs on CUDA GPUs: "
                       f"`pip install verl[sglang]` on a GPU machine")
    if not torch.cuda.is_available():
        return False, "sglang is installed but there is no CUDA GPU; SGLang's offline engine needs one"
    return True, ""


@dataclass(kw_only=True, slots=True)
class SGLangRolloutConfig:
    """Settings of the SGLang engine."""

    model_path: str
    """Hugging Face model directory."""
    dtype: str = "auto"
    """Model dtype."""
    tensor_parallel_size: int = 1
    """SGLang's tp_size."""
    mem_fraction_static: float = 0.5
    """GPU memory fraction for weights + KV cache."""
    push_bucket_bytes: int = 64 << 20
    """Weights are pushed in lists of tensors of about this many bytes."""
    seed: int = 0
    """Engine random seed."""
    extra: dict = field(default_factory=dict)
    """Further keyword arguments for sglang.Engine."""


class SGLangRollout(RolloutEngine):
    name = "sglang"

    def __init__(self, config: SGLangRolloutConfig, tokenizer=None):
        ok, why = sglang_available()
        if not ok:
            raise VerlConfigError(f"the sglang rollout engine cannot run here: {why}")
        import sglang
        super().__init__(Tokenizer.wrap(tokenizer if tokenizer is not None else config.model_path))
        self.config = config
        self.engine = sglang.Engine(model_path=config.model_path, dtype=config.dtype,
                                    tp_size=config.tensor_parallel_size,
                                    mem_fraction_static=config.mem_fraction_static, random_seed=config.seed,
                                    **config.extra)

    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        jobs = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
        sp = [dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k > 0 else -1, stop=list(params.stop) or None,
                   stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
                   sampling_seed=params.sample_seed(i, j)) for i, j in jobs]
        res = self.engine.generate(input_ids=[prompt_ids[i] for i, _ in jobs], sampling_params=sp,
                                   return_logprob=params.logprobs)
        outs = []
        for (i, j), r in zip(jobs, res):
            meta = r.get("meta_info", {})
            tokens = list(r.get("output_ids") or self.tokenizer.encode(r["text"], add_special_tokens=False))
            lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])] if params.logprobs else None
            fr = meta.get("finish_reason") or {}
            reason = "length" if (fr.get("type") if isinstance(fr, dict) else fr) == "length" else "stop"
            outs.append(self._finish(i, j, prompt_ids[i], tokens, reason, lps, params.stop))
        return outs

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        bucket, size, count = [], 0, 0
        for name, t in named_tensors:
            bucket.append((name, t))
            size += t.nbytes
            count += 1
            if size >= self.config.push_bucket_bytes:
                self.engine.update_weights_from_tensor(bucket)
                bucket, size = [], 0
        if bucket:
            self.engine.update_weights_from_tensor(bucket)
        self.engine.flush_cache()
        return count

    def _release(self) -> None:
        self.engine.release_memory_occupation()

    def _resume(self) -> None:
        self.engine.resume_memory_occupation()
