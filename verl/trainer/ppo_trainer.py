"""The PPO / GRPO training loop: builds the workers from the config, then runs the dataflow once per step,
logging metrics and writing checkpoints. The algorithm itself lives in `verl.trainer.ppo_flow`."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import time
from pathlib import Path

import torch

from verl.config.base import to_dict
from verl.config.ppo import PPOConfig
from verl.data import BatchSampler, PromptDataset, load_prompt_dataset, make_task, task_corpus
from verl.distributed import Placement
from verl.errors import VerlConfigError
from verl.rollout import build_rollout, require_engine
from verl.trainer.kl_control import build_kl_controller
from verl.trainer.ppo_flow import build_ppo_dataflow
from verl.trainer.warmup import supervised_warmup
from verl.utils.checkpoint import CheckpointManager
from verl.distributed.collectives import barrier, reduce_metrics
from verl.utils.metrics import MetricsLogger, plot_curves
from verl.workers import ActorWorker, CriticWorker, RolloutWorker, TorchEngine, ValueModel, build_reward

MAXED = ("reward/max", "rollout/mismatch_max")


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
        return model, tokenizer
    corpus = (task_corpus(cfg.data.task) if not cfg.data.train_files
              else [p + a for p, a in zip(dataset.prompts, dataset.answers)])
    tokenizer = tiny_tokenizer(corpus, cfg.model.tiny.vocab_size)
    return tiny_model(cfg.model.tiny, tokenizer=tokenizer, tie_word_embeddings=True, seed=cfg.trainer.seed), tokenizer


def check_generation_layout(cfg: PPOConfig, hf_config) -> None:
    """What the model decides about the generation layout, checked before any step."""
    heads = hf_config.num_attention_heads
    if heads % cfg.rollout.tp:
        raise VerlConfigError(f"rollout.tp={cfg.rollout.tp} does not divide the model's {heads} attention heads; "
                              f"use one of {[d for d in range(1, heads + 1) if heads % d == 0]}")
    limit = cfg.rollout.max_model_len or getattr(hf_config, "max_position_embeddings", None)
    need = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if limit is not None and need > limit:
        raise VerlConfigError(f"data.max_prompt_length={cfg.data.max_prompt_length} + rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens} = {need} exceeds the maximum model length {limit} "
                              f"(rollout.max_model_len, else the model's max_position_embeddings); shorten one")


class PPOTrainer:
    """Owns the workers, the data order, the KL controller, metrics and checkpoints of one job."""

    def __init__(self, cfg: PPOConfig, placement: Placement):
        cfg.validate_world(placement.world_size)  # before anything touches the disk
        require_engine(cfg.rollout.engine)
        self.cfg, self.placement = cfg, placement
        if cfg.trainer.threads > 0:
            torch.set_num_threads(cfg.trainer.threads)
        self.dataset = load_dataset(cfg)
        self.policy, self.tokenizer = load_policy(cfg, self.dataset)
        check_generation_layout(cfg, self.policy.config)
        # the global RNG (whatever the step's seed does not cover): differs between data-parallel replicas and
        # agrees within a model-parallel group; sampling itself is seeded per step and row
        torch.manual_seed(cfg.trainer.seed * 1000 + placement.dp_rank)
        self.sampler = BatchSampler(len(self.dataset), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        self.reward_fn = build_reward(cfg.reward, placement.device)
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
        self.flow = build_ppo_dataflow(cfg)
        self.out_dir = Path(cfg.trainer.output_dir)
        self.ckpt = CheckpointManager(self.out_dir / "checkpoints", placement, cfg.trainer.keep_checkpoints,
                                      trust=cfg.trainer.trust_checkpoint)
        self.actor = self.ref = self.critic = self.rollout = None
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.node_seconds: dict[str, float] = {}

    def on_node_end(self, event) -> None:
        """Dataflow hook: per-node durations of the current step (logged as timing/<node>_s)."""
        self.node_seconds[event.node] = event.duration_s

    # -- workers (built after the warm start: the reference and critic copy the warm-started policy) --------
    def _init_dir(self) -> Path:
        """The warm-started policy as a Hugging Face directory: what megatron models and vLLM / SGLang load."""
        path = self.out_dir / ".init_hf"
        if self.placement.is_main:
            export_hf(self.policy, self.tokenizer, path)
        barrier(self.placement)
        return path

    def _build_workers(self) -> None:
        cfg, p = self.cfg, self.placement
        needs_dir = cfg.actor.engine == "megatron" or cfg.rollout.engine in ("vllm", "sglang")
        init_dir = self._init_dir() if needs_dir else None
        engines = self._megatron_engines(init_dir) if cfg.actor.engine == "megatron" else self._torch_engines()
        kw = dict(temperature=cfg.rollout.temperature, max_response_length=cfg.rollout.max_new_tokens,
                  responses_per_mini=cfg.actor.mini_batch_size // p.dp_size * cfg.rollout.n)
        self.actor = ActorWorker(engines["actor"], cfg.actor, **kw)
        self.ref = ActorWorker(engines["ref"], cfg.actor, **kw) if "ref" in engines else None
        self.critic = CriticWorker(engines["critic"], cfg.critic) if "critic" in engines else None
        rollout_cfg = cfg.rollout
        if rollout_cfg.decoder == "train":  # decode in the actor's micro-batches: the shapes its forward will see
            rollout_cfg = dataclasses.replace(rollout_cfg, max_batch_size=cfg.actor.micro_batch_size)
        engine = build_rollout(rollout_cfg, model=self.policy, model_path=str(init_dir) if init_dir else None,
                               tokenizer=self.tokenizer)
        self.rollout = RolloutWorker(engine, cfg.rollout, max_prompt_length=cfg.data.max_prompt_length, placement=p)

    def _torch_engines(self) -> dict:
        cfg, p, steps = self.cfg, self.placement, self.cfg.trainer.total_steps
        out = {"actor": TorchEngine(self.policy, cfg.actor.optim, p, total_steps=steps)}
        if cfg.needs_ref:
            out["ref"] = TorchEngine(copy.deepcopy(self.policy), None, p)
        if cfg.needs_critic:
            out["critic"] = TorchEngine(ValueModel.from_causal_lm(self.policy), cfg.critic.optim, p, head="value",
                                        total_steps=steps)
        return out

    def _megatron_engines(self, init_dir: Path) -> dict:
        from verl.workers.megatron import MegatronEngine
        cfg, p, m, steps = self.cfg, self.placement, self.cfg.actor.megatron, self.cfg.trainer.total_steps
        out = {"actor": MegatronEngine(init_dir, p, m, optim=cfg.actor.optim, total_steps=steps)}
        if cfg.needs_ref:
            out["ref"] = MegatronEngine(init_dir, p, m)
        if cfg.needs_critic:
            out["critic"] = MegatronEngine(init_dir, p, m, value_head=True, optim=cfg.critic.optim, total_steps=steps)
        return out

    # -- checkpoints ----------------------------------------------------------------------------------------
    def _checkpointed(self) -> tuple[dict, dict]:
        """(torch modules and optimizers, megatron engines with their own per-rank layout): both go to DCP."""
        modules, sharded = {}, {}
        for name, w in {"actor": self.actor, "ref": self.ref, "critic": self.critic}.items():
            if w is None:
                continue
            if isinstance(w.engine, TorchEngine):
                modules[name] = (w.engine.module, w.engine.optimizer)
            else:
                sharded[name] = w.engine
        return modules, sharded

    def _trainer_state(self) -> dict:
        def sched(worker):
            s = getattr(getattr(worker, "engine", None), "scheduler", None)
            return s.state_dict() if s is not None else None
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "actor_sched": sched(self.actor), "critic_sched": sched(self.critic), "config": to_dict(self.cfg)}

    def _restore(self, path: Path) -> None:
        state = self.ckpt.load(path, *self._checkpointed())
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        for worker, key in ((self.actor, "actor_sched"), (self.critic, "critic_sched")):
            if worker is not None and state[key] is not None:
                worker.engine.scheduler.load_state_dict(state[key])

    def save(self) -> Path:
        return self.ckpt.save(self.step, *self._checkpointed(), self._trainer_state())

    def setup(self) -> dict[str, float]:
        """Warm start (fresh runs) or checkpoint restore (resumed runs); returns warm-up and first-sync metrics."""
        resume = self.ckpt.resolve(self.cfg.trainer.resume, overwrite=self.cfg.trainer.overwrite,
                                   run_files=[self.out_dir / "metrics.jsonl"])
        info: dict[str, float] = {}
        if resume is None and self.cfg.warmup.steps > 0:
            info = supervised_warmup(self.policy, self.tokenizer, self.dataset, self.cfg.warmup, self.placement,
                                     self.cfg.trainer.seed)
        self._build_workers()
        if resume is not None:
            self._restore(resume)
            info["resumed_from_step"] = self.step
        self.rollout.sync_weights(self.actor)
        return info

    # -- one step -------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        rows = [self.dataset[i] for i in self.sampler.next_batch()]  # the step's prompts, the same on every rank
        # a pure function of the step (and the row, inside the rollout worker): a resumed run samples exactly
        # what the uninterrupted one did, whatever the generation layout
        seed = self.cfg.rollout.seed + self.step * len(rows) * self.cfg.rollout.n
        inputs = {"prompts": rows, "seed": seed, "step": self.step,
                  "rollout": self.rollout, "reward_fn": self.reward_fn, "actor": self.actor, "ref": self.ref,
                  "critic": self.critic, "kl_ctrl": self.kl_ctrl, "algo_cfg": self.cfg.algorithm}
        self.node_seconds.clear()
        trace = None
        if self.cfg.trainer.trace_step == self.step + 1:
            trace = str(self.out_dir / f"trace_step_{self.step + 1}.json")
        out = self.flow.run(inputs, hooks=[self], trace=trace)
        return self._metrics(out, time.perf_counter() - t0)

    def _metrics(self, out: dict, elapsed: float) -> dict[str, float]:
        batch, scores, mask = out["batch"], out["scores"], out["batch"].response_mask
        m = {"reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
             "response/length": float(mask.sum(-1).mean()), "response/clip_ratio": float((mask[:, -1] > 0).float().mean()),
             "advantage/mean": float((out["advantages"] * mask).sum() / mask.sum().clamp(min=1)),
             **out.get("kl_metrics", {}), **(out.get("mismatch_metrics") or {}), **out.get("actor_metrics", {}),
             **(out.get("critic_metrics") or {}), **out["sync_metrics"]}
        if "actor/kl" not in m and "actor/ppo_kl" in m:
            m["actor/kl"] = m["actor/ppo_kl"]
        m["perf/tokens"] = float(batch.num_tokens())
        m["perf/response_tokens"] = float(mask.sum())
        m = reduce_metrics(m, self.placement, maxed=MAXED, mined=("reward/min",))
        dp = self.placement.dp_size  # model-parallel peers hold the same tokens: count each replica once
        m["perf/step_time_s"] = elapsed
        m["perf/wall_time"] = time.time()  # when the step ended (aligns runs that share a machine)
        m["perf/tokens_per_s"] = m.pop("perf/tokens") * dp / elapsed
        m["perf/response_tokens_per_s"] = m.pop("perf/response_tokens") * dp / elapsed
        for name, seconds in self.node_seconds.items():
            m[f"timing/{name}_s"] = seconds
        return m

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        cfg, p = self.cfg, self.placement
        info = self.setup()
        logger = MetricsLogger(self.out_dir, enabled=p.is_main, tensorboard=cfg.trainer.tensorboard,
                               start_step=self.step)
        bar = None
        if p.is_main and cfg.trainer.progress_bar:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.trainer.total_steps, initial=self.step, desc=f"{cfg.algorithm.adv_estimator}",
                       dynamic_ncols=True)
        if info:
            logger.log(self.step, info)
            if p.is_main:
                print("  ".join(f"{k}={v:.4g}" for k, v in info.items()), flush=True)
        try:
            while self.step < cfg.trainer.total_steps:
                metrics = self.train_step()
                self.step += 1
                self.history.append(metrics)
                logger.log(self.step, metrics)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(progress_fields(metrics))
                every, last = cfg.trainer.save_every, self.step == cfg.trainer.total_steps
                if (every and self.step % every == 0) or (last and cfg.trainer.save_final):
                    self.save()
        finally:
            if bar is not None:
                bar.close()
            logger.close()
        self._finish()
        return self.history

    def close(self) -> None:
        """Shuts the rollout engine down (vLLM / SGLang hold processes, threads and process groups)."""
        if self.rollout is not None:
            self.rollout.engine.close()

    def _finish(self) -> None:
        out_dir = self.out_dir
        if self.cfg.trainer.export_hf:
            engine = self.actor.engine
            if isinstance(engine, TorchEngine):
                if self.placement.is_main:
                    export_hf(engine.module, self.tokenizer, out_dir / "hf_actor")
            else:
                engine.export_hf(out_dir / "hf_actor", self.tokenizer)  # collective: gathers the shards
        if self.placement.is_main and self.cfg.trainer.plot and (out_dir / "metrics.jsonl").is_file():
            plot_curves(out_dir / "metrics.jsonl", out_dir / "curves.png", title=self.cfg.algorithm.adv_estimator)
        barrier(self.placement)


def progress_fields(m: dict[str, float]) -> dict[str, str]:
    """What the progress bar shows of a step's metrics."""
    out = {"reward": f"{m['reward/mean']:.3f}", "kl": f"{m.get('actor/kl', 0.0):.4f}",
           "entropy": f"{m.get('actor/entropy', 0.0):.3f}", "tok_s": f"{m['perf/tokens_per_s']:.0f}",
           "sync_ms": f"{1e3 * m.get('perf/sync_s', 0.0):.1f}"}
    if "rollout/mismatch_max" in m:
        out["mismatch"] = f"{m['rollout/mismatch_max']:.2g}"
    return out


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
