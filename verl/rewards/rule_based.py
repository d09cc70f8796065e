"""Rule-based rewards for verifiable answers.

``gsm8k`` (GSM8K convention): the answer is what follows the last ``####`` in the response; without one,
the last number in the response. Both sides are normalised (commas, ``$``, a trailing ``.`` and ``.0``
removed) and compared exactly: 1.0 on a match, else 0.0. The ground truth may itself be a full GSM8K
solution ending in ``#### 42``.

``arithmetic`` / ``counting``: exact match of the first number in the response (the tasks of
`verl.data.tasks` answer with a single number).
"""

from __future__ import annotations

import re

from verl.rewards.registry import register_reward

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _normalise(number: str) -> str:
    s = number.replace(",", "").replace("$", "").strip().rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style text: after the last '####', else its last number; None if absent."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUMBER.search(tail.replace("$", ""))
        return _normalise(m.group(0)) if m else None
    numbers = _NUMBER.findall(text.replace("$", ""))
    return _normalise(numbers[-1]) if numbers else None


@register_reward("gsm8k")
def gsm8k_reward(response: str, ground_truth: str, prompt: str = "") -> float:
    pred = extract_gsm8k_answer(response)
    truth = extract_gsm8k_answer(ground_truth)
    return 1.0 if pred is not None and pred == truth else 0.0


def _first_number_match(response: str, ground_truth: str) -> float:
    m = _NUMBER.search(response)
    return 1.0 if m is not None and _normalise(m.group(0)) == _normalise(ground_truth) else 0.0


@register_reward("arithmetic")
def arithmetic_reward(response: str, ground_truth: str, prompt: str = "") -> float:
    return _first_number_match(response, ground_truth)


@register_reward("counting")
def counting_reward(response: str, ground_truth: str, prompt: str = "") -> float:
    return _first_number_match(response, ground_truth)
