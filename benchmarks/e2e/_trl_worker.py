"""TRL side of bench_grpo_vs_trl.py: GRPOTrainer on the shared model and prompts, run in the TRL venv.

    python _trl_worker.py SPEC.json       # written by bench_grpo_vs_trl.py; the result goes to spec["out"]

Prompts reach the model exactly as TRL tokenizes them (plain text: the tokenizer's own special-token rule;
chat messages: the chat template), and the first step checks them against the ids verl's Tokenizer.encode_prompt
gives (spec["prompt_ids"]): a mismatch stops the run instead of comparing two different workloads. Besides
the step times, the worker records the step split (generate / log-prob passes outside the loss / the rest of
scoring / update) and the padded share of the positions the generation and the update compute.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import torch

torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def exact_number(completions, answer, **kwargs):
    """The arithmetic reward (first number of the completion equals the answer), as a TRL reward function."""
    out = []
    for c, a in zip(completions, answer):
        m = re.search(r"-?\d+", c)
        out.append(1.0 if m is not None and m.group(0) == a else 0.0)
    return out


def gsm_rewards():
    """verl's own gsm_symbolic + 0.1 x gsm8k_format rules (verl is importable: PYTHONPATH), on chat completions."""
    from verl.rewards.rule_based import gsm8k_format_reward, gsm_symbolic_reward

    def text(c):
        return c[-1]["content"] if isinstance(c, list) else c

    def gsm_symbolic(completions, answer, **kwargs):
        return [gsm_symbolic_reward(text(c), a) for c, a in zip(completions, answer)]

    def gsm8k_format(completions, **kwargs):
        return [gsm8k_format_reward(text(c)) for c in completions]
    return [gsm_symbolic, gsm8k_format], [1.0, 0.1]


class StepTimer(TrainerCallback):
    """Step start/end times; after every step the result so far is written (`dump`), so a run stopped by
    the benchmark's time limit still reports the steps it finished."""

    def __init__(self, dump):
        self.starts, self.ends, self.cpu, self.dump = [], [], [], dump

    def on_step_begin(self, args, state, control, **kw):
        self.starts.append(time.time())
        self.cpu.append(time.process_time())

    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.time())
        self.cpu[-1] = time.process_time() - self.cpu[-1]
        self.dump()


class Probe:
    """Per-step seconds of TRL's phases and the positions each computes, by wrapping the trainer's methods."""

    def __init__(self, trainer, model, expected_prompt_ids: list[list[int]] | None, eos_ids: list[int]):
        self.rec: list[dict] = []
        self.in_loss = False
        self.expected, self.eos = expected_prompt_ids, set(eos_ids)
        self._wrap(model, "generate", self._generate)
        self._wrap(trainer, "_generate_and_score_completions", self._scoring)
        self._wrap(trainer, "_get_per_token_logps_and_entropies", self._logps)
        self._wrap(trainer, "compute_loss", self._loss)
        self._wrap(trainer, "_tokenize_prompts", self._tokenized)

    @staticmethod
    def _wrap(obj, name, hook):
        inner = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: hook(inner, *a, **k))

    def _cur(self) -> dict:
        return self.rec[-1]

    def _scoring(self, inner, *a, **k):
        self.rec.append({"generate_s": 0.0, "logprob_s": 0.0, "gen_positions": 0, "gen_valid": 0})
        t0 = time.perf_counter()
        out = inner(*a, **k)
        self._cur()["scoring_s"] = time.perf_counter() - t0
        return out

    def _tokenized(self, inner, prompts, *a, **k):
        out = inner(prompts, *a, **k)
        if self.expected is not None and len(self.rec) <= 1:
            got = sorted(tuple(p) for p in out[0])
            want = sorted(tuple(p) for p in self.expected for _ in range(len(got) // len(self.expected)))
            if got != want:
                raise SystemExit(f"TRL tokenized the prompts differently from verl: first TRL prompt {got[0][:12]}..."
                                 f" vs verl {want[0][:12]}...")
        return out

    def _generate(self, inner, *a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        mask = k["attention_mask"]
        B, P = mask.shape
        steps = out.shape[1] - P  # generate runs every row for every step until all rows finished
        lengths = []
        for row in out[:, P:].tolist():
            stop = next((i for i, t in enumerate(row) if t in self.eos), None)
            lengths.append(len(row) if stop is None else stop + 1)
        cur = self._cur()
        cur["generate_s"] += time.perf_counter() - t0
        cur["gen_positions"] += B * P + B * max(steps - 1, 0)
        cur["gen_valid"] += int(mask.sum()) + sum(n - 1 for n in lengths)
        cur["response_tokens"] = sum(lengths)
        return out

    def _logps(self, inner, *a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        if not self.in_loss:
            self._cur()["logprob_s"] += time.perf_counter() - t0
        return out

    def _loss(self, inner, model, inputs, *a, **k):
        self.in_loss = True
        try:
            out = inner(model, inputs, *a, **k)
        finally:
            self.in_loss = False
        masks = (inputs["prompt_mask"], inputs["completion_mask"])
        cur = self._cur()  # one call per micro-batch (gradient accumulation): the step's sums
        cur["update_positions"] = cur.get("update_positions", 0) + sum(m.numel() for m in masks)
        cur["update_valid"] = cur.get("update_valid", 0) + int(sum(m.sum() for m in masks))
        return out


def main(spec: dict) -> None:
    rows = [json.loads(line) for line in open(spec["prompts"])]
    n, model_dir = spec["n"], spec["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
    funcs, weights = gsm_rewards() if spec["reward"] == "gsm" else ([exact_number], None)
    extra = {"generation_kwargs": {"min_new_tokens": spec["new_tokens"]}} if spec["ignore_eos"] else {}
    accumulate = len(rows) * n // spec["micro_batch"]
    cfg = GRPOConfig(output_dir="/tmp/verl-bench-trl", use_cpu=True, bf16=False, gradient_checkpointing=False,
                     # micro-batches of spec["micro_batch"] responses, one optimizer step and one generation
                     # of all len(rows) * n responses per step (as verl's actor.micro_batch_size)
                     per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=accumulate,
                     steps_per_generation=accumulate, num_generations=n,
                     max_completion_length=spec["new_tokens"], learning_rate=spec["lr"], max_steps=spec["steps"],
                     logging_steps=1, report_to=[], save_strategy="no", beta=0.0, temperature=1.0,
                     reward_weights=weights, dataloader_num_workers=0, seed=1, shuffle_dataset=False,
                     disable_tqdm=True, **extra)
    probe = None

    def dump():
        step_s = [e - s for s, e in zip(timer.starts, timer.ends)]
        recs = [dict(r) for r in probe.rec[:len(step_s)]]
        for rec, s in zip(recs, step_s):
            rec["other_scoring_s"] = rec.pop("scoring_s") - rec["generate_s"] - rec["logprob_s"]
            rec["update_s"] = s - rec["generate_s"] - rec["logprob_s"] - rec["other_scoring_s"]
        lengths = [r["response_tokens"] / (len(rows) * n) for r in recs]
        with open(spec["out"] + ".tmp", "w") as f:
            json.dump({"step_s": step_s, "step_end": timer.ends, "step_cpu_s": timer.cpu[:len(step_s)],
                       "mean_response_length": lengths, "steps": recs}, f)
        os.replace(spec["out"] + ".tmp", spec["out"])

    timer = StepTimer(dump)
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
    probe = Probe(trainer, model, spec.get("prompt_ids"), trainer.eos_token_ids)
    trainer.train()


if __name__ == "__main__":
    main(json.load(open(sys.argv[1])))
