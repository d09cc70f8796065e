"""The TP x PP x SP layout matrix against transformers on random checkpoints saved to disk (float32, gloo).

One 4-rank spawn runs every case (spawning and importing megatron dominate the cost on CPU); each layout
re-initialises megatron's parallel state, with the remaining ranks as data-parallel replicas:

* logits equal transformers' (left- and right-padded rows) within 1e-4;
* the loss and every gradient, mapped back to HF names, equal transformers';
* checkpoint -> megatron -> export is bit-exact (same tensor names, dtypes and bytes);
* a few AdamW steps with grad clipping give transformers' losses (the distributed optimizer wherever
  there are DP replicas), and a saved/loaded training state resumes to the same loss.

Cases beyond the main Llama one cover GQA with KV heads = query heads (MHA), KV heads < TP (megatron splits
a query group across ranks), qkv bias (Qwen2), tied embeddings across pipeline stages, Llama-3 and linear
RoPE scaling, Mistral, and vocab sizes not divisible by TP.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests.models import _workers
from tests.models._reference import hf_reference
from verl.testing import run_distributed
from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer

LOGIT_TOL = 1e-4
GRAD_TOL = 1e-4
LOSS_TOL = 1e-5
STEPS = 3
LR = 1e-2
ALL_LAYOUTS = [(1, 1, False), (1, 2, False), (2, 1, False), (2, 1, True), (2, 2, False), (2, 2, True)]

CASES = {
    # name: (family, checkpoint kwargs, layouts, job options)
    "llama gqa kv2<q4 untied V101": ("llama", dict(num_kv_heads=2, vocab_size=101), ALL_LAYOUTS,
                                      dict(dist_opt=True, resume_layouts=[(2, 1, True), (2, 2, True)])),
    "llama mha kv4 tied V101 rope-llama3": (
        "llama", dict(num_kv_heads=4, vocab_size=101, tie_word_embeddings=True, max_position_embeddings=16384,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
        [(2, 2, True)], {}),
    "qwen2 kv1<tp2 qkv-bias tied V99 rope-linear": (
        "qwen2", dict(num_kv_heads=1, vocab_size=99, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        [(2, 1, True)], {}),
    "mistral kv2 untied V128 sharded-ckpt+tokenizer recompute": (
        "mistral", dict(num_kv_heads=2, vocab_size=128, max_shard_size="60KB", with_tokenizer=True), [(2, 2, False)],
        dict(recompute=True)),
}
VALUE_LAYOUTS = [(2, 1, True)]


def _checkpoint(path, family, *, seed, max_shard_size=None, with_tokenizer=False, **shape):
    """A random checkpoint on disk; norms and biases get noise so that a layout mistake in them shows."""
    model = tiny_model(family=family, seed=seed, noise=0.1, **shape)
    tok = tiny_tokenizer(vocab_size=model.config.vocab_size) if with_tokenizer else None
    return save_tiny(model, tok, path, max_shard_size=max_shard_size)


def _batch(vocab, b=2, s=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :2] = 0      # left padding
    mask[1, -2:] = 0     # right padding
    return ids, mask


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    jobs = []
    for i, (name, (family, kw, layouts, opts)) in enumerate(CASES.items()):
        path = _checkpoint(root / f"case{i}", family, seed=i, **kw)
        batch = _batch(kw["vocab_size"], seed=i)
        ref = hf_reference(path, *batch, steps=STEPS, lr=LR)
        jobs.append(dict(name=name, path=path, out_dir=str(root / f"out{i}"), layouts=layouts, batch=batch,
                         ref=ref, steps=STEPS, lr=LR, **opts))
    jobs.append(dict(jobs[0], name="critic", kind="value", layouts=VALUE_LAYOUTS, out_dir=str(root / "value")))
    t0 = time.monotonic()
    per_rank = run_distributed(_workers.matrix_body, 4, args=(jobs,), timeout=900)
    elapsed = time.monotonic() - t0
    merged: dict = {}
    for rank_results in per_rank:           # each rank reports what it saw (last stage: loss, rank 0: export)
        for r in rank_results:
            slot = merged.setdefault((r["case"], r["layout"]), {})
            for k, v in r.items():
                if isinstance(v, dict) and isinstance(slot.get(k), dict):
                    slot[k].update(v)      # per-rank facts (bytes read, group ranks)
                else:
                    slot[k] = v
    refs = {j["name"]: j["ref"] for j in jobs}
    refs["__paths__"] = {j["name"]: j["path"] for j in jobs}
    report = [{"case": c, "tp": lay[0], "pp": lay[1], "sp": lay[2], "max_logit_diff": r["logit_diff"],
               "max_grad_diff": r.get("grad_diff"), "export_bit_exact": r.get("export_exact"),
               "step_losses": r["step_losses"], "hf_step_losses": refs[c]["step_losses"],
               "distributed_optimizer": r["dist_opt"]} for (c, lay), r in merged.items() if c != "critic"]
    if os.environ.get("VERL_WRITE_RESULTS"):   # the layout table for docs/reports, only when asked
        from verl.utils.results import RunInfo, write_result
        run = RunInfo.start(command="VERL_WRITE_RESULTS=1 python -m pytest -q tests/models/test_matrix.py")
        out = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "megatron_layout_matrix.json"
        write_result(out, {"seconds": elapsed, "cases": report}, run)
    for row in report:
        print(f"{row['case']:<45} tp={row['tp']} pp={row['pp']} sp={int(row['sp'])} "
              f"max|dlogit|={row['max_logit_diff']:.1e} max|dgrad|={row['max_grad_diff']:.1e}")
    return merged, refs


def _cases():
    return [(name, layout) for name, (_, _, layouts, _) in CASES.items() for layout in layouts]


def _id(case):
    name, (tp, pp, sp) = case
    return f"{name.split()[0]}-{name.split()[1]}-tp{tp}pp{pp}{'sp' if sp else ''}"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_logits_match_transformers(matrix, case):
    results, _ = matrix
    assert results[case]["logit_diff"] <= LOGIT_TOL


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_loss_and_grads_match_transformers(matrix, case):
    results, refs = matrix
    r = results[case]
    assert abs(r["loss"] - refs[case[0]]["loss"]) <= LOSS_TOL
    assert r["grad_names_match"]
    assert r["grad_diff"] <= GRAD_TOL


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_export_is_bit_exact(matrix, case):
    results, _ = matrix
    assert results[case]["export_exact"] is True


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_optimizer_steps_match_transformers_adamw(matrix, case):
    results, refs = matrix
    got, want = results[case]["step_losses"], refs[case[0]]["step_losses"]
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, want, strict=False)) <= 1e-4, (got, want)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_training_state_resumes(matrix):
    results, _ = matrix
    resumed = [r for r in results.values() if "resumed_last_loss" in r]
    assert {r["dist_opt"] for r in resumed} == {True, False}, "resume must cover both optimizers"
    for r in resumed:
        assert abs(r["resumed_last_loss"] - r["step_losses"][-1]) <= 1e-6
        assert abs(r["resumed_continued_loss"] - r["continued_loss"]) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_log_probs_and_entropy_with_temperature(matrix, case):
    results, _ = matrix
    assert results[case]["logprob_diff"] <= LOGIT_TOL
    assert results[case]["entropy_diff"] <= LOGIT_TOL


@pytest.mark.multiprocess
@pytest.mark.slow
def test_each_rank_reads_only_its_slices(matrix):
    results, refs = matrix
    name = next(iter(CASES))
    path = Path(refs["__paths__"][name])
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    for (case, (tp, pp, _sp)), r in results.items():
        if case != name:
            continue
        assert len(r["bytes_read"]) == 4
        for nbytes in r["bytes_read"].values():
            if tp * pp == 1:
                assert nbytes > 0.9 * total
            else:    # a rank reads about 1/(tp*pp) of the model (norms are replicated, hence the slack)
                assert nbytes < total * (1.0 / (tp * pp) + 0.15), (tp, pp, nbytes, total)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_process_groups_cover_the_world(matrix):
    results, _ = matrix
    for (_case, (tp, pp, _sp)), r in results.items():
        if "groups" not in r:
            continue
        coords = set()
        for rank, (tpr, ppr, dpr, tps, pps, dps) in r["groups"].items():
            assert (tps, pps, dps) == (tp, pp, 4 // (tp * pp))
            coords.add((tpr, ppr, dpr))
            assert rank % tp == tpr            # megatron's order: TP fastest, PP slowest
            assert rank // (4 // pp) == ppr
        assert len(coords) == 4


@pytest.mark.multiprocess
@pytest.mark.slow
def test_export_loads_in_transformers_with_tokenizer(matrix):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    results, refs = matrix
    name = "mistral kv2 untied V128 sharded-ckpt+tokenizer recompute"
    r = results[(name, CASES[name][2][0])]
    export = Path(r["export_dir"])
    src = Path(refs["__paths__"][name])
    assert (src / "model.safetensors.index.json").exists()     # the source checkpoint was sharded
    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(export))
    ids = torch.tensor([tok("the quick brown fox")["input_ids"]]) % model.config.vocab_size
    with torch.no_grad():
        out = model(ids).logits
    assert torch.equal(out, AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)(ids).logits)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_critic_value_head(matrix):
    from transformers import AutoModelForTokenClassification
    results, refs = matrix
    r = results[("critic", VALUE_LAYOUTS[0])]
    assert set(r["missing"]) == {"output_layer.value_head.weight", "output_layer.value_head.bias"}
    hf = AutoModelForTokenClassification.from_pretrained(r["export_dir"], dtype=torch.float32).eval()
    job = CASES[next(iter(CASES))]
    ids, mask = _batch(job[1]["vocab_size"], seed=0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.squeeze(-1)
    assert float(((r["values"] - want).abs() * mask).max()) <= LOGIT_TOL
    # Same three AdamW steps (clip 1.0) on transformers' token classifier from the same export.
    returns = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    # eval(): the HF token classifier has dropout before its head (megatron's critic has none)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.0)
    want_losses = []
    for _ in range(3):
        opt.zero_grad()
        values = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.squeeze(-1)
        rows = [(((values[i] - returns[i]) ** 2) * mask[i]).sum() / mask[i].sum() for i in range(ids.shape[0])]
        loss = torch.stack(rows).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        want_losses.append(float(loss.detach()))
    got = r["value_losses"]
    assert max(abs(a - b) for a, b in zip(got, want_losses, strict=True)) <= 1e-4, (got, want_losses)
