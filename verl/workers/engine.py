"""The plain-torch training engine: one Hugging Face model replica per rank, gradients averaged over ranks
(data parallel with explicit all-reduce, so it runs on gloo as well as NCCL), AdamW with the OptimConfig's
warm-up + decay schedule and global-norm clipping.

Every training engine (this one, `verl.workers.fsdp.FSDPEngine`, `verl.workers.megatron.MegatronEngine`) offers
the same calls, which is all the actor and critic workers use:

    engine.forward(batch, micro_batch_size, temperature=T)   # no grad: {"log_probs", "entropy"} or {"values"}, [B, R]
    engine.train_step(batch, micro_batch_size, loss_fn, extra, temperature=T)   # (stats, OptimizerStep)
        # both also take padding_free=True (packed micro-batches) and max_tokens=N (micro-batches cut by a
        # budget of real tokens instead of micro_batch_size rows): verl/workers/packing.py
    engine.aggregation(mode, mask, norm_len)                 # the step's global token / sequence counts
    engine.hybrid_engine(config), engine.local_params()      # how its weights reach the rollout engine

An optimizer step whose loss or gradient norm is not finite on any of the engine's ranks is skipped on all of
them (verl.utils.nonfinite): the gradients are zeroed, the weights, optimizer state and LR schedule stay as they
were, and `OptimizerStep.nonfinite` says what was not finite, where.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from verl.config.ppo import OptimConfig
from verl.distributed import Placement
from verl.ops.logprob import lm_head_logprob_entropy, logprob_entropy
from verl.ops.losses import Aggregation
from verl.utils.lr_schedule import LRSchedule
from verl.utils.nonfinite import agree_nonfinite, first_nonfinite_grad, local_problem
from verl.utils.state_check import MAX_STEP, Bool, Dict, Each, Float, Int, Json, List, Opt, StateError, Str
from verl.workers.batch import MicroLossFn, RolloutBatch
from verl.workers.packing import (PackedBatch, TreeCounts, micro_batch_slices, pack, pack_tree, packed_attention)

__all__ = ["BaseModelView", "ModuleEngine", "OptimizerStep", "TorchEngine", "build_optimizer", "count_aggregation",
           "head_outputs", "packed_head_outputs"]


class OptimizerStep(NamedTuple):
    """What one optimizer step of an engine did (the same on every rank of the engine)."""

    grad_norm: float
    """Global gradient norm before clipping (NaN or inf when the step was skipped for it)."""
    nonfinite: str | None = None
    """None: the step was applied. Otherwise it was skipped on every rank, and this names the first non-finite
    quantity (a micro-batch's loss, a parameter's gradient, or the norm) and the rank that found it."""


def count_aggregation(mode: str, mask: torch.Tensor, norm_len: int, group, dp_size: int) -> Aggregation:
    """Aggregation over one optimizer step's tokens on all `group` ranks, so micro-batch losses add up (and DP
    gradient averaging cancels) to exactly the loss of the whole mini-batch."""
    from verl.distributed.placement import comm_device
    counts = torch.tensor([float(mask.sum()), float((mask.sum(-1) > 0).sum())], dtype=torch.float64,
                          device=comm_device())
    if dp_size > 1:
        dist.all_reduce(counts, group=group)
    return Aggregation(mode=mode, global_tokens=float(counts[0]), global_seqs=float(counts[1]), dp_size=dp_size,
                       norm_len=float(norm_len))


def logit_head(config) -> tuple[float, float | None]:
    """(scale, soft-cap) a family's CausalLM.forward applies to the LM head's logits (the base model never
    does): Cohere multiplies by `logit_scale`, Granite divides by `logits_scaling`, Gemma 2/3 soft-cap with
    cap·tanh(logits / cap). A scale folds into the temperature (so the fused LM head still applies); a cap
    needs the logits."""
    scale = float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)
    return scale, getattr(config, "final_logit_softcapping", None) or None


def head_outputs(module: torch.nn.Module, head: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, responses: torch.Tensor, prompt_length: int,
                 temperature: float, loss_head=None) -> dict[str, torch.Tensor]:
    """Response-position outputs [b, R] of a causal LM ("lm": log-probs and entropy) or a `ValueModel` ("value").
    `loss_head(hidden [b, R, H], weight [V, H], responses, temperature)`: a fused loss head (actor.fused_loss_head)
    run in place of the LM head when the head can be fused (no bias, no logit soft-cap); its dict is returned."""
    P = prompt_length
    if head == "value":
        values = module(input_ids, attention_mask, position_ids)
        return {"values": values[:, P - 1:-1]}
    hidden = module.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
    # only the R positions that predict response tokens go through the (fused) LM head
    scale, cap = logit_head(getattr(module, "config", None))
    lm_head = module.get_output_embeddings()
    if loss_head is not None and cap is None and getattr(lm_head, "bias", None) is None:
        return loss_head(hidden[:, P - 1:-1], lm_head.weight, responses, temperature / scale)
    if cap is not None:
        logits = lm_head(hidden[:, P - 1:-1]).float()
        lp, ent = logprob_entropy(torch.tanh(logits / cap) * cap, responses, temperature / scale)
    else:
        lp, ent = lm_head_logprob_entropy(hidden[:, P - 1:-1], lm_head, responses, temperature / scale)
    return {"log_probs": lp, "entropy": ent}


def packed_head_outputs(module: torch.nn.Module, head: str, packed: PackedBatch,
                        temperature: float, loss_head=None) -> dict[str, torch.Tensor]:
    """`head_outputs` of a packed micro-batch (verl/workers/packing.py): one row of real tokens, attention kept
    within its sequences (`packed_attention`), only the positions that predict response tokens through the head;
    scattered back to [b, R]."""
    with packed_attention(module, packed) as attention:
        if head == "value":
            values = module(packed.input_ids, position_ids=packed.position_ids, **attention)
            return {"values": packed.unpack(values[0, packed.src])}
        hidden = module.base_model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                                   **attention).last_hidden_state[0, packed.src]
    scale, cap = logit_head(getattr(module, "config", None))
    lm_head = module.get_output_embeddings()
    if loss_head is not None and cap is None and getattr(lm_head, "bias", None) is None:
        # the fused loss head reads the padded [b, R] layout its fields have; padding rows are masked out of it
        return loss_head(packed.unpack(hidden), lm_head.weight, packed.unpack(packed.targets), temperature / scale)
    targets = packed.targets[None]
    if cap is not None:
        logits = lm_head(hidden[None]).float()
        lp, ent = logprob_entropy(torch.tanh(logits / cap) * cap, targets, temperature / scale)
    else:
        lp, ent = lm_head_logprob_entropy(hidden[None], lm_head, targets, temperature / scale)
    return {"log_probs": packed.unpack(lp[0]), "entropy": packed.unpack(ent[0])}


def _scalar_or_list(value, where: str) -> None:
    """A scheduler state key this verl does not know (torch adds some across versions): JSON scalars only."""
    items = value if isinstance(value, list) else [value]
    if len(items) > 1 << 16 or not all(v is None or isinstance(v, (bool, str)) or (isinstance(v, (int, float))
                                       and math.isfinite(v)) for v in items):
        raise StateError(where, f"{str(value)[:60]}: must be a finite number, a string, true/false or a list of them")


_STEPS, _RATE = Int(0, MAX_STEP), Float(0.0)
SCHEDULER_STATE = Dict(
    {"last_epoch": Int(-1, MAX_STEP), "_step_count": _STEPS, "base_lrs": List(_RATE), "_last_lr": List(_RATE),
     "lr_lambdas": List(Opt(Dict({}, extra=Json()))), "verbose": Bool(), "_is_initial": Bool(),
     "_get_lr_called_within_step": Bool(),
     # megatron-core's OptimizerParamScheduler
     "max_lr": _RATE, "min_lr": _RATE, "num_steps": _STEPS, "lr_warmup_steps": _STEPS, "lr_decay_steps": _STEPS,
     "lr_decay_style": Str(32), "start_wd": _RATE, "end_wd": _RATE, "wd_incr_style": Str(32), "wd_incr_steps": _STEPS},
    optional=("last_epoch", "_step_count", "base_lrs", "_last_lr", "lr_lambdas", "verbose", "_is_initial",
              "_get_lr_called_within_step", "max_lr", "min_lr", "num_steps", "lr_warmup_steps", "lr_decay_steps",
              "lr_decay_style", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"),
    extra=Each(_scalar_or_list))
"""What a restored LR scheduler state (torch's LambdaLR or megatron's) may hold, checked before it is loaded."""


def build_optimizer(module: torch.nn.Module, optim: OptimConfig, total_steps: int):
    """(AdamW over the trainable parameters, its `LRSchedule` following `optim.lr_factor`)."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                  weight_decay=optim.weight_decay, foreach=False)
    return optimizer, LRSchedule(optimizer, optim, total_steps)


class ModuleEngine:
    """What the torch-module engines share: micro-batched forward / train step, the optimizer step with
    global-norm clipping, aggregation counts over the data-parallel group, and the weights' way to the rollout
    engine. Subclasses set `module` (HF names), `placement`, `head`, `optim_cfg`, `optimizer`, `scheduler`, and
    give `_forward` and `_reduce_grads`."""

    module: torch.nn.Module
    placement: Placement
    head: str
    optim_cfg: OptimConfig | None
    optimizer: torch.optim.Optimizer | None = None
    scheduler = None
    supports_fused_head = True
    """train_step runs a loss function's `fused_head` (actor.fused_loss_head) in place of the LM head."""
    @functools.cached_property
    def tree_counts(self) -> TreeCounts:
        """What the prefix trees of its passes computed (share_prefix), until a worker takes them."""
        return TreeCounts()

    sync_view = "all"
    """What the weight sync moves (verl.models.lora.SYNC_VIEWS): every weight, or with LoRA the adapters only
    ("adapter") or the merged weights ("merged")."""

    def _forward(self, mb: RolloutBatch, temperature: float, packed: PackedBatch | None = None,
                 loss_head=None) -> dict[str, torch.Tensor]:
        """[b, R] outputs of one micro-batch: padded, or from its `packed` form when given; with `loss_head` (the
        fused loss head, actor.fused_loss_head) its dict in place of the LM head's."""
        raise NotImplementedError

    def _reduce_grads(self) -> str | None:
        """Makes every rank's gradients the data-parallel mean (before clipping). Returns this rank's own first
        non-finite gradient, described, where the engine sees it before the reduction spreads it (else None)."""
        raise NotImplementedError

    def _gradient_sync(self, last_micro_batch: bool) -> None:
        """Called before each micro-batch's backward: engines that reduce in backward skip all but the last."""

    # -- forward --------------------------------------------------------------------------------------------
    def _micro_batches(self, batch: RolloutBatch, micro_batch_size: int, max_tokens: int, padding_free: bool,
                       share_prefix: bool = False):
        """(row slice, micro-batch, its packed form or None) per micro-batch (verl/workers/packing.py);
        share_prefix: the rows' shared prefixes computed once (`pack_tree`; counted in `tree_counts`)."""
        group = self.placement.dp if self.placement.distributed else None
        tree = self.tree_counts if share_prefix and padding_free else None
        for sl in micro_batch_slices(batch, micro_batch_size, max_tokens, group, tree=tree):
            mb = batch.select(sl)
            yield sl, mb, (pack(mb) if tree is None else pack_tree(mb)) if padding_free else None

    @torch.no_grad()
    def forward(self, batch: RolloutBatch, micro_batch_size: int, *, temperature: float = 1.0,
                padding_free: bool = False, max_tokens: int = 0, share_prefix: bool = False) -> dict[str, torch.Tensor]:
        """Response-token outputs [B, R] (0 on padding): log-probs and entropy, or values."""
        batch.check_token_ids(self.vocab_size, f"{type(self).__name__}.forward")
        parts = [self._forward(mb, temperature, packed) for _, mb, packed
                 in self._micro_batches(batch, micro_batch_size, max_tokens, padding_free, share_prefix)]
        return {k: torch.cat([p[k] for p in parts]) * batch.response_mask for k in parts[0]}

    def train_step(self, batch: RolloutBatch, micro_batch_size: int, loss_fn: MicroLossFn,
                   extra: dict[str, torch.Tensor], *, temperature: float = 1.0, padding_free: bool = False,
                   max_tokens: int = 0, share_prefix: bool = False) -> tuple[list[dict], OptimizerStep]:
        """Forward/backward of every micro-batch (gradients accumulate), then one optimizer step (`step`).
        Returns each micro-batch's statistics (floats) and what the step did."""
        batch.check_token_ids(self.vocab_size, f"{type(self).__name__}.train_step")
        from verl.models.lora import adapter_dropout
        with adapter_dropout(self.module):
            stats, losses = self._accumulate(batch, micro_batch_size, loss_fn, extra, temperature, padding_free,
                                             max_tokens, share_prefix)
        return stats, self.step(losses)

    def _accumulate(self, batch, micro_batch_size, loss_fn, extra, temperature, padding_free, max_tokens,
                    share_prefix) -> tuple[list[dict], list[torch.Tensor]]:
        """Forward / backward of every micro-batch: (statistics, losses)."""
        stats, losses = [], []
        micro = list(self._micro_batches(batch, micro_batch_size, max_tokens, padding_free, share_prefix))
        for i, (sl, mb, packed) in enumerate(micro):
            self._gradient_sync(i == len(micro) - 1)
            fields = {"response_mask": mb.response_mask, **{k: v[sl] for k, v in extra.items()}}
            head = getattr(loss_fn, "fused_head", None)
            loss_head = None if head is None else functools.partial(head, fields=fields)
            loss, s = loss_fn(self._forward(mb, temperature, packed, loss_head), fields)
            loss.backward()
            losses.append(loss.detach())
            stats.append({k: float(v) for k, v in s.items()})
        return stats, losses

    @property
    def vocab_size(self) -> int | None:
        """Token ids the module embeds (its input embedding's rows)."""
        emb = self.module.get_input_embeddings() if hasattr(self.module, "get_input_embeddings") else None
        return getattr(emb, "num_embeddings", None)

    def from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor a loss function filled (on the last pipeline stage): here every rank is the last stage."""
        return t

    def aggregation(self, mode: str, mask: torch.Tensor, norm_len: int) -> Aggregation:
        p = self.placement
        return count_aggregation(mode, mask, norm_len, p.dp, p.dp_size if p.distributed else 1)

    # -- optimizer --------------------------------------------------------------------------------------------
    def step(self, losses: Sequence[torch.Tensor] = ()) -> OptimizerStep:
        """Averages gradients over the replicas, then, unless this step's loss (`losses`: this rank's micro-batch
        losses) or gradient norm is non-finite on some rank of the engine, clips and steps the optimizer and
        schedule (every rank decides alike: a one-number all-reduce over the data-parallel group). The norm is
        over the whole model (FSDP2's DTensor gradients give it across their shards)."""
        assert self.optimizer is not None, "frozen engine has no optimizer"
        own = self._reduce_grads()
        named = [(n, p) for n, p in self.module.named_parameters() if p.grad is not None]
        grads = [p.grad for _, p in named]
        total = torch.nn.utils.get_total_norm(grads, foreach=False) if grads else torch.tensor(0.0)
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        local = local_problem(losses, norm, ((n, p.grad) for n, p in named), own)
        problem = agree_nonfinite(local, self.placement.global_rank, [self.placement.dp])
        if problem is None:
            if self.optim_cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_([p for _, p in named], self.optim_cfg.grad_clip, total,
                                                     foreach=False)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return OptimizerStep(norm, problem)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    # -- weights for the rollout engine -------------------------------------------------------------------------
    def local_params(self) -> dict[str, torch.Tensor]:
        """This rank's weights by Hugging Face name (the live tensors, or FSDP2's local dim-0 chunks: views; the
        hybrid engine only reads them); with LoRA the `sync_view` of them (collective for the merged view)."""
        from verl.hybrid_engine.module import module_local_params
        if self.sync_view == "all":
            return module_local_params(self.module)
        from verl.models.lora import sync_tensors
        return sync_tensors(self.module, self.sync_view)

    def sync_layout_params(self) -> dict[str, torch.Tensor] | None:
        """The tensors the weight sync is planned from (None: every parameter)."""
        if self.sync_view == "all":
            return None
        from verl.models.lora import sync_tensors
        return sync_tensors(self.module, self.sync_view, local=False)

    @property
    def shard_group(self):
        """The group its parameters are sharded over (None: whole on every rank, or one rank)."""
        return self.placement.dp

    def hybrid_engine(self, config):
        """The 3D-HybridEngine planned for this module's data-parallel replicas (collective)."""
        from verl.hybrid_engine.module import hybrid_engine_for_module
        return hybrid_engine_for_module(self.module, config, group=self.placement.dp,
                                        params=self.sync_layout_params())


class BaseModelView:
    """The reference of a LoRA actor: the actor's own engine and module with every adapter off for the forward
    (no second copy of the weights). Offers what the reference's worker calls; holds nothing of its own (it is
    not checkpointed, and its memory is the actor's)."""

    def __init__(self, engine: ModuleEngine):
        self.view_of = engine
        self.placement = engine.placement
        self.optimizer = self.scheduler = None
        self.lr = 0.0

    def forward(self, batch: RolloutBatch, micro_batch_size: int, **kw) -> dict[str, torch.Tensor]:
        from verl.models.lora import adapters_disabled
        with adapters_disabled(self.view_of.module):
            return self.view_of.forward(batch, micro_batch_size, **kw)

    def aggregation(self, mode: str, mask: torch.Tensor, norm_len: int) -> Aggregation:
        return self.view_of.aggregation(mode, mask, norm_len)

    def from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def onload(self, device: torch.device) -> None:
        """The actor's engine holds the memory."""

    def offload(self) -> None:
        """See `onload`."""


def is_device_mapped(module: torch.nn.Module) -> bool:
    """Loaded by transformers with `device_map=...` over more than one device (accelerate's hooks move the
    activations between them); a map onto one device is an ordinary placement."""
    device_map = getattr(module, "hf_device_map", None) or {}
    return len(set(map(str, device_map.values()))) > 1


class TorchEngine(ModuleEngine):
    """Owns a module (a causal LM, or a `ValueModel` with `head="value"`) and, unless frozen, its optimizer."""

    @classmethod
    def from_role(cls, req) -> "TorchEngine":
        """The role's module on this rank (`verl.workers.request.EngineRequest`): the actor trains the policy
        in place, the reference a copy, the critic a value model on the policy's trunk."""
        engine = cls(req.module(), req.optim, req.placement, head=req.head, total_steps=req.total_steps)
        engine.sync_view = req.sync_view
        return engine

    def __init__(self, module: torch.nn.Module, optim: OptimConfig | None, placement: Placement, *,
                 head: str = "lm", total_steps: int = 1):
        # a model loaded with a device map stays where it was put (verl.trainer.ppo_trainer.check_device_map)
        self.module = module if is_device_mapped(module) else module.to(placement.device)
        self.placement, self.head, self.optim_cfg = placement, head, optim
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        if optim is None:
            self.module.requires_grad_(False)
            self.module.eval()
            return
        self.optimizer, self.scheduler = build_optimizer(self.module, optim, total_steps)
        self.broadcast_parameters()

    def _forward(self, mb: RolloutBatch, temperature: float, packed: PackedBatch | None = None,
                 loss_head=None) -> dict[str, torch.Tensor]:
        if packed is not None:
            return packed_head_outputs(self.module, self.head, packed, temperature, loss_head)
        return head_outputs(self.module, self.head, mb.input_ids, mb.attention_mask, mb.position_ids, mb.responses,
                            mb.prompt_length, temperature, loss_head)

    def broadcast_parameters(self) -> None:
        """Makes every rank of the engine start from its first rank's weights."""
        p = self.placement
        if p.distributed:
            for t in self.module.parameters():
                dist.broadcast(t.data, src=p.global_of(0), group=p.dp)

    def _reduce_grads(self) -> str | None:
        named = [(n, p.grad) for n, p in self.module.named_parameters() if p.grad is not None]
        grads = [g for _, g in named]
        if not self.placement.distributed or not grads:
            return None
        flat = torch.cat([g.reshape(-1) for g in grads])
        # the averaging would spread one rank's NaN to every rank: name the rank that produced it
        own = None if bool(torch.isfinite(flat).all()) else first_nonfinite_grad(named)
        dist.all_reduce(flat, group=self.placement.dp)
        flat /= self.placement.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return own

    # -- memory (a role with cpu_offload: the dataflow runtime calls these around the role's nodes) -----------
    def offload(self) -> None:
        """Weights and optimizer state to the CPU."""
        self._move(torch.device("cpu"))

    def onload(self, device: torch.device) -> None:
        self._move(device)

    def _move(self, device: torch.device) -> None:
        if is_device_mapped(self.module):
            return
        self.module.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = v.to(device)
