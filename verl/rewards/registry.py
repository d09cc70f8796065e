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

import difflib
import math
from collections.abc import Callable, Sequence

import torch

from verl.errors import VerlConfigError, VerlRuntimeError

RewardFn = Callable[[str, str, str], float]
_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name` (re-registering a name replaces it)."""
    def wrap(fn: RewardFn) -> RewardFn:
        _REWARDS[name] = fn
        return fn
    return wrap


def list_rewards() -> list[str]:
    return sorted(_REWARDS)


def get_reward(name: str) -> RewardFn:
    if ":" in name and name not in _REWARDS:
        import importlib
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise VerlConfigError(f"reward.name={name!r}: cannot import {attr!r} from {module!r} ({e})") from e
        if not callable(fn):
            raise VerlConfigError(f"reward.name={name!r} is not a function")
        return fn
    if name not in _REWARDS:
        close = difflib.get_close_matches(name, list(_REWARDS), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise VerlConfigError(f"unknown reward {name!r} (reward.name); {hint}registered: {', '.join(list_rewards())}")
    return _REWARDS[name]


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
