"""Actor, reference and critic workers on megatron-core GPT models (TP / PP / SP; megatron DDP and its Adam).

Chosen with ``actor.engine=megatron``. The models are built from a Hugging Face directory (the warm-started
policy, written by the trainer) with `verl.models`; the rollout keeps a Hugging Face copy that
``sync_weights`` refreshes each step from the megatron shards (gathered to HF names, then broadcast over the
model-parallel group). Same calls as the torch workers: ``compute_log_probs``, ``update``,
``compute_values``; checkpoints put each rank's model shard and optimizer state into the trainer's DCP checkpoint.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from verl.algos import Aggregation, kl_loss
from verl.config.ppo import ActorConfig, CriticConfig, MegatronConfig, OptimConfig
from verl.trainer import algorithms as algo
from verl.utils.distributed import comm_device
from verl.workers.batch import RolloutBatch, micro_slices


def _micro_size(n: int, wanted: int) -> int:
    """Largest divisor of n not above `wanted` (megatron needs equal micro-batches)."""
    return max(d for d in range(1, min(n, wanted) + 1) if n % d == 0)


class MegatronModel:
    """One megatron GPT (optionally with a value head) and, if trained, its optimizer."""

    def __init__(self, hf_dir: str | Path, pg, mcfg: MegatronConfig, *, value_head: bool = False,
                 optim: OptimConfig | None = None, total_steps: int = 1):
        from transformers import AutoConfig

        from verl.models import BuildOptions, build_gpt, load_hf_checkpoint
        from verl.models.optimizer import OptimConfig as MOptim, build_optimizer
        self.pg = pg
        self.model = build_gpt(AutoConfig.from_pretrained(hf_dir), pg,
                               BuildOptions(params_dtype=mcfg.params_dtype, value_head=value_head))
        load_hf_checkpoint(self.model, hf_dir)
        self.opt = None
        if optim is not None:
            self.opt = build_optimizer(self.model, MOptim(
                lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas), eps=optim.eps,
                clip_grad=optim.grad_clip, warmup_steps=optim.warmup_steps,
                total_steps=max(total_steps, optim.warmup_steps + 1),
                use_distributed_optimizer=mcfg.use_distributed_optimizer))
        else:
            self.model.module.requires_grad_(False)

    def aggregation(self, mode: str, mask: torch.Tensor, norm_len: int) -> Aggregation:
        """Counts over the data-parallel group (TP / PP peers hold the same batch)."""
        counts = torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())], dtype=torch.float64,
                              device=comm_device())
        if self.pg.dp_size > 1:
            dist.all_reduce(counts, group=self.pg.dp)
        return Aggregation(mode=mode, global_tokens=float(counts[0]), global_seqs=float(counts[1]),
                           dp_size=self.pg.dp_size, norm_len=float(norm_len))

    def train_step(self, batch: RolloutBatch, micro: int, loss_fn, **extra: torch.Tensor) -> dict:
        from verl.models import make_micro_batches
        from verl.models.optimizer import train_step
        mbs = make_micro_batches(batch.input_ids, batch.attention_mask, _micro_size(len(batch), micro), **extra)
        n = len(mbs)
        # megatron divides each micro-batch loss by their number; the aggregation already sums to the step loss
        return train_step(self.model, self.opt, mbs, lambda out, mb: loss_fn(out, mb, n))

    def dcp_state(self, for_load: bool = False) -> dict:
        """This rank's part of the trainer's DCP checkpoint, under a rank-unique key (TP/PP shards share
        parameter names, so plain names would be de-duplicated across ranks): the model shard as DCP tensors
        (the live ones: DCP reads them on save and loads into them in place), the optimizer and LR schedule as
        one opaque blob (their tensors only exist after the first step, and DCP loads tensors into existing
        ones). `for_load` leaves the blob empty: DCP replaces it with the saved one."""
        from verl.models.optimizer import model_tensors, optimizer_state
        state = {"model": model_tensors(self.model)}
        if self.opt is not None:
            blob = io.BytesIO()
            if not for_load:
                torch.save(optimizer_state(self.model, self.opt), blob)
                blob.seek(0)
            state["train_state"] = blob
        return {f"rank{dist.get_rank():05d}": state}

    def load_dcp_state(self, state: dict, source: str) -> None:
        """Restores what `dcp_state` saved (DCP has filled the tensors and hands the blob back as a stream)."""
        mine = state[f"rank{dist.get_rank():05d}"]
        if self.opt is None:
            self.model.gpt.load_state_dict(mine["model"], strict=False)
            return
        from verl.models.optimizer import restore_training_state
        blob = mine["train_state"]
        blob.seek(0)
        restore_training_state(self.model, self.opt, {"model": mine["model"], **torch.load(blob, weights_only=False)},
                               source)

    @property
    def lr(self) -> float:
        return self.opt.optimizer.param_groups[0]["lr"] if self.opt else 0.0


class MegatronActorWorker:
    """Policy (or, without an optimizer, the frozen reference) on megatron."""

    def __init__(self, engine: MegatronModel, cfg: ActorConfig, *, temperature: float, responses_per_mini: int,
                 max_response_length: int):
        self.engine, self.cfg, self.temperature = engine, cfg, temperature
        self.micro_batch_size = cfg.micro_batch_size
        self.responses_per_mini, self.max_response_length = responses_per_mini, max_response_length

    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        from verl.models import compute_log_probs
        out = compute_log_probs(self.engine.model, batch.input_ids, batch.attention_mask,
                                temperature=self.temperature,
                                micro_batch_size=_micro_size(len(batch), self.micro_batch_size))
        P = batch.prompt_length
        mask = batch.response_mask
        return out["log_probs"][:, P - 1:-1] * mask, out["entropy"][:, P - 1:-1] * mask

    def _loss_fn(self, agg: Aggregation, prompt_length: int, on_policy: bool, use_ref: bool):
        from verl.models import IGNORE_INDEX, vocab_parallel_logprob_entropy
        from verl.models.vocab_parallel import masked_vocab_logits
        cfg, model = self.cfg, self.engine.model

        def loss_fn(logits, mb, n_micro):
            lp, ent = vocab_parallel_logprob_entropy(masked_vocab_logits(logits, model), mb["labels"],
                                                     self.temperature, model.pg.tp, ignore_index=IGNORE_INDEX)
            P, mask = prompt_length, mb["response_mask"]
            lp, ent = lp[:, P - 1:-1], ent[:, P - 1:-1]
            old = lp.detach() if on_policy else mb["old_log_probs"]
            pg_loss, clipfrac, ppo_kl = algo.policy_loss(
                cfg.policy_loss, lp, old, mb["advantages"], mask, clip_low=cfg.clip_ratio_low,
                clip_high=cfg.clip_ratio_high, clip_c=cfg.clip_ratio_c, agg=agg)
            loss = pg_loss
            metrics = {"actor/pg_loss": pg_loss.detach().clone() * n_micro, "actor/pg_clipfrac": clipfrac.detach(),
                       "actor/ppo_kl": ppo_kl.detach(),
                       "actor/entropy": algo.aggregate(ent.detach(), mask, "token-mean")}
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * algo.aggregate(ent, mask, agg)
            if use_ref:
                metrics["actor/kl"] = algo.aggregate((lp - mb["ref_log_probs"]).detach(), mask, "token-mean")
                if cfg.use_kl_loss:
                    kl = kl_loss(cfg.kl_loss_type, lp, mb["ref_log_probs"], mask, agg)
                    loss = loss + cfg.kl_loss_coef * kl
                    metrics["actor/kl_loss"] = kl.detach().clone() * n_micro
            return loss * n_micro, metrics
        return loss_fn

    def update(self, batch: RolloutBatch, old_logp, advantages, ref_logp) -> dict[str, float]:
        stats: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.cfg.ppo_epochs):
            for mini in micro_slices(len(batch), self.responses_per_mini):
                sub = batch.select(mini)
                agg = self.engine.aggregation(self.cfg.loss_agg_mode, sub.response_mask, self.max_response_length)
                extra = {"response_mask": sub.response_mask, "advantages": advantages[mini]}
                if old_logp is not None:
                    extra["old_log_probs"] = old_logp[mini]
                if ref_logp is not None:
                    extra["ref_log_probs"] = ref_logp[mini]
                out = self.engine.train_step(sub, self.micro_batch_size,
                                             self._loss_fn(agg, batch.prompt_length, old_logp is None,
                                                           ref_logp is not None), **extra)
                for k, v in out.items():
                    if k.startswith("actor/") and math.isfinite(v):
                        stats[k].append(v)
                stats["actor/grad_norm"].append(out["grad_norm"])
        result = {k: sum(v) / len(v) for k, v in stats.items()}
        result["actor/lr"] = self.engine.lr
        return result

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The full model under Hugging Face names on every rank (gathered over TP / PP, then broadcast over
        the model-parallel group from the rank that assembled it)."""
        from megatron.core import parallel_state as ps

        from verl.models.checkpoint import gather_hf_state_dict
        from verl.models.layout import hf_tensor_shapes
        model = self.engine.model
        full = gather_hf_state_dict(model)
        shapes = hf_tensor_shapes(model.arch)
        if self.engine.pg.tp_size * self.engine.pg.pp_size == 1:
            return full
        group = ps.get_model_parallel_group()
        holders = [None] * dist.get_world_size(group)
        dist.all_gather_object(holders, dist.get_rank() if full is not None else -1, group=group)
        src = max(holders)
        out = {}
        for name in sorted(shapes):
            t = full[name].contiguous() if full is not None else torch.empty(shapes[name])
            dist.broadcast(t, src=src, group=group)
            out[name] = t
        return out


class MegatronCriticWorker:
    """Value model (value head on the policy's trunk) on megatron."""

    def __init__(self, engine: MegatronModel, cfg: CriticConfig):
        self.engine, self.cfg = engine, cfg

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        from verl.models import compute_values
        values = compute_values(self.engine.model, batch.input_ids, batch.attention_mask,
                                micro_batch_size=_micro_size(len(batch), self.cfg.micro_batch_size))
        P = batch.prompt_length
        return values[:, P - 1:-1] * batch.response_mask

    def update(self, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        agg = self.engine.aggregation("token-mean", batch.response_mask, batch.response_mask.shape[1])
        P = batch.prompt_length

        def loss_fn(values, mb, n_micro):
            loss, clipfrac = algo.value_loss(values[:, P - 1:-1], mb["old_values"], mb["returns"], mb["response_mask"],
                                             cliprange=self.cfg.cliprange_value, agg=agg)
            return loss * n_micro, {"critic/vf_loss": loss.detach().clone() * n_micro,
                                    "critic/vf_clipfrac": clipfrac.detach()}
        stats: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.cfg.ppo_epochs):
            out = self.engine.train_step(batch, self.cfg.micro_batch_size, loss_fn, response_mask=batch.response_mask,
                                         old_values=old_values, returns=returns)
            for k in ("critic/vf_loss", "critic/vf_clipfrac"):
                stats[k].append(out[k])
            stats["critic/grad_norm"].append(out["grad_norm"])
        return {k: sum(v) / len(v) for k, v in stats.items()}
