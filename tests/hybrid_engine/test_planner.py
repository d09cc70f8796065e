"""The reshard planner from metadata alone (one process): coverage, bit-exact assembly for many
(TP, PP, DP) → TP_g combinations of a megatron actor, a data-parallel Hugging Face module (whole tensors
on every rank) and FSDP2 dim-0 shards, lazy gather, bucket bounds, and configuration errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.hybrid_engine.reference import (expected_generation, megatron_meta, megatron_shards,
                                           random_hf_state_dict, tiny_config)
from verl.errors import VerlConfigError
from verl.distributed import Placement
from verl.hybrid_engine import generation_coords, plan_reshard
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
                src = shards[pc.src_rank][pc.param]  # KeyError = the plan asks a rank for what it does not hold
                sources.append(src if tp.narrow is None else src.narrow(*tp.narrow))
                rows.append((len(sources) - 1, pc.src_offset, pc.dst_offset, pc.length))
            out[tp.rank][tp.target.name] = reshard_gather_ref(sources, torch.tensor(rows), tp.dim, tp.target.shape)
    return out


def check_against_reference(plan, shards, sd, cfg):
    got = simulate(plan, shards)
    for r, (tg, _) in enumerate(plan.coords):
        want = expected_generation(sd, cfg, plan.tp_g, tg, plan.fmt)
        assert sorted(got[r]) == sorted(want), f"rank {r}: wrong set of tensors"
        for name, w in want.items():
            assert torch.equal(got[r][name], w), f"rank {r} {name} differs ({plan.train}, tp_g={plan.tp_g})"


@pytest.mark.parametrize("tp,pp,dp,tp_g", COMBOS, ids=[f"tp{a}pp{b}dp{c}-tpg{d}" for a, b, c, d in COMBOS])
@pytest.mark.parametrize("fmt", ["hf", "vllm"])
def test_plan_assembles_engine_weights_bit_exactly(tp, pp, dp, tp_g, fmt):
    cfg = tiny_config(bias=(tp_g == 2))  # Qwen2-style QKV bias in part of the matrix
    layout = Placement.layout(tp=tp, pp=pp, dp=dp)
    sd = random_hf_state_dict(cfg, dtype=torch.bfloat16)
    meta = megatron_meta(cfg, tp=tp, pp=pp, dtype=torch.bfloat16, vocab_multiple=VOCAB_MULTIPLE)
    plan = plan_reshard(meta, layout, tp_g, fmt=fmt, bucket_bytes=8 << 10)
    shards = [megatron_shards(sd, cfg, layout, r, VOCAB_MULTIPLE) for r in range(layout.world_size)]
    for r in range(layout.world_size):  # the planner's view of local shard shapes agrees with megatron's
        assert {k: tuple(v.shape) for k, v in shards[r].items()} == plan.local_params(r)
    check_against_reference(plan, shards, sd, cfg)


@pytest.mark.parametrize("tp_g", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["hf", "vllm"])
def test_megatron_qkv_split_across_ranks_when_tp_exceeds_kv_heads(tp_g, fmt):
    cfg = tiny_config(heads=8, kv_heads=2, bias=True)
    layout = Placement.layout(tp=4, pp=1, dp=1)
    sd = random_hf_state_dict(cfg)
    plan = plan_reshard(megatron_meta(cfg, tp=4), layout, tp_g, fmt=fmt, bucket_bytes=8 << 10)
    check_against_reference(plan, [megatron_shards(sd, cfg, layout, r, 8) for r in range(4)], sd, cfg)


@pytest.mark.parametrize("tp,dp", [(1, 4), (2, 2), (4, 1), (4, 2), (8, 1)])
def test_lazy_gather_stays_inside_the_merged_group(tp, dp):
    # a vocabulary whose megatron padding (a multiple of 8·TP) is also the engines' (64): vocab shards line up
    cfg = tiny_config(heads=8, kv_heads=8, hidden=64, ffn=64, vocab=128)
    layout = Placement.layout(tp=tp, pp=1, dp=dp)
    meta = megatron_meta(cfg, tp=tp, vocab_multiple=VOCAB_MULTIPLE)
    for tp_g in [g for g in (1, 2, 4, 8) if tp % g == 0]:
        plan = plan_reshard(meta, layout, tp_g)
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
            total = sum(4 * math.prod(shape) for g in meta.groups for shape in g.shapes)
            assert max(traffic["received"]) < total


def test_pipeline_stages_send_their_layers_and_nothing_is_sent_twice():
    cfg = tiny_config()
    layout = Placement.layout(tp=2, pp=2, dp=1)
    plan = plan_reshard(megatron_meta(cfg, tp=2, pp=2, vocab_multiple=VOCAB_MULTIPLE), layout, 2)
    for b in plan.buckets:
        for tgt in b.targets:
            for pc in tgt.pieces:
                assert layout.coords(pc.src_rank)[2] == plan.specs[pc.param].stage
            cov = sorted((pc.dst_offset, pc.length) for pc in tgt.pieces)
            assert sum(n for _, n in cov) == tgt.target.shape[tgt.target.dim]
            assert all(a + n == b for (a, n), (b, _) in zip(cov, cov[1:]))


def test_naive_all_gather_moves_far_more_than_the_plan():
    cfg = tiny_config(layers=8, hidden=64, ffn=128)
    layout = Placement.layout(tp=4, pp=1, dp=1)
    meta = megatron_meta(cfg, tp=4, vocab_multiple=VOCAB_MULTIPLE)
    plan = plan_reshard(meta, layout, 2)
    sharded = sum(4 * math.prod(shape) for g in meta.groups if g.kind != "replicated" for shape in g.shapes)
    naive_recv = sharded * 3 / 4  # an all-gather brings each rank the 3 shards it does not hold
    # TP 4 → 2 needs only the partner's shard: a third of the naive traffic.
    assert max(plan.traffic()["received"]) <= 0.34 * naive_recv


def test_buckets_respect_the_bound_except_single_oversized_params():
    cfg = tiny_config(layers=6)
    layout = Placement.layout(tp=2, pp=1, dp=2)
    bound = 6 << 10
    plan = plan_reshard(megatron_meta(cfg, tp=2, vocab_multiple=VOCAB_MULTIPLE), layout, 1, bucket_bytes=bound)
    assert len(plan.buckets) > 3
    for b in plan.buckets:
        held = [0] * layout.world_size
        for tgt in b.targets:
            held[tgt.rank] += tgt.nbytes
            for pc in tgt.pieces:
                if pc.src_rank != tgt.rank:
                    held[pc.src_rank] += tgt.piece_nbytes(pc)
                    held[tgt.rank] += tgt.piece_nbytes(pc)
        assert max(held) <= bound or len(b.groups) == 1
    layers = [int(g.names[0].split(".")[2]) for b in plan.buckets for g in b.groups
              if g.names[0].startswith("model.layers.")]
    assert layers == sorted(layers), "buckets must follow layer order"


def test_generation_coords_are_a_permutation():
    for tp, pp, dp, tp_g in COMBOS:
        layout = Placement.layout(tp=tp, pp=pp, dp=dp)
        coords = generation_coords(layout, tp_g)
        assert sorted(coords) == sorted((a, b) for b in range(layout.world_size // tp_g) for a in range(tp_g))


def test_configuration_errors_name_the_bad_value():
    cfg = tiny_config(heads=8, kv_heads=2)
    with pytest.raises(VerlConfigError, match="tp=3"):
        megatron_meta(cfg, tp=3)
    meta = megatron_meta(cfg, tp=2)
    with pytest.raises(VerlConfigError, match="must divide the world size 2"):
        plan_reshard(meta, Placement.layout(tp=2), 4)
    with pytest.raises(VerlConfigError, match="weight format 'sglang'"):
        plan_reshard(meta, Placement.layout(tp=2), 1, fmt="sglang")
    with pytest.raises(VerlConfigError, match="pp=3"):
        megatron_meta(cfg, pp=3)
    with pytest.raises(VerlConfigError, match="2 chunks along the training TP axis but the training layout has TP=4"):
        plan_reshard(meta, Placement.layout(tp=4), 4)
    with pytest.raises(VerlConfigError, match="stage 1 but the training layout has PP=1"):
        plan_reshard(megatron_meta(cfg, pp=2), Placement.layout(dp=2), 1)
    with pytest.raises(VerlConfigError, match="not a multiple"):
        plan_reshard(megatron_meta(tiny_config(heads=6, kv_heads=2, hidden=24, vocab=192)), Placement.layout(dp=3), 3)
    with pytest.raises(VerlConfigError, match="padded vocabulary of 128 rows does not split over generation TP=3"):
        plan_reshard(megatron_meta(tiny_config(heads=6, kv_heads=2, hidden=24)), Placement.layout(dp=3), 3)
    with pytest.raises(VerlConfigError, match="8 query heads do not split over generation TP=3"):
        plan_reshard(megatron_meta(tiny_config(vocab=192)), Placement.layout(dp=3), 3)


def test_kv_heads_are_replicated_when_generation_tp_exceeds_them():
    cfg = tiny_config(heads=8, kv_heads=2)
    layout = Placement.layout(tp=2, pp=1, dp=2)
    sd = random_hf_state_dict(cfg)
    plan = plan_reshard(megatron_meta(cfg, tp=2), layout, 4)
    got = simulate(plan, [megatron_shards(sd, cfg, layout, r, 8) for r in range(4)])
    k = sd["model.layers.0.self_attn.k_proj.weight"]
    hd = cfg.hidden_size // cfg.num_attention_heads
    for r, (tg, _) in enumerate(plan.coords):
        assert torch.equal(got[r]["model.layers.0.self_attn.k_proj.weight"], k[(tg // 2) * hd:(tg // 2 + 1) * hd])


@pytest.mark.parametrize("vocab,tp_g,rows", [(151936, 2, [75968, 75968]), (50257, 2, [25152, 25105]),
                                             (101, 4, [32, 32, 32, 5])])
def test_generation_vocab_shards_follow_the_engines_padding(vocab, tp_g, rows):
    """vLLM / SGLang pad the vocabulary to a multiple of 64 and give each TP rank an equal range: a shard cut
    any other way would not fit the engine's parameter (megatron's padding for 151936 at TP=2 gives 76032)."""
    from verl.hybrid_engine import generation_targets
    from verl.models.layout import TensorGroup
    group = TensorGroup(kind="vocab", names=("model.embed_tokens.weight",), shapes=((vocab, 8),))
    got = [generation_targets(group, tp_g, r, "vllm") for r in range(tp_g)]
    assert [sum(t.shape[0] for t in ts) for ts in got] == rows
