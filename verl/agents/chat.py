"""Token-in, token-out multi-turn conversations over a model's own chat template.

A trajectory is the exact ids the engine sampled with the observations' ids appended; the model's own turns are
never re-encoded from text. What the template contributes is rendered once per observation, as text *deltas*:

    prompt ids   = encode(render(opening messages, add_generation_prompt))
    after turn k = the template's end-of-turn text not already sampled (ChatML: the "\\n" after <|im_end|>)
                   + render(history + observations, add_generation_prompt) minus render(history)

The deltas are taken on a fixed two-message history (a user message, then an assistant placeholder), so they do
not depend on what the model wrote. `ChatFormat` analyses the template once, up front (`probe`):

- where an assistant turn ends (`turn_end`) and which token the engine should stop a turn on (`stop_ids`);
- whether the template is *append-only* at the points the loop appends (the opening, each assistant turn, each
  group of observations): rendering a longer conversation never changes the text of a shorter one. Templates that
  rewrite history (Qwen3's, which drops the reasoning of assistant turns before the last user message) are not.

The rule for templates that are not append-only: the trajectory keeps every turn as the engine generated it
(earlier reasoning included), so what is trained is still exactly the context each turn was sampled in, and one
sample per trajectory is trained. The template's rewrite is the difference between training and a deployment
that re-renders the history with the template: each trajectory's check counts it (`rollout/tito_rewritten`)
instead of a mismatch, and the run logs the rewrite once.

`check` runs on every trajectory: the template rendered over the final message list (assistant turns as the text
of the sampled ids) is tokenized and compared with the accumulated ids. Equal is the fast path (list equality);
a difference is located (difflib over the two id lists), classified and explained — which turn, which ids, what
text: ``retokenized`` (the same text split into other tokens: a sampled non-canonical tokenization, or tool output
that looks like a special token), ``rewritten`` (a rewrite the probe found), ``differs`` (anything else).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout.tokenizer import Tokenizer

__all__ = ["ChatFormat", "Check", "Segment"]

_PLACEHOLDER = "VERLPLACEHOLDER7319"
_USER = "VERLUSER4417"


@dataclass(frozen=True, slots=True)
class Segment:
    """A span of a trajectory's ids: the prompt, an assistant turn (sampled) or an observation (appended)."""

    kind: str
    """prompt, assistant or observation."""
    start: int
    end: int
    turn: int
    """The assistant turn it belongs to or follows (-1 for the prompt)."""


@dataclass(slots=True)
class Check:
    """The append-only check of one trajectory."""

    ok: bool
    """The template's rendering of the final conversation is the accumulated ids."""
    kinds: list[str] = field(default_factory=list)
    """retokenized / rewritten / differs, one per differing region."""
    detail: str = ""
    """Where and how they differ (first regions), for the log."""

    @property
    def rewritten_only(self) -> bool:
        """Every difference is a history rewrite the probe found (counted apart from mismatches)."""
        return bool(self.kinds) and all(k == "rewritten" for k in self.kinds)


class ChatFormat:
    """A tokenizer's chat template, analysed for multi-turn token-in-token-out (module docstring).

    `tools`: function schemas to pass to the template as its ``tools`` argument (used only when the template
    renders them); `observation_role`: the role of tool results (the probe's observations)."""

    def __init__(self, tokenizer: Tokenizer, *, tools: list[dict] | None = None, observation_role: str = "tool"):
        self.tok = tokenizer
        template = getattr(tokenizer.hf, "chat_template", None)
        if not template:
            raise VerlConfigError("multi-turn rollouts (agent.env) need the tokenizer's chat template, and this "
                                  "tokenizer has none: set one (tokenizer.chat_template) or use a chat model")
        self.native_tools = "tools" in template
        """The template renders the tool schemas itself (from its ``tools`` argument)."""
        self.tools = tools if (tools and self.native_tools) else None
        self.observation_role = observation_role
        self._split, self._chunks = _added_token_splitter(tokenizer.hf), {}
        self._probe_turn_end()
        self.append_only, self.rewrite = self._probe_append_only()

    # -- rendering ----------------------------------------------------------------------------------------------
    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        try:
            return self.tok.hf.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template error names the template's own message
            roles = [m.get("role") for m in messages]
            raise VerlConfigError(f"the chat template cannot render a conversation with roles {roles}: "
                                  f"{type(e).__name__}: {e}") from e

    def encode(self, text: str) -> list[int]:
        """`text` as the tokenizer encodes it (no BOS / EOS added). The tokenizer cuts text at its added tokens
        before normalising and splitting the pieces between them; so is it here, with the pieces' ids cached, so
        that the check re-encodes only what no earlier trajectory or observation already encoded (the tool
        description, the observations, repeated prompts). Tokenizers whose added tokens strip whitespace around
        them (lstrip / rstrip / single_word) are encoded whole."""
        if self._split is None:
            return self.tok.encode(text, add_special_tokens=False)
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            ids = self._chunks.get(piece)
            if ids is None:
                ids = self.tok.hf.encode(piece, add_special_tokens=False)
                if len(self._chunks) > 1 << 16:
                    self._chunks.clear()
                self._chunks[piece] = ids
            out += ids
        return out

    def prompt_ids(self, prompt) -> list[int]:
        """The opening ids: chat messages through the template (generation prompt added), text as the engine
        encodes it."""
        if isinstance(prompt, str):
            return self.tok.encode_prompt(prompt)
        return self.encode(self.render(prompt, add_generation_prompt=True))

    def turn_text(self, ids: list[int]) -> str:
        """An assistant turn's text from its sampled ids (the final stop token left out, special tokens kept)."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def decode(self, ids: list[int]) -> str:
        """Ids to text exactly (special tokens kept, no clean-up of spaces before punctuation)."""
        return self.tok.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- the probe ----------------------------------------------------------------------------------------------
    def _probe_turn_end(self) -> None:
        user = [{"role": "user", "content": _USER}]
        gen = self.render(user, add_generation_prompt=True)
        done = self.render(user + [{"role": "assistant", "content": _PLACEHOLDER}], add_generation_prompt=False)
        if _PLACEHOLDER not in done or not done.startswith(gen):
            raise VerlConfigError("the chat template cannot be checked: rendering an assistant message does not "
                                  "continue the generation prompt (it changes the text before the model's turn), "
                                  "so a sampled turn cannot be appended to the prompt as ids")
        at = done.index(_PLACEHOLDER)
        if done[len(gen):at]:
            raise VerlConfigError(f"the chat template cannot be checked: it puts {done[len(gen):at]!r} between the "
                                  f"generation prompt and the assistant's text, which the model never samples")
        self._base_text = done
        self.turn_end = done[at + len(_PLACEHOLDER):]
        """The template's text after an assistant message's content (ChatML: '<|im_end|>\\n')."""
        end_ids = self.encode(self.turn_end) if self.turn_end else []
        first = end_ids[0] if end_ids else None
        self.end_token = first if first is not None and self.turn_end.startswith(self._text(first)) else None
        """The id the model ends a turn with (the template's first end-of-turn token), or None."""
        self.stop_ids = frozenset(([self.end_token] if self.end_token is not None else []) +
                                  list(self.tok.eos_token_ids))
        """Ids that end a turn: the end-of-turn token and the tokenizer's EOS."""

    def _text(self, token: int) -> str:
        return self.decode([token])

    def _probe_append_only(self) -> tuple[bool, str]:
        """(append-only?, the first rewrite found) at the points the loop appends."""
        obs = self.observation_role
        turns = [[{"role": "user", "content": "Q1"}],
                 [{"role": "assistant", "content": "<think>R1</think>A1"}], [{"role": obs, "content": "T1"}],
                 [{"role": "assistant", "content": "<think>R2</think>A2"}], [{"role": "user", "content": "Q2"}],
                 [{"role": "assistant", "content": "<think>R3</think>A3"}]]
        for system in ([{"role": "system", "content": "S"}], []):
            try:
                return self._appends(system, turns)
            except VerlConfigError:
                if not system:
                    raise
        raise AssertionError("unreachable")

    def _appends(self, system: list[dict], turns: list[list[dict]]) -> tuple[bool, str]:
        conv, before = list(system), None
        for group in turns:
            gen = group[0]["role"] == "assistant"
            if gen:
                before = self.render(conv, add_generation_prompt=True)
            conv = conv + group
            after = self.render(conv, add_generation_prompt=False)
            if before is not None and not after.startswith(before):
                at = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b) if any(
                    a != b for a, b in zip(before, after)) else min(len(before), len(after))
                return False, (f"adding a {group[0]['role']} message re-renders the earlier text: "
                               f"{before[max(0, at - 20):at + 40]!r} became {after[max(0, at - 20):at + 40]!r}")
            before = after
        return True, ""

    # -- observations -----------------------------------------------------------------------------------------
    def end_tail(self, last_token: int | None) -> str:
        """The template's end-of-turn text the model did not sample after a turn that ended with `last_token`."""
        if last_token is not None and last_token in self.stop_ids:
            stop = self._text(last_token)
            if self.turn_end.startswith(stop):
                return self.turn_end[len(stop):]
        return self.turn_end

    def observation_ids(self, observations: list[dict], last_token: int | None) -> list[int]:
        """The ids appended after an assistant turn that ended with `last_token`: the rest of its end-of-turn
        text, the observation messages, and the generation prompt of the next turn."""
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _PLACEHOLDER}]
        after = self.render(base + list(observations), add_generation_prompt=True)
        if not after.startswith(self._base_text):
            roles = [m.get("role") for m in observations]
            raise VerlRuntimeError(f"the chat template renders an assistant turn differently when {roles} messages "
                                   f"follow it, so observations cannot be appended as ids; this template cannot run "
                                   f"multi-turn rollouts")
        return self.encode(self.end_tail(last_token) + after[len(self._base_text):])

    # -- the check --------------------------------------------------------------------------------------------
    def check(self, messages: list[dict], ids: list[int], segments: list[Segment]) -> Check:
        """The append-only check of a finished trajectory (module docstring): `messages` the final conversation
        (assistant turns as `turn_text` of their ids), `ids` prompt + response as accumulated. A last turn the
        model ended is completed by the template's end-of-turn text it did not sample; one cut by its budget is
        compared as a prefix of the rendering."""
        expected = self.encode(self.render(messages, add_generation_prompt=False))
        actual = list(ids)
        if actual and actual[-1] in self.stop_ids:
            actual += self.encode(self.end_tail(actual[-1]))
        else:
            expected = expected[:len(actual)]
        if actual == expected:
            return Check(ok=True)
        return self._explain(actual, expected, segments)

    def _explain(self, actual: list[int], expected: list[int], segments: list[Segment]) -> Check:
        # the common head and tail are cut off first: difflib is quadratic, the differences are usually local
        head = next((k for k, (a, e) in enumerate(zip(actual, expected)) if a != e), min(len(actual), len(expected)))
        tail = 0
        while tail < min(len(actual), len(expected)) - head and actual[-1 - tail] == expected[-1 - tail]:
            tail += 1
        middle = difflib.SequenceMatcher(None, actual[head:len(actual) - tail], expected[head:len(expected) - tail],
                                         autojunk=False).get_opcodes()
        ops = [(tag, i1 + head, i2 + head, j1 + head, j2 + head) for tag, i1, i2, j1, j2 in middle]
        kinds, lines = [], []
        for tag, i1, i2, j1, j2 in ops:
            if tag == "equal":
                continue
            seg = next((s for s in segments if s.start <= i1 < s.end), segments[-1] if segments else None)
            a_text, e_text = self.decode(actual[i1:i2]), self.decode(expected[j1:j2])
            if a_text == e_text:
                kind = "retokenized"
            elif not self.append_only and seg is not None and seg.kind == "assistant" and tag in ("delete", "replace") \
                    and seg is not _last_assistant(segments):
                kind = "rewritten"
            else:
                kind = "differs"
            kinds.append(kind)
            if len(lines) < 3:
                where = "the end-of-turn text" if seg is None or i1 >= seg.end else \
                    f"{seg.kind}{'' if seg.turn < 0 else f' of turn {seg.turn}'}"
                lines.append(f"{kind} in {where} (ids {i1}..{i2}): trajectory {actual[i1:i2][:12]} {a_text[:60]!r} "
                             f"vs template {expected[j1:j2][:12]} {e_text[:60]!r}")
        return Check(ok=False, kinds=kinds, detail="; ".join(lines))


def _added_token_splitter(hf) -> re.Pattern | None:
    """A regex that cuts text at (and keeps) the tokenizer's added tokens, longest first, as the tokenizer itself
    does; None when an added token strips the whitespace around it (then pieces would not encode alike)."""
    added = list(getattr(hf, "added_tokens_decoder", {}).values())
    if not added or any(a.lstrip or a.rstrip or a.single_word or a.normalized for a in added):
        return None
    contents = sorted({a.content for a in added}, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")


def _last_assistant(segments: list[Segment]) -> Segment | None:
    return next((s for s in reversed(segments) if s.kind == "assistant"), None)
