"""Build a megatron-core GPTModel (Llama / Qwen2 / Mistral / Qwen3, and the mixture-of-experts Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE) from a Hugging Face config, TP/SP/PP-sharded, its experts EP × ETP-sharded."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.models.config import ArchSpec, ParallelLayout, arch_from_hf, dtype_from_name, parallel_layout
from verl.models.layout import ShardSpec, shard_spec


@dataclass(kw_only=True, slots=True)
class BuildOptions:
    """How to build the megatron model (architecture comes from the HF config)."""

    params_dtype: str = "float32"
    """Parameter dtype: float32 | bfloat16 | float16."""
    value_head: bool = False
    """Critic / reward model: the output layer is a scalar head per token instead of the vocabulary."""
    vocab_multiple: int = 1
    """Pad the vocabulary to a multiple of tp * vocab_multiple (e.g. 64 for GPU-friendly shapes)."""
    spec: str = "auto"
    """Layer implementation: 'local' (megatron-core modules, CPU and GPU), 'te' (Transformer Engine), or
    'auto' (TE when importable with CUDA, else local)."""
    init_method_std: float = 0.02
    """Std of the random init (weights loaded from a checkpoint overwrite it)."""
    recompute: bool = False
    """Full activation recomputation of every layer (memory for compute)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the MoE load-balancing auxiliary loss (Switch-Transformer form, per layer); 0 disables it."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the MoE router z-loss (mean squared log-sum-exp of the router logits); 0 disables it."""


@dataclass(kw_only=True, slots=True)
class MegatronGPT:
    """A built model and everything needed to map it back to Hugging Face."""

    module: torch.nn.Module
    """This rank's GPTModel stage (wrapped in megatron DDP once `build_optimizer` ran)."""
    arch: ArchSpec
    """The architecture (from the HF config)."""
    layout: ParallelLayout
    """Vocab padding and GQA split for this TP size."""
    pg: Placement
    """The process groups it was built for."""
    hf_config: object
    """The transformers config it was built from (written back on export)."""
    options: BuildOptions
    """Build options."""
    spec: str = "local"
    """The layer implementation actually used: 'local' or 'te'."""

    @property
    def device(self) -> torch.device:
        """Where this stage's parameters (and so its inputs and outputs) live."""
        return next(self.gpt.parameters()).device

    @property
    def gpt(self) -> torch.nn.Module:
        """The bare GPTModel (inside any DDP wrapper)."""
        m = self.module
        while hasattr(m, "module") and not hasattr(m, "decoder"):
            m = m.module
        return m

    @property
    def layer_offset(self) -> int:
        """Global index of this stage's first layer."""
        layers = self.gpt.decoder.layers
        return layers[0].layer_number - 1 if len(layers) else 0

    def shard_specs(self) -> list[ShardSpec]:
        """Per local parameter: megatron name, HF segments, global shape, TP dim, stage, dtype (this rank holds
        chunk `spec.chunk_index(tp=pg.tp_rank, dp=pg.dp_rank, etp=pg.etp_rank)` of each)."""
        return [shard_spec(name, arch=self.arch, layout=self.layout, layer_offset=self.layer_offset,
                           stage=self.pg.pp_rank, dtype=p.dtype, ep_rank=self.pg.ep_rank)
                for name, p in self.gpt.named_parameters()]


class ValueHead(torch.nn.Module):
    """Scalar per token, replacing GPTModel's output layer (same call signature: returns (out, bias))."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, dtype: torch.dtype, std: float):
        super().__init__()
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        torch.nn.init.normal_(self.value_head.weight, std=std)
        torch.nn.init.zeros_(self.value_head.bias)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
            # Every TP rank computes the same values from the full sequence, so the backward must split the
            # grad (not sum it over TP as for a vocab-parallel output).
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return self.value_head(hidden_states), None


def _use_te(spec: str) -> bool:
    te_ok = importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()
    if spec == "te" and not te_ok:
        raise VerlConfigError("spec='te' needs transformer_engine and a CUDA GPU; use spec='local' or 'auto'")
    if spec not in ("auto", "te", "local"):
        raise VerlConfigError(f"spec={spec!r} is not one of auto / te / local")
    return spec == "te" or (spec == "auto" and te_ok)


def transformer_config(arch: ArchSpec, layout: ParallelLayout, pg: Placement, options: BuildOptions):
    """The megatron TransformerConfig equivalent to the HF architecture."""
    from megatron.core.transformer import TransformerConfig
    if arch.num_layers % pg.pp_size:
        raise VerlConfigError(f"num_hidden_layers={arch.num_layers} is not divisible by pp={pg.pp_size}")
    dtype = dtype_from_name(options.params_dtype)
    extra = {}
    if options.recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        tensor_model_parallel_size=pg.tp_size, pipeline_model_parallel_size=pg.pp_size,
        sequence_parallel=pg.sequence_parallel, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=options.init_method_std,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Fusions need CUDA/apex/TE; the unfused paths are what we compare against transformers.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        # per-head q/k norms are replicated over TP (megatron sums their grads over TP when this is set); OLMoE's
        # projection norms are TP-sharded (verl.models.moe.ProjectionRMSNorm), so they must not be
        qk_layernorm=arch.qk_norm == "head", **_moe_config(arch, pg, options), **extra)
    # Micro-batches may differ in padded length; set after __post_init__, whose check of this flag only
    # concerns MoE token dispatchers (there are none here).
    config.variable_seq_lengths = True
    return config


def _moe_config(arch: ArchSpec, pg: Placement, options: BuildOptions) -> dict:
    """TransformerConfig fields of the MoE layers (none for a dense model). Routing is the checkpoint's: top-k of
    a float32 softmax router, renormalised or not (`moe_router_pre_softmax`), dropless, all-to-all dispatch."""
    moe = arch.moe
    if moe is None:
        return {}
    return dict(num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.ffn_hidden_size,
                moe_router_pre_softmax=not moe.normalize_top_k, moe_router_score_function="softmax",
                moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                moe_layer_freq=[int(arch.is_moe_layer(i)) for i in range(arch.num_layers)],
                moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size or None,
                moe_shared_expert_gate=moe.shared_gate, moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=options.moe_aux_loss_coeff, moe_z_loss_coeff=options.moe_z_loss_coeff or None,
                expert_model_parallel_size=pg.ep_size, expert_tensor_parallel_size=pg.etp_size)


def _layer_spec(arch: ArchSpec, pg: Placement, use_te: bool):
    """megatron's layer spec for a dense model; for MoE models (and OLMoE's q/k norm) this stage's layers, each
    with verl's MoE classes where it has experts (verl.models.moe)."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    qk = arch.qk_norm != "none"

    def base(experts: int | None):
        if use_te:
            return get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False,
                                                              qk_layernorm=qk)
        return get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk,
                                        normalization="RMSNorm")
    if arch.moe is None and arch.qk_norm != "projection":
        return base(None)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from verl.models.moe import moe_layer_spec
    per_stage = arch.num_layers // pg.pp_size
    first = pg.pp_rank * per_stage
    specs = [moe_layer_spec(base(arch.moe.num_experts if arch.is_moe_layer(i) else None), arch, tp_group=pg.tp)
             for i in range(first, first + per_stage)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        from megatron.core.models.gpt.gpt_layer_specs import LNImpl as norm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def build_gpt(hf_config, pg: Placement, options: BuildOptions | None = None) -> MegatronGPT:
    """This rank's stage of a megatron GPTModel equivalent to `hf_config` (random init; load weights after)."""
    from megatron.core.models.gpt import GPTModel
    options = options or BuildOptions()
    arch = arch_from_hf(hf_config)
    layout = parallel_layout(arch, pg.tp_size, options.vocab_multiple, ep=pg.ep_size, etp=pg.etp_size)
    if arch.moe is not None and pg.tp_size > 1 and not pg.sequence_parallel:
        raise VerlConfigError(f"tp={pg.tp_size} with the mixture-of-experts model {arch.model_type} needs "
                              f"sequence_parallel=true (megatron-core's MoE layer refuses TP without it)")
    config = transformer_config(arch, layout, pg, options)
    use_te = _use_te(options.spec)
    spec = _layer_spec(arch, pg, use_te)
    tie = arch.tie_word_embeddings and not options.value_head
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=layout.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings, pre_process=pg.is_first_stage,
        post_process=pg.is_last_stage, parallel_output=True, share_embeddings_and_output_weights=tie,
        position_embedding_type="rope", rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_llama3_factor is not None, rope_scaling_factor=arch.rope_llama3_factor or 8.0,
        seq_len_interpolation_factor=arch.rope_linear_factor)
    if options.value_head and pg.is_last_stage:
        model.output_layer = ValueHead(arch.hidden_size, sequence_parallel=pg.sequence_parallel,
                                       dtype=config.params_dtype, std=options.init_method_std)
    if config.params_dtype != torch.float32:
        # the local spec's torch norms (and the MoE router) are created in float32 whatever params_dtype says;
        # megatron's Float16Module casts the whole model, so do the same: one dtype, as the checkpoint's
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(config.params_dtype)
    built_options = dataclasses.replace(options)
    return MegatronGPT(module=model, arch=arch, layout=layout, pg=pg, hf_config=hf_config, options=built_options,
                       spec="te" if use_te else "local")
