"""The job's training and held-out prompts: files (data.train_files / data.val_files) or the synthetic task, whose
held-out split (val.num_examples) is drawn apart from the training prompts.

    train, val = load_splits(cfg.data, cfg.val, seed=cfg.trainer.seed)     # val is None without a held-out set
"""

from __future__ import annotations

from verl.config.ppo import DataConfig, ValConfig
from verl.data.dataset import PromptDataset, load_prompt_dataset
from verl.data.tasks import make_task
from verl.errors import VerlConfigError

__all__ = ["load_splits"]

HELD_OUT_SEED = 7_919_000
"""Offset of the synthetic held-out split's seed from trainer.seed (its draws never coincide with training's)."""


def load_splits(d: DataConfig, v: ValConfig, seed: int) -> tuple[PromptDataset, PromptDataset | None]:
    """(training prompts, held-out prompts or None), each cut to data.train_max_samples / val_max_samples."""
    if d.train_files:
        train = load_prompt_dataset(d.train_files, d.prompt_key, d.answer_key, d.data_source_key)
    else:
        train = _task(d, d.num_examples, seed)
    val = None
    if d.val_files:
        val = load_prompt_dataset(d.val_files, d.prompt_key, d.answer_key, d.data_source_key, key="data.val_files")
    elif v.num_examples and not d.train_files:
        val, train = _held_out(d, v.num_examples, seed, train)
    elif v.num_examples:
        raise VerlConfigError(f"val.num_examples={v.num_examples} splits the synthetic task, but data.train_files "
                              f"is set; give the held-out files as data.val_files instead")
    return _head(train, d.train_max_samples), None if val is None else _head(val, d.val_max_samples)


def _task(d: DataConfig, count: int, seed: int) -> PromptDataset:
    return PromptDataset.from_records(make_task(d.task, count, seed=seed, max_operand=d.max_operand),
                                      source=f"task {d.task}", default_source=d.task)


def _held_out(d: DataConfig, count: int, seed: int, train: PromptDataset) -> tuple[PromptDataset, PromptDataset]:
    """`count` distinct prompts of the task (its own seed), and the training prompts without any of them."""
    pool = _task(d, max(4 * count, 256), seed + HELD_OUT_SEED)
    seen: dict[str, int] = {}
    for i, p in enumerate(pool.prompts):
        seen.setdefault(repr(p), i)
        if len(seen) == count:
            break
    if len(seen) < count:
        raise VerlConfigError(f"val.num_examples={count}: the task {d.task!r} (data.max_operand={d.max_operand}) "
                              f"drew only {len(seen)} distinct prompts; ask for fewer or widen the task")
    val = pool.take(list(seen.values()))
    keep = [i for i, p in enumerate(train.prompts) if repr(p) not in seen]
    if not keep:
        raise VerlConfigError(f"val.num_examples={count} held out every training prompt of task {d.task!r}; ask "
                              f"for fewer")
    return val, train.take(keep)


def _head(ds: PromptDataset, limit: int) -> PromptDataset:
    return ds if limit < 0 or limit >= len(ds) else ds.take(range(limit))
