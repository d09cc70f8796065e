"""The planner for a data-parallel Hugging Face module, from metadata alone (one process): every rank holding
every tensor whole (nothing may move), FSDP2 dim-0 shards (only the rows a generation rank lacks may move,
checked against the independent reference), and architectures the layout model does not know."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.hybrid_engine.reference import fsdp_bytes_needed, fsdp_chunk, random_hf_state_dict, tiny_config
from tests.hybrid_engine.test_planner import check_against_reference, simulate
from verl.errors import VerlConfigError
from verl.distributed import Placement
from verl.hybrid_engine import plan_reshard
from verl.models.layout import hf_model_layout

PLAIN = [(world, tp_g) for world in (1, 2, 4) for tp_g in (1, 2, 4) if world % tp_g == 0]


@pytest.mark.parametrize("world,tp_g", PLAIN, ids=[f"dp{w}-tpg{g}" for w, g in PLAIN])
@pytest.mark.parametrize("fmt", ["hf", "vllm"])
@pytest.mark.parametrize("variant", ["plain", "bias", "tied-gqa"])
def test_whole_copies_on_every_rank_move_nothing(world, tp_g, fmt, variant):
    cfg = tiny_config(bias=variant == "bias", tied=variant == "tied-gqa", kv_heads=2 if variant == "tied-gqa" else 4)
    sd = random_hf_state_dict(cfg, dtype=torch.bfloat16)
    layout = hf_model_layout(sd, cfg)
    assert not layout.unknown
    plan = plan_reshard(layout, Placement.layout(dp=world), tp_g, fmt=fmt, bucket_bytes=8 << 10)
    traffic = plan.traffic()
    assert traffic["sent"] == [0] * world and traffic["received"] == [0] * world
    for r in range(world):
        assert plan.local_params(r) == {n: tuple(t.shape) for n, t in sd.items()}
    check_against_reference(plan, [sd] * world, sd, cfg)
    if tp_g == 1 and fmt == "hf":  # every target is the rank's own whole tensor (the executor hands out a view)
        for t in plan.targets_of(0):
            (pc,) = t.pieces
            assert (pc.param, pc.src_rank, pc.src_offset, pc.length) == (t.target.name, 0, 0, t.target.shape[t.dim])
    if fmt == "vllm":
        qkv = next(t for t in plan.targets_of(0) if t.target.name == "model.layers.0.self_attn.qkv_proj.weight")
        assert [pc.param.rsplit(".", 2)[1] for pc in qkv.pieces] == ["q_proj", "k_proj", "v_proj"]
    if cfg.tie_word_embeddings:  # the embedding is the output layer: no separate target
        assert "lm_head.weight" not in {t.target.name for t in plan.targets_of(0)}


FSDP = [(2, 1), (2, 2), (3, 1), (4, 1), (4, 2), (4, 4)]


@pytest.mark.parametrize("world,tp_g", FSDP, ids=[f"fsdp{w}-tpg{g}" for w, g in FSDP])
@pytest.mark.parametrize("fmt", ["hf", "vllm"])
def test_fsdp_dim0_shards_gather_only_the_rows_a_rank_lacks(world, tp_g, fmt):
    cfg = tiny_config(kv_heads=2, bias=True)            # vocab 101 and 16-row biases: uneven chunks
    sd = random_hf_state_dict(cfg)
    layout = hf_model_layout(sd, cfg, shards=world)
    train = Placement.layout(dp=world)
    plan = plan_reshard(layout, train, tp_g, fmt=fmt, bucket_bytes=8 << 10)
    shards = [{n: fsdp_chunk(w, r, world) for n, w in sd.items()} for r in range(world)]
    for r in range(world):
        assert plan.local_params(r) == {n: tuple(t.shape) for n, t in shards[r].items()}
    check_against_reference(plan, shards, sd, cfg)
    traffic = plan.traffic()
    for r, (tg, _) in enumerate(plan.coords):
        assert traffic["received"][r] == fsdp_bytes_needed(sd, cfg, tp_g, tg, r, world), r
    assert sum(traffic["sent"]) == sum(traffic["received"])
    if tp_g > 1:  # o_proj / down_proj are cut by columns while FSDP cuts rows: read narrowed chunks
        o = next(t for t in plan.targets_of(0) if t.target.name == "model.layers.0.self_attn.o_proj.weight")
        assert o.dim == 0 and o.narrow == (1, 0, cfg.hidden_size // tp_g)


def test_empty_fsdp_chunks_are_skipped():
    # 3 rows over 4 ranks: chunks of 1, 1, 1, 0 rows; 5 rows: 2, 2, 1, 0. Rank 3 holds nothing and must
    # still receive everything.
    sd = {"w": torch.arange(12.0).view(3, 4), "b": torch.arange(5.0)}
    layout = hf_model_layout(sd, SimpleNamespace(model_type="toy"), shards=4)
    plan = plan_reshard(layout, Placement.layout(dp=4), 1)
    assert plan.local_params(3) == {"w": (0, 4), "b": (0,)}
    got = simulate(plan, [{n: fsdp_chunk(t, r, 4) for n, t in sd.items()} for r in range(4)])
    for r in range(4):
        assert all(torch.equal(got[r][n], sd[n]) for n in sd)
    assert plan.traffic()["received"][3] == (12 + 5) * 4


def test_unknown_architecture_works_whole_and_refuses_cutting_or_fusing():
    sd = {"transformer.wte.weight": torch.randn(11, 4), "transformer.h.0.attn.c_attn.weight": torch.randn(4, 12),
          "transformer.ln_f.weight": torch.randn(4)}
    layout = hf_model_layout(sd, SimpleNamespace(model_type="gpt2"))
    assert layout.unknown and all(g.kind == "whole" for g in layout.groups)
    plan = plan_reshard(layout, Placement.layout(dp=2), 1)
    assert plan.traffic()["sent"] == [0, 0]
    assert {t.target.name for t in plan.targets_of(1)} == set(sd)
    with pytest.raises(VerlConfigError, match=r"architecture 'gpt2'.*weight_format='hf' with generation_tp=1 "
                                              r"\(got weight_format='vllm'"):
        plan_reshard(layout, Placement.layout(dp=2), 1, fmt="vllm")
    with pytest.raises(VerlConfigError, match=r"architecture 'gpt2'.*generation_tp=2"):
        plan_reshard(layout, Placement.layout(dp=2), 2)


def test_a_known_architecture_with_unexpected_parameters_says_why_it_cannot_be_cut():
    cfg = tiny_config()
    sd = random_hf_state_dict(cfg)
    sd["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(cfg.intermediate_size)
    layout = hf_model_layout(sd, cfg)
    assert plan_reshard(layout, Placement.layout(), 1).traffic()["sent"] == [0]
    with pytest.raises(VerlConfigError, match=r"'llama'.*gate_proj\.bias"):
        plan_reshard(layout, Placement.layout(dp=2), 2)


def test_a_fused_target_from_parameters_of_different_dtypes_is_refused():
    cfg = tiny_config()
    sd = random_hf_state_dict(cfg)
    sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"].bfloat16()
    with pytest.raises(VerlConfigError, match="qkv_proj.weight would be built from parameters of dtypes"):
        plan_reshard(hf_model_layout(sd, cfg), Placement.layout(), 1, fmt="vllm")

