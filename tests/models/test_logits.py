"""Megatron logits equal transformers' on the same random checkpoint (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.models import _workers
from tests.models._tiny import hf_model, save_tiny_checkpoint
from verl.testing import run_distributed

TOL = 1e-4


def _batch(vocab, b=2, s=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :3] = 0          # left padding on row 0
    mask[1, -2:] = 0         # right padding on row 1
    return ids, mask


def _hf_logits(path, ids, mask):
    model = hf_model(path)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def _max_diff(a, b, mask):
    return float(((a - b).abs() * mask[..., None]).max())


@pytest.mark.multiprocess
def test_logits_tp1_pp1(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt", "llama")
    ids, mask = _batch(101)
    out = run_distributed(_workers.logits_body, 1, args=(path, 1, 1, False, ids, mask), timeout=180)
    diff = _max_diff(out[0]["logits"], _hf_logits(path, ids, mask), mask)
    print(f"tp=1 pp=1 sp=False max|dlogit|={diff:.2e}")
    assert diff <= TOL
