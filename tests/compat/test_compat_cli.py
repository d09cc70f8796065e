"""`verl compat`: launch scripts read (never run) with their shell variables, the translation printed with every
refusal before anything runs, and the key table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from verl.cli.compat import keys_table, main, read_script, report

SCRIPTS = Path(__file__).parent / "verl_upstream" / "scripts"


def test_script_variables_are_substituted(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text('set -x\nexport N=${N_GPUS:-4}\nlen=$((1024 * 2))\nfiles="[\'$HOME/a.parquet\', '
                      '\'$HOME/b.parquet\']"\nname=$(basename /x/model)  # needs a command\nif true; then\n'
                      '  mode=async\nfi\npython3 -m verl.trainer.main_ppo \\\n    data.train_files="$files" \\\n'
                      '    data.max_response_length=$len trainer.n_gpus_per_node=$N \\\n'
                      '    actor_rollout_ref.rollout.mode=$mode trainer.experiment_name=$name $@\n')
    (inv,) = read_script(script, ["trainer.total_training_steps=2"], {"HOME": "/h"})
    assert inv.line == 9
    assert inv.argv == ["data.train_files=['/h/a.parquet', '/h/b.parquet']", "data.max_response_length=2048",
                        "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.mode=async",
                        "trainer.experiment_name=", "trainer.total_training_steps=2"]
    assert inv.problems == ["$name: $(basename /x/model) is a command substitution; this reader does not run "
                            "commands"]
    (inv,) = read_script(script, [], {"HOME": "/h", "N_GPUS": "2"})
    assert "trainer.n_gpus_per_node=2" in inv.argv
    (inv,) = read_script(script, [], {})
    assert "$HOME has no value" in inv.problems[0]


def test_every_kept_script_is_read():
    for path in sorted(SCRIPTS.glob("*.sh")):
        (inv,) = read_script(path, [], {"HOME": "/h"})
        assert len(inv.argv) > 30, path


def test_report_of_an_upstream_script():
    (inv,) = read_script(SCRIPTS / "grpo_trainer__run_qwen2-7b.sh", [], {"HOME": "/h"})
    out = io.StringIO()
    assert report(inv.argv, out) == 0
    text = out.getvalue()
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40  -> actor.micro_batch_size=40" in text
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=true  -- memory / speed only" in text
    assert "processes: trainer.n_gpus_per_node x nnodes = 8" in text
    assert "rollout.n: 5" in text and 'trainer.output_dir: "checkpoints/verl_grpo_example' in text


def test_report_lists_every_refusal_and_fails(capsys):
    rc = main([str(SCRIPTS / "gmpo_trainer__test_dapo_7b_math.sh")])
    text = capsys.readouterr().out
    assert rc == 2
    assert "REFUSED (2):" in text
    assert "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4  -- Ulysses sequence parallelism" in text
    assert "actor_rollout_ref.model.override_config.max_position_embeddings=32768" in text
    assert "not runnable:" in text
    assert "reward_model.reward_kwargs.overlong_buffer_cfg.len=4096  -> reward.overlong_buffer=4096" in text


def test_yaml_and_overrides(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("actor_rollout_ref:\n  rollout: {name: torch, tensor_model_parallel_size: 1}\n")
    assert main([str(cfg), "actor_rollout_ref.rollout.n=3"]) == 0
    assert 'rollout.n: 3' in capsys.readouterr().out
    assert main(["--", "actor_rollout_ref.rollout.name=torch", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                 "algorithm.kl_penalty=full"]) == 2
    assert "algorithm.kl_penalty=full  -- the 'full' KL" in capsys.readouterr().out


def test_keys_table():
    out = io.StringIO()
    keys_table(True, out)
    rows = json.loads(out.getvalue())
    kinds = {r["kind"] for r in rows}
    assert kinds == {"map", "ignore", "refuse"} and all(r["what"] for r in rows)
    assert any(r["key"] == "actor_rollout_ref.actor.ppo_micro_batch_size" and "n_gpus_per_node" in r["what"]
               for r in rows)


def test_missing_launch_script_is_named(tmp_path, capsys):
    missing = tmp_path / "run_qwen.sh"
    assert main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such launch script" in err
