"""The one LR schedule (`verl.utils.lr_schedule.LRSchedule`): warm-up then each decay style, as written in
`OptimConfig.lr_factor`, on a torch optimizer; its state round-trips; bad states are refused."""

from __future__ import annotations

import math

import pytest
import torch

from verl.config.ppo import OptimConfig
from verl.utils.lr_schedule import LRSchedule


def _lrs(cfg: OptimConfig, total: int) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=123.0)
    sched = LRSchedule(opt, cfg, total)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(total):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_warmup_then_cosine_reaches_min_lr():
    lrs = _lrs(OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, lr_decay_style="cosine"), 6)
    assert lrs[:2] == [0.5, 1.0]  # (step + 1) / warmup
    assert lrs[2] == 1.0 and math.isclose(lrs[4], 0.1 + 0.9 * 0.5) and math.isclose(lrs[6], 0.1)


def test_linear_and_constant():
    assert _lrs(OptimConfig(lr=2.0, min_lr=0.0, lr_decay_style="linear"), 4) == [2.0, 1.5, 1.0, 0.5, 0.0, ]
    assert set(_lrs(OptimConfig(lr=3e-4), 3)) == {3e-4}


def test_state_round_trips_and_bad_state_is_refused():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    a = LRSchedule(opt, cfg, 10)
    for _ in range(3):
        a.step()
    b = LRSchedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), cfg, 10)
    b.load_state_dict(a.state_dict())
    assert b.get_last_lr() == a.get_last_lr() == [0.7]
    for bad in ({"last_step": -1}, {"last_epoch": 3}, {"last_step": 2.5}, None):
        with pytest.raises(ValueError, match="last_step"):
            b.load_state_dict(bad)
