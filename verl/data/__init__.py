"""Prompt datasets (parquet / JSONL, upstream verl's layout included), synthetic verifiable tasks with a held-out
split, and the resumable batch order."""

from verl.data.dataset import BatchSampler, PromptDataset, fit_prompt_lengths, load_prompt_dataset, write_jsonl
from verl.data.splits import load_splits
from verl.data.tasks import TASKS, make_task, prompt_text, task_corpus

__all__ = ["BatchSampler", "PromptDataset", "fit_prompt_lengths", "load_prompt_dataset", "load_splits",
           "write_jsonl", "TASKS", "make_task", "prompt_text", "task_corpus"]
