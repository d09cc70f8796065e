"""TRL side of bench_grpo_vs_trl.py: GRPOTrainer on the shared tiny model and prompts, run in the TRL venv.

    python _trl_worker.py MODEL_DIR PROMPTS.jsonl STEPS OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def exact_number(completions, answer, **kwargs):
    """The arithmetic reward (first number of the completion equals the answer), as a TRL reward function."""
    import re
    out = []
    for c, a in zip(completions, answer):
        m = re.search(r"-?\d+", c)
        out.append(1.0 if m is not None and m.group(0) == a else 0.0)
    return out


class StepTimer(TrainerCallback):
    def __init__(self):
        self.starts, self.ends = [], []

    def on_step_begin(self, args, state, control, **kw):
        self.starts.append(time.time())

    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.time())


def main(model_dir: str, prompts_path: str, steps: int, out_path: str, n: int, new_tokens: int) -> None:
    rows = [json.loads(line) for line in open(prompts_path)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ds = Dataset.from_dict({"prompt": [tok.bos_token + r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
    cfg = GRPOConfig(output_dir="/tmp/verl-bench-trl", use_cpu=True, bf16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=len(rows) * n, num_generations=n, max_completion_length=new_tokens,
                     generation_kwargs={"min_new_tokens": new_tokens}, learning_rate=1e-4, max_steps=steps,
                     logging_steps=1, report_to=[], save_strategy="no", beta=0.0, temperature=1.0,
                     dataloader_num_workers=0, seed=1, shuffle_dataset=False, disable_tqdm=True)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_number, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
    trainer.train()
    step_s = [e - s for s, e in zip(timer.starts, timer.ends)]
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    json.dump({"step_s": step_s, "step_end": timer.ends, "mean_completion_length": lengths}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
