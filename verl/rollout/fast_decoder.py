"""A lean decode path for Llama-family transformers models (Llama, Qwen2, Mistral without a sliding window).

Hugging Face's forward pays, per layer and per generated token, for its generic machinery: mask building,
cache objects, attention-interface dispatch, separate q/k/v and gate/up projections. For the small models an
RL rollout decodes thousands of times per step that bookkeeping costs more than the arithmetic. This decoder
runs the same math on the model's own parameters (nothing is copied that training could change behind its
back: fused projection weights are rebuilt at every `start`; LoRA adapters are merged into them there) with

- one preallocated key/value buffer per layer, written in place (no cache objects, no concatenation);
- q/k/v as one GEMM and gate/up as one GEMM;
- a cos/sin table for every position of the batch computed once by the model's own rotary module;
- `scaled_dot_product_attention` with grouped-query heads and a boolean padding mask; a decode step (one query
  per row) puts the query heads that share a key/value head side by side as that head's queries, so the
  attention reads each cached key and value once for all of them (not once per query head); in float32 on CPU
  that step runs verl's decode-attention kernel (`verl.ops.decode_attention`; `fused_attention`);
- float32 projections on CPU packed once per `start` into a GEMM library's own weight layout: an unpacked
  `F.linear` repacks the whole weight at every call, which at the handful of rows a decode step has costs as
  much as the multiply. `pack` chooses the layout (`PACKINGS`):
  "verl" (`verl.ops.packed_linear`, csrc/cpu/packed_linear.cpp): panels of 16 output rows with k outermost, and a
  6-row x 16-output register block per panel; every output is one FMA chain over k, so a row's result is the same
  bit for bit whatever the batch's row count and thread count, within rounding of F.linear;
  "onednn" (torch's `mkldnn::_reorder_linear_weight` / `_linear_pointwise`): a row's result is the same bit
  for bit whatever the batch's row count (1 row or a thousand) and thread count, within rounding of F.linear;
  "mkl" (`cblas_sgemm_pack` through `mkl::_mkl_reorder_linear_weight` / `_mkl_linear`): F.linear's result bit
  for bit from 16 rows on, within rounding below, where a row's result may depend on the row count (below 16
  rows on an AMD EPYC; from 2 rows on, not on an Intel Xeon);
  "auto" (the default) takes verl's where the extension is built, else oneDNN where this torch has it, else MKL,
  else none; "none" keeps F.linear.
  benchmarks/engines/bench_decode.py measures them on SmolLM2-135M's decode (bench_decode.json). The packed
  copies take more memory than the fused float ones (SmolLM2-135M, 540 MB of float32 weights: `prepare` grew
  the process's resident memory by ~1.0 GB for oneDNN, ~1.2 GB for MKL, ~0.5 GB unpacked; verl's panels hold
  the fused weights once, padded to 16 rows), freed by `finish`.
  Where the packing ops are missing the projections stay on `F.linear` (`pack_unavailable` says why).

Numerically it is the model's forward (checked against it in tests/rollout); models it does not know are
reported by `unsupported_reason` and keep using their own forward. With `quantization="int8"` every projection
and the LM head are quantized to int8 per output row when the weights are fused (`start` / `prepare`, i.e. after
each weight sync) and run through `verl.ops.int8_linear`; a projection the kernel cannot serve (weights that are
not float32) stays in its own dtype, counted in `unquantized` with the reason.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from verl import _extension
from verl.ops._backend import use_fused
from verl.ops.attention import decode_attention
from verl.ops.packed_linear import pack_linear_weight, packed_linear
from verl.ops.quant import int8_linear, quantize_int8

__all__ = ["LlamaFamilyDecoder", "PACKINGS", "QUANTIZATIONS", "unsupported_reason"]

QUANTIZATIONS = ("none", "int8")
PACKINGS = ("auto", "verl", "onednn", "mkl", "none")

_MODEL_TYPES = {"llama", "qwen2", "mistral"}
_STATIC_ROPE = {"default", "linear", "llama3"}


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when `LlamaFamilyDecoder` reproduces the model's forward, else why not (for the log)."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in _MODEL_TYPES:
        return f"model_type {mtype!r} is not one of {sorted(_MODEL_TYPES)}"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in _STATIC_ROPE:
        return f"rope_type {rope_type!r} changes with the sequence length"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "the module does not have the Llama layout (model.layers, model.rotary_emb)"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "the model is split across devices by its device_map"
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"layer {type(layer).__name__} does not have the Llama projections"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "per-head q/k norms"
    return None


def _weight_bias(lin: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer's effective (weight, bias): a PEFT LoRA layer's active adapters merged into its base
    weight (base + scale * B A), so the adapters decode at the cost of the plain model."""
    base = getattr(lin, "base_layer", None)
    if base is None:
        return lin.weight, lin.bias
    weight = base.weight
    if not lin.disable_adapters and not lin.merged:
        for name in lin.active_adapters:
            if name in lin.lora_A:
                weight = weight + lin.scaling[name] * (lin.lora_B[name].weight @ lin.lora_A[name].weight)
    return weight, base.bias


def _fused(linears: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    pairs = [_weight_bias(lin) for lin in linears]
    weight = torch.cat([w for w, _ in pairs])
    if all(b is None for _, b in pairs):
        return weight, None
    return weight, torch.cat([b if b is not None else weight.new_zeros(w.shape[0]) for w, b in pairs])


def _pack_unavailable(kind: str) -> str | None:
    """None when float32 weights can be packed for `kind`'s GEMM ("verl", "onednn", "mkl"), else why not."""
    if kind == "verl":
        if not _extension.available():
            return "the extension verl._C is not built or failed to import"
        if not _extension.has_kernel("packed_linear", "CPU"):
            return "verl._C has no CPU kernel for verl::packed_linear (rebuild it)"
        return None
    backend, ops = {"onednn": (torch.backends.mkldnn, ("mkldnn", "_reorder_linear_weight", "_linear_pointwise")),
                    "mkl": (torch.backends.mkl, ("mkl", "_mkl_reorder_linear_weight", "_mkl_linear"))}[kind]
    if not backend.is_available():
        return f"this torch is built without {kind}"
    lib = ops[0]
    try:
        for op in ops[1:]:
            getattr(getattr(torch.ops, lib), op)
    except (AttributeError, RuntimeError):
        return f"this torch has no {lib}::{ops[1]} / {lib}::{ops[2]}"
    return None


def _packing(pack: str) -> tuple[str, str | None]:
    """(the packing `pack` runs with, why the one asked for is not available or None)."""
    if pack not in PACKINGS:
        raise ValueError(f"LlamaFamilyDecoder: pack={pack!r} is not one of {PACKINGS}")
    if pack == "none":
        return "none", None
    for kind in (("verl", "onednn", "mkl") if pack == "auto" else (pack,)):
        why = _pack_unavailable(kind)
        if why is None:
            return kind, None
    return "none", why


class _Proj:
    """One projection as the decoder runs it: float (weight, bias), packed float32 (packed, bias; `mode` "verl",
    "onednn" or "mkl"), or int8 (qweight, scale, bias)."""

    __slots__ = ("weight", "bias", "q", "scale", "packed", "mode", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str = "float"):
        self.weight, self.bias, self.q, self.scale, self.packed, self.mode = weight, bias, None, None, None, mode
        self.out_features = weight.shape[0]
        if mode == "verl":
            self.packed = pack_linear_weight(weight.detach())
            self.weight = None
        elif mode == "int8":
            self.q, self.scale = quantize_int8(weight)
            self.weight = None  # the fused float copy goes: only the int8 one is read while decoding
        elif mode == "onednn":
            # The batch size given to the packing is a hint only: the packed weight serves any number of rows.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
            self.weight = None
        elif mode == "mkl":
            # As above (`_mkl_linear` takes the packed path when its last argument equals the rows it is given).
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 32)
            # The packed path reads only the original weight's sizes: a stand-in of that shape and no storage
            # lets the fused float copy go.
            self.weight = weight.new_empty(()).expand(weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if self.mode == "verl":
                return packed_linear(x, self.packed, self.bias, self.out_features)
            if self.mode == "onednn":
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, x.numel() // x.shape[-1])
        if self.q is None:
            return F.linear(x, self.weight, self.bias)
        return int8_linear(x, self.q, self.scale, self.bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaFamilyDecoder:
    """Prefill + per-token decode on a Llama-family model with a static KV cache.

    Usage per batch: `start(batch, max_len)`, then `step(ids, mask)` with the prompt (left-padded [B, P]) and
    afterwards one token per row ([B, 1]); `mask` [B, L] covers every position so far (0 = padding or a
    finished row). Returns the last position's logits [B, V]. `select(rows)` between steps changes which rows
    the cache holds (the mask must follow). `finish()` frees the cache.
    """

    def __init__(self, model: torch.nn.Module, quantization: str = "none", pack: str = "auto"):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LlamaFamilyDecoder cannot run this model: {reason}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"LlamaFamilyDecoder: quantization={quantization!r} is not one of {QUANTIZATIONS}")
        self.model, self.base = model, model.model
        self.quantization = quantization
        self.quantized = 0
        """Projections running in int8 after the last `prepare` (LM head included)."""
        self.unquantized: dict[str, str] = {}
        """Projection -> why the int8 kernel does not serve it (after the last `prepare` with quantization)."""
        self.quantize_s = 0.0
        """Seconds the last `prepare` spent quantizing."""
        self.pack = pack
        """Which library float32 CPU projections are packed for at `prepare` (`PACKINGS`, module docstring)."""
        self.packing, self.pack_unavailable = _packing(pack)
        self.packed = 0
        """Projections running packed (for `packing`) after the last `prepare` (LM head included)."""
        self.group_queries = True
        """A decode step attends with each key/value head's query heads side by side (module docstring); False:
        one query per head through SDPA's grouped-query path (what benchmarks/engines/bench_decode.py compares)."""
        self.fused_attention = True
        """A float32 CPU decode step with `group_queries` attends through verl.ops.decode_attention (one pass over
        the cache per key/value head, csrc/cpu/attention.cpp) where the extension has it; False: SDPA."""
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.layers: list[dict] = []
        self.length = 0

    @torch.no_grad()
    def start(self, batch: int, max_len: int) -> None:
        """Fuses the current weights and allocates the cache for `batch` rows of at most `max_len` positions."""
        self.prepare(max_len)
        self._allocate(batch, max_len)

    @torch.no_grad()
    def prepare(self, max_len: int) -> None:
        """Fuses the current weights and computes cos/sin for `max_len` positions (no cache yet: `join` adds rows)."""
        t0 = time.perf_counter()
        self.layers, self.quantized, self.unquantized, self.packed = [], 0, {}, 0
        self.packing, self.pack_unavailable = _packing(self.pack)
        for i, layer in enumerate(self.base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            where = f"model.layers.{i}"
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv=self._proj(f"{where}.self_attn.qkv_proj", *_fused([attn.q_proj, attn.k_proj, attn.v_proj])),
                o=self._proj(f"{where}.self_attn.o_proj", *_weight_bias(attn.o_proj)),
                gu=self._proj(f"{where}.mlp.gate_up_proj", *_fused([mlp.gate_proj, mlp.up_proj])),
                down=self._proj(f"{where}.mlp.down_proj", *_weight_bias(mlp.down_proj)),
                act=mlp.act_fn, k=None, v=None))
        self.head = self._proj("lm_head", *_weight_bias(self.model.lm_head))
        self.quantize_s = time.perf_counter() - t0 if self.quantization != "none" else 0.0
        self._rope(max_len)
        self.length = 0

    def _proj(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> _Proj:
        if self.quantization == "none":
            if self.packing != "none" and weight.device.type == "cpu" and \
                    weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
                self.packed += 1
                return _Proj(weight, bias, self.packing)
            return _Proj(weight, bias)
        why = None
        if weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
            why = f"{weight.dtype} weights (the int8 kernel computes in float32)"
        elif weight.device.type not in ("cpu", "cuda"):
            why = f"weights on {weight.device.type}"
        if why is not None:
            self.unquantized[name] = why
            return _Proj(weight, bias)
        self.quantized += 1
        return _Proj(weight, bias, "int8")

    def _rope(self, max_len: int) -> None:
        # the model's own rotary module gives cos/sin for every position a row can reach
        emb = self.base.embed_tokens.weight
        positions = torch.arange(max_len, device=emb.device)[None]
        cos, sin = self.base.rotary_emb(emb[:1, None], positions)
        self.cos, self.sin = cos[0], sin[0]

    def _allocate(self, batch: int, max_len: int) -> None:
        emb = self.base.embed_tokens.weight
        shape = (batch, self.n_kv, max_len, self.head_dim)
        for L in self.layers:
            L["k"], L["v"] = emb.new_empty(shape), emb.new_empty(shape)
        self.length = 0

    def clear(self) -> None:
        """Drops the cache but keeps the fused weights (a continuous batch that ran empty)."""
        for L in self.layers:
            L["k"] = L["v"] = None
        self.length = 0

    @property
    def rows(self) -> int:
        """Rows the cache holds (0 before the first `join` after `prepare`)."""
        return 0 if not self.layers or self.layers[0]["k"] is None else self.layers[0]["k"].shape[0]

    @torch.no_grad()
    def join(self, ids: torch.Tensor, mask: torch.Tensor, reserve: int,
             repeat: torch.Tensor | None = None) -> torch.Tensor:
        """Adds rows to a running batch (continuous batching): prefills `ids` ([b, S] left-padded, `mask` [b, S])
        on their own, then puts them below the current rows, every row right-aligned at max(length, S) columns
        with room for `reserve` more. Returns the new rows' last logits [b, V]. A row's positions come from its
        mask, so moving its cache right by some padding columns changes nothing it computes; the padding columns
        hold zeros (never an uninitialised value that attention weights of 0 would still turn into NaN). The
        caller pads the current rows' mask on the left by max(S - length, 0) and the new rows' by
        max(length - S, 0). `repeat` (an index into the rows of `ids`): the rows that join are those prefilled rows
        in that order (a prompt prefilled once for each of its samples)."""
        old = [(L["k"], L["v"]) for L in self.layers] if self.rows else None
        before, rows = self.length, self.rows
        b, S = ids.shape
        width = max(before, S)
        cap = width + reserve
        if cap > self.cos.shape[0]:
            self._rope(cap)
        self._allocate(b, S)
        logits = self.step(ids, mask)
        if repeat is not None:
            logits, b = logits[repeat], len(repeat)
        for i, L in enumerate(self.layers):
            for name in ("k", "v"):
                new = L[name] if repeat is None else L[name][repeat]
                merged = new.new_zeros((rows + b, self.n_kv, cap, self.head_dim))
                merged[rows:, :, width - S:width] = new[:, :, :S]
                if old is not None:
                    merged[:rows, :, width - before:width] = old[i][0 if name == "k" else 1][:, :, :before]
                L[name] = merged
        self.length = width
        return logits

    @torch.no_grad()
    def trim(self, columns: int) -> None:
        """Drops the first `columns` cache columns (padding no row attends to any more: a long-running batch
        would otherwise widen with every row that joins). The caller drops the same columns of its mask."""
        if columns <= 0:
            return
        for L in self.layers:
            L["k"], L["v"] = L["k"][:, :, columns:], L["v"][:, :, columns:]
        self.length -= columns  # positions come from the masks: the cos/sin table stays as it is

    @torch.no_grad()
    def select(self, rows: torch.Tensor) -> None:
        """Keeps the cache rows `rows` (an index: rows may be dropped, reordered or repeated); later steps take
        len(rows) rows. Repeating a prefilled row gives a GRPO group's samples their shared prompt without
        prefilling it n times; dropping finished rows stops paying for their decode steps."""
        for L in self.layers:
            L["k"], L["v"] = L["k"].index_select(0, rows), L["v"].index_select(0, rows)

    def finish(self) -> None:
        """Drops the KV buffers and fused weights (the memory goes back before training runs)."""
        self.layers, self.length, self.head = [], 0, None
        self.cos = self.sin = None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * weight

    @torch.no_grad()
    def step(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, S = ids.shape
        t0, t1 = self.length, self.length + S
        if not self.layers:
            raise ValueError("LlamaFamilyDecoder.step() before start(): call start(batch, max_len) first")
        if t1 > self.layers[0]["k"].shape[2]:
            raise ValueError(f"decoding position {t1} exceeds the cache's max_len {self.layers[0]['k'].shape[2]} "
                             f"(given to start(), or length + reserve given to join())")
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, t0:t1]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, S, d]
        keys = mask[:, None, None, :t1].bool()  # [B, 1, 1, L]
        if S > 1:  # prefill: causal, and a padded query attends to itself so that no row is all -inf
            causal = torch.ones(S, t1, dtype=torch.bool, device=ids.device).tril(t0)
            own = torch.arange(S, device=ids.device)[:, None] + t0 == torch.arange(t1, device=ids.device)
            keys = (keys & causal) | own
        x = self.base.embed_tokens(ids)
        H, KV, d = self.n_heads, self.n_kv, self.head_dim
        # a float32 CPU decode step attends through verl's kernel (verl.ops.decode_attention) when it is built
        rows_mask = None
        if S == 1 and self.group_queries and self.fused_attention and x.device.type == "cpu" and \
                x.dtype == torch.float32 and use_fused("decode_attention", x):
            rows_mask = mask[:, :t1].bool().contiguous()
        for L in self.layers:
            h = self._norm(x, L["ln1"])
            qkv = L["qkv"](h)
            q, k, v = qkv.split((H * d, KV * d, KV * d), dim=-1)
            q = _rotate(q.view(B, S, H, d).transpose(1, 2), cos, sin)
            L["k"][:, :, t0:t1] = _rotate(k.view(B, S, KV, d).transpose(1, 2), cos, sin)
            L["v"][:, :, t0:t1] = v.view(B, S, KV, d).transpose(1, 2)
            if S == 1 and self.group_queries:  # query head h reads key/value head h // (H // KV)
                if rows_mask is not None:
                    o = decode_attention(q.reshape(B, KV, H // KV, d), L["k"][:, :, :t1], L["v"][:, :, :t1],
                                         rows_mask)
                else:
                    o = F.scaled_dot_product_attention(q.reshape(B, KV, H // KV, d), L["k"][:, :, :t1],
                                                       L["v"][:, :, :t1], attn_mask=keys)
                x = x + L["o"](o.reshape(B, 1, H * d))
            else:
                o = F.scaled_dot_product_attention(q, L["k"][:, :, :t1], L["v"][:, :, :t1], attn_mask=keys,
                                                   enable_gqa=KV != H)
                x = x + L["o"](o.transpose(1, 2).reshape(B, S, H * d))
            gate, up = L["gu"](self._norm(x, L["ln2"])).chunk(2, dim=-1)
            x = x + L["down"](L["act"](gate) * up)
        self.length = t1
        return self.head(self._norm(x[:, -1], self.base.norm.weight))
