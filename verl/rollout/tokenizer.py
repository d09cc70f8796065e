"""One tokenizer wrapper shared by every rollout engine: prompts in (text, token ids or chat messages),
text out, padding side and special tokens decided in one place."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verl.errors import VerlConfigError, library_errors

__all__ = ["Tokenizer"]


class Tokenizer:
    """Wraps a Hugging Face tokenizer.

    padding_side: "left" for generation (every prompt ends at the same position, so one KV-cache step
    serves the whole batch). add_special_tokens: whether text prompts get the tokenizer's BOS.
    """

    def __init__(self, hf_tokenizer, *, padding_side: str = "left", add_special_tokens: bool = True):
        if padding_side not in ("left", "right"):
            raise VerlConfigError(f"padding_side={padding_side!r}; choose 'left' (generation) or 'right'")
        self.hf = hf_tokenizer
        self.padding_side = padding_side
        self.add_special_tokens = add_special_tokens

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> Tokenizer:
        from transformers import AutoTokenizer
        with library_errors(f"tokenizer directory {str(path)!r} cannot be loaded",
                            "give a Hugging Face model or tokenizer directory (tokenizer.json, or tokenizer.model "
                            "with its config)"):
            hf = AutoTokenizer.from_pretrained(path)
        return cls(hf, **kwargs)

    @classmethod
    def wrap(cls, tokenizer) -> Tokenizer:
        """Accepts a Tokenizer, a HF tokenizer or a path."""
        if isinstance(tokenizer, Tokenizer):
            return tokenizer
        if isinstance(tokenizer, str):
            return cls.from_pretrained(tokenizer)
        if tokenizer is None:
            raise VerlConfigError("a tokenizer is needed: pass a Hugging Face tokenizer, a verl Tokenizer or a path")
        return cls(tokenizer)

    # -- special tokens -------------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    @property
    def pad_token_id(self) -> int:
        """The pad id; falls back to EOS (then 0), as causal LMs often ship without a pad token."""
        if self.hf.pad_token_id is not None:
            return int(self.hf.pad_token_id)
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    # -- text ↔ ids -----------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        return list(self.hf.encode(text, add_special_tokens=add))

    def encode_prompt(self, prompt) -> list[int]:
        """A prompt given as text, token ids, or chat messages ([{"role":..., "content":...}])."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.reshape(-1).tolist()]
        if len(prompt) > 0 and isinstance(prompt[0], dict):
            return self.encode(self.apply_chat_template(prompt), add_special_tokens=False)
        return [int(t) for t in prompt]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        if getattr(self.hf, "chat_template", None) is None:
            raise VerlConfigError("this tokenizer has no chat template; pass plain text prompts or set "
                                  "tokenizer.hf.chat_template")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def pad(self, batch: Sequence[Sequence[int]], *, side: str | None = None,
            width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) [B, T], padded on `side` (default: padding_side) with pad_token_id to
        `width` columns (default: the longest sequence)."""
        side = side or self.padding_side
        width = max(len(s) for s in batch) if width is None else width
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
            ids[i, sl] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, sl] = 1
        return ids, mask

    def save_pretrained(self, path: str) -> None:
        self.hf.save_pretrained(path)
