"""Registry of rule-based rewards and the checked batch scorer.

A rule-based reward is a plain function ``fn(response: str, ground_truth: str, prompt: str) -> float``:

    from verl.rewards import register_reward

    @register_reward("ends_politely")
    def ends_politely(response, ground_truth, prompt):
        return 1.0 if response.rstrip().endswith("please") else 0.0

and is chosen with ``reward.name=ends_politely``, or without registering as ``reward.name=my_pkg.rewards:fn``
(an importable ``module:function`` path, which also reaches processes that torchrun spawns). ``prompt`` is the
row's prompt as the dataset holds it: text, or chat messages. A reward that raises or returns NaN / a
non-number stops the step with a `VerlRuntimeError` naming the reward, the sample's index in the step's batch
and the head of its response, before anything of that step is logged or saved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.registry import Registry

RewardFn = Callable[[str, str, str], float]
REWARDS: Registry = Registry("reward", key="reward.name", refs=True)
"""Rule-based rewards by name; ``module:function`` references reach user code (re-registering a name is an
error naming both functions)."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`."""
    return REWARDS.register(name)


def list_rewards() -> list[str]:
    return REWARDS.names()


def get_reward(name: str) -> RewardFn:
    """The reward registered as `name`, or the function a ``module:function`` reference names."""
    fn = REWARDS.get(name)
    if not callable(fn):
        raise VerlConfigError(f"reward.name={name!r} is not a function")
    return fn


def _head(text: str, width: int = 120) -> str:
    """A sample's text, cut to its first `width` characters (responses run to hundreds of tokens)."""
    text = str(text)
    return repr(text) if len(text) <= width else f"{text[:width]!r}... ({len(text)} chars)"


def score_batch(fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], prompts: Sequence[str],
                name: str | None = None) -> torch.Tensor:
    """Scores each response; returns float32 [len(responses)]. Failures and NaNs raise `VerlRuntimeError`."""
    label = name or getattr(fn, "__name__", "reward")
    out = []
    for i, (resp, gt, prompt) in enumerate(zip(responses, ground_truths, prompts, strict=True)):
        try:
            value = fn(resp, gt, prompt)
        except Exception as e:  # noqa: BLE001 - re-raised with the sample that broke it
            raise VerlRuntimeError(f"reward {label!r} raised {type(e).__name__}: {e} on sample {i} "
                                   f"(response {_head(resp)}, ground truth {_head(gt)})", node="reward",
                                   cause=e) from e
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise VerlRuntimeError(f"reward {label!r} returned {value!r} for sample {i} (response {_head(resp)}, "
                                   f"ground truth {_head(gt)}); a reward must be a finite float", node="reward")
        out.append(float(value))
    return torch.tensor(out, dtype=torch.float32)
