"""One interface over every generation engine (torch, vLLM, SGLang): `SamplingParams` in,
`GenerationOutput`s out, weights pushed in as a stream of Hugging-Face-named tensors.

    engine = build_rollout(RolloutConfig(engine="torch"), model=hf_model, tokenizer=tok)   # or "vllm"
    outs = engine.generate(["2+2="], SamplingParams(max_new_tokens=8, temperature=0))
    engine.update_weights(hybrid_engine.stream(local_params))     # before each generation phase
    engine.release(); ...train...; engine.resume()

Seeding convention, identical in every engine so that their outputs can be compared: sample j of prompt i
(of `n`) is generated with seed `seed + i·n + j`, by its own random stream (so no two samples of one call share
noise); a sampled token is the Gumbel-max (exponential race) winner argmax(p / q), q ~ Exp(1) in float64 drawn
from that stream, one draw per step.
"""

from __future__ import annotations

import abc
import contextlib
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from verl.errors import VerlConfigError, VerlRuntimeError

__all__ = ["SamplingParams", "GenerationOutput", "RolloutEngine", "Prompt", "FINISH_REASONS", "length_limit",
           "check_token_ids"]

Prompt = str | Sequence[int]
FINISH_REASONS = ("stop", "length")


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample; shared by every engine."""

    max_new_tokens: int = 64
    """Most tokens generated per sample."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 or -1 = off)."""
    n: int = 1
    """Samples per prompt."""
    stop: tuple[str, ...] = ()
    """Strings that end a sample; the text is cut before the stop string."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (kept in token_ids), in addition to the tokenizer's EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    seed: int | None = None
    """Seed of the call's first sample (sample j of prompt i uses seed + i·n + j); None draws from the global
    torch RNG (torch engine) or the engine's own generator."""
    logprobs: bool = False
    """Return the log-probability of every sampled token under the sampling distribution (temperature,
    top-k and top-p applied)."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise VerlConfigError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise VerlConfigError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise VerlConfigError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise VerlConfigError(f"SamplingParams.top_k={self.top_k} must be >= 1, or 0 / -1 for off")
        if self.n < 1:
            raise VerlConfigError(f"SamplingParams.n={self.n} must be >= 1")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if any(s == "" for s in self.stop):
            raise VerlConfigError("SamplingParams.stop contains an empty string; remove it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sample_seed(self, i: int, j: int) -> int | None:
        """The seed of sample j of prompt i (None when the call is unseeded)."""
        return None if self.seed is None else self.seed + i * self.n + j


@dataclass(kw_only=True, slots=True)
class GenerationOutput:
    """One sample of one prompt."""

    prompt_index: int
    """Index of the prompt in the `generate` call."""
    sample_index: int
    """j in 0..n-1."""
    prompt_token_ids: list[int]
    """The prompt as token ids."""
    token_ids: list[int]
    """Generated token ids (a final EOS / stop token id included)."""
    text: str
    """Decoded generated text (special tokens skipped, cut before a stop string)."""
    finish_reason: str
    """"stop" (EOS, stop token or stop string) or "length" (max_new_tokens reached)."""
    logprobs: list[float] | None = field(default=None)
    """Log-probability of each generated token when SamplingParams.logprobs, else None."""
    token_versions: list[int] | None = field(default=None)
    """The weight version that produced each generated token (what the engine's `pause_hook` returned before
    sampling it; same length as token_ids), or None when no hook was set (partial rollouts)."""
    routes: torch.Tensor | None = field(default=None)
    """[prompt + generated tokens fed to the model, L, K] int16: the K experts each token went to in each of the
    model's L mixture-of-experts layers (the prompt's tokens, then every generated token but the last, which is
    never fed back), or None when the engine records no routes (`EngineSpec.router_replay`)."""


def length_limit(configured: int | None, positions: int | None) -> int | None:
    """The one length rule of every engine: the longest prompt + response is rollout.max_model_len, else the
    model's max_position_embeddings (None: unbounded, for a model that declares none). A max_model_len beyond
    the model's positions is refused: positions past them were never trained (RoPE extrapolation, or an index
    past a learned position table). A prompt that leaves no room under the limit is refused in `generate`; a
    response stops at it with finish_reason "length" (`budget`)."""
    if configured is not None and positions is not None and configured > positions:
        raise VerlConfigError(f"rollout.max_model_len={configured} exceeds the model's max_position_embeddings="
                              f"{positions}; use at most {positions} (or leave it unset)")
    return configured if configured is not None else positions


def check_token_ids(rows: Sequence[Sequence[int]], vocab_size: int | None, what: str = "prompt") -> None:
    """Every id of every row an int in [0, vocab_size) (None: only the type is checked); else VerlConfigError
    naming the row, the position, the id and the vocabulary (an embedding lookup would raise a bare
    IndexError, or worse on a GPU, a device-side assert)."""
    for i, row in enumerate(rows):
        for j, t in enumerate(row):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise VerlConfigError(f"{what} {i} has {t!r} ({type(t).__name__}) at position {j}; token ids are "
                                      f"ints")
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise VerlConfigError(f"{what} {i} has token id {t} at position {j}, outside the model's vocabulary "
                                      f"of {vocab_size} ids [0, {vocab_size}); encode prompts with the model's "
                                      f"own tokenizer")


class RolloutEngine(abc.ABC):
    """The interface every generation engine implements. Engine failures raise VerlRuntimeError."""

    name: str = "?"

    def __init__(self, tokenizer, *, max_model_len: int | None = None):
        self.tokenizer = tokenizer
        self.released = False
        self.max_model_len = max_model_len
        """Longest prompt + response (None: unbounded); set by `length_limit`, enforced alike in every engine
        (generate, budget)."""
        self.vocab_size: int | None = None
        """Token ids the model embeds (its embedding rows), checked on every prompt; None: not known."""
        self.pause_hook: Callable[[], int] | None = None
        """Partial rollouts (rollout.partial): an engine that can pause (`EngineSpec.pausable`) calls this
        once per decode step, after the prefill and before sampling each generated token. It returns the weight
        version the engine holds now and may first load newer weights through `update_weights`; when the
        version differs from the previous token's, the engine rebuilds its KV cache from the tokens so far with
        the current weights before sampling. Each token's version lands in GenerationOutput.token_versions.
        Engines that cannot pause ignore it."""
        self.sync_base: tuple[str, int] | None = None
        """The tag of the last delta sync written into the weights (verl.hybrid_engine.delta); any other weight
        load clears it, so the next delta sync knows its base is gone and sends everything."""

    # -- the interface --------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config, *, model=None, model_path: str | None = None, tokenizer=None) -> "RolloutEngine":
        """The engine for the rollout config `config` (`verl.rollout.build_rollout` calls this on the class the
        engine table names). Engines that load a model directory take `model_path` (and the tokenizer, or load
        it from there); this default is theirs: ``cls(config, model_path, tokenizer)``."""
        if model_path is None:
            raise VerlConfigError(f"the {cls.name} rollout engine loads a model directory: pass model_path= "
                                  f"(save the actor with save_pretrained first)")
        return cls(config, model_path, tokenizer)

    def generate(self, prompts: Sequence[Prompt] | Prompt, sampling_params: SamplingParams | None = None,
                 ) -> list[GenerationOutput]:
        """`n` samples per prompt, prompt-major ([p0s0, p0s1, ..., p1s0, ...])."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if self.released:
            raise VerlRuntimeError(f"the {self.name} rollout engine is released; call resume() before generate()")
        ids = [self._encode(i, p) for i, p in enumerate(prompts)]
        check_token_ids(ids, self.vocab_size)
        ids = [[int(t) for t in row] for row in ids]
        for i, p in enumerate(ids):
            if not p:
                raise VerlConfigError(f"prompt {i} is empty; every prompt needs at least one token")
            if self.max_model_len is not None and len(p) >= self.max_model_len:
                raise VerlConfigError(f"prompt {i} is {len(p)} tokens, which leaves no room to generate within "
                                      f"max_model_len={self.max_model_len} (prompt + response); shorten the prompt or "
                                      f"raise rollout.max_model_len")
        with self._engine_errors("generate"):
            return self._generate(ids, params)

    def _encode(self, i: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, (str, torch.Tensor)) or (len(prompt) > 0 and isinstance(prompt[0], dict)):
            return self.tokenizer.encode_prompt(prompt)
        if not isinstance(prompt, Sequence):
            raise VerlConfigError(f"prompt {i} is a {type(prompt).__name__}; give text, token ids or chat messages")
        return list(prompt)  # token ids are checked as they are, never cast (int(2.7) would be 2)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Loads HF-named tensors (consumed one by one, so a bucketed stream never piles up); returns the count."""
        self.sync_base = None
        with self._engine_errors("update_weights"):
            return self._update_weights(named_tensors)

    def weight_names(self) -> set[str] | None:
        """Every weight name update_weights accepts (None when the engine cannot tell up front)."""
        return None

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's live weight tensors by the names update_weights takes, for a sync that writes changed
        elements in place (rollout.sync=delta; engines with `delta_sync` in verl.engines)."""
        raise VerlConfigError(f"the {self.name} rollout engine does not expose its weights for a delta sync; use "
                              f"rollout.sync=full")

    def release(self) -> None:
        """Frees the engine's memory (KV cache; weights where the engine supports it) for the training phase."""
        with self._engine_errors("release"):
            self._release()
        self.released = True

    def resume(self) -> None:
        """Takes the memory back after `release`; weights must be pushed again if they were freed."""
        with self._engine_errors("resume"):
            self._resume()
        self.released = False

    def close(self) -> None:
        """Shuts the engine down for good (its processes, threads and process groups); idempotent."""

    # -- implemented by engines -----------------------------------------------------------------------------

    @abc.abstractmethod
    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[GenerationOutput]: ...

    @abc.abstractmethod
    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    @abc.abstractmethod
    def _release(self) -> None: ...

    @abc.abstractmethod
    def _resume(self) -> None: ...

    # -- helpers ----------------------------------------------------------------------------------------------

    def budget(self, prompt_len: int, params: SamplingParams) -> int:
        """Tokens a sample of a `prompt_len`-token prompt may generate: max_new_tokens, cut so that prompt +
        response stays within max_model_len (the sample then ends with finish_reason "length")."""
        if self.max_model_len is None:
            return params.max_new_tokens
        return min(params.max_new_tokens, self.max_model_len - prompt_len)

    @contextlib.contextmanager
    def _engine_errors(self, what: str):
        try:
            yield
        except (VerlRuntimeError, VerlConfigError):
            raise
        except Exception as e:  # noqa: BLE001 - every engine failure becomes one error type, cause chained
            raise VerlRuntimeError(f"{self.name} rollout engine failed in {what}: {type(e).__name__}: {e}",
                                   cause=e) from e

    def _finish(self, prompt_index: int, sample_index: int, prompt: list[int], tokens: list[int], reason: str,
                logprobs: list[float] | None, stop: Sequence[str],
                token_versions: list[int] | None = None, routes: torch.Tensor | None = None) -> GenerationOutput:
        """Builds an output; cuts the text before the first stop string."""
        text = self.tokenizer.decode(tokens)
        for s in stop:
            at = text.find(s)
            if at >= 0:
                text, reason = text[:at], "stop"
        return GenerationOutput(prompt_index=prompt_index, sample_index=sample_index, prompt_token_ids=list(prompt),
                                token_ids=list(tokens), text=text, finish_reason=reason, logprobs=logprobs,
                                token_versions=token_versions, routes=routes)
