"""Shard descriptions (pure metadata, one process): the fused layouts megatron-core uses, vocab padding,
and that the TP shards of every parameter tile its global tensor exactly once."""

from __future__ import annotations

import pytest

from verl.models.tiny import tiny_config
from verl.errors import VerlConfigError
from verl.models import arch_from_hf, parallel_layout
from verl.models.layout import (KINDS, Segment, ShardSpec, hf_model_layout, hf_tensor_groups, hf_tensor_shapes,
                                megatron_shard_specs, shard_spec)

LOCAL_NAMES = [
    "embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
    "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
    "decoder.final_layernorm.weight", "output_layer.weight",
]


def _spec(name, tp, **cfg):
    arch = arch_from_hf(tiny_config(family="qwen2", **cfg))
    return shard_spec(name, arch=arch, layout=parallel_layout(arch, tp), layer_offset=0)


def _pieces(spec, rank):
    return [(s.hf_name, s.start, s.length) for s, _ in spec.local_segments(rank)]


def test_qkv_is_grouped_q_then_k_then_v_per_query_group():
    # 4 query heads, 2 KV heads, head_dim 16: group g = [q heads 2g, 2g+1; k_g; v_g]; TP rank r = group r.
    spec = _spec("decoder.layers.0.self_attention.linear_qkv.weight", 2)
    assert spec.kind == "qkv-fused" and spec.dim == 0 and spec.parts == 2 and spec.global_shape == (128, 64)
    p = "model.layers.0.self_attn"
    assert _pieces(spec, 1) == [(f"{p}.q_proj.weight", 32, 32), (f"{p}.k_proj.weight", 16, 16),
                                (f"{p}.v_proj.weight", 16, 16)]


def test_qkv_when_tp_exceeds_kv_heads_splits_a_group_contiguously():
    # 1 KV head, TP 2: the single group [q0 q1 q2 q3 k v] (6 x 16 rows) is cut in half, as megatron does.
    p = "model.layers.0.self_attn"
    spec = _spec("decoder.layers.0.self_attention.linear_qkv.weight", 2, num_kv_heads=1)
    assert _pieces(spec, 0) == [(f"{p}.q_proj.weight", 0, 48)]
    assert _pieces(spec, 1) == [(f"{p}.q_proj.weight", 48, 16), (f"{p}.k_proj.weight", 0, 16),
                                (f"{p}.v_proj.weight", 0, 16)]


def test_gate_up_is_per_rank_gate_then_up():
    spec = _spec("decoder.layers.0.mlp.linear_fc1.weight", 2)
    assert spec.kind == "gate-up-fused"
    assert _pieces(spec, 1) == [("model.layers.0.mlp.gate_proj.weight", 64, 64),
                                ("model.layers.0.mlp.up_proj.weight", 64, 64)]


def test_vocab_padding_lands_on_the_last_rank():
    spec = _spec("embedding.word_embeddings.weight", 2, vocab_size=101)
    assert spec.global_shape == (102, 64) and spec.local_shape(1) == (51, 64)
    assert _pieces(spec, 1) == [("model.embed_tokens.weight", 51, 50), (None, 0, 1)]


def test_row_parallel_splits_columns_and_norms_are_replicated():
    proj = _spec("decoder.layers.0.self_attention.linear_proj.weight", 2)
    assert proj.kind == "row" and proj.dim == 1 and proj.local_shape(1) == (64, 32)
    assert _pieces(proj, 1) == [("model.layers.0.self_attn.o_proj.weight", 32, 32)]
    norm = _spec("decoder.layers.0.pre_mlp_layernorm.weight", 2)
    assert norm.kind == "replicated" and norm.dim is None and norm.local_shape(1) == (64,)
    assert norm.hf_names == ("model.layers.0.post_attention_layernorm.weight",)


def test_tied_output_layer_reads_the_embedding_and_is_not_exported():
    spec = _spec("output_layer.weight", 2, tie_word_embeddings=True)
    assert spec.hf_names == ("model.embed_tokens.weight",) and not spec.exported


def test_pipeline_offset_gives_global_layer_names():
    arch = arch_from_hf(tiny_config(family="llama", num_layers=4))
    spec = shard_spec("decoder.layers.1.mlp.linear_fc2.weight", arch=arch, layout=parallel_layout(arch, 1),
                      layer_offset=2, stage=1)
    assert spec.name == "decoder.layers.3.mlp.linear_fc2.weight" and spec.layer == 3 and spec.stage == 1
    assert spec.local_name == "decoder.layers.1.mlp.linear_fc2.weight"
    assert spec.hf_names == ("model.layers.3.mlp.down_proj.weight",)


@pytest.mark.parametrize("tp,kv", [(1, 2), (2, 2), (2, 1), (4, 1), (2, 4)])
def test_shards_tile_every_hf_tensor_exactly_once(tp, kv):
    arch = arch_from_hf(tiny_config(family="qwen2", num_kv_heads=kv, num_heads=4, vocab_size=101))
    layout = parallel_layout(arch, tp)
    covered: dict[str, list[tuple[int, int]]] = {}
    for name in LOCAL_NAMES:
        for rank in range(tp):
            spec = shard_spec(name, arch=arch, layout=layout, layer_offset=0)
            assert spec.kind in KINDS
            if spec.dim is None and rank > 0:
                continue          # replicated: one copy is the whole tensor
            for seg, _ in spec.local_segments(rank):
                if seg.hf_name is not None:
                    covered.setdefault(seg.hf_name, []).append((seg.start, seg.start + seg.length))
    shapes = hf_tensor_shapes(arch)
    layer0 = {k: v for k, v in shapes.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    assert set(covered) == set(layer0)
    for name, spans in covered.items():
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == layer0[name][dim]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), (name, spans)


def test_bad_layouts_are_refused_with_the_fix():
    arch = arch_from_hf(tiny_config(family="llama", num_heads=4, num_kv_heads=2))
    with pytest.raises(VerlConfigError, match="tp=3"):
        parallel_layout(arch, 3)
    with pytest.raises(VerlConfigError, match="gelu"):
        arch_from_hf(tiny_config(family="llama", hidden_act="gelu"))
    with pytest.raises(VerlConfigError, match="o_proj bias"):
        arch_from_hf(tiny_config(family="llama", attention_bias=True))
    with pytest.raises(VerlConfigError, match="yarn"):
        arch_from_hf(tiny_config(family="llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}))


def test_chunks_are_ceil_sized_with_short_or_empty_last_ones():
    # FSDP2's dim-0 rule; megatron's even split is the same rule whenever the parts divide the rows.
    spec = ShardSpec(name="w", local_name="w", kind="column", global_shape=(9, 2), dim=0, parts=4, axis="dp",
                     segments=(Segment(hf_name="w", start=0, length=9),))
    assert [spec.chunk(k) for k in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 0)]
    assert spec.local_shape(3) == (0, 2) and spec.local_segments(3) == []
    assert spec.local_segments(2) == [(Segment(hf_name="w", start=6, length=3), 0)]
    with pytest.raises(VerlConfigError, match="segments cover 8 rows but the tensor has shape"):
        ShardSpec(name="w", local_name="w", kind="column", global_shape=(9, 2), dim=0,
                  segments=(Segment(hf_name="w", start=0, length=8),))


@pytest.mark.parametrize("family,tie,value_head", [("llama", False, False), ("qwen2", True, False),
                                                   ("mistral", False, True)])
def test_every_stage_holds_each_hf_tensor_once_and_groups_list_them_all(family, tie, value_head):
    arch = arch_from_hf(tiny_config(family=family, num_layers=4, tie_word_embeddings=tie))
    layout = parallel_layout(arch, 2, vocab_multiple=4)
    specs = megatron_shard_specs(arch, layout, pp=2, value_head=value_head)
    assert [s.stage for s in specs] == sorted(s.stage for s in specs)
    assert {s.layer for s in specs if s.stage == 1} == {2, 3, None}
    held = [n for s in specs for n in s.hf_names]
    assert sorted(held) == sorted(set(held)), "a tensor held by two parameters"
    groups = hf_tensor_groups(arch, value_head=value_head)
    assert set(held) == {n for g in groups for n in g.names} == set(hf_tensor_shapes(arch, value_head=value_head))
    vocab = [g for g in groups if g.kind == "vocab"]
    assert len(vocab) == (1 if tie or value_head else 2)


def test_an_hf_module_of_a_known_architecture_gets_its_groups_and_whole_or_fsdp_params():
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(family="qwen2", tie_word_embeddings=True)
    params = dict(AutoModelForCausalLM.from_config(cfg).named_parameters())
    whole = hf_model_layout(params, cfg)
    assert not whole.unknown and whole.architecture == "qwen2"
    assert {n for g in whole.groups for n in g.names} == set(params)   # tied: no lm_head anywhere
    assert all(p.dim is None and p.name == p.local_name for p in whole.params)
    fsdp = hf_model_layout(params, cfg, shards=3)
    q = next(p for p in fsdp.params if p.name == "model.layers.1.self_attn.q_proj.weight")
    assert (q.dim, q.parts, q.axis, q.layer, q.local_shape(2)) == (0, 3, "dp", 1, (20, 64))
