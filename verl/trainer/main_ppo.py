"""PPO / GRPO post-training from a YAML config plus dotted overrides.

The default config (verl/trainer/config/default.yaml) is the embedded job: a tiny Llama-architecture model
and BPE tokenizer built locally (no download), the synthetic arithmetic task ("7+9=" → "16") with an
exact-match reward, a short supervised warm start, then GRPO. Other algorithms are one override away:
`algorithm.adv_estimator=gae` (PPO with a critic), `dr_grpo`, `rloo`, `reinforce_plus_plus`, `remax`.

    python -m verl.trainer.main_ppo                                   # the default job, one process
    python -m verl.trainer.main_ppo verl/trainer/config/default.yaml actor.optim.lr=1e-6 rollout.n=4
    torchrun --nproc_per_node=2 -m verl.trainer.main_ppo CONFIG.yaml trainer.output_dir=outputs/run2
    torchrun --nproc_per_node=8 -m verl.trainer.main_ppo CONFIG.yaml actor.engine=megatron actor.megatron.tp=2
    torchrun --nproc_per_node=8 -m verl.trainer.main_ppo CONFIG.yaml actor.engine=fsdp actor.fsdp.param_dtype=bfloat16
    python -m verl.trainer.main_ppo CONFIG.yaml trainer.resume=auto   # continue the newest checkpoint
    python -m verl.trainer.main_ppo --help                            # every config key, documented

Upstream verl's launch lines run as they are (docs/from_verl.md): its keys (actor_rollout_ref.*, critic.*,
reward_model.*, trainer.total_epochs, ...), Hydra's --config-name=ppo_megatron_trainer and verl YAML files are
translated by verl.config.verl_dialect (`verl compat SCRIPT.sh` prints the translation first):

    python -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=~/data/gsm8k/train.parquet \
        actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.rollout.n=5 trainer.n_gpus_per_node=8

trainer.n_gpus_per_node x trainer.nnodes processes: a plain `python -m` on one node starts them itself (torchrun's
standalone launcher); on several nodes run torchrun on each.

torchrun picks NCCL on GPUs and gloo on CPU. Outputs: metrics.jsonl, tensorboard/, curves.png,
checkpoints/step_N (torch.distributed.checkpoint), hf_actor/ under trainer.output_dir.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from verl.utils.spare import hand_over, start_spare

# Nothing heavy is imported at module level: a worker that torchrun restarts hands over to its rank's warm spare
# (verl.utils.spare) before it would import torch; `main` imports the trainer after that.

DEFAULT_CONFIG = Path(__file__).parent / "config" / "default.yaml"


def parse_args(argv: list[str]) -> tuple[Path, list[str]]:
    """[CONFIG.yaml] key=value ... → (config path, overrides); without a YAML the default job's config."""
    if argv and "=" not in argv[0]:
        return Path(argv[0]), argv[1:]
    return DEFAULT_CONFIG, argv


def spawn_world(translation, argv: list[str]) -> int | None:
    """A verl command line asks for trainer.n_gpus_per_node x nnodes processes: in a plain process on one node,
    start them (torchrun's standalone launcher runs this module again) and return its exit code; under torchrun,
    check the world. None: go on in this process."""
    import os
    import subprocess
    want, world = translation.world, int(os.environ.get("WORLD_SIZE", "0"))
    if world:
        if world != want:
            from verl.errors import VerlConfigError
            raise VerlConfigError(f"trainer.n_gpus_per_node x trainer.nnodes = {want} processes, but torchrun started "
                                  f"{world}; launch {want}, or set trainer.n_gpus_per_node / nnodes to match")
        return None
    if want == 1:
        return None
    if translation.nnodes > 1:
        from verl.errors import VerlConfigError
        raise VerlConfigError(f"trainer.nnodes={translation.nnodes}: run torchrun on every node (torchrun "
                              f"--nnodes={translation.nnodes} --nproc_per_node={want // translation.nnodes} "
                              f"--rdzv-endpoint=HOST:PORT -m verl.trainer.main_ppo ...)")
    print(f"verl: trainer.n_gpus_per_node={want}: starting {want} processes (torchrun --standalone)", flush=True)
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={want}", "-m", "verl.trainer.main_ppo", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    hand_over(argv)  # a restarted torchrun worker whose rank's spare waits runs there (and never returns)
    import torch.distributed as dist

    from verl.config import PPOConfig, describe
    from verl.config.verl_dialect import load_job
    from verl.distributed import destroy_process_groups, init_placement
    from verl.engines import describe_engines
    from verl.trainer.ppo_trainer import PPOTrainer
    start_spare(_run_restarted)  # the imports done, before anything rank-specific: a spare for the next restart
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("\n".join(describe(PPOConfig)))
        print("\n" + "\n".join(describe_engines()))
        return 0
    cfg, translation = load_job(argv, DEFAULT_CONFIG)
    if translation is not None:
        rc = spawn_world(translation, argv)
        if rc is not None:
            return rc
        if os.environ.get("RANK", "0") == "0":
            for note in translation.notes:
                print(f"verl: {note}", flush=True)
    owned = not dist.is_initialized()  # tear down only the process groups this call creates
    m = cfg.actor.megatron
    specs = cfg.engine_specs()
    placement = init_placement(cfg.trainer.device, tp=m.tp, pp=m.pp, sequence_parallel=m.sequence_parallel,
                               ep=m.ep, etp=m.expert_tp, seed=cfg.trainer.seed, megatron=specs["actor"].model_parallel,
                               process_group=any(s.needs_process_group for s in specs.values()),
                               timeout_s=cfg.trainer.collective_timeout_s)
    trainer = None
    try:
        trainer = PPOTrainer(cfg, placement)
        history = trainer.fit()
        if placement.is_main and history:
            first, last = history[0], history[-1]
            print(f"done: {len(history)} steps, reward {first['reward/mean']:.3f} -> {last['reward/mean']:.3f}, "
                  f"outputs in {Path(cfg.trainer.output_dir).resolve()}")
        if placement.is_main and trainer.val_history:
            (s0, v0), (s1, v1) = trainer.val_history[0], trainer.val_history[-1]
            print(f"held-out accuracy (val/pass@1): {v0['val/pass@1']:.3f} at step {s0} -> {v1['val/pass@1']:.3f} "
                  f"at step {s1} ({len(trainer.val_history)} validations)")
    finally:
        if owned:  # megatron's groups first, then the engine (vLLM's shutdown also ends the default group)
            if specs["actor"].model_parallel and dist.is_initialized():
                destroy_process_groups()
            if trainer is not None:
                trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def _run_restarted(argv: list[str]) -> int:
    """What a spare's child runs for a restarted worker: `main` as the command line runs it."""
    from verl.errors import run_cli
    return run_cli(main, argv)


if __name__ == "__main__":
    from verl.errors import run_cli
    sys.exit(run_cli(main))
