"""The critic worker, on any training engine: values of the response positions and the clipped value-loss
update (`verl.algos.critic_loss`). `ValueModel` is the plain-torch critic: a value head on a copy of the
policy's transformer trunk."""

from __future__ import annotations

import copy
from collections import defaultdict

import torch

from verl.algos import critic_loss
from verl.config.ppo import CriticConfig
from verl.workers.actor import reduce_micro_stats
from verl.workers.batch import RolloutBatch

__all__ = ["CriticWorker", "ValueModel"]


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


class CriticWorker:
    def __init__(self, engine, cfg: CriticConfig):
        self.engine, self.cfg = engine, cfg

    def onload(self, device: torch.device) -> None:
        """cpu_offload: the dataflow runtime calls this before the role's node, `offload` after it."""
        self.engine.onload(device)

    def offload(self) -> None:
        self.engine.offload()

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """V(state before response token t), [B, R] (0 on padding)."""
        return self.engine.forward(batch, self.cfg.micro_batch_size)["values"]

    def update(self, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """Epochs of one optimizer step over the whole batch (micro-batches accumulate gradients)."""
        agg = self.engine.aggregation("token-mean", batch.response_mask, batch.response_mask.shape[1])

        def loss_fn(out, f):
            return critic_loss(out["values"], f["response_mask"], f["old_values"], f["returns"],
                               cliprange=self.cfg.cliprange_value, agg=agg)
        stats: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.cfg.ppo_epochs):
            per_micro, grad_norm = self.engine.train_step(batch, self.cfg.micro_batch_size, loss_fn,
                                                          {"old_values": old_values, "returns": returns})
            for k, v in reduce_micro_stats(per_micro).items():
                stats[k].append(v)
            stats["critic/grad_norm"].append(grad_norm)
        return {k: sum(v) / len(v) for k, v in stats.items()}
