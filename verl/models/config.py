"""Hugging Face config (Llama / Qwen2 / Mistral families) -> the architecture facts verl builds from.

`ArchSpec` is the single, framework-neutral description: the megatron TransformerConfig, the converters and
the shard descriptions all read it, so the HF config is parsed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl.errors import VerlConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(kw_only=True, slots=True, frozen=True)
class ArchSpec:
    """A decoder-only GQA / SwiGLU / RMSNorm / RoPE transformer, as read from a Hugging Face config."""

    model_type: str
    """HF `model_type` (llama, qwen2, mistral)."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when < num_heads)."""
    head_dim: int
    """Per-head width (may differ from hidden_size / num_heads)."""
    ffn_hidden_size: int
    """SwiGLU inner width (each of gate and up)."""
    vocab_size: int
    """True vocabulary size (before padding)."""
    max_position_embeddings: int
    """Longest sequence RoPE is set up for."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """RoPE base."""
    rope_linear_factor: float | None
    """Linear position interpolation factor (HF rope_type 'linear'), or None."""
    rope_llama3_factor: float | None
    """Llama-3.1 frequency scaling factor (HF rope_type 'llama3'), or None."""
    qkv_bias: bool
    """Bias on the q/k/v projections (Qwen2)."""
    tie_word_embeddings: bool
    """The output layer reuses the input embedding matrix."""
    sliding_window: int | None
    """Mistral/Qwen2 attention window; sequences longer than it are refused (the local attention is full)."""

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope(hf_config) -> tuple[float, float | None, float | None]:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0) or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    partial = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise VerlConfigError(f"partial_rotary_factor={partial} is not supported: the megatron model rotates every "
                              f"head dimension; use a checkpoint with full rotary embeddings")
    if rope_type == "default":
        return theta, None, None
    if rope_type == "linear":
        return theta, float(params["factor"]), None
    if rope_type == "llama3":
        # megatron-core's llama3 scaling hard-codes these three (the Llama-3.1 values).
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        got = {k: params.get(k) for k in expected}
        if any(float(got[k]) != v for k, v in expected.items() if got[k] is not None):
            raise VerlConfigError(f"llama3 rope scaling with {got} is not supported: megatron-core fixes "
                                  f"{expected}; only 'factor' may vary")
        return theta, None, float(params.get("factor", 8.0))
    raise VerlConfigError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


def _sliding_window(hf_config, model_type: str) -> int | None:
    """The attention window, refused when shorter than the context: the megatron model has no local attention,
    so it would attend to tokens the checkpoint's model never sees at longer lengths."""
    window = getattr(hf_config, "sliding_window", None)
    if model_type == "qwen2":
        types = getattr(hf_config, "layer_types", None) or []
        if not getattr(hf_config, "use_sliding_window", False) and "sliding_attention" not in types:
            return None
    if window is None:
        return None
    limit = hf_config.max_position_embeddings
    if window < limit:
        raise VerlConfigError(f"sliding_window={window} is shorter than max_position_embeddings={limit}: the "
                              f"megatron model has no sliding-window attention, so sequences longer than the window "
                              f"would differ from the checkpoint's model. Set max_position_embeddings <= {window} in "
                              f"the checkpoint's config.json if your sequences fit the window, or use a checkpoint "
                              f"without a window (sliding_window: null)")
    return window


def arch_from_hf(hf_config) -> ArchSpec:
    """Reads the architecture from a transformers config; refuses what the megatron model cannot reproduce."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise VerlConfigError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise VerlConfigError(f"hidden_act={act!r} is not supported (SwiGLU needs 'silu')")
    if getattr(hf_config, "mlp_bias", False):
        raise VerlConfigError("mlp_bias=True is not supported (the Llama/Qwen2/Mistral MLPs have no bias)")
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        # Llama's attention_bias also gives o_proj a bias, which the megatron model (add_bias_linear=False)
        # does not have: loading would silently drop it.
        raise VerlConfigError(f"attention_bias=True is not supported for {model_type} (it adds an o_proj bias); "
                              f"q/k/v biases alone are the qwen2 architecture")
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv:
        raise VerlConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    theta, linear, llama3 = _rope(hf_config)
    window = _sliding_window(hf_config, model_type)
    return ArchSpec(
        model_type=model_type, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size, max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=float(hf_config.rms_norm_eps), rope_theta=theta, rope_linear_factor=linear,
        rope_llama3_factor=llama3,
        qkv_bias=model_type == "qwen2",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), sliding_window=window)


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelLayout:
    """How one ArchSpec is split for a given TP size (derived, never configured by hand)."""

    tp_size: int
    """Tensor-parallel size."""
    padded_vocab_size: int
    """Vocabulary padded up to a multiple of `tp_size * vocab_multiple` (extra rows are zero, logits masked)."""
    kv_heads_split: bool
    """True when TP > num_kv_heads: megatron then splits the fused QKV rows evenly (not per group) and
    all-gathers the projection inside attention, so no KV weight is replicated (layout.py explains)."""


def parallel_layout(arch: ArchSpec, tp_size: int, vocab_multiple: int = 1) -> ParallelLayout:
    if arch.num_heads % tp_size:
        raise VerlConfigError(f"num_attention_heads={arch.num_heads} is not divisible by tp={tp_size}; pick a TP "
                              f"size that divides it")
    kv = arch.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise VerlConfigError(f"num_key_value_heads={kv} and tp={tp_size}: one must divide the other "
                              f"(megatron-core's grouped-query attention rule); pick another TP size")
    if arch.ffn_hidden_size % tp_size:
        raise VerlConfigError(f"intermediate_size={arch.ffn_hidden_size} is not divisible by tp={tp_size}")
    multiple = tp_size * vocab_multiple
    padded = -(-arch.vocab_size // multiple) * multiple
    return ParallelLayout(tp_size=tp_size, padded_vocab_size=padded, kv_heads_split=kv < tp_size)


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise VerlConfigError(f"dtype {name!r} is not one of {sorted(table)}")
    return table[name]
