"""The PPO / GRPO training loop: builds the workers from the config, then runs the dataflow once per step,
logging metrics and writing checkpoints. The algorithm itself lives in `verl.trainer.ppo_flow`."""

from __future__ import annotations

import copy
import os
import shutil
import time
from pathlib import Path

import torch

from verl.config.base import to_dict
from verl.config.ppo import PPOConfig
from verl.data import BatchSampler, PromptDataset, load_prompt_dataset, make_task, task_corpus
from verl.errors import VerlConfigError
from verl.trainer.kl_control import build_kl_controller
from verl.trainer.ppo_flow import build_ppo_dataflow
from verl.trainer.warmup import supervised_warmup
from verl.utils.checkpoint import CheckpointManager
from verl.utils.distributed import World, barrier, comm_device, ensure_process_group, reduce_metrics
from verl.utils.metrics import MetricsLogger, plot_curves
from verl.workers import ActorWorker, CriticWorker, ReferenceWorker, TorchEngine, ValueModel, build_reward, build_rollout

TIMING_PREFIXES = ("perf/", "timing/")


def load_dataset(cfg: PPOConfig) -> PromptDataset:
    d = cfg.data
    if d.train_files:
        return load_prompt_dataset(d.train_files, d.prompt_key, d.answer_key)
    return PromptDataset.from_records(make_task(d.task, d.num_examples, seed=cfg.trainer.seed, max_operand=d.max_operand), source=f"task {d.task}")


def load_policy(cfg: PPOConfig, dataset: PromptDataset):
    """(model, tokenizer): a Hugging Face directory, or the tiny local Llama with a BPE trained on the data."""
    from verl.testing.tiny import tiny_model, tiny_tokenizer
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise VerlConfigError(f"model.path={cfg.model.path!r} is not a Hugging Face model directory (no "
                                  f"config.json there); fix the path, or unset model.path for the tiny local model")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.model.dtype))
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.bos_token_id is None:
            tokenizer.bos_token = tokenizer.eos_token
        return model, tokenizer
    corpus = (task_corpus(cfg.data.task) if not cfg.data.train_files
              else [p + a for p, a in zip(dataset.prompts, dataset.answers)])
    tokenizer = tiny_tokenizer(corpus, cfg.model.tiny.vocab_size)
    return tiny_model(cfg.model.tiny, tokenizer=tokenizer, tie_word_embeddings=True, seed=cfg.trainer.seed), tokenizer


class PPOTrainer:
    """Owns the workers, the data order, the KL controller, metrics and checkpoints of one job."""

    def __init__(self, cfg: PPOConfig, world: World):
        cfg.validate_world(world.world_size)  # before anything touches the disk
        self.cfg, self.world = cfg, world
        if cfg.trainer.threads > 0:
            torch.set_num_threads(cfg.trainer.threads)
        self.dataset = load_dataset(cfg)
        self.policy, self.tokenizer = load_policy(cfg, self.dataset)
        self.pg = None
        self.dp_rank, self.dp_size = world.rank, world.world_size
        if cfg.actor.engine == "megatron":
            from verl.distributed import init_process_groups
            ensure_process_group(world)
            m = cfg.actor.megatron
            self.pg = init_process_groups(tp=m.tp, pp=m.pp, sequence_parallel=m.sequence_parallel,
                                          seed=cfg.trainer.seed)
            self.dp_rank, self.dp_size = self.pg.dp_rank, self.pg.dp_size
        # sampling differs between data-parallel replicas and agrees within a model-parallel group
        torch.manual_seed(cfg.trainer.seed * 1000 + self.dp_rank)
        self.sampler = BatchSampler(len(self.dataset), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        self.rollout = build_rollout(self.policy, self.tokenizer, cfg.rollout, cfg.data.max_prompt_length,
                                     world.device)
        self.reward_fn = build_reward(cfg.reward, world.device)
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
        self.flow = build_ppo_dataflow(cfg)
        self.out_dir = Path(cfg.trainer.output_dir)
        self.ckpt = CheckpointManager(self.out_dir / "checkpoints", world, cfg.trainer.keep_checkpoints)
        self.actor = self.ref = self.critic = None
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.node_seconds: dict[str, float] = {}

    def on_node_end(self, event) -> None:
        """Dataflow hook: per-node durations of the current step (logged as timing/<node>_s)."""
        self.node_seconds[event.node] = event.duration_s

    # -- workers (built after the warm start: the reference and critic copy the warm-started policy) --------
    def _build_workers(self) -> None:
        if self.cfg.actor.engine == "megatron":
            self._build_megatron_workers()
        else:
            self._build_torch_workers()

    def _build_torch_workers(self) -> None:
        cfg, world, policy = self.cfg, self.world, self.policy
        self.actor = ActorWorker(TorchEngine(policy, cfg.actor.optim, world), cfg.actor,
                                 temperature=cfg.rollout.temperature,
                                 responses_per_mini=cfg.actor.mini_batch_size // self.dp_size * cfg.rollout.n,
                                 max_response_length=cfg.rollout.max_new_tokens)
        if cfg.needs_ref:
            self.ref = ReferenceWorker(TorchEngine(copy.deepcopy(policy), None, world), cfg.rollout.temperature,
                                       cfg.actor.micro_batch_size)
        if cfg.needs_critic:
            self.critic = CriticWorker(TorchEngine(ValueModel.from_causal_lm(policy), cfg.critic.optim, world),
                                       cfg.critic)

    def _build_megatron_workers(self) -> None:
        from verl.workers.megatron import MegatronActorWorker, MegatronCriticWorker, MegatronModel
        cfg, m = self.cfg, self.cfg.actor.megatron
        init_dir = self.out_dir / ".init_hf"  # the (warm-started) policy the megatron models load
        if self.world.is_main:
            export_hf(self.policy, self.tokenizer, init_dir)
        barrier(self.world)
        kw = dict(temperature=cfg.rollout.temperature, max_response_length=cfg.rollout.max_new_tokens,
                  responses_per_mini=cfg.actor.mini_batch_size // self.dp_size * cfg.rollout.n)
        steps = cfg.trainer.total_steps
        self.actor = MegatronActorWorker(MegatronModel(init_dir, self.pg, m, optim=cfg.actor.optim, total_steps=steps),
                                         cfg.actor, **kw)
        if cfg.needs_ref:
            self.ref = MegatronActorWorker(MegatronModel(init_dir, self.pg, m), cfg.actor, **kw)
        if cfg.needs_critic:
            self.critic = MegatronCriticWorker(MegatronModel(init_dir, self.pg, m, value_head=True,
                                                             optim=cfg.critic.optim, total_steps=steps), cfg.critic)

    def _checkpointed(self) -> tuple[dict, dict]:
        """(torch modules and optimizers, megatron engines with their own per-rank layout): both go to DCP."""
        workers = {"actor": self.actor, "ref": self.ref, "critic": self.critic}
        modules, sharded = {}, {}
        for name, w in workers.items():
            if w is None:
                continue
            if isinstance(w.engine, TorchEngine):
                modules[name] = (w.engine.module, w.engine.optimizer)
            else:
                sharded[name] = w.engine
        return modules, sharded

    def _scheduler_state(self, worker):
        sched = getattr(getattr(worker, "engine", None), "scheduler", None)
        return sched.state_dict() if sched is not None else None

    def _trainer_state(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "actor_sched": self._scheduler_state(self.actor), "critic_sched": self._scheduler_state(self.critic),
                "config": to_dict(self.cfg)}

    def _restore(self, path: Path) -> None:
        state = self.ckpt.load(path, *self._checkpointed())
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        for worker, key in ((self.actor, "actor_sched"), (self.critic, "critic_sched")):
            if worker is not None and state[key] is not None:
                worker.engine.scheduler.load_state_dict(state[key])

    def setup(self) -> dict[str, float]:
        """Warm start (fresh runs) or checkpoint restore (resumed runs); returns warm-up metrics."""
        resume = self.ckpt.resolve(self.cfg.trainer.resume)
        info: dict[str, float] = {}
        if resume is None and self.cfg.warmup.steps > 0:
            info = supervised_warmup(self.policy, self.tokenizer, self.dataset, self.cfg.warmup, self.world,
                                     self.cfg.trainer.seed)
        self._build_workers()
        if resume is not None:
            self._restore(resume)
            info["resumed_from_step"] = self.step
        self.rollout.sync_weights(self.actor)
        return info

    # -- one step -------------------------------------------------------------------------------------------
    def _rows(self) -> list[dict]:
        idx = self.sampler.next_batch()
        per = len(idx) // self.dp_size
        mine = idx[self.dp_rank * per:(self.dp_rank + 1) * per]
        return [self.dataset[i] for i in mine]

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        inputs = {"prompts": self._rows(), "rollout": self.rollout, "reward_fn": self.reward_fn, "actor": self.actor,
                  "ref": self.ref, "critic": self.critic, "kl_ctrl": self.kl_ctrl, "algo_cfg": cfg.algorithm,
                  "on_policy": (cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size == cfg.data.train_batch_size
                                and not cfg.algorithm.use_kl_in_reward),
                  "update_actor_now": self.step >= cfg.critic.warmup_steps or not cfg.needs_critic}
        if not cfg.needs_ref:
            inputs["ref_log_probs"] = None
        self.node_seconds.clear()
        trace = None
        if cfg.trainer.trace_step == self.step + 1:
            trace = str(self.out_dir / f"trace_step_{self.step + 1}.json")
        out = self.flow.run(inputs, hooks=[self], trace=trace)
        elapsed = time.perf_counter() - t0
        return self._metrics(out, elapsed)

    def _metrics(self, out: dict, elapsed: float) -> dict[str, float]:
        batch, scores = out["batch"], out["scores"]
        m = {"reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
             "response/length": float(batch.response_mask.sum(-1).mean()),
             "response/clip_ratio": float((batch.response_mask[:, -1] > 0).float().mean()),
             **out.get("kl_metrics", {}), **out.get("actor_metrics", {}), **(out.get("critic_metrics") or {})}
        adv = out["advantages"]
        m["advantage/mean"] = float((adv * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1))
        if "actor/kl" not in m and "actor/ppo_kl" in m:
            m["actor/kl"] = m["actor/ppo_kl"]
        local = torch.tensor([float(batch.num_tokens()), float(batch.response_mask.sum())], dtype=torch.float64,
                             device=comm_device())
        m = reduce_metrics(m, self.world, maxed=("reward/max",), mined=("reward/min",))
        if self.world.distributed:
            torch.distributed.all_reduce(local)
        m["perf/step_time_s"] = elapsed
        m["perf/wall_time"] = time.time()  # when the step ended (aligns runs that share a machine)
        m["perf/tokens_per_s"] = float(local[0]) / elapsed
        m["perf/response_tokens_per_s"] = float(local[1]) / elapsed
        for name, seconds in self.node_seconds.items():
            m[f"timing/{name}_s"] = seconds
        return m

    # -- the loop -------------------------------------------------------------------------------------------
    def save(self) -> Path:
        return self.ckpt.save(self.step, *self._checkpointed(), self._trainer_state())

    def fit(self) -> list[dict[str, float]]:
        cfg, world = self.cfg, self.world
        info = self.setup()
        out_dir = self.out_dir
        logger = MetricsLogger(out_dir, enabled=world.is_main, tensorboard=cfg.trainer.tensorboard,
                               start_step=self.step)
        bar = None
        if world.is_main and cfg.trainer.progress_bar:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.trainer.total_steps, initial=self.step, desc=f"{cfg.algorithm.adv_estimator}",
                       dynamic_ncols=True)
        if info:
            logger.log(self.step, info)
            if world.is_main:
                print("  ".join(f"{k}={v:.4g}" for k, v in info.items()), flush=True)
        try:
            while self.step < cfg.trainer.total_steps:
                metrics = self.train_step()
                self.step += 1
                self.history.append(metrics)
                logger.log(self.step, metrics)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics.get('actor/kl', 0.0):.4f}",
                                    entropy=f"{metrics.get('actor/entropy', 0.0):.3f}",
                                    tok_s=f"{metrics['perf/tokens_per_s']:.0f}")
                every = cfg.trainer.save_every
                last = self.step == cfg.trainer.total_steps
                if (every and self.step % every == 0) or (last and cfg.trainer.save_final):
                    self.save()
        finally:
            if bar is not None:
                bar.close()
            logger.close()
        self._finish(out_dir)
        return self.history

    def _finish(self, out_dir: Path) -> None:
        if not self.world.is_main:
            barrier(self.world)
            return
        if self.cfg.trainer.plot and (out_dir / "metrics.jsonl").is_file():
            plot_curves(out_dir / "metrics.jsonl", out_dir / "curves.png", title=self.cfg.algorithm.adv_estimator)
        if self.cfg.trainer.export_hf:
            export_hf(self.policy, self.tokenizer, out_dir / "hf_actor")  # synced from the actor each step
        barrier(self.world)


def export_hf(module: torch.nn.Module, tokenizer, path: Path) -> Path:
    """Writes a Hugging Face directory atomically (temp dir, then rename over the old one)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    module.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.rename(tmp, path)
    return path
