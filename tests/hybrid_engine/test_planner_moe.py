"""The reshard planner on mixture-of-experts models, from metadata alone (one process): every (TP, PP, DP, EP,
ETP) → TP_g combination assembles the engine's tensors bit-exactly, each rank is sent exactly the experts it
lacks (EP=2 → TP_g=1 moves no attention, norm or router byte), and vLLM's fused-MoE format is refused.

The references below are written from megatron-core's expert layout (EP rank r holds experts r·E/EP ...,
each expert's fc1 = [gate_t; up_t] over expert TP), independently of verl.models.layout."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from tests.hybrid_engine.reference import expected_generation, megatron_shards
from tests.hybrid_engine.test_planner import check_against_reference, simulate
from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.hybrid_engine import plan_reshard

E, K, F_EXPERT, VOCAB_MULTIPLE = 4, 2, 16, 8


def moe_config(layers=2) -> SimpleNamespace:
    """A Qwen3-MoE config: per-head q/k norms, every layer sparse."""
    return SimpleNamespace(model_type="qwen3_moe", hidden_size=32, intermediate_size=48, moe_intermediate_size=F_EXPERT,
                           num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=101,
                           tie_word_embeddings=False, attention_bias=False, max_position_embeddings=64,
                           rms_norm_eps=1e-6)


def moe_state_dict(cfg, dtype=torch.bfloat16, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g).to(dtype)
    H, hd = cfg.hidden_size, cfg.head_dim
    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, H), "model.norm.weight": r(H),
          "lm_head.weight": r(cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
                   p + "self_attn.q_proj.weight": r(4 * hd, H), p + "self_attn.k_proj.weight": r(2 * hd, H),
                   p + "self_attn.v_proj.weight": r(2 * hd, H), p + "self_attn.o_proj.weight": r(H, 4 * hd),
                   p + "self_attn.q_norm.weight": r(hd), p + "self_attn.k_norm.weight": r(hd),
                   p + "mlp.gate.weight": r(E, H)})
        for e in range(E):
            sd.update({p + f"mlp.experts.{e}.gate_proj.weight": r(F_EXPERT, H),
                       p + f"mlp.experts.{e}.up_proj.weight": r(F_EXPERT, H),
                       p + f"mlp.experts.{e}.down_proj.weight": r(H, F_EXPERT)})
    return sd


def moe_shards(sd, cfg, layout: Placement, rank: int) -> dict[str, torch.Tensor]:
    """`rank`'s megatron shards: the dense part as reference.megatron_shards builds it, plus norms, router and
    the experts of its EP index (global expert numbers in the canonical names)."""
    dense = {k: v for k, v in sd.items() if ".mlp." not in k and "_norm." not in k}
    for i in range(cfg.num_hidden_layers):  # megatron_shards' MLP slots, dropped below
        for x in ("gate", "up"):
            dense[f"model.layers.{i}.mlp.{x}_proj.weight"] = torch.zeros(cfg.intermediate_size, cfg.hidden_size)
        dense[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(cfg.hidden_size, cfg.intermediate_size)
    out = {k: v for k, v in megatron_shards(dense, cfg, layout, rank, VOCAB_MULTIPLE).items() if ".mlp." not in k}
    _, _, p = layout.coords(rank)
    et, ep, _, _ = layout.expert_coords(rank)
    per_stage, local = cfg.num_hidden_layers // layout.pp_size, E // layout.ep_size
    for i in range(p * per_stage, (p + 1) * per_stage):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "self_attention.q_layernorm.weight"] = sd[h + "self_attn.q_norm.weight"].clone()
        out[m + "self_attention.k_layernorm.weight"] = sd[h + "self_attn.k_norm.weight"].clone()
        out[m + "mlp.router.weight"] = sd[h + "mlp.gate.weight"].clone()
        for e in range(ep * local, (ep + 1) * local):
            x = f"{h}mlp.experts.{e}."
            gate, up = (sd[x + f"{n}_proj.weight"].chunk(layout.etp_size)[et] for n in ("gate", "up"))
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([gate, up])
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = \
                sd[x + "down_proj.weight"].chunk(layout.etp_size, dim=1)[et].clone()
    return out


def moe_meta(cfg, layout: Placement, dtype=torch.bfloat16):
    from verl.models import arch_from_hf, parallel_layout
    from verl.models.layout import megatron_model_layout
    arch = arch_from_hf(cfg)
    lay = parallel_layout(arch, layout.tp_size, VOCAB_MULTIPLE, ep=layout.ep_size, etp=layout.etp_size)
    return megatron_model_layout(arch, lay, pp=layout.pp_size, dtype=dtype)


def _combos():
    for tp, pp, dp, ep, etp in itertools.product([1, 2], [1, 2], [1, 2, 4], [1, 2, 4], [1, 2]):
        world = tp * pp * dp
        if world > 8 or (world // pp) % (ep * etp) or (etp == 2 and tp == 1 and ep == 4):
            continue
        for tp_g in (1, 2):
            if world % tp_g == 0 and (tp % tp_g == 0 or tp_g % tp == 0):
                yield tp, pp, dp, ep, etp, tp_g


COMBOS = list(_combos())


@pytest.mark.parametrize("tp,pp,dp,ep,etp,tp_g", COMBOS, ids=["tp{}pp{}dp{}ep{}etp{}-tpg{}".format(*c) for c in COMBOS])
def test_expert_layouts_assemble_engine_weights_bit_exactly(tp, pp, dp, ep, etp, tp_g):
    cfg = moe_config()
    layout = Placement.layout(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
    sd = moe_state_dict(cfg)
    plan = plan_reshard(moe_meta(cfg, layout), layout, tp_g, fmt="hf", bucket_bytes=8 << 10)
    shards = [moe_shards(sd, cfg, layout, r) for r in range(layout.world_size)]
    for r in range(layout.world_size):  # the planner's local shards are megatron's, experts included
        assert {k: tuple(v.shape) for k, v in shards[r].items()} == plan.local_params(r)
    check_against_reference(plan, shards, sd, cfg)


@pytest.mark.parametrize("dp,ep", [(2, 2), (4, 2), (4, 4)])
def test_each_rank_receives_exactly_the_experts_it_lacks(dp, ep):
    cfg = moe_config()
    layout = Placement.layout(tp=1, pp=1, dp=dp, ep=ep)
    sd = moe_state_dict(cfg)
    plan = plan_reshard(moe_meta(cfg, layout), layout, 1, bucket_bytes=1 << 30)
    expert_bytes = sum(v.numel() * v.element_size() for k, v in sd.items() if ".experts." in k)
    traffic = plan.traffic()
    for r in range(dp):
        assert traffic["received"][r] == expert_bytes * (ep - 1) // ep
    total = sum(v.numel() * v.element_size() for v in sd.values())
    # everything a rank holds (attention, norms, router, embeddings, its experts) is used in place
    assert sum(traffic["received"]) < total * dp * (ep - 1) / ep
    got = simulate(plan, [moe_shards(sd, cfg, layout, r) for r in range(dp)])
    want = expected_generation(sd, cfg, 1, 0, "hf")
    assert all(torch.equal(got[r][k], v) for r in range(dp) for k, v in want.items())


def test_vllm_fused_moe_format_is_refused():
    cfg = moe_config()
    layout = Placement.layout(tp=2, pp=1, dp=1)
    with pytest.raises(VerlConfigError, match="fused-MoE"):
        plan_reshard(moe_meta(cfg, layout), layout, 2, fmt="vllm")


def test_expert_shard_of_an_unknown_ep_rank_is_refused():
    cfg = moe_config()
    meta = moe_meta(cfg, Placement.layout(tp=1, pp=1, dp=2, ep=2))
    with pytest.raises(VerlConfigError, match="expert-parallel rank 1"):
        plan_reshard(meta, Placement.layout(tp=1, pp=1, dp=2, ep=1), 1)
