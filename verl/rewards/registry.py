"""Registry of rule-based rewards and the checked batch scorer.

A rule-based reward is a plain function ``fn(response: str, ground_truth: str, prompt: str) -> float``:

    from verl.rewards import register_reward

    @register_reward("ends_politely")
    def ends_politely(response, ground_truth, prompt):
        return 1.0 if response.rstrip().endswith("please") else 0.0

and is chosen with ``reward.name=ends_politely``, or without registering as ``reward.name=my_pkg.rewards:fn``
(an importable ``module:function`` path, which also reaches processes that torchrun spawns), or as
``reward.name=path/to/file.py:fn`` (a Python file: upstream verl's ``custom_reward_function.path`` / ``.name``;
the file a function came from is logged). ``prompt`` is the row's prompt as the dataset holds it: text, or chat
messages.

Upstream verl's signature is called as it is: a function with a ``solution_str`` (or ``data_source``) parameter
is ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, one with ``solution_strs`` the
batched form ``compute_score(data_sources, solution_strs, ground_truths, extra_infos)`` returning one result per
sample. Any reward may return a number, or a dict with a ``score`` number plus further entries; the numeric ones
are logged per key (reward/<key>/mean). A reward that raises or returns NaN / a non-number (or a dict without
``score``) stops the step with a `VerlRuntimeError` naming the reward, the sample's index in the step's batch
and the head of its response, before anything of that step is logged or saved.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.registry import Registry

RewardFn = Callable[[str, str, str], float]
REWARDS: Registry = Registry("reward", refs=True)
"""Rule-based rewards by name; ``module:function`` references reach user code (re-registering a name is an
error naming both functions)."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn` under `name`."""
    return REWARDS.register(name)


def list_rewards() -> list[str]:
    return REWARDS.names()


def get_reward(name: str) -> RewardFn:
    """The reward registered as `name`, the function a ``module:function`` reference names, or the function
    `fn` of the Python file of ``path/to/file.py:fn``."""
    module, sep, attr = str(name).rpartition(":")
    fn = load_file_ref(module, attr) if sep and module.endswith(".py") else REWARDS.get(name)
    if not callable(fn):
        raise VerlConfigError(f"reward.name={name!r} is not a function")
    return fn


_FILE_MODULES: dict[str, object] = {}


def load_file_ref(path: str, attr: str, key: str = "reward.name") -> object:
    """Attribute `attr` of the Python file `path` (`~` expanded, relative to the current directory), executed
    once per process as a module of its own. A file named in a config is explicit, so it needs no search-path
    entry; where it came from is logged once (rank 0)."""
    label = f"{key}={path}:{attr}"
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise VerlConfigError(f"{label}: the reward file {str(p)!r} does not exist (custom_reward_function.path); "
                              f"give the path of a Python file")
    if str(p) not in _FILE_MODULES:
        name = f"verl_user_reward_{hashlib.sha256(str(p).encode()).hexdigest()[:12]}"
        spec = importlib.util.spec_from_file_location(name, p)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file failed at import: named with its cause
            sys.modules.pop(name, None)
            raise VerlConfigError(f"{label}: importing {str(p)!r} raised {type(e).__name__}: {e}") from e
        _FILE_MODULES[str(p)] = module
        if os.environ.get("RANK", "0") == "0":
            print(f"verl: {label} loaded from {p}", flush=True)
    module = _FILE_MODULES[str(p)]
    if not hasattr(module, attr):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise VerlConfigError(f"{label}: {str(p)!r} has no function {attr!r} (custom_reward_function.name); its "
                              f"functions: {', '.join(names) or 'none'}")
    return getattr(module, attr)


def convention(fn) -> str:
    """How `fn` is called: "rule" fn(response, ground_truth, prompt), "verl" compute_score(data_source,
    solution_str, ground_truth, extra_info) per sample, or "verl_batched" (plural parameters, one call)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "rule"
    if "solution_strs" in params:
        return "verl_batched"
    return "verl" if "solution_str" in params or "data_source" in params else "rule"


def _head(text: str, width: int = 120) -> str:
    """A sample's text, cut to its first `width` characters (responses run to hundreds of tokens)."""
    text = str(text)
    return repr(text) if len(text) <= width else f"{text[:width]!r}... ({len(text)} chars)"


def score_batch(fn: RewardFn, responses: Sequence[str], ground_truths: Sequence[str], prompts: Sequence[str],
                name: str | None = None) -> torch.Tensor:
    """Scores each response; returns float32 [len(responses)]. Failures and NaNs raise `VerlRuntimeError`."""
    return score_samples(fn, responses, ground_truths, prompts, name=name)[0]


def score_samples(fn, responses: Sequence[str], ground_truths: Sequence, prompts: Sequence,
                  data_sources: Sequence[str] | None = None, extra_infos: Sequence | None = None,
                  name: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scores float32 [B], extra metrics {key: float32 [B]} from dict results) of `fn` in its own calling
    convention (`convention`). Failures, NaNs, non-numbers and dicts without 'score' raise `VerlRuntimeError`."""
    label = name or getattr(fn, "__name__", "reward")
    n = len(responses)
    sources = list(data_sources) if data_sources is not None else ["default"] * n
    extras = list(extra_infos) if extra_infos is not None else [None] * n
    kind = convention(fn)
    if kind == "verl_batched":
        try:
            results = list(fn(data_sources=sources, solution_strs=list(responses), ground_truths=list(ground_truths),
                              extra_infos=extras))
        except Exception as e:  # noqa: BLE001 - re-raised naming the reward
            raise VerlRuntimeError(f"reward {label!r} (batched) raised {type(e).__name__}: {e} on a batch of {n} "
                                   f"samples", node="reward", cause=e) from e
        if len(results) != n:
            raise VerlRuntimeError(f"reward {label!r} (batched) returned {len(results)} results for {n} samples",
                                   node="reward")
    else:
        results = [_call(fn, kind, label, i, responses[i], ground_truths[i], prompts[i], sources[i], extras[i])
                   for i in range(n)]
    return _collect(results, responses, ground_truths, label)


def _call(fn, kind: str, label: str, i: int, resp, gt, prompt, source, extra):
    try:
        if kind == "verl":
            return fn(data_source=source, solution_str=resp, ground_truth=gt, extra_info=extra)
        return fn(resp, gt, prompt)
    except Exception as e:  # noqa: BLE001 - re-raised with the sample that broke it
        raise VerlRuntimeError(f"reward {label!r} raised {type(e).__name__}: {e} on sample {i} "
                               f"(response {_head(resp)}, ground truth {_head(gt)})", node="reward",
                               cause=e) from e


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None
    return float(value)


def _collect(results: list, responses, ground_truths, label: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    scores: list[float] = []
    extra: dict[str, list[float]] = {}
    for i, value in enumerate(results):
        where = f"for sample {i} (response {_head(responses[i])}, ground truth {_head(ground_truths[i])})"
        if isinstance(value, dict):
            if "score" not in value:
                raise VerlRuntimeError(f"reward {label!r} returned a dict without 'score' {where}: {value!r:.200}; "
                                       f"a dict result holds the score under 'score'", node="reward")
            for k, v in value.items():
                if k != "score" and _number(v) is not None:
                    extra.setdefault(k, [math.nan] * len(results))[i] = float(v)
            value = value["score"]
        score = _number(value)
        if score is None:
            raise VerlRuntimeError(f"reward {label!r} returned {value!r} {where}; a reward must be a finite float "
                                   f"(or a dict with a finite 'score')", node="reward")
        scores.append(score)
    return (torch.tensor(scores, dtype=torch.float32),
            {k: torch.tensor(v, dtype=torch.float32) for k, v in extra.items()})
