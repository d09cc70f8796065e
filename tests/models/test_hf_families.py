"""Any Hugging Face causal LM as the actor: for tiny random models of several families (built locally from
their configs, no hub), on two gloo ranks, the torch and the FSDP2 engines compute the log-probs a plain HF
forward gives, take the same training step, and push their weights into a torch rollout engine bit-exactly
through the 3D-HybridEngine. One spawned job loops over the families."""

from __future__ import annotations

import copy

import pytest
import torch

from verl.testing import run_distributed

# family → (config class, causal-LM class, config fields beyond the shared tiny shape). Each one exercises
# something a Llama does not: tied embeddings, q/k biases, qk-norm, scaled embeddings and (1 + w) norms, logit
# soft-capping, logit scaling (folded into the temperature), partial rotary with an LM-head bias, fused qkv / gate-up
# projections, routed experts (fused 3-D expert weights, top-k routing).
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": 32}),
    "gemma": ("GemmaConfig", {"head_dim": 8, "hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0,
                                "query_pre_attn_scalar": 8, "sliding_window": 16}),
    "granite": ("GraniteConfig", {"logits_scaling": 2.0, "embedding_multiplier": 3.0, "residual_multiplier": 0.5}),
    "cohere": ("CohereConfig", {"logit_scale": 0.5}),
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.5}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    # mixture of experts: transformers' fused experts, run on verl's dispatch kernels once a torch engine holds them
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12-5=", "answer": "7"},
        {"prompt": "2+2=", "answer": "4"}, {"prompt": "9-1=", "answer": "8"}]
KW = dict(temperature=1.0, responses_per_mini=8, max_response_length=5)


def family_model(family: str, tok, seed: int):
    """A tiny random `family` causal LM over `tok`'s vocabulary, norms and biases perturbed so a mix-up shows."""
    import transformers
    from transformers import AutoModelForCausalLM
    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        max_position_embeddings=64, vocab_size=len(tok), initializer_range=0.2,
        **{"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n or n.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
    return model


def hf_log_probs(model, batch) -> torch.Tensor:
    """log p(response token) from the model's own forward (logits, soft-capping and all) — the reference."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).logits.float()
    P = batch.prompt_length
    lp = logits[:, P - 1:-1].log_softmax(-1).gather(-1, batch.responses[..., None]).squeeze(-1)
    return lp * batch.response_mask


def _full(module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def _synced(actor, family, tok, placement, batch) -> dict:
    """Syncs `actor` into a torch rollout engine holding other weights: tensors that differ afterwards, and
    the largest log-prob gap between the rollout model and the actor."""
    from verl.config import ActorConfig
    from verl.rollout import RolloutConfig, build_rollout
    from verl.workers import ActorWorker, RolloutWorker, TorchEngine
    other = family_model(family, tok, seed=99)
    cfg = RolloutConfig(engine="torch", n=2, max_new_tokens=5)
    RolloutWorker(build_rollout(cfg, model=other, tokenizer=tok), cfg, max_prompt_length=16,
                  placement=placement).sync_weights(actor)
    full, got = _full(actor.engine.module), dict(other.named_parameters())
    lp = ActorWorker(TorchEngine(other, None, placement), ActorConfig(micro_batch_size=4), **KW).compute_log_probs(batch)
    return {"differ": [n for n in full if not torch.equal(full[n], got[n].detach())],
            "sync_lp_gap": float((lp[0] - actor.compute_log_probs(batch)[0]).abs().max())}


def _family_case(family, tok, placement) -> dict:
    from verl.config import ActorConfig, FSDPConfig, OptimConfig
    from verl.rollout import RolloutConfig, build_rollout
    from verl.workers import ActorWorker, RolloutWorker, TorchEngine
    from verl.workers.fsdp import FSDPEngine
    model = family_model(family, tok, seed=3)
    rcfg = RolloutConfig(engine="torch", n=2, max_new_tokens=5)
    batch = RolloutWorker(build_rollout(rcfg, model=model, tokenizer=tok), rcfg, max_prompt_length=16,
                          placement=placement).generate(ROWS, seed=7)
    ref = hf_log_probs(model, batch)
    adv = torch.linspace(-1, 1, len(batch))[:, None] * batch.response_mask
    optim = OptimConfig(lr=1e-2, grad_clip=1.0)
    out = {"tokens": float(batch.response_mask.sum())}
    for name, make in (("torch", lambda m: TorchEngine(m, optim, placement, total_steps=5)),
                       ("fsdp", lambda m: FSDPEngine(m, optim, placement, FSDPConfig(), total_steps=5))):
        actor = ActorWorker(make(copy.deepcopy(model)), ActorConfig(micro_batch_size=4, optim=optim), **KW)
        lp, _ = actor.compute_log_probs(batch)
        stats = actor.update(batch, lp, adv, None)
        out[name] = {"lp_gap": float((lp - ref).abs().max()), "grad_norm": stats["actor/grad_norm"],
                     "params": _full(actor.engine.module), **_synced(actor, family, tok, placement, batch)}
    t, f = out.pop("torch"), out.pop("fsdp")
    out["step_gap"] = max(float((t["params"][n] - f["params"][n]).abs().max()) for n in t["params"])
    out["moved"] = max(float((t["params"][n] - p.detach()).abs().max()) for n, p in model.named_parameters())
    for name, r in (("torch", t), ("fsdp", f)):
        out.update({f"{name}/{k}": v for k, v in r.items() if k != "params"})
    return out


def _families_body(rank, world, families):
    from verl.data import task_corpus
    from verl.distributed import init_placement
    from verl.models.tiny import tiny_tokenizer
    placement = init_placement("cpu")
    tok = tiny_tokenizer(task_corpus("arithmetic"), 96)
    return {family: _family_case(family, tok, placement) for family in families}


@pytest.mark.multiprocess
def test_hf_families_on_torch_and_fsdp_engines():
    families = list(FAMILIES)
    per_rank = run_distributed(_families_body, 2, args=(families,), timeout=600)
    for rank, results in enumerate(per_rank):
        for family in families:
            r = results[family]
            assert r["tokens"] > 0, family
            for engine in ("torch", "fsdp"):
                assert r[f"{engine}/lp_gap"] < 1e-4, (family, engine, r[f"{engine}/lp_gap"])
                assert r[f"{engine}/differ"] == [], (family, engine, r[f"{engine}/differ"])
                assert r[f"{engine}/sync_lp_gap"] == 0.0, (family, engine, r[f"{engine}/sync_lp_gap"])
            assert r["torch/grad_norm"] > 0 and r["fsdp/grad_norm"] == pytest.approx(r["torch/grad_norm"], rel=1e-4)
            assert r["moved"] > 1e-4 and r["step_gap"] < 1e-5, (family, r["moved"], r["step_gap"])
