"""megatron-core's optimizer (optionally the distributed one) with grad clipping and an LR schedule.

    opt = build_optimizer(model, OptimConfig(lr=1e-5, grad_clip=1.0), total_steps=100, use_distributed_optimizer=True)
    stats = train_step(model, opt, micro_batches, causal_lm_loss(model))   # {'loss':..., 'grad_norm':..., 'lr':...}
    save_training_state(model, opt, dir); load_training_state(model, opt, dir)

`build_optimizer` wraps `model.module` in megatron's DistributedDataParallel (contiguous grad buffers,
DP all-reduce or reduce-scatter, SP layer-norm and tied-embedding grad sync in `finalize_model_grads`).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from verl.config.ppo import OptimConfig
from verl.errors import VerlConfigError
from verl.models.forward import LossFn, forward_backward
from verl.models.gpt import MegatronGPT
from verl.utils.lr_schedule import LRSchedule
from verl.utils.nonfinite import agree_nonfinite, local_problem


@dataclass(kw_only=True, slots=True)
class Optimizer:
    """The megatron optimizer and its LR scheduler."""

    optimizer: object
    """megatron.core.optimizer.MegatronOptimizer."""
    scheduler: object
    """verl.utils.lr_schedule.LRSchedule: the one schedule every engine follows."""
    config: OptimConfig
    """What it was built from."""
    use_distributed_optimizer: bool = False
    """Whether optimizer state is sharded over data-parallel ranks (ZeRO-1)."""


def build_optimizer(model: MegatronGPT, config: OptimConfig | None = None, *, total_steps: int = 1000,
                    use_distributed_optimizer: bool = False, grad_reduce_in_fp32: bool = True) -> Optimizer:
    """Wraps the model in megatron DDP (once) and builds Adam + scheduler over its parameters.

    `total_steps` is the length of the LR schedule (warm-up included); `use_distributed_optimizer` shards
    optimizer state and fp32 master params over data-parallel ranks (ZeRO-1); `grad_reduce_in_fp32`
    accumulates and reduces gradients in fp32 (matters for bf16 params).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    config = config or OptimConfig()
    total_steps = max(total_steps, config.warmup_steps + 1)
    gpt = model.gpt
    tcfg = gpt.config
    if not isinstance(model.module, DistributedDataParallel):
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
                                                use_distributed_optimizer=use_distributed_optimizer)
        model.module = DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=gpt)
        # The schedule calls these hooks: DP/SP/embedding grad sync after the last micro-batch.
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.no_sync_func = model.module.no_sync
    ocfg = OptimizerConfig(optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
                           adam_beta1=config.betas[0], adam_beta2=config.betas[1], adam_eps=config.eps,
                           clip_grad=config.grad_clip, bf16=tcfg.bf16, fp16=tcfg.fp16,
                           params_dtype=tcfg.params_dtype, use_distributed_optimizer=use_distributed_optimizer)
    opt = get_megatron_optimizer(ocfg, [model.module])
    sched = LRSchedule(opt, config, total_steps)  # the torch engines' schedule (weight decay stays constant)
    return Optimizer(optimizer=opt, scheduler=sched, config=config, use_distributed_optimizer=use_distributed_optimizer)


def accumulate_grads(model: MegatronGPT, micro_batches, loss_fn: LossFn) -> list[dict]:
    """Zeroes the grad buffers and runs forward/backward over the micro-batches (grads synced over DP/SP/PP
    tied embeddings by megatron at the end). Returns the last stage's per-micro-batch metrics."""
    model.module.zero_grad_buffer()
    return forward_backward(model, micro_batches, loss_fn, forward_only=False)


def apply_update(model: MegatronGPT, opt: Optimizer, outs: list[dict], *, losses: Sequence[torch.Tensor] = ()) -> dict:
    """Clips, steps the optimizer, advances the LR schedule; returns mean metrics + grad_norm, lr, update_applied
    and nonfinite.

    A step whose gradient norm, or whose loss on some rank (`losses`: this rank's micro-batch losses, on the last
    pipeline stage), is not finite is skipped on every rank of the model (they agree over its
    model-parallel group, then its data-parallel group): the gradients are zeroed and neither the optimizer nor
    the schedule steps; `nonfinite` then names the first non-finite quantity and its rank (None when applied).
    An fp16 loss-scale overflow is megatron's own skip (its scaler backs off) and is not reported as one.
    Metrics are averaged over micro-batches on the last stage and broadcast over PP, so every rank gets them.
    """
    inner = opt.optimizer
    # megatron's optimizer.step() in its parts, so that the decision to step can wait for every rank's verdict
    overflow = inner.prepare_grads()
    grad_norm, problem = float("nan"), None
    if not overflow:
        grad_norm = float(inner.get_grad_norm())
        grads = ((n, getattr(p, "main_grad", p.grad)) for n, p in model.gpt.named_parameters())
        problem = agree_nonfinite(local_problem(losses, grad_norm, grads), model.pg.global_rank,
                                  [model.pg.mp, model.pg.dp])
    ok = not overflow and problem is None
    lr = inner.param_groups[0]["lr"]
    if ok:
        if opt.config.grad_clip > 0:
            _clip_grads(inner, grad_norm, opt.config.grad_clip)
        inner.step_with_ready_grads()
        opt.scheduler.step()
    else:
        model.module.zero_grad_buffer()
    inner.zero_grad()
    metrics = _mean_metrics(model, outs)
    metrics.update(grad_norm=grad_norm, lr=float(lr), update_applied=ok, nonfinite=problem)
    return metrics


def _clip_grads(inner, grad_norm: float, clip: float) -> None:
    """Scales every sub-optimizer's main gradients by clip / grad_norm when that is below 1 (as megatron's own
    step does with the norm it computed)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    for sub in getattr(inner, "chained_optimizers", [inner]):
        params = [] if getattr(sub, "is_stub_optimizer", False) else sub.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=grad_norm,
                                         use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def train_step(model: MegatronGPT, opt: Optimizer, micro_batches, loss_fn: LossFn) -> dict:
    """One optimizer step over the micro-batches: `accumulate_grads` then `apply_update`."""
    return apply_update(model, opt, accumulate_grads(model, micro_batches, loss_fn))


def _mean_metrics(model: MegatronGPT, outs: list[dict]) -> dict:
    pg = model.pg
    keys = sorted(k for k in (outs[0] if outs else {}) if torch.is_tensor(outs[0][k]) and outs[0][k].numel() == 1)
    names: list = [keys]
    if pg.pp_size > 1:
        dist.broadcast_object_list(names, src=pg.pp_global_ranks[-1], group=pg.pp)
    keys = names[0]
    vals = torch.tensor([sum(float(o[k]) for o in outs) / len(outs) for k in keys] if pg.is_last_stage
                        else [0.0] * len(keys), dtype=torch.float64, device=model.device)
    if pg.pp_size > 1 and keys:
        dist.broadcast(vals, src=pg.pp_global_ranks[-1], group=pg.pp)
    return dict(zip(keys, vals.cpu().tolist(), strict=False))


def model_tensors(model: MegatronGPT) -> dict[str, torch.Tensor]:
    """This rank's model shard: the state-dict tensors (sharing storage with the parameters)."""
    return {k: v for k, v in model.gpt.state_dict().items() if torch.is_tensor(v)}


def optimizer_state(model: MegatronGPT, opt: Optimizer) -> dict:
    """This rank's optimizer state (incl. the distributed optimizer's DP shard), LR schedule and the
    (tp, pp, dp) layout: everything of `training_state` but the model."""
    opt_state = opt.optimizer.state_dict()
    if opt.use_distributed_optimizer:
        # The distributed optimizer keeps Adam moments in DP-sharded buffers outside state_dict().
        opt_state = {"base": opt_state, "param_state": _dist_opt_param_state(opt)}
    return {"optimizer": opt_state, "scheduler": opt.scheduler.state_dict(),
            "layout": (model.pg.tp_size, model.pg.pp_size, model.pg.dp_size)}


def training_state(model: MegatronGPT, opt: Optimizer) -> dict:
    """This rank's model shard (copied), optimizer state, LR schedule and layout, as one dict (what
    `save_training_state` writes)."""
    return {"model": {k: v.detach().clone() for k, v in model_tensors(model).items()},
            **optimizer_state(model, opt)}


def restore_training_state(model: MegatronGPT, opt: Optimizer, state: dict, source: str) -> None:
    """Restores a `training_state` dict (same layout required; `source` names where it came from)."""
    layout = (model.pg.tp_size, model.pg.pp_size, model.pg.dp_size)
    if tuple(state["layout"]) != layout:
        raise VerlConfigError(f"training state in {source} was saved with (tp, pp, dp)={tuple(state['layout'])}, "
                              f"this run has {layout}; resume with the same layout or export/load HF weights")
    missing, unexpected = model.gpt.load_state_dict(state["model"], strict=False)
    real_missing = [k for k in missing if not k.endswith("_extra_state")]
    if real_missing or unexpected:
        raise VerlConfigError(f"training state does not fit the model: missing {real_missing}, unexpected {unexpected}")
    if opt.use_distributed_optimizer:
        opt.optimizer.load_state_dict(state["optimizer"]["base"])
        _load_dist_opt_param_state(opt, state["optimizer"]["param_state"])
    else:
        opt.optimizer.load_state_dict(state["optimizer"])
    # Master params (fp32 copies) must follow the restored model weights.
    opt.optimizer.reload_model_params()
    opt.scheduler.load_state_dict(state["scheduler"])


def save_training_state(model: MegatronGPT, opt: Optimizer, directory: str | Path) -> Path:
    """Saves `training_state` to `directory/rank_XXXXX.pt` (collective; resume with the same TP/PP/DP layout)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank_{dist.get_rank() if dist.is_initialized() else 0:05d}.pt"
    torch.save(training_state(model, opt), path)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_training_state(model: MegatronGPT, opt: Optimizer, directory: str | Path) -> None:
    """Restores what `save_training_state` wrote (same layout required)."""
    path = Path(directory) / f"rank_{dist.get_rank() if dist.is_initialized() else 0:05d}.pt"
    if not path.exists():
        raise VerlConfigError(f"no training state for this rank at {path}")
    restore_training_state(model, opt, read_plain_state(path, str(path)), str(directory))


def read_plain_state(f, source: str) -> dict:
    """A `torch.save`d dict of tensors and plain values (file path or stream), unpickled with weights_only=True:
    anything else in it (an object whose unpickling could run code) is refused with the `source` named."""
    try:
        return torch.load(f, weights_only=True)
    except pickle.UnpicklingError as e:
        raise VerlConfigError(f"training state in {source} holds more than tensors and plain values; refused, since "
                              f"unpickling it could run code ({str(e).splitlines()[0]})") from e


def _dist_opt_param_state(opt: Optimizer) -> dict:
    inner = opt.optimizer
    out = {}
    for gi, group in enumerate(inner.optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            st = inner.optimizer.state.get(p, {})
            out[(gi, pi)] = {"param": p.detach().clone(),
                             **{k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()}}
    return out


def _load_dist_opt_param_state(opt: Optimizer, saved: dict) -> None:
    inner = opt.optimizer
    with torch.no_grad():
        for gi, group in enumerate(inner.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                entry = saved[(gi, pi)]
                p.copy_(entry["param"])
                inner.optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                                            for k, v in entry.items() if k != "param"}
