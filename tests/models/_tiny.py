"""Tiny random Hugging Face checkpoints on disk (no hub) for the megatron model tests."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_hf_config(family: str = "llama", *, heads: int = 4, kv_heads: int = 2, vocab: int = 101, layers: int = 2,
                   tie: bool = False, hidden: int = 64, ffn: int = 128, **extra):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    kw = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=tie,
              rms_norm_eps=1e-6, dtype="float32")
    if family == "mistral":
        kw["head_dim"] = hidden // heads
        kw["sliding_window"] = 64
    kw.update(extra)
    return cls(**kw)


def save_tiny_checkpoint(path: str | Path, family: str = "llama", *, seed: int = 0, max_shard_size: str | None = None,
                         with_tokenizer: bool = False, **cfg_kwargs) -> Path:
    """A random-weight causal LM saved with safetensors (sharded when `max_shard_size` is given)."""
    from transformers import AutoModelForCausalLM
    path = Path(path)
    cfg = tiny_hf_config(family, **cfg_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # HF inits norms to 1; random norms make a layout mistake visible
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    if with_tokenizer:
        tiny_tokenizer(cfg.vocab_size).save_pretrained(str(path))
    return path


def tiny_tokenizer(vocab_size: int):
    """A byte-level BPE trained in memory, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 4, "hello world 1 2 3"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).float().eval()
