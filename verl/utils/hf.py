"""Writing Hugging Face model directories."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def export_hf(module: torch.nn.Module, tokenizer, path: Path) -> Path:
    """Writes the model (and tokenizer) as a new Hugging Face directory `path`. An existing non-empty `path` is
    refused, never replaced: callers write to a temporary folder and rename it into place themselves (the trainer
    through `verl.utils.run_folder.RunFolder.publish`, which replaces only what the run wrote)."""
    path = Path(path)
    if os.path.lexists(path) and (not path.is_dir() or path.is_symlink() or any(path.iterdir())):
        raise FileExistsError(f"export_hf writes a new folder, and {path} already exists; pick a new path")
    module.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
