"""Padding-free training (verl/workers/packing.py): packed micro-batches and token-budget micro-batches give the
padded path's log-probs, entropy, values, losses and (data-parallel averaged) gradients, on the torch, FSDP and
megatron engines, for batches with empty and single-token responses and holes in the response mask."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from verl.config import ActorConfig, CriticConfig, MegatronConfig, OptimConfig, TinyModelConfig
from verl.errors import VerlConfigError
from verl.workers.batch import RolloutBatch
from verl.workers.packing import (_split_to, block_causal_mask, micro_batch_slices, pack, padded_token_share,
                                  token_budget_slices)
from verl.workers.varlen_attention import VARLEN

SHAPE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
R = 12
TOL = dict(rtol=1e-5, atol=1e-6)
# (prompt, response) lengths per row: an empty response, single-token ones, one that fills all R columns
LENGTHS = [[(3, 5), (7, 1), (1, 0), (5, 12), (4, 3), (2, 9), (6, 7), (3, 2)],
           [(2, 12), (5, 0), (4, 1), (1, 11), (6, 4), (3, 1), (2, 3), (1, 2)]]
CONFIGS = {"packed": dict(padding_free=True), "packed_budget": dict(padding_free=True, max_tokens_per_micro_batch=24),
           "padded_budget": dict(padding_free=False, max_tokens_per_micro_batch=24)}


def make_batch(lengths: list[tuple[int, int]], seed: int = 0, vocab: int = 96, prompt_cols: int = 0) -> RolloutBatch:
    """Left-padded prompts (to at least `prompt_cols` columns), right-padded responses (RolloutBatch's layout),
    a hole in one response's mask (rollout correction rejects tokens that way)."""
    g = torch.Generator().manual_seed(seed)
    B, P = len(lengths), max(prompt_cols, *(p for p, _ in lengths))
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, (p, r) in enumerate(lengths):
        ids[b, P - p:P + r] = torch.randint(3, vocab, (p + r,), generator=g)
        attn[b, P - p:P + r] = 1
    mask = attn[:, P:].float()
    mask[3, 4:6] = 0
    return RolloutBatch(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                        response_mask=mask, group=torch.arange(B) // 4)


def _model(seed: int = 3):
    from verl.models.tiny import tiny_model, tiny_tokenizer
    return tiny_model(SHAPE, tokenizer=tiny_tokenizer(None, 96), tie_word_embeddings=True, seed=seed, noise=0.1)


def _inputs(batch: RolloutBatch, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    m = batch.response_mask
    return {"adv": torch.randn(len(batch), 1, generator=g) * m,
            "ref": (torch.randn(m.shape, generator=g) * 0.1 - 2) * m,
            "returns": torch.randn(m.shape, generator=g) * m}


# ------------------------------------------------------------------------------------------------ packing itself

def test_pack_layout_positions_and_targets():
    batch = make_batch(LENGTHS[0])
    P = batch.prompt_length
    p = pack(batch)
    lengths = [a + b for a, b in LENGTHS[0]]
    assert p.num_tokens == sum(lengths) and p.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert p.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    assert torch.equal(p.input_ids[0], batch.input_ids[batch.attention_mask.bool()])
    # every real response token but the first is predicted by the real token before it, within its row
    assert len(p.src) == sum(r for _, r in LENGTHS[0]) and p.max_seqlen == max(lengths)
    assert torch.equal(p.seq_ids[p.src], p.rows) and torch.equal(p.input_ids[0, p.src + 1], p.targets)
    assert torch.equal(p.targets, batch.input_ids[p.rows, P + p.cols])
    out = p.unpack(torch.arange(1, len(p.src) + 1, dtype=torch.float))
    assert out.shape == (8, R) and torch.equal(out > 0, batch.attention_mask[:, P:].bool())
    padded = pack(batch, multiple=8)
    assert padded.num_tokens % 8 == 0 and padded.seq_ids[-1] == 8 and torch.equal(padded.src, p.src)


def test_block_causal_mask_keeps_attention_within_sequences():
    m = block_causal_mask(torch.tensor([0, 0, 1, 1, 1, 2]))[0, 0]
    allowed = ~m
    assert allowed[1, 0] and allowed[4, 2] and not allowed[2, 1] and not allowed[0, 1] and not allowed[5, 4]
    assert allowed.diagonal().all()


def test_token_budget_slices_and_equalisation():
    assert token_budget_slices([5, 5, 5, 9, 1], 10) == [slice(0, 2), slice(2, 3), slice(3, 5)]
    with pytest.raises(VerlConfigError, match="sequence of 11 tokens.*max_tokens_per_micro_batch=10"):
        token_budget_slices([3, 11], 10)
    assert _split_to([slice(0, 4), slice(4, 5)], 4) == [slice(0, 1), slice(1, 2), slice(2, 4), slice(4, 5)]
    with pytest.raises(VerlConfigError, match="needs 3 micro-batches.*only 2 rows"):
        _split_to([slice(0, 1), slice(1, 2)], 3)
    batch = make_batch(LENGTHS[0])
    assert micro_batch_slices(batch, 3) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    sl = micro_batch_slices(batch, 3, max_tokens=24)
    assert all(int(batch.attention_mask[s].sum()) <= 24 for s in sl) and sl[-1].stop == 8
    assert 0.4 < padded_token_share(batch, micro_batch_slices(batch, 8)) < 0.6


# ------------------------------------------------------------------------------------- engines: one comparison

def _capture_grads(engine) -> dict:
    """Makes the engine record its data-parallel averaged gradients (before the optimizer step)."""
    box = {}
    reduce = engine._reduce_grads

    def record():
        reduce()
        box.update({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                    for n, p in engine.module.named_parameters() if p.grad is not None})
    engine._reduce_grads = record
    return box


def _run_module_engine(make_engine, batch, inputs, overrides: dict, agg: str) -> dict:
    """log-probs, values, actor and critic update results and gradients on one engine setup."""
    from verl.workers import ActorWorker, CriticWorker
    acfg = ActorConfig(micro_batch_size=3, optim=OptimConfig(lr=1e-2), loss_agg_mode=agg, use_kl_loss=True,
                       entropy_coeff=0.01, **overrides)
    actor = ActorWorker(make_engine("lm"), acfg, temperature=0.9, responses_per_mini=len(batch), max_response_length=R)
    grads = _capture_grads(actor.engine)
    lp, ent = actor.compute_log_probs(batch)
    stats = actor.update(batch, lp.detach() - 0.05 * batch.response_mask, inputs["adv"], inputs["ref"])
    critic = CriticWorker(make_engine("value"), CriticConfig(micro_batch_size=3, **overrides))
    cgrads = _capture_grads(critic.engine)
    values = critic.compute_values(batch)
    cstats = critic.update(batch, values, inputs["returns"])
    return {"lp": lp, "ent": ent, "values": values, "pg_loss": stats["actor/pg_loss"], "kl": stats["actor/kl_loss"],
            "vf_loss": cstats["critic/vf_loss"], "grads": dict(grads), "cgrads": dict(cgrads)}


def _value_model(model):
    from verl.workers import ValueModel
    vm = ValueModel.from_causal_lm(model)
    vm.value_head.weight.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return vm


def _compare(results: dict) -> list[str]:
    """Mismatches of each config against the padded count-based run (empty: all equal)."""
    ref, bad = results["padded"], []
    for name, res in results.items():
        for key in ("lp", "ent", "values"):
            if not torch.allclose(res[key], ref[key], **TOL):
                bad.append(f"{name} {key}: {float((res[key] - ref[key]).abs().max()):.3g}")
        for key in ("pg_loss", "kl", "vf_loss"):
            if res[key] != pytest.approx(ref[key], rel=1e-5, abs=1e-7):
                bad.append(f"{name} {key}: {res[key]} vs {ref[key]}")
        for key in ("grads", "cgrads"):
            assert res[key].keys() == ref[key].keys() and ref[key], (name, key)
            worst = max(float((res[key][n] - ref[key][n]).abs().max()) for n in ref[key])
            if not all(torch.allclose(res[key][n], ref[key][n], **TOL) for n in ref[key]):
                bad.append(f"{name} {key}: {worst:.3g}")
    return bad


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_torch_engine_packed_equals_padded(agg):
    from verl.distributed import init_placement
    from verl.workers import TorchEngine
    placement = init_placement("cpu")
    model, batch = _model(), make_batch(LENGTHS[0])
    inputs = _inputs(batch, 0)

    def make(head):
        module = copy.deepcopy(model) if head == "lm" else _value_model(model)
        return TorchEngine(module, OptimConfig(lr=1e-2), placement, head=head, total_steps=5)
    results = {name: _run_module_engine(make, batch, inputs, overrides, agg)
               for name, overrides in {"padded": dict(padding_free=False), **CONFIGS}.items()}
    assert _compare(results) == []
    assert float(results["padded"]["lp"].abs().max()) > 1 and results["padded"]["pg_loss"] != 0


def _dp_body(rank, world):
    """Each rank its own rows (different lengths, so the token budget gives the ranks different micro-batch
    counts before equalisation); torch (all-reduce) and FSDP2 (reduce-scatter) engines."""
    from verl.config import FSDPConfig
    from verl.distributed import init_placement
    from verl.workers import TorchEngine
    from verl.workers.fsdp import FSDPEngine
    placement = init_placement("cpu")
    model, batch = _model(), make_batch(LENGTHS[rank], seed=rank)
    inputs = _inputs(batch, rank)
    counts = [len(micro_batch_slices(batch, 3, 24, placement.dp)),
              len(token_budget_slices(batch.attention_mask.sum(-1).tolist(), 24))]
    out = {"counts": counts}
    engines = {"torch": lambda m, h: TorchEngine(m, OptimConfig(lr=1e-2), placement, head=h, total_steps=5),
               "fsdp": lambda m, h: FSDPEngine(m, OptimConfig(lr=1e-2), placement, FSDPConfig(), head=h, total_steps=5)}
    for engine, build in engines.items():
        def make(head):
            return build(copy.deepcopy(model) if head == "lm" else _value_model(model), head)
        results = {name: _run_module_engine(make, batch, inputs, overrides, "token-mean")
                   for name, overrides in {"padded": dict(padding_free=False), **CONFIGS}.items()}
        out[engine] = _compare(results)
        out[f"{engine}_grads"] = results["packed"]["grads"]
    # FSDP2 with prefix trees (each rank its own rows: make_tree_batch, rank 1's responses shifted)
    tree_batch = make_tree_batch(shift=rank)
    tree_inputs = _inputs(tree_batch, rank)
    def make():
        return engines["fsdp"](copy.deepcopy(model), "lm")
    padded = _run_tree_actor(make, tree_batch, tree_inputs, 3, dict(padding_free=False))
    tree = _run_tree_actor(make, tree_batch, tree_inputs, 3, dict(padding_free=True, share_prompt_prefix=True))
    out["fsdp_tree"] = [k for k, a, b in (("lp", tree[0], padded[0]), ("ent", tree[1], padded[1]))
                        if not torch.allclose(a, b, **TOL)]
    out["fsdp_tree"] += [n for n in padded[3] if not torch.allclose(tree[3][n], padded[3][n], **TOL)]
    out["fsdp_tree_ratio"] = tree[2]["actor/tree_token_ratio"]
    # ... and the critic's (critic.share_prompt_prefix)
    def make_value():
        return engines["fsdp"](_value_model(model), "value")
    padded = _run_tree_critic(make_value, tree_batch, tree_inputs, 3, dict(padding_free=False))
    tree = _run_tree_critic(make_value, tree_batch, tree_inputs, 3, dict(padding_free=True, share_prompt_prefix=True))
    out["fsdp_critic_tree"] = ([] if torch.allclose(tree[0], padded[0], **TOL) else ["values"]) + \
        [n for n in padded[2] if not torch.allclose(tree[2][n], padded[2][n], **TOL)]
    out["fsdp_critic_tree_ratio"] = tree[1]["critic/tree_token_ratio"]
    return out


@pytest.mark.multiprocess
def test_torch_and_fsdp_engines_packed_equal_padded_over_two_ranks():
    from verl.testing import run_distributed
    r0, r1 = run_distributed(_dp_body, 2, timeout=500)
    assert r0["torch"] == [] and r1["torch"] == [] and r0["fsdp"] == [] and r1["fsdp"] == []
    assert r0["fsdp_tree"] == [] and r1["fsdp_tree"] == [] and r0["fsdp_tree_ratio"] > 1.3
    assert r0["fsdp_critic_tree"] == [] and r1["fsdp_critic_tree"] == [] and r0["fsdp_critic_tree_ratio"] > 1.3
    # the budget cut the ranks' batches into different counts, equalised to the larger one
    assert r0["counts"][1] != r1["counts"][1] and r0["counts"][0] == r1["counts"][0] == max(r0["counts"][1],
                                                                                         r1["counts"][1])
    for n, g in r0["torch_grads"].items():  # the averaged gradient is the same on both ranks, and both engines
        torch.testing.assert_close(r1["torch_grads"][n], g, **TOL)
        torch.testing.assert_close(r0["fsdp_grads"][n], g, **TOL)


# ------------------------------------------------------------------------------------------------- megatron

def _megatron_grads(monkeypatch, box: dict) -> None:
    """Records the megatron model's reduced gradients (main_grad) before each optimizer step."""
    import verl.models.optimizer as opt
    apply = opt.apply_update

    def record(model, optimizer, outs, **kw):
        box.setdefault(model.options.value_head, {}).update(
            {n: p.main_grad.clone() for n, p in model.gpt.named_parameters()
             if getattr(p, "main_grad", None) is not None})
        return apply(model, optimizer, outs, **kw)
    monkeypatch.setattr(opt, "apply_update", record)


def _run_megatron(path, placement, batch, inputs, overrides) -> dict:
    from verl.workers import ActorWorker, CriticWorker
    from verl.workers.megatron import MegatronEngine
    optim = OptimConfig(lr=1e-2)
    acfg = ActorConfig(micro_batch_size=2, optim=optim, use_kl_loss=True, entropy_coeff=0.01, **overrides)
    actor = ActorWorker(MegatronEngine(path, placement, MegatronConfig(), optim=optim, total_steps=5), acfg,
                        temperature=0.9, responses_per_mini=len(batch), max_response_length=R)
    lp, ent = actor.compute_log_probs(batch)
    stats = actor.update(batch, lp.detach() - 0.05 * batch.response_mask, inputs["adv"], inputs["ref"])
    torch.manual_seed(7)  # the value head is not in the HF directory: the same random init in every run
    critic = CriticWorker(MegatronEngine(path, placement, MegatronConfig(), value_head=True, optim=optim,
                                         total_steps=5), CriticConfig(micro_batch_size=2, **overrides))
    values = critic.compute_values(batch)
    cstats = critic.update(batch, values, inputs["returns"])
    return {"lp": lp, "ent": ent, "values": values, "pg_loss": stats["actor/pg_loss"], "kl": stats["actor/kl_loss"],
            "vf_loss": cstats["critic/vf_loss"]}


def _megatron_compare(path, placement, batch, inputs, monkeypatch_like) -> list[str]:
    results = {}
    for name, overrides in {"padded": dict(padding_free=False), **CONFIGS}.items():
        box: dict = {}
        monkeypatch_like(box)
        results[name] = _run_megatron(path, placement, batch, inputs, overrides)
        results[name].update(grads=box[False], cgrads=box[True])
    return _compare(results)


@pytest.fixture
def megatron_dir(tmp_path):
    import torch.distributed as dist

    from verl.distributed import destroy_process_groups, init_placement
    from verl.models.tiny import save_tiny, tiny_tokenizer
    placement = init_placement("cpu", megatron=True)
    yield placement, save_tiny(_model(), tiny_tokenizer(None, 96), tmp_path / "hf")
    destroy_process_groups()
    dist.destroy_process_group()


def test_megatron_engine_packed_equals_padded(megatron_dir, monkeypatch):
    placement, path = megatron_dir
    batch = make_batch(LENGTHS[0])
    bad = _megatron_compare(path, placement, batch, _inputs(batch, 0), lambda box: _megatron_grads(monkeypatch, box))
    assert bad == []


def _megatron_tree_compare(path, placement, batch, monkeypatch_like) -> list[str]:
    """The actor's log-probs, loss and gradients, and the critic's values, loss and gradients, as prefix trees
    (one micro-batch cutting a group, RoPE at the position ids) against the padded run."""
    from verl.workers import ActorWorker, CriticWorker
    from verl.workers.megatron import MegatronEngine
    inputs, optim, res = _inputs(batch, 0), OptimConfig(lr=1e-2), {}
    for name, overrides in {"padded": dict(padding_free=False),
                            "tree": dict(padding_free=True, share_prompt_prefix=True)}.items():
        box: dict = {}
        monkeypatch_like(box)
        cfg = ActorConfig(micro_batch_size=3, optim=optim, use_kl_loss=True, entropy_coeff=0.01, **overrides)
        actor = ActorWorker(MegatronEngine(path, placement, MegatronConfig(), optim=optim, total_steps=5), cfg,
                            temperature=0.9, responses_per_mini=len(batch), max_response_length=R)
        lp, ent = actor.compute_log_probs(batch)
        stats = actor.update(batch, lp.detach() - 0.05 * batch.response_mask, inputs["adv"], inputs["ref"])
        torch.manual_seed(7)  # the value head is not in the HF directory: the same random init in every run
        critic = CriticWorker(MegatronEngine(path, placement, MegatronConfig(), value_head=True, optim=optim,
                                             total_steps=5), CriticConfig(micro_batch_size=3, **overrides))
        values = critic.compute_values(batch)
        cstats = critic.update(batch, values, inputs["returns"])
        res[name] = (lp, ent, stats, box[False])
        res["critic_" + name] = (values, cstats, box[True])
    (values, cstats, cgrads), (values2, cstats2, cgrads2) = res["critic_padded"], res["critic_tree"]
    bad = [] if torch.allclose(values2, values, **TOL) else [f"values: {float((values2 - values).abs().max()):.3g}"]
    if cstats2["critic/vf_loss"] != pytest.approx(cstats["critic/vf_loss"], rel=1e-5, abs=1e-7):
        bad.append(f"vf_loss {cstats2['critic/vf_loss']} vs {cstats['critic/vf_loss']}")
    bad += [f"critic grad {n}" for n in cgrads if not torch.allclose(cgrads2[n], cgrads[n], **TOL)]
    if not cgrads or cstats2.get("critic/tree_token_ratio", 0) < 1.3:
        bad.append(f"no critic gradients or nothing shared: {cstats2.get('critic/tree_token_ratio')}")
    (lp, ent, stats, grads), (lp2, ent2, stats2, grads2) = res["padded"], res["tree"]
    bad += [f"{k}: {float((a - b).abs().max()):.3g}" for k, a, b in (("lp", lp2, lp), ("ent", ent2, ent))
            if not torch.allclose(a, b, **TOL)]
    if stats2["actor/pg_loss"] != pytest.approx(stats["actor/pg_loss"], rel=1e-5, abs=1e-7):
        bad.append(f"pg_loss {stats2['actor/pg_loss']} vs {stats['actor/pg_loss']}")
    bad += [f"grad {n}" for n in grads if not torch.allclose(grads2[n], grads[n], **TOL)]
    if not grads or stats2.get("actor/tree_token_ratio", 0) < 1.3:
        bad.append(f"no gradients or nothing shared: {stats2.get('actor/tree_token_ratio')}")
    return bad


def test_megatron_prefix_tree_equals_padded(megatron_dir, monkeypatch):
    placement, path = megatron_dir
    assert _megatron_tree_compare(path, placement, make_tree_batch(),
                                  lambda box: _megatron_grads(monkeypatch, box)) == []


def _megatron_tp2_body(rank, world, path):
    from verl.distributed import destroy_process_groups, init_placement
    placement = init_placement("cpu", tp=2, sequence_parallel=True)
    batch = make_batch(LENGTHS[0], prompt_cols=8)  # the padded path needs P + R divisible by tp under SP
    mp = pytest.MonkeyPatch()
    try:
        bad = _megatron_compare(path, placement, batch, _inputs(batch, 0), lambda box: _megatron_grads(mp, box))
        bad += _megatron_tree_compare(path, placement, make_tree_batch(), lambda box: _megatron_grads(mp, box))
    finally:
        mp.undo()
        destroy_process_groups()
    return bad


@pytest.mark.multiprocess
def test_megatron_tensor_parallel_packed_equals_padded(tmp_path):
    """TP=2 with sequence parallelism: the packed row (and the prefix tree) is padded to a multiple of the TP
    size."""
    from verl.testing import run_distributed
    from verl.models.tiny import save_tiny, tiny_tokenizer
    path = save_tiny(_model(), tiny_tokenizer(None, 96), tmp_path / "hf")
    assert run_distributed(_megatron_tp2_body, 2, args=(str(path),), timeout=500) == [[], []]


def test_token_budget_below_the_longest_response_is_refused():
    from verl.config import PPOConfig, load_config
    with pytest.raises(VerlConfigError, match="actor.max_tokens_per_micro_batch=10 cannot hold"):
        load_config(PPOConfig, None, ["actor.max_tokens_per_micro_batch=10"])


def test_verl_train_padding_free_matches_padded(tmp_path):
    """`verl train` (PPO with a critic and the KL loss) with padding-free token-budget micro-batches: the same
    first-step losses as the padded run, the same rollouts, finite metrics."""
    import json

    from verl.cli.main import main
    from tests.trainer.conftest import TINY
    base = ["train", *TINY, "algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "trainer.export_hf=false",
            "trainer.plot=false", "trainer.save_final=false"]
    runs = {"padded": ["actor.padding_free=false", "critic.padding_free=false"],
            "packed": ["actor.padding_free=true", "critic.padding_free=true", "actor.max_tokens_per_micro_batch=40",
                       "critic.max_tokens_per_micro_batch=40"],
            "trees": ["actor.share_prompt_prefix=true", "critic.share_prompt_prefix=true"]}
    steps = {}
    for name, extra in runs.items():
        assert main([*base, *extra, f"trainer.output_dir={tmp_path / name}"]) == 0
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        steps[name] = [r for r in rows if "reward/mean" in r]
    assert len(steps["packed"]) == len(steps["padded"]) == len(steps["trees"]) == 2
    first_padded = steps["padded"][0]
    for name in ("packed", "trees"):
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/grad_norm",
                    "critic/grad_norm"):
            assert steps[name][0][key] == pytest.approx(first_padded[key], rel=1e-4, abs=1e-7), (name, key)
    # the trees shared the groups' prompts in both roles' passes
    assert steps["trees"][0]["critic/tree_token_ratio"] > 1.2 and steps["trees"][0]["actor/tree_token_ratio"] > 1.2
    assert "critic/tree_token_ratio" not in steps["packed"][0]


def test_model_without_masking_utils_is_refused_for_packing():
    from verl.workers.packing import check_varlen_attention

    class Trunk(torch.nn.Module):  # modeling code that would ignore the restarting position ids
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)
    with pytest.raises(VerlConfigError, match="Trunk .* does not build its attention mask.*padding_free=false"):
        check_varlen_attention(Trunk())
    assert check_varlen_attention(_model()) == VARLEN


# ---------------------------------------------------------------------- per-sequence (varlen) attention, no [T, T] mask

FAMILIES = {"llama": dict(family="llama", num_kv_heads=4), "qwen2_gqa": dict(family="qwen2", num_kv_heads=1),
            "mistral_window": dict(family="mistral", sliding_window=4)}


def _outputs_and_grads(model, batch, packed) -> tuple[torch.Tensor, torch.Tensor, float, dict]:
    """(log-probs, entropy [b, R], a loss over both, its parameter gradients), padded or from `packed`."""
    from verl.workers.engine import head_outputs, packed_head_outputs
    model.zero_grad(set_to_none=True)
    if packed is None:
        out = head_outputs(model, "lm", batch.input_ids, batch.attention_mask, batch.position_ids, batch.responses,
                           batch.prompt_length, 0.9)
    else:
        out = packed_head_outputs(model, "lm", packed, 0.9)
    m = batch.response_mask  # the padded path's outputs at padding columns are not defined
    lp, ent = out["log_probs"] * m, out["entropy"] * m
    loss = (lp * torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype).view_as(lp) + 0.1 * ent).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), loss.item(), grads


@pytest.mark.parametrize("batched", [False, True], ids=["per_sequence", "batched"])
@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_attention_equals_padded_without_a_mask(family, batched, monkeypatch):
    """float64: the packed forward through verl's varlen attention (one SDPA call per sequence, or one over the
    sequences right-padded to the longest) gives the padded batch's log-probs, entropy, loss and gradients; no
    mask reaches it or is built (transformers' SDPA mask builder is not called, no SDPA call spans sequences,
    a mask only where the sliding window cuts a sequence), and the model's own attention is back afterwards."""
    import transformers.masking_utils as mu

    import verl.workers.varlen_attention as va
    from verl.models.tiny import tiny_model
    model = tiny_model(SHAPE, noise=0.1, seed=3, vocab_size=96, **FAMILIES[family]).double()
    batch = make_batch(LENGTHS[0])
    batch.response_mask = batch.response_mask.double()
    lp, ent, loss, grads = _outputs_and_grads(model, batch, None)

    seen, calls = [], []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(module, query, key, value, attention_mask, **kw):
        seen.append((attention_mask, kw.get("cu_seq_lens_q")))
        return va.varlen_sdpa_attention(module, query, key, value, attention_mask, **kw)

    def sdpa_spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[0], q.shape[2], None if attn_mask is None else tuple(attn_mask.shape), kw["is_causal"]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    def no_mask_builder(*args, **kwargs):
        raise AssertionError("transformers built an SDPA mask for a packed row")
    monkeypatch.setitem(va.AttentionInterface._global_mapping, VARLEN, spy)
    monkeypatch.setitem(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", no_mask_builder)
    monkeypatch.setattr(va.F, "scaled_dot_product_attention", sdpa_spy)
    monkeypatch.setattr(va, "batch_sequences", lambda lengths: batched)
    packed = pack(batch)
    lp2, ent2, loss2, grads2 = _outputs_and_grads(model, batch, packed)

    assert len(seen) == SHAPE.num_layers and all(m is None for m, _ in seen)
    assert all(torch.equal(cu, packed.cu_seqlens) for _, cu in seen)
    lengths = [n for n in (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist() if n]
    rows = [(len(lengths), max(lengths))] if batched else [(1, n) for n in lengths]
    assert [(b, n) for b, n, _, _ in calls] == rows * SHAPE.num_layers and max(lengths) < packed.num_tokens
    window = FAMILIES[family].get("sliding_window")
    assert all((mask is None and causal) == (window is None or n <= window) for _, n, mask, causal in calls)
    assert all(mask in (None, (n, n)) for _, n, mask, _ in calls)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(lp2, lp, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ent2, ent, rtol=1e-9, atol=1e-10)
    assert loss2 == pytest.approx(loss, rel=1e-10) and abs(loss) > 1
    assert grads.keys() == grads2.keys() and len(grads) > 10
    for n in grads:
        torch.testing.assert_close(grads2[n], grads[n], rtol=1e-9, atol=1e-10, msg=n)


@pytest.mark.parametrize("batched", [False, True], ids=["per_sequence", "batched"])
def test_varlen_attention_function_against_a_block_mask(batched, monkeypatch):
    """The registered function alone: GQA heads, a sliding window, an empty sequence; and what it refuses."""
    from transformers.integrations.sdpa_attention import repeat_kv

    import verl.workers.varlen_attention as va
    monkeypatch.setattr(va, "batch_sequences", lambda lengths: batched)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 11, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 3, 9, 11], dtype=torch.int32)
    module = torch.nn.Module()
    seq = torch.repeat_interleave(torch.arange(4), cu[1:] - cu[:-1])
    i = torch.arange(11)
    for window in (None, 2):
        allowed = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])
        if window:
            allowed &= i[None, :] > i[:, None] - window
        ref = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=allowed)
        out, _ = va.varlen_sdpa_attention(module, q, k, v, None, sliding_window=window, cu_seq_lens_q=cu)
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="softcap"):
        va.varlen_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu, softcap=30.0)
    with pytest.raises(ValueError, match="no attention mask"):
        va.varlen_sdpa_attention(module, q, k, v, torch.ones(1, 1, 11, 11, dtype=torch.bool), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="rise from 0 to the packed length 11"):
        va.varlen_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 3, 10]))


def test_batch_sequences_bounds_the_padded_attention_work():
    from verl.workers.varlen_attention import batch_sequences
    assert batch_sequences([48, 40, 56, 44]) and not batch_sequences([8, 8, 1, 17, 7, 11, 13, 5])
    assert not batch_sequences([30])


def test_varlen_attention_stands_in_only_where_it_is_exact(monkeypatch):
    """Soft-capped logits keep the block mask (warned once, with the fix); flash and flex attention keep theirs."""
    import verl.workers.packing as packing
    from verl.workers.packing import check_varlen_attention
    monkeypatch.setattr(packing, "_WARNED", set())
    model = _model()
    model.config.attn_logit_softcapping = 30.0
    with pytest.warns(UserWarning, match="soft-capped.*block-diagonal \\[T, T\\] mask.*padding_free=false"):
        assert check_varlen_attention(model) == "sdpa"
    model.config.attn_logit_softcapping = None
    model.config._attn_implementation = "flex_attention"
    assert check_varlen_attention(model) == "flex_attention"


# ------------------------------------------------------------------------------ shared prompt prefix (GRPO groups)

def make_group_batch(prompt_lengths: list[int], response_lengths: list[int], n: int, seed: int = 0) -> RolloutBatch:
    """Groups of n consecutive rows with the same (left-padded) prompt and their own responses."""
    batch = make_batch([(prompt_lengths[i // n], r) for i, r in enumerate(response_lengths)], seed=seed)
    P = batch.prompt_length
    for i in range(len(response_lengths)):
        batch.input_ids[i, :P] = batch.input_ids[i - i % n, :P]
    return batch


def make_tree_batch(shift: int = 0) -> RolloutBatch:
    """Two GRPO groups of four whose prompts open with the same 2 tokens (a chat template's opening); in group 1
    rows 1 and 2 share their first 3 response tokens and row 3 repeats row 2 whole (a response that is a prefix
    of another's is laid out inside it); row 5's response is empty."""
    batch = make_group_batch([5, 4], [6, 7, 5, 5, 3, 0, 12, 1][shift:] + [6, 7, 5, 5, 3, 0, 12, 1][:shift], n=4,
                             seed=4 + shift)
    P = batch.prompt_length
    batch.input_ids[4:, P - 4:P - 2] = batch.input_ids[0, P - 5:P - 3]
    batch.input_ids[2, P:P + 3] = batch.input_ids[1, P:P + 3]
    batch.input_ids[3, P:P + 5] = batch.input_ids[2, P:P + 5]
    return batch


def test_pack_tree_lays_out_each_shared_prefix_once_with_the_padded_targets():
    from verl.workers.packing import pack_tree, tree_tokens
    batch = make_tree_batch()
    tree, plain = pack_tree(batch), pack(batch)
    # prompts once per group (-3x5, -3x4), the opening once (-2), the shared response start (-3), row 3's (-5)
    assert tree.num_tokens == plain.num_tokens - 15 - 12 - 2 - 3 - 5 == tree_tokens(batch)[0] == 38
    assert tree_tokens(batch)[1] == plain.num_tokens
    for key in ("rows", "cols", "targets"):
        assert torch.equal(getattr(tree, key), getattr(plain, key))
    # every response position predicts from the same token at the same position as in its own row
    assert torch.equal(tree.input_ids[0, tree.src], plain.input_ids[0, plain.src])
    assert torch.equal(tree.position_ids[0, tree.src], plain.position_ids[0, plain.src])
    # each output attends to exactly the tokens its own row has before it (and itself)
    att = tree.attention[0, 0]
    for r in range(len(batch)):
        at = tree.src[tree.rows == r]
        if len(at):
            own = set(tree.src[tree.rows == r].tolist())
            last = int(at[-1])
            seen = set(att[last].nonzero().flatten().tolist())
            assert len(seen) == int(batch.attention_mask[r].sum()) - 1 and own <= seen | {last}
    # segments: row 0; rows 1, 2 after the prompt (and row 1's start); row 4 after the opening; rows 6, 7
    assert [len(s.context) for s in tree.tree] == [0, 5, 8, 2, 4, 4]


def test_tree_token_budget_counts_the_shared_prefix_once_and_the_splits():
    from verl.workers.packing import tree_metrics
    batch = make_tree_batch()
    lengths = batch.attention_mask.sum(-1).tolist()
    seqs = [batch.input_ids[r][batch.attention_mask[r].bool()] for r in range(len(batch))]
    assert token_budget_slices(lengths, 30) == [slice(0, 2), slice(2, 5), slice(5, 8)]  # 75 tokens plainly
    tree = token_budget_slices(lengths, 30, seqs)
    assert tree == [slice(0, 6), slice(6, 8)]  # group 1 and most of group 2 as a tree (25 tokens); row 6 is 12 more
    # the cut splits group 2's tree: its 4 prompt tokens are computed again in the second micro-batch
    assert tree_metrics(batch, tree) == {"tree_tokens": 42, "plain_tokens": 75, "splits": 1, "split_tokens": 4}
    assert sum(pack_tree_tokens(batch, sl) for sl in tree) == 42
    assert tree_metrics(batch, [slice(0, 8)]) == {"tree_tokens": 38, "plain_tokens": 75, "splits": 0,
                                                   "split_tokens": 0}


def pack_tree_tokens(batch, sl) -> int:
    from verl.workers.packing import pack_tree
    return pack_tree(batch.select(sl)).num_tokens


def _torch_engine(model):
    from verl.distributed import init_placement
    from verl.workers import TorchEngine
    return TorchEngine(copy.deepcopy(model), OptimConfig(lr=1e-2), init_placement("cpu"), head="lm", total_steps=5)


def _run_tree_actor(make_engine, batch, inputs, micro: int, overrides: dict):
    """(log-probs, entropy, update statistics, averaged gradients) of the actor on a fresh engine."""
    from verl.workers import ActorWorker
    cfg = ActorConfig(micro_batch_size=micro, optim=OptimConfig(lr=1e-2), use_kl_loss=True, entropy_coeff=0.01,
                      **overrides)
    engine = make_engine()
    actor = ActorWorker(engine, cfg, temperature=0.9, responses_per_mini=len(batch), max_response_length=R)
    grads = _capture_grads(actor.engine)
    lp, ent = actor.compute_log_probs(batch)
    stats = actor.update(batch, lp.detach() - 0.05 * batch.response_mask, inputs["adv"], inputs["ref"])
    return lp, ent, stats, dict(grads)


@pytest.mark.parametrize("micro,budget,attention", [(3, 0, "varlen"), (8, 0, "varlen"), (8, 30, "varlen"),
                                                    (8, 0, "mask")])
def test_actor_prefix_tree_equals_padded_log_probs_losses_and_gradients(micro, budget, attention, monkeypatch):
    """The update's outputs, loss and gradients with shared prefixes computed once equal the padded path's: a tree
    split over micro-batches (3), two groups in one (8), cut by a token budget, and through the dense mask
    (attention that verl's per-segment SDPA cannot stand in for)."""
    import verl.workers.packing as packing
    if attention == "mask":
        monkeypatch.setattr(packing, "check_varlen_attention", lambda module: "sdpa")
    model, batch = _model(), make_tree_batch()
    inputs = _inputs(batch, 0)
    make = functools.partial(_torch_engine, model)
    lp, ent, stats, grads = _run_tree_actor(make, batch, inputs, micro, dict(padding_free=False))
    tree = dict(padding_free=True, share_prompt_prefix=True, max_tokens_per_micro_batch=budget)
    lp2, ent2, stats2, grads2 = _run_tree_actor(make, batch, inputs, micro, tree)
    torch.testing.assert_close(lp2, lp, **TOL)
    torch.testing.assert_close(ent2, ent, **TOL)
    assert stats2["actor/pg_loss"] == pytest.approx(stats["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert stats["actor/pg_loss"] != 0
    assert grads.keys() == grads2.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads2[n], grads[n], **TOL, msg=n)
    assert stats2["actor/tree_token_ratio"] > 1.3 and "actor/tree_token_ratio" not in stats
    # micro-batches [0, 3) [3, 6) [6, 8) cut both groups; the budget cuts group 2 (log-prob pass and update each)
    assert stats2["actor/tree_splits"] == {3: 4, 8: 2 if budget else 0}[micro]


def _torch_value_engine(model):
    from verl.distributed import init_placement
    from verl.workers import TorchEngine
    return TorchEngine(_value_model(copy.deepcopy(model)), OptimConfig(lr=1e-2), init_placement("cpu"),
                       head="value", total_steps=5)


def _run_tree_critic(make_engine, batch, inputs, micro: int, overrides: dict):
    """(values, update statistics, averaged gradients) of the critic on a fresh value model."""
    from verl.workers import CriticWorker
    critic = CriticWorker(make_engine(), CriticConfig(micro_batch_size=micro, **overrides))
    grads = _capture_grads(critic.engine)
    values = critic.compute_values(batch)
    stats = critic.update(batch, values, inputs["returns"])
    return values, stats, dict(grads)


@pytest.mark.parametrize("micro,budget,attention", [(3, 0, "varlen"), (8, 30, "varlen"), (8, 0, "mask")])
def test_critic_prefix_tree_equals_padded_values_loss_and_gradients(micro, budget, attention, monkeypatch):
    """critic.share_prompt_prefix: the values, value loss and gradients with each shared prefix computed once
    equal the padded path's (a tree split over micro-batches, cut by a token budget, through the dense mask)."""
    import verl.workers.packing as packing
    if attention == "mask":
        monkeypatch.setattr(packing, "check_varlen_attention", lambda module: "sdpa")
    model, batch = _model(), make_tree_batch()
    inputs = _inputs(batch, 0)
    make = functools.partial(_torch_value_engine, model)
    values, stats, grads = _run_tree_critic(make, batch, inputs, micro, dict(padding_free=False))
    tree = dict(padding_free=True, share_prompt_prefix=True, max_tokens_per_micro_batch=budget)
    values2, stats2, grads2 = _run_tree_critic(make, batch, inputs, micro, tree)
    assert float(values.abs().sum()) > 0
    torch.testing.assert_close(values2, values, **TOL)
    assert stats2["critic/vf_loss"] == pytest.approx(stats["critic/vf_loss"], rel=1e-5, abs=1e-7)
    assert grads.keys() == grads2.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads2[n], grads[n], **TOL, msg=n)
    # the value pass and the update each lay the batch out as trees: the same ratio as the actor's passes
    assert stats2["critic/tree_token_ratio"] > 1.3 and "critic/tree_token_ratio" not in stats
    assert stats2["critic/tree_splits"] == {3: 4, 8: 2 if budget else 0}[micro]


def test_prefix_tree_needs_padding_free(monkeypatch):
    import dataclasses

    import verl.config.ppo as ppo
    from verl.config.base import ConfigValueError
    with pytest.raises(ConfigValueError, match="padding_free"):
        ActorConfig(padding_free=False, share_prompt_prefix=True).check()
    with pytest.raises(ConfigValueError, match="critic.padding_free"):
        CriticConfig(padding_free=False, share_prompt_prefix=True).check()
    ppo.PPOConfig(critic=CriticConfig(share_prompt_prefix=True)).check()
    for engine in ("torch", "fsdp", "megatron"):
        ActorConfig(engine=engine, share_prompt_prefix=True).check()
    # a training engine without prefix sharing (every built-in one has it) is refused for the critic's trees
    real = ppo.engine_spec
    monkeypatch.setattr(ppo, "engine_spec", lambda kind, name, key=None: dataclasses.replace(
        real(kind, name, key), prefix_sharing=False) if kind == "training" else real(kind, name, key))
    with pytest.raises(ConfigValueError, match=r"critic.share_prompt_prefix.*not supported on the critic's engine "
                                               r"\(torch\)"):
        ppo.PPOConfig(critic=CriticConfig(share_prompt_prefix=True)).check()
