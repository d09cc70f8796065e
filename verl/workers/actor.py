"""Actor (policy) and reference workers: response log-probs, and the PPO update over mini-batches,
micro-batches and epochs with entropy bonus and optional KL-to-reference loss."""

from __future__ import annotations

from collections import defaultdict

import torch

from verl.config.ppo import ActorConfig
from verl.trainer import algorithms as algo
from verl.workers.batch import RolloutBatch, micro_slices
from verl.workers.engine import TorchEngine


def response_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float):
    """log p(response token) and entropy, both [B, R]; only the R + 1 last positions reach the LM head."""
    R = batch.response_mask.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                logits_to_keep=R + 1, use_cache=False)
    return algo.logprob_entropy(out.logits[:, :-1], batch.responses, temperature)


class _LogProbMixin:
    engine: TorchEngine
    temperature: float
    micro_batch_size: int

    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) [B, R] of the batch's responses under this worker's model."""
        logps, ents = [], []
        for sl in micro_slices(len(batch), self.micro_batch_size):
            lp, ent = response_logprobs(self.engine.module, batch.select(sl), self.temperature)
            logps.append(lp)
            ents.append(ent)
        return torch.cat(logps), torch.cat(ents)


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

    def _micro_loss(self, mb: RolloutBatch, old_logp, advantages, ref_logp, stats) -> torch.Tensor:
        cfg = self.cfg
        logp, entropy = response_logprobs(self.engine.module, mb, self.temperature)
        mask = mb.response_mask
        old = logp.detach() if old_logp is None else old_logp
        pg_loss, clipfrac, approx_kl = algo.policy_loss(
            logp, old, advantages, mask, clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
            clip_c=cfg.clip_ratio_c, agg_mode=cfg.loss_agg_mode)
        ent = algo.agg_loss(entropy, mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coeff * ent
        if cfg.use_kl_loss:
            kl = algo.agg_loss(algo.kl_penalty(logp, ref_logp, cfg.kl_loss_type), mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl
            stats["actor/kl_loss"].append(float(kl.detach()))
        if ref_logp is not None:
            stats["actor/kl"].append(float(algo.agg_loss((logp - ref_logp).detach(), mask, "token-mean")))
        stats["actor/pg_loss"].append(float(pg_loss.detach()))
        stats["actor/pg_clipfrac"].append(float(clipfrac))
        stats["actor/ppo_kl"].append(float(approx_kl))
        stats["actor/entropy"].append(float(algo.agg_loss(entropy.detach(), mask, "token-mean")))
        return loss

    def update(self, batch: RolloutBatch, old_logp: torch.Tensor | None, advantages: torch.Tensor,
               ref_logp: torch.Tensor | None) -> dict[str, float]:
        """PPO epochs over mini-batches (one optimizer step each) of micro-batches (gradient accumulation).

        `old_logp=None` means on-policy (one epoch, one mini-batch): the first forward's detached log-probs
        are the old ones, which saves a whole forward pass per step.
        """
        stats: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.cfg.ppo_epochs):
            for mini in micro_slices(len(batch), self.responses_per_mini):
                mini_size = mini.stop - mini.start
                for sl in micro_slices(mini_size, self.micro_batch_size):
                    rows = slice(mini.start + sl.start, mini.start + sl.stop)
                    loss = self._micro_loss(batch.select(rows), None if old_logp is None else old_logp[rows],
                                            advantages[rows], None if ref_logp is None else ref_logp[rows], stats)
                    (loss * ((sl.stop - sl.start) / mini_size)).backward()
                stats["actor/grad_norm"].append(self.engine.step())
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["actor/lr"] = self.engine.lr
        return out
