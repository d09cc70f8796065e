"""A few rows in upstream verl's parquet layout, as its examples/data_preprocess scripts write them (gsm8k.py:
data_source, chat-message prompt, ability, reward_model {style, ground_truth}, extra_info {split, index, answer,
question}; math_dataset.py and DAPO-Math's: the same layout with their data sources), placed where verl's launch
scripts read them ($HOME/data/..., $HOME/verl/data/...). Nothing is downloaded: the questions are generated here."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DAPO_INSTRUCTION = ('Solve the following math problem step by step. The last line of your response should be of the '
                    'form Answer: $Answer (without quotes) where $Answer is the answer to the problem.')


def gsm8k_rows(split: str, n: int, seed: int) -> list[dict]:
    """Rows with the schema of verl's examples/data_preprocess/gsm8k.py."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        a, b = rng.randrange(2, 30), rng.randrange(2, 30)
        question = f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": split, "index": i, "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
                                    "question": question}})
    return rows


def math_rows(split: str, n: int, seed: int) -> list[dict]:
    """The same layout with MATH's data source and a boxed answer (verl's math_dataset.py)."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        a, b = rng.randrange(1, 9), rng.randrange(2, 9)
        rows.append({"data_source": "DigitalLearningGmbH/MATH-lighteval",
                     "prompt": [{"role": "user", "content": f"What is {a} divided by {b}? {MATH_INSTRUCTION}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": f"\\frac{{{a}}}{{{b}}}"},
                     "extra_info": {"split": split, "index": i}})
    return rows


def dapo_rows(source: str, n: int, seed: int) -> list[dict]:
    """DAPO-Math-17k / AIME rows: the same layout, an 'Answer:' line expected."""
    rng, rows = random.Random(seed), []
    for i in range(n):
        a, b = rng.randrange(2, 20), rng.randrange(2, 20)
        rows.append({"data_source": source,
                     "prompt": [{"role": "user", "content": f"{DAPO_INSTRUCTION}\n\nCompute {a} times {b}."}],
                     "ability": "MATH", "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": str(a * b)},
                     "extra_info": {"index": str(i)}})
    return rows


def write(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def make_home(home: Path, n_train: int = 32, n_test: int = 8) -> Path:
    """The data files verl's example scripts read, under `home` (their $HOME)."""
    write(gsm8k_rows("train", n_train, 0), home / "data/gsm8k/train.parquet")
    write(gsm8k_rows("test", n_test, 1), home / "data/gsm8k/test.parquet")
    write(math_rows("train", n_train, 2), home / "data/math/train.parquet")
    write(math_rows("test", n_test, 3), home / "data/math/test.parquet")
    write(dapo_rows("math_dapo", n_train, 4), home / "verl/data/dapo-math-17k.parquet")
    write(dapo_rows("aime_2024", n_test, 5), home / "verl/data/aime-2024.parquet")
    return home
