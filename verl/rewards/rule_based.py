"""Rule-based rewards for verifiable answers.

``gsm8k`` (GSM8K convention): the answer is what follows the last ``####`` in the response; without one,
the last number in the response. Both sides are normalised (commas, ``$``, a trailing ``.`` and ``.0``
removed) and compared exactly: 1.0 on a match, else 0.0. The ground truth may itself be a full GSM8K
solution ending in ``#### 42``.

``arithmetic`` / ``counting``: exact match of the first number in the response (the tasks of
`verl.data.tasks` answer with a single number).

``gsm_symbolic`` (the task of the same name): reasoning-gym's own scorer on the response's final answer,
extracted as for ``gsm8k``. ``gsm8k_format``: 1.0 for a response whose last line is ``#### NUMBER``, the
optional format term beside it.
"""

from __future__ import annotations

import re

from verl.errors import VerlConfigError
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



_GSM_SCORER = None
_FINAL_LINE = re.compile(r"####\s*\$?-?\d[\d,]*(?:\.\d+)?\.?")


@register_reward("gsm_symbolic")
def gsm_symbolic_reward(response: str, ground_truth: str, prompt="") -> float:
    """reasoning-gym's gsm_symbolic scorer on the response's final answer (`extract_gsm8k_answer`: after the last
    '####', else the last number): 1.0 when it equals the ground truth as a number, 0.01 for another number,
    0.0 for none (the scorer's own values)."""
    global _GSM_SCORER
    if _GSM_SCORER is None:
        try:
            import reasoning_gym
        except ImportError:
            raise VerlConfigError("reward gsm_symbolic scores with the reasoning-gym wheel, which is not installed: "
                                  "pip install reasoning-gym") from None
        _GSM_SCORER = reasoning_gym.create_dataset("gsm_symbolic", size=1, seed=0)  # only its score_answer is used
    return float(_GSM_SCORER.score_answer(extract_gsm8k_answer(response), {"answer": ground_truth}))


@register_reward("gsm8k_format")
def gsm8k_format_reward(response: str, ground_truth: str = "", prompt="") -> float:
    """1.0 when the response's last line is '#### NUMBER' and no other line has '####' (what the gsm_symbolic
    task's system prompt asks for), else 0.0. Add it to the answer reward with a small weight in reward.sources."""
    lines = response.strip().splitlines()
    return 1.0 if lines and _FINAL_LINE.fullmatch(lines[-1].strip()) and response.count("####") == 1 else 0.0
