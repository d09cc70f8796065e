"""End-to-end GRPO throughput: verl vs TRL's GRPOTrainer on the same tiny model, tokenizer and prompts
(8 prompts x 4 samples, 32 new tokens, one process, one thread), plus verl's scaling over 1, 2, 4 processes.

    bash benchmarks/e2e/setup_trl_env.sh                       # once: TRL 1.16 venv (/root/.cache/verl-trl)
    python benchmarks/e2e/bench_grpo_vs_trl.py --quick         # ~5 steps each side
    python benchmarks/e2e/bench_grpo_vs_trl.py --full          # more steps, and the 1/2/4-process scaling

Both sides sample exactly 32 tokens per response (EOS ignored), learn with lr 1e-4, no KL term (TRL's beta=0,
verl's actor.use_kl_loss=false: neither runs a reference model), one PPO epoch (on-policy: no extra
old-log-prob pass on either side). tokens/s = generated tokens / step wall time.
In each round the two sides run at the same time, one single-threaded process each, so on a shared
machine they see the same outside load; only steps that end inside the window where both are training
count (verl runs more steps so that it covers TRL's whole run despite starting faster). The compute floor (the
step's matmul FLOPs at this machine's measured single-thread GEMM rate) bounds the ratio any implementation of
the same fp32 step could reach against TRL; it is reported beside the ratio. s/step is the
median over those steps of all rounds (the first step of every run excluded), the minimum is reported too. Writes
benchmarks/results/e2e_grpo_vs_trl.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS, SAMPLES, NEW_TOKENS = 8, 4, 32
TINY = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
            max_position_embeddings=128, vocab_size=96)


def build_assets(work: Path) -> tuple[Path, Path, int]:
    from verl.config import TinyModelConfig
    from verl.data import make_task, task_corpus, write_jsonl
    from verl.testing.tiny import save_tiny, tiny_model, tiny_tokenizer
    tok = tiny_tokenizer(task_corpus("arithmetic"), TINY["vocab_size"])
    model = tiny_model(TinyModelConfig(**TINY), tokenizer=tok, tie_word_embeddings=True, seed=0)
    model_dir = save_tiny(model, tok, work / "model")
    rows = make_task("arithmetic", PROMPTS, seed=0)
    write_jsonl(rows, work / "prompts.jsonl")
    return model_dir, work / "prompts.jsonl", sum(p.numel() for p in model.parameters())


def verl_args(model_dir: Path, prompts: Path, steps: int, out: Path, per_rank_prompts: int = PROMPTS) -> list[str]:
    return [f"model.path={model_dir}", f"data.train_files={prompts}", f"data.train_batch_size={per_rank_prompts}",
            f"rollout.n={SAMPLES}", f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.ignore_eos=true",
            f"actor.mini_batch_size={per_rank_prompts}", f"actor.micro_batch_size={PROMPTS * SAMPLES}",
            "actor.optim.lr=1e-4", "actor.use_kl_loss=false", "warmup.steps=0", f"trainer.total_steps={steps}", "trainer.threads=1",
            "trainer.device=cpu", "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false",
            "trainer.tensorboard=false", "trainer.progress_bar=false", "data.max_prompt_length=64",
            f"trainer.output_dir={out}"]


def _launch_verl(model_dir, prompts, steps, out: Path, nproc: int = 1) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if nproc == 1:
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *verl_args(model_dir, prompts, steps, out)]
    else:
        # weak scaling: every rank keeps the single-process workload (8 prompts x 4 samples)
        from verl.data import make_task, write_jsonl
        many = out.parent / f"prompts_x{nproc}.jsonl"
        write_jsonl(make_task("arithmetic", PROMPTS * nproc, seed=0), many)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "verl.trainer.main_ppo", *verl_args(model_dir, many, steps, out, PROMPTS * nproc)]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)


def _verl_result(proc: subprocess.Popen, out: Path, nproc: int = 1) -> dict:
    if proc.wait() != 0:
        raise RuntimeError(f"verl run failed with exit code {proc.returncode}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["perf/step_time_s"] for r in recs if "perf/step_time_s" in r]
    return {"step_s": step_s, "step_end": [r["perf/wall_time"] for r in recs if "perf/wall_time" in r], "nproc": nproc,
            "mean_response_length": statistics.mean(r["response/length"] for r in recs if "response/length" in r)}


def run_verl(model_dir, prompts, steps, out: Path, nproc: int = 1) -> dict:
    return _verl_result(_launch_verl(model_dir, prompts, steps, out, nproc), out, nproc)


def _launch_trl(model_dir, prompts, steps, out: Path, python: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([python, str(Path(__file__).with_name("_trl_worker.py")), str(model_dir), str(prompts),
                             str(steps), str(out), str(SAMPLES), str(NEW_TOKENS)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def side_by_side(model_dir, prompts, steps, work: Path, tag: str, python: str) -> tuple[dict, dict]:
    """Runs verl and TRL concurrently on the same inputs; returns (verl result, TRL result)."""
    vp = _launch_verl(model_dir, prompts, 3 * steps, work / f"verl{tag}")
    tp = _launch_trl(model_dir, prompts, steps, work / f"trl{tag}.json", python)
    if tp.wait() != 0:
        vp.kill()
        raise RuntimeError(f"TRL run failed with exit code {tp.returncode} (is {python} the TRL venv? "
                           f"bash benchmarks/e2e/setup_trl_env.sh)")
    verl, trl = _verl_result(vp, work / f"verl{tag}"), json.loads((work / f"trl{tag}.json").read_text())
    # keep the steady steps (not a run's first) that both started and ended while the other side was training
    lo = max(verl["step_end"][0], trl["step_end"][0])
    hi = min(verl["step_end"][-1], trl["step_end"][-1])
    for side in (verl, trl):
        side["overlap_step_s"] = [s for s, e in list(zip(side["step_s"], side["step_end"]))[1:] if lo <= e - s and e <= hi]
    return verl, trl


def compute_floor(model_dir: Path, prompts: Path) -> dict:
    """The least time any implementation needs per step on this machine at one thread: the matmul FLOPs of the
    step (rollout forward over prompt + response, training forward + backward = 3 forwards; attention and
    everything else ignored, so a lower bound) at the single-thread fp32 GEMM rate measured here on the
    model's own projection shapes."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    prompt_len = 1 + max(len(tok(r["prompt"], add_special_tokens=False).input_ids) for r in rows)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    matmul_params = sum(m.weight.numel() for m in linears)
    tokens = PROMPTS * SAMPLES * (prompt_len + NEW_TOKENS)
    flops = 2 * matmul_params * tokens * (1 + 3)
    rates = []
    for lin in {(m.in_features, m.out_features) for m in linears}:
        x, w = torch.randn(tokens, lin[0]), torch.randn(lin[1], lin[0])
        best = float("inf")
        for _ in range(10):  # best of 10: a preempted GEMM is slower, never faster
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        rates.append(2 * tokens * lin[0] * lin[1] / best)
    rate = max(rates)
    return {"matmul_params": matmul_params, "tokens_per_sequence": prompt_len + NEW_TOKENS,
            "gflop_per_step": flops / 1e9, "gemm_gflops_1thread": rate / 1e9, "floor_s_per_step": flops / rate}


def summarise(runs: list[list[float]], nproc: int = 1, skip_first: bool = True) -> dict:
    steady = [s for run in runs for s in (run[1:] if skip_first and len(run) > 1 else run)]
    if not steady:
        raise RuntimeError("no steady steps to time (the two sides never trained at the same time); use --full")
    best, median = min(steady), statistics.median(steady)
    tokens = PROMPTS * SAMPLES * NEW_TOKENS * nproc
    return {"s_per_step": median, "s_per_step_min": best, "tokens_per_s": tokens / median,
            "tokens_per_s_best": tokens / best, "tokens_per_s_per_process": tokens / median / nproc,
            "steps_timed": len(steady)}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    names = ["verl", "TRL"]
    vals = [result["verl"]["tokens_per_s"], result["trl"]["tokens_per_s"]]
    axes[0].bar(names, vals, color=["tab:blue", "tab:gray"])
    if result.get("compute_floor"):
        ceiling = PROMPTS * SAMPLES * NEW_TOKENS / result["compute_floor"]["floor_s_per_step"]
        axes[0].axhline(ceiling, color="tab:red", linestyle="--", label="compute floor (matmul FLOPs / GEMM rate)")
        axes[0].axhline(2 * vals[1], color="tab:green", linestyle=":", label="target: 2x TRL")
        axes[0].legend(fontsize=7, loc="lower right")
    axes[0].set_title(f"GRPO tokens/s, 1 proc 1 thread, median (x{result['ratio_tokens_per_s']:.2f})")
    if result.get("scaling"):
        ns = [r["nproc"] for r in result["scaling"]]
        axes[1].plot(ns, [r["tokens_per_s"] for r in result["scaling"]], marker="o", label="total")
        axes[1].plot(ns, [r["tokens_per_s_per_process"] for r in result["scaling"]], marker="s", label="per process")
        axes[1].set_xticks(ns)
        axes[1].set_xlabel("processes (gloo, 1 thread each)")
        axes[1].legend()
    axes[1].set_title("verl weak scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="5 steps per side, no scaling sweep (default)")
    mode.add_argument("--full", action="store_true", help="10 steps per side plus scaling over 1, 2, 4 processes")
    ap.add_argument("--trl-python", default="/root/.cache/verl-trl/bin/python")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e_grpo_vs_trl"))
    args = ap.parse_args()
    steps, rounds = (8, 3) if args.full else (5, 2)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, prompts, n_params = build_assets(work)
        verl_runs, trl_runs = [], []
        for r in range(rounds):
            v, t = side_by_side(model_dir, prompts, steps, work, str(r), args.trl_python)
            verl_runs.append(v)
            trl_runs.append(t)
        result = {"config": {"prompts": PROMPTS, "samples": SAMPLES, "new_tokens": NEW_TOKENS, "steps": steps,
                             "rounds": rounds, "threads": 1, "model": {**TINY, "parameters": n_params}},
                  "verl": {**summarise([v["overlap_step_s"] for v in verl_runs], skip_first=False), "raw": verl_runs},
                  "trl": {**summarise([t["overlap_step_s"] for t in trl_runs], skip_first=False), "raw": trl_runs}}
        result["ratio_tokens_per_s"] = result["verl"]["tokens_per_s"] / result["trl"]["tokens_per_s"]
        result["ratio_tokens_per_s_best"] = result["verl"]["tokens_per_s_best"] / result["trl"]["tokens_per_s_best"]
        floor = compute_floor(model_dir, prompts)
        floor["max_ratio_vs_trl"] = result["trl"]["s_per_step"] / floor["floor_s_per_step"]
        floor["verl_fraction_of_floor"] = floor["floor_s_per_step"] / result["verl"]["s_per_step"]
        result["compute_floor"] = floor
        if args.full:
            result["scaling"] = []
            for nproc in (1, 2, 4):
                r = run_verl(model_dir, prompts, steps, work / f"scale{nproc}", nproc=nproc)
                result["scaling"].append({"nproc": nproc, **summarise([r["step_s"]], nproc)})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("ratio_tokens_per_s", "ratio_tokens_per_s_best", "compute_floor")} |
                     {s: {k: round(v, 3) for k, v in result[s].items() if k != "raw"} for s in ("verl", "trl")}))
    for r in result.get("scaling", []):
        print(f"nproc={r['nproc']}: {r['tokens_per_s']:.0f} tokens/s total, {r['s_per_step']:.2f} s/step")


if __name__ == "__main__":
    main()
