"""A generated corpus of multi-turn tool conversations that proves token-in-token-out on a chat template
(benchmarks/tito/bench_tito.py runs >= 10,000 per template; tests/agents/test_tito_corpus.py a CI-sized slice).

Every conversation is built the way the agent loop builds a trajectory (`verl.agents.ChatFormat`): the prompt's
ids from the template, each assistant turn as "sampled" ids (the turn's canonical encoding plus the end-of-turn
token, or, for a share of turns, a non-canonical split of the same text, as a sampler can produce), each group of
observations as the template's delta. Tool outputs are drawn to break things: unicode from many scripts
(combining marks, emoji, right-to-left), empty strings, very long ones, special-token look-alikes of every
template, JSON, bare whitespace. Some conversations get a follow-up user message (which a reasoning-stripping
template rewrites history on).

Per conversation three things are measured:
- the loop's check (`ChatFormat.check`): equal, or which kinds of difference;
- an independent oracle: the tokenizer's own `apply_chat_template(tokenize=True)` over the final messages
  compared with the trajectory's ids (another code path than the check's render-then-encode);
- the trained tokens: every position of loss mask 1 holds the id that was "sampled" there.

A *silent* mismatch is a trajectory the oracle finds different while the check passed it (or the reverse), or a
trained token that was not sampled; the corpus must have none.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field

from verl.agents.chat import ChatFormat, Segment
from verl.agents.formats import get_format
from verl.rollout.tokenizer import Tokenizer

__all__ = ["CorpusResult", "run_corpus"]

_TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates an expression.",
                                            "parameters": {"type": "object", "properties": {
                                                "expression": {"type": "string"}}, "required": ["expression"]}}},
          {"type": "function", "function": {"name": "search", "description": "Searches the web.",
                                            "parameters": {"type": "object", "properties": {
                                                "query": {"type": "string"}}, "required": ["query"]}}}]

_LOOKALIKES = ["<|im_end|>", "<|im_start|>assistant\n", "<|im_start|>user\n", "<|endoftext|>", "<|eot_id|>",
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|begin_of_text|>", "<|python_tag|>",
               "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>", "<s>",
               "</s>", "<|im_end", "im_end|>", "< |im_end| >", "<|eot_id", "[INST]"]
_SCRIPTS = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF), (0x600, 0x6FF),
            (0x900, 0x97F), (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAC8F), (0x1F300, 0x1F64F),
            (0x300, 0x36F), (0x2000, 0x206F)]
_WORDS = ("the result is found in table seven of the report while the answer depends on what you ask and how "
          "we compute every value carefully before writing it down").split()


def _unicode(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        lo, hi = rng.choice(_SCRIPTS)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def tool_output(rng: random.Random) -> tuple[str, str]:
    """(kind, text) of one random tool output."""
    kind = rng.choice(["unicode", "empty", "long", "lookalike", "json", "whitespace", "number", "text"])
    if kind == "unicode":
        return kind, _unicode(rng, rng.randint(1, 60))
    if kind == "empty":
        return kind, ""
    if kind == "long":
        return kind, " ".join(_text(rng, 20) + _unicode(rng, 5) for _ in range(rng.randint(20, 60)))
    if kind == "lookalike":
        parts = [rng.choice(_LOOKALIKES) if rng.random() < 0.5 else _text(rng, 2) for _ in range(rng.randint(1, 6))]
        return kind, "".join(parts)
    if kind == "json":
        return kind, json.dumps({"value": rng.random(), "items": [_text(rng, 2), _unicode(rng, 3)], "ok": True},
                                ensure_ascii=rng.random() < 0.5)
    if kind == "whitespace":
        return kind, rng.choice([" ", "\n", "\n\n", "\t", "  \n  ", " trailing space "])
    if kind == "number":
        return kind, str(rng.randint(-10**12, 10**12))
    return kind, _text(rng, rng.randint(1, 30))


@dataclass(slots=True)
class _Conversation:
    messages: list[dict]
    ids: list[int]
    mask: list[int]
    sampled: list[list[int]]
    segments: list[Segment]
    noncanonical: int = 0
    outputs: list[str] = field(default_factory=list)


def _assistant_text(rng: random.Random, fmt, reasoning: bool, final: bool) -> tuple[str, int]:
    """(text, number of tool calls) of one assistant turn."""
    head = f"<think>\n{_text(rng, rng.randint(2, 12))}\n</think>\n\n" if reasoning else ""
    if final:
        return head + _text(rng, rng.randint(1, 15)) + rng.choice(["", ".", " 42", " " + _unicode(rng, 3)]), 0
    calls = rng.randint(1, 2) if fmt.name == "hermes" else 1
    body = [fmt.call_text(*rng.choice([("calculator", {"expression": f"{rng.randint(0, 999)} + {rng.randint(0, 99)}"}),
                                        ("search", {"query": _text(rng, 3) + _unicode(rng, 2)})]))
            for _ in range(calls)]
    if fmt.name == "hermes":
        lead = _text(rng, rng.randint(0, 6))
        return head + (lead + "\n" if lead else "") + "\n".join(body), calls
    return head + body[0], 1


def _sampled(chat: ChatFormat, rng: random.Random, text: str, noncanonical: float) -> tuple[list[int], bool]:
    """The turn's ids as an engine might sample them: canonical, or with one token split in two (same text)."""
    ids = chat.encode(text)
    if ids and rng.random() < noncanonical:
        for _ in range(8):
            k = rng.randrange(len(ids))
            piece = chat.tok.hf.decode([ids[k]], clean_up_tokenization_spaces=False)
            if len(piece) < 2:
                continue
            at = rng.randint(1, len(piece) - 1)
            split = chat.encode(piece[:at]) + chat.encode(piece[at:])
            if chat.tok.hf.decode(split, clean_up_tokenization_spaces=False) == piece and split != [ids[k]]:
                return ids[:k] + split + ids[k + 1:] + [chat.end_token], True
    return ids + [chat.end_token], False


def conversation(chat: ChatFormat, fmt, rng: random.Random, *, reasoning: bool, noncanonical: float,
                 followup: float) -> _Conversation:
    """One random tool conversation, built as the agent loop builds a trajectory."""
    messages = ([{"role": "system", "content": _text(rng, 5)}] if rng.random() < 0.5 else []) + \
        [{"role": "user", "content": _text(rng, rng.randint(2, 10)) + rng.choice(["?", " " + _unicode(rng, 4)])}]
    ids = chat.prompt_ids(messages)
    conv = _Conversation(messages=messages, ids=list(ids), mask=[0] * len(ids), sampled=[],
                         segments=[Segment("prompt", 0, len(ids), -1)])
    rounds = rng.randint(1, 4)
    for turn in range(rounds + 1):
        text, calls = _assistant_text(rng, fmt, reasoning and rng.random() < 0.7, final=turn == rounds)
        sampled, odd = _sampled(chat, rng, text, noncanonical)
        conv.noncanonical += odd
        conv.sampled.append(sampled)
        conv.segments.append(Segment("assistant", len(conv.ids), len(conv.ids) + len(sampled), turn))
        conv.ids += sampled
        conv.mask += [1] * len(sampled)
        conv.messages.append({"role": "assistant", "content": chat.turn_text(sampled)})
        if turn == rounds:
            break
        if rng.random() < followup:
            obs = [{"role": "user", "content": _text(rng, rng.randint(1, 8))}]
        else:
            obs = []
            for _ in range(calls):
                _, out = tool_output(rng)
                conv.outputs.append(out)
                obs.append({"role": fmt.observation_role, "content": out})
        delta = chat.observation_ids(obs, sampled[-1])
        conv.segments.append(Segment("observation", len(conv.ids), len(conv.ids) + len(delta), turn))
        conv.ids += delta
        conv.mask += [0] * len(delta)
        conv.messages.extend(obs)
    return conv


@dataclass(slots=True)
class CorpusResult:
    """One template's corpus run."""

    template: str
    append_only: bool
    rule: str
    conversations: int = 0
    turns: int = 0
    tool_outputs: int = 0
    equal: int = 0
    mismatches: int = 0
    """Conversations the check found different from the template (every one explained), by kind below."""
    kinds: dict[str, int] = field(default_factory=dict)
    rewritten: int = 0
    """Conversations whose only difference is the template's history rewrite (non-append-only rule)."""
    noncanonical_turns: int = 0
    """Turns given a non-canonical split on purpose."""
    noncanonical_conversations: int = 0
    """Conversations with such a turn: each must be caught ('retokenized')."""
    noncanonical_caught: int = 0
    """Those the check reported as retokenized."""
    noncanonical_missed: int = 0
    """Those the check passed as equal: must be 0."""
    silent: int = 0
    """Check and oracle disagree, or a trained token was not sampled: must be 0."""
    untrained_sampled: int = 0
    check_ms_per_turn_mean: float = 0.0
    check_ms_per_turn_p50: float = 0.0
    examples: list[str] = field(default_factory=list)


def run_corpus(name: str, hf_tokenizer, conversations: int, *, seed: int = 0, noncanonical: float = 0.05,
               followup: float = 0.2) -> CorpusResult:
    """`conversations` random conversations over the chat template of `hf_tokenizer` (module docstring)."""
    fmt = get_format("json" if name == "llama3" else "hermes")
    chat = ChatFormat(Tokenizer(hf_tokenizer), tools=_TOOLS, observation_role=fmt.observation_role)
    res = CorpusResult(template=name, append_only=chat.append_only,
                       rule="" if chat.append_only else "turns kept as generated; the rewrite counted apart")
    rng = random.Random(seed)
    per_turn = []
    kwargs = {"tools": chat.tools} if chat.tools else {}
    for _ in range(conversations):
        conv = conversation(chat, fmt, rng, reasoning=name.startswith("qwen"), noncanonical=noncanonical,
                            followup=followup)
        turns = len(conv.sampled)
        t0 = time.perf_counter()
        check = chat.check(conv.messages, conv.ids, conv.segments)
        per_turn.append((time.perf_counter() - t0) / turns)
        oracle = list(hf_tokenizer.apply_chat_template(conv.messages, tokenize=True, add_generation_prompt=False,
                                                       return_dict=False, **kwargs))
        actual = conv.ids + chat.encode(chat.end_tail(conv.ids[-1]))
        res.conversations += 1
        res.turns += turns
        res.tool_outputs += len(conv.outputs)
        res.noncanonical_turns += conv.noncanonical
        res.noncanonical_conversations += conv.noncanonical > 0
        res.noncanonical_caught += conv.noncanonical > 0 and "retokenized" in check.kinds
        res.noncanonical_missed += conv.noncanonical > 0 and check.ok
        trained = [t for t, m in zip(conv.ids, conv.mask) if m]
        if trained != [t for s in conv.sampled for t in s]:
            res.untrained_sampled += 1
        if check.ok != (oracle == actual) or trained != [t for s in conv.sampled for t in s]:
            res.silent += 1
        if check.ok:
            res.equal += 1
        elif check.rewritten_only:
            res.rewritten += 1
        else:
            res.mismatches += 1
            for k in set(check.kinds):
                res.kinds[k] = res.kinds.get(k, 0) + 1
            if len(res.examples) < 3:
                res.examples.append(check.detail[:300])
    ms = [1e3 * t for t in per_turn]
    res.check_ms_per_turn_mean = statistics.fmean(ms) if ms else 0.0
    res.check_ms_per_turn_p50 = statistics.median(ms) if ms else 0.0
    return res
