"""The reshard executor on 2 and 4 gloo ranks: bit-exact engine weights for every layout combination that
fits, the training shards untouched, bounded buffers, and failures that surface as VerlRuntimeError."""

from __future__ import annotations

import pytest
import torch

from tests.hybrid_engine.reference import (expected_generation, megatron_meta, megatron_shards,
                                           random_hf_state_dict, tiny_config)
from verl.errors import VerlRuntimeError
from verl.distributed import Placement
from verl.hybrid_engine import HybridEngine, HybridEngineConfig
from verl.testing import run_distributed

VOCAB_MULTIPLE = 8
COMBOS = {
    2: [(2, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 1), (1, 2, 1, 2), (1, 1, 2, 1), (1, 1, 2, 2)],
    4: [(2, 1, 2, 1), (2, 1, 2, 2), (2, 1, 2, 4), (4, 1, 1, 1), (4, 1, 1, 2), (4, 1, 1, 4), (2, 2, 1, 1),
        (2, 2, 1, 2), (2, 2, 1, 4), (1, 2, 2, 2), (1, 4, 1, 1), (1, 1, 4, 1)],
}


def _matrix_body(rank, world, combos):
    results = []
    for i, (tp, pp, dp, tp_g) in enumerate(combos):
        fmt = "vllm" if i % 3 == 2 else "hf"
        dtype = torch.bfloat16 if i % 2 else torch.float32
        cfg = tiny_config(bias=(i % 4 == 1), tied=(i % 5 == 3))
        layout = Placement.layout(tp=tp, pp=pp, dp=dp)
        sd = random_hf_state_dict(cfg, dtype=dtype, seed=i)
        shards = megatron_shards(sd, cfg, layout, rank, VOCAB_MULTIPLE)
        before = {k: v.clone() for k, v in shards.items()}
        meta = megatron_meta(cfg, tp=tp, pp=pp, dtype=dtype, vocab_multiple=VOCAB_MULTIPLE)
        he = HybridEngine(meta, layout, HybridEngineConfig(generation_tp=tp_g, weight_format=fmt, bucket_mb=0.01))
        got = dict(he.stream(shards))
        tg = he.plan.coords[rank][0]
        want = expected_generation(sd, cfg, tp_g, tg, fmt)
        bad = sorted(set(want) ^ set(got)) + [n for n in want if n in got and not torch.equal(got[n], want[n])]
        intact = all(torch.equal(before[k], shards[k]) for k in before)
        st = he.last_stats
        results.append(dict(combo=(tp, pp, dp, tp_g, fmt), bad=bad[:5], intact=intact, peak=st.peak_bytes,
                            buckets=st.buckets, sent=st.bytes_sent, planned=he.plan.traffic()["bucket_peak"][rank]))
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_executor_matrix_is_bit_exact(world):
    per_rank = run_distributed(_matrix_body, world, args=(COMBOS[world],), timeout=240)
    for rank, results in enumerate(per_rank):
        for res in results:
            assert res["bad"] == [], f"rank {rank} {res['combo']}: wrong tensors {res['bad']}"
            assert res["intact"], f"rank {rank} {res['combo']}: training shards changed"
            assert res["buckets"] > 1
            assert res["peak"] <= res["planned"], "held more than the planned bucket"
    tp_eq = [r for r in per_rank[0] if r["combo"][0] == r["combo"][3] and r["combo"][1] == 1]
    assert tp_eq and all(r["sent"] == 0 for r in tp_eq), "TP_g = TP with PP = 1 must send nothing"


class _FailingEngine:
    """Takes a few tensors, then fails (on one rank only)."""

    def __init__(self, fail: bool):
        self.fail, self.seen = fail, 0

    def update_weights(self, named):
        for _name, _t in named:
            self.seen += 1
            if self.fail and self.seen == 3:
                raise KeyError("engine exploded mid-update")


def _failure_body(rank, world, fail_rank):
    cfg = tiny_config()
    layout = Placement.layout(tp=2, pp=1, dp=world // 2)
    sd = random_hf_state_dict(cfg)
    shards = megatron_shards(sd, cfg, layout, rank, VOCAB_MULTIPLE)
    before = {k: v.clone() for k, v in shards.items()}
    he = HybridEngine(megatron_meta(cfg, tp=2, vocab_multiple=VOCAB_MULTIPLE), layout,
                      HybridEngineConfig(generation_tp=1, bucket_mb=0.01))
    try:
        he.sync(shards, _FailingEngine(rank == fail_rank))
        outcome = "no error"
    except VerlRuntimeError as e:
        outcome = str(e)
    # The group is still usable afterwards (messages paired up), and training shards are untouched.
    probe = torch.ones(1)
    torch.distributed.all_reduce(probe)
    return outcome, all(torch.equal(before[k], shards[k]) for k in before), probe.item()


@pytest.mark.multiprocess
def test_engine_failure_mid_update_raises_on_every_rank_and_keeps_training_weights():
    out = run_distributed(_failure_body, 2, args=(1,), timeout=120)
    assert "engine exploded mid-update" in out[1][0] and "rank 1" in out[1][0]
    assert "another rank's rollout engine failed" in out[0][0]
    assert all(intact for _, intact, _ in out)
    assert all(p == 2.0 for *_, p in out)


def _bad_shard_body(rank, world):
    cfg = tiny_config()
    layout = Placement.layout(tp=2)
    shards = megatron_shards(random_hf_state_dict(cfg), cfg, layout, rank, VOCAB_MULTIPLE)
    if rank == 0:
        shards["decoder.layers.1.mlp.linear_fc2.weight"] = shards["decoder.layers.1.mlp.linear_fc2.weight"][:, :-1]
    he = HybridEngine(megatron_meta(cfg, tp=2, vocab_multiple=VOCAB_MULTIPLE), layout)
    try:
        list(he.stream(shards))
    except VerlRuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_mismatched_shard_is_reported_before_any_transfer():
    out = run_distributed(_bad_shard_body, 2, timeout=120)
    assert "decoder.layers.1.mlp.linear_fc2.weight" in out[0] and "shape" in out[0]
    assert "another rank" in out[1]


class _NamedEngine(_FailingEngine):
    def __init__(self, names):
        super().__init__(False)
        self.names = names

    def weight_names(self):
        return self.names


def _unknown_name_body(rank, world):
    cfg = tiny_config()
    layout = Placement.layout(tp=2)
    shards = megatron_shards(random_hf_state_dict(cfg), cfg, layout, rank, VOCAB_MULTIPLE)
    he = HybridEngine(megatron_meta(cfg, tp=2, vocab_multiple=VOCAB_MULTIPLE), layout)
    names = {t.target.name for t in he.plan.targets_of(rank)}
    engine = _NamedEngine(names - {"model.layers.2.mlp.up_proj.weight"} if rank == 0 else names)
    try:
        he.sync(shards, engine)
        return "no error", engine.seen
    except VerlRuntimeError as e:
        return str(e), engine.seen


@pytest.mark.multiprocess
def test_a_name_the_engine_does_not_know_fails_before_anything_moves():
    out = run_distributed(_unknown_name_body, 2, timeout=120)
    assert "no weight named 'model.layers.2.mlp.up_proj.weight'" in out[0][0]
    assert "another rank's rollout engine does not know" in out[1][0]
    assert out[0][1] == 0 and out[1][1] == 0, "no tensor may reach an engine"
