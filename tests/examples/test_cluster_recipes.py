"""The cluster launch recipes of examples/cluster/ (issue #27 item 4): the command lines they generate are the ones
verl expects, and a two-node torchrun launch with c10d rendezvous trains (two agents on this machine).

- slurm_verl.sbatch is run through bash with fake SLURM_* variables and a fake `scontrol` (VERL_DRY_RUN=1 prints
  the srun line instead of running it), as each node of a 2-node allocation would see it;
- pytorchjob.yaml is read with yaml.safe_load, every replica's container command checked;
- two `torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d` agents, each a subprocess, run the default job
  for 2 steps.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "cluster"
SBATCH = CLUSTER / "slurm_verl.sbatch"


def _flags(argv: list[str]) -> dict[str, str]:
    """torchrun's --key=value options (before -m), keyed without dashes; underscores and dashes alike."""
    out = {}
    for a in argv[:argv.index("verl.trainer.main_ppo") - 1]:
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            out[k.replace("-", "_")] = v
    return out


def _check_torchrun(argv: list[str], nnodes: int, nproc: int) -> dict[str, str]:
    """What every recipe's torchrun line must say; returns its options."""
    assert argv[0] == "torchrun", argv
    flags = _flags(argv)
    assert flags["nnodes"] == str(nnodes) and flags["nproc_per_node"] == str(nproc), flags
    assert flags["rdzv_backend"] == "c10d" and re.fullmatch(r"[\w.-]+:\d+", flags["rdzv_endpoint"]), flags
    assert flags.get("rdzv_id"), "a rendezvous id keeps two jobs on one endpoint apart"
    assert int(flags["max_restarts"]) > 0, "restarts let a job recover from a dead rank (trainer.recovery)"
    m = argv.index("-m")
    assert argv[m + 1] == "verl.trainer.main_ppo", argv
    config = argv[m + 2]
    assert "=" not in config and (ROOT / config).is_file(), f"the recipe's config {config} is not in the repo"
    overrides = argv[m + 3:]
    assert all("=" in o for o in overrides), overrides
    from verl.config import PPOConfig, load_config
    cfg = load_config(PPOConfig, ROOT / config, [o for o in overrides if not o.startswith(("model.", "data."))])
    assert cfg.trainer.output_dir and cfg.trainer.hang_timeout_s > 0  # the recipe's keys are real config keys
    return flags


# ---- Slurm ---------------------------------------------------------------------------------------------------
def _sbatch_directives() -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.M))


def _dry_run(tmp_path: Path, node: int, *args: str, **env: str) -> list[str]:
    """The srun line the script runs, as node `node` of the allocation would compute it."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && [ \"$3\" = 'gpu-[017-018]' ] "
                                   "&& printf 'gpu-017\\ngpu-018\\n'\n")
    (fake / "scontrol").chmod(0o755)
    nodes = _sbatch_directives()["nodes"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_", "NCCL_", "GLOO_"))}
    full = {**base, "PATH": f"{fake}:{os.environ['PATH']}", "VERL_DRY_RUN": "1", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NUM_NODES": nodes, "SLURM_NNODES": nodes, "SLURM_JOB_NODELIST": "gpu-[017-018]",
            "SLURM_GPUS_ON_NODE": _sbatch_directives()["gpus-per-node"], "SLURM_NODEID": str(node),
            "SLURMD_NODENAME": f"gpu-{17 + node:03d}", **env}
    res = subprocess.run(["bash", str(SBATCH), *args], env=full, cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    return shlex.split(res.stdout)


def test_slurm_script_builds_one_torchrun_per_node_with_c10d(tmp_path):
    d = _sbatch_directives()
    assert d["ntasks-per-node"] == "1", "one torchrun agent per node"
    lines = [_dry_run(tmp_path, node, "examples/gsm8k_grpo.yaml", "model.path=/models/m",
                      "data.train_files=[/data/a b.parquet]") for node in (0, 1)]
    assert lines[0] == lines[1], "every node must run the same agent command (one endpoint, one rendezvous id)"
    srun = lines[0]
    t = srun.index("torchrun")
    assert srun[0] == "srun" and f"--nodes={d['nodes']}" in srun[:t] and "--ntasks-per-node=1" in srun[:t], srun
    flags = _check_torchrun(srun[t:], nnodes=int(d["nodes"]), nproc=int(d["gpus-per-node"]))
    assert flags["rdzv_endpoint"] == "gpu-017:29500", "the rendezvous is on the allocation's first node"
    assert flags["rdzv_id"] == "verl-4242"
    assert srun[-2:] == ["model.path=/models/m", "data.train_files=[/data/a b.parquet]"], "overrides passed as is"
    assert "trainer.output_dir=outputs/slurm-4242" in srun


def test_slurm_script_takes_the_documented_environment(tmp_path):
    argv = _dry_run(tmp_path, 0, MASTER_ADDR="10.0.0.5", MASTER_PORT="31000", NPROC_PER_NODE="4",
                    OUTPUT_DIR="/shared/run1", HANG_TIMEOUT_S="900", RDZV_TIMEOUT_S="60")
    flags = _check_torchrun(argv[argv.index("torchrun"):], nnodes=2, nproc=4)
    assert flags["rdzv_endpoint"] == "10.0.0.5:31000" and flags["rdzv_conf"] == "join_timeout=60", flags
    assert "trainer.output_dir=/shared/run1" in argv and "trainer.hang_timeout_s=900" in argv
    assert argv[argv.index("-m") + 2] == "examples/gsm8k_grpo.yaml", "the default config"
    # outside an allocation it says so instead of launching anything
    res = subprocess.run(["bash", str(SBATCH)], env={"PATH": os.environ["PATH"], "VERL_DRY_RUN": "1"},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "run this script with sbatch" in res.stderr, res.stderr


def test_slurm_script_exports_the_network_interfaces(tmp_path):
    script = SBATCH.read_text()
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        assert re.search(rf"export .*\b{var}\b", script), f"{var} is not exported to the agents"
    res = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


# ---- Kubernetes ----------------------------------------------------------------------------------------------
def test_pytorchjob_runs_the_same_agent_on_every_pod():
    job = yaml.safe_load((CLUSTER / "pytorchjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    pods = sum(s["replicas"] for s in specs.values())
    nproc = int(job["spec"]["nprocPerNode"])
    commands = []
    for role, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == nproc, role
        flags = _check_torchrun(container["command"], nnodes=pods, nproc=nproc)
        host, port = flags["rdzv_endpoint"].split(":")
        assert host == f"{job['metadata']['name']}-master-0", "the operator's service of the Master pod"
        assert int(port) in [p["containerPort"] for p in container["ports"]], "the rendezvous port is declared"
        env = {e["name"] for e in container["env"]}
        assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= env, env
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        out = next(a.split("=", 1)[1] for a in container["command"] if a.startswith("trainer.output_dir="))
        assert any(out.startswith(m + "/") for m in mounts), "output_dir must be on the volume every pod shares"
        commands.append(container["command"])
    assert all(c == commands[0] for c in commands)


# ---- two torchrun agents on this machine ---------------------------------------------------------------------
@pytest.mark.multiprocess
def test_two_torchrun_agents_with_c10d_rendezvous_train(tmp_path):
    from verl.distributed.placement import free_port
    port, out = free_port(), tmp_path / "run"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=verl-test-{port}",
             "-m", "verl.trainer.main_ppo", "warmup.steps=0", "trainer.total_steps=2", "val.num_examples=0",
             "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false",
             "trainer.progress_bar=false", "trainer.tensorboard=false", f"trainer.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    print("agent command (run twice):", shlex.join(agent))
    start = time.monotonic()
    agents = [subprocess.Popen(agent, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    logs = []
    try:
        for a in agents:
            logs.append(a.communicate(timeout=300)[0])
    except subprocess.TimeoutExpired:
        for a in agents:
            a.kill()
        pytest.fail("HANG: the two agents did not finish 2 steps in 300 s")
    print(f"two agents finished in {time.monotonic() - start:.1f} s")
    assert [a.returncode for a in agents] == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert sum("done: 2 steps" in x for x in logs) == 1, "rank 0 reports the end once"
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2], rows
    entries = json.loads((out / "verl_run.json").read_text())["entries"]
    assert "hang/rank_1.txt" in entries and "hang/rank_2.txt" not in entries, "the world was not 2 processes"
