"""The one model of the Megatron ↔ Hugging Face weight layout (pure metadata: names, shapes, row ranges).

Two views of one model's weights, both derived from the parsed `ArchSpec`:

* the **HF tensors** (`TensorGroup`s, `hf_tensor_groups`): every tensor of the HF checkpoint with its shape,
  grouped as a generation engine may fuse them (q/k/v, gate/up) and tagged with how tensor parallelism cuts
  them. `hf_tensor_shapes` is the flat name → shape view (what export writes and load expects).
* the **training parameters** (`ShardSpec`s): each parameter's global tensor is the concatenation, along
  `dim`, of `segments` — row ranges of HF tensors, or zero padding — and rank k of `parts` along the
  training axis `axis` holds chunk k (rows [k·c, min((k+1)·c, total)) with c = ceil(total / parts): the
  even split megatron uses, and the dim-0 split of torch's FSDP2 whose last chunks may be short or empty);
  when `dim` is None every holder has the whole tensor.

`ModelLayout` bundles both for the 3D-HybridEngine; the megatron loader/exporter reads the `ShardSpec`s.

The two delicate megatron layouts, both megatron-core's own:

* fused QKV (`linear_qkv`): per query group g, ``[q heads of group g; k_g; v_g]`` (each head `head_dim`
  rows), groups in order. TP rank r holds rows ``[r*R/tp, (r+1)*R/tp)`` of that global matrix. When
  tp <= kv heads this is whole groups; when tp > kv heads megatron (0.16) cuts a group across ranks and
  all-gathers the projection output inside attention, so the same contiguous split stays correct.
* fused gate/up (`linear_fc1`): TP rank r holds ``[gate rows r; up rows r]`` (each ffn/tp rows), so the
  global matrix is ``[gate_0; up_0; gate_1; up_1; ...]`` — NOT ``[gate; up]``.

The vocabulary (embedding and untied output layer) is padded with zero rows up to a multiple of TP.

Mixture-of-experts layers: the router (`mlp.router`) is replicated; each routed expert is a SwiGLU MLP whose
`linear_fc1` / `linear_fc2` are cut over the expert tensor-parallel group (ETP) exactly like a dense MLP over TP,
and each expert lives on one expert-parallel rank: EP rank r holds experts [r·E/EP, (r+1)·E/EP) as its
`local_experts.0 …`. Their ShardSpecs name the GLOBAL expert (`local_experts.<e>` in the canonical name), cut
along the `etp` axis and held by EP rank `ep` only; every other parameter is held by every EP rank of its stage.
On the Hugging Face side each expert is its own tensors (the checkpoint's per-expert names; transformers' fused
in-memory `experts.gate_up_proj` is the rollout engine's business, `expert_module_slots`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from verl.errors import VerlConfigError
from verl.models.config import ArchSpec, ParallelLayout, arch_from_hf

KINDS = ("qkv-fused", "gate-up-fused", "column", "row", "vocab", "replicated", "value-head")
AXES = ("tp", "dp", "etp")
GROUP_KINDS = ("qkv", "gate_up", "row", "vocab", "replicated", "whole")


@dataclass(kw_only=True, slots=True, frozen=True)
class Segment:
    """`length` consecutive rows (along the cut dim) of one HF tensor, or zero padding."""

    hf_name: str | None
    """HF tensor name; None for zero padding (vocab padding rows)."""
    start: int
    """First index along the cut dim inside the HF tensor."""
    length: int
    """Number of indices."""


def _chunk(total: int, parts: int, k: int) -> tuple[int, int]:
    """(start, length) of chunk k of `parts`: ceil-sized chunks, the last ones short or empty (FSDP2's
    rule; equal to an even split whenever `parts` divides `total`, as megatron requires)."""
    c = -(-total // parts)
    start = min(k * c, total)
    return start, min(c, total - start)


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardSpec:
    """One training parameter and where its rows come from in Hugging Face terms (rank-independent)."""

    name: str
    """Canonical name: megatron's with the GLOBAL layer index (decoder.layers.5.mlp.linear_fc1.weight), or the
    HF name for a Hugging Face module."""
    local_name: str
    """The name in the holder's `module.named_parameters()` (megatron: layer index local to the stage)."""
    kind: str
    """One of KINDS (how megatron stores it; 'column' / 'replicated' for HF-module parameters)."""
    global_shape: tuple[int, ...]
    """Shape of the unsharded tensor (megatron's vocab includes padding)."""
    dim: int | None
    """The dim the training layout cuts (0 column/vocab/fused/FSDP, 1 row); None when every holder has it all."""
    parts: int = 1
    """Number of chunks along `dim` (megatron: TP size; FSDP2: DP size)."""
    axis: str = "tp"
    """Which index of the training layout picks the chunk: 'tp' (megatron) or 'dp' (FSDP2)."""
    segments: tuple[Segment, ...]
    """The global tensor along `dim` (dim 0 when `dim` is None), in order."""
    layer: int | None = None
    """Global transformer layer index; None for embeddings, final norm and output layer."""
    stage: int = 0
    """Pipeline stage whose ranks hold it."""
    dtype: torch.dtype = torch.float32
    """Element type of the live parameter (decides bucket bytes)."""
    exported: bool = True
    """False for a copy that is not written on export (the tied output layer on the last pipeline stage)."""
    ep: int | None = None
    """The expert-parallel rank that holds it (a routed expert's weights); None: every EP rank of its stage."""

    def __post_init__(self):
        if self.axis not in AXES:
            raise VerlConfigError(f"{self.name}: axis={self.axis!r}; choose one of {AXES}")
        total = sum(s.length for s in self.segments)
        if not self.global_shape or total != self.global_shape[self.cut_dim]:
            raise VerlConfigError(f"{self.name}: segments cover {total} rows but the tensor has shape "
                                  f"{self.global_shape} along dim {self.cut_dim}")

    @property
    def cut_dim(self) -> int:
        """The dim `segments` run along."""
        return 0 if self.dim is None else self.dim

    @property
    def hf_names(self) -> tuple[str, ...]:
        """HF tensors this parameter is built from (in layout order, padding excluded)."""
        return tuple(dict.fromkeys(s.hf_name for s in self.segments if s.hf_name is not None))

    def chunk_index(self, *, tp: int, dp: int, etp: int = 0) -> int:
        """Which chunk a holder at training (tp, dp, expert-tp) indices holds."""
        return {"tp": tp, "dp": dp, "etp": etp}[self.axis]

    def chunk(self, k: int) -> tuple[int, int]:
        """(start, length) along `cut_dim` of the global tensor that chunk k holds."""
        if self.dim is None:
            return 0, self.global_shape[0]
        return _chunk(self.global_shape[self.dim], self.parts, k)

    def local_shape(self, k: int) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.cut_dim] = self.chunk(k)[1]
        return tuple(shape)

    def local_segments(self, k: int) -> list[tuple[Segment, int]]:
        """The pieces of `segments` chunk k covers: (sub-segment, offset in the local tensor)."""
        lo, n = self.chunk(k)
        out, pos = [], 0
        for seg in self.segments:
            a, b = max(lo, pos), min(lo + n, pos + seg.length)
            if a < b:
                out.append((Segment(hf_name=seg.hf_name, start=seg.start + (a - pos), length=b - a), a - lo))
            pos += seg.length
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorGroup:
    """HF tensors a generation engine may fuse into one (q/k/v, gate/up), or one tensor on its own."""

    kind: str
    """One of GROUP_KINDS: how tensor parallelism cuts it — qkv (query heads; KV heads, replicated past their
    count), gate_up and vocab (rows; vocab as the engines pad it), row (columns), replicated (whole on every
    rank), whole (an architecture the layout model does not know: never cut, never fused)."""
    names: tuple[str, ...]
    """HF names, in fused order."""
    shapes: tuple[tuple[int, ...], ...]
    """Full shape of each tensor, aligned with `names`."""
    num_heads: int = 0
    """qkv: query heads."""
    num_kv_heads: int = 0
    """qkv: key/value heads."""
    head_dim: int = 0
    """qkv: rows per head."""
    expert: int | None = None
    """The routed expert these tensors belong to (None for everything else): engines that fuse experts into
    their own layout (vLLM's fused MoE) need to know."""

    def __post_init__(self):
        if self.kind not in GROUP_KINDS or len(self.names) != len(self.shapes):
            raise VerlConfigError(f"TensorGroup {self.names}: kind={self.kind!r} (one of {GROUP_KINDS}) with "
                                  f"{len(self.shapes)} shapes for {len(self.names)} names")

    @property
    def dim(self) -> int:
        """The dim generation tensor parallelism cuts."""
        return 1 if self.kind == "row" else 0


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelLayout:
    """One model's weights in both views: what the 3D-HybridEngine plans from."""

    architecture: str
    """HF model_type (or the module's class name), named in errors."""
    groups: tuple[TensorGroup, ...]
    """Every HF tensor the generation engine receives, grouped."""
    params: tuple[ShardSpec, ...]
    """Every training parameter (of every pipeline stage) that carries them."""
    unknown: str = ""
    """Why the layout model does not know this architecture ('' when it does): its tensors are then only
    handed over whole (HF names, generation TP 1)."""


def _seg(name: str | None, start: int, length: int) -> Segment:
    return Segment(hf_name=name, start=start, length=length)


# ------------------------------------------------------------------------------------------- HF tensors

def _hf_mlp_names(arch: ArchSpec, p: str) -> dict[str, str]:
    """HF names of layer prefix `p`'s MoE tensors: router, shared expert, and the per-expert name patterns."""
    if arch.moe.naming == "mixtral":
        b = f"{p}.block_sparse_moe"
        return {"router": f"{b}.gate.weight", "gate": f"{b}.experts.{{e}}.w1.weight",
                "up": f"{b}.experts.{{e}}.w3.weight", "down": f"{b}.experts.{{e}}.w2.weight"}
    m = f"{p}.mlp"
    return {"router": f"{m}.gate.weight", "gate": f"{m}.experts.{{e}}.gate_proj.weight",
            "up": f"{m}.experts.{{e}}.up_proj.weight", "down": f"{m}.experts.{{e}}.down_proj.weight",
            "shared_gate": f"{m}.shared_expert.gate_proj.weight", "shared_up": f"{m}.shared_expert.up_proj.weight",
            "shared_down": f"{m}.shared_expert.down_proj.weight", "shared_scale": f"{m}.shared_expert_gate.weight"}


def _swiglu_groups(gate: str, up: str, down: str, h: int, f: int, expert: int | None = None) -> list[TensorGroup]:
    return [TensorGroup(kind="gate_up", names=(gate, up), shapes=((f, h), (f, h)), expert=expert),
            TensorGroup(kind="row", names=(down,), shapes=((h, f),), expert=expert)]


def _hf_mlp_groups(arch: ArchSpec, layer: int) -> list[TensorGroup]:
    p, h = f"model.layers.{layer}", arch.hidden_size
    if not arch.is_moe_layer(layer):
        return _swiglu_groups(f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight", f"{p}.mlp.down_proj.weight", h,
                              arch.ffn_hidden_size)
    moe, names = arch.moe, _hf_mlp_names(arch, p)
    groups = [TensorGroup(kind="replicated", names=(names["router"],), shapes=((moe.num_experts, h),))]
    for e in range(moe.num_experts):
        groups += _swiglu_groups(names["gate"].format(e=e), names["up"].format(e=e), names["down"].format(e=e), h,
                                 moe.ffn_hidden_size, expert=e)
    if moe.shared_ffn_hidden_size:
        groups += _swiglu_groups(names["shared_gate"], names["shared_up"], names["shared_down"], h,
                                 moe.shared_ffn_hidden_size)
    if moe.shared_gate:
        groups.append(TensorGroup(kind="replicated", names=(names["shared_scale"],), shapes=((1, h),)))
    return groups


def _qk_norm_shapes(arch: ArchSpec) -> tuple[tuple[int], tuple[int]]:
    hd = arch.head_dim
    if arch.qk_norm == "head":
        return (hd,), (hd,)
    return (arch.num_heads * hd,), (arch.num_kv_heads * hd,)


def hf_tensor_groups(arch: ArchSpec, *, value_head: bool = False) -> tuple[TensorGroup, ...]:
    """Every tensor of the HF checkpoint, in model order (embeddings, layers, final norm, output)."""
    h, hd = arch.hidden_size, arch.head_dim
    vocab = dict(kind="vocab", shapes=((arch.vocab_size, h),))
    heads = dict(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=hd)
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    groups = [TensorGroup(names=("model.embed_tokens.weight",), **vocab)]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        groups.append(TensorGroup(kind="replicated", names=(f"{p}.input_layernorm.weight",), shapes=((h,),)))
        groups.append(TensorGroup(kind="qkv", names=tuple(f"{p}.self_attn.{x}_proj.weight" for x in "qkv"),
                                  shapes=((q, h), (kv, h), (kv, h)), **heads))
        if arch.qkv_bias:
            groups.append(TensorGroup(kind="qkv", names=tuple(f"{p}.self_attn.{x}_proj.bias" for x in "qkv"),
                                      shapes=((q,), (kv,), (kv,)), **heads))
        if arch.qk_norm != "none":
            # per head: the same few numbers for every head; over the projection: vLLM gathers q / k across TP
            # before the norm, so both are whole on every generation rank
            for x, shape in zip("qk", _qk_norm_shapes(arch)):
                groups.append(TensorGroup(kind="replicated", names=(f"{p}.self_attn.{x}_norm.weight",),
                                          shapes=(shape,)))
        groups += [
            TensorGroup(kind="row", names=(f"{p}.self_attn.o_proj.weight",), shapes=((h, q),)),
            TensorGroup(kind="replicated", names=(f"{p}.post_attention_layernorm.weight",), shapes=((h,),)),
            *_hf_mlp_groups(arch, i),
        ]
    groups.append(TensorGroup(kind="replicated", names=("model.norm.weight",), shapes=((h,),)))
    if value_head:
        groups += [TensorGroup(kind="replicated", names=("score.weight",), shapes=((1, h),)),
                   TensorGroup(kind="replicated", names=("score.bias",), shapes=((1,),))]
    elif not arch.tie_word_embeddings:
        groups.append(TensorGroup(names=("lm_head.weight",), **vocab))
    return tuple(groups)


def hf_tensor_shapes(arch: ArchSpec, *, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint with its shape (what export writes, what load expects)."""
    return {n: s for g in hf_tensor_groups(arch, value_head=value_head) for n, s in zip(g.names, g.shapes)}


# ------------------------------------------------------------------------------------ megatron parameters

def _qkv_segments(arch: ArchSpec, hf_prefix: str, suffix: str) -> tuple[Segment, ...]:
    hd, qpg = arch.head_dim, arch.q_per_group
    segs = []
    for g in range(arch.num_kv_heads):
        segs += [_seg(f"{hf_prefix}.q_proj.{suffix}", g * qpg * hd, qpg * hd),
                 _seg(f"{hf_prefix}.k_proj.{suffix}", g * hd, hd),
                 _seg(f"{hf_prefix}.v_proj.{suffix}", g * hd, hd)]
    return tuple(segs)


def _gate_up_segments(gate: str, up: str, width: int, tp: int) -> tuple[Segment, ...]:
    n = width // tp
    segs = []
    for r in range(tp):
        segs += [_seg(gate, r * n, n), _seg(up, r * n, n)]
    return tuple(segs)


def _vocab_segments(hf_name: str, arch: ArchSpec, layout: ParallelLayout) -> tuple[Segment, ...]:
    segs = [_seg(hf_name, 0, arch.vocab_size)]
    if layout.padded_vocab_size > arch.vocab_size:
        segs.append(_seg(None, 0, layout.padded_vocab_size - arch.vocab_size))
    return tuple(segs)


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _swiglu_table(prefix: str, gate: str, up: str, down: str, h: int, width: int, tp: int) -> dict[str, tuple]:
    """megatron's fused SwiGLU pair under `prefix` (linear_fc1 = per-rank [gate_r; up_r], linear_fc2 by columns)."""
    return {f"{prefix}linear_fc1.weight": ("gate-up-fused", (2 * width, h), 0, _gate_up_segments(gate, up, width, tp)),
            f"{prefix}linear_fc2.weight": ("row", (h, width), 1, (_seg(down, 0, width),))}


def _qk_norm_table(arch: ArchSpec, hp: str) -> dict[str, tuple]:
    if arch.qk_norm == "none":
        return {}
    out = {}
    for x, (rows,) in zip("qk", _qk_norm_shapes(arch)):
        # per head: one [head_dim] weight on every rank; over the projection: rank r's heads' rows
        kind, dim = ("replicated", None) if arch.qk_norm == "head" else ("column", 0)
        out[f"self_attention.{x}_layernorm.weight"] = (kind, (rows,), dim, (_seg(f"{hp}.self_attn.{x}_norm.weight", 0,
                                                                                 rows),))
    return out


def _mlp_table(arch: ArchSpec, tp: int, hp: str, layer: int) -> dict[str, tuple]:
    h = arch.hidden_size
    if not arch.is_moe_layer(layer):
        return _swiglu_table("mlp.", f"{hp}.mlp.gate_proj.weight", f"{hp}.mlp.up_proj.weight",
                             f"{hp}.mlp.down_proj.weight", h, arch.ffn_hidden_size, tp)
    moe, names = arch.moe, _hf_mlp_names(arch, hp)
    router = (_seg(names["router"], 0, moe.num_experts),)
    table = {"mlp.router.weight": ("replicated", (moe.num_experts, h), None, router)}
    if moe.shared_ffn_hidden_size:
        shared = (names["shared_gate"], names["shared_up"], names["shared_down"])
        table.update(_swiglu_table("mlp.shared_experts.", *shared, h, moe.shared_ffn_hidden_size, tp))
    if moe.shared_gate:
        table["mlp.shared_experts.gate_weight"] = ("replicated", (1, h), None, (_seg(names["shared_scale"], 0, 1),))
    return table


def _layer_table(arch: ArchSpec, tp: int, hp: str, layer: int) -> dict[str, tuple]:
    """megatron layer parameter (local and TE spec names) → (kind, global shape, dim, segments); routed experts
    are `_expert_spec`'s."""
    h = arch.hidden_size
    q_rows = arch.num_kv_heads * (arch.q_per_group + 2) * arch.head_dim
    attn = arch.num_heads * arch.head_dim
    ln1 = ("replicated", (h,), None, (_seg(f"{hp}.input_layernorm.weight", 0, h),))
    ln2 = ("replicated", (h,), None, (_seg(f"{hp}.post_attention_layernorm.weight", 0, h),))
    return {
        "input_layernorm.weight": ln1,
        "self_attention.linear_qkv.layer_norm_weight": ln1,
        "self_attention.linear_qkv.weight": ("qkv-fused", (q_rows, h), 0,
                                             _qkv_segments(arch, f"{hp}.self_attn", "weight")),
        "self_attention.linear_qkv.bias": ("qkv-fused", (q_rows,), 0, _qkv_segments(arch, f"{hp}.self_attn", "bias")),
        "self_attention.linear_proj.weight": ("row", (h, attn), 1, (_seg(f"{hp}.self_attn.o_proj.weight", 0, attn),)),
        **_qk_norm_table(arch, hp),
        "pre_mlp_layernorm.weight": ln2,
        "mlp.linear_fc1.layer_norm_weight": ln2,
        **_mlp_table(arch, tp, hp, layer),
    }


_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _expert_spec(rest: str, *, arch: ArchSpec, layout: ParallelLayout, layer: int, common: dict,
                 ep_rank: int) -> ShardSpec | None:
    """The ShardSpec of a routed expert's weight (`rest`: the name after the layer prefix), or None."""
    m = _EXPERT_RE.match(rest)
    if m is None or not arch.is_moe_layer(layer):
        return None
    e = ep_rank * layout.local_experts(arch) + int(m.group(1))
    names = _hf_mlp_names(arch, f"model.layers.{layer}")
    gate, up, down = (names[k].format(e=e) for k in ("gate", "up", "down"))
    table = _swiglu_table("", gate, up, down, arch.hidden_size, arch.moe.ffn_hidden_size, layout.etp_size)
    kind, shape, dim, segs = table[f"{m.group(2)}.weight"]
    return ShardSpec(name=f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{m.group(2)}.weight", kind=kind,
                     global_shape=shape, dim=dim, segments=segs, layer=layer, ep=ep_rank,
                     **{**common, "parts": layout.etp_size, "axis": "etp"})


def _top_level(local_name: str, arch: ArchSpec, layout: ParallelLayout) -> tuple | None:
    """(kind, global shape, dim, segments, exported) of a non-layer megatron parameter, or None."""
    h, vp = arch.hidden_size, layout.padded_vocab_size
    if local_name == "embedding.word_embeddings.weight":
        return "vocab", (vp, h), 0, _vocab_segments("model.embed_tokens.weight", arch, layout), True
    if local_name == "output_layer.weight":
        tied = arch.tie_word_embeddings
        src = "model.embed_tokens.weight" if tied else "lm_head.weight"
        # A tied output layer only exists as a parameter on a last stage that is not also the first stage;
        # it is a copy of the embedding, kept in sync by megatron, so export skips it.
        return "vocab", (vp, h), 0, _vocab_segments(src, arch, layout), not tied
    if local_name == "decoder.final_layernorm.weight":
        return "replicated", (h,), None, (_seg("model.norm.weight", 0, h),), True
    if local_name in ("output_layer.value_head.weight", "output_layer.value_head.bias"):
        suffix = local_name.rsplit(".", 1)[1]
        return "value-head", (1, h) if suffix == "weight" else (1,), None, (_seg(f"score.{suffix}", 0, 1),), True
    return None


def shard_spec(local_name: str, *, arch: ArchSpec, layout: ParallelLayout, layer_offset: int, stage: int = 0,
               dtype: torch.dtype = torch.float32, ep_rank: int = 0) -> ShardSpec:
    """The ShardSpec of one megatron parameter (local spec and TE spec names both understood); `ep_rank`: the
    holder's expert-parallel rank (which experts its `local_experts.<i>` are)."""
    common = dict(local_name=local_name, parts=layout.tp_size, stage=stage, dtype=dtype)
    m = _LAYER_RE.match(local_name)
    if m:
        layer = int(m.group(1)) + layer_offset
        expert = _expert_spec(m.group(2), arch=arch, layout=layout, layer=layer, common=common, ep_rank=ep_rank)
        if expert is not None:
            return expert
        table = _layer_table(arch, layout.tp_size, f"model.layers.{layer}", layer)
        if m.group(2) not in table:
            raise VerlConfigError(f"no Hugging Face mapping for megatron parameter {local_name!r}")
        kind, shape, dim, segs = table[m.group(2)]
        return ShardSpec(name=f"decoder.layers.{layer}.{m.group(2)}", kind=kind, global_shape=shape, dim=dim,
                         segments=segs, layer=layer, **common)
    top = _top_level(local_name, arch, layout)
    if top is None:
        raise VerlConfigError(f"no Hugging Face mapping for megatron parameter {local_name!r}")
    kind, shape, dim, segs, exported = top
    return ShardSpec(name=local_name, kind=kind, global_shape=shape, dim=dim, segments=segs, exported=exported,
                     **common)


def _layer_params(arch: ArchSpec, layout: ParallelLayout, layer: int) -> list[tuple[str, int]]:
    """(local-spec parameter name after the layer prefix, holder's EP rank) of one layer, named_parameters order."""
    attn = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    attn += ["self_attention.linear_qkv.bias"] if arch.qkv_bias else []
    attn += ["self_attention.linear_proj.weight"]
    attn += [f"self_attention.{x}_layernorm.weight" for x in "qk"] if arch.qk_norm != "none" else []
    out = [(n, 0) for n in attn + ["pre_mlp_layernorm.weight"]]
    if not arch.is_moe_layer(layer):
        return out + [("mlp.linear_fc1.weight", 0), ("mlp.linear_fc2.weight", 0)]
    out.append(("mlp.router.weight", 0))
    for r in range(layout.ep_size):
        out += [(f"mlp.experts.local_experts.{i}.linear_fc{j}.weight", r) for i in range(layout.local_experts(arch))
                for j in (1, 2)]
    if arch.moe.shared_ffn_hidden_size:
        out += [("mlp.shared_experts.linear_fc1.weight", 0), ("mlp.shared_experts.linear_fc2.weight", 0)]
    if arch.moe.shared_gate:
        out.append(("mlp.shared_experts.gate_weight", 0))
    return out


def megatron_shard_specs(arch: ArchSpec, layout: ParallelLayout, *, pp: int = 1, dtype: torch.dtype = torch.float32,
                         value_head: bool = False) -> list[ShardSpec]:
    """The exported parameters of every stage (and every EP rank's experts) of the megatron GPTModel verl builds
    (megatron-core's local layer spec names, named_parameters order), without building it: metadata for planning
    on one process."""
    if arch.num_layers % pp:
        raise VerlConfigError(f"num_hidden_layers={arch.num_layers} is not divisible by pp={pp}; choose PP dividing it")
    per_stage, last = arch.num_layers // pp, pp - 1
    names = [(0, 0, "embedding.word_embeddings.weight", 0)]
    for i in range(arch.num_layers):
        stage = i // per_stage
        names += [(stage, stage * per_stage, f"decoder.layers.{i - stage * per_stage}.{rest}", ep)
                  for rest, ep in _layer_params(arch, layout, i)]
    names.append((last, 0, "decoder.final_layernorm.weight", 0))
    if value_head:
        names += [(last, 0, "output_layer.value_head.weight", 0), (last, 0, "output_layer.value_head.bias", 0)]
    elif not arch.tie_word_embeddings:
        names.append((last, 0, "output_layer.weight", 0))
    return [shard_spec(n, arch=arch, layout=layout, layer_offset=off, stage=st, dtype=dtype, ep_rank=ep)
            for st, off, n, ep in names]


def megatron_model_layout(arch: ArchSpec, layout: ParallelLayout, *, params: list[ShardSpec] | None = None,
                          pp: int = 1, dtype: torch.dtype = torch.float32, value_head: bool = False) -> ModelLayout:
    """The ModelLayout of a megatron GPT: `params` are a live model's ShardSpecs (every stage's); by default
    those `megatron_shard_specs` derives for `pp` stages of `dtype`."""
    if params is None:
        params = megatron_shard_specs(arch, layout, pp=pp, dtype=dtype, value_head=value_head)
    groups = hf_tensor_groups(arch, value_head=value_head)
    return ModelLayout(architecture=arch.model_type, groups=groups, params=tuple(p for p in params if p.exported))


# ------------------------------------------------------------------------------ Hugging Face modules

_HF_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _module_spec(name: str, t: torch.Tensor, shards: int) -> ShardSpec:
    shape = tuple(t.shape)
    if not shape:
        raise VerlConfigError(f"parameter {name!r} is a scalar; the hybrid engine moves tensors of rank >= 1")
    m = _HF_LAYER_RE.search(name)
    return ShardSpec(name=name, local_name=name, kind="replicated" if shards == 1 else "column", global_shape=shape,
                     dim=None if shards == 1 else 0, parts=shards, axis="dp", segments=(_seg(name, 0, shape[0]),),
                     layer=int(m.group(1)) if m else None, dtype=t.dtype)


def _known_groups(tensors: Mapping[str, torch.Tensor], hf_config) -> tuple[tuple[TensorGroup, ...] | None, str]:
    """The architecture's groups when the layout model knows it AND the module has exactly its tensors."""
    try:
        arch = arch_from_hf(hf_config)
    except VerlConfigError as e:
        return None, str(e)
    groups = hf_tensor_groups(arch)
    want = {n: s for g in groups for n, s in zip(g.names, g.shapes)}
    got = {n: tuple(t.shape) for n, t in tensors.items()}
    if want != got:
        diff = sorted(set(want) ^ set(got)) or sorted(n for n in want if want[n] != got[n])
        return None, f"its parameters differ from the {arch.model_type} layout (e.g. {diff[:3]})"
    return groups, ""


def hf_model_layout(tensors: Mapping[str, torch.Tensor], hf_config, *, shards: int = 1,
                    architecture: str | None = None) -> ModelLayout:
    """The ModelLayout of a Hugging Face module trained data-parallel.

    `tensors`: HF name → the parameter (only `.shape` and `.dtype` are read; the global shape for FSDP2).
    shards == 1: every rank holds every tensor whole (plain torch DDP / single process); shards > 1: FSDP2,
    each tensor cut along dim 0 into `shards` chunks, DP rank k holding chunk k. An architecture the layout
    model does not know gets a layout of whole, unfusable tensors. `architecture` names the model in errors
    (default: the config's model_type).
    """
    params = tuple(_module_spec(n, t, shards) for n, t in tensors.items())
    architecture = architecture or getattr(hf_config, "model_type", None) or type(hf_config).__name__
    groups, unknown = _known_groups(tensors, hf_config)
    if groups is None:
        groups = tuple(TensorGroup(kind="whole", names=(n,), shapes=(tuple(t.shape),)) for n, t in tensors.items())
    return ModelLayout(architecture=architecture, groups=groups, params=params, unknown=unknown)


# ---------------------------------------------------------------------- transformers' in-memory MoE modules

@dataclass(frozen=True, slots=True)
class ModuleSlot:
    """Where a checkpoint tensor lives inside a transformers module: rows [start, start + length) of
    `param[expert]` (of `param` itself when expert is None)."""

    param: str
    expert: int | None
    start: int
    length: int

    def view(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        t = params[self.param]
        t = t if self.expert is None else t[self.expert]
        return t.narrow(0, self.start, self.length)


def hf_module_slots(arch: ArchSpec) -> dict[str, ModuleSlot]:
    """Checkpoint name -> `ModuleSlot` for every tensor a transformers (>= 5) module of `arch` keeps under another
    name: each MoE layer's experts fused into `mlp.experts.gate_up_proj` [E, 2I, H] ([gate_e; up_e] per expert)
    and `mlp.experts.down_proj` [E, H, I], and Mixtral's router as `mlp.gate`. Empty for dense models, whose
    module names are the checkpoint's."""
    out: dict[str, ModuleSlot] = {}
    if arch.moe is None:
        return out
    f = arch.moe.ffn_hidden_size
    for layer in arch.moe.layers:
        p = f"model.layers.{layer}"
        names = _hf_mlp_names(arch, p)
        if arch.moe.naming == "mixtral":
            out[names["router"]] = ModuleSlot(f"{p}.mlp.gate.weight", None, 0, arch.moe.num_experts)
        for e in range(arch.moe.num_experts):
            out[names["gate"].format(e=e)] = ModuleSlot(f"{p}.mlp.experts.gate_up_proj", e, 0, f)
            out[names["up"].format(e=e)] = ModuleSlot(f"{p}.mlp.experts.gate_up_proj", e, f, f)
            out[names["down"].format(e=e)] = ModuleSlot(f"{p}.mlp.experts.down_proj", e, 0, arch.hidden_size)
    return out


def hf_checkpoint_view(params: Mapping[str, torch.Tensor], arch: ArchSpec) -> dict[str, torch.Tensor]:
    """A transformers module's tensors (parameters, or their gradients) by checkpoint name: views, no copies."""
    slots = hf_module_slots(arch)
    fused = {s.param for s in slots.values()}
    out = {n: t for n, t in params.items() if n not in fused}
    out.update({name: slot.view(params) for name, slot in slots.items()})
    return out
