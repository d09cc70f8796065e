"""The hybrid engine on a plain Hugging Face tiny Llama / Qwen2 (2 gloo ranks): data-parallel whole copies (DDP or
not) and FSDP2 `fully_shard` dim-0 shards push their weights into a recording engine bit-exactly, in the
`hf` and `vllm` formats, moving only what a rank lacks and leaving the training weights untouched."""

from __future__ import annotations

import pytest
import torch

from tests.hybrid_engine.reference import expected_generation, fsdp_bytes_needed
from verl.testing import run_distributed


class _Recorder:
    """A rollout engine that keeps copies of what it receives and where each tensor's storage was."""

    def __init__(self):
        self.got, self.storage = {}, {}

    def update_weights(self, named):
        for name, t in named:
            self.storage[name] = t.untyped_storage().data_ptr()
            self.got[name] = t.clone()


def _tiny_llama(tied: bool, bias: bool):
    """A tiny Llama, or with q/k/v biases its Qwen2 sibling."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if bias else (LlamaConfig, LlamaForCausalLM)
    cfg = config_cls(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)  # the same weights on every rank, as data parallelism keeps them
    model = model_cls(cfg)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; random values make a layout mistake visible
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p))
    return model


def _compare(rank, he, model_sd, cfg, fmt, tp_g, rec, local, before):
    want = expected_generation(model_sd, cfg, tp_g, he.plan.coords[rank][0], fmt)
    bad = sorted(set(want) ^ set(rec.got)) + [n for n in want if n in rec.got and not torch.equal(rec.got[n], want[n])]
    intact = all(torch.equal(before[k], v) for k, v in local.items())
    return dict(bad=bad[:5], intact=intact, sent=he.last_stats.bytes_sent, received=he.last_stats.bytes_received,
                planned=he.plan.traffic()["received"][rank], n=len(rec.got))


def _whole_body(rank, world, cases):
    from torch.nn.parallel import DistributedDataParallel

    from verl.hybrid_engine import HybridEngineConfig, hybrid_engine_for_module, module_local_params
    results = []
    for tied, fmt, tp_g, ddp in cases:
        model = _tiny_llama(tied, bias=fmt == "vllm")
        sd = {n: p.detach().clone() for n, p in model.named_parameters()}
        actor = DistributedDataParallel(model) if ddp else model
        he = hybrid_engine_for_module(actor, HybridEngineConfig(generation_tp=tp_g, weight_format=fmt, bucket_mb=0.01))
        local = module_local_params(actor)
        before = {k: v.clone() for k, v in local.items()}
        rec = _Recorder()
        he.sync(local, rec)
        res = _compare(rank, he, sd, model.config, fmt, tp_g, rec, local, before)
        own = {p.untyped_storage().data_ptr() for p in local.values()}
        res["views"] = all(ptr in own for ptr in rec.storage.values())
        results.append(dict(res, case=(tied, fmt, tp_g, ddp)))
    return results


@pytest.mark.multiprocess
def test_whole_copies_on_every_rank_reach_the_engine_bit_exactly_without_moving_a_byte():
    cases = [(False, "hf", 1, False), (True, "vllm", 1, True), (False, "vllm", 2, False), (True, "hf", 2, False)]
    per_rank = run_distributed(_whole_body, 2, args=(cases,), timeout=240)
    for rank, results in enumerate(per_rank):
        for res in results:
            assert res["bad"] == [], f"rank {rank} {res['case']}: wrong tensors {res['bad']}"
            assert res["intact"] and res["n"] > 0
            assert res["sent"] == res["received"] == 0, f"rank {rank} {res['case']} moved bytes"
            if res["case"][1:3] == ("hf", 1):
                assert res["views"], "TP_g = 1 in the hf format must hand out views of the parameters"


def _fsdp_body(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from verl.hybrid_engine import HybridEngineConfig, hybrid_engine_for_module, module_local_params
    mesh = init_device_mesh("cpu", (world,))
    results = []
    for fmt, tp_g in cases:
        model = _tiny_llama(tied=False, bias=True)
        sd = {n: p.detach().clone() for n, p in model.named_parameters()}
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        he = hybrid_engine_for_module(model, HybridEngineConfig(generation_tp=tp_g, weight_format=fmt, bucket_mb=0.01))
        local = module_local_params(model)
        before = {k: v.clone() for k, v in local.items()}
        rec = _Recorder()
        he.sync(local, rec)
        res = _compare(rank, he, sd, model.config, fmt, tp_g, rec, local, before)
        res["needed"] = fsdp_bytes_needed(sd, model.config, tp_g, he.plan.coords[rank][0], rank, world)
        results.append(dict(res, case=(fmt, tp_g), shards=sorted({s.parts for s in he.plan.specs.values()})))
    return results


@pytest.mark.multiprocess
def test_fsdp2_shards_reach_the_engine_bit_exactly_gathering_only_missing_rows():
    per_rank = run_distributed(_fsdp_body, 2, args=([("hf", 1), ("vllm", 2), ("hf", 2)],), timeout=240)
    for rank, results in enumerate(per_rank):
        for res in results:
            assert res["bad"] == [], f"rank {rank} {res['case']}: wrong tensors {res['bad']}"
            assert res["intact"] and res["n"] > 0 and res["shards"] == [2]
            assert res["received"] == res["planned"] == res["needed"], (rank, res)
