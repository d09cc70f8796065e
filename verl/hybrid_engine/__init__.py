"""The 3D-HybridEngine: a pure planner (metadata → which rank sends which slice where) and an executor
(bucketed point-to-point moves, layout permutation in one gather kernel) that turn the actor's Megatron
training layout TP×PP×DP into the generation layout TP_g×DP_g as an `update_weights` stream."""

from verl.hybrid_engine.engine import HybridEngine, HybridEngineConfig
from verl.hybrid_engine.executor import ExecutorStats, ReshardExecutor
from verl.hybrid_engine.planner import (
    Bucket,
    Piece,
    ReshardPlan,
    TargetPlan,
    TrainingLayout,
    generation_coords,
    plan_reshard,
)
from verl.hybrid_engine.specs import (ParamSpec, Segment, Target, generation_targets, llama_param_specs,
                                      training_segments)

__all__ = ["HybridEngine", "HybridEngineConfig", "ExecutorStats", "ReshardExecutor", "Bucket", "Piece",
           "ReshardPlan", "TargetPlan", "TrainingLayout", "generation_coords", "plan_reshard", "ParamSpec",
           "Segment", "Target", "generation_targets", "llama_param_specs", "training_segments"]
