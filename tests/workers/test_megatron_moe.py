"""Router replay on the megatron engine (2 gloo ranks, expert parallel): the torch engine's recorded routes are
replayed token for token — forcing other routes gives transformers' forward with those routes forced — in packed
and padded micro-batches, with EP=2 alone and with TP=2 + sequence parallelism; moe/router_mismatch_frac counts
the decisions that differ; bad routes are refused naming the layer and the token."""

from __future__ import annotations

import pytest
import torch

from verl.config import TinyModelConfig
from verl.data import task_corpus
from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
from verl.testing import run_distributed

SHAPE = TinyModelConfig(family="qwen3_moe", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=32, num_experts=4, num_experts_per_tok=2)
ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12-5=", "answer": "7"}]
LAYOUTS = [dict(tp=1, ep=2), dict(tp=2, ep=2, etp=1, sequence_parallel=True)]


def _policy():
    tok = tiny_tokenizer(task_corpus("arithmetic"), 96)
    return tiny_model(SHAPE, tokenizer=tok, seed=5, noise=0.1), tok


def _forced_log_probs(model, batch, routes):
    """transformers' response log-probs with every token whose route is given (>= 0) sent to those experts."""
    B, S = batch.input_ids.shape
    from verl.models.config import arch_from_hf
    layers = arch_from_hf(model.config).moe.layers
    handles = []
    for j, i in enumerate(layers):
        forced = routes[:, :, j].reshape(B * S, -1).long()

        def hook(_m, _inputs, out, forced=forced):
            logits, _, ids = out
            ids = torch.where((forced >= 0).all(-1, keepdim=True), forced, ids)
            return logits, torch.softmax(logits.float().gather(1, ids), -1).to(logits.dtype), ids
        handles.append(model.model.layers[i].mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids).logits
    finally:
        for h in handles:
            h.remove()
    P = batch.prompt_length
    lp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, batch.input_ids[:, P:, None])[..., 0]
    return lp * batch.response_mask


def replay_body(rank, world_size, path, layout):
    import dataclasses

    from verl.config import MegatronConfig
    from verl.distributed import destroy_process_groups, init_placement
    from verl.errors import VerlRuntimeError
    from verl.rollout import RolloutConfig, build_rollout
    from verl.workers import RolloutWorker
    from verl.workers.megatron import MegatronEngine
    model, tok = _policy()
    model.eval()
    cfg = RolloutConfig(engine="torch", n=2, max_new_tokens=5)
    rollout = RolloutWorker(build_rollout(cfg, model=model, tokenizer=tok), cfg, max_prompt_length=16)
    batch = rollout.generate(ROWS, seed=0)
    tp, ep, etp, sp = layout["tp"], layout["ep"], layout.get("etp"), layout.get("sequence_parallel", False)
    placement = init_placement("cpu", tp=tp, ep=ep, etp=etp, sequence_parallel=sp, megatron=True)
    mcfg = MegatronConfig(tp=tp, ep=ep, etp=etp, sequence_parallel=sp)
    engines = {r: MegatronEngine(path, placement, mcfg, replay_routes=r, compare_routes=True) for r in (False, True)}
    out = {"recorded": batch.routes is not None}
    # the rollout's own routes: nothing differs, replayed or not
    for replay, eng in engines.items():
        for packed in (True, False):
            lp = eng.forward(batch, 4, padding_free=packed)["log_probs"]
            out[f"lp_diff_{replay}_{packed}"] = float((lp - _forced_log_probs(model, batch, batch.routes)).abs().max())
        out[f"metrics_{replay}"] = eng.take_metrics()
    # other routes (each expert id + 1): replay follows them exactly; without replay every decision differs
    rotated = torch.where(batch.routes >= 0, (batch.routes + 1) % SHAPE.num_experts, batch.routes)
    other = dataclasses.replace(batch, routes=rotated)
    want = _forced_log_probs(model, other, rotated)
    for packed in (True, False):
        lp = engines[True].forward(other, 4, padding_free=packed)["log_probs"]
        out[f"forced_diff_{packed}"] = float((lp - want).abs().max())
    out["forced_vs_own"] = float((want - _forced_log_probs(model, batch, batch.routes)).abs().max())
    engines[True].take_metrics()
    engines[False].forward(other, 4, padding_free=True)
    out["mismatch_rotated"] = engines[False].take_metrics()["moe/router_mismatch_frac"]
    errors = {}
    bad = rotated.clone()
    bad[1, 3, 1, 0] = 7
    for name, routes in (("range", bad), ("layers", rotated[:, :, :1])):
        try:
            engines[True].forward(dataclasses.replace(batch, routes=routes), 4, padding_free=True)
        except VerlRuntimeError as e:
            errors[name] = str(e)
    out["errors"] = errors
    destroy_process_groups()
    return out


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    model, tok = _policy()
    return str(save_tiny(model, tok, tmp_path_factory.mktemp("moe")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS, ids=["ep2", "tp2sp-ep2"])
def test_router_replay_follows_the_given_routes(policy_dir, layout):
    for r in run_distributed(replay_body, 2, args=(policy_dir, layout), timeout=600):
        assert r["recorded"]
        for key in ("lp_diff_False_True", "lp_diff_False_False", "lp_diff_True_True", "lp_diff_True_False"):
            assert r[key] < 1e-4, (key, r[key])
        for replay in (False, True):
            m = r[f"metrics_{replay}"]
            assert m["moe/router_mismatch_frac"] == 0.0   # float32: the training forward routes as the rollout did
            assert m["moe/expert_load_max_over_mean"] >= 1.0 and m["moe/aux_loss"] > 0
        assert r["forced_vs_own"] > 1e-2                  # the rotated routes do change the result ...
        assert r["forced_diff_True"] < 1e-4 and r["forced_diff_False"] < 1e-4   # ... and replay computes exactly that
        assert r["mismatch_rotated"] == 1.0
        assert "token 3 of sample 1 at MoE layer 1 is expert 7, outside [0, 4)" in r["errors"]["range"]
        assert "the model has 2 MoE layers" in r["errors"]["layers"]
