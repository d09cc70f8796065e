"""Property tests of the RL kernels (hypothesis) and aggregation invariance across 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl.ops as O
from verl.testing import run_distributed
from tests.conftest import needs_ext

pytestmark = needs_ext
FAST = settings(max_examples=15, deadline=None, derandomize=True)


@st.composite
def embedded_sequences(draw):
    """B compact sequences (length L_b) and a random embedding of each into T slots, keeping token order."""
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lens = [draw(st.integers(0, T)) for _ in range(B)]
    layout = draw(st.sampled_from(["right", "left", "holes"]))
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, L in enumerate(lens):
        if layout == "right":
            pos = torch.arange(L)
        elif layout == "left":
            pos = torch.arange(T - L, T)
        else:
            pos = torch.randperm(T, generator=g)[:L].sort().values
        mask[b, pos] = True
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    gamma = draw(st.floats(0.5, 1.0))
    lam = draw(st.floats(0.5, 1.0))
    return rewards, values, mask, gamma, lam


@FAST
@given(embedded_sequences())
def test_gae_is_padding_invariant(case):
    """Each row's valid outputs equal GAE on the compact (unpadded) sequence, whatever the padding layout."""
    rewards, values, mask, gamma, lam = case
    adv, ret, _ = torch.ops.verl.gae(rewards, values, mask, gamma, lam)
    for b in range(rewards.shape[0]):
        sel = mask[b]
        L = int(sel.sum())
        if L == 0:
            assert (adv[b] == 0).all()
            continue
        ca, cr, _ = torch.ops.verl.gae(rewards[b, sel][None], values[b, sel][None], torch.ones(1, L, dtype=torch.bool),
                                       gamma, lam)
        torch.testing.assert_close(adv[b, sel], ca[0])
        torch.testing.assert_close(ret[b, sel], cr[0])
        assert (adv[b, ~sel] == 0).all()


@FAST
@given(embedded_sequences())
def test_whitened_gae_has_zero_mean_unit_variance_over_mask(case):
    rewards, values, mask, gamma, lam = case
    out = O.compute_gae(rewards * 3 + 1, values, mask, gamma, lam, whiten=True)
    n = int(mask.sum())
    if n < 2 or float(O.masked_var(out.returns - values, mask)) < 1e-6:
        return  # fewer than 2 tokens, or constant advantages: whitening is defined as (x - mean) * 1/sqrt(eps)
    assert abs(float(O.masked_mean(out.advantages, mask))) < 1e-9
    assert abs(float(O.masked_var(out.advantages, mask)) - 1.0) < 1e-5
    assert (out.advantages[~mask] == 0).all()


@FAST
@given(st.integers(1, 24), st.integers(1, 6), st.integers(0, 2**31 - 1), st.booleans())
def test_grpo_advantages_sum_to_zero_within_each_group(B, T, seed, norm_by_std):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True  # every sequence shows its advantage at token 0
    index = torch.randint(0, 4, (B,), generator=g)
    adv = O.outcome_advantage(rewards, mask, index, "grpo", norm_by_std=norm_by_std).advantages[:, 0]
    for gid in index.unique():
        assert abs(float(adv[index == gid].sum())) < 1e-9
    rloo = O.outcome_advantage(rewards, mask, index, "rloo").advantages[:, 0]
    for gid in index.unique():
        assert abs(float(rloo[index == gid].sum())) < 1e-9


def _split_case(seed, B, T):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    return lp, old, adv, mask


def _global_agg(mode, mask, dp_size):
    return O.Aggregation(mode=mode, global_tokens=float(mask.sum()), global_seqs=float((mask.sum(-1) > 0).sum()),
                         dp_size=dp_size)


@FAST
@given(st.integers(2, 12), st.integers(1, 9), st.integers(0, 2**31 - 1), st.sampled_from(O.AGG_MODES),
       st.integers(1, 4), st.sampled_from(O.POLICY_LOSSES))
def test_aggregation_is_invariant_to_data_parallel_splits(B, T, seed, mode, parts, loss_type):
    """Chunks aggregated with the global counts: micro-batches summed, or DP ranks averaged, equal the full batch."""
    lp, old, adv, mask = _split_case(seed, B, T)
    full_x = lp.clone().requires_grad_()
    full = O.policy_loss(full_x, old, adv, mask, loss_type, agg=_global_agg(mode, mask, 1)).loss
    full.backward()
    chunks = torch.arange(B).chunk(parts)
    for dp in (1, len(chunks)):  # dp=1: gradient accumulation; dp=k: k ranks whose losses/grads are averaged
        agg = _global_agg(mode, mask, dp)
        x = lp.clone().requires_grad_()
        total = sum(O.policy_loss(x[c], old[c], adv[c], mask[c], loss_type, agg=agg).loss for c in chunks) / dp
        total.backward()
        torch.testing.assert_close(total, full)
        torch.testing.assert_close(x.grad, full_x.grad)


def _dp_rank_body(rank, world_size, seed, mode):
    lp, old, adv, mask = _split_case(seed, 10, 7)
    agg = _global_agg(mode, mask, world_size)  # global counts: every rank knows the step's totals
    rows = torch.arange(10).chunk(world_size)[rank]
    x = lp[rows].clone().requires_grad_()
    out = O.policy_loss(x, old[rows], adv[rows], mask[rows], "vanilla", agg=agg)
    out.loss.backward()
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss)
    loss /= world_size  # DDP averages gradients across ranks; the loss is averaged the same way here
    grad = torch.zeros(10, 7, dtype=torch.float64)
    grad[rows] = x.grad / world_size
    torch.distributed.all_reduce(grad)
    full_x = lp.clone().requires_grad_()
    full = O.policy_loss(full_x, old, adv, mask, "vanilla", agg=_global_agg(mode, mask, 1)).loss
    full.backward()
    return float((loss - full).abs()), float((grad - full_x.grad).abs().max())


@pytest.mark.multiprocess
def test_aggregation_invariance_on_two_gloo_ranks():
    for mode in ("token-mean", "seq-mean-token-mean"):
        results = run_distributed(_dp_rank_body, world_size=2, args=(11, mode), timeout=120)
        for loss_err, grad_err in results:
            assert loss_err < 1e-12 and grad_err < 1e-12, (mode, loss_err, grad_err)
