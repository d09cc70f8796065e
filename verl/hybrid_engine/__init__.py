"""The 3D-HybridEngine: a pure planner (metadata → which rank sends which slice where) and an executor
(bucketed point-to-point moves, layout permutation in one gather kernel) that turn the actor's training
layout — megatron TP×PP×DP, or a data-parallel Hugging Face module (whole on every rank, or FSDP2 dim-0
shards) — into the generation layout TP_g×DP_g as an `update_weights` stream.

    he = hybrid_engine_for(megatron_gpt, HybridEngineConfig(generation_tp=2, weight_format="vllm"))
    he.sync(megatron_local_params(megatron_gpt), rollout)
    he = hybrid_engine_for_module(hf_model, HybridEngineConfig(), group=None)
    he.sync(module_local_params(hf_model), rollout)
    he = hybrid_engine_across(hf_model_or_None, config_or_None, group=union, actor_ranks=(0, 1), rollout_ranks=(2, 3))
    he.sync(module_local_params(hf_model), None)     # actor ranks send; rollout ranks: he.sync({}, rollout)

Both views of the weights come from one layout model, verl.models.layout (`ModelLayout`: the
architecture's HF tensor groups and the training `ShardSpec`s)."""

from verl.hybrid_engine.engine import HybridEngine, HybridEngineConfig
from verl.hybrid_engine.executor import ExecutorStats, ReshardExecutor
from verl.hybrid_engine.megatron import (hybrid_engine_for, megatron_layout, megatron_local_params,
                                         megatron_training_layout)
from verl.hybrid_engine.module import (hybrid_engine_across, hybrid_engine_for_module, module_layout,
                                       module_local_params)
from verl.hybrid_engine.planner import (
    RANK_MAPPINGS,
    Bucket,
    Piece,
    ReshardPlan,
    TargetPlan,
    generation_coords,
    plan_reshard,
)
from verl.hybrid_engine.targets import FORMATS, Target, generation_targets

__all__ = ["HybridEngine", "HybridEngineConfig", "ExecutorStats", "ReshardExecutor", "Bucket", "Piece",
           "ReshardPlan", "TargetPlan", "generation_coords", "plan_reshard", "RANK_MAPPINGS",
           "FORMATS", "Target", "generation_targets", "hybrid_engine_for", "megatron_layout",
           "megatron_local_params", "megatron_training_layout", "hybrid_engine_for_module", "hybrid_engine_across",
           "module_layout", "module_local_params"]
