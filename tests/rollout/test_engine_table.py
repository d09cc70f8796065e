"""The engine table (`verl.engines`): adding a rollout engine is one class plus one registration, after which the
trainer, the config checks, the doctor and the weight sync take it like a built-in one. The toy engine below is
that class (written here, so adding it touches this file and nothing else)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from verl.config import PPOConfig, load_config
from verl.engines import EngineSpec, engine_spec, engines, register_engine, role_engines, rollout_engine
from verl.errors import VerlConfigError
from verl.rollout import RolloutEngine, SamplingParams, Tokenizer
from verl.trainer.main_ppo import main

from tests.trainer.conftest import TINY


class ToyRollout(RolloutEngine):
    """Samples one token at a time from the full forward of its own copy of the policy (no KV cache): the
    smallest engine that implements the interface. The 3D-HybridEngine streams the actor's weights into it."""

    name = "toy"

    def __init__(self, model, tokenizer, config):
        super().__init__(Tokenizer.wrap(tokenizer), max_model_len=config.max_model_len)
        self.model, self.loads = copy.deepcopy(model).eval(), 0

    @classmethod
    def from_config(cls, config, *, model=None, model_path=None, tokenizer=None):
        return cls(model, tokenizer, config)

    @torch.inference_mode()
    def _generate(self, prompt_ids, params: SamplingParams):
        outs, stop = [], set(self.tokenizer.eos_token_ids)
        for i, prompt in enumerate(prompt_ids):
            for j in range(params.n):
                gen = torch.Generator().manual_seed(params.sample_seed(i, j) or 0)
                ids, tokens, lps = list(prompt), [], []
                for _ in range(self.budget(len(prompt), params)):
                    logits = self.model(torch.tensor([ids])).logits[0, -1].float() / max(params.temperature, 1e-6)
                    logp = logits.log_softmax(-1)
                    t = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    ids.append(t), tokens.append(t), lps.append(float(logp[t]))
                    if t in stop:
                        break
                reason = "stop" if tokens and tokens[-1] in stop else "length"
                outs.append(self._finish(i, j, prompt, tokens, reason, lps if params.logprobs else None, ()))
        return outs

    def _update_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        n = 0
        for name, tensor in named_tensors:
            params[name].data.copy_(tensor)
            n += 1
        self.loads += 1
        return n

    def _release(self):
        pass

    def _resume(self):
        pass


register_engine(EngineSpec(name="toy", kind="rollout", summary="a test engine: full forward per token",
                           factory=f"{__name__}:ToyRollout"))


def test_the_table_holds_every_built_in_engine_with_its_capabilities():
    assert {"hf", "torch", "vllm", "sglang", "toy"} <= set(engines("rollout"))
    assert engines("training") == ("fsdp", "megatron", "torch") and role_engines("reward") == ("rule", "torch")
    assert engines("rollout", pausable=True) == ("torch",)
    assert set(engines("rollout", exclusive=True)) == {"sglang", "vllm"}
    assert rollout_engine("vllm").needs_model_dir and training_engine_spans_world("megatron")
    with pytest.raises(VerlConfigError, match=r"rollout.engine: unknown rollout engine 'vlm' \(did you mean 'vllm'"):
        rollout_engine("vlm", "rollout.engine")
    with pytest.raises(VerlConfigError, match="rollout engine 'toy' is already registered"):
        register_engine(EngineSpec(name="toy", kind="rollout", summary="another"))


def training_engine_spans_world(name: str) -> bool:
    return engine_spec("training", name).spans_world


def test_a_new_engine_is_checked_by_its_capabilities():
    with pytest.raises(VerlConfigError, match=r"rollout.tp=2 with rollout.engine=toy.*one of \['sglang', 'vllm'\]"):
        load_config(PPOConfig, None, ["rollout.engine=toy", "rollout.tp=2"])
    with pytest.raises(VerlConfigError, match=r"rollout.engine=toy cannot do \(engines that can: \['torch'\]\)"):
        load_config(PPOConfig, None, ["rollout.engine=toy", "rollout.partial=true", "trainer.mode=async"])
    cfg = load_config(PPOConfig, None, ["rollout.engine=toy", "rollout.cpu_offload=true"])
    with pytest.raises(VerlConfigError, match="rollout.cpu_offload=true but its engine 'toy' cannot offload"):
        cfg.roles(1)


def test_verl_train_runs_the_new_engine_and_syncs_weights_into_it(tmp_path):
    assert main([*TINY, f"trainer.output_dir={tmp_path / 'run'}", "rollout.engine=toy", "trainer.save_final=false",
                 "trainer.export_hf=false", "trainer.plot=false", "actor.optim.lr=1e-2"]) == 0
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward/mean" in r]
    assert len(steps) == 2
    # a copy of the policy, not the actor's module: every step's sync streamed the weights in
    assert all(r["perf/sync_shared"] == 0.0 and r["perf/sync_bytes"] > 0 for r in steps)
