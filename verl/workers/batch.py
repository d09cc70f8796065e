"""The rollout batch the workers exchange: token tensors plus the texts they came from.

Layout: `input_ids` [B, P + R] holds left-padded prompts (P columns) followed by right-padded responses
(R columns). Response position t is predicted by the logits at column P - 1 + t.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(slots=True)
class RolloutBatch:
    """B responses (n per prompt, grouped by `group`) and their prompts."""

    input_ids: torch.Tensor
    """[B, P + R] prompt and response token ids."""
    attention_mask: torch.Tensor
    """[B, P + R] 1 on real tokens (prompt padding and tokens after EOS are 0)."""
    position_ids: torch.Tensor
    """[B, P + R] positions counting real tokens only (left padding does not shift them)."""
    response_mask: torch.Tensor
    """[B, R] float, 1 on response tokens up to and including EOS."""
    group: torch.Tensor
    """[B] long, index of the prompt each response answers (GRPO groups)."""
    prompts: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    response_texts: list[str] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: slice | torch.Tensor) -> "RolloutBatch":
        """Rows `idx` (a slice or index tensor) of the batch."""
        if isinstance(idx, slice):
            rows = range(len(self))[idx]
        else:
            rows = idx.tolist()
        pick = (lambda xs: [xs[i] for i in rows]) if not isinstance(idx, slice) else (lambda xs: xs[idx])
        return replace(self, input_ids=self.input_ids[idx], attention_mask=self.attention_mask[idx],
                       position_ids=self.position_ids[idx], response_mask=self.response_mask[idx],
                       group=self.group[idx], prompts=pick(self.prompts), answers=pick(self.answers),
                       response_texts=pick(self.response_texts))

    def to(self, device: torch.device) -> "RolloutBatch":
        return replace(self, input_ids=self.input_ids.to(device), attention_mask=self.attention_mask.to(device),
                       position_ids=self.position_ids.to(device), response_mask=self.response_mask.to(device),
                       group=self.group.to(device))

    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def micro_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
