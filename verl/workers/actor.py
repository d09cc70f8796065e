"""The actor (policy) worker, on any training engine: response log-probs, and the PPO update over
mini-batches, micro-batches and epochs with `verl.algos.actor_loss`. A frozen engine makes it the reference.

On-policy updates (one epoch over one mini-batch) need no separate old-log-prob pass: the update's forward,
detached, gives the old log-probs, and with them the rollout/train mismatch of this step.

Rollout correction (algorithm.rollout_correction, verl/algos/rollout_correction.py) is applied here, once per
step before the epochs: rejected tokens leave the batch's response mask (so the aggregation's counts drop them)
and the IS weights travel with the advantages into the policy loss. On-policy, without rejection, the IS weights
come from the update's own forward instead, micro-batch by micro-batch: its detached log-probs are pi_old (the
fused loss head computes them first with one extra LM-head pass, no grad), so no old-log-prob pass is needed.

With actor.fused_loss_head the update's loss comes from one fused op over the hidden states and the LM head weight
(verl.ops.linear_rl_loss, same loss, gradients and statistics as actor_loss): the loss function carries it as
`loss_fn.fused_head`, the engine calls it inside its forward where the LM head would run, and hands back its
loss, statistics and log-probs. Engines that do not offer it (or a head it cannot fuse) give log-probs as usual
and the same loss function falls back to actor_loss.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from verl.algos import ADDITIVE, actor_loss, rollout_correction, rollout_mismatch
from verl.algos.rollout_correction import is_weights
from verl.algos import policy_losses
from verl.algos.kl import fused_kl_kind
from verl.config.ppo import ActorConfig, RolloutCorrectionConfig
from verl.errors import VerlConfigError
from verl.utils.nonfinite import NonfiniteGuard
from verl.workers.batch import RolloutBatch, micro_slices

__all__ = ["ActorWorker", "reduce_micro_stats"]


def reduce_micro_stats(per_micro: list[dict[str, float]]) -> dict[str, float]:
    """One optimizer step's statistics from its micro-batches': sums of the loss parts, means of the rest."""
    keys = per_micro[0] if per_micro else {}
    return {k: sum(m[k] for m in per_micro) / (1 if k in ADDITIVE else len(per_micro)) for k in keys}


def record_step(stats: dict[str, list[float]], role: str, per_micro: list[dict[str, float]], result, guard,
                step: int) -> None:
    """Adds one optimizer step's statistics and grad norm to `stats`, unless the non-finite guard skipped the
    step (its statistics would be NaN; the guard counts it instead)."""
    if guard.record(result.nonfinite, step):
        for k, v in reduce_micro_stats(per_micro).items():
            stats[k].append(v)
        stats[f"{role}/grad_norm"].append(result.grad_norm)


class ActorWorker:
    """The trained policy (or, on a frozen engine, the reference)."""

    def __init__(self, engine, cfg: ActorConfig, *, temperature: float, responses_per_mini: int,
                 max_response_length: int, rollout_correction: RolloutCorrectionConfig | None = None,
                 max_nonfinite_steps: int = 3):
        self.engine, self.cfg, self.temperature = engine, cfg, temperature
        self.guard = NonfiniteGuard("actor", max_nonfinite_steps)
        self.responses_per_mini, self.max_response_length = responses_per_mini, max_response_length
        self.correction = rollout_correction or RolloutCorrectionConfig()
        self.loss_params = cfg.loss_params()
        self._micro = dict(padding_free=cfg.padding_free, max_tokens=cfg.max_tokens_per_micro_batch)
        self.weight_link = None
        self.weight_stream = None  # trainer.mode=async: publishes each new version (verl.workers.rollout.WeightStream)
        """A `verl.workers.rollout.WeightLink` when the rollout runs on other ranks: where this actor sends its
        weights (set by the trainer)."""
        if cfg.share_prompt_prefix:  # engines with EngineSpec.prefix_sharing take it (config check)
            self._micro["share_prefix"] = True

    def onload(self, device: torch.device) -> None:
        """cpu_offload: the dataflow runtime calls this before the role's node, `offload` after it."""
        self.engine.onload(device)

    def offload(self) -> None:
        self.engine.offload()

    def compute_log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) [B, R] of the batch's responses under this worker's model (0 on padding)."""
        out = self.engine.forward(batch, self.cfg.micro_batch_size, temperature=self.temperature, **self._micro)
        return out["log_probs"], out["entropy"]

    def _loss_fn(self, agg, seen: torch.Tensor | None):
        cfg = self.cfg

        def loss_fn(out, f):
            if seen is not None:  # on-policy: this forward's log-probs are the old ones; keep them for the mismatch
                seen[f["row"]] = out["log_probs"].detach().to(seen.dtype)
            if "loss" in out:  # the engine ran the fused loss head
                return out["loss"], {k: v.detach() for k, v in out.items() if k.startswith("actor/")}
            if "rollout_log_probs" in f:  # on-policy IS: this forward's log-probs are pi_old
                f = dict(f, rollout_is_weights=self._inline_weights(out["log_probs"], f))
            return actor_loss(out["log_probs"], out["entropy"], f["response_mask"], f["advantages"],
                              old_log_probs=f.get("old_log_probs"), ref_log_probs=f.get("ref_log_probs"),
                              policy_loss=cfg.policy_loss, clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
                              clip_c=cfg.clip_ratio_c, agg=agg, entropy_coeff=cfg.entropy_coeff,
                              kl_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0, kl_type=cfg.kl_loss_type,
                              loss_params=self.loss_params, rollout_is_weights=f.get("rollout_is_weights"))
        kinds = self._head_kinds()
        if kinds is not None:
            loss_fn.fused_head = self._fused_head(agg, kinds)
        return loss_fn

    def _head_kinds(self) -> tuple[str, str] | None:
        """(policy loss, KL kind) of the fused loss head, or None when this config must take the unfused path."""
        cfg = self.cfg
        if not cfg.fused_loss_head or not getattr(self.engine, "supports_fused_head", False):
            return None
        fn = policy_losses.get_policy_loss(cfg.policy_loss)
        loss_type = {policy_losses.vanilla: "vanilla", policy_losses.gspo: "gspo",
                     policy_losses.reinforce: "reinforce"}.get(fn)
        kl_kind = fused_kl_kind(cfg.kl_loss_type) if cfg.use_kl_loss else "low_var_kl"
        return None if loss_type is None or kl_kind is None else (loss_type, kl_kind)

    def _fused_head(self, agg, kinds: tuple[str, str]):
        """head(hidden [b, R, H], weight [V, H], labels [b, R], temperature, fields) -> flat dict: "loss", "log_probs"
        and actor_loss's statistics; what the engine runs in place of its LM head."""
        from verl.ops.rl_head import linear_rl_loss, vocab_parallel_linear_rl_loss
        cfg, (loss_type, kl_kind) = self.cfg, kinds
        kl_coef = cfg.kl_loss_coef if cfg.use_kl_loss else 0.0

        def head(hidden, weight, labels, temperature, fields, tp=None):
            """tp: (group, vocab_start, vocab_size) when `weight` is this rank's vocabulary shard (megatron)."""
            adv, w = fields["advantages"], fields.get("rollout_is_weights")
            ref = fields.get("ref_log_probs")
            kw = dict(old_logprob=fields.get("old_log_probs"), ref_logprob=ref, temperature=temperature,
                      loss_type=loss_type, clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
                      clip_c=cfg.clip_ratio_c, kl_kind=kl_kind, kl_coef=kl_coef, entropy_coeff=cfg.entropy_coeff,
                      agg=agg)

            def run(*args):
                if tp is None:
                    return linear_rl_loss(*args, **kw)
                group, start, vocab = tp
                return vocab_parallel_linear_rl_loss(*args, group, vocab_start=start, vocab_size=vocab,
                                                     reduce_grad_hidden=False, **kw)

            if "rollout_log_probs" in fields:  # on-policy IS: pi_old is this forward's, needed before the loss
                with torch.no_grad():  # the same op without gradients: its log-probs are the loss's own
                    lp = run(hidden.detach(), weight.detach(), labels, fields["response_mask"], adv).log_probs
                w = self._inline_weights(lp, fields)
            out = run(hidden, weight, labels, fields["response_mask"], adv if w is None else adv * w)
            res = {"loss": out.loss, "log_probs": out.log_probs, "actor/pg_loss": out.pg_loss,
                   "actor/pg_clipfrac": out.pg_clipfrac, "actor/pg_clipfrac_lower": out.pg_clipfrac_lower,
                   "actor/ppo_kl": out.ppo_kl, "actor/entropy": out.entropy_mean}
            if ref is not None:
                res["actor/kl"] = out.kl_mean
                if kl_coef:
                    res["actor/kl_loss"] = out.kl_loss
            return res
        return head

    def _inline_weights(self, log_probs: torch.Tensor, fields: dict) -> torch.Tensor:
        """On-policy truncated IS weights of one micro-batch from its own forward's log-probs (pi_old)."""
        return is_weights(log_probs.detach(), fields["rollout_log_probs"], fields["response_mask"],
                          self.correction.is_level, self.correction.is_cap)

    def _correct(self, batch: RolloutBatch, old_log_probs: torch.Tensor | None):
        """(batch with rejected tokens masked out, IS weights or None, metrics) under algorithm.rollout_correction."""
        if batch.rollout_log_probs is None:
            raise VerlConfigError("algorithm.rollout_correction needs the rollout engine's log-probs of the sampled "
                                  "tokens, and this rollout returned none; turn the correction off or use an engine "
                                  "that returns them")
        if old_log_probs is None:
            raise VerlConfigError("algorithm.rollout_correction weights / rejection need the old log-probs from the "
                                  "old_log_prob node (PPOConfig.on_policy is false when rejection is on)")
        corr = rollout_correction(old_log_probs, batch.rollout_log_probs, batch.response_mask, self.correction)
        mask = batch.response_mask * corr.keep.to(batch.response_mask.dtype)
        return dataclasses.replace(batch, response_mask=mask), corr.weights, corr.metrics

    def update(self, batch: RolloutBatch, old_log_probs: torch.Tensor | None, advantages: torch.Tensor,
               ref_log_probs: torch.Tensor | None, step: int | None = None) -> dict[str, float]:
        """PPO epochs over mini-batches (one optimizer step each) of micro-batches (gradient accumulation).
        `old_log_probs=None` means on-policy (see the module docstring). A step the engine skipped for a
        non-finite loss or gradient norm counts in actor/nonfinite_steps and leaves its statistics out of the
        means; `step` (the training step) only names it in the error `trainer.max_nonfinite_steps` raises."""
        weights, corr_metrics = None, {}
        inline = self.correction.enabled and old_log_probs is None  # on-policy IS (PPOConfig.on_policy)
        if inline and (self.correction.rejection_level != "none" or batch.rollout_log_probs is None):
            self._correct(batch, old_log_probs)  # raises, naming what is missing
        if self.correction.enabled and not inline:
            batch, weights, corr_metrics = self._correct(batch, old_log_probs)
        tensors = {"advantages": advantages, "old_log_probs": old_log_probs, "ref_log_probs": ref_log_probs,
                   "rollout_is_weights": weights, "row": torch.arange(len(batch), device=advantages.device),
                   "rollout_log_probs": batch.rollout_log_probs if inline else None}
        tensors = {k: v for k, v in tensors.items() if v is not None}
        seen = None
        if old_log_probs is None and batch.rollout_log_probs is not None:
            seen = torch.zeros_like(batch.rollout_log_probs)
        stats: dict[str, list[float]] = defaultdict(list)
        skipped = self.guard.skipped
        for _ in range(self.cfg.ppo_epochs):
            for mini in micro_slices(len(batch), self.responses_per_mini):
                sub = batch.select(mini)
                agg = self.engine.aggregation(self.cfg.loss_agg_mode, sub.response_mask, self.max_response_length)
                per_micro, result = self.engine.train_step(
                    sub, self.cfg.micro_batch_size, self._loss_fn(agg, seen), {k: v[mini] for k, v in tensors.items()},
                    temperature=self.temperature, **self._micro)
                record_step(stats, "actor", per_micro, result, self.guard, step)
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        out["actor/nonfinite_steps"] = float(self.guard.skipped - skipped)
        out["actor/lr"] = self.engine.lr
        out.update(getattr(self.engine, "take_metrics", dict)())  # moe/*: routing since the last update
        if "share_prefix" in self._micro:  # this update's passes and the log-prob passes before it
            out.update(self.engine.tree_counts.take("actor"))
        out.update(corr_metrics)
        if seen is not None:
            seen = self.engine.from_last_stage(seen)
            out.update(rollout_mismatch(seen, batch.rollout_log_probs, batch.response_mask))
            if inline:  # the weights the loss used, from the same log-probs
                out.update(rollout_correction(seen, batch.rollout_log_probs, batch.response_mask,
                                              self.correction).metrics)
        return out
