"""The kill-during-save test's victim: resumes from the newest valid checkpoint under argv[1] (resume=auto), then
saves step after step (weights filled with the step number) and prints `saved N` after each save returns."""

from __future__ import annotations

import sys

import torch

from verl.distributed import Placement
from verl.utils.checkpoint import CheckpointManager


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 64)).sum().backward()
    opt.step()  # the optimizer has state to save
    return model, opt


def main(root: str) -> None:
    torch.set_num_threads(1)
    model, opt = build()
    mgr = CheckpointManager(root, Placement(), keep=2)
    path = mgr.resolve("auto")
    step = mgr.load(path, {"m": (model, opt)})["step"] if path is not None else 0
    print(f"ready {step}", flush=True)
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        mgr.save(step, {"m": (model, opt)}, {}, {"step": step})
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
