"""The hybrid engine across rank sets: a data-parallel actor (whole copies, or FSDP2 dim-0 shards) on some ranks
of a group, the generation layout (TP_g) on other ranks of it. The planner from metadata alone (one process:
bit-exact against the independent reference, every byte a generation rank needs crosses the wire exactly once,
whole copies share the sending), then the executor on gloo ranks (2: actor [0] -> rollout [1]; 4: actor [0, 1]
-> rollout [2, 3]) pushing bit-exact weights into a recording engine while the actor's weights stay intact."""

from __future__ import annotations

import pytest
import torch

from tests.hybrid_engine.reference import (expected_generation, fsdp_chunk, random_hf_state_dict, tiny_config)
from tests.hybrid_engine.test_planner import simulate
from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.hybrid_engine import plan_reshard
from verl.models.layout import hf_model_layout
from verl.testing import run_distributed

# (training ranks, generation ranks) as group ranks: apart, interleaved, more and fewer generation ranks
SETS = [((0,), (1,)), ((0, 1), (2, 3)), ((1, 3), (0, 2)), ((0,), (1, 2)), ((0, 1, 2), (3,)), ((2, 3), (0, 1))]


def _check_plan(plan, shards_by_rank, sd, cfg, train, gen):
    got = simulate(plan, shards_by_rank)
    for i, r in enumerate(gen):
        tg = plan.coords[r][0]
        assert tg == i % plan.tp_g
        want = expected_generation(sd, cfg, plan.tp_g, tg, plan.fmt)
        assert sorted(got[r]) == sorted(want), f"rank {r}: wrong set of tensors"
        for name, w in want.items():
            assert torch.equal(got[r][name], w), f"rank {r} {name} differs"
    for r in train:
        assert plan.coords[r] is None and not got[r] and plan.targets_of(r) == []
    for b in plan.buckets:
        for tp in b.targets:
            assert all(pc.src_rank in train for pc in tp.pieces), "a generation rank may only receive"
    traffic = plan.traffic()
    for r in gen:  # it holds nothing: every byte of its targets arrives over the wire, once
        assert traffic["received"][r] == sum(t.nbytes for t in plan.targets_of(r))
        assert traffic["sent"][r] == 0
    assert sum(traffic["sent"]) == sum(traffic["received"])
    return traffic


def _cases(layouts):
    """(train, gen, tp_g, fmt) for every rank-set pair whose generation ranks TP_g divides."""
    return [(a, b, g, f) for a, b in SETS for g, f in layouts if len(b) % g == 0]


WHOLE, FSDP = _cases([(1, "hf"), (1, "vllm"), (2, "vllm"), (2, "hf")]), _cases([(1, "hf"), (2, "vllm")])


@pytest.mark.parametrize("train,gen,tp_g,fmt", WHOLE, ids=[f"{list(a)}->{list(b)}-tpg{g}-{f}" for a, b, g, f in WHOLE])
def test_whole_copies_reach_other_ranks_bit_exactly_and_share_the_sending(train, gen, tp_g, fmt):
    cfg = tiny_config(bias=fmt == "vllm", kv_heads=2)
    sd = random_hf_state_dict(cfg, dtype=torch.bfloat16)
    plan = plan_reshard(hf_model_layout(sd, cfg), Placement.layout(dp=len(train)), tp_g, fmt=fmt,
                        bucket_bytes=8 << 10, train_ranks=train, gen_ranks=gen)
    shards = [sd if r in train else {} for r in range(len(train) + len(gen))]
    for r in train:
        assert plan.local_params(r) == {n: tuple(t.shape) for n, t in sd.items()}
    traffic = _check_plan(plan, shards, sd, cfg, train, gen)
    largest = max(t.nbytes for t in sd.values())
    sent = [traffic["sent"][r] for r in train]
    assert max(sent) - min(sent) <= largest, f"the actor's copies should share the sending: {sent}"


@pytest.mark.parametrize("train,gen,tp_g,fmt", FSDP, ids=[f"{list(a)}->{list(b)}-tpg{g}-{f}" for a, b, g, f in FSDP])
def test_fsdp_shards_reach_other_ranks_bit_exactly(train, gen, tp_g, fmt):
    cfg = tiny_config(bias=True, kv_heads=2)  # vocab 101, 16-row biases: uneven chunks
    sd = random_hf_state_dict(cfg)
    n = len(train)
    plan = plan_reshard(hf_model_layout(sd, cfg, shards=n), Placement.layout(dp=n), tp_g, fmt=fmt,
                        bucket_bytes=8 << 10, train_ranks=train, gen_ranks=gen)
    shards = [{} for _ in range(n + len(gen))]
    for k, r in enumerate(train):
        shards[r] = {name: fsdp_chunk(w, k, n) for name, w in sd.items()}
        assert plan.local_params(r) == {name: tuple(t.shape) for name, t in shards[r].items()}
    _check_plan(plan, shards, sd, cfg, train, gen)


def test_buckets_bound_what_a_rank_holds_across_sets():
    cfg = tiny_config()
    sd = random_hf_state_dict(cfg)
    bound = 16 << 10
    plan = plan_reshard(hf_model_layout(sd, cfg), Placement.layout(dp=2), 1, bucket_bytes=bound,
                        train_ranks=(0, 1), gen_ranks=(2, 3))
    assert len(plan.buckets) > 2
    for b in plan.buckets:  # per rank: the targets it receives plus the slices it sends
        held = [0] * plan.world
        for tp in b.targets:
            held[tp.rank] += tp.nbytes
            for pc in tp.pieces:
                held[pc.src_rank] += tp.piece_nbytes(pc)
        assert len(b.groups) == 1 or max(held) <= bound, (b.index, held)


@pytest.mark.parametrize("train,gen,match", [
    ((0, 0), (1, 2), "distinct ranks"), ((0, 1), (3, 4), "0..3"), ((0,), (1, 2, 3), "must divide")])
def test_bad_rank_sets_are_refused(train, gen, match):
    cfg = tiny_config()
    sd = random_hf_state_dict(cfg)
    with pytest.raises(VerlConfigError, match=match):
        plan_reshard(hf_model_layout(sd, cfg), Placement.layout(dp=len(train)), 2, train_ranks=train, gen_ranks=gen)


# ---- the executor on gloo ranks ----------------------------------------------------------------------------
class _Recorder:
    def __init__(self):
        self.got = {}

    def update_weights(self, named):
        for name, t in named:
            self.got[name] = t.clone()


def _body(rank, world, actor_ranks, rollout_ranks, cases):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from tests.hybrid_engine.test_module import _tiny_llama
    from verl.distributed import new_group
    from verl.hybrid_engine import HybridEngineConfig, hybrid_engine_across, module_local_params
    group = torch.distributed.group.WORLD
    actor_group = new_group(list(actor_ranks)) if len(actor_ranks) > 1 else None
    results = []
    for kind, fmt, tp_g in cases:
        model = _tiny_llama(tied=kind == "whole", bias=True)
        sd = {n: p.detach().clone() for n, p in model.named_parameters()}
        module = config = None
        if rank in actor_ranks:
            module = model
            if kind == "fsdp":
                mesh = DeviceMesh.from_group(actor_group, "cpu")
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
        else:
            config = HybridEngineConfig(generation_tp=tp_g, weight_format=fmt, bucket_mb=0.01)
        he = hybrid_engine_across(module, config, group=group, actor_ranks=actor_ranks, rollout_ranks=rollout_ranks,
                                  shard_group=actor_group)
        local = module_local_params(module) if module is not None else {}
        before = {k: v.clone() for k, v in local.items()}
        rec = _Recorder()
        he.sync(local, rec if rank in rollout_ranks else None)
        res = dict(case=(kind, fmt, tp_g), sent=he.last_stats.bytes_sent, received=he.last_stats.bytes_received,
                   n=len(rec.got), intact=all(torch.equal(before[k], v) for k, v in local.items()),
                   peak=he.last_stats.peak_bytes,
                   bucket_max=max(sum(t.nbytes for t in b.targets if t.rank == rank) for b in he.plan.buckets))
        if rank in rollout_ranks:
            tg = rollout_ranks.index(rank) % tp_g
            want = expected_generation(sd, model.config, tp_g, tg, fmt)
            res["bad"] = sorted(set(want) ^ set(rec.got)) + [
                n for n in want if n in rec.got and not torch.equal(rec.got[n], want[n])]
            res["expected_bytes"] = sum(t.nbytes for t in want.values())
        results.append(res)
    return results


def _check_run(per_rank, actor_ranks, rollout_ranks):
    for rank, results in enumerate(per_rank):
        for res in results:
            assert res["intact"], (rank, res["case"])
            if rank in rollout_ranks:
                assert res["n"] > 0 and res["bad"] == [], (rank, res["case"], res["bad"])
                assert res["received"] == res["expected_bytes"] and res["sent"] == 0, (rank, res)
                if res["case"] == ("whole", "hf", 1):  # every target arrives whole: no copy beside the buffers
                    assert res["peak"] == res["bucket_max"], (rank, res)
            else:
                assert res["n"] == 0 and res["received"] == 0, (rank, res)
    for i in range(len(per_rank[0])):
        assert sum(per_rank[r][i]["sent"] for r in actor_ranks) == \
            sum(per_rank[r][i]["received"] for r in rollout_ranks)


@pytest.mark.multiprocess
def test_one_actor_rank_to_one_rollout_rank_bit_exactly():
    cases = [("whole", "hf", 1), ("whole", "vllm", 1)]
    per_rank = run_distributed(_body, 2, args=((0,), (1,), cases), timeout=240)
    _check_run(per_rank, (0,), (1,))


@pytest.mark.multiprocess
def test_two_actor_ranks_to_two_rollout_ranks_bit_exactly_whole_and_fsdp2():
    cases = [("whole", "hf", 1), ("whole", "vllm", 2), ("fsdp", "hf", 1), ("fsdp", "vllm", 2)]
    per_rank = run_distributed(_body, 4, args=((0, 1), (2, 3), cases), timeout=300)
    _check_run(per_rank, (0, 1), (2, 3))
    # whole copies: both actor ranks send (the load is shared), FSDP2: each sends its own chunks
    for i in (0, 2):
        assert per_rank[0][i]["sent"] > 0 and per_rank[1][i]["sent"] > 0
