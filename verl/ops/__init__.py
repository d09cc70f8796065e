"""verl's fused kernels with a plain, typed Python API; embedding them in another trainer needs only
`import verl.ops` (which also makes `torch.ops.verl.*` available with fake and autograd registrations).

Each op family lives in its own module with its pure-PyTorch reference (`*_ref`) beside it. Choose between
fused kernels and references with `set_backend("auto" | "fused" | "reference")` or `VERL_OPS_BACKEND`.
"""

from __future__ import annotations

from verl.ops._backend import BACKENDS, backend, get_backend, set_backend, use_fused
from verl.ops.logprob import (
    DEFAULT_CHUNK_N,
    DEFAULT_CHUNK_V,
    linear_logprob_entropy,
    linear_logprob_entropy_ref,
    lm_head_logprob_entropy,
    logprob_entropy,
    logprob_entropy_ref,
    vocab_parallel_linear_logprob_entropy,
    vocab_parallel_logprob_entropy,
)
from verl.ops.masked import (
    masked_mean,
    masked_mean_ref,
    masked_sum,
    masked_sum_ref,
    masked_var,
    masked_var_ref,
    masked_whiten,
    masked_whiten_ref,
)
from verl.ops.reshard import (  # hybrid engine: bucket pack/unpack, Megatron → engine layout gather
    reshard_gather,
    reshard_gather_ref,
    reshard_pack,
    reshard_pack_ref,
    reshard_unpack,
    reshard_unpack_ref,
)
from verl.ops.rl import (  # RL advantages: GAE, outcome (group) estimators
    OUTCOME_ESTIMATORS,
    AdvantageResult,
    as_group_index,
    compute_gae,
    compute_gae_ref,
    outcome_advantage,
    outcome_advantage_ref,
    reinforce_plus_plus,
)
from verl.ops.losses import (  # per-token KL and the fused RL losses with masked aggregation
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    Aggregation,
    PolicyLossOutput,
    ValueLossOutput,
    agg_loss,
    agg_loss_ref,
    kl_loss,
    kl_loss_ref,
    kl_penalty,
    kl_penalty_ref,
    policy_loss,
    policy_loss_ref,
    value_loss,
    value_loss_ref,
)

from verl.ops.quant import int8_linear, int8_linear_ref, quantize_int8  # int8 weight-only linear (generation)
from verl.ops.attention import decode_attention, decode_attention_ref  # one decode step's attention (generation)
from verl.ops.packed_linear import pack_linear_weight, packed_linear, packed_linear_ref  # decode projections
from verl.ops.rl_head import (  # the fused RL loss head: hidden states + LM head weight -> the actor's loss
    HEAD_LOSSES,
    HeadLossOutput,
    linear_rl_loss,
    linear_rl_loss_ref,
    vocab_parallel_linear_rl_loss,
)

__all__ = [
    "BACKENDS", "backend", "get_backend", "set_backend", "use_fused",
    "masked_sum", "masked_mean", "masked_var", "masked_whiten",
    "masked_sum_ref", "masked_mean_ref", "masked_var_ref", "masked_whiten_ref",
    "reshard_pack", "reshard_unpack", "reshard_gather",
    "reshard_pack_ref", "reshard_unpack_ref", "reshard_gather_ref",
    # RL advantages (verl/ops/rl.py)
    "OUTCOME_ESTIMATORS", "AdvantageResult", "as_group_index", "compute_gae", "compute_gae_ref",
    "outcome_advantage", "outcome_advantage_ref", "reinforce_plus_plus",
    # per-token KL and RL losses (verl/ops/losses.py)
    "KL_KINDS", "kl_penalty", "kl_penalty_ref", "AGG_MODES", "POLICY_LOSSES", "Aggregation", "PolicyLossOutput",
    "ValueLossOutput", "agg_loss", "agg_loss_ref", "kl_loss", "kl_loss_ref", "policy_loss", "policy_loss_ref",
    "value_loss", "value_loss_ref",
    # log-prob / entropy (verl/ops/logprob.py)
    "logprob_entropy", "linear_logprob_entropy", "vocab_parallel_logprob_entropy",
    "vocab_parallel_linear_logprob_entropy", "logprob_entropy_ref", "linear_logprob_entropy_ref",
    "lm_head_logprob_entropy",
    "DEFAULT_CHUNK_N", "DEFAULT_CHUNK_V",
    # the fused RL loss head (verl/ops/rl_head.py)
    "HEAD_LOSSES", "HeadLossOutput", "linear_rl_loss", "linear_rl_loss_ref", "vocab_parallel_linear_rl_loss",
    # int8 weight-only linear for generation (verl/ops/quant.py)
    "quantize_int8", "int8_linear", "int8_linear_ref",
    # one decode step's attention on CPU (verl/ops/attention.py)
    "decode_attention", "decode_attention_ref",
    # float32 linear with a weight packed once, for decoding on CPU (verl/ops/packed_linear.py)
    "pack_linear_weight", "packed_linear", "packed_linear_ref",
]
