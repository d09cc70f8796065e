"""Critic worker: a value head on a copy of the policy's transformer trunk; values and the clipped value loss."""

from __future__ import annotations

import copy
from collections import defaultdict

import torch

from verl.config.ppo import CriticConfig
from verl.trainer import algorithms as algo
from verl.workers.actor import step_aggregation
from verl.workers.batch import RolloutBatch, micro_slices
from verl.workers.engine import TorchEngine


class ValueModel(torch.nn.Module):
    """Transformer trunk + linear value head; `forward` returns one value per position [B, T]."""

    def __init__(self, trunk: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.trunk = trunk
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)  # start at V = 0: no spurious advantages at step 1
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_causal_lm(cls, lm: torch.nn.Module) -> "ValueModel":
        return cls(copy.deepcopy(lm.base_model), lm.config.hidden_size)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def response_values(model: ValueModel, batch: RolloutBatch) -> torch.Tensor:
    """V(state before response token t), [B, R]."""
    values = model(batch.input_ids, batch.attention_mask, batch.position_ids)
    P = batch.prompt_length
    return values[:, P - 1:-1] * batch.response_mask


class CriticWorker:
    def __init__(self, engine: TorchEngine, cfg: CriticConfig):
        self.engine, self.cfg = engine, cfg

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        return torch.cat([response_values(self.engine.module, batch.select(sl))
                          for sl in micro_slices(len(batch), self.cfg.micro_batch_size)])

    def update(self, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """Epochs of one optimizer step over the whole batch (micro-batches accumulate gradients)."""
        stats: dict[str, list[float]] = defaultdict(list)
        agg = step_aggregation("token-mean", batch.response_mask, self.engine, batch.response_mask.shape[1])
        for _ in range(self.cfg.ppo_epochs):
            vf_loss = 0.0
            for sl in micro_slices(len(batch), self.cfg.micro_batch_size):
                mb = batch.select(sl)
                values = response_values(self.engine.module, mb)
                loss, clipfrac = algo.value_loss(values, old_values[sl], returns[sl], mb.response_mask,
                                                 cliprange=self.cfg.cliprange_value, agg=agg)
                loss.backward()
                vf_loss += float(loss.detach())
                stats["critic/vf_clipfrac"].append(float(clipfrac))
            stats["critic/vf_loss"].append(vf_loss)
            stats["critic/grad_norm"].append(self.engine.step())
        return {k: sum(v) / len(v) for k, v in stats.items()}
