"""Hugging Face config (Llama / Qwen2 / Mistral / Qwen3 families and the mixture-of-experts Qwen3-MoE, Qwen2-MoE,
Mixtral and OLMoE) -> the architecture facts verl builds from.

`ArchSpec` is the single, framework-neutral description: the megatron TransformerConfig, the converters and
the shard descriptions all read it, so the HF config is parsed in one place. Mixture-of-experts layers are
described by `MoESpec` (top-k token-choice routing with a softmax router; what else exists is refused by name).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from verl.errors import VerlConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

UNSUPPORTED_MOE = {
    "deepseek_v2": "multi-head latent attention and group-limited routing",
    "deepseek_v3": "multi-head latent attention and sigmoid, group-limited (noaux_tc) routing",
    "glm4_moe": "sigmoid routing with a score-correction bias and expert groups",
    "switch_transformers": "an encoder-decoder with top-1 routing and expert capacity (token dropping)",
    "nllb_moe": "an encoder-decoder with expert capacity and token dropping",
    "jetmoe": "mixture-of-attention-heads as well as of MLP experts",
    "granitemoe": "a fused expert layout with granite's multipliers",
    "dbrx": "a fused expert layout with clipped qkv",
    "phimoe": "sparsemixer routing (not a softmax top-k)",
    "qwen3_next": "gated delta-net linear attention",
    "gpt_oss": "biased experts with a clamped SwiGLU and attention sinks",
}
"""Mixture-of-experts families that route or compute differently from a softmax top-k token choice, with why."""


@dataclass(kw_only=True, slots=True, frozen=True)
class MoESpec:
    """The mixture-of-experts layers of an architecture: top-k token-choice routing over `num_experts` SwiGLU
    experts, a softmax router, optionally a gated shared expert."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is sent to."""
    ffn_hidden_size: int
    """SwiGLU inner width of one routed expert."""
    normalize_top_k: bool
    """The top-k router probabilities are renormalised to sum to 1 (Qwen3-MoE's norm_topk_prob, Mixtral); else
    they are the softmax over all experts, gathered (OLMoE, Qwen2-MoE by default)."""
    layers: tuple[int, ...]
    """Global indices of the MoE layers; the others have a dense SwiGLU MLP of ArchSpec.ffn_hidden_size."""
    shared_ffn_hidden_size: int = 0
    """Width of the shared expert every token also goes through (Qwen2-MoE); 0: none."""
    shared_gate: bool = False
    """The shared expert's output is scaled by sigmoid(hidden @ gate) (Qwen2-MoE's shared_expert_gate)."""
    naming: str = "mlp"
    """Checkpoint names: 'mlp' (mlp.gate, mlp.experts.E.gate_proj/up_proj/down_proj) or 'mixtral'
    (block_sparse_moe.gate, block_sparse_moe.experts.E.w1/w3/w2)."""


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
    qk_norm: str = "none"
    """RMSNorm of queries and keys before RoPE: 'none', 'head' (per head, weight [head_dim]: Qwen3) or
    'projection' (over the whole q / k projection, weights [heads * head_dim]: OLMoE)."""
    moe: MoESpec | None = None
    """The mixture-of-experts layers; None for a dense model."""

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has routed experts."""
        return self.moe is not None and layer in self.moe.layers


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
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
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


def _moe(hf_config, model_type: str) -> MoESpec | None:
    """The MoE layers of a supported MoE family (None for a dense one), refusing variants megatron would change."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    g = functools.partial(getattr, hf_config)
    experts = g("num_local_experts") if model_type == "mixtral" else g("num_experts")
    top_k = g("num_experts_per_tok")
    if not 1 <= top_k <= experts:
        raise VerlConfigError(f"num_experts_per_tok={top_k} must be in [1, {experts}] (the number of experts)")
    if float(g("router_jitter_noise", 0.0) or 0.0):
        raise VerlConfigError(f"router_jitter_noise={g('router_jitter_noise')} is not supported: it multiplies the "
                              f"experts' inputs by noise in training, which megatron-core's router does not; set 0")
    if g("clip_qkv", None) is not None:
        raise VerlConfigError(f"clip_qkv={g('clip_qkv')} is not supported (the megatron attention does not clip)")
    n = hf_config.num_hidden_layers
    step = int(g("decoder_sparse_step", 1) or 1)
    dense = set(g("mlp_only_layers", None) or [])
    layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    if model_type in ("mixtral", "olmoe"):
        width, normalize = hf_config.intermediate_size, model_type == "mixtral" or bool(g("norm_topk_prob", False))
    else:
        width, normalize = g("moe_intermediate_size"), bool(g("norm_topk_prob", False))
    shared = int(g("shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
    return MoESpec(num_experts=experts, top_k=top_k, ffn_hidden_size=width, normalize_top_k=normalize, layers=layers,
                   shared_ffn_hidden_size=shared, shared_gate=shared > 0,
                   naming="mixtral" if model_type == "mixtral" else "mlp")


def arch_from_hf(hf_config) -> ArchSpec:
    """Reads the architecture from a transformers config; refuses what the megatron model cannot reproduce."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in UNSUPPORTED_MOE:
        raise VerlConfigError(f"model_type {model_type!r} is a mixture-of-experts variant verl's megatron models do "
                              f"not support ({UNSUPPORTED_MOE[model_type]}); supported MoE families: {MOE_MODEL_TYPES} "
                              f"(softmax top-k token-choice routing)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise VerlConfigError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise VerlConfigError(f"hidden_act={act!r} is not supported (SwiGLU needs 'silu')")
    if getattr(hf_config, "mlp_bias", False):
        raise VerlConfigError("mlp_bias=True is not supported (the Llama/Qwen2/Mistral MLPs have no bias)")
    if model_type not in ("qwen2", "qwen2_moe") and getattr(hf_config, "attention_bias", False):
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
    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "projection"}.get(model_type, "none")
    return ArchSpec(
        model_type=model_type, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size, max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=float(hf_config.rms_norm_eps), rope_theta=theta, rope_linear_factor=linear,
        rope_llama3_factor=llama3,
        qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)), sliding_window=window,
        qk_norm=qk_norm, moe=_moe(hf_config, model_type))


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
    ep_size: int = 1
    """Expert-parallel size: each EP rank holds num_experts / ep_size consecutive experts of every MoE layer."""
    etp_size: int = 1
    """Expert tensor-parallel size: each expert's matrices are cut over it as a dense MLP's over TP."""

    def local_experts(self, arch: ArchSpec) -> int:
        """Experts of one MoE layer on one EP rank."""
        return arch.moe.num_experts // self.ep_size if arch.moe is not None else 0


def check_moe_layout(arch: ArchSpec, tp_size: int, ep: int, etp: int) -> None:
    """What the architecture decides about EP / ETP (and its q/k norms about TP), refused naming the values."""
    if arch.qk_norm == "projection" and arch.num_kv_heads % tp_size:
        raise VerlConfigError(f"tp={tp_size} does not divide num_key_value_heads={arch.num_kv_heads}: the "
                              f"{arch.model_type} q/k norm spans the whole projection, which verl cuts by whole KV "
                              f"heads; pick a TP size dividing {arch.num_kv_heads}")
    moe = arch.moe
    if moe is None:
        if ep > 1 or etp != tp_size:
            raise VerlConfigError(f"actor.megatron.ep={ep} / etp={etp} apply to mixture-of-experts models; "
                                  f"{arch.model_type} has no experts: leave ep=1 and etp unset")
        return
    if moe.num_experts % ep:
        raise VerlConfigError(f"actor.megatron.ep={ep} does not divide the {moe.num_experts} experts of "
                              f"{arch.model_type}; pick ep dividing {moe.num_experts}")
    if moe.ffn_hidden_size % etp:
        raise VerlConfigError(f"the experts' intermediate size {moe.ffn_hidden_size} is not divisible by "
                              f"actor.megatron.etp={etp}")
    if moe.shared_ffn_hidden_size % tp_size:
        raise VerlConfigError(f"the shared expert's intermediate size {moe.shared_ffn_hidden_size} is not divisible "
                              f"by tp={tp_size}")


def parallel_layout(arch: ArchSpec, tp_size: int, vocab_multiple: int = 1, *, ep: int = 1,
                    etp: int | None = None) -> ParallelLayout:
    if arch.num_heads % tp_size:
        raise VerlConfigError(f"num_attention_heads={arch.num_heads} is not divisible by tp={tp_size}; pick a TP "
                              f"size that divides it")
    kv = arch.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise VerlConfigError(f"num_key_value_heads={kv} and tp={tp_size}: one must divide the other "
                              f"(megatron-core's grouped-query attention rule); pick another TP size")
    dense_layers = arch.moe is None or len(arch.moe.layers) < arch.num_layers
    if dense_layers and arch.ffn_hidden_size % tp_size:
        raise VerlConfigError(f"intermediate_size={arch.ffn_hidden_size} is not divisible by tp={tp_size}")
    etp = tp_size if etp is None else etp
    check_moe_layout(arch, tp_size, ep, etp)
    multiple = tp_size * vocab_multiple
    padded = -(-arch.vocab_size // multiple) * multiple
    return ParallelLayout(tp_size=tp_size, padded_vocab_size=padded, kv_heads_split=kv < tp_size, ep_size=ep,
                          etp_size=etp)


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise VerlConfigError(f"dtype {name!r} is not one of {sorted(table)}")
    return table[name]
