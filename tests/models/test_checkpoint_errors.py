"""Loader errors that need no processes: what is wrong with the directory, and how to fix it."""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import save_file

from verl.errors import VerlConfigError
from verl.models import load_hf_checkpoint
from verl.models.checkpoint import _LazyReader, _tensor_files


def test_directory_without_safetensors_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(VerlConfigError, match="safe_serialization"):
        load_hf_checkpoint(types.SimpleNamespace(), tmp_path)


def test_reader_reads_only_the_requested_slice(tmp_path):
    save_file({"w": torch.arange(24.0).view(4, 6)}, str(tmp_path / "model.safetensors"))
    reader = _LazyReader(_tensor_files(tmp_path))
    try:
        rows = reader.slice("w", 0, 1, 2)
        cols = reader.slice("w", 1, 4, 2)
    finally:
        reader.close()
    assert torch.equal(rows, torch.arange(24.0).view(4, 6)[1:3])
    assert torch.equal(cols, torch.arange(24.0).view(4, 6)[:, 4:6])
    assert reader.bytes_read == (12 + 8) * 4
