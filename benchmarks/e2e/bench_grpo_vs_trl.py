"""End-to-end GRPO throughput: verl vs TRL's GRPOTrainer on the same model, tokenizer and prompts (8 prompts x
4 samples, one process and one thread each, both running at the same time), plus verl's scaling over 1, 2, 4
processes.

    bash scripts/setup_env.sh trl                                               # once: the TRL environment
    python benchmarks/e2e/bench_grpo_vs_trl.py --workload tiny --quick          # ~5 steps each side
    python benchmarks/e2e/bench_grpo_vs_trl.py --workload tiny --full           # + the 1/2/4-process scaling
    python benchmarks/e2e/bench_grpo_vs_trl.py --workload smollm2-gsm8k         # 3 TRL steps (~30-60 min here)
    verl bench e2e --workload smollm2-gsm8k      # the same: the e2e suite's scripts that take --workload (this one)

Workloads:
- tiny: a 2.4M-parameter model with a 96-token vocabulary on the arithmetic task; both sides sample exactly
  32 tokens per response (EOS ignored), lr 1e-4.
- smollm2-gsm8k: SmolLM2-135M-Instruct (verl.models.pretrained's cached HF directory: the same weights on both
  sides), 8 reasoning-gym gsm_symbolic prompts in the model's chat template, up to 256 new tokens ending at EOS
  (<|im_end|>), verl's gsm_symbolic + 0.1 x gsm8k_format rewards on both sides, lr 2e-6, float32.

Both sides: no KL term (TRL's beta=0, verl's actor.use_kl_loss=false: neither runs a reference model), one PPO
epoch (on-policy: neither runs a separate old-log-prob pass), prompts tokenized exactly as the model's tokenizer
does (TRL's worker checks its prompt ids against verl's Tokenizer.encode_prompt and stops on a mismatch).
tokens/s = generated (response) tokens / step wall time, each side with its own response lengths.

In each round the two sides run at the same time, one single-threaded process each, so on a shared machine they
see the same outside load; only steps that lie wholly inside the window where both are training count (verl is
given more steps and stopped once TRL finishes). The compute floor (the step's matmul FLOPs at this machine's
measured single-thread GEMM rate) bounds the ratio any implementation of the same fp32 step could reach against
TRL; it is reported beside the ratio, with each side's step split and padded-token share. Writes
benchmarks/results/e2e_grpo_vs_trl[_smollm2].{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS, SAMPLES = 8, 4
TINY = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
            max_position_embeddings=128, vocab_size=96)


@dataclass(kw_only=True, slots=True)
class Workload:
    """What one side-by-side comparison runs."""

    name: str
    """The --workload name."""
    new_tokens: int
    """Maximum new tokens per response (exactly this many when ignore_eos)."""
    ignore_eos: bool
    """Sample past EOS (fixed-length responses) or stop at it."""
    lr: float
    """Learning rate of both sides."""
    reward: str
    """The TRL worker's reward: "arithmetic" (exact first number) or "gsm" (verl's gsm rules)."""
    verl_args: list[str] = field(default_factory=list)
    """Overrides of verl's job beyond the shared ones (a YAML first, when the job starts from one)."""
    micro_batch: int = PROMPTS * SAMPLES
    """TRL's responses per forward/backward (its per-device batch, with gradient accumulation over the step's
    responses: one optimizer step and one generation per step). verl's is in verl_args (or its YAML)."""
    skip_first: bool = True
    """Leave every run's first step out of the timing (start-up costs that a seconds-long step would show)."""


WORKLOADS = {
    "tiny": Workload(name="tiny", new_tokens=32, ignore_eos=True, lr=1e-4, reward="arithmetic",
                     verl_args=["data.max_prompt_length=64", f"actor.micro_batch_size={PROMPTS * SAMPLES}"]),
    # a minutes-long step: its first step's start-up share is negligible, and there are only a few steps
    "smollm2-gsm8k": Workload(name="smollm2-gsm8k", new_tokens=256, ignore_eos=False, lr=2e-6, reward="gsm",
                              verl_args=[str(ROOT / "examples" / "smollm2_gsm8k.yaml")], skip_first=False,
                              # TRL: 32 x ~450 padded tokens at once would need ~16 GB of fp32 activations; verl:
                              # the YAML's micro-batches (one GRPO group each, its prompt shared)
                              micro_batch=8),
}


def build_assets(work: Path, wl: Workload) -> tuple[Path, Path, list[list[int]]]:
    """(model dir, prompts.jsonl, the prompts' token ids as verl encodes them)."""
    from verl.data import make_task, task_corpus, write_jsonl
    from verl.rollout.tokenizer import Tokenizer
    if wl.name == "tiny":
        from verl.config import TinyModelConfig
        from verl.models.tiny import save_tiny, tiny_model, tiny_tokenizer
        tok = tiny_tokenizer(task_corpus("arithmetic"), TINY["vocab_size"])
        model = tiny_model(TinyModelConfig(**TINY), tokenizer=tok, tie_word_embeddings=True, seed=0)
        model_dir = save_tiny(model, tok, work / "model")
        rows = make_task("arithmetic", PROMPTS, seed=0)
    else:
        from verl.models.pretrained import resolve_model_path
        model_dir = _plain_config(Path(resolve_model_path("smollm2-135m-instruct")), work / "model")
        rows = make_task("gsm_symbolic", PROMPTS, seed=0)
    write_jsonl(rows, work / "prompts.jsonl")
    tok = Tokenizer.from_pretrained(str(model_dir))
    return model_dir, work / "prompts.jsonl", [tok.encode_prompt(r["prompt"]) for r in rows]


def _plain_config(cached: Path, out: Path) -> Path:
    """The cached HF directory (its files linked, not copied) with the GGUF's quantization_config left out of
    config.json: the weights there are plain float32, but transformers flags a model loaded with that entry as
    quantized and its Trainer (TRL's) refuses to train it. Both sides load this directory."""
    out.mkdir(parents=True, exist_ok=True)
    for f in cached.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((cached / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def verl_args(wl: Workload, model_dir: Path, prompts: Path, steps: int, out: Path,
              per_rank_prompts: int = PROMPTS) -> list[str]:
    return [*wl.verl_args, f"model.path={model_dir}", f"data.train_files={prompts}",
            f"data.train_batch_size={per_rank_prompts}", f"rollout.n={SAMPLES}",
            f"rollout.max_new_tokens={wl.new_tokens}", f"rollout.ignore_eos={str(wl.ignore_eos).lower()}",
            f"actor.mini_batch_size={per_rank_prompts}",
            f"actor.optim.lr={wl.lr}", "actor.use_kl_loss=false", "warmup.steps=0", f"trainer.total_steps={steps}",
            "trainer.threads=1", "trainer.device=cpu", "trainer.save_final=false", "trainer.export_hf=false",
            "trainer.plot=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
            f"trainer.output_dir={out}"]


def _launch_verl(wl: Workload, model_dir, prompts, steps, out: Path, nproc: int = 1) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if nproc == 1:
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *verl_args(wl, model_dir, prompts, steps, out)]
    else:
        # weak scaling: every rank keeps the single-process workload (8 prompts x 4 samples)
        from verl.data import make_task, write_jsonl
        many = out.parent / f"prompts_x{nproc}.jsonl"
        write_jsonl(make_task("arithmetic", PROMPTS * nproc, seed=0), many)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "verl.trainer.main_ppo", *verl_args(wl, model_dir, many, steps, out, PROMPTS * nproc)]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)


def _read_verl(out: Path, nproc: int = 1) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "perf/step_time_s" in r]
    keep = ("timing/", "rollout/padded_share", "response/length", "reward/mean")
    return {"step_s": [r["perf/step_time_s"] for r in recs], "step_end": [r["perf/wall_time"] for r in recs],
            "step_cpu_s": [r.get("perf/cpu_time_s") for r in recs],
            "nproc": nproc, "mean_response_length": [r["response/length"] for r in recs],
            "steps": [{k: v for k, v in r.items() if k.startswith(keep)} for r in recs]}


def _verl_result(proc: subprocess.Popen, out: Path, nproc: int = 1, stopped: bool = False) -> dict:
    if proc.wait() != 0 and not stopped:
        raise RuntimeError(f"verl run failed with exit code {proc.returncode}")
    return _read_verl(out, nproc)


def run_verl(wl: Workload, model_dir, prompts, steps, out: Path, nproc: int = 1) -> dict:
    return _verl_result(_launch_verl(wl, model_dir, prompts, steps, out, nproc), out, nproc)


def _launch_trl(wl: Workload, model_dir, prompts, prompt_ids, steps, out: Path, python: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    spec = {"model_dir": str(model_dir), "prompts": str(prompts), "steps": steps, "out": str(out), "n": SAMPLES,
            "new_tokens": wl.new_tokens, "ignore_eos": wl.ignore_eos, "lr": wl.lr, "reward": wl.reward,
            "micro_batch": wl.micro_batch,
            "prompt_ids": prompt_ids}
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    return subprocess.Popen([python, str(Path(__file__).with_name("_trl_worker.py")), str(spec_path)], env=env,
                            stdout=subprocess.DEVNULL)


def _wait_trl(tp: subprocess.Popen, out: Path, limit_s: float | None, python: str) -> None:
    """Waits for TRL; past `limit_s` it is stopped and the steps it finished (written after each) are kept."""
    try:
        code = tp.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        tp.terminate()
        tp.wait()
        if not out.is_file():
            raise RuntimeError(f"TRL finished no step within --max-minutes ({limit_s / 60:.0f} min)") from None
        print(f"TRL stopped at the time limit after {len(json.loads(out.read_text())['step_s'])} step(s)", flush=True)
        return
    if code != 0:
        raise RuntimeError(f"TRL run failed with exit code {code} (is {python} the TRL environment's python? "
                           f"bash scripts/setup_env.sh trl)")


def side_by_side(wl: Workload, assets, steps, work: Path, tag: str, python: str,
                 limit_s: float | None = None) -> tuple[dict, dict]:
    """Runs verl and TRL concurrently on the same inputs; returns (verl result, TRL result)."""
    model_dir, prompts, prompt_ids = assets
    vp = _launch_verl(wl, model_dir, prompts, 4 * steps, work / f"verl{tag}")
    tp = _launch_trl(wl, model_dir, prompts, prompt_ids, steps, work / f"trl{tag}.json", python)
    try:
        _wait_trl(tp, work / f"trl{tag}.json", limit_s, python)
    except BaseException:
        vp.kill()
        raise
    stopped = vp.poll() is None
    if stopped:  # TRL is done: verl's later steps would run on a machine TRL no longer loads
        time.sleep(1.0)
        vp.terminate()
    verl = _verl_result(vp, work / f"verl{tag}", stopped=stopped)
    trl = json.loads((work / f"trl{tag}.json").read_text())
    _time_window(wl, verl, trl)
    return verl, trl


def _time_window(wl: Workload, verl: dict, trl: dict) -> None:
    """Marks each side's steps to time (`overlap`)."""
    # keep the steps (not a run's first, for short steps) that started and ended while the other side trained
    lo = max(verl["step_end"][0] - verl["step_s"][0], trl["step_end"][0] - trl["step_s"][0])
    hi = min(verl["step_end"][-1], trl["step_end"][-1])
    first = 1 if wl.skip_first else 0
    for side in (verl, trl):
        side["overlap"] = [k for k, (s, e) in enumerate(zip(side["step_s"], side["step_end"]))
                           if k >= first and lo <= e - s and e <= hi]
    if not verl["overlap"] or not trl["overlap"]:
        # minutes-long steps on a loaded machine: no step of one side fits inside the other's; every step of
        # both then counts (they still ran at the same time), and the per-CPU-second figures are the fair ones
        print("no step lies wholly inside the window both sides trained in: timing every step", flush=True)
        for side in (verl, trl):
            side["overlap"], side["all_steps_timed"] = list(range(first, len(side["step_s"]))), True


def summarise(wl: Workload, runs: list[dict], nproc: int = 1, key: str = "overlap") -> dict:
    """Median s/step and tokens/s over the counted steps of all runs; tokens = the step's response tokens. Also
    per CPU second of the process (its own cost, whatever else loads the machine), where recorded."""
    steps, tokens, cpu = [], [], []
    for run in runs:
        lengths = run.get("mean_response_length") or [wl.new_tokens] * len(run["step_s"])
        for k in run[key]:
            steps.append(run["step_s"][k])
            tokens.append(PROMPTS * SAMPLES * nproc * lengths[k])
            cpu.append((run.get("step_cpu_s") or [None] * len(run["step_s"]))[k])
    if not steps:
        raise RuntimeError("no steps to time (the two sides never trained at the same time); use --full")
    rates = [t / s for t, s in zip(tokens, steps)]
    out = {"s_per_step": statistics.median(steps), "s_per_step_min": min(steps),
           "tokens_per_s": statistics.median(rates), "tokens_per_s_best": max(rates),
           "tokens_per_s_per_process": statistics.median(rates) / nproc,
           "mean_response_length": statistics.mean(t / (PROMPTS * SAMPLES * nproc) for t in tokens),
           "steps_timed": len(steps)}
    if all(c is not None for c in cpu):
        out["cpu_s_per_step"] = statistics.median(cpu)
        out["tokens_per_cpu_s"] = statistics.median(t / c for t, c in zip(tokens, cpu))
    return out


def step_split(runs: list[dict], side: str, packed: bool = True) -> dict:
    """Mean seconds per counted step of generate / log-prob / update (and the rest), and the padded shares."""
    recs = [run["steps"][k] for run in runs for k in run["overlap"] if k < len(run["steps"])]
    if not recs:
        return {}
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in recs)  # noqa: E731
    if side == "trl":
        out = {"generate_s": mean("generate_s"), "log_prob_s": mean("logprob_s"), "update_s": mean("update_s"),
               "other_s": mean("other_scoring_s")}
        out["padded_share_generate"] = 1 - sum(r["gen_valid"] for r in recs) / sum(r["gen_positions"] for r in recs)
        out["padded_share_update"] = 1 - sum(r["update_valid"] for r in recs) / sum(r["update_positions"] for r in recs)
        return out
    timings = {k[len("timing/"):-2]: mean(k) for k in recs[0] if k.startswith("timing/")}
    out = {"generate_s": timings.pop("generate", 0.0), "log_prob_s": timings.pop("old_log_prob", 0.0),
           "update_s": timings.pop("update_actor", 0.0), "sync_s": timings.pop("sync_weights", 0.0)}
    out["other_s"] = sum(timings.values())
    if "rollout/padded_share" in recs[0]:
        out["padded_share_generate"] = mean("rollout/padded_share")
    # packed micro-batches (actor.padding_free) hold real tokens only; the padded layout's share is not logged
    out["padded_share_update"] = 0.0 if packed else float("nan")
    return out


def compute_floor(model_dir: Path, prompt_ids: list[list[int]], response_length: float) -> dict:
    """The least time any implementation needs per step on this machine at one thread: the matmul FLOPs of the
    step at the single-thread fp32 GEMM rate measured here on the model's own projection shapes. The rollout
    runs every prompt and response token once through the body and the response positions through the LM
    head; training runs forward + backward (3 forwards) over the same tokens. Attention scores, norms,
    sampling and everything else are left out, and every prompt is counted once per sample (what both sides
    compute), so it is a lower bound."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    body_params = sum(m.weight.numel() for m in linears if m is not head)
    head_params = head.weight.numel()
    prompt_tokens = SAMPLES * sum(len(p) for p in prompt_ids)
    response_tokens = PROMPTS * SAMPLES * response_length
    per_pass = 2 * (body_params * (prompt_tokens + response_tokens) + head_params * response_tokens)
    flops = per_pass * (1 + 3)
    rows = 1024
    rates = []
    for lin in {(m.in_features, m.out_features) for m in linears}:
        x, w = torch.randn(rows, lin[0]), torch.randn(lin[1], lin[0])
        best = float("inf")
        for _ in range(5):  # best of 5: a preempted GEMM is slower, never faster
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        rates.append(2 * rows * lin[0] * lin[1] / best)
    rate = max(rates)
    return {"body_matmul_params": body_params, "lm_head_params": head_params, "prompt_tokens": prompt_tokens,
            "response_tokens": response_tokens, "gflop_per_step": flops / 1e9, "gemm_gflops_1thread": rate / 1e9,
            "floor_s_per_step": flops / rate, "floor_tokens_per_s": response_tokens * rate / flops,
            "prompt_share_of_training_flops": body_params * prompt_tokens / (per_pass / 2),
            # per phase: generation is one forward of every token, the update forward + backward (3 forwards);
            # the on-policy jobs here run no separate log-prob pass (its floor would be one forward)
            "gflop_generate": per_pass / 1e9, "gflop_update": 3 * per_pass / 1e9,
            "floor_generate_s": per_pass / rate, "floor_update_s": 3 * per_pass / rate}


def markdown(result: dict) -> str:
    c, f = result["config"], result["compute_floor"]
    lines = [f"# GRPO verl vs TRL: {c['workload']}", "",
             f"{c['prompts']} prompts x {c['samples']} samples, up to {c['new_tokens']} new tokens "
             f"({'EOS ignored' if c['ignore_eos'] else 'ending at EOS'}), 1 process x 1 thread each, run at the "
             f"same time; {c['command']}", "",
             "| side | s/step (median) | response tokens/s | mean response | generate s | log-prob s | update s "
             "| other s | padded share generate | padded share update | steps |", "|---" * 11 + "|"]
    for side in ("verl", "trl"):
        r, sp = result[side], result[side].get("split", {})
        lines.append(f"| {side} | {r['s_per_step']:.1f} | {r['tokens_per_s']:.1f} | {r['mean_response_length']:.1f} | "
                     f"{sp.get('generate_s', 0):.1f} | {sp.get('log_prob_s', 0):.1f} | {sp.get('update_s', 0):.1f} | "
                     f"{sp.get('other_s', 0):.1f} | {sp.get('padded_share_generate', float('nan')):.3f} | "
                     f"{sp.get('padded_share_update', float('nan')):.3f} | {r['steps_timed']} |")
    lines += ["", f"**ratio (tokens/s, median): {result['ratio_tokens_per_s']:.2f}x** "
              f"(best step vs best step: {result['ratio_tokens_per_s_best']:.2f}x)"]
    if "ratio_tokens_per_cpu_s" in result:
        lines += ["", f"Per CPU second of each process (its own cost on the shared machine): verl "
                  f"{result['verl']['tokens_per_cpu_s']:.1f}, TRL {result['trl']['tokens_per_cpu_s']:.1f} "
                  f"tokens/CPU-s, "
                  f"ratio {result['ratio_tokens_per_cpu_s']:.2f}x"]
    if "floor_generate_s" in f:
        lines += ["", "| side | phase | s/step | GFLOP (floor's count) | floor s | share of the floor |",
                  "|---" * 6 + "|"]
        for side in ("verl", "trl"):
            sp = result[side].get("split", {})
            for phase in ("generate", "log_prob", "update", "sync"):
                secs = sp.get(f"{phase}_s", 0.0)
                gf, fs = f.get(f"gflop_{phase}"), f.get(f"floor_{phase}_s")
                share = f"{fs / secs:.0%}" if fs and secs else "-"
                lines.append(f"| {side} | {phase} | {secs:.1f} | {'-' if gf is None else f'{gf:.0f}'} | "
                             f"{'-' if fs is None else f'{fs:.1f}'} | {share} |")
    lines += ["",
              f"Compute floor: {f['gflop_per_step']:.0f} GFLOP/step of matmuls at {f['gemm_gflops_1thread']:.0f} "
              f"GFLOP/s (1 thread) = {f['floor_s_per_step']:.1f} s/step = {f['floor_tokens_per_s']:.1f} tokens/s; "
              f"the most any fp32 implementation could reach against TRL here: {f['max_ratio_vs_trl']:.2f}x; verl "
              f"runs at {100 * f['verl_fraction_of_floor']:.0f}% of it. Prompt tokens are "
              f"{100 * f['prompt_share_of_training_flops']:.0f}% of the training matmul FLOPs."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    names = ["verl", "TRL"]
    vals = [result["verl"]["tokens_per_s"], result["trl"]["tokens_per_s"]]
    axes[0].bar(names, vals, color=["tab:blue", "tab:gray"])
    axes[0].axhline(result["compute_floor"]["floor_tokens_per_s"], color="tab:red", linestyle="--",
                    label="compute floor (matmul FLOPs / GEMM rate)")
    axes[0].axhline(2 * vals[1], color="tab:green", linestyle=":", label="target: 2x TRL")
    axes[0].legend(fontsize=7, loc="lower right")
    axes[0].set_title(f"{result['config']['workload']}: tokens/s, 1 proc 1 thread "
                      f"(x{result['ratio_tokens_per_s']:.2f})", fontsize=9)
    split = [(s, result[s].get("split", {})) for s in ("verl", "trl")]
    bottom = [0.0, 0.0]
    for part in ("generate_s", "log_prob_s", "update_s", "other_s"):
        h = [sp.get(part, 0.0) for _, sp in split]
        axes[1].bar(names, h, bottom=bottom, label=part[:-2])
        bottom = [b + x for b, x in zip(bottom, h)]
    axes[1].set_ylabel("s per step (mean of timed steps)")
    axes[1].legend(fontsize=7)
    axes[1].set_title("step split")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(wl: Workload, args, assets, runs: list[tuple[dict, dict]], steps: int) -> dict:
    """The result of the rounds: both sides' summaries, step splits and padded shares, ratios, compute floor."""
    verl_runs, trl_runs = [v for v, _ in runs], [t for _, t in runs]
    result = {"config": {"workload": wl.name, "prompts": PROMPTS, "samples": SAMPLES, "new_tokens": wl.new_tokens,
                         "ignore_eos": wl.ignore_eos, "trl_steps": steps, "rounds": len(runs), "threads": 1,
                         "command": args.run_info.command},
              "verl": {**summarise(wl, verl_runs), "raw": verl_runs,
                       "split": step_split(verl_runs, "verl", "actor.padding_free=false" not in wl.verl_args)},
              "trl": {**summarise(wl, trl_runs), "split": step_split(trl_runs, "trl"), "raw": trl_runs}}
    result["ratio_tokens_per_s"] = result["verl"]["tokens_per_s"] / result["trl"]["tokens_per_s"]
    result["ratio_tokens_per_s_best"] = result["verl"]["tokens_per_s_best"] / result["trl"]["tokens_per_s_best"]
    if "tokens_per_cpu_s" in result["verl"] and "tokens_per_cpu_s" in result["trl"]:
        result["ratio_tokens_per_cpu_s"] = result["verl"]["tokens_per_cpu_s"] / result["trl"]["tokens_per_cpu_s"]
    length = statistics.mean([result["verl"]["mean_response_length"], result["trl"]["mean_response_length"]])
    floor = compute_floor(assets[0], assets[2], length)
    floor["max_ratio_vs_trl"] = floor["floor_tokens_per_s"] / result["trl"]["tokens_per_s"]
    floor["verl_fraction_of_floor"] = result["verl"]["tokens_per_s"] / floor["floor_tokens_per_s"]
    for side in ("verl", "trl"):  # each phase's share of its own floor (1 = at the floor)
        sp = result[side]["split"]
        for phase in ("generate", "update"):
            if sp.get(f"{phase}_s"):
                sp[f"floor_share_{phase}"] = floor[f"floor_{phase}_s"] / sp[f"{phase}_s"]
    result["compute_floor"] = floor
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny: 5 TRL steps x 2 rounds, no scaling (default)")
    mode.add_argument("--full", action="store_true", help="tiny: 8 TRL steps x 3 rounds plus scaling over 1, 2, 4")
    ap.add_argument("--steps", type=int, default=None, help="TRL steps per round (smollm2-gsm8k default: 3)")
    ap.add_argument("--rounds", type=int, default=None, help="side-by-side rounds (smollm2-gsm8k default: 1)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop a round after this long and time the steps both sides finished (a loaded machine)")
    ap.add_argument("--verl", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra overrides of verl's job (e.g. actor.padding_free=false)")
    ap.add_argument("--trl-python", default=None,
                    help="the TRL environment's python (default: bash scripts/setup_env.sh trl, which builds it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    args.run_info = RunInfo.start()
    if args.trl_python is None:
        venv = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh"), "trl"], capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1]
        args.trl_python = str(Path(venv) / "bin" / "python")
    wl = WORKLOADS[args.workload]
    wl.verl_args = [*wl.verl_args, *args.verl]
    steps, rounds = ((8, 3) if args.full else (5, 2)) if wl.name == "tiny" else (3, 1)
    steps, rounds = args.steps or steps, args.rounds or rounds
    suffix = "" if wl.name == "tiny" else "_" + wl.name.split("-")[0]
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"e2e_grpo_vs_trl{suffix}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets = build_assets(work, wl)
        limit = None if args.max_minutes is None else 60 * args.max_minutes
        runs = [side_by_side(wl, assets, steps, work, str(r), args.trl_python, limit) for r in range(rounds)]
        result = report(wl, args, assets, runs, steps)
        if args.full and wl.name == "tiny":
            result["scaling"] = []
            for nproc in (1, 2, 4):
                r = run_verl(wl, assets[0], assets[1], steps, work / f"scale{nproc}", nproc=nproc)
                r["all"] = list(range(1, len(r["step_s"])))
                result["scaling"].append({"nproc": nproc, **summarise(wl, [r], nproc, key="all")})
    result = write_result(out.with_suffix(".json"), result, args.run_info)
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    for r in result.get("scaling", []):
        print(f"nproc={r['nproc']}: {r['tokens_per_s']:.0f} tokens/s total, {r['s_per_step']:.2f} s/step")


if __name__ == "__main__":
    main()
