"""The reshard planner from metadata alone (one process): coverage, bit-exact assembly for many
(TP, PP, DP) → TP_g combinations, lazy gather, bucket bounds, and configuration errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.hybrid_engine.reference import (expected_generation, megatron_shards, padded_vocab, random_hf_state_dict,
                                           tiny_config)
from verl.errors import VerlConfigError
from verl.hybrid_engine import TrainingLayout, generation_coords, llama_param_specs, plan_reshard
from verl.ops import reshard_gather_ref

VOCAB_MULTIPLE = 8


def _combos(max_world=8):
    for tp, pp, dp in itertools.product([1, 2, 4], [1, 2, 4], [1, 2, 4]):
        world = tp * pp * dp
        if world > max_world:
            continue
        for tp_g in [1, 2, 4, 8]:
            if world % tp_g == 0 and (tp % tp_g == 0 or tp_g % tp == 0):
                yield tp, pp, dp, tp_g


COMBOS = list(_combos())


def simulate(plan, shards):
    """Runs the plan on one process: each target assembled from the source ranks' shards."""
    out = [dict() for _ in range(plan.world)]
    for b in plan.buckets:
        for tp in b.targets:
            sources, rows = [], []
            for pc in tp.pieces:
                src = shards[pc.src_rank][tp.param]  # KeyError = the plan asks a rank for what it does not hold
                sources.append(src)
                rows.append((len(sources) - 1, pc.src_offset, pc.dst_offset, pc.length))
            out[tp.rank][tp.target.name] = reshard_gather_ref(sources, torch.tensor(rows), tp.target.dim,
                                                              tp.target.shape)
    return out


@pytest.mark.parametrize("tp,pp,dp,tp_g", COMBOS, ids=[f"tp{a}pp{b}dp{c}-tpg{d}" for a, b, c, d in COMBOS])
@pytest.mark.parametrize("fmt", ["hf", "vllm"])
def test_plan_assembles_engine_weights_bit_exactly(tp, pp, dp, tp_g, fmt):
    cfg = tiny_config(bias=(tp_g == 2))  # Qwen2-style QKV bias in part of the matrix
    layout = TrainingLayout(tp=tp, pp=pp, dp=dp)
    sd = random_hf_state_dict(cfg, dtype=torch.bfloat16)
    specs = llama_param_specs(cfg, tp=tp, pp=pp, dtype=torch.bfloat16, make_vocab_size_divisible_by=VOCAB_MULTIPLE)
    plan = plan_reshard(specs, layout, tp_g, fmt=fmt, bucket_bytes=8 << 10)
    shards = [megatron_shards(sd, cfg, layout, r, VOCAB_MULTIPLE) for r in range(layout.world)]
    for r in range(layout.world):  # the planner's view of local shard shapes agrees with megatron's
        assert {k: tuple(v.shape) for k, v in shards[r].items()} == plan.local_params(r)
    got = simulate(plan, shards)
    for r, (tg, _) in enumerate(plan.coords):
        want = expected_generation(sd, cfg, tp_g, tg, fmt, padded_vocab(cfg, tp, VOCAB_MULTIPLE))
        assert sorted(got[r]) == sorted(want), f"rank {r}: wrong set of tensors"
        for name, w in want.items():
            assert torch.equal(got[r][name], w), f"rank {r} {name} differs (tp={tp} pp={pp} dp={dp} tp_g={tp_g})"


@pytest.mark.parametrize("tp,dp", [(1, 4), (2, 2), (4, 1), (4, 2), (8, 1)])
def test_lazy_gather_stays_inside_the_merged_group(tp, dp):
    cfg = tiny_config(heads=8, kv_heads=8, hidden=64, ffn=64)
    layout = TrainingLayout(tp=tp, pp=1, dp=dp)
    specs = llama_param_specs(cfg, tp=tp, make_vocab_size_divisible_by=VOCAB_MULTIPLE)
    for tp_g in [g for g in (1, 2, 4, 8) if tp % g == 0]:
        plan = plan_reshard(specs, layout, tp_g)
        k = tp // tp_g
        for b in plan.buckets:
            for tgt in b.targets:
                t_dst, d_dst, _ = layout.coords(tgt.rank)
                for pc in tgt.pieces:
                    t_src, d_src, _ = layout.coords(pc.src_rank)
                    assert d_src == d_dst and t_src // k == t_dst // k, (tp_g, tgt.target.name, pc)
        traffic = plan.traffic()
        if tp_g == tp:
            assert sum(traffic["sent"]) == 0, "TP_g = TP must not move anything"
        else:  # a rank receives exactly what its generation shard has beyond its own training shard
            total = sum(p.element_size * p.row_numel() * sum(h[p.dim] for h in p.hf_shapes) for p in specs)
            assert max(traffic["received"]) < total


def test_pipeline_stages_send_their_layers_and_nothing_is_sent_twice():
    cfg = tiny_config()
    layout = TrainingLayout(tp=2, pp=2, dp=1)
    specs = llama_param_specs(cfg, tp=2, pp=2, make_vocab_size_divisible_by=VOCAB_MULTIPLE)
    plan = plan_reshard(specs, layout, 2)
    for b in plan.buckets:
        for tgt in b.targets:
            spec = plan.specs[tgt.param]
            for pc in tgt.pieces:
                assert layout.coords(pc.src_rank)[2] == spec.stage
            cov = sorted((pc.dst_offset, pc.length) for pc in tgt.pieces)
            assert sum(n for _, n in cov) == tgt.target.shape[tgt.target.dim]
            assert all(a + n == b for (a, n), (b, _) in zip(cov, cov[1:]))


def test_naive_all_gather_moves_far_more_than_the_plan():
    cfg = tiny_config(layers=8, hidden=64, ffn=128)
    layout = TrainingLayout(tp=4, pp=1, dp=1)
    specs = llama_param_specs(cfg, tp=4, make_vocab_size_divisible_by=VOCAB_MULTIPLE)
    plan = plan_reshard(specs, layout, 2)
    sharded = sum(spec.element_size * spec.row_numel() * sum(s[spec.dim] for s in spec.hf_shapes)
                  for spec in specs if spec.layout != "replicated")
    naive_recv = sharded * 3 / 4  # an all-gather brings each rank the 3 shards it does not hold
    # TP 4 → 2 needs only the partner's shard: a third of the naive traffic.
    assert max(plan.traffic()["received"]) <= 0.34 * naive_recv


def test_buckets_respect_the_bound_except_single_oversized_params():
    cfg = tiny_config(layers=6)
    layout = TrainingLayout(tp=2, pp=1, dp=2)
    specs = llama_param_specs(cfg, tp=2, make_vocab_size_divisible_by=VOCAB_MULTIPLE)
    bound = 6 << 10
    plan = plan_reshard(specs, layout, 1, bucket_bytes=bound)
    assert len(plan.buckets) > 3
    for b in plan.buckets:
        held = [0] * layout.world
        for tgt in b.targets:
            held[tgt.rank] += tgt.nbytes
            for pc in tgt.pieces:
                if pc.src_rank != tgt.rank:
                    held[pc.src_rank] += tgt.piece_nbytes(pc)
                    held[tgt.rank] += tgt.piece_nbytes(pc)
        assert max(held) <= bound or len(b.params) == 1
    layers = [plan.specs[p].layer for b in plan.buckets for p in b.params if plan.specs[p].layer is not None]
    assert layers == sorted(layers), "buckets must follow layer order"


def test_generation_coords_are_a_permutation():
    for tp, pp, dp, tp_g in COMBOS:
        layout = TrainingLayout(tp=tp, pp=pp, dp=dp)
        coords = generation_coords(layout, tp_g)
        assert sorted(coords) == sorted((a, b) for b in range(layout.world // tp_g) for a in range(tp_g))


def test_configuration_errors_name_the_bad_value():
    cfg = tiny_config(heads=8, kv_heads=2)
    with pytest.raises(VerlConfigError, match="query groups across TP=4"):
        plan_reshard(llama_param_specs(cfg, tp=4, make_vocab_size_divisible_by=8), TrainingLayout(tp=4), 4)
    specs = llama_param_specs(cfg, tp=2, make_vocab_size_divisible_by=8)
    with pytest.raises(VerlConfigError, match="must divide the world size 2"):
        plan_reshard(specs, TrainingLayout(tp=2), 4)
    with pytest.raises(VerlConfigError, match="weight format 'sglang'"):
        plan_reshard(specs, TrainingLayout(tp=2), 1, fmt="sglang")
    with pytest.raises(VerlConfigError, match="PP=3"):
        llama_param_specs(cfg, pp=3)
    with pytest.raises(VerlConfigError, match="not a multiple"):
        specs6 = llama_param_specs(tiny_config(heads=6, kv_heads=2, hidden=24), tp=1, make_vocab_size_divisible_by=8)
        plan_reshard(specs6, TrainingLayout(dp=3), 3)


def test_kv_heads_are_replicated_when_generation_tp_exceeds_them():
    cfg = tiny_config(heads=8, kv_heads=2)
    layout = TrainingLayout(tp=2, pp=1, dp=2)
    sd = random_hf_state_dict(cfg)
    plan = plan_reshard(llama_param_specs(cfg, tp=2, make_vocab_size_divisible_by=8), layout, 4)
    got = simulate(plan, [megatron_shards(sd, cfg, layout, r, 8) for r in range(4)])
    k = sd["model.layers.0.self_attn.k_proj.weight"]
    hd = cfg.hidden_size // cfg.num_attention_heads
    for r, (tg, _) in enumerate(plan.coords):
        assert torch.equal(got[r]["model.layers.0.self_attn.k_proj.weight"], k[(tg // 2) * hd:(tg // 2 + 1) * hd])
