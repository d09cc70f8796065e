"""Actor (policy) and reference workers: response log-probs, and the PPO update over mini-batches,
micro-batches and epochs with entropy bonus and optional KL-to-reference loss."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from verl.algos import Aggregation, kl_loss
from verl.config.ppo import ActorConfig
from verl.trainer import algorithms as algo
from verl.utils.distributed import comm_device
from verl.workers.batch import RolloutBatch, micro_slices
from verl.workers.engine import TorchEngine


def response_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float):
    """log p(response token) and entropy, both [B, R]; only the R positions that predict response tokens go
    through the (fused) LM head."""
    P = batch.prompt_length
    hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, use_cache=False).last_hidden_state
    return algo.response_logprob_entropy(hidden[:, P - 1:-1], model.get_output_embeddings(), batch.responses,
                                         temperature)


def step_aggregation(mode: str, mask: torch.Tensor, engine: TorchEngine, norm_len: int) -> Aggregation:
    """Aggregation over one optimizer step's tokens on all ranks, so micro-batch losses add up (and DP
    gradient averaging cancels) to exactly the loss of the whole mini-batch."""
    counts = torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())], dtype=torch.float64,
                          device=comm_device())
    if engine.world.distributed:
        dist.all_reduce(counts)
    return Aggregation(mode=mode, global_tokens=float(counts[0]), global_seqs=float(counts[1]),
                       dp_size=engine.world.world_size, norm_len=float(norm_len))


class _LogProbMixin:
    engine: TorchEngine
    temperature: float
    micro_batch_size: int

    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) [B, R] of the batch's responses under this worker's model (0 on padding)."""
        logps, ents = [], []
        for sl in micro_slices(len(batch), self.micro_batch_size):
            lp, ent = response_logprobs(self.engine.module, batch.select(sl), self.temperature)
            logps.append(lp)
            ents.append(ent)
        mask = batch.response_mask
        return torch.cat(logps) * mask, torch.cat(ents) * mask


class ReferenceWorker(_LogProbMixin):
    """A frozen copy of the initial policy (the KL anchor)."""

    def __init__(self, engine: TorchEngine, temperature: float, micro_batch_size: int):
        self.engine, self.temperature, self.micro_batch_size = engine, temperature, micro_batch_size


class ActorWorker(_LogProbMixin):
    """The trained policy."""

    def __init__(self, engine: TorchEngine, cfg: ActorConfig, *, temperature: float, responses_per_mini: int,
                 max_response_length: int):
        self.engine, self.cfg, self.temperature = engine, cfg, temperature
        self.micro_batch_size = cfg.micro_batch_size
        self.responses_per_mini = responses_per_mini
        self.max_response_length = max_response_length

    def _micro_loss(self, mb: RolloutBatch, old_logp, advantages, ref_logp, agg: Aggregation, stats) -> torch.Tensor:
        cfg = self.cfg
        logp, entropy = response_logprobs(self.engine.module, mb, self.temperature)
        mask = mb.response_mask
        old = logp.detach() if old_logp is None else old_logp
        pg_loss, clipfrac, ppo_kl = algo.policy_loss(
            cfg.policy_loss, logp, old, advantages, mask, clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
            clip_c=cfg.clip_ratio_c, agg=agg)
        loss = pg_loss
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * algo.aggregate(entropy, mask, agg)
        if cfg.use_kl_loss:
            kl = kl_loss(cfg.kl_loss_type, logp, ref_logp, mask, agg)
            loss = loss + cfg.kl_loss_coef * kl
            stats["actor/kl_loss"].append(float(kl.detach()))
        with torch.no_grad():
            stats["actor/pg_loss"].append(float(pg_loss))
            stats["actor/pg_clipfrac"].append(float(clipfrac))
            stats["actor/ppo_kl"].append(float(ppo_kl))
            stats["actor/entropy"].append(float(algo.aggregate(entropy, mask, "token-mean")))
            if ref_logp is not None:
                stats["actor/kl"].append(float(algo.aggregate(logp - ref_logp, mask, "token-mean")))
        return loss

    def update(self, batch: RolloutBatch, old_logp: torch.Tensor | None, advantages: torch.Tensor,
               ref_logp: torch.Tensor | None) -> dict[str, float]:
        """PPO epochs over mini-batches (one optimizer step each) of micro-batches (gradient accumulation).

        `old_logp=None` means on-policy (one epoch, one mini-batch): the first forward's detached log-probs
        are the old ones, which saves a whole forward pass per step.
        """
        stats: dict[str, list[float]] = defaultdict(list)
        summed = ("actor/pg_loss", "actor/kl_loss")  # partial sums over micro-batches (see step_aggregation)
        for _ in range(self.cfg.ppo_epochs):
            for mini in micro_slices(len(batch), self.responses_per_mini):
                agg = step_aggregation(self.cfg.loss_agg_mode, batch.response_mask[mini], self.engine,
                                       self.max_response_length)
                mini_stats: dict[str, list[float]] = defaultdict(list)
                for sl in micro_slices(mini.stop - mini.start, self.micro_batch_size):
                    rows = slice(mini.start + sl.start, mini.start + sl.stop)
                    loss = self._micro_loss(batch.select(rows), None if old_logp is None else old_logp[rows],
                                            advantages[rows], None if ref_logp is None else ref_logp[rows], agg,
                                            mini_stats)
                    loss.backward()
                for k, v in mini_stats.items():
                    stats[k].append(sum(v) if k in summed else sum(v) / len(v))
                stats["actor/grad_norm"].append(self.engine.step())
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["actor/lr"] = self.engine.lr
        return out
