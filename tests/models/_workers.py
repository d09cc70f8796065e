"""Rank bodies for the megatron model tests (module-level so that spawn can pickle them)."""

from __future__ import annotations

import torch


def _tokenizer_or_none(path):
    from pathlib import Path
    if not (Path(path) / "tokenizer.json").exists():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def _build(path, tp, pp, sp, value_head=False, recompute=False):
    from transformers import AutoConfig

    from verl.distributed import init_process_groups
    from verl.models import BuildOptions, build_gpt, load_hf_checkpoint
    pg = init_process_groups(tp=tp, pp=pp, sequence_parallel=sp)
    model = build_gpt(AutoConfig.from_pretrained(str(path)), pg, BuildOptions(value_head=value_head,
                                                                                 recompute=recompute))
    info = load_hf_checkpoint(model, path)
    return model, info


def _hf_grad_names(model, grads_by_local):
    from verl.models import gather_hf_state_dict
    return gather_hf_state_dict(model, grads_by_local)


def _files_equal(a, b) -> bool:
    """Every tensor in HF checkpoint dir `a` equals (bitwise) the one in `b`, and both have the same names."""
    from pathlib import Path

    from safetensors.torch import load_file

    def load(d):
        out = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out
    ta, tb = load(a), load(b)
    return set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) and ta[k].dtype == tb[k].dtype for k in ta)


def layout_case(path, out_dir, tp, pp, sp, batch, ref, steps, lr, *, dist_opt: bool, check_resume: bool = False,
                recompute: bool = False):
    """Everything one layout must reproduce: logits, loss, grads (HF names), export, optimizer steps."""
    import torch.distributed as dist

    from verl.distributed import destroy_process_groups
    from verl.models import (causal_lm_loss, compute_log_probs, compute_logits, export_hf_checkpoint,
                             make_micro_batches)
    from verl.config import OptimConfig
    from verl.models.optimizer import (accumulate_grads, apply_update, build_optimizer, load_training_state,
                                       save_training_state, train_step)
    ids, mask = batch
    mbs = make_micro_batches(ids, mask, 1)
    res = {}
    model, info = _build(path, tp, pp, sp, recompute=recompute)
    res["bytes_read"] = {dist.get_rank(): info["bytes_read"]}
    res["groups"] = {dist.get_rank(): (model.pg.tp_rank, model.pg.pp_rank, model.pg.dp_rank, model.pg.tp_size,
                                       model.pg.pp_size, model.pg.dp_size)}
    logits = compute_logits(model, ids, mask, micro_batch_size=1)
    res["logit_diff"] = float(((logits - ref["logits"]).abs() * mask[..., None]).max())
    lp = compute_log_probs(model, ids, mask, temperature=0.7, micro_batch_size=1)
    m = lp["token_mask"]
    res["logprob_diff"] = float(((lp["log_probs"] - ref["log_probs_t07"]).abs() * m).max())
    res["entropy_diff"] = float(((lp["entropy"] - ref["entropy_t07"]).abs() * m).max())
    tag = f"tp{tp}_pp{pp}_sp{int(sp)}"
    written = export_hf_checkpoint(model, f"{out_dir}/{tag}", tokenizer=_tokenizer_or_none(path))
    if written is not None:
        res["export_exact"] = _files_equal(path, written)
        res["export_dir"] = str(written)
    dp = dist.get_world_size() // (tp * pp)
    sharded = dist_opt and dp > 1

    def check_grads(outs):
        if outs:
            res["loss"] = sum(float(o["loss"]) for o in outs) / len(outs)
        hf_grads = _hf_grad_names(model, {n: p.main_grad for n, p in model.gpt.named_parameters()})
        if hf_grads is not None:
            res["grad_diff"] = max(float((hf_grads[k] - ref["grads"][k]).abs().max()) for k in ref["grads"])
            res["grad_names_match"] = set(hf_grads) == set(ref["grads"])

    if sharded:
        # The distributed optimizer leaves only this rank's DP shard of each grad reduced, so grads are
        # compared on a plain-DDP build first.
        build_optimizer(model, OptimConfig(lr=lr, grad_clip=0.0))
        check_grads(accumulate_grads(model, mbs, causal_lm_loss(model)))
        destroy_process_groups()
        model, _ = _build(path, tp, pp, sp, recompute=recompute)
    opt = build_optimizer(model, OptimConfig(lr=lr, grad_clip=1.0), use_distributed_optimizer=sharded)
    losses = []
    for step in range(steps):
        if check_resume and step == steps - 1:
            save_training_state(model, opt, f"{out_dir}/state_{tag}")
        outs = accumulate_grads(model, mbs, causal_lm_loss(model))
        if step == 0 and not sharded:
            check_grads(outs)
        losses.append(apply_update(model, opt, outs)["loss"])
    res["step_losses"] = losses
    res["dist_opt"] = sharded
    if check_resume:
        # One more step after the saved point depends on the restored Adam moments and LR schedule, not
        # only on the weights.
        res["continued_loss"] = train_step(model, opt, mbs, causal_lm_loss(model))["loss"]
        load_training_state(model, opt, f"{out_dir}/state_{tag}")
        res["resumed_last_loss"] = train_step(model, opt, mbs, causal_lm_loss(model))["loss"]
        res["resumed_continued_loss"] = train_step(model, opt, mbs, causal_lm_loss(model))["loss"]
    destroy_process_groups()
    return res


def value_case(path, out_dir, tp, pp, sp, batch, ref):
    """Critic: value head over a causal-LM checkpoint (fresh head), values vs transformers' token classifier."""
    from verl.distributed import destroy_process_groups
    from verl.models import compute_values, export_hf_checkpoint, make_micro_batches, value_mse_loss
    from verl.config import OptimConfig
    from verl.models.optimizer import build_optimizer, train_step
    ids, mask = batch
    model, info = _build(path, tp, pp, sp, value_head=True)
    res = {"missing": info["missing"]}
    written = export_hf_checkpoint(model, f"{out_dir}/value_tp{tp}_pp{pp}_sp{int(sp)}")
    res["values"] = compute_values(model, ids, mask, micro_batch_size=1)
    if written is not None:
        res["export_dir"] = str(written)
    returns = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OptimConfig(lr=1e-2, grad_clip=1.0))
    mbs = make_micro_batches(ids, mask, 1, returns=returns)
    res["value_losses"] = [train_step(model, opt, mbs, value_mse_loss())["value_loss"] for _ in range(3)]
    destroy_process_groups()
    return res


def matrix_body(rank, world_size, jobs):
    """Runs every (checkpoint, layouts) job in one set of processes (spawning is the expensive part)."""
    out = []
    for job in jobs:
        if job.get("kind") == "value":
            for tp, pp, sp in job["layouts"]:
                r = value_case(job["path"], job["out_dir"], tp, pp, sp, job["batch"], job["ref"])
                out.append({"case": job["name"], "layout": (tp, pp, sp), **r})
            continue
        for tp, pp, sp in job["layouts"]:
            r = layout_case(job["path"], job["out_dir"], tp, pp, sp, job["batch"], job["ref"], job["steps"],
                            job["lr"], dist_opt=job.get("dist_opt", False), recompute=job.get("recompute", False),
                            check_resume=(tp, pp, sp) in job.get("resume_layouts", ()))
            out.append({"case": job["name"], "layout": (tp, pp, sp), **r})
    return out
