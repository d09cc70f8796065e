"""Delta weight sync (rollout.sync=delta, verl/hybrid_engine/delta.py): the payload encodings and the additive
checksum on their own; then syncs into a bfloat16 generation copy from torch replicas, FSDP2 shards and megatron
TP=2 shards (2 gloo ranks, engine on the same ranks) and across rank sets, each checked after N syncs against a
full sync of the same weights, bit for bit; and the bad inputs: a base that changed behind the sync (a full sync
forced and counted), a payload corrupted in transit (that bucket resent whole, counted), engine memory that
changed (found by the periodic full check, counted)."""

from __future__ import annotations

import pytest
import torch

from verl.errors import VerlRuntimeError
from verl.hybrid_engine.delta import BITMASK, INDEX, NONE, checksum, decode_delta, encode_delta
from verl.testing import run_distributed


# ------------------------------------------------------------------------------------------------ pure parts

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("share", [0.0, 0.001, 0.02, 0.5])
def test_encode_decode_round_trip_and_picks_the_smaller_payload(dtype, share):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(5000, generator=g).to(dtype)
    new = old.clone()
    hit = torch.rand(5000, generator=g) < share
    new[hit] = torch.randn(int(hit.sum()), generator=g).to(dtype)
    kind, payload, n = encode_delta(new, old)
    if n == 0:
        assert kind == NONE and payload.numel() == 0
        return
    es = new.element_size()
    index_bytes, mask_bytes = n * (4 + es), -(-5000 // 64) * 8 + n * es
    assert kind == (INDEX if index_bytes <= mask_bytes else BITMASK)
    assert payload.numel() == min(index_bytes, mask_bytes)
    where, values = decode_delta(kind, payload, 5000, n, dtype)
    rebuilt = old.clone()
    rebuilt[where] = values
    assert torch.equal(rebuilt.view(torch.uint8), new.view(torch.uint8))


def test_bit_patterns_count_as_changes():
    old = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert encode_delta(new, old)[2] == 1  # -0.0 differs from 0.0 in its bits; the same NaN does not


def test_checksum_sees_one_flipped_bit_anywhere_and_headers_catch_bad_sizes():
    g = torch.Generator().manual_seed(2)
    image = torch.randn(3 << 20, generator=g).to(torch.bfloat16)  # more than one chunk of words
    base = checksum(image)
    for at in (0, 123, (1 << 20) + 5, (3 << 20) - 1):
        flipped = image.clone()
        flipped.view(torch.int16)[at] ^= 1
        assert checksum(flipped) != base
    swapped = image.clone()
    swapped[[10, 11]] = image[[11, 10]]
    assert image[10] == image[11] or checksum(swapped) != base  # positions are weighted
    old = image[:4096]
    new = old.clone()
    new[::97] += 1
    kind, payload, n = encode_delta(new, old)
    with pytest.raises(VerlRuntimeError, match="value bytes"):
        decode_delta(kind, payload[:-2], 4096, n, torch.bfloat16)
    with pytest.raises(VerlRuntimeError, match="outside"):
        decode_delta(INDEX, torch.cat([torch.tensor([5000], dtype=torch.int32).view(torch.uint8),
                                       torch.zeros(2, dtype=torch.uint8)]), 4096, 1, torch.bfloat16)


# ------------------------------------------------------------------------------------------- one process

def _nudge(params: dict[str, torch.Tensor], step: int, lr: float = 2e-6) -> None:
    """An Adam-sized step (each element moves by about lr), the same on every rank for the same name."""
    for k, (name, t) in enumerate(sorted(params.items())):
        g = torch.Generator().manual_seed(step * 1000 + k)
        t.add_(lr * torch.randn(t.shape, generator=g).sign().to(t.dtype))


def _engine_and_model():
    from verl.models.tiny import TEST_SHAPE, tiny_model, tiny_tokenizer
    from verl.rollout import RolloutConfig, build_rollout
    model = tiny_model(TEST_SHAPE, seed=1, noise=0.05)
    engine = build_rollout(RolloutConfig(engine="torch", dtype="bfloat16"), model=model, tokenizer=tiny_tokenizer())
    return model, engine


def _equal_to_cast(model, engine) -> bool:
    held = engine.weight_tensors()
    return all(torch.equal(held[n].view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16))
               for n, p in model.named_parameters())


def test_delta_syncs_into_a_bfloat16_copy_stay_bit_exact_and_move_a_fraction():
    from verl.hybrid_engine import HybridEngineConfig, hybrid_engine_for_module, module_local_params
    model, engine = _engine_and_model()
    he = hybrid_engine_for_module(model, HybridEngineConfig(engine_dtype=torch.bfloat16, delta=True, verify_every=4,
                                                            bucket_mb=0.02))
    first = he.sync_delta(module_local_params(model), engine)
    assert first.full and first.changed == first.elements and _equal_to_cast(model, engine)
    shares = []
    for step in range(1, 13):
        _nudge(module_local_params(model), step)
        d = he.sync_delta(module_local_params(model), engine)
        assert not d.full and d.bucket_resyncs == d.verify_failures == 0
        assert d.verified == (step % 4 == 0)
        assert _equal_to_cast(model, engine), f"sync {step}: the engine differs from the bfloat16 cast"
        shares.append(d.changed / d.elements)
        assert d.engine_bytes < d.full_bytes / 3
    assert 0 < max(shares) < 0.2


def test_a_changed_base_forces_a_counted_full_sync_and_a_corrupted_bucket_is_resent():
    from verl.hybrid_engine import HybridEngineConfig, hybrid_engine_for_module, module_local_params
    from verl.hybrid_engine.delta import DeltaExecutor
    model, engine = _engine_and_model()
    he = hybrid_engine_for_module(model, HybridEngineConfig(engine_dtype=torch.bfloat16, delta=True, verify_every=0,
                                                            bucket_mb=0.02))
    he.sync_delta(module_local_params(model), engine)
    # another load into the engine (any update_weights) takes away the base the next delta would apply to
    name, held = next(iter(engine.weight_tensors().items()))
    engine.update_weights([(name, held.clone())])
    _nudge(module_local_params(model), 1)
    d = he.sync_delta(module_local_params(model), engine)
    assert d.full and d.forced_full == 1 and _equal_to_cast(model, engine)
    # a payload corrupted on the way: caught before it is written, the bucket resent whole
    _nudge(module_local_params(model), 2)
    hits = []

    def corrupt(bucket, sender, payload):
        if bucket == 1 and payload.numel() and not hits:  # once: the resend arrives intact
            hits.append(bucket)
            payload = payload.clone()
            payload[-1] ^= 0x10
        return payload
    DeltaExecutor.tamper = staticmethod(corrupt)
    try:
        d = he.sync_delta(module_local_params(model), engine)
    finally:
        DeltaExecutor.tamper = None
    assert hits and d.bucket_resyncs == 1 and not d.full and _equal_to_cast(model, engine)
    # engine memory changed behind the sync: the periodic full check finds it and resends that bucket
    he.config.verify_every = 1
    engine.weight_tensors()[name].view(-1)[0] += 1
    _nudge(module_local_params(model), 3)
    d = he.sync_delta(module_local_params(model), engine)
    assert d.verified and d.verify_failures == 1 and _equal_to_cast(model, engine)


# ------------------------------------------------------------------------------------------- 2 gloo ranks

class _Engine:
    """A generation engine holding this rank's targets in bfloat16 (what delta and full syncs write into)."""

    def __init__(self, he, rank):
        self.sync_base = None
        self.tensors = {t.target.name: torch.zeros(t.target.shape, dtype=torch.bfloat16)
                        for t in he.plan.targets_of(rank)}

    def weight_tensors(self):
        return self.tensors

    def weight_names(self):
        return set(self.tensors)


class _Recorder:
    def __init__(self):
        self.got = {}

    def update_weights(self, named):
        for name, t in named:
            self.got[name] = t.clone()


def _source(kind: str, path: str | None):
    """(local params, hybrid engine factory) of the actor on this rank for `kind`."""
    from verl.hybrid_engine import hybrid_engine_for_module, module_local_params
    from verl.models.tiny import TEST_SHAPE, tiny_model
    if kind == "megatron":
        from transformers import AutoConfig

        from verl.distributed import init_process_groups
        from verl.hybrid_engine.megatron import hybrid_engine_for, megatron_local_params
        from verl.models import BuildOptions, build_gpt, load_hf_checkpoint
        pg = init_process_groups(tp=2, pp=1)
        model = build_gpt(AutoConfig.from_pretrained(path), pg, BuildOptions(vocab_multiple=4))
        load_hf_checkpoint(model, path)
        return lambda: megatron_local_params(model), lambda cfg: hybrid_engine_for(model, cfg)
    model = tiny_model(TEST_SHAPE, seed=1, noise=0.05)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return lambda: module_local_params(model), lambda cfg: hybrid_engine_for_module(model, cfg)


def _same_ranks_body(rank, world, kind, path, steps):
    from verl.hybrid_engine import HybridEngineConfig
    local, make = _source(kind, path)
    base = dict(engine_dtype=torch.bfloat16, bucket_mb=0.02, generation_tp=1)
    he = make(HybridEngineConfig(delta=True, verify_every=3, **base))
    full = make(HybridEngineConfig(**base))
    engine = _Engine(he, torch.distributed.get_rank())
    stats = []
    for step in range(steps):
        if step:
            _nudge(local(), step)
        d = he.sync_delta(local(), engine)
        stats.append((d.full, d.changed, d.elements, d.engine_bytes, d.full_bytes, d.bucket_resyncs,
                      d.verify_failures, he.last_stats.bytes_sent + he.last_stats.bytes_received))
    rec = _Recorder()
    full.sync(local(), rec)
    bad = [n for n, t in rec.got.items() if not torch.equal(t.view(torch.int16), engine.tensors[n].view(torch.int16))]
    return dict(bad=bad, n=len(rec.got), names=sorted(rec.got) == sorted(engine.tensors), stats=stats,
                full_comm=full.last_stats.bytes_sent + full.last_stats.bytes_received)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["torch", "fsdp", "megatron"])
def test_delta_from_every_source_engine_equals_a_full_sync_bit_for_bit(kind, tmp_path):
    path = None
    if kind == "megatron":
        pytest.importorskip("megatron.core")
        from verl.models.tiny import TEST_SHAPE, save_tiny, tiny_model
        path = str(save_tiny(tiny_model(TEST_SHAPE, seed=1, noise=0.05), None, tmp_path / "ckpt"))
    per_rank = run_distributed(_same_ranks_body, 2, args=(kind, path, 8), timeout=400)
    for rank, res in enumerate(per_rank):
        assert res["names"] and res["n"] > 0 and res["bad"] == [], (rank, res["bad"][:3])
        first, rest = res["stats"][0], res["stats"][1:]
        assert first[0] and first[1] == first[2]
        for full, changed, elements, sent, full_bytes, resyncs, failures, comm in rest:
            assert not full and resyncs == failures == 0
            assert 0 < changed < elements and sent < full_bytes / 3
            if kind != "torch":  # whole copies build every target from their own copy: nothing crosses the wire
                assert comm < res["full_comm"] / 3


def _across_body(rank, world, steps):
    from verl.hybrid_engine import HybridEngineConfig, hybrid_engine_across, module_local_params
    from verl.models.tiny import TEST_SHAPE, tiny_model
    group = torch.distributed.group.WORLD
    actor = rank == 0
    model = tiny_model(TEST_SHAPE, seed=1, noise=0.05) if actor else None
    cfg = dict(engine_dtype=torch.bfloat16, bucket_mb=0.02)
    he = hybrid_engine_across(model, HybridEngineConfig(delta=True, verify_every=2, **cfg), group=group,
                              actor_ranks=(0,), rollout_ranks=(1,))
    full = hybrid_engine_across(model, HybridEngineConfig(**cfg), group=group, actor_ranks=(0,), rollout_ranks=(1,))
    engine = None if actor else _Engine(he, 1)
    received = []
    for step in range(steps):
        if actor and step:
            _nudge(module_local_params(model), step)
        he.sync_delta(module_local_params(model) if actor else {}, engine)
        received.append(he.last_stats.bytes_received)
    rec = None if actor else _Recorder()
    full.sync(module_local_params(model) if actor else {}, rec)
    if actor:
        return None
    bad = [n for n, t in rec.got.items() if not torch.equal(t.view(torch.int16), engine.tensors[n].view(torch.int16))]
    return dict(bad=bad, n=len(rec.got), received=received, full=full.last_stats.bytes_received)


@pytest.mark.multiprocess
def test_delta_to_a_rollout_on_its_own_ranks_equals_a_full_sync():
    res = run_distributed(_across_body, 2, args=(6,), timeout=300)[1]
    assert res["bad"] == [] and res["n"] > 0
    assert res["received"][0] >= res["full"]  # the first sync is full
    assert all(r < res["full"] / 3 for r in res["received"][1:])


@pytest.mark.parametrize("overrides, match", [
    (["rollout.sync=delta", "rollout.engine=vllm"], r"rollout.sync=delta writes the changed elements .* "
                                                    r"rollout.engine=vllm does not"),
    (["rollout.sync=delta", "trainer.mode=async"], r"rollout.sync=delta needs every sync applied in order"),
    (["rollout.delta_verify_every=-1"], r"rollout.delta_verify_every=-1 must be >= 0"),
])
def test_delta_settings_that_cannot_work_are_refused_when_the_config_is_read(overrides, match):
    from verl.config import PPOConfig, load_config
    from verl.errors import VerlConfigError
    from tests.trainer.conftest import TINY
    with pytest.raises(VerlConfigError, match=match):
        load_config(PPOConfig, None, [*TINY, *overrides])
