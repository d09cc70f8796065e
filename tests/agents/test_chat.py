"""Token-in-token-out over real chat templates: the probe (turn end, stop token, append-only or not), observation
deltas, and the per-trajectory check on a CI-sized slice of the generated corpus (benchmarks/tito/bench_tito.py runs
10,000 conversations per template)."""

from __future__ import annotations

import pytest

from verl.agents import ChatFormat
from verl.agents.chat import Segment
from verl.errors import VerlConfigError
from verl.rollout import Tokenizer
from verl.testing.chat_templates import chat_tokenizer
from verl.models.tiny import tiny_tokenizer
from verl.testing.tito_corpus import run_corpus


@pytest.fixture(scope="module")
def chatml():
    return tiny_tokenizer(["12+3=15 calculator\ntool user assistant"] * 20, 80, chat="chatml")


def test_chatml_probe_and_observation_delta(chatml):
    chat = ChatFormat(Tokenizer(chatml))
    assert chat.append_only and chat.turn_end == "<|im_end|>\n"
    assert chat.stop_ids == {chatml.convert_tokens_to_ids("<|im_end|>")}
    prompt = chat.prompt_ids([{"role": "user", "content": "12+3="}])
    turn = chat.encode("calculator") + [chat.end_token]
    obs = chat.observation_ids([{"role": "tool", "content": "15"}], turn[-1])
    # the rest of the end-of-turn ("\n"), the tool turn, the next generation prompt: exactly the template's text
    assert chat.decode(obs) == "\n<|im_start|>tool\n15<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": chat.turn_text(turn)},
                {"role": "tool", "content": "15"}]
    answer = chat.encode("15") + [chat.end_token]
    ids = prompt + turn + obs + answer
    segs = [Segment("prompt", 0, len(prompt), -1), Segment("assistant", len(prompt), len(prompt) + len(turn), 0),
            Segment("observation", len(prompt) + len(turn), len(ids) - len(answer), 0),
            Segment("assistant", len(ids) - len(answer), len(ids), 1)]
    assert chat.check(messages + [{"role": "assistant", "content": "15"}], ids, segs).ok
    # a turn the engine sampled with another split of the same text: caught, located, explained
    odd = chat.encode("calcul") + chat.encode("ator") + [chat.end_token]
    assert odd != turn and chat.decode(odd) == chat.decode(turn)
    ids2 = prompt + odd + obs + answer
    shift = len(odd) - len(turn)
    segs2 = [segs[0], Segment("assistant", len(prompt), len(prompt) + len(odd), 0),
             Segment("observation", segs[2].start + shift, segs[2].end + shift, 0),
             Segment("assistant", segs[3].start + shift, segs[3].end + shift, 1)]
    check = chat.check(messages + [{"role": "assistant", "content": "15"}], ids2, segs2)
    assert not check.ok and check.kinds == ["retokenized"] and "assistant of turn 0" in check.detail


def test_templates_that_cannot_be_checked_are_refused(chatml):
    tok = tiny_tokenizer(["a b c"] * 10, 60, chat="chatml")
    tok.chat_template = None
    with pytest.raises(VerlConfigError, match="need the tokenizer's chat template"):
        ChatFormat(Tokenizer(tok))
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    with pytest.raises(VerlConfigError, match="cannot be checked"):
        ChatFormat(Tokenizer(tok))  # the rendered turn adds ' ' after the generation prompt, never sampled


CORPUS = 60  # conversations per template in CI (the benchmark runs 10,000)


@pytest.mark.parametrize("name", ["smollm2", "qwen", "llama3", "qwen3_reasoning"])
def test_tito_corpus(name, request):
    tok = chat_tokenizer(name, request.getfixturevalue("smollm2_dir") if name == "smollm2" else None)
    res = run_corpus(name, tok, CORPUS, seed=1, noncanonical=0.1)
    assert res.conversations == CORPUS and res.turns > CORPUS and res.tool_outputs > CORPUS // 2
    assert res.silent == 0 and res.untrained_sampled == 0
    # every planted non-canonical turn is caught, and (append-only templates) nothing else differs
    assert res.noncanonical_conversations > 0 and res.noncanonical_missed == 0
    if name == "qwen3_reasoning":
        # the rewrite is counted apart; every other difference comes from a planted split (one inside reasoning
        # the template drops is part of the rewrite, one next to it may be reported as a different text)
        assert not res.append_only and res.rewritten > 0
        assert res.noncanonical_caught <= res.mismatches <= res.noncanonical_conversations
    else:
        assert res.append_only and res.rewritten == 0
        assert res.noncanonical_caught == res.noncanonical_conversations
        assert res.mismatches == res.noncanonical_conversations and set(res.kinds) == {"retokenized"}
