"""The critic worker, on any training engine: values of the response positions and the clipped value-loss
update (`verl.algos.critic_loss`). `ValueModel` is the plain-torch critic: a value head on a copy of the
policy's transformer trunk.

A value model on disk (`ValueModel.save_pretrained` / `from_pretrained`, and a reward source with type=model) is a
Hugging Face directory that `AutoModel` loads as the trunk (the bare trunk as saved here, or a whole causal-LM
directory, whose LM head is then ignored) plus `value_head.safetensors` beside it: `weight` [1, hidden_size] and
`bias` [1], the head's `torch.nn.Linear` parameters.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path

import torch

from verl.algos import critic_loss
from verl.config.ppo import CriticConfig
from verl.errors import VerlConfigError
from verl.utils.nonfinite import NonfiniteGuard
from verl.workers.actor import record_step
from verl.workers.batch import RolloutBatch, micro_slices

__all__ = ["VALUE_HEAD_FILE", "CriticWorker", "ValueModel"]

VALUE_HEAD_FILE = "value_head.safetensors"


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

    def save_pretrained(self, path: str | Path, tokenizer=None) -> Path:
        """The trunk as a Hugging Face directory at `path` (with `tokenizer` when given) plus the value head."""
        from safetensors.torch import save_file
        if not callable(getattr(self.trunk, "save_pretrained", None)):
            raise VerlConfigError(f"ValueModel.save_pretrained: the trunk is a {type(self.trunk).__name__}, not a "
                                  f"Hugging Face model; build the ValueModel with from_causal_lm")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.trunk.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        head = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.value_head.state_dict().items()}
        save_file(head, str(path / VALUE_HEAD_FILE))
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ValueModel":
        """Loads what `save_pretrained` wrote (or a causal-LM directory given a value_head.safetensors)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        from transformers import AutoModel
        path = Path(path)
        head_file = path / VALUE_HEAD_FILE
        if not head_file.is_file():
            raise VerlConfigError(f"{str(path)!r} has no {VALUE_HEAD_FILE}; a value model is a Hugging Face "
                                  f"directory plus that file (ValueModel.save_pretrained writes both)")
        trunk = AutoModel.from_pretrained(path, dtype=dtype)
        hidden = trunk.config.hidden_size
        try:
            head = load_file(str(head_file))
        except SafetensorError as e:
            raise VerlConfigError(f"{head_file} is not a readable safetensors file ({e}); write it with "
                                  f"ValueModel.save_pretrained") from e
        want = {"weight": (1, hidden), "bias": (1,)}
        got = {k: tuple(v.shape) for k, v in head.items()}
        if got != want:
            raise VerlConfigError(f"{head_file}: tensors {got} do not match the trunk's value head {want} "
                                  f"(hidden_size={hidden}); write it with ValueModel.save_pretrained")
        model = cls(trunk, hidden)
        model.value_head.load_state_dict(head)
        return model.to(dtype)

    def forward(self, input_ids, attention_mask, position_ids, **attention_kwargs) -> torch.Tensor:
        """attention_kwargs: the trunk's attention arguments beyond the mask (packed rows' cu_seq_lens_q, ...)."""
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **attention_kwargs).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


class CriticWorker:
    def __init__(self, engine, cfg: CriticConfig, *, max_nonfinite_steps: int = 3, responses_per_mini: int = 0):
        """`responses_per_mini`: this rank's responses per optimizer step (critic.mini_batch_size); 0: all."""
        self.engine, self.cfg, self.responses_per_mini = engine, cfg, responses_per_mini
        self._micro = dict(padding_free=cfg.padding_free, max_tokens=cfg.max_tokens_per_micro_batch)
        if cfg.share_prompt_prefix:  # engines with EngineSpec.prefix_sharing take it (config check)
            self._micro["share_prefix"] = True
        self.guard = NonfiniteGuard("critic", max_nonfinite_steps)

    def onload(self, device: torch.device) -> None:
        """cpu_offload: the dataflow runtime calls this before the role's node, `offload` after it."""
        self.engine.onload(device)

    def offload(self) -> None:
        self.engine.offload()

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """V(state before response token t), [B, R] (0 on padding)."""
        return self.engine.forward(batch, self.cfg.micro_batch_size, **self._micro)["values"]

    def update(self, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor,
               step: int | None = None) -> dict[str, float]:
        """Epochs of optimizer steps over mini-batches (critic.mini_batch_size; 0: the whole batch in one step),
        micro-batches accumulating gradients. Skipped steps (non-finite loss or gradient norm) count in
        critic/nonfinite_steps, as in `ActorWorker.update`."""
        def loss_fn_for(agg):
            def loss_fn(out, f):
                return critic_loss(out["values"], f["response_mask"], f["old_values"], f["returns"],
                                   cliprange=self.cfg.cliprange_value, agg=agg)
            return loss_fn
        stats: dict[str, list[float]] = defaultdict(list)
        skipped = self.guard.skipped
        for _ in range(self.cfg.ppo_epochs):
            for mini in micro_slices(len(batch), self.responses_per_mini or max(1, len(batch))):
                sub = batch.select(mini)
                agg = self.engine.aggregation("token-mean", sub.response_mask, sub.response_mask.shape[1])
                per_micro, result = self.engine.train_step(sub, self.cfg.micro_batch_size, loss_fn_for(agg),
                                                           {"old_values": old_values[mini], "returns": returns[mini]},
                                                           **self._micro)
                record_step(stats, "critic", per_micro, result, self.guard, step)
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["critic/nonfinite_steps"] = float(self.guard.skipped - skipped)
        if "share_prefix" in self._micro:  # this update's passes and the value pass before it
            out.update(self.engine.tree_counts.take("critic"))
        return out
