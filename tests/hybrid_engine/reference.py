"""Independent references for the hybrid-engine tests: Megatron's sharding of a HF state dict and the
engine-layout tensors a generation rank must end up with, written directly from the layout conventions
(not from verl.models.layout or verl.hybrid_engine), so the planner is checked against a second derivation.
`megatron_meta` is the one thing here that calls verl: it builds the metadata under test."""

from __future__ import annotations

from verl.distributed import Placement

from types import SimpleNamespace

import torch



# A plain namespace with a LlamaConfig's fields: importing transformers would cost every spawned rank seconds.
LlamaConfig = SimpleNamespace


def tiny_config(layers=4, heads=8, kv_heads=4, hidden=32, ffn=48, vocab=101, tied=False, bias=False) -> LlamaConfig:
    return SimpleNamespace(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                           tie_word_embeddings=tied, attention_bias=bias, model_type="qwen2" if bias else "llama",
                           head_dim=hidden // heads,
                           max_position_embeddings=64, rms_norm_eps=1e-6)


def megatron_meta(cfg: LlamaConfig, *, tp=1, pp=1, dtype=torch.float32, vocab_multiple=8, value_head=False):
    """The ModelLayout (metadata under test) of the megatron GPT verl builds from `cfg` for TP `tp`, PP `pp`."""
    from verl.models import arch_from_hf, parallel_layout
    from verl.models.layout import megatron_model_layout
    arch = arch_from_hf(cfg)
    return megatron_model_layout(arch, parallel_layout(arch, tp, vocab_multiple), pp=pp, dtype=dtype,
                                 value_head=value_head)


def random_hf_state_dict(cfg: LlamaConfig, dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    hd = H // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def r(*s):
        return torch.randn(*s, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
                   p + "self_attn.q_proj.weight": r(nq * hd, H), p + "self_attn.k_proj.weight": r(nkv * hd, H),
                   p + "self_attn.v_proj.weight": r(nkv * hd, H), p + "self_attn.o_proj.weight": r(H, nq * hd),
                   p + "mlp.gate_proj.weight": r(F, H), p + "mlp.up_proj.weight": r(F, H),
                   p + "mlp.down_proj.weight": r(H, F)})
        if cfg.attention_bias:
            sd.update({p + "self_attn.q_proj.bias": r(nq * hd), p + "self_attn.k_proj.bias": r(nkv * hd),
                       p + "self_attn.v_proj.bias": r(nkv * hd)})
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = r(V, H)
    return sd


def megatron_shards(sd, cfg: LlamaConfig, layout: Placement, rank: int, vocab_multiple: int) -> dict:
    """The local shards of `rank` in megatron-core's layout (fused QKV per query group, [gate_r; up_r])."""
    t, _, p = layout.coords(rank)
    tp, L = layout.tp_size, cfg.num_hidden_layers
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nq
    step = vocab_multiple * tp
    padded = -(-cfg.vocab_size // step) * step
    per_stage = L // layout.pp_size

    def vocab(w):
        full = torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])
        return full.chunk(tp)[t].clone()

    out = {}
    if p == 0:
        out["embedding.word_embeddings.weight"] = vocab(sd["model.embed_tokens.weight"])
    for i in range(p * per_stage, (p + 1) * per_stage):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for leaf in ("weight", "bias") if cfg.attention_bias else ("weight",):
            q = sd[h + f"self_attn.q_proj.{leaf}"]
            k, v = sd[h + f"self_attn.k_proj.{leaf}"], sd[h + f"self_attn.v_proj.{leaf}"]
            rest = q.shape[1:]
            fused = torch.cat([q.reshape(nkv, nq // nkv * hd, *rest), k.reshape(nkv, hd, *rest),
                               v.reshape(nkv, hd, *rest)], dim=1).reshape(-1, *rest)
            out[m + f"self_attention.linear_qkv.{leaf}"] = fused.chunk(tp)[t].clone()
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = sd[h + "self_attn.o_proj.weight"].chunk(tp, dim=1)[t].clone()
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"].clone()
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"].chunk(tp)[t],
                                                      sd[h + "mlp.up_proj.weight"].chunk(tp)[t]])
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"].chunk(tp, dim=1)[t].clone()
    if p == layout.pp_size - 1:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
        if not cfg.tie_word_embeddings:
            out["output_layer.weight"] = vocab(sd["lm_head.weight"])
    return out


ENGINE_VOCAB_PADDING = 64  # vLLM's / SGLang's vocab-parallel layers pad the vocabulary to a multiple of this


def generation_region(name: str, shape, cfg: LlamaConfig, tp_g: int, tg: int) -> tuple[slice, slice]:
    """(rows, columns) of HF tensor `name` that generation TP rank `tg` of `tp_g` needs (columns: all for 1-D)."""
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nq
    rows = shape[0]
    everything = (slice(0, rows), slice(None))

    def chunk(n):
        return slice(tg * n // tp_g, (tg + 1) * n // tp_g)

    leaf = name.rsplit(".", 2)[-2]
    if leaf in ("q_proj", "gate_proj", "up_proj"):
        return chunk(rows), slice(None)
    if leaf in ("k_proj", "v_proj"):
        if tp_g <= nkv:
            return chunk(rows), slice(None)
        h = tg * nkv // tp_g  # replicated KV head
        return slice(h * hd, (h + 1) * hd), slice(None)
    if leaf in ("o_proj", "down_proj"):
        return slice(0, rows), chunk(shape[1])
    if leaf in ("embed_tokens", "lm_head") and tp_g > 1:
        per = -(-cfg.vocab_size // ENGINE_VOCAB_PADDING) * ENGINE_VOCAB_PADDING // tp_g
        return slice(min(tg * per, rows), min((tg + 1) * per, rows)), slice(None)
    return everything


def expected_generation(sd, cfg: LlamaConfig, tp_g: int, tg: int, fmt: str) -> dict[str, torch.Tensor]:
    """What generation TP rank `tg` of `tp_g` must receive (HF names, or vLLM fused qkv/gate_up); the
    vocabulary is split as the engines pad it (ENGINE_VOCAB_PADDING), without the padding rows."""
    out = {}
    for name, w in sd.items():
        rows, cols = generation_region(name, w.shape, cfg, tp_g, tg)
        out[name] = w[rows] if w.dim() == 1 else w[rows, cols]
    if fmt == "vllm":
        for name in [n for n in out if ".q_proj." in n]:
            leaf = name.rsplit(".", 1)[1]
            base = name.rsplit(".", 2)[0]
            out[f"{base}.qkv_proj.{leaf}"] = torch.cat([out.pop(f"{base}.{p}_proj.{leaf}") for p in "qkv"])
        for name in [n for n in out if ".gate_proj." in n]:
            base = name.rsplit(".", 2)[0]
            out[f"{base}.gate_up_proj.weight"] = torch.cat([out.pop(f"{base}.gate_proj.weight"),
                                                            out.pop(f"{base}.up_proj.weight")])
    # A shard made only of vocabulary padding holds nothing to send: the planner leaves it out.
    return {k: v.contiguous() for k, v in out.items() if v.numel()}


def fsdp_chunk(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """FSDP2's dim-0 shard of `w` on `rank`: ceil-sized chunks, the last ones short or empty."""
    c = -(-w.shape[0] // world)
    return w[rank * c:(rank + 1) * c].clone()


def fsdp_bytes_needed(sd, cfg: LlamaConfig, tp_g: int, tg: int, rank: int, world: int) -> int:
    """Bytes generation rank `rank` (TP index `tg`) must receive when training shards every HF tensor FSDP2-
    style over `world` ranks: the rows of its region that lie outside its own dim-0 chunk."""
    total = 0
    for name, w in sd.items():
        rows, cols = generation_region(name, w.shape, cfg, tp_g, tg)
        c = -(-w.shape[0] // world)
        own = range(rank * c, min((rank + 1) * c, w.shape[0]))
        foreign = sum(1 for i in range(w.shape[0])[rows] if i not in own)
        width = 1 if w.dim() == 1 else len(range(w.shape[1])[cols])
        total += foreign * width * w.element_size()
    return total
