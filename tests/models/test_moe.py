"""Mixture-of-experts models on megatron-core against transformers (float32, gloo): Qwen3-MoE (per-head q/k norms,
renormalised top-k), Mixtral (its own checkpoint names), OLMoE (q/k norms over the whole projection) and Qwen2-MoE
(a gated shared expert, q/k/v biases), plus the dense Qwen3 the first brings along.

One 2-rank spawn runs every (family, layout): EP=2 over the data-parallel ranks, TP=2 with sequence parallelism
(experts cut over expert TP = 2, or kept whole at ETP=1 with EP=2), PP=2. Each must give transformers' logits and
log-probs within 1e-4, its loss and every gradient (HF names) within 1e-4, and export the checkpoint bit-exactly.
The single-process tests check the parsing, the refusals, and the layout metadata on its own."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.models._moe_workers import loader_errors_body, moe_matrix_body
from tests.models._reference import hf_reference
from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.models.config import arch_from_hf, parallel_layout
from verl.models.layout import hf_checkpoint_view, hf_tensor_shapes, megatron_shard_specs
from verl.models.tiny import save_tiny, tiny_config, tiny_model
from verl.testing import run_distributed

TOL = 1e-4
MOE_LAYOUTS = [(1, 1, False, 1, 1), (1, 1, False, 2, 1), (2, 1, True, 1, 2), (2, 1, True, 2, 1), (1, 2, False, 1, 1)]
DENSE_LAYOUTS = [(1, 1, False, 1, 1), (2, 1, True, 1, 2), (1, 2, False, 1, 1)]
FAMILIES = {"qwen3_moe": MOE_LAYOUTS, "mixtral": MOE_LAYOUTS, "olmoe": MOE_LAYOUTS, "qwen2_moe": MOE_LAYOUTS,
            "qwen3": DENSE_LAYOUTS}
MOE = dict(num_experts=4, num_experts_per_tok=2, vocab_size=101)


def _model(family, seed=0):
    return tiny_model(family=family, seed=seed, noise=0.1, **MOE)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_matrix")
    jobs = []
    for i, (family, layouts) in enumerate(FAMILIES.items()):
        path = save_tiny(_model(family, seed=i), None, root / family)
        g = torch.Generator().manual_seed(i)
        # OLMoE's config sets pad_token_id=1, whose embedding row transformers never trains (padding_idx) while
        # megatron's embedding has no such row: batches without it compare every gradient
        ids = torch.randint(2, 101, (2, 8), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2], mask[1, -2:] = 0, 0   # left and right padding
        jobs.append(dict(name=family, path=path, out_dir=str(root / f"out_{family}"), layouts=layouts,
                         batch=(ids, mask), ref=hf_reference(path, ids, mask, steps=1, lr=1e-2)))
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start(command="VERL_WRITE_RESULTS=1 python -m pytest tests/models/test_moe.py -k matrix")
    merged: dict = {}
    for rank_results in run_distributed(moe_matrix_body, 2, args=(jobs,), timeout=1500):
        for r in rank_results:
            slot = merged.setdefault((r["case"], r["layout"]), {})
            for k, v in r.items():
                slot[k] = {**slot[k], **v} if isinstance(v, dict) and isinstance(slot.get(k), dict) else v
    report = [{"architecture": c, "tp": lay[0], "pp": lay[1], "sp": lay[2], "ep": lay[3], "etp": lay[4],
               "max_logit_diff": r["logit_diff"], "max_logprob_diff": r["logprob_diff"],
               "max_grad_diff": r.get("grad_diff"), "export_bit_exact": r.get("export_exact")}
              for (c, lay), r in merged.items()]
    if os.environ.get("VERL_WRITE_RESULTS"):   # the table for docs/MODELS.md, only when asked
        out = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "moe_layout_matrix.json"
        write_result(out, {"meta": {"ranks": 2}, "cases": report}, run)
    for row in report:
        print(f"{row['architecture']:<10} tp={row['tp']} pp={row['pp']} sp={int(row['sp'])} ep={row['ep']} "
              f"etp={row['etp']} max|dlogit|={row['max_logit_diff']:.1e} max|dgrad|={row['max_grad_diff']:.1e}")
    return merged


CASES = [(f, lay) for f, layouts in FAMILIES.items() for lay in layouts]
IDS = [f"{f}-tp{t}pp{p}{'sp' if s else ''}ep{e}etp{et}" for f, (t, p, s, e, et) in CASES]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matrix_logits_grads_and_export_match_transformers(matrix, case):
    r = matrix[case]
    assert r["logit_diff"] <= TOL and r["logprob_diff"] <= TOL
    assert r["grad_names_match"] and r["grad_diff"] <= TOL
    assert r["export_exact"] is True


@pytest.mark.multiprocess
def test_loader_refuses_a_missing_or_unused_expert_tensor(tmp_path):
    from safetensors.torch import load_file, save_file
    model = _model("qwen3_moe")
    good = save_tiny(model, None, tmp_path / "good")
    tensors = load_file(str(good / "model.safetensors"))
    paths = {}
    for name, edit in (("missing", lambda t: t.pop("model.layers.1.mlp.experts.3.down_proj.weight")),
                       ("extra", lambda t: t.update({"model.layers.0.mlp.experts.4.up_proj.weight": torch.zeros(2)}))):
        d = save_tiny(model, None, tmp_path / name)
        t = dict(tensors)
        edit(t)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        paths[name] = d
    # every rank refuses, also the EP rank that does not hold expert 3 (else it would wait for the other forever)
    for r in run_distributed(loader_errors_body, 2, args=(paths,), timeout=300):
        assert "model.layers.0.mlp.experts.4.up_proj.weight" in r["extra"] and "does not use" in r["extra"]
        assert "lacks model.layers.1.mlp.experts.3.down_proj.weight" in r["missing"]


# ------------------------------------------------------------------------------ one process, metadata only

@pytest.mark.parametrize("family", list(FAMILIES))
def test_layout_names_every_checkpoint_tensor_with_its_shape(family, tmp_path):
    from safetensors import safe_open
    path = save_tiny(_model(family), None, tmp_path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert hf_tensor_shapes(arch_from_hf(tiny_config(family=family, **MOE))) == on_disk


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
@pytest.mark.parametrize("tp,pp,ep,etp", [(1, 1, 1, 1), (1, 1, 4, 1), (2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 1)])
def test_shard_specs_cover_every_hf_row_once(family, tp, pp, ep, etp):
    arch = arch_from_hf(tiny_config(family=family, num_layers=2, **MOE))
    specs = megatron_shard_specs(arch, parallel_layout(arch, tp, ep=ep, etp=etp), pp=pp)
    rows: dict[str, int] = {}
    for s in specs:
        for seg in s.segments:
            if seg.hf_name is not None:
                rows[seg.hf_name] = rows.get(seg.hf_name, 0) + seg.length
    shapes = hf_tensor_shapes(arch)
    # each spec's segments run along its cut dim: every HF row (or column) of every tensor, exactly once
    assert set(rows) == set(shapes)
    for s in specs:
        for seg in s.segments:
            if seg.hf_name is not None:
                assert rows[seg.hf_name] == shapes[seg.hf_name][s.cut_dim]
    experts = [s for s in specs if s.ep is not None]
    assert len(experts) == 2 * len(arch.moe.layers) * arch.moe.num_experts
    assert {s.ep for s in experts} == set(range(ep)) and all(s.axis == "etp" and s.parts == etp for s in experts)


def test_expert_rank_order_is_megatron_cores():
    from megatron.core.parallel_state import RankGenerator
    for tp, pp, dp, ep, etp in [(2, 1, 4, 2, 2), (1, 2, 4, 4, 1), (2, 2, 2, 2, 1), (1, 1, 8, 2, 2)]:
        lay = Placement.layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
        world = lay.world_size
        gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        for group in gen.get_ranks("ep"):
            assert len({lay.expert_coords(r)[1] for r in group}) == ep        # EP indices along each EP group
            assert len({lay.expert_coords(r)[0::2] for r in group}) == 1       # ... and nothing else varies
        for r in range(world):
            assert lay.expert_rank_of(*lay.expert_coords(r)) == r


def test_module_view_maps_transformers_fused_experts_to_checkpoint_names(tmp_path):
    from safetensors.torch import load_file
    for family in ("qwen3_moe", "mixtral"):
        model = _model(family)
        on_disk = load_file(str(save_tiny(model, None, tmp_path / family) / "model.safetensors"))
        view = hf_checkpoint_view(dict(model.named_parameters()), arch_from_hf(model.config))
        assert set(view) == set(on_disk) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
        assert all(torch.equal(view[k], on_disk[k]) for k in view)


def _cfg(**kw):
    base = dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-6)
    return SimpleNamespace(**{**base, **kw})


def test_refusals_name_the_bad_value():
    with pytest.raises(VerlConfigError, match="deepseek_v3.*mixture-of-experts variant.*group-limited"):
        arch_from_hf(_cfg(model_type="deepseek_v3"))
    with pytest.raises(VerlConfigError, match="router_jitter_noise=0.1"):
        arch_from_hf(_cfg(model_type="mixtral", num_local_experts=4, intermediate_size=16, router_jitter_noise=0.1))
    with pytest.raises(VerlConfigError, match="num_experts_per_tok=5 must be in \\[1, 4\\]"):
        arch_from_hf(_cfg(num_experts_per_tok=5))
    arch = arch_from_hf(_cfg())
    with pytest.raises(VerlConfigError, match="ep=3 does not divide the 4 experts"):
        parallel_layout(arch, 1, ep=3)
    with pytest.raises(VerlConfigError, match="intermediate size 16 is not divisible by actor.megatron.etp=3"):
        parallel_layout(arch, 1, etp=3)
    olmoe = arch_from_hf(_cfg(model_type="olmoe", num_key_value_heads=2, num_attention_heads=4, intermediate_size=16))
    with pytest.raises(VerlConfigError, match="tp=4 does not divide num_key_value_heads=2"):
        parallel_layout(olmoe, 4)
    with pytest.raises(VerlConfigError, match="qwen3 has no experts"):
        parallel_layout(arch_from_hf(tiny_config(family="qwen3")), 1, ep=2)
    with pytest.raises(VerlConfigError, match="etp=2 x ep=2 x pp=1 = 4 does not divide the 2 ranks"):
        Placement.layout(tp=2, pp=1, dp=1, ep=2)


def test_mixed_dense_and_sparse_layers():
    arch = arch_from_hf(_cfg(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert arch.moe.layers == (1,)
    shapes = hf_tensor_shapes(arch)
    assert "model.layers.0.mlp.gate_proj.weight" in shapes and "model.layers.3.mlp.down_proj.weight" in shapes
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in shapes
    assert "model.layers.1.mlp.gate_proj.weight" not in shapes
