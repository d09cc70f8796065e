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

torchrun picks NCCL on GPUs and gloo on CPU. Outputs: metrics.jsonl, tensorboard/, curves.png,
checkpoints/step_N (torch.distributed.checkpoint), hf_actor/ under trainer.output_dir.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from verl.config import PPOConfig, describe, load_config
from verl.distributed import destroy_process_groups, init_placement
from verl.engines import describe_engines
from verl.trainer.ppo_trainer import PPOTrainer

DEFAULT_CONFIG = Path(__file__).parent / "config" / "default.yaml"


def parse_args(argv: list[str]) -> tuple[Path, list[str]]:
    """[CONFIG.yaml] key=value ... → (config path, overrides); without a YAML the default job's config."""
    if argv and "=" not in argv[0]:
        return Path(argv[0]), argv[1:]
    return DEFAULT_CONFIG, argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("\n".join(describe(PPOConfig)))
        print("\n" + "\n".join(describe_engines()))
        return 0
    config_path, overrides = parse_args(argv)
    cfg = load_config(PPOConfig, config_path, overrides)
    owned = not dist.is_initialized()  # tear down only the process groups this call creates
    m = cfg.actor.megatron
    specs = cfg.engine_specs()
    placement = init_placement(cfg.trainer.device, tp=m.tp, pp=m.pp, sequence_parallel=m.sequence_parallel,
                               seed=cfg.trainer.seed, megatron=specs["actor"].model_parallel,
                               process_group=any(s.needs_process_group for s in specs.values()),
                               timeout_s=cfg.trainer.collective_timeout_s)
    trainer = None
    try:
        trainer = PPOTrainer(cfg, placement)
        history = trainer.fit()
        if placement.is_main and history:
            first, last = history[0], history[-1]
            print(f"done: {len(history)} steps, reward {first['reward/mean']:.3f} -> {last['reward/mean']:.3f}, "
                  f"outputs in {cfg.trainer.output_dir}")
    finally:
        if owned:  # megatron's groups first, then the engine (vLLM's shutdown also ends the default group)
            if specs["actor"].model_parallel and dist.is_initialized():
                destroy_process_groups()
            if trainer is not None:
                trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from verl.errors import run_cli
    sys.exit(run_cli(main))
