"""A user's own row batch, as the dataflow's tests pass between nodes: the dataflow shards any dataclass of
per-row fields that slices with `[lo:hi]` and joins with `concat` (the PPO flow's `RolloutBatch` is one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rows:
    ids: torch.Tensor
    """[n, ...] a tensor per row."""
    text: list[str]
    """a string per row."""

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, idx) -> "Rows":
        return Rows(ids=self.ids[idx], text=self.text[idx])

    @classmethod
    def concat(cls, pieces: list["Rows"]) -> "Rows":
        return cls(ids=torch.cat([p.ids for p in pieces]), text=[t for p in pieces for t in p.text])
