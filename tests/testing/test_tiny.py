"""The one tiny-model builder: every family and option it promises, reproducibility, and its errors."""

from __future__ import annotations

import pytest
import torch

from verl.config import TinyModelConfig
from verl.data import task_corpus
from verl.errors import VerlConfigError
from verl.models.tiny import TEST_SHAPE, save_tiny, tiny_config, tiny_model, tiny_tokenizer


@pytest.mark.parametrize("family,qkv_bias", [("llama", False), ("llama", True), ("qwen2", True), ("mistral", False)])
def test_each_family_has_the_asked_shape_and_biases(family, qkv_bias):
    model = tiny_model(family=family, num_kv_heads=1, qkv_bias=qkv_bias if family == "llama" else None)
    cfg = model.config
    assert cfg.model_type == family and cfg.num_key_value_heads == 1
    assert cfg.hidden_size == TEST_SHAPE.hidden_size and cfg.vocab_size == TEST_SHAPE.vocab_size
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (cfg.hidden_size // cfg.num_attention_heads, cfg.hidden_size)
    assert (attn.q_proj.bias is not None) == qkv_bias


@pytest.mark.parametrize("tie", [False, True])
def test_tied_and_untied_embeddings(tie):
    model = tiny_model(tie_word_embeddings=tie)
    shared = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shared == tie


def test_same_seed_same_weights_and_the_global_rng_is_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = tiny_model(seed=4, noise=0.1), tiny_model(seed=4, noise=0.1)
    c = tiny_model(seed=5, noise=0.1)
    assert torch.equal(torch.get_rng_state(), before)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert not torch.equal(a.model.norm.weight, c.model.norm.weight)
    assert not torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight)), "noise reaches the norms"


def test_the_default_jobs_tokenizer_and_policy():
    tok = tiny_tokenizer(task_corpus("arithmetic"), 96)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    assert tok.tokenize("123+45=") == ["1", "2", "3", "+", "4", "5", "="]  # digits are always single tokens
    assert tok.padding_side == "left" and tok.chat_template
    model = tiny_model(TinyModelConfig(), tokenizer=tok, tie_word_embeddings=True, seed=1)
    cfg = model.config
    assert cfg.vocab_size == len(tok) and cfg.pad_token_id == tok.pad_token_id and cfg.eos_token_id == tok.eos_token_id
    assert cfg.hidden_size == TinyModelConfig().hidden_size and model.training


def test_reward_head_and_save_round_trip(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = tiny_tokenizer()
    rm = tiny_model(head="score", tokenizer=tok, num_layers=1)
    save_tiny(rm, tok, tmp_path)
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert back.config.num_labels == 1 and torch.equal(back.score.weight, rm.score.weight)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("the quick") == tok.encode("the quick")


def test_errors_name_the_bad_value_and_the_fix():
    with pytest.raises(VerlConfigError, match="did you mean 'num_kv_heads'"):
        tiny_config(num_kv_head=1)
    with pytest.raises(VerlConfigError, match="unknown family 'mistrall'.*did you mean 'mistral'"):
        tiny_config(family="mistrall")
    with pytest.raises(VerlConfigError, match="Qwen2 always has q/k/v biases"):
        tiny_config(family="qwen2", qkv_bias=False)
    with pytest.raises(VerlConfigError, match="mistral has no attention-bias option"):
        tiny_config(family="mistral", qkv_bias=True)
    with pytest.raises(VerlConfigError, match="the tokenizer has"):
        tiny_config(tokenizer=tiny_tokenizer(), vocab_size=7)
    with pytest.raises(VerlConfigError, match="cannot apply"):
        tiny_model(tiny_config(), num_layers=1)
