"""Prompt datasets from parquet or JSONL files with a ground-truth column, and a resumable batch order.

    ds = load_prompt_dataset(["train.parquet"], prompt_key="question", answer_key="answer")
    sampler = BatchSampler(len(ds), batch_size=16, seed=1)
    rows = [ds[i] for i in sampler.next_batch()]      # {"prompt": ..., "answer": ...}
    state = sampler.state_dict()                       # saved in checkpoints (data position)

A prompt is text, or chat messages ([{"role": ..., "content": ...}], e.g. a parquet column of structs) that the
model's chat template renders when the rollout encodes it (`verl.rollout.Tokenizer.encode_prompt`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from verl.errors import VerlConfigError, library_errors


@dataclass(frozen=True, slots=True)
class PromptDataset:
    """Prompts and their ground truths, indexable; rows are {"prompt": str | list[dict], "answer": str,
    "data_source": str, "extra_info": dict | None}."""

    prompts: list
    answers: list[str]
    sources: list[str] | None = None
    """Each row's data source (None: every row is "default")."""
    extras: list | None = None
    """Each row's `extra_info` (verl's layout: split, index, ...), passed to verl-style reward functions."""

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict:
        return {"prompt": self.prompts[i], "answer": self.answers[i],
                "data_source": self.sources[i] if self.sources is not None else "default",
                "extra_info": self.extras[i] if self.extras is not None else None}

    def take(self, idx: Sequence[int]) -> "PromptDataset":
        """The rows `idx`, in that order."""
        pick = (lambda xs: None if xs is None else [xs[i] for i in idx])
        return PromptDataset(pick(self.prompts), pick(self.answers), pick(self.sources), pick(self.extras))

    @classmethod
    def from_records(cls, records: Sequence[dict], prompt_key: str = "prompt", answer_key: str = "answer",
                     source: str = "records", source_key: str = "data_source",
                     default_source: str = "default") -> "PromptDataset":
        """Rows of `records` (dicts, e.g. parquet rows). `answer_key` may be a dotted path into a struct column;
        a file without it but with upstream verl's `reward_model.ground_truth` uses that."""
        if not records:
            raise VerlConfigError(f"dataset {source} is empty")
        bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
        if bad is not None:
            raise VerlConfigError(f"dataset {source} row {bad} is a {type(records[bad]).__name__} "
                                  f"({records[bad]!r:.60}), not a record of columns; every row maps column names "
                                  f"to values")
        answer_key = _answer_key(records[0], answer_key)
        for key, what in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if _lookup(records[0], key) is _MISSING:
                raise VerlConfigError(f"dataset {source} has no column {key!r} (set by {what}); its columns are "
                                      f"{sorted(records[0])}: set {what} to one of them")
        prompts, answers, sources, extras = [], [], [], []
        for i, r in enumerate(records):
            p, a = r.get(prompt_key), _lookup(r, answer_key)
            if not (isinstance(p, str) and p) and not _is_chat(p):
                raise VerlConfigError(f"dataset {source} row {i}: column {prompt_key!r} must be a non-empty string "
                                      f"or a list of chat messages {{'role': str, 'content': str}}, got {p!r:.120}")
            if a is None or a is _MISSING:
                raise VerlConfigError(f"dataset {source} row {i}: ground truth {answer_key!r} is missing (every row "
                                      f"needs one; fix the row or drop it)")
            _no_media(r, i, source)
            prompts.append(p)
            answers.append(a if isinstance(a, (str, list, dict)) else str(a))  # structures reach verl-style rewards
            sources.append(str(r.get(source_key) or default_source))
            extras.append(r.get("extra_info"))
        return cls(prompts, answers, sources, extras)


_MISSING = object()


def _lookup(row: dict, key: str):
    """row[key], where a dotted key walks into struct columns; _MISSING when absent."""
    if key in row:
        return row[key]
    node = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _answer_key(first: dict, answer_key: str) -> str:
    """`answer_key`, or upstream verl's reward_model.ground_truth when the default 'answer' column is absent."""
    if answer_key == "answer" and "answer" not in first and \
            _lookup(first, "reward_model.ground_truth") is not _MISSING:
        return "reward_model.ground_truth"
    return answer_key


def _no_media(row: dict, i: int, source: str) -> None:
    for key in ("images", "videos"):
        if row.get(key) is not None and len(row[key]):
            raise VerlConfigError(f"dataset {source} row {i} has {key} (a multi-modal row); verl here trains "
                                  f"text-only policies: drop the {key!r} column")


def _is_chat(prompt) -> bool:
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt))


def fit_prompt_lengths(dataset: PromptDataset, encode: Callable[[object], list[int]], max_length: int,
                       overlong: str = "error", source: str = "the dataset") -> PromptDataset:
    """Checks every prompt's token count (`encode`: the rollout's own prompt encoding, chat template included)
    against `max_length` (data.max_prompt_length). overlong="error" raises naming the first row too long;
    "filter" drops such rows, says how many on stderr, and fails only when none is left."""
    lengths = [len(encode(p)) for p in dataset.prompts]
    keep = [i for i, n in enumerate(lengths) if n <= max_length]
    if len(keep) == len(lengths):
        return dataset
    first = next(i for i, n in enumerate(lengths) if n > max_length)
    head = _prompt_head(dataset.prompts[first])
    if overlong == "error":
        raise VerlConfigError(f"{source} row {first} ({head!r}) is {lengths[first]} tokens after the tokenizer's "
                              f"chat template / special tokens, longer than data.max_prompt_length={max_length} "
                              f"({len(lengths) - len(keep)} rows are); raise data.max_prompt_length, shorten the "
                              f"prompts, or set data.overlong_prompts=filter to drop them")
    if not keep:
        raise VerlConfigError(f"every prompt of {source} is longer than data.max_prompt_length={max_length} (the "
                              f"shortest is {min(lengths)} tokens); raise data.max_prompt_length")
    import sys
    print(f"[verl] data.overlong_prompts=filter: dropped {len(lengths) - len(keep)} of {len(lengths)} prompts "
          f"longer than data.max_prompt_length={max_length} tokens (first: row {first}, {lengths[first]} "
          f"tokens)", file=sys.stderr, flush=True)
    return dataset.take(keep)


def _prompt_head(prompt, width: int = 60) -> str:
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]  # a chat's last message: the question
    return text[:width] + ("..." if len(text) > width else "")


def _read_file(path: Path, key: str = "data.train_files") -> list[dict]:
    if not path.is_file():
        raise VerlConfigError(f"dataset file {str(path)!r} does not exist ({key})")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        with library_errors(f"dataset file {str(path)!r} (data.train_files) cannot be read as parquet"):
            return pq.read_table(path).to_pylist()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise VerlConfigError(f"dataset file {str(path)!r}: unsupported format {suffix!r}; use .parquet or .jsonl")


def load_prompt_dataset(files: Sequence[str], prompt_key: str = "prompt", answer_key: str = "answer",
                        source_key: str = "data_source", key: str = "data.train_files") -> PromptDataset:
    """Reads and concatenates parquet / JSONL files (`~` expanded); a missing column or file is a
    `VerlConfigError`. Rows without a `source_key` column take the file's stem as their data source."""
    if not files:
        raise VerlConfigError(f"no dataset files given ({key})")
    parts = []
    for f in files:
        path = Path(f).expanduser()
        parts.append(PromptDataset.from_records(_read_file(path, key), prompt_key, answer_key, source=repr(str(f)),
                                                source_key=source_key, default_source=path.stem))
    return PromptDataset([p for d in parts for p in d.prompts], [a for d in parts for a in d.answers],
                         [s for d in parts for s in d.sources], [e for d in parts for e in d.extras])


def write_jsonl(records: Sequence[dict], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


class BatchSampler:
    """Endless epoch-shuffled order of dataset indices whose position is part of a checkpoint.

    The permutation of epoch e depends only on (seed, e), so restoring (epoch, cursor) reproduces the order
    of an uninterrupted run exactly.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > num_examples:
            raise VerlConfigError(f"batch of {batch_size} prompts is larger than the dataset ({num_examples} rows); "
                                  f"lower data.train_batch_size or add data")
        self.num_examples, self.batch_size, self.seed, self.shuffle = num_examples, batch_size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._cached: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
                order = torch.randperm(self.num_examples, generator=g).tolist()
            else:
                order = list(range(self.num_examples))
            self._cached = (epoch, order)
        return self._cached[1]

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices; an epoch's tail shorter than a batch is dropped."""
        if self.cursor + self.batch_size > self.num_examples:
            self.epoch, self.cursor = self.epoch + 1, 0
        out = self._order(self.epoch)[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def state_spec(self):
        """What a restored `state_dict` must hold: an epoch count and a position within this dataset."""
        from verl.utils.state_check import MAX_STEP, Dict, Int
        return Dict({"epoch": Int(0, MAX_STEP), "cursor": Int(0, self.num_examples)})

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def _read_jsonl(path: Path) -> list[dict]:
    """One JSON object per line (blank lines skipped); anything else is a VerlConfigError naming the line."""
    rows = []
    with library_errors(f"dataset file {str(path)!r} (data.train_files) is not UTF-8 text", "save it as UTF-8"):
        text = path.read_text(encoding="utf-8")
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise VerlConfigError(f"dataset file {str(path)!r} line {lineno} is not JSON: {e}") from e
        if not isinstance(row, dict):
            raise VerlConfigError(f"dataset file {str(path)!r} line {lineno} is a JSON {type(row).__name__} "
                                  f"({line.strip()[:60]!r}), not an object; write one object per line, e.g. "
                                  f'{{"prompt": "...", "answer": "..."}}')
        rows.append(row)
    return rows
