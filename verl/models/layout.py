"""Where each megatron parameter shard comes from in a Hugging Face checkpoint (a pure planner: metadata only).

Every local parameter is described by a `ShardSpec`: its global megatron tensor is the concatenation, along
`partition_dim`, of `segments` — row (or column) ranges of HF tensors, or zero padding — and this rank holds
the contiguous chunk `tp_rank` of `tp_size` along that dim (replicated params: the whole tensor).

The two delicate layouts, both megatron-core's own:

* fused QKV (`linear_qkv`): per query group g, ``[q heads of group g; k_g; v_g]`` (each head `head_dim`
  rows), groups in order. TP rank r holds rows ``[r*R/tp, (r+1)*R/tp)`` of that global matrix. When
  tp <= kv heads this is whole groups; when tp > kv heads megatron (0.16) cuts a group across ranks and
  all-gathers the projection output inside attention, so the same contiguous split stays correct.
* fused gate/up (`linear_fc1`): TP rank r holds ``[gate rows r; up rows r]`` (each ffn/tp rows), so the
  global matrix is ``[gate_0; up_0; gate_1; up_1; ...]`` — NOT ``[gate; up]``.

The vocabulary (embedding and untied output layer) is padded with zero rows up to a multiple of TP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from verl.errors import VerlConfigError
from verl.models.config import ArchSpec, ParallelLayout

KINDS = ("qkv-fused", "gate-up-fused", "column", "row", "vocab", "replicated", "value-head")


@dataclass(kw_only=True, slots=True, frozen=True)
class Segment:
    """`length` consecutive rows/columns (along the shard's partition dim) of one HF tensor, or zero padding."""

    hf_name: str | None
    """HF tensor name; None for zero padding (vocab padding rows)."""
    start: int
    """First index along the partition dim inside the HF tensor."""
    length: int
    """Number of indices."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardSpec:
    """One local parameter shard and its mapping to Hugging Face tensors (consumed by the hybrid engine)."""

    name: str
    """Canonical megatron name with the GLOBAL layer index (e.g. decoder.layers.5.mlp.linear_fc1.weight)."""
    local_name: str
    """The name in this rank's `module.named_parameters()` (layer index local to the pipeline stage)."""
    hf_names: tuple[str, ...]
    """HF tensors this parameter is built from (in layout order, padding excluded)."""
    global_shape: tuple[int, ...]
    """Shape of the unsharded megatron tensor (vocab includes padding)."""
    partition_dim: int | None
    """TP partition dim (0 column/vocab/fused, 1 row); None when replicated over TP."""
    kind: str
    """One of KINDS."""
    tp_rank: int
    """This rank's TP index."""
    tp_size: int
    """TP size."""
    segments: tuple[Segment, ...]
    """The global tensor along `partition_dim` (or dim 0 when replicated), in order."""
    exported: bool = True
    """False for a copy that is not written on export (the tied output layer on the last pipeline stage)."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.partition_dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.partition_dim] //= self.tp_size
        return tuple(shape)

    def local_segments(self) -> list[tuple[Segment, int]]:
        """The pieces of `segments` this rank's chunk covers: (sub-segment, offset in the local tensor)."""
        if self.partition_dim is None:
            lo, hi = 0, self.global_shape[0]
        else:
            n = self.global_shape[self.partition_dim] // self.tp_size
            lo, hi = self.tp_rank * n, (self.tp_rank + 1) * n
        out, pos = [], 0
        for seg in self.segments:
            a, b = max(lo, pos), min(hi, pos + seg.length)
            if a < b:
                out.append((Segment(hf_name=seg.hf_name, start=seg.start + (a - pos), length=b - a), a - lo))
            pos += seg.length
        return out


def _seg(name: str | None, start: int, length: int) -> Segment:
    return Segment(hf_name=name, start=start, length=length)


def _qkv_segments(arch: ArchSpec, hf_prefix: str, suffix: str) -> tuple[Segment, ...]:
    hd, qpg = arch.head_dim, arch.q_per_group
    segs = []
    for g in range(arch.num_kv_heads):
        segs += [_seg(f"{hf_prefix}.q_proj.{suffix}", g * qpg * hd, qpg * hd),
                 _seg(f"{hf_prefix}.k_proj.{suffix}", g * hd, hd),
                 _seg(f"{hf_prefix}.v_proj.{suffix}", g * hd, hd)]
    return tuple(segs)


def _gate_up_segments(arch: ArchSpec, hf_prefix: str, tp: int) -> tuple[Segment, ...]:
    n = arch.ffn_hidden_size // tp
    segs = []
    for r in range(tp):
        segs += [_seg(f"{hf_prefix}.gate_proj.weight", r * n, n), _seg(f"{hf_prefix}.up_proj.weight", r * n, n)]
    return tuple(segs)


def _vocab_segments(hf_name: str, arch: ArchSpec, layout: ParallelLayout) -> tuple[Segment, ...]:
    segs = [_seg(hf_name, 0, arch.vocab_size)]
    if layout.padded_vocab_size > arch.vocab_size:
        segs.append(_seg(None, 0, layout.padded_vocab_size - arch.vocab_size))
    return tuple(segs)


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def shard_spec(local_name: str, *, arch: ArchSpec, layout: ParallelLayout, tp_rank: int,
               layer_offset: int) -> ShardSpec:
    """The ShardSpec of one local megatron parameter (local spec and TE spec names both understood)."""
    h, tp = arch.hidden_size, layout.tp_size
    q_rows = arch.num_kv_heads * (arch.q_per_group + 2) * arch.head_dim
    common = dict(local_name=local_name, tp_rank=tp_rank, tp_size=tp)
    m = _LAYER_RE.match(local_name)
    if m:
        layer = int(m.group(1)) + layer_offset
        rest = m.group(2)
        name = f"decoder.layers.{layer}.{rest}"
        hp = f"model.layers.{layer}"
        table = {
            "self_attention.linear_qkv.weight": ("qkv-fused", (q_rows, h), 0,
                                                 _qkv_segments(arch, f"{hp}.self_attn", "weight")),
            "self_attention.linear_qkv.bias": ("qkv-fused", (q_rows,), 0,
                                               _qkv_segments(arch, f"{hp}.self_attn", "bias")),
            "self_attention.linear_proj.weight": ("row", (h, arch.num_heads * arch.head_dim), 1,
                                                  (_seg(f"{hp}.self_attn.o_proj.weight", 0,
                                                        arch.num_heads * arch.head_dim),)),
            "mlp.linear_fc1.weight": ("gate-up-fused", (2 * arch.ffn_hidden_size, h), 0,
                                      _gate_up_segments(arch, f"{hp}.mlp", tp)),
            "mlp.linear_fc2.weight": ("row", (h, arch.ffn_hidden_size), 1,
                                      (_seg(f"{hp}.mlp.down_proj.weight", 0, arch.ffn_hidden_size),)),
            "input_layernorm.weight": ("replicated", (h,), None, (_seg(f"{hp}.input_layernorm.weight", 0, h),)),
            "self_attention.linear_qkv.layer_norm_weight": (
                "replicated", (h,), None, (_seg(f"{hp}.input_layernorm.weight", 0, h),)),
            "pre_mlp_layernorm.weight": ("replicated", (h,), None,
                                         (_seg(f"{hp}.post_attention_layernorm.weight", 0, h),)),
            "mlp.linear_fc1.layer_norm_weight": ("replicated", (h,), None,
                                                 (_seg(f"{hp}.post_attention_layernorm.weight", 0, h),)),
        }
        if rest not in table:
            raise VerlConfigError(f"no Hugging Face mapping for megatron parameter {local_name!r}")
        kind, shape, dim, segs = table[rest]
        return ShardSpec(name=name, hf_names=_names(segs), global_shape=shape, partition_dim=dim, kind=kind,
                         segments=segs, **common)
    vp = layout.padded_vocab_size
    if local_name == "embedding.word_embeddings.weight":
        segs = _vocab_segments("model.embed_tokens.weight", arch, layout)
        return ShardSpec(name=local_name, hf_names=_names(segs), global_shape=(vp, h), partition_dim=0,
                         kind="vocab", segments=segs, **common)
    if local_name == "output_layer.weight":
        tied = arch.tie_word_embeddings
        src = "model.embed_tokens.weight" if tied else "lm_head.weight"
        segs = _vocab_segments(src, arch, layout)
        # A tied output layer only exists as a parameter on a last stage that is not also the first stage;
        # it is a copy of the embedding, kept in sync by megatron, so export skips it.
        return ShardSpec(name=local_name, hf_names=_names(segs), global_shape=(vp, h), partition_dim=0,
                         kind="vocab", segments=segs, exported=not tied, **common)
    if local_name == "decoder.final_layernorm.weight":
        segs = (_seg("model.norm.weight", 0, h),)
        return ShardSpec(name=local_name, hf_names=_names(segs), global_shape=(h,), partition_dim=None,
                         kind="replicated", segments=segs, **common)
    if local_name in ("output_layer.value_head.weight", "output_layer.value_head.bias"):
        suffix = local_name.rsplit(".", 1)[1]
        shape = (1, h) if suffix == "weight" else (1,)
        segs = (_seg(f"score.{suffix}", 0, 1),)
        return ShardSpec(name=local_name, hf_names=_names(segs), global_shape=shape, partition_dim=None,
                         kind="value-head", segments=segs, **common)
    raise VerlConfigError(f"no Hugging Face mapping for megatron parameter {local_name!r}")


def _names(segs) -> tuple[str, ...]:
    out: list[str] = []
    for s in segs:
        if s.hf_name is not None and s.hf_name not in out:
            out.append(s.hf_name)
    return tuple(out)


def hf_tensor_shapes(arch: ArchSpec, *, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint with its shape (what export writes, what load expects)."""
    h, hd = arch.hidden_size, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (arch.num_heads * hd, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (arch.num_kv_heads * hd, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (arch.num_kv_heads * hd, h)
        if arch.qkv_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (arch.num_heads * hd,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (arch.num_kv_heads * hd,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (arch.num_kv_heads * hd,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, arch.num_heads * hd)
        shapes[f"{p}.mlp.gate_proj.weight"] = (arch.ffn_hidden_size, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (arch.ffn_hidden_size, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, arch.ffn_hidden_size)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    if value_head:
        shapes["score.weight"] = (1, h)
        shapes["score.bias"] = (1,)
    elif not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes
