"""Tiny Llama-family models with random weights and a BPE tokenizer trained in memory: no download. The
default job's policy, and every test's and benchmark's model, come from here.

    tok = tiny_tokenizer(task_corpus("arithmetic"), vocab_size=96)             # the default job's tokenizer
    policy = tiny_model(TinyModelConfig(), tokenizer=tok, tie_word_embeddings=True, seed=1)   # and policy
    qwen = tiny_model(family="qwen2", num_kv_heads=1, noise=0.1, seed=3)        # a test's (TEST_SHAPE + overrides)
    moe = tiny_model(family="qwen3_moe", num_experts=4, seed=2)                 # mixture of experts, top-2
    save_tiny(policy, tok, "outputs/tiny")                                      # a Hugging Face directory

A shape is a `TinyModelConfig` (the trainer's typed config) with keyword overrides of its fields; the other
keywords are the family's own Hugging Face config fields (``rope_parameters``, ``initializer_range``, ...).
The same arguments and seed give the same weights, and the global RNG is left as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from verl.config.ppo import TinyModelConfig
from verl.errors import VerlConfigError, nearest

__all__ = ["CHAT_EXAMPLE", "FAMILIES", "SAMPLE_TEXT", "TEST_SHAPE", "save_tiny", "tiny_config", "tiny_model",
           "tiny_tokenizer"]

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config,
            "qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig, "olmoe": OlmoeConfig}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

# Small enough for a multi-rank CPU test, big enough for TP=2 x GQA; 101 is prime, so padding the vocabulary
# to a tensor-parallel multiple is always exercised.
TEST_SHAPE = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                             max_position_embeddings=64, vocab_size=101)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
"""Ids 0..3, in this order, in every tiny tokenizer."""

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")

SAMPLE_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "what is 2 + 2 ? the answer is 4 .",
    "a rollout engine samples tokens with a key value cache",
    "reinforcement learning from human feedback trains a policy",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 4
"""The words the rollout tests and benchmarks prompt with; with `CHAT_EXAMPLE`, `tiny_tokenizer`'s default
corpus."""
CHAT_EXAMPLE = ["<|system|> be brief\n<|user|> 2 + 2 ?\n<|assistant|> 4"] * 4

_SHAPE_TO_HF = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
                "max_position_embeddings": "max_position_embeddings", "vocab_size": "vocab_size"}
_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(TinyModelConfig))


def tiny_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 96) -> PreTrainedTokenizerFast:
    """BPE trained in memory on ``corpus`` (default: `SAMPLE_TEXT` and `CHAT_EXAMPLE`), with at most
    ``vocab_size`` tokens (fewer when the corpus runs out of merges). Digits are always single tokens, so a
    number is spelled the same way wherever it appears (what keeps the arithmetic task learnable by a tiny
    model); characters the corpus never shows become ``<unk>``. Like Llama's tokenizer it starts every encoded
    text with ``<s>`` (its own special-token rule, which the rollout's prompt encoding follows); left padding
    (for generation) and a plain ``<|role|> text`` chat template."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(SAMPLE_TEXT + CHAT_EXAMPLE if corpus is None else list(corpus), trainer=trainer)
    bos = SPECIAL_TOKENS.index("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", padding_side="left")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_config(shape: TinyModelConfig | None = None, *, family: str | None = None,
                tokenizer: PreTrainedTokenizerFast | None = None, tie_word_embeddings: bool = False,
                qkv_bias: bool | None = None, **overrides: Any) -> PretrainedConfig:
    """The Hugging Face config of a tiny model of ``family``: ``shape`` (default `TEST_SHAPE`) with
    ``overrides`` of its fields, then the family's own config fields. With a ``tokenizer`` the vocabulary is
    the tokenizer's and so are the pad/bos/eos ids. ``qkv_bias`` None is the family's default (only Qwen2 has
    q/k/v biases); True on Llama sets ``attention_bias`` (which also biases o_proj). ``family`` None is the
    shape's; mixture-of-experts families take the shape's num_experts / num_experts_per_tok / expert width."""
    family = family or (shape.family if shape is not None else None) or "llama"
    if family not in FAMILIES:
        raise VerlConfigError(f"tiny_config: unknown family {family!r}{nearest(family, FAMILIES, 'families')}")
    cls = FAMILIES[family]
    hf_fields = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    shape_kw = {k: overrides.pop(k) for k in list(overrides) if k in _SHAPE_FIELDS}
    allowed = hf_fields - set(_SHAPE_TO_HF.values())  # the shape's own fields are spelt TinyModelConfig's way
    unknown = [k for k in overrides if k not in allowed]
    if unknown:
        raise VerlConfigError(f"tiny_config: unknown argument '{unknown[0]}'"
                              f"{nearest(unknown[0], list(_SHAPE_FIELDS) + sorted(allowed), 'arguments')}; "
                              f"the shape's fields are TinyModelConfig's, the rest {cls.__name__}'s")
    shape = dataclasses.replace(shape or TEST_SHAPE, **shape_kw)
    kw: dict[str, Any] = {hf: getattr(shape, ours) for ours, hf in _SHAPE_TO_HF.items()}
    kw.update(_family_fields(family, shape))
    if tokenizer is not None:
        if "vocab_size" in shape_kw and shape_kw["vocab_size"] != len(tokenizer):
            raise VerlConfigError(f"tiny_config: vocab_size={shape_kw['vocab_size']} but the tokenizer has "
                                  f"{len(tokenizer)} tokens; drop vocab_size (it is the tokenizer's)")
        kw.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    kw["tie_word_embeddings"] = tie_word_embeddings
    kw.update(_bias_fields(family, qkv_bias))
    if family == "mistral":  # a window as long as the context: full attention, which every verl engine runs
        kw.update(head_dim=shape.hidden_size // shape.num_heads, sliding_window=shape.max_position_embeddings)
    kw.update(overrides)
    return cls(**kw)


def _family_fields(family: str, shape: TinyModelConfig) -> dict[str, Any]:
    """What a family's config needs beyond the shape: an explicit head_dim (Qwen3's default is 128), and the
    experts of a mixture-of-experts family (every layer sparse; Mixtral and OLMoE call the expert width
    intermediate_size)."""
    out: dict[str, Any] = {}
    if family.startswith("qwen3"):
        out["head_dim"] = shape.hidden_size // shape.num_heads
    if family not in MOE_FAMILIES:
        return out
    out["num_local_experts" if family == "mixtral" else "num_experts"] = shape.num_experts
    out["num_experts_per_tok"] = shape.num_experts_per_tok
    if family in ("mixtral", "olmoe"):
        out["intermediate_size"] = shape.expert_size
    else:
        out.update(moe_intermediate_size=shape.expert_size, norm_topk_prob=family == "qwen3_moe")
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = shape.expert_size
    return out


def _bias_fields(family: str, qkv_bias: bool | None) -> dict[str, Any]:
    if qkv_bias is None or qkv_bias == (family == "qwen2"):
        return {}
    if family == "llama":
        return {"attention_bias": True}
    if family == "qwen2":
        raise VerlConfigError("tiny_config: Qwen2 always has q/k/v biases; use family='llama' for none")
    raise VerlConfigError(f"tiny_config: {family} has no attention-bias option; use family='qwen2' (q/k/v biases) "
                          f"or 'llama' with qkv_bias=True")


def tiny_model(shape: TinyModelConfig | PretrainedConfig | None = None, *, seed: int = 0, noise: float = 0.0,
               head: Literal["lm", "score"] = "lm", **config_kwargs: Any) -> PreTrainedModel:
    """A randomly initialised model, reproducible from ``seed`` (float32, as constructed: training mode).

    ``shape`` is a `TinyModelConfig` (``config_kwargs`` as for `tiny_config`) or a ready Hugging Face config.
    ``noise``: the std of Gaussian noise added to every norm weight and bias, which are otherwise all ones and
    zeros, so that a weight-layout mistake in them would change nothing a test can see. ``head="score"``: a
    scalar sequence-classification head (a reward model) instead of the LM head."""
    if head not in ("lm", "score"):
        raise VerlConfigError(f"tiny_model: head={head!r}; use 'lm' (causal LM) or 'score' (reward model)")
    if isinstance(shape, PretrainedConfig):
        if config_kwargs:
            raise VerlConfigError(f"tiny_model: given a Hugging Face config, {sorted(config_kwargs)} cannot "
                                  f"apply; set them on the config (or pass a TinyModelConfig shape)")
        config = copy.deepcopy(shape)
    else:
        config = tiny_config(shape, **config_kwargs)
    if head == "score":
        config.num_labels = 1
    auto = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config)
        if noise:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name or name.endswith("bias"):
                        p.add_(torch.randn_like(p) * noise)
    return model


def save_tiny(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast | None, path: str | Path, *,
              max_shard_size: str | None = None) -> Path:
    """``model`` (and ``tokenizer``) as a Hugging Face directory at ``path`` (safetensors; sharded when
    ``max_shard_size`` is given), which vLLM, `AutoModelForCausalLM.from_pretrained` and verl's megatron
    loader read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
