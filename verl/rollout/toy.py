"""A tiny Llama and a BPE tokenizer built locally (no hub): for tests, benchmarks and the default job's
generation engines. Deterministic for a given seed."""

from __future__ import annotations

import os

import torch

__all__ = ["toy_tokenizer", "toy_llama", "save_toy_model", "TOY_CORPUS"]

TOY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "what is 2 + 2 ? the answer is 4 .",
    "a rollout engine samples tokens with a key value cache",
    "reinforcement learning from human feedback trains a policy",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 4

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def toy_tokenizer(vocab_size: int = 384):
    """A byte-level BPE trained in memory on TOY_CORPUS, with <s>, </s>, <pad> and a chat template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(TOY_CORPUS, trainer=trainer)
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def toy_llama(vocab_size: int, *, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
              ffn: int = 256, seed: int = 0, dtype: torch.dtype = torch.float32, tie: bool = False,
              max_positions: int = 512):
    """A randomly initialised LlamaForCausalLM (eval mode); head_dim = hidden / heads must be >= 32 for
    vLLM's CPU attention kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      initializer_range=0.2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


def save_toy_model(path: str, *, seed: int = 0, **kwargs) -> str:
    """Writes a toy Llama + tokenizer as a Hugging Face model directory (what vLLM loads); returns `path`."""
    tok = toy_tokenizer()
    model = toy_llama(len(tok), seed=seed, **kwargs)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
