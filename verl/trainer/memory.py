"""Before step 1: a lower bound of the memory one process needs for a step, refused when it cannot fit.

    parts = estimate_step_memory(cfg, shape, world_size=2)      # [Part(what, bytes, keys), ...]
    check_memory_fits(cfg, shape, placement)                     # VerlConfigError naming the keys, or None

Every part counts only memory that certainly exists (weights, gradients and Adam moments of each trained role on
this rank; the rollout engine's KV cache and one step's logits; the step's batch tensors; the synthetic dataset;
the warm start's logits), so a refusal is never a guess: a config that passes may still need more (activations,
allocator slack), one that fails cannot run here. The bound is per process; on the CPU the processes of one
machine share its memory (LOCAL_WORLD_SIZE of them), on a GPU each has its device's free memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl.config.ppo import PPOConfig
from verl.errors import VerlConfigError

__all__ = ["ModelShape", "Part", "available_bytes", "check_memory_fits", "estimate_step_memory", "hf_shape",
           "model_shape"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_MODEL_KEYS = ("model.tiny.hidden_size", "model.tiny.num_layers", "model.tiny.vocab_size",
               "model.tiny.intermediate_size")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs of the policy's architecture."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    keys: tuple[str, ...]
    """The config keys that set this shape (the tiny model's, or model.path)."""

    @property
    def params(self) -> int:
        head_dim = self.hidden // max(1, self.heads)
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        per_layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * (self.hidden // max(1, self.heads)) * dtype_bytes


@dataclass(frozen=True, slots=True)
class Part:
    """One share of the estimate."""

    what: str
    bytes: int
    keys: tuple[str, ...]
    """The config keys it grows with (what to lower)."""


def model_shape(cfg: PPOConfig, tiny_vocab: int = 1) -> ModelShape | None:
    """The policy's shape from the config alone (model.tiny, or model.path's config.json), before anything is
    built; None when model.path is not a directory with a config.json (a GGUF file or a shipped model's name).
    The tiny model's vocabulary is what its tokenizer learns (at most model.tiny.vocab_size), known only once
    the tokenizer is trained: `tiny_vocab` (a floor before that)."""
    if cfg.model.path is None:
        t = cfg.model.tiny
        return ModelShape(hidden=t.hidden_size, layers=t.num_layers, heads=t.num_heads, kv_heads=t.num_kv_heads,
                          intermediate=t.intermediate_size, vocab=min(tiny_vocab, t.vocab_size), tied=True,
                          keys=_MODEL_KEYS)
    try:
        return hf_shape(json.loads((Path(cfg.model.path) / "config.json").read_text()), ("model.path",))
    except (OSError, ValueError):
        return None  # the loader names what is wrong with the directory


def hf_shape(c: dict[str, Any], keys: tuple[str, ...]) -> ModelShape | None:
    """The shape a Hugging Face config (as a dict) describes; None when it lacks the usual fields."""
    try:
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        return ModelShape(hidden=hidden, layers=int(c["num_hidden_layers"]), heads=heads,
                          kv_heads=int(c.get("num_key_value_heads") or heads),
                          intermediate=int(c.get("intermediate_size") or 4 * hidden), vocab=int(c["vocab_size"]),
                          tied=bool(c.get("tie_word_embeddings", False)), keys=keys)
    except (KeyError, TypeError, ValueError):
        return None


def estimate_step_memory(cfg: PPOConfig, shape: ModelShape | None, world_size: int) -> list[Part]:
    """Lower bounds of what one process holds during a step (see the module docstring), largest first."""
    roles = cfg.roles(world_size)
    dp = cfg.data_parallel_size(len(roles["actor"].ranks))
    seq = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    responses = -(-cfg.batch_responses // dp)
    batch_keys = ("data.train_batch_size", "rollout.n")
    seq_keys = ("data.max_prompt_length", "rollout.max_new_tokens")
    parts = [Part("the step's batch tensors", responses * seq * 8 * 6, batch_keys + seq_keys)]
    if not cfg.data.train_files:
        parts.append(Part("the synthetic dataset", cfg.data.num_examples * 200, ("data.num_examples",)))
    if shape is not None:
        parts += _model_parts(cfg, shape, roles, responses, seq, batch_keys + seq_keys)
    return sorted(parts, key=lambda p: -p.bytes)


def _model_parts(cfg: PPOConfig, shape: ModelShape, roles: dict, responses: int, seq: int,
                 batch_keys: tuple[str, ...]) -> list[Part]:
    b = _DTYPE_BYTES[cfg.model.dtype]
    dtype_key = ("model.dtype",) if cfg.model.path is not None or cfg.model.dtype != "float32" else ()
    keys = shape.keys + dtype_key

    def shards(role: str) -> int:
        engine = roles[role].engine
        if engine == "megatron":
            return cfg.actor.megatron.tp * cfg.actor.megatron.pp
        return len(roles[role].ranks) if engine == "fsdp" else 1

    trained = shape.params * b * 4  # weights, gradients and two Adam moments
    parts = [Part("actor weights, gradients and Adam state", trained // shards("actor"), keys)]
    if cfg.needs_ref:
        parts.append(Part("reference weights", shape.params * b // shards("ref"), keys))
    if cfg.needs_critic:
        parts.append(Part("critic weights, gradients and Adam state", trained // shards("critic"), keys))
    rows = min(responses, cfg.rollout.max_batch_size)
    if cfg.rollout.engine in ("hf", "torch"):
        parts.append(Part("the rollout's KV cache", rows * seq * shape.kv_bytes_per_token(b),
                          batch_keys + ("rollout.max_batch_size",) + keys))
    parts.append(Part("one decode step's logits", rows * shape.vocab * 4,
                      ("rollout.max_batch_size", "rollout.n", "data.train_batch_size") + keys))
    warm = -(-cfg.warmup.batch_size // len(roles["actor"].ranks)) if cfg.warmup.steps else 0
    if warm:  # the warm start's [rows, tokens, vocab] logits and their gradient (at least 2 tokens per row)
        parts.append(Part("the warm start's logits", warm * 2 * shape.vocab * 4 * 2,
                          ("warmup.batch_size",) + keys))
    return parts


def available_bytes(device: str) -> int | None:
    """Memory this process may still use on `device` ('cpu' or 'cuda...'): the GPU's free memory, or the
    machine's available memory (within a cgroup's limit) shared by the processes of this machine."""
    if device.startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    try:  # a container's limit, when tighter than the machine's
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max" and avail is not None:
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    if avail is None:
        return None
    return avail // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def check_memory_fits(cfg: PPOConfig, shape: ModelShape | None, world_size: int, device: str,
                      available: int | None = None) -> None:
    """Raises VerlConfigError, naming the largest parts and the keys that drive them, when the lower bound of
    a step's memory exceeds what this process can have (`available`: measured when None)."""
    parts = estimate_step_memory(cfg, shape, world_size)
    need = sum(p.bytes for p in parts)
    have = available_bytes(device) if available is None else available
    if have is None or need <= have:
        return
    gib = 1 << 30
    top = [p for p in parts if p.bytes >= need * 0.05][:3] or parts[:1]
    why = "; ".join(f"{p.what} {p.bytes / gib:.2f} GiB (grows with {', '.join(_current(cfg, p.keys))})"
                    for p in top)
    raise VerlConfigError(f"one training step needs at least {need / gib:.2f} GiB per process on {device}, but "
                          f"{have / gib:.2f} GiB are available: {why}; lower those keys (or run on more "
                          f"processes / a larger machine)")


def _current(cfg: PPOConfig, keys: tuple[str, ...]) -> list[str]:
    """`key=value` for each key (its value read from the config)."""
    out = []
    for key in dict.fromkeys(keys):
        obj: Any = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        out.append(f"{key}={obj}")
    return out
