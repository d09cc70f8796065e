"""A small Llama-architecture model and a BPE tokenizer built locally (no download), for the default job,
tests and benchmarks.

    tokenizer = build_tokenizer(task_corpus("arithmetic"), vocab_size=96)
    model = build_tiny_llama(TinyModelConfig(), tokenizer, seed=1)
    save_pretrained_pair(model, tokenizer, "outputs/tiny")     # a regular Hugging Face directory

Digits are always single tokens (numbers are then spelled the same way wherever they appear, which keeps
the arithmetic task learnable by a tiny model); other symbols merge by BPE trained on the task's text.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from verl.config.ppo import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 96) -> PreTrainedTokenizerFast:
    """BPE trained in memory on `corpus`; pad/bos/eos/unk specials; left padding (for generation)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(list(corpus), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", padding_side="left")
    return hf


def build_tiny_llama(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised `LlamaForCausalLM` of the given shape (float32), reproducible from `seed`."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def save_pretrained_pair(model, tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
