"""Short supervised warm start: teaches a random model the answer format (prompt → answer, EOS) so that RL
starts from a policy whose samples sometimes earn reward. Loss on the answer tokens only. In an agent job the
examples are the environment's demonstrations (multi-turn conversations, built as rollouts build trajectories),
with the loss on the assistant turns only."""

from __future__ import annotations

import torch

from verl.config.ppo import OptimConfig
from verl.config.ppo import WarmupConfig
from verl.data import PromptDataset
from verl.distributed import Placement
from verl.rollout import Tokenizer
from verl.workers.engine import TorchEngine


def sft_batch(tokenizer: Tokenizer, rows: list[dict], device,
              examples: list[tuple[list[int], list[int]]] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt (encoded exactly as the rollout encodes it) + answer + EOS; labels -100 except on
    the answer and EOS. `examples` ((ids, loss mask) pairs: agent demonstrations) replace the rows."""
    seqs, labels = [], []
    for ids, mask in examples or []:
        seqs.append(list(ids))
        labels.append([t if m else -100 for t, m in zip(ids, mask)])
    for r in rows if examples is None else []:
        p = tokenizer.encode_prompt(r["prompt"])
        a = tokenizer.encode(r["answer"], add_special_tokens=False) + [tokenizer.eos_token_ids[0]]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    return ids, mask, lab


def supervised_warmup(module: torch.nn.Module, tokenizer, dataset: PromptDataset, cfg: WarmupConfig,
                      placement: Placement, seed: int, agent=None) -> dict[str, float]:
    """Runs `cfg.steps` AdamW steps of answer-only cross-entropy; returns the first and last losses. `agent` (an
    AgentLoop): train on its environment's demonstrations of the sampled rows instead."""
    engine = TorchEngine(module, OptimConfig(lr=cfg.lr), placement)
    tok = Tokenizer.wrap(tokenizer)
    g = torch.Generator().manual_seed(seed * 7919 + placement.rank)
    per_rank = max(1, cfg.batch_size // placement.world_size)
    losses = []
    module.train()
    for _ in range(cfg.steps):
        idx = torch.randint(len(dataset), (per_rank,), generator=g).tolist()
        rows = [dataset[i] for i in idx]
        examples = None
        if agent is not None:
            from verl.agents.loop import demonstration_rows
            examples = demonstration_rows(agent, rows, seed * 7919 + placement.rank * 131 + len(losses))
            if not examples:
                from verl.errors import VerlConfigError
                raise VerlConfigError(f"warmup.steps={cfg.steps} with agent.env={agent.cfg.env!r}, whose "
                                      f"environment gives no demonstrations to warm up on; set warmup.steps=0")
        ids, mask, labels = sft_batch(tok, rows, placement.device, examples)
        loss = module(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        engine.step()
        losses.append(float(loss.detach()))
    return {"warmup/first_loss": losses[0], "warmup/last_loss": losses[-1]} if losses else {}
