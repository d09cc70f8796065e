"""Rewards for upstream verl's datasets, picked per row by its data source (verl's `default_compute_score`).

``by_data_source`` is the reward of a verl launch script without a custom reward function: each row's
``data_source`` column names the rule. Written here from the published scoring rules, not upstream's code:

- ``gsm8k_strict`` (openai/gsm8k): the number after the last ``#### `` in the response's last 300 characters
  (commas and ``$`` dropped), 1.0 when it equals the ground truth as a string, else 0.0.
- ``math`` (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500): the last ``\\boxed{...}``
  (or ``\\fbox{...}``), compared with the ground truth after the MATH benchmark's normalisation (Hendrycks et
  al. 2021: ``\\left``/``\\right``, degrees, ``$``, units in ``\\text{ }``, ``%``, spaces, ``\\frac12`` and ``a/b``
  to ``\\frac{a}{b}``, 0.5 to ``\\frac{1}{2}``, a short ``x =`` prefix dropped): 1.0 or 0.0.
- ``math_dapo`` (math_dapo, math, math_dapo_reasoning, aime*): the last ``Answer: ...`` line in the response's last
  300 characters, normalised as Minerva does (Lewkowycz et al. 2022: the part after ``=``, units and filler words
  removed, ``\\text{}``/``\\boxed{}`` unwrapped, thousands separators dropped): a dict {"score": 1.0 or -1.0,
  "acc": 1.0 or 0.0} (acc is logged as reward/acc/mean).
- the synthetic tasks by their names (arithmetic, counting, gsm_symbolic).

Edge cases of the normalisations may differ from upstream's implementation; a dataset whose rule must match it
to the letter should name its reward function (custom_reward_function.path).
"""

from __future__ import annotations

import re

from verl.errors import VerlRuntimeError
from verl.rewards.registry import get_reward, register_reward

__all__ = ["DATA_SOURCES", "check_sources", "reward_for_source"]

DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k_strict",
    "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math", "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math_dapo", "math": "math_dapo", "math_dapo_reasoning": "math_dapo",
    "arithmetic": "arithmetic", "counting": "counting", "gsm_symbolic": "gsm_symbolic",
}
"""Data source -> registered reward; sources starting with 'aime' take math_dapo."""


def reward_for_source(source: str) -> str | None:
    """The registered reward for rows of `source`, or None when there is none."""
    return DATA_SOURCES.get(source) or ("math_dapo" if source.startswith("aime") else None)


def check_sources(reward_cfg, datasets) -> None:
    """With a `by_data_source` rule source in `reward_cfg` (a RewardConfig), every data source of `datasets`
    (PromptDatasets, None skipped) has a rule: a VerlConfigError naming the others, before any step."""
    from verl.errors import VerlConfigError
    if not any(s.type == "rule" and s.name == "by_data_source" for s in reward_cfg.resolved_sources()):
        return
    sources = {s for d in datasets if d is not None for s in (d.sources or ["default"])}
    missing = sorted(s for s in sources if reward_for_source(s) is None)
    if missing:
        raise VerlConfigError(f"reward by_data_source has no rule for data_source {missing} (known: "
                              f"{', '.join(sorted(DATA_SOURCES))}, aime*); name your own compute_score with "
                              f"custom_reward_function.path / .name (reward.name=path/to/file.py:compute_score)")


@register_reward("by_data_source")
def by_data_source(data_source, solution_str, ground_truth, extra_info=None):
    """The built-in rule for the row's data source (DATA_SOURCES)."""
    name = reward_for_source(str(data_source))
    if name is None:
        raise VerlRuntimeError(f"no built-in reward for data_source {data_source!r} (known: "
                               f"{', '.join(sorted(DATA_SOURCES))}, aime*); name your own compute_score with "
                               f"custom_reward_function.path / .name (reward.name=file.py:fn)", node="reward")
    return get_reward(name)(solution_str, ground_truth, extra_info)


_GSM8K = re.compile(r"#### (-?[0-9.,]+)")


@register_reward("gsm8k_strict")
def gsm8k_strict(response: str, ground_truth: str, prompt=None) -> float:
    """openai/gsm8k as upstream verl scores it: the last '#### <number>' of the response's tail, exact match."""
    found = _GSM8K.findall(response[-300:])
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "").replace("$", "") == str(ground_truth) else 0.0


# ---------------------------------------------------------------------------------------------- MATH (boxed)

def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} / \\fbox{...} (braces matched), or of '\\boxed x' up to '$'."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):
        return text[start + len("\\boxed "):].split("$")[0].strip()
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1:i]
    return None


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}, \\frac{1}2 -> \\frac{1}{2}."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_slash(s: str) -> str:
    a, sep, b = s.partition("/")
    if sep and a.lstrip("-").isdigit() and b.isdigit() and "/" not in b:
        return f"\\frac{{{a}}}{{{b}}}"
    return s


def normalize_math(s: str) -> str:
    """The MATH benchmark's answer normalisation (see the module docstring)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs, sep, rhs = s.partition("=")
    if sep and "=" not in rhs and len(lhs) <= 2:
        s = rhs
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = _fix_fracs(s.replace(" ", ""))
    return "\\frac{1}{2}" if s == "0.5" else _fix_slash(s)


@register_reward("math")
def math_boxed(response: str, ground_truth: str, prompt=None) -> float:
    """MATH: the last \\boxed{} of the response equals the ground truth after normalize_math."""
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    return 1.0 if normalize_math(answer) == normalize_math(str(ground_truth)) else 0.0


# ---------------------------------------------------------------------------------------------- DAPO / Minerva

_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
            ",\\!", "{,}", '"', "\\dots"]
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(answer: str) -> str:
    """Minerva's final-answer normalisation (see the module docstring)."""
    s = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    for macro in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + macro + r"\{)(.*?)(\})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


@register_reward("math_dapo")
def math_dapo(response: str, ground_truth: str, prompt=None) -> dict:
    """DAPO-Math: the last 'Answer: ...' of the response's tail, Minerva-normalised; +1 right, -1 wrong."""
    found = _ANSWER.findall(response[-300:])
    pred = normalize_final_answer(found[-1]) if found else "[INVALID]"
    correct = pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": float(correct)}
