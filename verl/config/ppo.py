"""The config tree of a PPO / GRPO job (one typed tree; YAML and overrides map onto it 1:1).

Batch sizes follow one convention: `data.train_batch_size` and `actor.mini_batch_size` count *prompts*
over all ranks; `*.micro_batch_size` counts *responses* on one rank (one forward/backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from verl.errors import VerlConfigError
from verl.rollout.config import RolloutConfig


@dataclass(kw_only=True, slots=True)
class TinyModelConfig:
    """A Llama-architecture model built locally with random weights (no download)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when smaller than num_heads)."""
    intermediate_size: int = 256
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = 128
    """Longest sequence (prompt + response) the model supports."""
    vocab_size: int = 96
    """Target size of the BPE vocabulary trained in memory on the task's text."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which policy model to train."""

    path: str | None = None
    """Hugging Face model directory (config, weights, tokenizer); None builds the tiny local model."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the locally built model when `path` is None."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training (float32 on CPU)."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompt dataset and batching."""

    train_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files of prompts; empty uses the synthetic `task`."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    answer_key: str = "answer"
    """Column holding the ground truth the reward compares against."""
    task: Literal["arithmetic", "counting"] = "arithmetic"
    """Synthetic verifiable task used when `train_files` is empty."""
    num_examples: int = 2000
    """Examples generated for the synthetic task."""
    max_operand: int = 20
    """Operands of the synthetic arithmetic task are below this (difficulty)."""
    train_batch_size: int = 16
    """Prompts per step over all ranks."""
    max_prompt_length: int = 32
    """Prompts longer than this many tokens are an error (left-padded to the batch's longest)."""
    shuffle: bool = True
    """Reshuffle every epoch (seeded by trainer.seed, so runs and resumes are reproducible)."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warm-up + decay learning-rate schedule."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (linear / cosine)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after the warm-up, over the job's remaining steps."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up in optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    def check(self) -> None:
        if not self.lr > 0 or not self.min_lr >= 0 or self.min_lr > self.lr:
            raise VerlConfigError(f"optim: lr={self.lr} must be > 0 and 0 <= min_lr={self.min_lr} <= lr")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0 or not self.eps > 0:
            raise VerlConfigError(f"optim: warmup_steps={self.warmup_steps}, weight_decay={self.weight_decay} and "
                                  f"grad_clip={self.grad_clip} must be >= 0 and eps={self.eps} > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise VerlConfigError(f"optim.betas={self.betas} must be two numbers in [0, 1)")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of `lr` at optimizer step `step` of `total_steps` (warm-up, then the decay style)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_decay_style == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        shape = 1.0 - progress if self.lr_decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        floor = self.min_lr / self.lr
        return floor + (1.0 - floor) * shape


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    """Parallel layout of the megatron engine (actor, reference and critic share it)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    sequence_parallel: bool = False
    """Split activations along the sequence over the TP group (needs tp > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the megatron models."""


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    """The policy and its PPO update."""

    engine: Literal["torch", "megatron"] = "torch"
    """Training engine: plain torch data parallel over a Hugging Face / verl model, or megatron-core."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Layout of the megatron engine (used when engine=megatron)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of the policy."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    mini_batch_size: int = 16
    """Prompts per optimizer step over all ranks (each brings rollout.n responses)."""
    micro_batch_size: int = 32
    """Responses per forward/backward on one rank (gradient accumulation unit)."""
    policy_loss: str = "vanilla"
    """Registered policy loss (verl.algos: vanilla PPO clip, gspo, reinforce, or your own)."""
    clip_ratio_low: float = 0.2
    """PPO clip below 1 (ratio >= 1 - clip_ratio_low)."""
    clip_ratio_high: float = 0.2
    """PPO clip above 1 (ratio <= 1 + clip_ratio_high); larger than low is the asymmetric 'clip-higher'."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Put the KL to the reference model in the loss (GRPO style) instead of the reward."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "k3"
    """Registered KL estimator used in the loss (k1, abs, k2, k3, k1+, k3+, ...)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses are reduced to one number."""


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The value model (used by the `gae` estimator only)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Optimizer of the critic."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    micro_batch_size: int = 32
    """Responses per forward/backward on one rank."""
    cliprange_value: float = 0.5
    """Clip of the new values around the old ones in the value loss."""
    warmup_steps: int = 0
    """Steps during which only the critic is trained (the actor update is skipped)."""


@dataclass(kw_only=True, slots=True)
class KLControlConfig:
    """KL-in-reward coefficient controller."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive (Ziegler et al.) towards `target_kl`."""
    kl_coef: float = 0.001
    """(Initial) coefficient of the KL penalty in the reward."""
    target_kl: float = 0.1
    """Adaptive controller's target KL per sequence."""
    horizon: int = 10000
    """Adaptive controller's horizon in samples."""


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Advantage estimation and KL handling."""

    adv_estimator: str = "grpo"
    """Registered advantage estimator: gae (PPO with a critic), grpo, dr_grpo, rloo, reinforce_plus_plus, remax
    (no critic), or your own (verl.algos.register_advantage)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group's reward std (dr_grpo never does)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(policy || reference) from the token rewards."""
    kl_penalty: str = "k1"
    """Registered KL estimator used in the reward."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of the KL-in-reward coefficient."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How responses are scored."""

    type: Literal["rule", "model"] = "rule"
    """Rule-based function from the reward registry, or a model-based reward model."""
    name: str = "arithmetic"
    """Registered rule-based reward (see verl.rewards.list_rewards())."""
    model_path: str | None = None
    """Hugging Face sequence-classification model directory for type=model."""


@dataclass(kw_only=True, slots=True)
class WarmupConfig:
    """Short supervised warm start on the ground-truth answers (for random models)."""

    steps: int = 0
    """Supervised steps before RL (0 skips the warm start)."""
    batch_size: int = 32
    """Examples per supervised step."""
    lr: float = 3e-3
    """Learning rate of the warm start."""


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Loop, logging and checkpoints."""

    total_steps: int = 50
    """RL steps to run."""
    seed: int = 1
    """Seed of data order, sampling and initialisation."""
    output_dir: str = "outputs/default"
    """Metrics, plots, checkpoints and the exported model go here."""
    save_every: int = 0
    """Checkpoint every K steps (0: only at the end)."""
    save_final: bool = True
    """Checkpoint at the end of training."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk (0 keeps all)."""
    resume: str | None = None
    """Checkpoint directory to continue from, or 'auto' for the newest valid one in output_dir (an incomplete or
    corrupted newer one is skipped with a warning)."""
    overwrite: bool = False
    """Start a fresh run in an output_dir that an earlier run used (checkpoints or metrics.jsonl there): deletes
    that run's checkpoints and metrics first. Without it (and without `resume`) such a folder is refused."""
    trust_checkpoint: bool = False
    """Resume from a checkpoint without verl's verified manifest.json, and let DCP unpickle its metadata and
    objects unrestricted. Unpickling runs code: only for checkpoints whose origin you trust."""
    export_hf: bool = True
    """Export the final actor as a Hugging Face directory (output_dir/hf_actor)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the workers (auto: cuda when available)."""
    threads: int = 0
    """torch intra-op threads per process (0: leave torch's default)."""
    progress_bar: bool = True
    """Show a tqdm bar with step, reward, KL, entropy and tokens/s (rank 0)."""
    tensorboard: bool = True
    """Write TensorBoard event files next to metrics.jsonl."""
    plot: bool = True
    """Write curves.png (reward, KL, entropy) at the end."""
    collective_timeout_s: float = 1800.0
    """Timeout of every collective (process-group timeout): a rank that hangs fails the job after this long."""
    trace_step: int = 0
    """Write a Chrome trace of this step's dataflow to output_dir/trace_step_N.json (0: no trace)."""


@dataclass(kw_only=True, slots=True)
class PPOConfig:
    """Root of a PPO / GRPO job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy update."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (gae only)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm start."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, logging, checkpoints."""

    @property
    def needs_critic(self) -> bool:
        """The advantage estimator reads a critic's values (its registration says so)."""
        from verl.algos import advantage_info
        return advantage_info(self.algorithm.adv_estimator).needs_critic

    @property
    def needs_ref(self) -> bool:
        """A KL term (in the loss or the reward) needs the frozen reference model."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def on_policy(self) -> bool:
        """One epoch over one mini-batch without KL in the reward: the update's own first forward gives the old
        log-probs (nothing changed the weights since generation), which saves a forward pass per step."""
        return (self.actor.ppo_epochs == 1 and self.actor.mini_batch_size == self.data.train_batch_size
                and not self.algorithm.use_kl_in_reward)

    def check(self) -> None:
        """Checks that do not depend on the world size (run when the tree is built)."""
        from verl.algos import advantage_info, get_advantage, get_kl, get_policy_loss, check_agg_mode
        for getter, key, value in ((get_advantage, "algorithm.adv_estimator", self.algorithm.adv_estimator),
                                   (get_policy_loss, "actor.policy_loss", self.actor.policy_loss),
                                   (get_kl, "actor.kl_loss_type", self.actor.kl_loss_type),
                                   (get_kl, "algorithm.kl_penalty", self.algorithm.kl_penalty)):
            try:
                getter(value)
            except VerlConfigError as e:
                raise VerlConfigError(f"{key}: {e}") from None
        check_agg_mode(self.actor.loss_agg_mode)
        if advantage_info(self.algorithm.adv_estimator).needs_group and self.rollout.n < 2:
            raise VerlConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares responses "
                                  f"within a group; set rollout.n >= 2 (got {self.rollout.n})")
        for name, value in (("data.train_batch_size", self.data.train_batch_size),
                            ("actor.mini_batch_size", self.actor.mini_batch_size),
                            ("actor.micro_batch_size", self.actor.micro_batch_size),
                            ("critic.micro_batch_size", self.critic.micro_batch_size),
                            ("rollout.n", self.rollout.n), ("rollout.max_new_tokens", self.rollout.max_new_tokens),
                            ("actor.ppo_epochs", self.actor.ppo_epochs), ("trainer.total_steps", self.trainer.total_steps)):
            if value < 1:
                raise VerlConfigError(f"{name} must be >= 1, got {value}")
        if self.rollout.decoder == "train" and (self.rollout.engine != "torch" or self.actor.engine != "torch"):
            raise VerlConfigError(f"rollout.decoder=train decodes with the training forward of a torch actor's own "
                                  f"module: it needs rollout.engine=torch and actor.engine=torch (got "
                                  f"{self.rollout.engine} / {self.actor.engine})")
        if self.rollout.compare_full_gather and self.actor.engine != "megatron":
            raise VerlConfigError("rollout.compare_full_gather times the full gather of a megatron actor's shards; "
                                  "set actor.engine=megatron, or turn it off")
        if self.reward.type == "model" and not self.reward.model_path:
            raise VerlConfigError("reward.type=model needs reward.model_path (a sequence-classification model dir)")

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that get different prompts (TP / PP peers of the megatron engine share theirs)."""
        if self.actor.engine != "megatron":
            return world_size
        m = self.actor.megatron
        if world_size % (m.tp * m.pp):
            raise VerlConfigError(f"actor.megatron.tp={m.tp} x pp={m.pp} must divide the {world_size} ranks")
        return world_size // (m.tp * m.pp)

    def validate_world(self, world_size: int) -> None:
        """Layout and batch-size divisibility across `world_size` ranks and micro-batches; raised before any step."""
        d, a, n = self.data, self.actor, self.rollout.n
        tp_g = self.rollout.tp
        if tp_g > world_size or world_size % tp_g:
            raise VerlConfigError(f"rollout.tp={tp_g} must divide the {world_size} ranks (each generation replica "
                                  f"spans rollout.tp ranks); use a divisor of {world_size}, or launch more processes")
        replicas = world_size // tp_g
        world_size = self.data_parallel_size(world_size)
        if d.train_batch_size % world_size:
            raise VerlConfigError(f"data.train_batch_size={d.train_batch_size} prompts do not split over "
                                  f"{world_size} ranks; use a multiple of {world_size}")
        if d.train_batch_size % replicas:
            raise VerlConfigError(f"data.train_batch_size={d.train_batch_size} prompts do not split over the "
                                  f"{replicas} generation replicas (ranks / rollout.tp={tp_g}); use a multiple of "
                                  f"{replicas}")
        if d.train_batch_size % a.mini_batch_size:
            raise VerlConfigError(f"actor.mini_batch_size={a.mini_batch_size} must divide "
                                  f"data.train_batch_size={d.train_batch_size}")
        if a.mini_batch_size % world_size:
            raise VerlConfigError(f"actor.mini_batch_size={a.mini_batch_size} prompts do not split over "
                                  f"{world_size} ranks; use a multiple of {world_size}")
        per_rank = a.mini_batch_size // world_size * n
        if per_rank % a.micro_batch_size:
            raise VerlConfigError(f"actor.micro_batch_size={a.micro_batch_size} must divide the "
                                  f"{per_rank} responses of a mini-batch on one rank "
                                  f"(actor.mini_batch_size / world_size * rollout.n)")
        if self.needs_critic:
            rank_batch = d.train_batch_size // world_size * n
            if rank_batch % self.critic.micro_batch_size:
                raise VerlConfigError(f"critic.micro_batch_size={self.critic.micro_batch_size} must divide the "
                                      f"{rank_batch} responses per rank (data.train_batch_size / world_size * "
                                      f"rollout.n)")
