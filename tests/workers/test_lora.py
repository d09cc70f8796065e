"""LoRA on the actor (actor.lora, verl/models/lora.py): the refusals before step 1; the reference as the base with
the adapters off (no second copy); the PEFT export; the atomic, versioned adapter swap in the torch engine (every
token's log-prob is its recorded version's, bit for bit in the swap's atomicity, to float rounding in the fused
decoder); `verl train` with LoRA (adapter-only checkpoints, resume, export), FSDP2 shards sending only the adapter,
and async partial rollouts whose per-token versions are checked token by token against each version's adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.config.ppo import LoRAConfig
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.models.lora import (adapter_bytes, adapters_disabled, apply_lora, export_adapter, merged_model,
                              sync_tensors, unique_bytes)
from verl.models.tiny import TEST_SHAPE, tiny_model, tiny_tokenizer
from verl.testing import run_distributed

from tests.trainer.conftest import TINY

LORA = ["actor.lora.enabled=true", "actor.lora.rank=4", "actor.lora.alpha=8"]


def _lora_model(seed: int = 1, rank: int = 4, b_std: float = 0.2):
    model = tiny_model(TEST_SHAPE, seed=seed, noise=0.05)
    torch.manual_seed(seed)
    apply_lora(model, LoRAConfig(enabled=True, rank=rank, alpha=2.0 * rank))
    _randomize_adapters(model, seed, b_std)
    return model


def _randomize_adapters(model, seed: int, std: float = 0.2) -> None:
    """B starts at zero (a fresh adapter changes nothing); a trained one does not."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


# ------------------------------------------------------------------------------------------------ bad input

def test_a_target_that_matches_nothing_is_refused_naming_the_layers_that_exist():
    with pytest.raises(VerlConfigError, match=r"\['qproj'\] match no linear layer .* its linear layers are "
                                              r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', "
                                              r"'up_proj', 'v_proj'\]"):
        apply_lora(tiny_model(TEST_SHAPE), LoRAConfig(enabled=True, target_modules=["q_proj", "qproj"]))


@pytest.mark.parametrize("overrides, match", [
    (["actor.lora.rank=0"], r"actor.lora.rank.*0.*must be >= 1"),
    (["actor.engine=megatron"], r"actor.engine=megatron: it cannot take LoRA adapters \(its column / row-parallel "
                                r"linears .*\); use one of \['fsdp', 'torch'\]"),
    (["rollout.engine=vllm"], r"rollout.engine=vllm: it cannot take adapter-only updates in memory \(vLLM 0.32 "
                              r"loads LoRA adapters only from a directory.*set actor.lora.sync=merged"),
    (["rollout.sync=delta", "rollout.dtype=bfloat16"], r"rollout.sync=delta .* with actor.lora.enabled"),
    (["actor.use_kl_loss=true", "ref.engine=fsdp"], r"reference is the actor's base model .* remove ref.engine=fsdp"),
])
def test_lora_settings_that_cannot_work_are_refused_before_step_1(overrides, match):
    with pytest.raises(VerlConfigError, match=match):
        load_config(PPOConfig, None, [*TINY, *LORA, *overrides])


def test_merged_sync_is_the_explicit_fallback_for_vllm_and_the_reference_must_share_the_actors_ranks():
    load_config(PPOConfig, None, [*TINY, *LORA, "rollout.engine=vllm", "actor.lora.sync=merged"])
    cfg = load_config(PPOConfig, None, [*TINY, *LORA, "actor.use_kl_loss=true", "trainer.placement=split",
                                        "ref.ranks=[1]", "actor.ranks=[0]", "rollout.ranks=[0]"])
    with pytest.raises(VerlConfigError, match=r"ref.ranks=\[1\] would need a second copy"):
        cfg.validate_world(2)


# ------------------------------------------------------------------------------------- model-level pieces

def test_the_reference_is_the_base_with_adapters_off_and_holds_no_second_copy():
    from verl.distributed import Placement
    from verl.workers.batch import RolloutBatch
    from verl.workers.engine import BaseModelView, TorchEngine
    plain = tiny_model(TEST_SHAPE, seed=1, noise=0.05)
    model = _lora_model()
    actor = TorchEngine(model, None, Placement())
    ref = BaseModelView(actor)
    ids = torch.randint(4, 100, (3, 10))
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids),
                         position_ids=torch.arange(10).expand(3, 10), response_mask=torch.ones(3, 4),
                         group=torch.arange(3))
    want = TorchEngine(plain, None, Placement()).forward(batch, 8)
    got, lora = ref.forward(batch, 8), actor.forward(batch, 8)
    assert torch.equal(got["log_probs"], want["log_probs"])  # the base model exactly
    assert not torch.allclose(lora["log_probs"], want["log_probs"])  # and the adapters back on afterwards
    one = unique_bytes(plain)
    assert unique_bytes(actor.module, ref.view_of.module) == unique_bytes(model) < 1.15 * one


def _logits_and_adapter_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_the_fused_lora_linear_is_pefts_forward_and_gradients_in_one_node(monkeypatch):
    """apply_lora gives every injected linear the one-node forward (FusedLoraLinear): logits and every adapter's
    gradient as PEFT's own layers give them (a bias included); with the adapters off, merged, or dropout active it
    is PEFT's forward itself."""
    import copy

    from peft.tuners.lora import Linear

    import verl.models.lora as L
    fused_calls = []
    apply = L._LoraLinearFn.apply
    monkeypatch.setattr(L._LoraLinearFn, "apply", lambda *a: fused_calls.append(1) or apply(*a))
    model = _lora_model()
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(type(m).__name__ == "FusedLoraLinear" for m in layers)
    peft_model = copy.deepcopy(model)
    for m in peft_model.modules():
        if isinstance(m, Linear):
            m.__class__ = Linear
    ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    (got, got_g), (want, want_g) = _logits_and_adapter_grads(model, ids), _logits_and_adapter_grads(peft_model, ids)
    assert len(fused_calls) == len(layers)  # every linear, forward once
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_g.keys() == want_g.keys() and all(".lora_" in n for n in got_g) and got_g
    for n in got_g:
        torch.testing.assert_close(got_g[n], want_g[n], rtol=1e-5, atol=1e-7)
    fused_calls.clear()
    with adapters_disabled(model):
        model(ids)
    layers[0].merge()
    model(ids)
    layers[0].unmerge()
    assert len(fused_calls) == len(layers) - 1  # off: none; the merged layer: PEFT's forward

    class Biased(torch.nn.Module):  # a linear with a bias, and dropout on the adapter
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 5, bias=True)

        def forward(self, x):
            return self.proj(x)
    from verl.models.lora import adapter_dropout
    for drop in (0.0, 0.5):
        torch.manual_seed(2)
        one = apply_lora(Biased(), LoRAConfig(enabled=True, rank=2, alpha=4.0, dropout=drop,
                                              target_modules=["proj"]))
        _randomize_adapters(one, 3)
        ref = copy.deepcopy(one)
        ref.proj.__class__ = Linear
        x = torch.randn(3, 4, 6, requires_grad=True)
        fused_calls.clear()
        for m in (one, ref):
            m.zero_grad(set_to_none=True)
            with adapter_dropout(m):
                torch.manual_seed(5)
                m(x).sum().backward()
        assert len(fused_calls) == (1 if drop == 0.0 else 0)  # active dropout: PEFT's forward
        torch.testing.assert_close(one.proj.lora_A.default.weight.grad, ref.proj.lora_A.default.weight.grad)
        torch.testing.assert_close(one.proj.lora_B.default.weight.grad, ref.proj.lora_B.default.weight.grad)
        assert one.proj.base_layer.bias.grad is None


def test_the_adapter_exports_in_peft_format_and_merges_into_the_base(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import save_tiny
    save_tiny(tiny_model(TEST_SHAPE, seed=1, noise=0.05), None, tmp_path / "base")
    model = _lora_model()
    ids = torch.randint(4, 100, (2, 9))
    want = model(ids).logits
    export_adapter(model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["base_model_name_or_path"] == str(tmp_path / "base")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(loaded(ids).logits, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged_model(model)(ids).logits, want, atol=1e-5, rtol=0)
    with adapters_disabled(model):
        assert not torch.allclose(model(ids).logits, want)


# --------------------------------------------------------------------------------- the swap in the engine

class _Versions:
    """A pause hook that loads adapter version v (a dict of tensors) before token `at[v]`, returning the version
    the engine holds: several swaps in the middle of every sample."""

    def __init__(self, engine, versions: list[dict], at: list[int]):
        self.engine, self.versions, self.at, self.calls, self.now = engine, versions, at, 0, 0

    def __call__(self) -> int:
        for v, k in enumerate(self.at):
            if self.calls == k and v > self.now:
                self.engine.update_weights(self.versions[v].items())
                self.now = v
        self.calls += 1
        return self.now


@torch.no_grad()
def _token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("decoder", ["fast", "model"])
def test_adapter_swaps_are_atomic_and_every_token_is_its_versions(decoder):
    from verl.rollout import RolloutConfig, SamplingParams, Tokenizer, TorchRollout
    tok = tiny_tokenizer()
    model = _lora_model(seed=1)
    versions = [{n: t.clone() for n, t in sync_tensors(_lora_model(seed=s), "adapter").items()} for s in (1, 2, 3)]
    engine = TorchRollout(model, tok, RolloutConfig(decoder=decoder))
    engine.pause_hook = _Versions(engine, versions, at=[0, 3, 7])
    prompts = ["the quick brown", "one two three four"]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, n=2, temperature=1.0, seed=5, logprobs=True,
                                                   ignore_eos=True))
    assert engine.last_swap_s < 0.5  # a pointer swap per tensor (the benchmark times it on the real model)
    checker = _lora_model(seed=1)
    mixed = 0
    for o in outs:
        prompt = Tokenizer(tok).encode_prompt(prompts[o.prompt_index])
        assert o.token_versions == sorted(o.token_versions)  # versions only move forward
        mixed += len(set(o.token_versions)) > 1
        for v in set(o.token_versions):
            checker.load_state_dict(versions[v], strict=False)
            want = _token_logprobs(checker, prompt, o.token_ids)
            at = [i for i, tv in enumerate(o.token_versions) if tv == v]
            got = torch.tensor([o.logprobs[i] for i in at])
            torch.testing.assert_close(got, want[at], atol=2e-5, rtol=0)
    assert mixed == len(outs)  # every sample was generated across swaps


def test_a_failing_update_leaves_the_adapters_as_they_were():
    from verl.rollout import RolloutConfig, TorchRollout
    model = _lora_model()
    engine = TorchRollout(model, tiny_tokenizer(), RolloutConfig())
    before = {n: t.clone() for n, t in sync_tensors(model, "adapter").items()}
    new = list(sync_tensors(_lora_model(seed=2), "adapter").items())

    def stream():
        yield from new[:5]
        raise RuntimeError("the sender died")
    with pytest.raises(VerlRuntimeError, match="the sender died"):
        engine.update_weights(stream())
    assert all(torch.equal(t, before[n]) for n, t in sync_tensors(model, "adapter").items())


# ------------------------------------------------------------------------------------------- verl train

def _train(tmp_path, *extra, out="run"):
    from verl.distributed import init_placement
    from verl.trainer.ppo_trainer import PPOTrainer
    cfg = load_config(PPOConfig, None, [*TINY, *LORA, "trainer.plot=false", f"trainer.output_dir={tmp_path / out}",
                                        *extra])
    trainer = PPOTrainer(cfg, init_placement("cpu"))
    return trainer, trainer.fit()


def _checkpoint_keys(path: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader
    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_lora_job_trains_only_the_adapter_checkpoints_it_resumes_and_exports(tmp_path):
    trainer, hist = _train(tmp_path, "actor.use_kl_loss=true", "trainer.total_steps=2", "actor.lora.export_merged=true")
    base = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if ".base_layer." in n}
    assert len(hist) == 2 and all("actor/kl" in h for h in hist)
    assert hist[0]["perf/sync_shared"] == 1.0  # the colocated torch engine generates with the actor's module
    keys = _checkpoint_keys(tmp_path / "run" / "checkpoints" / "step_000002")
    model_keys = [k for k in keys if k.startswith("actor.model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:3]
    assert not any(k.startswith("ref.") for k in keys)
    assert (tmp_path / "run" / "hf_actor" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "hf_actor_merged" / "config.json").is_file()
    resumed, more = _train(tmp_path, "actor.use_kl_loss=true", "trainer.total_steps=3", "trainer.resume=auto")
    assert len(more) == 1
    for name, p in resumed.policy.named_parameters():
        if ".base_layer." in name:  # the frozen, warmed-up base comes back from output_dir/lora_base
            assert torch.equal(p, base[name]), name


def _fsdp_body(rank, world, out):
    from verl.distributed import init_placement
    from verl.trainer.ppo_trainer import PPOTrainer
    cfg = load_config(PPOConfig, None, [*TINY, *LORA, "actor.engine=fsdp", "actor.use_kl_loss=true",
                                        "trainer.plot=false", "trainer.save_final=false", f"trainer.output_dir={out}"])
    trainer = PPOTrainer(cfg, init_placement("cpu", process_group=True))
    hist = trainer.fit()
    full = {n: t.full_tensor() for n, t in sync_tensors(trainer.actor.engine.module, "adapter", local=False).items()}
    held = dict(sync_tensors(trainer.rollout.engine.model, "adapter"))
    return dict(hist=hist, equal=all(torch.equal(full[n], held[n]) for n in full), n=len(full),
                adapter=adapter_bytes(trainer.rollout.engine.model),
                model=sum(p.nbytes for p in trainer.rollout.engine.model.parameters()))


@pytest.mark.multiprocess
def test_fsdp2_shards_send_only_the_adapter_into_the_rollouts_copy_and_export_it(tmp_path):
    for rank, res in enumerate(run_distributed(_fsdp_body, 2, args=(str(tmp_path / "f"),), timeout=400)):
        assert res["equal"] and res["n"] > 0, rank
        for h in res["hist"]:
            assert h["perf/sync_bytes"] == res["adapter"] < res["model"] / 4
            assert h["perf/sync_shared"] == 0.0 and "actor/kl" in h  # the reference: the base, adapters off
    assert (tmp_path / "f" / "hf_actor" / "adapter_model.safetensors").is_file()  # gathered from the shards


class _Recording:
    """PPOTrainer that keeps, on the actor's rank, every trained batch and every published adapter version."""

    @staticmethod
    def make():
        from verl.trainer.ppo_trainer import PPOTrainer

        class Trainer(PPOTrainer):
            def setup(self):
                info = super().setup()
                self.versions, self.batches = {}, []
                self._snapshot(self.step)
                return info

            def _snapshot(self, version):
                if self.actor is not None:
                    self.versions[version] = {n: t.clone() for n, t in sync_tensors(self.actor.engine.module,
                                                                                    "adapter").items()}

            def _metrics(self, out, elapsed):
                if self.actor is not None:
                    self.batches.append(out["batch"])
                return super()._metrics(out, elapsed)

            def train_step(self):
                m = super().train_step()
                self._snapshot(self.step + 1)
                return m
        return Trainer


def _async_body(rank, world, out):
    from verl.distributed import init_placement
    cfg = load_config(PPOConfig, None, [
        *TINY, *LORA, "warmup.steps=0", "trainer.export_hf=false", "trainer.plot=false", "trainer.save_final=false",
        f"trainer.output_dir={out}", "trainer.placement=split", "actor.ranks=[0]", "rollout.ranks=[1]",
        "reward.ranks=[0]", "trainer.mode=async", "algorithm.max_staleness=1", "rollout.partial=true",
        "rollout.max_new_tokens=32", "rollout.ignore_eos=true", "rollout.kv_cache=false", "rollout.decoder=model",
        "trainer.total_steps=4", "actor.optim.lr=5e-2",
        "reward.name=tests.trainer.test_multiprocess:length_reward"])
    trainer = _Recording.make()(cfg, init_placement("cpu"))
    trainer.fit()
    if trainer.actor is None:
        return None
    return _check_token_versions(trainer)


def _check_token_versions(trainer) -> dict:
    """Every response token of every trained batch against the log-prob of its recorded version's adapter
    (teacher-forced over the prefix): a token computed from a torn or other adapter would not match."""
    import copy
    checker = copy.deepcopy(trainer.policy)
    checked = swaps = 0
    for batch in trainer.batches:
        assert batch.token_version is not None
        P = batch.prompt_length
        for row in range(len(batch)):
            real = batch.response_mask[row] > 0
            tv = batch.token_version[row][real].tolist()
            assert tv == sorted(tv) and int(batch.weight_version[row]) == tv[0]
            swaps += len(set(tv)) > 1
            ids = batch.input_ids[row][batch.attention_mask[row] > 0].tolist()
            prompt_len = int(batch.attention_mask[row][:P].sum())
            for v in set(tv):
                checker.load_state_dict(trainer.versions[v], strict=False)
                want = _token_logprobs(checker, ids[:prompt_len], ids[prompt_len:])
                at = [i for i, x in enumerate(tv) if x == v]
                torch.testing.assert_close(batch.rollout_log_probs[row][at], want[at], atol=1e-4, rtol=0)
                checked += len(at)
    return dict(checked=checked, swaps=swaps, versions=sorted(trainer.versions))


@pytest.mark.multiprocess
def test_async_partial_rollouts_with_lora_every_token_from_one_adapter_version(tmp_path):
    res = run_distributed(_async_body, 2, args=(str(tmp_path / "a"),), timeout=500)[0]
    assert res["checked"] > 0 and res["versions"] == [0, 1, 2, 3, 4]
    print(f"tokens checked against their adapter version: {res['checked']}; responses spanning versions: "
          f"{res['swaps']}")


def test_merged_sync_hands_a_plain_engine_base_plus_scaled_adapters(tmp_path):
    trainer, hist = _train(tmp_path, "actor.lora.sync=merged", "trainer.total_steps=2", "trainer.export_hf=false",
                           "trainer.save_final=false")
    engine = trainer.rollout.engine.model
    assert engine is not trainer.actor.engine.module and not any(".lora_" in n for n, _ in engine.named_parameters())
    want = sync_tensors(trainer.actor.engine.module, "merged")
    held = dict(engine.named_parameters())
    assert all(torch.equal(held[n], t) for n, t in want.items() if n in held)
    assert hist[-1]["perf/sync_bytes"] == sum(p.nbytes for p in engine.parameters())
