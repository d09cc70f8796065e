"""Rank bodies for the hybrid engine on verl's real megatron GPT (module-level so that spawn can pickle them)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def _hf_state_dict(path) -> dict[str, torch.Tensor]:
    from pathlib import Path

    from safetensors.torch import load_file
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def reshard_real_model_body(rank, world, path, layouts):
    from transformers import AutoConfig

    from tests.hybrid_engine.reference import expected_generation
    from verl.distributed import destroy_process_groups, init_process_groups
    from verl.hybrid_engine import HybridEngineConfig
    from verl.hybrid_engine.megatron import hybrid_engine_for, megatron_local_params
    from verl.models import BuildOptions, build_gpt, load_hf_checkpoint
    from verl.models.layout import megatron_shard_specs

    hf_cfg = AutoConfig.from_pretrained(path)
    sd = _hf_state_dict(path)
    cfg = SimpleNamespace(num_attention_heads=hf_cfg.num_attention_heads, hidden_size=hf_cfg.hidden_size,
                          num_key_value_heads=hf_cfg.num_key_value_heads, vocab_size=hf_cfg.vocab_size)
    results = []
    for tp, pp, tp_g, fmt in layouts:
        pg = init_process_groups(tp=tp, pp=pp)
        model = build_gpt(hf_cfg, pg, BuildOptions(vocab_multiple=4))
        load_hf_checkpoint(model, path)
        he = hybrid_engine_for(model, HybridEngineConfig(generation_tp=tp_g, weight_format=fmt, bucket_mb=0.05))
        local = megatron_local_params(model)
        before = {k: v.clone() for k, v in local.items()}
        got = dict(he.stream(local))
        want = expected_generation(sd, cfg, tp_g, he.plan.coords[rank][0], fmt)
        bad = sorted(set(want) ^ set(got)) + [n for n in want if n in got and not torch.equal(got[n], want[n])]
        intact = all(torch.equal(before[k], v) for k, v in megatron_local_params(model).items())
        # The metadata-only derivation (planning without a model) describes the live model exactly.
        derived = {s.name: s for s in megatron_shard_specs(model.arch, model.layout, pp=pp)}
        same_specs = derived == he.plan.specs
        results.append(dict(layout=(tp, pp, tp_g, fmt), bad=bad[:5], intact=intact, n=len(got),
                            sent=he.last_stats.bytes_sent, same_specs=same_specs))
        destroy_process_groups()
    return results
