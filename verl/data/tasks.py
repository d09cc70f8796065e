"""Synthetic verifiable tasks: prompts with an exactly checkable answer, generated locally (no download).

- ``arithmetic``: ``"13+9="`` → ``"22"`` (sums and differences of two numbers below ``max_operand``).
- ``counting``: ``"count b in abbab:"`` → ``"3"``.

The ground truth goes in the ``answer`` column, checked by the rule-based rewards of `verl.rewards`.
"""

from __future__ import annotations

import random

TASKS = ("arithmetic", "counting")


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


def make_task(name: str, num_examples: int, seed: int = 0, max_operand: int = 20) -> list[dict[str, str]]:
    """`num_examples` records {"prompt", "answer"} of the task `name`, reproducible from `seed`."""
    makers = {"arithmetic": arithmetic_example, "counting": counting_example}
    if name not in makers:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    rng = random.Random(seed)
    return [makers[name](rng, max_operand) for _ in range(num_examples)]


def task_corpus(name: str) -> list[str]:
    """Texts covering every symbol of the task (prompt + answer), for training a tokenizer."""
    return [r["prompt"] + r["answer"] for r in make_task(name, 3000, seed=12345, max_operand=100)]
