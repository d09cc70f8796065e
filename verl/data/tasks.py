"""Synthetic verifiable tasks: prompts with an exactly checkable answer, generated locally (no download).

- ``arithmetic``: ``"13+9="`` → ``"22"`` (sums and differences of two numbers below ``max_operand``).
- ``counting``: ``"count b in abbab:"`` → ``"3"``.
- ``gsm_symbolic``: GSM8K-style word problems from the ``reasoning-gym`` wheel (its ``gsm_symbolic``
  generator: GSM8K questions with their numbers and names re-drawn), as chat messages (a system
  instruction asking for GSM8K's ``#### <number>`` final line, then the question) that the model's chat
  template renders; the answer is the number. Scored by the ``gsm_symbolic`` reward (reasoning-gym's
  scorer), optionally plus the ``gsm8k_format`` reward.

The ground truth goes in the ``answer`` column, checked by the rule-based rewards of `verl.rewards`.
"""

from __future__ import annotations

import random

from verl.errors import VerlConfigError

TASKS = ("arithmetic", "counting", "gsm_symbolic")

GSM_SYSTEM_PROMPT = "Solve the math problem step by step, then write the final number after '####', e.g. '#### 42'."
"""The system message of the gsm_symbolic task's prompts."""


def arithmetic_example(rng: random.Random, max_operand: int = 20) -> dict[str, str]:
    a, b = rng.randrange(max_operand), rng.randrange(max_operand)
    if rng.random() < 0.5:
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}
    a, b = max(a, b), min(a, b)  # keeps answers non-negative, so the answer format is digits only
    return {"prompt": f"{a}-{b}=", "answer": str(a - b)}


def counting_example(rng: random.Random, max_operand: int = 20) -> dict[str, str]:
    letters = "abcd"
    target = rng.choice(letters)
    text = "".join(rng.choice(letters) for _ in range(rng.randrange(3, 10)))
    return {"prompt": f"count {target} in {text}:", "answer": str(text.count(target))}


def gsm_symbolic_examples(num_examples: int, seed: int) -> list[dict]:
    """`num_examples` reasoning-gym gsm_symbolic problems as chat prompts; prompt i depends on (seed, i) only."""
    try:
        import reasoning_gym
    except ImportError:
        raise VerlConfigError("data.task=gsm_symbolic generates its problems with the reasoning-gym wheel, which "
                              "is not installed: pip install reasoning-gym") from None
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=num_examples, seed=seed)
    return [{"prompt": [{"role": "system", "content": GSM_SYSTEM_PROMPT},
                        {"role": "user", "content": ex["question"]}],
             "answer": str(ex["answer"])} for ex in ds]


def make_task(name: str, num_examples: int, seed: int = 0, max_operand: int = 20) -> list[dict]:
    """`num_examples` records {"prompt", "answer"} of the task `name`, reproducible from `seed` (prompts are
    text, or chat messages for gsm_symbolic)."""
    if name == "gsm_symbolic":
        return gsm_symbolic_examples(num_examples, seed)
    makers = {"arithmetic": arithmetic_example, "counting": counting_example}
    if name not in makers:
        raise VerlConfigError(f"unknown task {name!r} (data.task); choose one of {', '.join(TASKS)}")
    rng = random.Random(seed)
    return [makers[name](rng, max_operand) for _ in range(num_examples)]


def prompt_text(prompt) -> str:
    """A prompt's text: itself, or its chat messages' contents joined by newlines."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def task_corpus(name: str) -> list[str]:
    """Texts covering every symbol of the task (prompt + answer), for training a tokenizer."""
    count = 300 if name == "gsm_symbolic" else 3000  # long word problems: a few hundred cover the characters
    return [prompt_text(r["prompt"]) + r["answer"] for r in make_task(name, count, seed=12345, max_operand=100)]
