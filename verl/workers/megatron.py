"""The megatron-core training engine: a verl.models GPT (TP / PP / SP; megatron DDP and its Adam) behind the
same calls as the plain-torch engine (`forward`, `train_step`, `aggregation`, `hybrid_engine`), so the actor,
reference and critic workers are the same classes on both.

Chosen with `actor.engine=megatron`. Models are built from a Hugging Face directory (the warm-started policy,
written by the trainer); their weights reach the rollout engine through the 3D-HybridEngine (lazy, bucketed,
from the local TP/PP shards); checkpoints put each rank's shard and optimizer state into the trainer's DCP
checkpoint.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import torch
import torch.distributed as dist

from verl.config.ppo import OptimConfig
from verl.config.ppo import MegatronConfig
from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.ops.losses import Aggregation
from verl.workers.batch import MicroLossFn, RolloutBatch
from verl.workers.engine import OptimizerStep, count_aggregation
from verl.workers.packing import PackedBatch, TreeCounts, block_causal_mask, micro_batch_slices, pack, pack_tree

__all__ = ["MegatronEngine"]


class _HiddenOutput(torch.nn.Module):
    """Stands in for GPTModel's output layer while a fused loss head runs (actor.fused_loss_head): returns the
    final hidden states instead of logits, through the same tensor-parallel region the column-parallel output
    layer enters (all-gather of sequence-parallel activations, or identity), whose backward sums d loss / d hidden
    over the TP ranks. The fused head then multiplies by the output weight itself, never holding the logits."""

    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True), None
        return copy_to_tensor_model_parallel_region(hidden_states), None


def _to_device(mb: RolloutBatch, device: torch.device) -> RolloutBatch:
    """The token tensors of `mb` on `device` (packing indexes them together with the model's outputs)."""
    import dataclasses
    return dataclasses.replace(mb, input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                               position_ids=mb.position_ids.to(device), response_mask=mb.response_mask.to(device))


def _micro_size(n: int, wanted: int) -> int:
    """Largest divisor of n not above `wanted` (megatron needs equal micro-batches)."""
    return max(d for d in range(1, min(n, wanted) + 1) if n % d == 0)


class MegatronEngine:
    """One megatron GPT (optionally with a value head) and, if trained, its optimizer."""

    @classmethod
    def from_role(cls, req) -> "MegatronEngine":
        """The role's GPT model built from the warm-started policy's Hugging Face directory; the actor of an MoE
        policy replays the rollout's routes when actor.router_replay=rollout."""
        actor = req.role == "actor"
        return cls(req.init_dir, req.placement, req.cfg.actor.megatron, value_head=req.role == "critic",
                   optim=req.optim, total_steps=req.total_steps,
                   replay_routes=actor and req.cfg.actor.router_replay == "rollout", compare_routes=actor)

    def __init__(self, hf_dir: str | Path, placement: Placement, mcfg: MegatronConfig, *, value_head: bool = False,
                 optim: OptimConfig | None = None, total_steps: int = 1, replay_routes: bool = False,
                 compare_routes: bool = False):
        from transformers import AutoConfig

        from verl.models import BuildOptions, build_gpt, load_hf_checkpoint
        from verl.models.optimizer import build_optimizer
        self.placement = placement
        # Pad the vocabulary as the generation engines do (a multiple of 64), so at rollout.tp = tp the
        # embedding and output shards line up with the engines' and the weight sync moves no vocabulary row.
        tp = placement.tp_size
        self.model = build_gpt(AutoConfig.from_pretrained(hf_dir), placement,
                               BuildOptions(params_dtype=mcfg.params_dtype, value_head=value_head,
                                            vocab_multiple=64 // tp if 64 % tp == 0 else 1,
                                            moe_aux_loss_coeff=mcfg.moe_aux_loss_coeff,
                                            moe_z_loss_coeff=mcfg.moe_z_loss_coeff))
        load_hf_checkpoint(self.model, hf_dir)
        # mixture-of-experts policies: the rollout's routes are compared with the training forward's
        # (moe/router_mismatch_frac) and, with router replay, used instead of routing again
        moe = self.model.arch.moe is not None
        self.replay_routes, self.compare_routes = moe and replay_routes, moe and (compare_routes or replay_routes)
        self.opt = None
        if optim is not None:
            self.opt = build_optimizer(self.model, optim, total_steps=total_steps,
                                       use_distributed_optimizer=mcfg.use_distributed_optimizer)
        else:
            self.model.module.requires_grad_(False)

    @property
    def supports_fused_head(self) -> bool:
        """An LM (not a value model) whose vocabulary padding leaves every TP rank at least one real row."""
        layout, p = self.model.layout, self.placement
        shard = layout.padded_vocab_size // p.tp_size
        return not self.model.options.value_head and self.model.arch.vocab_size > (p.tp_size - 1) * shard

    def _fused_head_outputs(self, head, hidden: torch.Tensor, mb: dict, prompt_length: int,
                            temperature: float) -> dict[str, torch.Tensor]:
        """The fused loss head on the last stage's hidden states [b, s, H] and this rank's real vocabulary rows."""
        gpt, p, P = self.model.gpt, self.placement, prompt_length
        weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
                  else self._output_layer.weight)
        start = p.tp_rank * weight.shape[0]
        real = min(weight.shape[0], self.model.arch.vocab_size - start)  # padding rows never enter the softmax
        tp = (p.tp, start, self.model.arch.vocab_size)
        packed: PackedBatch | None = mb.get("packed")
        if packed is not None:  # one packed row: the response positions back in the [b, R] layout of `fields`
            return head(packed.unpack(hidden[0, packed.src]), weight[:real], packed.unpack(packed.targets),
                        temperature, fields=mb, tp=tp)
        return head(hidden[:, P - 1:-1], weight[:real], mb["input_ids"][:, P:], temperature, fields=mb, tp=tp)

    # -- forward --------------------------------------------------------------------------------------------
    def _packed_micro_batch(self, mb: RolloutBatch, tree: bool = False) -> dict:
        """One packed micro-batch as the dict megatron's forward step reads (verl/workers/packing.py): a single
        row of real tokens, restarting positions, and a block-diagonal causal mask. RoPE here rotates by the
        column index (megatron-core ignores position_ids for rope), which attention scores see only as the
        query-key distance, the same within each block as in the padded row. tree: `pack_tree`'s layout, its
        dense mask, and RoPE by the position ids (`rope_positions`: a shared prefix's columns are not the
        positions the tokens after it have in their rows)."""
        if self.model.spec == "te":
            raise VerlConfigError("padding_free with the Transformer Engine layer spec is not supported yet (TE's "
                                  "attention takes no block-diagonal mask; it needs thd PackedSeqParams); set "
                                  "actor.padding_free=false / critic.padding_free=false, or build with spec='local'")
        p = self.placement
        device = self.model.device
        # sequence parallelism splits the packed row over the TP ranks
        packed = (pack_tree if tree else pack)(_to_device(mb, device), multiple=p.tp_size if p.sequence_parallel else 1)
        mask = ~packed.attention if tree else block_causal_mask(packed.seq_ids)
        return {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                "attention_mask": torch.ones_like(packed.input_ids), "mask_4d": mask,
                "max_seqlen": packed.max_seqlen, "packed": packed, "rope_positions": tree}

    @functools.cached_property
    def tree_counts(self) -> TreeCounts:
        """What the prefix trees of its passes computed (share_prefix), until a worker takes them."""
        return TreeCounts()

    def _micro_batches(self, batch: RolloutBatch, micro_batch_size: int, extra: dict[str, torch.Tensor],
                       padding_free: bool, max_tokens: int, share_prefix: bool = False) -> list[dict]:
        """The micro-batch dicts of `batch` (with its response mask and `extra` rows) for megatron's schedule:
        padded rows of equal count (the original path), or cut by a token budget, or packed (share_prefix: as
        prefix trees)."""
        from verl.models import make_micro_batches
        routes = self._checked_routes(batch)
        if not padding_free and max_tokens <= 0:
            mbs = make_micro_batches(batch.input_ids, batch.attention_mask, _micro_size(len(batch), micro_batch_size),
                                     response_mask=batch.response_mask, **extra,
                                     **({} if routes is None else {"routes": routes}))
            return [{**mb, "replay_routes": self.replay_routes} for mb in mbs]
        out = []
        tree = share_prefix and padding_free
        for sl in micro_batch_slices(batch, micro_batch_size, max_tokens, self.placement.dp,
                                     tree=self.tree_counts if tree else None):
            mb = batch.select(sl)
            fields = {"response_mask": mb.response_mask, **{k: v[sl] for k, v in extra.items()}}
            base = (self._packed_micro_batch(mb, tree) if padding_free
                    else make_micro_batches(mb.input_ids, mb.attention_mask, len(mb))[0])
            if routes is not None:
                base["routes"] = self._packed_routes(routes[sl], mb, base) if padding_free else routes[sl]
                base["replay_routes"] = self.replay_routes
            out.append({**base, **fields})
        return out

    def _checked_routes(self, batch: RolloutBatch) -> torch.Tensor | None:
        """The batch's routes when this engine compares or replays them (checked against the model), else None."""
        if not self.compare_routes or batch.routes is None:
            return None
        from verl.models.moe import check_routes
        moe = self.model.arch.moe
        check_routes(batch.routes, len(moe.layers), moe.num_experts, moe.layers)
        return batch.routes

    def _packed_routes(self, routes: torch.Tensor, mb: RolloutBatch, packed_mb: dict) -> torch.Tensor:
        """[1, T, L, K]: the routes of the packed row's tokens, each from the row it came from at its position
        there (a prefix tree's shared token: the first row through it), -1 for the padding sequence sequence
        parallelism appends."""
        packed: PackedBatch = packed_mb["packed"]
        keep = mb.attention_mask.bool().to(routes.device)
        real = torch.full_like(routes, -1)  # each row's routes moved to the front, in its real tokens' order
        for r in range(len(mb)):
            real[r, :int(keep[r].sum())] = routes[r][keep[r]]
        rows, pos = packed.seq_ids.to(routes.device), packed.position_ids[0].to(routes.device)
        real = torch.cat([real, real.new_full((1, *real.shape[1:]), -1)])  # row b: the padding sequence
        return real[rows, pos.clamp(max=real.shape[1] - 1)][None]

    def _response_outputs(self, output: torch.Tensor, mb: dict, prompt_length: int,
                          temperature: float) -> dict[str, torch.Tensor]:
        """The last stage's output for one micro-batch → [b, R] response outputs."""
        P = prompt_length
        packed: PackedBatch | None = mb.get("packed")
        if packed is not None:
            return self._packed_outputs(output, mb, packed, temperature)
        if self.model.options.value_head:
            return {"values": output[:, P - 1:-1]}
        from verl.models import IGNORE_INDEX, masked_vocab_logits
        from verl.ops import vocab_parallel_logprob_entropy
        lp, ent = vocab_parallel_logprob_entropy(masked_vocab_logits(output, self.model), mb["labels"], temperature,
                                                 self.placement.tp, ignore_index=IGNORE_INDEX)
        return {"log_probs": lp[:, P - 1:-1], "entropy": ent[:, P - 1:-1]}

    def _packed_outputs(self, output: torch.Tensor, mb: dict, packed: PackedBatch,
                        temperature: float) -> dict[str, torch.Tensor]:
        """The outputs at the positions that predict response tokens, each against its own target (a prefix tree's
        shared position predicts a token of every row through it)."""
        if self.model.options.value_head:
            return {"values": packed.unpack(output[0, packed.src].float())}
        from verl.models import masked_vocab_logits
        from verl.ops import vocab_parallel_logprob_entropy
        logits = masked_vocab_logits(output[:, packed.src], self.model)
        lp, ent = vocab_parallel_logprob_entropy(logits, packed.targets[None], temperature, self.placement.tp)
        return {"log_probs": packed.unpack(lp[0]), "entropy": packed.unpack(ent[0])}

    @torch.no_grad()
    def _forward_micro_batches(self, batch: RolloutBatch, micro_batch_size: int, temperature: float,
                               padding_free: bool, max_tokens: int, share_prefix: bool) -> dict[str, torch.Tensor]:
        """`forward` over packed or token-budget micro-batches: [B, R] outputs from the last stage, on every rank."""
        from verl.models.forward import _broadcast_from_last_stage, forward_backward
        mbs = self._micro_batches(batch, micro_batch_size, {}, padding_free, max_tokens, share_prefix)
        P = batch.prompt_length

        def collect(output, mb):
            out = self._response_outputs(output, mb, P, temperature)
            return output.new_zeros(()), {k: v.detach().float() for k, v in out.items()}
        outs = forward_backward(self.model, mbs, collect, forward_only=True)
        keys = ["values"] if self.model.options.value_head else ["log_probs", "entropy"]
        tensors = ([torch.cat([o[k] for o in outs]) for k in keys] if self.placement.is_last_stage else None)
        shape = tuple(batch.response_mask.shape)
        tensors = _broadcast_from_last_stage(self.model, tensors, [shape] * len(keys))
        mask = batch.response_mask.to(tensors[0].device)
        return {k: t * mask for k, t in zip(keys, tensors)}

    @torch.no_grad()
    def forward(self, batch: RolloutBatch, micro_batch_size: int, *, temperature: float = 1.0,
                padding_free: bool = False, max_tokens: int = 0, share_prefix: bool = False) -> dict[str, torch.Tensor]:
        """Response-token outputs [B, R] on every rank (0 on padding): log-probs and entropy, or values."""
        from verl.models import compute_log_probs, compute_values
        batch.check_token_ids(self.model.arch.vocab_size, "MegatronEngine.forward")
        if padding_free or max_tokens > 0 or self._checked_routes(batch) is not None:
            return self._forward_micro_batches(batch, micro_batch_size, temperature, padding_free, max_tokens,
                                               share_prefix)
        micro = _micro_size(len(batch), micro_batch_size)
        P, mask = batch.prompt_length, batch.response_mask
        if self.model.options.value_head:
            values = compute_values(self.model, batch.input_ids, batch.attention_mask, micro_batch_size=micro)
            return {"values": values[:, P - 1:-1] * mask}
        out = compute_log_probs(self.model, batch.input_ids, batch.attention_mask, temperature=temperature,
                                micro_batch_size=micro)
        return {"log_probs": out["log_probs"][:, P - 1:-1] * mask, "entropy": out["entropy"][:, P - 1:-1] * mask}

    def train_step(self, batch: RolloutBatch, micro_batch_size: int, loss_fn: MicroLossFn,
                   extra: dict[str, torch.Tensor], *, temperature: float = 1.0, padding_free: bool = False,
                   max_tokens: int = 0, share_prefix: bool = False) -> tuple[list[dict], OptimizerStep]:
        """Forward/backward of the micro-batches through megatron's schedule, then one optimizer step, skipped on
        every rank when the loss or the gradient norm is not finite on any (`apply_update`). Returns each
        micro-batch's statistics (on every rank) and what the step did."""
        from verl.models.optimizer import accumulate_grads, apply_update
        batch.check_token_ids(self.model.arch.vocab_size, "MegatronEngine.train_step")
        mbs = self._micro_batches(batch, micro_batch_size, extra, padding_free, max_tokens, share_prefix)
        n, P = len(mbs), batch.prompt_length
        head = getattr(loss_fn, "fused_head", None) if self.supports_fused_head else None
        losses = []

        def megatron_loss(output, mb):
            out = (self._response_outputs(output, mb, P, temperature) if head is None
                   else self._fused_head_outputs(head, output, mb, P, temperature))
            loss, stats = loss_fn(out, mb)
            losses.append(loss.detach().clone())
            # megatron's schedule divides each micro-batch loss by their number; the aggregation already makes
            # the micro-batch losses sum to the step's loss
            return loss * n, {k: v.detach().clone() for k, v in stats.items()}
        gpt = self.model.gpt
        swap = head is not None and self.placement.is_last_stage
        self._output_layer = gpt.output_layer if swap else None
        if swap:  # the last stage hands back hidden states; restored right after the schedule
            gpt.output_layer = _HiddenOutput(self.placement.sequence_parallel)
        try:
            outs = accumulate_grads(self.model, mbs, megatron_loss)
        finally:
            if swap:
                gpt.output_layer, self._output_layer = self._output_layer, None
        update = apply_update(self.model, self.opt, [], losses=losses)
        per_micro = [{k: float(v) for k, v in o.items()} for o in outs]
        return self._last_stage_objects(per_micro), OptimizerStep(update["grad_norm"], update["nonfinite"])

    def _last_stage_objects(self, obj):
        p = self.placement
        if p.pp_size == 1:
            return obj
        box = [obj if p.is_last_stage else None]
        dist.broadcast_object_list(box, src=p.pp_global_ranks[-1], group=p.pp)
        return box[0]

    def take_metrics(self) -> dict[str, float]:
        """moe/router_mismatch_frac, moe/expert_load_max_over_mean, moe/aux_loss since the last call (an MoE policy;
        {} otherwise). Collective over the data-parallel group (and TP under sequence parallelism)."""
        if self.model.arch.moe is None:
            return {}
        from verl.models.moe import route_stats
        p = self.placement
        return route_stats(self.model.gpt, [p.dp, p.tp if p.sequence_parallel else None])

    def from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor a loss function filled on the last pipeline stage, on every stage."""
        p = self.placement
        if p.pp_size > 1:
            dist.broadcast(t, src=p.pp_global_ranks[-1], group=p.pp)
        return t

    def aggregation(self, mode: str, mask: torch.Tensor, norm_len: int) -> Aggregation:
        """Counts over the data-parallel group (TP / PP peers hold the same batch)."""
        p = self.placement
        return count_aggregation(mode, mask, norm_len, p.dp, p.dp_size)

    @property
    def lr(self) -> float:
        return self.opt.optimizer.param_groups[0]["lr"] if self.opt else 0.0

    @property
    def scheduler(self):
        return self.opt.scheduler if self.opt is not None else None

    # -- checkpoints ----------------------------------------------------------------------------------------
    def dcp_state(self, for_load: bool = False) -> dict:
        """This rank's part of the trainer's DCP checkpoint, under a rank-unique key (TP/PP shards share
        parameter names, so plain names would be de-duplicated across ranks): the model shard as DCP tensors
        (the live ones: DCP reads them on save and loads into them in place), the optimizer and LR schedule as
        one opaque blob (their tensors only exist after the first step, and DCP loads tensors into existing
        ones). The blob is `bytes` (a torch.save of tensors and plain values, read back with weights_only=True);
        `for_load` leaves it empty: DCP replaces it with the saved one."""
        from verl.models.optimizer import model_tensors, optimizer_state
        state = {"model": model_tensors(self.model)}
        if self.opt is not None:
            blob = io.BytesIO()
            if not for_load:
                torch.save(optimizer_state(self.model, self.opt), blob)
            state["train_state"] = blob.getvalue()
        return {f"rank{self.placement.rank:05d}": state}

    def load_dcp_state(self, state: dict, source: str) -> None:
        """Restores what `dcp_state` saved (DCP has filled the tensors and hands the blob back as bytes)."""
        mine = state[f"rank{self.placement.rank:05d}"]
        if self.opt is None:
            self.model.gpt.load_state_dict(mine["model"], strict=False)
            return
        from verl.models.optimizer import read_plain_state, restore_training_state
        saved = read_plain_state(io.BytesIO(mine["train_state"]), f"{source} (rank {self.placement.rank})")
        restore_training_state(self.model, self.opt, {"model": mine["model"], **saved}, source)

    # -- weights --------------------------------------------------------------------------------------------
    def local_params(self) -> dict[str, torch.Tensor]:
        """This rank's training shards by canonical (global-layer) name: the live tensors, only read."""
        from verl.hybrid_engine.megatron import megatron_local_params
        return megatron_local_params(self.model)

    def hybrid_engine(self, config):
        """The 3D-HybridEngine planned from every rank's shard metadata (collective)."""
        from verl.hybrid_engine.megatron import hybrid_engine_for
        return hybrid_engine_for(self.model, config)

    def full_gather_weights(self) -> dict[str, torch.Tensor]:
        """The transfer the 3D-HybridEngine replaced, kept to compare against (rollout.compare_full_gather):
        the whole model gathered to the replica's first rank, then every tensor broadcast over the
        model-parallel group, so every rank holds every weight whole (collective)."""
        from verl.models.checkpoint import gather_hf_state_dict
        from verl.models.layout import hf_tensor_shapes
        p = self.placement
        full = gather_hf_state_dict(self.model)
        # experts are spread over the data-parallel ranks (EP): only rank 0 then holds the whole model
        src, group = (0, None) if p.ep_size > 1 else (p.rank_of(0, p.dp_rank, 0), p.mp)
        out = {}
        for name, shape in sorted(hf_tensor_shapes(self.model.arch).items()):
            dtype = self.model.gpt.config.params_dtype
            t = full[name].contiguous() if full is not None else torch.empty(shape, dtype=dtype)
            if p.ep_size > 1 or p.tp_size * p.pp_size > 1:
                dist.broadcast(t, src=src, group=group)
            out[name] = t
        return out

    def export_hf(self, path: Path, tokenizer=None) -> None:
        """Writes the model as a Hugging Face directory (collective: gathers the shards to one writer)."""
        from verl.models import export_hf_checkpoint
        export_hf_checkpoint(self.model, path, tokenizer=tokenizer)
