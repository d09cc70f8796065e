"""Rank bodies for the megatron model tests (module-level so that spawn can pickle them)."""

from __future__ import annotations

import torch


def _build(path, tp, pp, sp, value_head=False):
    from transformers import AutoConfig

    from verl.distributed import init_process_groups
    from verl.models import BuildOptions, build_gpt, load_hf_checkpoint
    pg = init_process_groups(tp=tp, pp=pp, sequence_parallel=sp)
    model = build_gpt(AutoConfig.from_pretrained(str(path)), pg, BuildOptions(value_head=value_head))
    info = load_hf_checkpoint(model, path)
    return model, info


def logits_body(rank, world_size, path, tp, pp, sp, input_ids, attention_mask):
    from verl.models import compute_logits
    model, info = _build(path, tp, pp, sp)
    logits = compute_logits(model, input_ids, attention_mask, micro_batch_size=1)
    return {"logits": logits, "bytes_read": info["bytes_read"]}
