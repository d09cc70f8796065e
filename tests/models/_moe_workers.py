"""Rank bodies of the mixture-of-experts layout matrix (module-level so that spawn can pickle them)."""

from __future__ import annotations

import torch


def moe_layout_case(path, out_dir, layout, batch, ref):
    """Logits, log-probs (T=0.7), the loss and every gradient (HF names) and the export of one layout."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from tests.models._workers import _files_equal
    from verl.config import OptimConfig
    from verl.distributed import destroy_process_groups, init_process_groups
    from verl.models import (build_gpt, causal_lm_loss, compute_log_probs, compute_logits, export_hf_checkpoint,
                             gather_hf_state_dict, load_hf_checkpoint, make_micro_batches)
    from verl.models.optimizer import accumulate_grads, build_optimizer
    tp, pp, sp, ep, etp = layout
    ids, mask = batch
    pg = init_process_groups(tp=tp, pp=pp, sequence_parallel=sp, ep=ep, etp=etp)
    model = build_gpt(AutoConfig.from_pretrained(str(path)), pg)
    info = load_hf_checkpoint(model, path)
    res = {"bytes_read": {dist.get_rank(): info["bytes_read"]}}
    logits = compute_logits(model, ids, mask, micro_batch_size=1)
    res["logit_diff"] = float(((logits - ref["logits"]).abs() * mask[..., None]).max())
    lp = compute_log_probs(model, ids, mask, temperature=0.7, micro_batch_size=1)
    m = lp["token_mask"]
    res["logprob_diff"] = float(((lp["log_probs"] - ref["log_probs_t07"]).abs() * m).max())
    tag = "_".join(f"{k}{v}" for k, v in zip(("tp", "pp", "sp", "ep", "etp"), (tp, pp, int(sp), ep, etp)))
    written = export_hf_checkpoint(model, f"{out_dir}/{tag}")
    if written is not None:
        res["export_exact"] = _files_equal(path, written)
    build_optimizer(model, OptimConfig(lr=1e-2, grad_clip=0.0))
    outs = accumulate_grads(model, make_micro_batches(ids, mask, 1), causal_lm_loss(model))
    if outs:
        res["loss"] = sum(float(o["loss"]) for o in outs) / len(outs)
    grads = gather_hf_state_dict(model, {n: p.main_grad for n, p in model.gpt.named_parameters()})
    if grads is not None:
        res["grad_names_match"] = set(grads) == set(ref["grads"])
        res["grad_diff"] = max(float((grads[k] - ref["grads"][k]).abs().max()) for k in ref["grads"])
    destroy_process_groups()
    return res


def moe_matrix_body(rank, world_size, jobs):
    out = []
    for job in jobs:
        for layout in job["layouts"]:
            r = moe_layout_case(job["path"], job["out_dir"], tuple(layout), job["batch"], job["ref"])
            out.append({"case": job["name"], "layout": tuple(layout), **r})
    return out


def loader_errors_body(rank, world_size, paths):
    """What the strict loader says about a checkpoint missing one expert tensor, and one with an extra tensor."""
    from transformers import AutoConfig

    from verl.distributed import destroy_process_groups, init_process_groups
    from verl.models import build_gpt, load_hf_checkpoint
    pg = init_process_groups(tp=1, pp=1, ep=2)
    out = {}
    for name, path in paths.items():
        model = build_gpt(AutoConfig.from_pretrained(str(path)), pg)
        try:
            load_hf_checkpoint(model, path)
            out[name] = "loaded"
        except Exception as e:  # noqa: BLE001 - the message is the point
            out[name] = f"{type(e).__name__}: {e}"
    destroy_process_groups()
    return out
