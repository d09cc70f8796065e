"""Writing Hugging Face model directories."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch


def export_hf(module: torch.nn.Module, tokenizer, path: Path) -> Path:
    """Writes a Hugging Face directory atomically (temp dir, then rename over the old one)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    module.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.rename(tmp, path)
    return path
