"""The PPO / GRPO training loop: builds the workers from the config, then runs the dataflow once per step,
logging metrics and writing checkpoints. The algorithm itself lives in `verl.trainer.ppo_flow`."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from verl.config.base import to_dict
from verl.config.ppo import PPOConfig
from verl.data import BatchSampler, PromptDataset, fit_prompt_lengths, load_splits, prompt_text, task_corpus
from verl.dataflow.trace import merge_traces, write_trace
from verl.distributed import Placement
from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout import Tokenizer, build_rollout
from verl.rollout.base import length_limit
from verl.trainer.carried import decode_state, encode_state
from verl.trainer.kl_control import build_kl_controller
from verl.trainer.memory import check_memory_fits, hf_shape, model_shape
from verl.trainer.ppo_flow import build_ppo_dataflow
from verl.rewards import check_sources
from verl.trainer.validation import Validator, validation_due
from verl.trainer.warmup import supervised_warmup
from verl.trainer.carried import FLOW_STATE
from verl.utils.checkpoint import (CheckpointManager, all_ok, apply_state, broadcast_json, checkpoint_tensors,
                                   rng_state, set_rng_state)
from verl.distributed.collectives import barrier, gather_lists, reduce_metrics
from verl.utils.hf import export_hf
from verl.utils.metrics import MetricsLogger, peak_memory_mb, plot_curves
from verl.utils.run_folder import RunFolder, check_output_dir
from verl.utils.spare import started_by_spare
from verl.utils.snapshot import (DEFAULT_ROOT, MAX_KEEP, Snapshots, config_digest, fill, process_start_time,
                                 recovery_enabled, torchrun_restarts)
from verl.utils.state_check import MAX_STEP, Dict, Int, Json, List, Opt, Spec, validate
from verl.utils.watchdog import STUCK_FILE, Watchdog, rank_file
from verl.workers import ActorWorker, CriticWorker, RolloutWorker, TorchEngine, build_reward
from verl.workers.engine import SCHEDULER_STATE, BaseModelView, ModuleEngine
from verl.workers.request import EngineRequest
from verl.workers.rollout import WeightLink, WeightStream, sync_rollout_weights

MAXED = ("reward/max", "rollout/mismatch_max", "rollout/staleness_max", "perf/peak_memory_mb", "perf/snapshot_s")
SNAPSHOTS = ".snapshots"  # output_dir's folder of recovery snapshots, when memory has no room (verl.utils.snapshot)


def load_policy(cfg: PPOConfig, dataset: PromptDataset, placement: Placement | None = None):
    """(model, tokenizer): a Hugging Face directory, a GGUF file or a shipped model (verl.models.pretrained), or
    the tiny local model (model.tiny: Llama by default, or another family, mixture-of-experts ones included) with
    a BPE trained on the data (for an agent job, in ChatML, on the data and the environment's demonstrations too),
    in model.dtype. With a `placement`, a step that cannot fit in memory with the tiny model's vocabulary is
    refused before the model is built (verl.trainer.memory)."""
    from verl.models.tiny import tiny_model, tiny_tokenizer
    if cfg.model.path is not None:
        from verl.models.pretrained import load_pretrained, resolve_model_path
        return load_pretrained(resolve_model_path(cfg.model.path), cfg.model.dtype)
    corpus = (task_corpus(cfg.data.task) if not cfg.data.train_files
              else [prompt_text(p) + str(a) for p, a in zip(dataset.prompts, dataset.answers)])
    chat = "chatml" if cfg.agent.enabled else "plain"
    if cfg.agent.enabled:  # the conversations' own text (tags, JSON, newlines) gets tokens of its own
        from verl.agents.loop import AgentLoop, demonstration_texts
        draft = AgentLoop(cfg.agent, tiny_tokenizer(corpus, cfg.model.tiny.vocab_size, chat=chat),
                          response_length=cfg.rollout.max_new_tokens)
        corpus = corpus + demonstration_texts(draft, [dataset[i] for i in range(min(len(dataset), 500))],
                                              cfg.trainer.seed)
    tokenizer = tiny_tokenizer(corpus, cfg.model.tiny.vocab_size, chat=chat)
    if placement is not None:  # again with the vocabulary the corpus allowed (at most model.tiny.vocab_size)
        check_memory_fits(cfg, model_shape(cfg, tiny_vocab=len(tokenizer)), placement.world_size,
                          placement.device.type)
    model = tiny_model(cfg.model.tiny, tokenizer=tokenizer, tie_word_embeddings=True, seed=cfg.trainer.seed)
    return model.to(getattr(torch, cfg.model.dtype)), tokenizer  # model.dtype, as a loaded model gets it


def check_moe_layout(cfg: PPOConfig, hf_config) -> None:
    """What a mixture-of-experts model decides about the megatron layout (EP, ETP, SP) and router replay, checked
    before any model is built."""
    from verl.models.config import MOE_MODEL_TYPES, arch_from_hf, parallel_layout
    moe = getattr(hf_config, "model_type", None) in MOE_MODEL_TYPES
    if cfg.actor.router_replay != "off" and not moe:
        raise VerlConfigError(f"actor.router_replay={cfg.actor.router_replay} replays mixture-of-experts routes, but "
                              f"the policy ({getattr(hf_config, 'model_type', '?')}) has no experts; set "
                              f"actor.router_replay=off")
    if not cfg.engine_specs()["actor"].model_parallel:
        return
    m = cfg.actor.megatron
    parallel_layout(arch_from_hf(hf_config), m.tp, ep=m.ep, etp=m.expert_tp)
    if moe and m.tp > 1 and not m.sequence_parallel:
        raise VerlConfigError(f"actor.megatron.tp={m.tp} with a mixture-of-experts policy needs "
                              f"actor.megatron.sequence_parallel=true (megatron-core's MoE layer refuses TP without "
                              f"it)")


def check_generation_layout(cfg: PPOConfig, hf_config) -> None:
    """What the model decides about the generation layout, checked before any step."""
    heads = hf_config.num_attention_heads
    if heads % cfg.rollout.tp:
        raise VerlConfigError(f"rollout.tp={cfg.rollout.tp} does not divide the model's {heads} attention heads; "
                              f"use one of {[d for d in range(1, heads + 1) if heads % d == 0]}")
    limit = length_limit(cfg.rollout.max_model_len, getattr(hf_config, "max_position_embeddings", None))
    need = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if limit is not None and need > limit:
        raise VerlConfigError(f"data.max_prompt_length={cfg.data.max_prompt_length} + rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens} = {need} exceeds the maximum model length {limit} "
                              f"(rollout.max_model_len, else the model's max_position_embeddings); shorten one")


def _state_fields(sampler: BatchSampler, kl_ctrl) -> dict[str, Spec]:
    """The specs of the values every trainer state holds (a checkpoint's, a snapshot's)."""
    return {"step": Int(0, MAX_STEP), "sampler": sampler.state_spec(), "kl_ctrl": kl_ctrl.state_spec(),
            "actor_sched": Opt(SCHEDULER_STATE), "critic_sched": Opt(SCHEDULER_STATE)}


class PPOTrainer:
    """Owns the workers, the data order, the KL controller, metrics and checkpoints of one job."""

    def __init__(self, cfg: PPOConfig, placement: Placement, *, actor_model: torch.nn.Module | None = None,
                 tokenizer=None):
        """`actor_model` (with `tokenizer`): a Hugging Face causal LM object to train instead of `model.*`, e.g.
        one loaded with `device_map=...`, whose `hf_device_map` must agree with the actor's ranks."""
        cfg.engine_specs()["rollout"].require("rollout.engine")  # an engine that cannot run here: said first
        notes = cfg.validate_world(placement.world_size)  # before anything touches the disk
        if placement.is_main:
            for note in notes:
                print(f"verl: {note}", flush=True)
        self.cfg, self.placement = cfg, placement
        self.roles = cfg.roles(placement.world_size)
        if actor_model is not None:
            check_device_map(actor_model, self.roles["actor"], placement)
        self.places = role_placements(placement, self.roles)
        if cfg.trainer.threads > 0:
            torch.set_num_threads(cfg.trainer.threads)
        # before the data is read or generated: what the config alone says a step needs (load_policy checks again
        # with the tiny model's vocabulary once its tokenizer is trained)
        shape = model_shape(cfg) if actor_model is None else hf_shape(actor_model.config.to_dict(), ("actor_model",))
        check_memory_fits(cfg, shape, placement.world_size, placement.device.type)
        self.dataset, self.val_dataset = load_splits(cfg.data, cfg.val, cfg.trainer.seed)
        check_sources(cfg.reward, [self.dataset, self.val_dataset])
        derived = cfg.resolve_run_length(len(self.dataset))
        if derived and placement.is_main:
            print(f"verl: {derived}", flush=True)
        if actor_model is not None:
            if tokenizer is None:
                raise VerlConfigError("PPOTrainer(actor_model=...) needs tokenizer=... (the model's own tokenizer)")
            self.policy, self.tokenizer = actor_model, tokenizer
        else:
            self.policy, self.tokenizer = load_policy(cfg, self.dataset, placement)
        check_generation_layout(cfg, self.policy.config)
        check_moe_layout(cfg, self.policy.config)
        self.agent = None
        if cfg.agent.enabled:  # episodes open with the environment's messages: those are the prompts checked
            from verl.agents.loop import AgentLoop
            self.agent = AgentLoop(cfg.agent, self.tokenizer, response_length=cfg.rollout.max_new_tokens)
        encode = Tokenizer.wrap(self.tokenizer).encode_prompt if self.agent is None else \
            (lambda p: self.agent.prompt_ids({"prompt": p, "answer": ""}))
        self.dataset = fit_prompt_lengths(self.dataset, encode, cfg.data.max_prompt_length, cfg.data.overlong_prompts,
                                          source=", ".join(cfg.data.train_files) or f"task {cfg.data.task}")
        if self.val_dataset is not None:
            self.val_dataset = fit_prompt_lengths(self.val_dataset, encode,
                                                  cfg.data.max_prompt_length, cfg.data.overlong_prompts,
                                                  source=", ".join(cfg.data.val_files) or "the held-out split")
        # the global RNG (whatever the step's seed does not cover): differs between data-parallel replicas and
        # agrees within a model-parallel group; sampling itself is seeded per step and row
        torch.manual_seed(cfg.trainer.seed * 1000 + placement.dp_rank)
        self.sampler = BatchSampler(len(self.dataset), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        if cfg.warmup.steps and cfg.warmup.batch_size > len(self.dataset):
            raise VerlConfigError(f"warmup.batch_size={cfg.warmup.batch_size} examples per warm-start step exceeds the "
                                  f"{len(self.dataset)} rows of the dataset; use at most {len(self.dataset)}")
        self.reward_fn = build_reward(cfg.reward, placement.device, cfg.rollout.max_new_tokens) \
            if self.places["reward"] else None
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
        self.flow = build_ppo_dataflow(cfg, placement.world_size)
        # one_step_off: the generated batches waiting to be trained on, kept between the flow's runs and in
        # checkpoints. async: the flow's queue holds them, and the rollout's ranks run their own stage (their
        # checkpoints keep what the queue holds: `_requeue` is what a resumed rollout puts back first)
        self.lag = cfg.generation_lag
        self.flow_state = self.flow.new_state() if self.lag and not cfg.streaming else None
        self._queue_saved: tuple[int, dict] | None = None  # async, rollout ranks: (batches made, unconsumed ones)
        self._requeue: dict | None = None
        self.produces_only, self.metrics_world = False, placement
        if cfg.streaming:
            self._split_stages()
        self.out_dir = Path(cfg.trainer.output_dir)
        self.folder = RunFolder(self.out_dir, active=placement.is_main)  # what this run owns there
        self.ckpt = CheckpointManager(self.out_dir / "checkpoints", placement, cfg.trainer.keep_checkpoints,
                                      trust=cfg.trainer.trust_checkpoint, folder=self.folder, seed=cfg.trainer.seed,
                                      max_state_bytes=int(cfg.trainer.max_state_mb * 2**20))
        self.trace_stem: str | None = None  # trace_step_N, or trace_step_N-2, ... when that name is taken
        self.watchdog = Watchdog(cfg.trainer.hang_timeout_s, self.out_dir, placement.global_rank, placement.world_size)
        # elastic recovery: per-step snapshots (async: the rollout's ranks label theirs with training steps)
        self.snapshots: Snapshots | None = None
        self.restarted = False
        self.snapshot_s: float | None = None
        self._snapshot_payload: dict | None = None
        self.actor = self.ref = self.critic = self.rollout = None
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.trained_indices: list[int] = []
        self.val_history: list[tuple[int, dict[str, float]]] = []
        self.node_seconds: dict[str, float] = {}

    def _split_stages(self) -> None:
        """async: the rollout's ranks only generate (`_produce`); the training stage's ranks reduce metrics among
        themselves (a collective with the rollout would bring back the lockstep). Collective: every rank makes
        the group."""
        from verl.dataflow.comm import group_for
        gen = next(ranks for nodes, ranks in self.flow.stages if "generate" in nodes)
        train = tuple(r for r in range(self.placement.world_size) if r not in gen)
        group = group_for(train)
        me = self.placement.global_rank
        self.produces_only = me in gen
        if me in train:
            self.metrics_world = self.placement.subset(train, group)

    def on_node_end(self, event) -> None:
        """Dataflow hook: per-node durations of the current step (logged as timing/<node>_s)."""
        self.node_seconds[event.node] = event.duration_s

    def on_transfer(self, name: str, rank: int, start: float, end: float, info: dict) -> None:
        """Dataflow hook: time this rank spent moving batches between rank sets (timing/transfer_s)."""
        self.node_seconds["transfer"] = self.node_seconds.get("transfer", 0.0) + end - start

    # -- workers (built after the warm start: the reference and critic copy the warm-started policy) --------
    @property
    def _needs_init_dir(self) -> bool:
        """Megatron models and vLLM / SGLang load the warm-started policy from a Hugging Face directory."""
        return any(r.spec.needs_model_dir for r in self.roles.values())

    def _init_dir(self) -> Path:
        """The warm-started policy as a Hugging Face directory (.init_hf, replaced at every start of the run)."""
        tmp = f".tmp-init_hf-{self.ckpt.run_id[:8]}"
        def write():
            self.folder.record(tmp, "tree")
            export_hf(self.policy, self.tokenizer, self.out_dir / tmp)
            self.folder.publish(tmp, ".init_hf")
        self._on_main(write)
        return self.out_dir / ".init_hf"

    def _on_main(self, fn) -> None:
        """Runs `fn` on rank 0; its failure is raised on every rank (which wait for it)."""
        failure, problem = None, None
        if self.placement.is_main:
            try:
                fn()
            except Exception as e:
                failure, problem = e, f"{type(e).__name__}: {e}"
        problem = broadcast_json(problem, self.placement)
        if failure is not None:
            raise failure
        if problem is not None:
            raise VerlRuntimeError(f"rank 0 failed: {problem}")

    def _build_workers(self) -> None:
        """Each role's worker on its own ranks (None elsewhere), engines built in the same order everywhere."""
        cfg, roles, places = self.cfg, self.roles, self.places
        init_dir = self._init_dir() if self._needs_init_dir else None
        kw = dict(temperature=cfg.rollout.temperature, max_response_length=cfg.rollout.max_new_tokens)
        actor_cfg = cfg.actor
        if cfg.rollout.decoder == "train":  # the samples' log-probs come from the padded training forward
            actor_cfg = dataclasses.replace(actor_cfg, padding_free=False)
        limit = cfg.trainer.max_nonfinite_steps
        generation_model = self._apply_lora()
        if places["actor"] is not None:
            kw["responses_per_mini"] = cfg.actor.mini_batch_size // places["actor"].dp_size * cfg.rollout.n
            self.actor = ActorWorker(self._engine("actor", init_dir), actor_cfg,
                                     rollout_correction=cfg.algorithm.rollout_correction, max_nonfinite_steps=limit,
                                     **kw)
        if cfg.needs_ref and places["ref"] is not None:
            kw["responses_per_mini"] = cfg.actor.mini_batch_size // places["ref"].dp_size * cfg.rollout.n
            # with LoRA the reference is the actor's base model, adapters off: no second copy of the weights
            ref = BaseModelView(self.actor.engine) if cfg.actor.lora.enabled else self._engine("ref", init_dir)
            self.ref = ActorWorker(ref, actor_cfg, **kw)
        if cfg.needs_critic and places["critic"] is not None:
            mini = cfg.critic.mini_batch_size // places["critic"].dp_size * cfg.rollout.n
            self.critic = CriticWorker(self._engine("critic", init_dir), cfg.critic, max_nonfinite_steps=limit,
                                       responses_per_mini=mini)
        if places["rollout"] is not None:
            rollout_cfg = cfg.rollout
            if rollout_cfg.decoder == "train":  # decode in the actor's micro-batches: the shapes its forward sees
                rollout_cfg = dataclasses.replace(rollout_cfg, max_batch_size=cfg.actor.micro_batch_size)
            engine = build_rollout(rollout_cfg, model=generation_model, model_path=str(init_dir) if init_dir else None,
                                   tokenizer=self.tokenizer)
            self.rollout = RolloutWorker(engine, cfg.rollout, max_prompt_length=cfg.data.max_prompt_length,
                                         placement=places["rollout"], agent=self.agent)
        if roles["rollout"].ranks != roles["actor"].ranks:
            self._link_rollout()

    def _apply_lora(self) -> torch.nn.Module:
        """actor.lora: adapters into the policy (the same initial ones on every rank); returns the model a torch /
        hf rollout generates with: the policy itself (adapter sync, or no LoRA), or for a merged sync a plain copy
        that receives base + scale * B A."""
        lora = self.cfg.actor.lora
        if not lora.enabled:
            return self.policy
        from verl.models.lora import apply_lora
        plain = None
        if lora.sync == "merged" and self.places["rollout"] is not None \
                and not self.roles["rollout"].spec.needs_model_dir:
            plain = copy.deepcopy(self.policy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.trainer.seed)
            apply_lora(self.policy, lora)
        return self.policy if plain is None else plain

    def _lora_base(self, resumed: bool) -> None:
        """LoRA checkpoints hold the adapter only, so a warmed-up base is kept as output_dir/lora_base (a Hugging
        Face directory written once, after the warm start) and a resumed run loads it instead of warming up."""
        base = self.out_dir / "lora_base"
        if not resumed:
            if self.placement.is_main:
                export_hf(self.policy, self.tokenizer, base)
            barrier(self.placement)
            return
        if not (base / "config.json").is_file():
            raise VerlConfigError(f"resuming a LoRA run that warmed its base up (warmup.steps="
                                  f"{self.cfg.warmup.steps}) needs that base, {base}, which is missing; start afresh "
                                  f"(trainer.overwrite=true) or restore the directory")
        from transformers import AutoModelForCausalLM
        warmed = AutoModelForCausalLM.from_pretrained(str(base), dtype=next(self.policy.parameters()).dtype)
        self.policy.load_state_dict(warmed.state_dict())

    def memory_report(self) -> dict[str, float]:
        """perf/actor_ref_memory_mb (the distinct weights the actor and reference hold on this rank, the reference's
        shared base counted once) beside perf/model_memory_mb (one copy of the policy), and the actor's optimizer
        state (perf/actor_optim_memory_mb)."""
        from verl.models.lora import unique_bytes
        if self.actor is None or not isinstance(self.actor.engine, ModuleEngine):
            return {}
        modules = [self.actor.engine.module]
        if self.ref is not None and isinstance(self.ref.engine, ModuleEngine):
            modules.append(self.ref.engine.module)
        model = sum(p.numel() * p.element_size() for n, p in self.policy.named_parameters() if ".lora_" not in n)
        optim = self.actor.engine.optimizer
        state = 0 if optim is None else sum(t.numel() * t.element_size() for st in optim.state.values()
                                            for t in st.values() if isinstance(t, torch.Tensor))
        mb = float(1 << 20)
        return {"perf/actor_ref_memory_mb": unique_bytes(*modules) / mb, "perf/model_memory_mb": model / mb,
                "perf/actor_optim_memory_mb": state / mb}

    def _link_rollout(self) -> None:
        """A rollout on its own ranks: the actor's ranks send it the weights over a group of both sets (created on
        every rank, as process groups are; the dataflow's weight-sync node gets the same one)."""
        from verl.dataflow.comm import group_for
        from verl.distributed.placement import new_group
        actor, rollout = self.roles["actor"].ranks, self.roles["rollout"].ranks
        both = tuple(sorted(actor + rollout))
        # async: the stream's threads need a group no main-thread collective ever uses (group_for may be WORLD)
        link = WeightLink(new_group(list(both)) if self.cfg.streaming else group_for(both), actor, rollout)
        if self.actor is not None:
            self.actor.weight_link = link
        if self.rollout is not None:
            self.rollout.link = link

    def _engine(self, role: str, init_dir: Path | None):
        """The training engine of `role` (actor, ref or critic) on this rank: the class the engine table names."""
        req = EngineRequest(role=role, policy=self.policy, init_dir=init_dir, placement=self.places[role],
                            cfg=self.cfg, cpu_offload=self.roles[role].cpu_offload)
        return self.roles[role].spec.load().from_role(req)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def _checkpointed(self) -> tuple[dict, dict]:
        """(torch modules and optimizers — whole, or FSDP2's sharded DTensors — and megatron engines with their
        own per-rank layout): all go to one DCP checkpoint."""
        modules, sharded = {}, {}
        for name, w in {"actor": self.actor, "ref": self.ref, "critic": self.critic}.items():
            if w is None or getattr(w.engine, "view_of", None) is not None:  # a LoRA reference holds nothing
                continue
            if isinstance(w.engine, ModuleEngine):
                modules[name] = (w.engine.module, w.engine.optimizer)
            else:
                sharded[name] = w.engine
        return modules, sharded

    @staticmethod
    def _sched_state(worker) -> dict | None:
        s = getattr(getattr(worker, "engine", None), "scheduler", None)
        return s.state_dict() if s is not None else None

    def _trainer_state(self) -> dict:
        """Collective: rank 0 writes it, but a split critic's schedule lives on the critic's ranks."""
        own = self._own_state()
        scheds = {k: own[k] for k in ("actor_sched", "critic_sched")}
        # the batches generated but not yet trained on live on the rollout's ranks: each rank's share is stored
        carried = own["flow_state"]
        flow_states = [carried]
        if self.placement.distributed:
            everyone: list = [None] * self.placement.world_size
            dist.all_gather_object(everyone, (scheds, carried))
            scheds = {k: next((e[0][k] for e in everyone if e[0][k] is not None), None) for k in scheds}
            flow_states = [e[1] for e in everyone]
        return {**own, **scheds, "config": to_dict(self.cfg), "flow_state": flow_states}

    def _state_spec(self) -> Spec:
        """What a restored trainer state must hold, value by value (checked before anything is restored)."""
        return Dict({**_state_fields(self.sampler, self.kl_ctrl), "config": Json(), "generation_lag": Int(0, 1 << 20),
                     "flow_state": List(Opt(FLOW_STATE), max_len=1 << 20)},
                    optional=("generation_lag", "flow_state"))

    def _restore(self, path: Path) -> None:
        state = self.ckpt.load(path, *self._checkpointed(), state_spec=self._state_spec())
        self._apply_trainer_state(state)
        self._restore_carried(state)

    def _apply_trainer_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        for worker, key in ((self.actor, "actor_sched"), (self.critic, "critic_sched")):
            if worker is not None and state[key] is not None:
                worker.engine.scheduler.load_state_dict(state[key])

    def _restore_carried(self, state: dict) -> None:
        """The batches in flight at the save come back, so a one_step_off / async run resumes exactly (async: the
        rollout's ranks put the queue's batches back first, `_produce`). Resumed in another mode (another
        generation lag, or lockstep against streaming) or world size, they are dropped: their prompts count as
        used, and the new mode's prologue generates afresh with the restored weights."""
        saved_lag, saved_world = int(state.get("generation_lag", 0)), self.ckpt.saved_world_size
        saved_mode = (state.get("config") or {}).get("trainer", {}).get("mode", "sync")
        resharded = saved_world != self.placement.world_size
        if saved_lag != self.lag or resharded or (saved_mode == "async") != self.cfg.streaming:
            if saved_lag and self.placement.is_main:
                why = (f"saved by {saved_world} processes, resumed by {self.placement.world_size}" if resharded
                       else f"saved with generation lag {saved_lag}, resumed with {self.lag}" if saved_lag != self.lag
                       else f"saved in trainer.mode={saved_mode}, resumed in {self.cfg.trainer.mode}")
                print(f"verl: dropping the batch(es) generated ahead before the checkpoint ({why}); their prompts "
                      f"count as used", flush=True)
            return
        carried, rank = state.get("flow_state") or [], self.placement.global_rank
        mine = carried[rank] if rank < len(carried) else None
        if self.cfg.streaming:
            if self.produces_only and mine is not None:  # the rollout's ranks queue them again (`_produce`)
                self._requeue = decode_state(mine)
        elif self.flow_state is not None and mine is not None:
            self.flow_state.load_state_dict(decode_state(mine))

    def save(self, step: int | None = None) -> Path:
        """Collective over every rank (`step`: the training step saved, when a streaming rollout joins)."""
        step = self.step if step is None else step
        with self.watchdog.phase(f"the checkpoint save of step {step}"):
            return self.ckpt.save(step, *self._checkpointed(), self._trainer_state())

    # -- recovery snapshots (verl.utils.snapshot) ----------------------------------------------------------------
    @property
    def _snapshots_on(self) -> bool:
        """trainer.recovery takes per-step snapshots."""
        return recovery_enabled(self.cfg.trainer.recovery)

    def _snapshot_store(self, run_id: str) -> Snapshots:
        """This rank's store. async: the actor's ranks keep `lag + 1` snapshots (the trainer runs up to that many
        steps past the rollout's newest label); the rollout's ranks label each batch's snapshot with up to
        `lag + 2` steps (`_snapshot_produced`) and keep one more, their snapshots holding no weights."""
        t, disk = self.cfg.trainer, self.out_dir / SNAPSHOTS
        shm = DEFAULT_ROOT.parent.is_dir() and os.access(DEFAULT_ROOT.parent, os.W_OK)
        root = Path(t.snapshot_dir) if t.snapshot_dir else DEFAULT_ROOT if shm else disk
        keep = max(2, min(MAX_KEEP, self.lag + (3 if self.produces_only else 1))) if self.cfg.streaming else 2
        return Snapshots(root, disk, run_id, self.placement.global_rank, self.placement.world_size,
                         config_digest(to_dict(self.cfg)), keep=keep)

    def _own_state(self) -> dict:
        """This rank's part of the trainer state: a snapshot is per rank, taken without a collective."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "actor_sched": self._sched_state(self.actor), "critic_sched": self._sched_state(self.critic),
                "generation_lag": self.lag, "flow_state": self._carried_state()}

    def _carried_state(self) -> dict | None:
        """The batches generated ahead that this rank holds: one_step_off's run state, or in async on the
        rollout's ranks their shares of the values still in the queue (in the flow state's format)."""
        if self.flow_state is not None:
            return encode_state(self.flow_state.state_dict())
        if self._queue_saved is not None:
            runs, values = self._queue_saved
            return encode_state({"runs": runs, "carried": values})
        return None

    def _own_state_spec(self) -> Spec:
        return Dict({**_state_fields(self.sampler, self.kl_ctrl), "generation_lag": Int(self.lag, self.lag),
                     "flow_state": Opt(FLOW_STATE)})

    def _snapshot(self) -> None:
        """This rank's state after the step, handed to the snapshot writer (the copy is the only cost here)."""
        modules, sharded = self._checkpointed()
        with self.watchdog.phase(f"the snapshot of step {self.step}"):
            self.snapshot_s = self.snapshots.save(self.step, checkpoint_tensors(modules, sharded, for_load=False),
                                                  self._own_state(), rng_state())

    def _snapshot_produced(self, made: int, steps: range, drawn: dict[int, dict]) -> float:
        """async, on the rollout's ranks, once `made` batches are generated: a snapshot for each training step k
        of `steps`, the state a run restored at step k needs here (what the checkpoint of step k holds: the
        sampler as it was before batch k was drawn, the batches k .. made - 1 the queue holds). Each k is one
        the actor's ranks may be restored at with this rollout state: the next batch, `made`, is generated with
        version `made - lag`, which is k or the next one the actor publishes (`drawn`: position -> sampler
        state before drawing it). Returns the seconds it took from generation (perf/snapshot_rollout_s)."""
        t0, own, rng = time.perf_counter(), self._own_state(), rng_state()
        tensors = checkpoint_tensors(*self._checkpointed(), for_load=False)  # the same for every label
        with self.watchdog.phase(f"the rollout's snapshots of steps {steps.start}..{steps.stop - 1}"):
            for k in steps:
                carried = encode_state({"runs": made, "carried": self.flow.queued_values(made - k)})
                self.snapshots.save(k, tensors, {**own, "step": k, "sampler": drawn[k], "flow_state": carried}, rng)
        return time.perf_counter() - t0

    def _recoverable_snapshot(self) -> int | None:
        """Collective, in a worker group torchrun restarted: the newest step of the folder's run that every rank
        holds a snapshot of and can read (its payload kept for `_restore_snapshot`); None: there is none."""
        run = None
        if self.placement.is_main:
            manifest = self.folder.read()
            run = manifest["run_id"] if manifest is not None else None
        run = broadcast_json(run, self.placement)
        if run is None:
            return None
        store = self._snapshot_store(run)
        if self.placement.is_main:
            for why in store.others():
                print(f"verl: this run's snapshots taken with {why} are not used (a snapshot is restored only by the "
                      f"config and world size that took it); the newest checkpoint is, resharded where it must be",
                      flush=True)
        for step in store.common_steps(self.placement.distributed):
            payload, problem = None, None
            try:
                payload = store.load(step)
                validate(payload["trainer"], self._own_state_spec())
            except Exception as e:  # an unreadable snapshot: the next older one, else the newest checkpoint
                problem = f"{type(e).__name__}: {e}"
                print(f"verl: warning: rank {self.placement.global_rank} cannot restore its snapshot of step {step} "
                      f"({problem})", flush=True)
            if all_ok(problem is None, self.placement):
                self._snapshot_payload = payload
                return step
        return None

    def _restore_snapshot(self, step: int) -> None:
        payload, self._snapshot_payload = self._snapshot_payload, None
        modules, sharded = self._checkpointed()
        tensors = fill(checkpoint_tensors(modules, sharded, for_load=True), payload["tensors"])
        apply_state(tensors, modules, sharded, f"the snapshot of step {step}")
        set_rng_state(payload["rng"])
        state = payload["trainer"]
        self._apply_trainer_state(state)
        if state["flow_state"] is None:
            return
        if self.cfg.streaming:  # the rollout's ranks queue the batches again first (`_produce`)
            self._requeue = decode_state(state["flow_state"])
        elif self.flow_state is not None:
            self.flow_state.load_state_dict(decode_state(state["flow_state"]))

    def _check_same_config(self) -> None:
        """Collective: every rank loaded the same config (two nodes' agents launched with different files or
        overrides would otherwise train one job under two configs)."""
        if not self.placement.distributed:
            return
        from verl.distributed.placement import comm_device
        mine = torch.tensor([int(config_digest(to_dict(self.cfg)), 16)], dtype=torch.int64, device=comm_device())
        everyone = [torch.empty_like(mine) for _ in range(self.placement.world_size)]
        dist.all_gather(everyone, mine)
        differ = [r for r, d in enumerate(everyone) if int(d) != int(everyone[0])]
        if differ:
            raise VerlConfigError(f"ranks {differ} loaded another config than rank 0 (a different YAML file or other "
                                  f"overrides on their node's launch command); launch every node with the same ones")

    def setup(self) -> dict[str, float]:
        """Warm start (fresh runs) or checkpoint restore (resumed runs); returns warm-up and first-sync metrics."""
        check_output_dir(self.cfg.trainer.output_dir)  # again: links may have changed since the config was loaded
        self._check_same_config()
        t, t0 = self.cfg.trainer, time.time()
        resume, snapshot, restarts = t.resume, None, torchrun_restarts()
        self.restarted = bool(restarts[0]) and t.recovery != "off"
        if self.restarted:  # torchrun restarted the workers: they continue the folder's run
            resume = "auto"
            if self._snapshots_on:
                snapshot = self._recoverable_snapshot()
        resume = self.ckpt.resolve(resume, overwrite=t.overwrite, destinations=self._destinations(),
                                   snapshot_step=snapshot)
        if self._snapshots_on:
            self.snapshots = self._snapshot_store(self.ckpt.run_id)
            self._on_main(lambda: self.folder.record(SNAPSHOTS, "tree"))
            if not self.restarted:  # snapshots an earlier session of this folder left (it ended in an error)
                prior = self.ckpt._prior_run if self.placement.is_main else None
                stale = broadcast_json(sorted({r for r in (prior, self.ckpt.run_id) if r}), self.placement)
                self.snapshots.clear_stale(stale)
        resumed = resume is not None or self.ckpt.from_snapshot is not None
        if restarts[0] and self.placement.is_main:
            where = (f"the snapshot of step {self.ckpt.from_snapshot}" if self.ckpt.from_snapshot is not None
                     else str(resume) if resume is not None else "the start (nothing saved yet)")
            how = " (the worker started in its rank's warm spare)" if started_by_spare() else ""
            print(f"verl: torchrun restart {restarts[0]} of at most {restarts[1]}: continuing from {where}{how}",
                  flush=True)
        info: dict[str, float] = {}
        if not resumed and self.cfg.warmup.steps > 0:
            # every rank warms the same policy up, data parallel over the whole world (whatever the roles)
            world = self.placement
            if world.distributed:
                world = world.subset(tuple(range(world.world_size)), dist.group.WORLD)
            info = supervised_warmup(self.policy, self.tokenizer, self.dataset, self.cfg.warmup, world,
                                     self.cfg.trainer.seed, agent=self.agent)
        if self.cfg.actor.lora.enabled and self.cfg.warmup.steps > 0:
            self._lora_base(resumed)
        self._build_workers()
        if resume is not None:
            self._restore(resume)
        elif self.ckpt.from_snapshot is not None:
            self._restore_snapshot(self.ckpt.from_snapshot)
        if resumed:
            info["resumed_from_step"] = self.step
        self._on_main(self._claim_hang_reports)
        self.trace_stem = self._claim_trace()
        if self.rollout is not None or self.actor is not None:  # both sides of a rollout on its own ranks
            sync_rollout_weights(self.actor, self.rollout)
        info.update(self.memory_report())
        if self.cfg.streaming:  # from here on new versions flow in the background
            self._start_stream()
        if self.restarted:  # when this process started, set up, and was ready (bench_faults: recovery time split)
            info.update({"recovery/restart": float(restarts[0]), "recovery/setup_start_time": t0,
                         "recovery/ready_time": time.time()})
            started = process_start_time()
            if started is not None:
                info["recovery/process_start_time"] = started
        return info

    def _destinations(self) -> list[tuple[str, bool]]:
        """What this run writes under output_dir besides checkpoints: (path, replaced as a whole?)."""
        t = self.cfg.trainer
        out = [("metrics.jsonl", False), ("samples.jsonl", False)]
        if self.cfg.val.log_generations:
            out.append(("val_generations.jsonl", False))
        if t.plot:
            out.append(("curves.png", False))
        if t.export_hf:
            out += [(name, True) for name in self._exports()]
        if self._needs_init_dir:
            out.append((".init_hf", True))
        if self._snapshots_on:
            out.append((SNAPSHOTS, True))
        return out + [(rel, False) for rel in self._hang_reports()]

    def _hang_reports(self) -> list[str]:
        """The hang watchdog's files (each rank's stacks, the first expired rank's line), written by any rank."""
        return [rank_file(r) for r in range(self.placement.world_size)] + [STUCK_FILE]

    def _claim_hang_reports(self) -> None:
        """Rank 0 records hang/ and its files before any rank may write them, and clears an earlier session's
        stuck.txt (the other ranks' cue to write their stacks); every rank starts its watchdog after this."""
        rels = self._hang_reports()
        self.folder.record_all({"hang": "dir", **{rel: "file" for rel in rels},
                                **{f"hang/.{Path(rel).name}.tmp": "file" for rel in rels[:-1]}})
        (self.out_dir / STUCK_FILE).unlink(missing_ok=True)

    def _claim_trace(self) -> str | None:
        """The trace's file stem, recorded by rank 0 and the same on every rank: a free name, never an existing
        trace (a resumed run that traces the same step again writes trace_step_N-2.json beside the first)."""
        step = self.cfg.trainer.trace_step
        if not step or step <= self.step:  # no trace, or its step was run before the resumed checkpoint
            return None
        stem = None
        if self.placement.is_main:
            stem = self.folder.free_stem(f"trace_step_{step}", (".json", "_rollout.json"))
            self.folder.record(f"{stem}.json", "file")
            if self.cfg.streaming:
                self.folder.record(f"{stem}_rollout.json", "file")
            if self.cfg.agent.enabled:  # each rank's turns and tool calls, merged into the trace at the end
                for r in range(self.placement.world_size):
                    self.folder.record(f"{stem}_agent_{r}.json", "file")
        return broadcast_json(stem, self.placement)

    def _open_logger(self) -> MetricsLogger:
        """metrics.jsonl and TensorBoard, recorded as this run's (an unrecorded metrics.jsonl of a resumed run
        is appended to, never recorded)."""
        cfg, main = self.cfg.trainer, self.placement.is_main
        tb = self.out_dir / "tensorboard"
        before: set[str] = set()
        if main:
            for log in ("metrics.jsonl", "samples.jsonl", "val_generations.jsonl"):  # appended to, never rewritten
                if not self.folder.foreign(log) and (log != "val_generations.jsonl" or self.cfg.val.log_generations):
                    self.folder.record(log, "file")
            if cfg.tensorboard:
                if not os.path.lexists(tb):
                    self.folder.record("tensorboard", "dir")
                before = set(os.listdir(tb)) if tb.is_dir() else set()
        logger = MetricsLogger(self.out_dir, enabled=main, tensorboard=cfg.tensorboard, start_step=self.step)
        self.samples_log = MetricsLogger(self.out_dir, enabled=main, tensorboard=False, start_step=self.step,
                                         filename="samples.jsonl")
        if main and cfg.tensorboard:
            for name in sorted(set(os.listdir(tb)) - before):  # the event file SummaryWriter just created
                self.folder.record(f"tensorboard/{name}", "file")
        return logger

    def _start_stream(self) -> None:
        link = (self.actor.weight_link if self.actor is not None else
                self.rollout.link if self.rollout is not None else None)
        if link is None:
            return
        if self.actor is not None:
            self.actor.weight_stream = WeightStream(link, self.actor, None, self.step)
        if self.rollout is not None:
            stream = self.rollout.stream = WeightStream(link, None, self.rollout, self.step,
                                                        pinned=self.cfg.trainer.async_versions == "pinned")
            if self.cfg.rollout.partial:  # new weights between tokens: the torch engine rebuilds its KV cache
                self.rollout.engine.pause_hook = (self._pinned_switch if stream.pinned else
                                                  lambda: stream.take(self.rollout))

    def _pinned_switch(self) -> int:
        """The pause hook of partial rollouts under pinned versions, called before each decode step: batch b
        (`self._batch` = {batch: b, steps: steps so far, stats: its gen stats}, set per batch by `_run_flow`)
        takes version b - lag + 1 from its rollout.partial_switch_token-th step on (0: half of max_new_tokens),
        waiting for it when needed (the wait adds to the batch's rollout/weight_wait_s)."""
        now, rollout, stream = self._batch, self.cfg.rollout, self.rollout.stream
        now["steps"] += 1
        target = now["batch"] - self.lag + 1
        switch = rollout.partial_switch_token or max(1, rollout.max_new_tokens // 2)
        if stream.version < target and now["steps"] > switch:
            self.watchdog.beat(f"in node 'generate', waiting for weights version {target} at token {switch} of "
                               f"batch {now['batch'] + 1} (rollout.partial_switch_token)", inside=True)
            waited = stream.wait_for(self.rollout, target, self.cfg.trainer.collective_timeout_s, exact=True)
            now["stats"]["rollout/weight_wait_s"] += waited
        return stream.version

    # -- one step -------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step of the actor. Under one_step_off / async the first call also runs the prologue:
        `lag` runs that only generate (the training nodes wait for a batch from an earlier run)."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        while self.flow_state is not None and self.flow_state.runs < self.lag:
            self._run_flow(trace=None)
        trace = None
        if self.cfg.trainer.trace_step == self.step + 1:
            trace = str(self.out_dir / f"{self.trace_stem}.json")
        self.node_seconds.clear()
        out = self._run_flow(trace)
        m = self._metrics(out, time.perf_counter() - t0)
        # this process's CPU seconds (all its threads): on a machine shared with other jobs, the step's own cost
        m["perf/cpu_time_s"] = time.process_time() - cpu0
        return m

    def _run_flow(self, trace: str | None) -> dict:
        """One run of the dataflow: generates the next batch and (past the prologue) trains on the batch
        generated `lag` runs ago (this run's in sync mode)."""
        generated = self.flow_state.runs if self.flow_state is not None else self.step  # batches generated so far
        return self._run(trace, generated, self.step, {})

    def _run(self, trace: str | None, generated: int, version: int, gen_stats: dict) -> dict:
        # the batch's prompts, the same on every rank, each with its row index (samples.jsonl)
        rows = [{**self.dataset[i], "index": i} for i in self.sampler.next_batch()]
        # a pure function of the batch's index (and the row, inside the rollout worker): a resumed run samples
        # exactly what the uninterrupted one did, whatever the generation layout or mode
        seed = self.cfg.rollout.seed + generated * len(rows) * self.cfg.rollout.n
        # in lockstep the rollout holds the weights of the last sync: after `step` updates
        inputs = {"prompts": rows, "seed": seed, "step": self.step, "rollout_version": version,
                  "gen_stats": gen_stats, "rollout": self.rollout, "reward_fn": self.reward_fn,
                  "actor": self.actor, "ref": self.ref, "critic": self.critic, "kl_ctrl": self.kl_ctrl,
                  "algo_cfg": self.cfg.algorithm}
        agent = getattr(self.rollout, "agent", None) if trace is not None else None
        if agent is not None:
            agent.record_spans, agent.spans = True, []
        try:
            return self.flow.run(inputs, hooks=[self, self.watchdog], trace=trace, state=self.flow_state)
        finally:
            if agent is not None:
                agent.record_spans = False
                rank = self.placement.global_rank
                write_trace(str(self.out_dir / f"{self.trace_stem}_agent_{rank}.json"),
                            [agent.trace_events(rank)], {"agent": "tool calls and turns"}, ranks=[rank])

    def _produce(self) -> None:
        """async, on the rollout's ranks: generate every remaining batch into the flow's queue, each with the
        newest weights received, waiting for a newer version only when batch b would otherwise be trained more
        than `lag` versions after the one that generated it (batch b trains at step b, on version b). Joins each
        checkpoint once it has made the batches the queue can hold by then (so nobody waits on the other)."""
        cfg, stream, lag = self.cfg, self.rollout.stream, self.lag
        timeout = cfg.trainer.collective_timeout_s
        every, total = cfg.trainer.save_every, cfg.trainer.total_steps
        saves = [k for k in range(self.step + 1, total + 1)
                 if (every and k % every == 0) or (k == total and cfg.trainer.save_final)]
        start = self.step
        drawn = {start: self.sampler.state_dict()}  # batch b -> the sampler before it drew b (snapshots)
        if self._requeue is not None:  # a resumed run: the checkpoint's queued batches go first, as they were
            keep = max(0, total - self.step)  # (up to the last step: a run resumed with fewer steps trains fewer)
            carried = {k: v[:keep] for k, v in self._requeue["carried"].items()}
            start = self.step + max((len(v) for v in carried.values()), default=0)
            self.flow.requeue(carried)
            for b in range(self.step, start):  # their prompts were drawn before the save
                self.sampler.next_batch()
                drawn[b + 1] = self.sampler.state_dict()
            self._requeue = None
        pinned = cfg.trainer.async_versions == "pinned"
        # checkpoint k is joined after batch k + lag, or with a scheduled partial switch before batch k + lag (it
        # takes version k + 1 mid-way, which the actor makes only after that checkpoint)
        join = lag - 1 if pinned and cfg.rollout.partial else lag
        idle = snap_s = None
        for b in range(start, total):
            t0 = time.perf_counter()
            self.watchdog.step = b + 1
            with self.watchdog.phase(f"waiting for weights version {b - lag} (batch {b + 1})"):
                waited = stream.wait_for(self.rollout, b - lag, timeout, exact=pinned)
            stats = {"rollout/weight_wait_s": waited, "rollout/lead": float(b - stream.version)}
            if idle is not None:  # the previous batch's cycle: this one's ends only after the batch has left
                stats["perf/idle_share_rollout"] = idle
            if snap_s is not None:  # and the previous batch's snapshots
                stats["perf/snapshot_rollout_s"] = snap_s
            trace = None
            if self.trace_stem and b == min(cfg.trainer.trace_step - 1 + lag, total - 1):  # about then
                trace = str(self.out_dir / f"{self.trace_stem}_rollout.json")
            self.node_seconds.clear()
            self._batch = {"batch": b, "steps": 0, "stats": stats}  # for _pinned_switch
            self._run(trace, b, stream.version, stats)
            drawn[b + 1] = self.sampler.state_dict()
            cycle = time.perf_counter() - t0
            idle = max(0.0, 1.0 - self.node_seconds.get("generate", 0.0) / cycle)
            while saves and min(saves[0] + join, total - 1) <= b:
                self._save_produced(saves.pop(0), b + 1)
            if self.snapshots is not None:  # steps b - lag and b - lag + 1 (the last batch: every step left)
                first = max(b - lag, self.step, 1)
                snap_s = self._snapshot_produced(b + 1, range(first, total + 1 if b == total - 1 else b - lag + 2),
                                                 drawn)
                for old in [k for k in drawn if k < first]:
                    del drawn[old]
        self.flow.flush(timeout)
        for k in saves:
            self._save_produced(k, total)
        stream.close(self.rollout, timeout)

    def _save_produced(self, step: int, made: int) -> None:
        """async, on the rollout's ranks: joins the checkpoint of training step `step` once `made` batches are
        generated; the ones training has not taken yet (batches step .. made - 1) go into it."""
        self._queue_saved = (made, self.flow.queued_values(made - step))
        try:
            self.save(step)
        finally:
            self._queue_saved = None

    def _metrics(self, out: dict, elapsed: float) -> dict[str, float]:
        """The step's metrics, the same on every rank: each rank reports what its roles computed (the actor's
        ranks the batch, rewards and update; a split critic's ranks the critic's), then one reduction."""
        m: dict[str, float] = {}
        batch = None
        if self.actor is not None:
            batch = out["batch"] if self.flow_state is None else self.flow_state.lagged("batch", self.lag)
            gen = out.get("generation_metrics")
            scores, mask = out["scores"], batch.response_mask
            m = {"reward/mean": float(scores.mean()), "reward/max": float(scores.max()),
                 "reward/min": float(scores.min()), "response/length": float(mask.sum(-1).mean()),
                 "response/clip_ratio": float((batch.attention_mask[:, -1] > 0).float().mean()),
                 "advantage/mean": float((out["advantages"] * mask).sum() / mask.sum().clamp(min=1)),
                 **out.get("kl_metrics", {}), **(out.get("mismatch_metrics") or {}),
                 **out.get("actor_metrics", {}), **out["sync_metrics"],
                 "perf/tokens": float(batch.num_tokens()), "perf/response_tokens": float(mask.sum())}
            if "actor/kl" not in m and "actor/ppo_kl" in m:
                m["actor/kl"] = m["actor/ppo_kl"]
            m.update(gen or {})  # the engine's own (torch: padded share), and in async the rollout's waits
        elif self.rollout is not None:  # a rollout on its own ranks reports what it received
            m.update(out["sync_metrics"])
        if self.critic is not None:
            m.update(out.get("critic_metrics") or {})
        if self.reward_fn is not None:  # one source's own mean / std repeat reward/mean: only its extras
            one = self.reward_fn.sources[0].label if len(self.reward_fn.sources) == 1 else None
            m.update({k: v for k, v in (out.get("reward_metrics") or {}).items()
                      if k not in (f"reward/{one}/mean", f"reward/{one}/std")})
        if self.actor is not None and batch.weight_version is not None:
            stale = (self.step - batch.weight_version).float()
            m.update({"rollout/staleness_mean": float(stale.mean()), "rollout/staleness_max": float(stale.max())})
            if batch.token_version is not None:  # partial rollouts: the versions of the tokens themselves
                real = batch.response_mask > 0
                tokens = (self.step - batch.token_version)[real].float()
                m["rollout/token_staleness_mean"] = float(tokens.mean()) if tokens.numel() else 0.0
                # responses whose tokens came from more than one weight version (a switch mid-generation)
                newest = torch.where(real, batch.token_version, -1).max(-1).values
                m["rollout/mixed_version_share"] = float((newest > batch.weight_version).float().mean())
        m.update({f"timing/{name}_s": seconds for name, seconds in self.node_seconds.items()})
        m.update(self._idle_shares(elapsed))
        m["perf/peak_memory_mb"] = peak_memory_mb()  # the largest process's
        if self.snapshot_s is not None:  # the previous step's snapshot, taken between the steps (the slowest rank)
            m["perf/snapshot_s"] = self.snapshot_s
        m = reduce_metrics(m, self.metrics_world, maxed=MAXED, mined=("reward/min",))
        # the dataset rows this step trained on, from every rank's share (model-parallel peers repeat theirs)
        self.trained_indices = sorted(set(gather_lists(batch.data_indices if batch is not None else [],
                                                       self.metrics_world)))
        # model-parallel peers hold the same tokens: count each actor replica once
        dp = self.cfg.data_parallel_size(len(self.roles["actor"].ranks))
        m["perf/step_time_s"] = elapsed
        m["perf/wall_time"] = time.time()  # when the step ended (aligns runs that share a machine)
        m["perf/tokens_per_s"] = m.pop("perf/tokens") * dp / elapsed
        m["perf/response_tokens_per_s"] = m.pop("perf/response_tokens") * dp / elapsed
        return m

    def _idle_shares(self, elapsed: float) -> dict[str, float]:
        """perf/idle_share_<role> for the rollout's and the actor's ranks: the share of the step this rank spent
        outside its nodes (waiting for data, or inside sync_weights for the other side to arrive)."""
        busy = sum(v for k, v in self.node_seconds.items() if k not in ("transfer", "sync_weights"))
        rank = self.placement.global_rank
        return {f"perf/idle_share_{role}": max(0.0, 1.0 - busy / elapsed) for role in ("rollout", "actor")
                if rank in self.roles[role].ranks and (role == "actor" or rank not in self.roles["actor"].ranks)}

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Setup, then the steps (watched for hangs: `verl.utils.watchdog`), validations, saves and the export."""
        info = self.setup()
        with self.watchdog:
            history = self._fit(info)
        if self.snapshots is not None:  # the run ended: what it would recover from is in its checkpoints
            self.snapshots.clear()
        return history

    def _fit(self, info: dict[str, float]) -> list[dict[str, float]]:
        cfg, p = self.cfg, self.placement
        if self.produces_only:  # async: the rollout's ranks run their own stage
            self._produce()
            self._finish()
            return self.history
        logger = self._open_logger()
        bar = None
        if p.is_main and cfg.trainer.progress_bar:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.trainer.total_steps, initial=self.step, desc=f"{cfg.algorithm.adv_estimator}",
                       dynamic_ncols=True)
        validator, shown = self._validator(), {}
        # a run torchrun restarted continues its validation series as if uninterrupted
        before = cfg.trainer.val_before_train and not self.restarted
        if validator is not None and (before or cfg.trainer.val_only):
            info.update(self._validate(validator))
        if info:
            logged = {k: v for k, v in info.items() if k != "resumed_from_step"}  # the logger's resume marker
            if logged:
                logger.log(self.step, logged)
            if p.is_main:
                print("  ".join(f"{k}={v:.4g}" for k, v in info.items()), flush=True)
        try:
            while self.step < cfg.trainer.total_steps and not cfg.trainer.val_only:
                self.watchdog.step = self.step + 1
                self.watchdog.beat(f"step {self.step + 1}, before its dataflow run")
                metrics = self.train_step()
                self.step += 1
                if validator is not None and validation_due(cfg, self.step):
                    metrics.update(self._validate(validator))
                    shown = {k: metrics[k] for k in ("val/pass@1",)}
                self.history.append(metrics)
                logger.log(self.step, metrics)
                self.samples_log.log(self.step, {"data_indices": self.trained_indices})
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(progress_fields({**shown, **metrics}))
                every, last = cfg.trainer.save_every, self.step == cfg.trainer.total_steps
                if (every and self.step % every == 0) or (last and cfg.trainer.save_final):
                    self.save()
                if self.snapshots is not None:
                    self._snapshot()
            if self.actor is not None and cfg.streaming:  # the last version, then the stream's end marker
                self.actor.weight_stream.close(None, cfg.trainer.collective_timeout_s)
        finally:
            if bar is not None:
                bar.close()
            logger.close()
        if not cfg.trainer.val_only:
            self._finish()
        return self.history

    def _validator(self) -> Validator | None:
        """Validation's runner when the job has held-out prompts (verl.trainer.validation), else None."""
        if self.val_dataset is None:
            return None
        return Validator(self.cfg, self.val_dataset, self.rollout, self.reward_fn, self.placement, self.out_dir)

    def _validate(self, validator: Validator) -> dict[str, float]:
        """One validation (collective), kept in `val_history` as (step, metrics)."""
        with self.watchdog.phase(f"the validation at step {self.step}"):
            metrics = validator.run(self.step)
        self.val_history.append((self.step, metrics))
        return metrics

    def close(self) -> None:
        """Shuts the rollout engine down (vLLM / SGLang hold processes, threads and process groups)."""
        if self.rollout is not None:
            self.rollout.close()

    def _export_lora(self, adapter_dir: Path, merged_dir: Path | None) -> None:
        """The adapter in PEFT's format (into `adapter_dir`, published as output_dir/hf_actor) and, with
        actor.lora.export_merged, the merged model (`merged_dir`: hf_actor_merged); collective over the actor's
        ranks (FSDP2 gathers each tensor)."""
        from verl.models.lora import export_adapter, merged_model
        module, write = self.actor.engine.module, self.placement.global_rank == self.roles["actor"].ranks[0]
        export_adapter(module, adapter_dir, base_model=self.cfg.model.path, write=write)
        if write and self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(adapter_dir))
        if merged_dir is not None:
            merged = merged_model(module)
            if write:
                export_hf(merged, self.tokenizer, merged_dir)

    def _finish(self) -> None:
        """The exported actor (hf_actor), curves.png and the merged async trace: each written beside, then moved
        into place over this run's own earlier copy only."""
        with self.watchdog.phase("the final export"):
            barrier(self.placement)  # async: the rollout's ranks have written their trace
            if self.cfg.trainer.export_hf:
                self._export_actor()
            self._on_main(self._plot_and_merge)

    def _exports(self) -> list[str]:
        """The model folders the run exports under output_dir."""
        lora = self.cfg.actor.lora
        return ["hf_actor", *(["hf_actor_merged"] if lora.enabled and lora.export_merged else [])]

    def _export_actor(self) -> None:
        """Collective over every rank (the actor's ranks write), each export into a temporary sibling first."""
        tmps = {name: f".tmp-{name}-{self.ckpt.run_id[:8]}" for name in self._exports()}
        self._on_main(lambda: [self.folder.record(t, "tree") for t in tmps.values()])
        engine = self.actor.engine if self.actor is not None else None
        if engine is not None and self.cfg.actor.lora.enabled:
            merged = tmps.get("hf_actor_merged")
            self._export_lora(self.out_dir / tmps["hf_actor"], self.out_dir / merged if merged else None)
        elif isinstance(engine, TorchEngine):
            if self.placement.is_main:
                export_hf(engine.module, self.tokenizer, self.out_dir / tmps["hf_actor"])
        elif engine is not None:
            engine.export_hf(self.out_dir / tmps["hf_actor"], self.tokenizer)  # collective over the actor's ranks
        for name, tmp in tmps.items():
            self._on_main(lambda t=tmp, n=name: (self.out_dir / t).is_dir() and self.folder.publish(t, n))

    def _plot_and_merge(self) -> None:
        out_dir = self.out_dir
        if self.cfg.trainer.plot and (out_dir / "metrics.jsonl").is_file():
            tmp = out_dir / ".curves.tmp.png"
            self.folder.record(tmp.name, "file")
            plot_curves(out_dir / "metrics.jsonl", tmp, title=self.cfg.algorithm.adv_estimator)
            self.folder.replace_file(tmp, "curves.png")
            self.folder.forget(tmp.name)
        stem = self.trace_stem
        if not stem:
            return
        # async: the rollout stage's trace; agent jobs: each rollout rank's turns and tool calls. One timeline.
        extra = [out_dir / f"{stem}_rollout.json"] + sorted(out_dir.glob(f"{stem}_agent_*.json"))
        extra = [p for p in extra if p.is_file()]
        if extra:
            trace = out_dir / f"{stem}.json"
            merge_traces([str(p) for p in ([trace] if trace.is_file() else []) + extra], str(trace))
            for p in extra:
                p.unlink()
                self.folder.forget(p.name)


def role_placements(placement: Placement, roles: dict) -> dict[str, Placement | None]:
    """This rank's placement in each role (None where the role does not run here). Megatron roles keep the
    job's megatron layout; the others are plain data parallel over their ranks. Every rank asks for every
    role's group in the same order, because creating a process group is collective."""
    from verl.dataflow.comm import group_for
    out: dict[str, Placement | None] = {}
    for name, role in roles.items():
        group = group_for(role.ranks) if placement.distributed else None
        if placement.global_rank not in role.ranks:
            out[name] = None
        elif role.spec.model_parallel or (name == "rollout" and roles["actor"].spec.model_parallel):
            out[name] = placement  # the rollout splits prompts over the megatron actor's replicas
        else:
            out[name] = placement.subset(role.ranks, group) if placement.distributed else placement
    return out


def check_device_map(model: torch.nn.Module, actor, placement: Placement) -> None:
    """A model loaded with `device_map=...` keeps its modules where `hf_device_map` put them (the engines never
    move a device-mapped model). They must be devices of the actor's ranks: in a one-process job any GPU it
    sees (accelerate's hooks carry activations between them) or the CPU; with several processes, this
    process's own device, since every other GPU belongs to another rank. Raised before anything is built,
    naming the module and the device."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return
    if placement.global_rank not in actor.ranks:
        raise VerlConfigError(f"actor_model was passed to rank {placement.global_rank}, which is not among "
                              f"actor.ranks={list(actor.ranks)}; pass it on the actor's ranks only")
    mine = placement.device
    for module, dev in device_map.items():
        if dev in ("cpu", "disk") or (isinstance(dev, str) and dev.startswith("cpu")):
            if dev == "disk":
                raise VerlConfigError(f"actor_model.hf_device_map puts {module or 'the model'!r} on disk; a "
                                      f"trained actor needs its weights in memory: load it with a device_map "
                                      f"that fits on the device or the CPU")
            continue
        index = dev if isinstance(dev, int) else torch.device(dev).index
        if not placement.distributed and torch.cuda.is_available() and index < torch.cuda.device_count():
            continue
        if mine.type != "cuda" or index != mine.index:
            raise VerlConfigError(f"actor_model.hf_device_map puts {module or 'the model'!r} on device {dev!r}, "
                                  f"but this rank ({placement.global_rank}) of actor.ranks={list(actor.ranks)} "
                                  f"computes on {mine}; load the model with device_map={{'': {str(mine)!r}}} on "
                                  f"each rank, or launch one process per device the map uses")


def progress_fields(m: dict[str, float]) -> dict[str, str]:
    """What the progress bar shows of a step's metrics."""
    out = {"reward": f"{m['reward/mean']:.3f}", "kl": f"{m.get('actor/kl', 0.0):.4f}",
           "entropy": f"{m.get('actor/entropy', 0.0):.3f}", "tok_s": f"{m['perf/tokens_per_s']:.0f}",
           "sync_ms": f"{1e3 * m.get('perf/sync_s', 0.0):.1f}"}
    if "rollout/mismatch_max" in m:
        out["mismatch"] = f"{m['rollout/mismatch_max']:.2g}"
    if "rollout/tool_use_rate" in m:  # multi-turn rollouts: how often a tool is called, and turns per trajectory
        out["tools"] = f"{m['rollout/tool_use_rate']:.2f}"
        out["turns"] = f"{m['rollout/turns_mean']:.2f}"
    if "val/pass@1" in m:  # the latest held-out accuracy
        out["val_acc"] = f"{m['val/pass@1']:.3f}"
    return out
