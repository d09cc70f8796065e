"""Prompts are encoded exactly as the model's own tokenizer does, in one place (verl.rollout.Tokenizer) that the
trainer's rollout worker and the engines share. With SmolLM2 (whose BOS, <|im_start|>, its tokenizer never
adds to plain text): no BOS is forced onto text prompts, and chat prompts are the chat template's tokens."""

from __future__ import annotations

import pytest

from verl.data import make_task
from verl.rollout import RolloutConfig, SamplingParams, Tokenizer, build_rollout
from verl.workers import RolloutWorker

IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> (its bos_token) and <|im_end|> (its eos_token)
QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from verl.models.pretrained import load_pretrained
    return load_pretrained(smollm2_dir)


def test_text_prompts_get_no_forced_bos(smol):
    _, hf = smol
    assert hf.bos_token_id == IM_START
    ids = Tokenizer.wrap(hf).encode_prompt(QUESTION)
    assert ids == hf(QUESTION)["input_ids"] and IM_START not in ids
    assert hf.decode(ids) == QUESTION


def test_chat_prompts_are_the_chat_templates_tokens(smol):
    _, hf = smol
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    ids = Tokenizer.wrap(hf).encode_prompt(messages)
    by_hand = (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
               f"<|im_start|>assistant\n")
    assert ids == hf(by_hand, add_special_tokens=False)["input_ids"]
    assert ids.count(IM_START) == 3 and ids.count(IM_END) == 2 and hf.decode(ids[-4:]) == "<|im_start|>assistant\n"
    # the template's default system message when the chat has none
    no_system = Tokenizer.wrap(hf).encode_prompt(messages[1:])
    assert "You are a helpful AI assistant named SmolLM" in hf.decode(no_system)


def test_the_trainer_and_the_engine_encode_in_the_one_place(smol):
    """The rollout worker's encoding (what the trainer checks against data.max_prompt_length) is the prompt the
    engine generates from, for text and for gsm_symbolic's chat rows alike."""
    pytest.importorskip("reasoning_gym")
    model, hf = smol
    rows = [{"prompt": QUESTION, "answer": "7"}, *make_task("gsm_symbolic", 1, seed=0)]
    cfg = RolloutConfig(engine="torch", n=1, max_new_tokens=2)
    worker = RolloutWorker(build_rollout(cfg, model=model, tokenizer=hf), cfg, max_prompt_length=512)
    ids = worker.encode(rows)
    assert ids[0] == hf(QUESTION)["input_ids"]
    chat = hf.apply_chat_template(rows[1]["prompt"], tokenize=False, add_generation_prompt=True)
    assert ids[1] == hf(chat, add_special_tokens=False)["input_ids"]
    outs = worker.engine.generate(ids, SamplingParams(max_new_tokens=2, temperature=0.0))
    assert [list(o.prompt_token_ids) for o in outs] == ids
    batch = worker.generate(rows, greedy=True)
    for i, want in enumerate(ids):
        P = batch.prompt_length
        got = batch.input_ids[i, :P][batch.attention_mask[i, :P].bool()].tolist()
        assert got == want
