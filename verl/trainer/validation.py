"""Validation: the rollout engine answers the held-out prompts with the weights it holds (the current ones: in
trainer.mode=sync the weights reach it at the end of every step), and the job's reward scores the answers.

    validator = Validator(cfg, val_dataset, rollout, reward_fn, placement, out_dir)
    metrics = validator.run(step)      # collective: every rank calls it; every rank gets the same metrics

Metrics (`val.n` responses per prompt, sampled with val.temperature / top_p / top_k; greedy at temperature 0):
`val/reward_mean`, `val/<data_source>/reward_mean` per source, `val/pass@1` (the share of correct responses,
score >= val.correct_threshold: the held-out accuracy), and with n > 1 `val/mean@n` and `val/pass@j` for
j = 2, 4, ... up to n (the unbiased estimate 1 - C(n - c, j) / C(n, j) that one of j samples is correct, c of
the prompt's n being correct, averaged over prompts); `val/response_length`, `timing/validation_s`. With
val.log_generations = N the first N prompts, their responses and scores are appended to
<output_dir>/val_generations.jsonl.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch.distributed as dist

from verl.config.ppo import PPOConfig
from verl.data import PromptDataset
from verl.distributed import Placement
from verl.errors import VerlConfigError

__all__ = ["Validator", "pass_at_k", "validation_due"]

VAL_SEED = 104_729
"""Seed of validation's sampling (the same draws at every validation, so curves compare weights, not luck)."""


def validation_due(cfg: PPOConfig, step: int) -> bool:
    """After training step `step`: every trainer.test_freq steps, and after the last one."""
    freq = cfg.trainer.test_freq
    return freq > 0 and (step % freq == 0 or step == cfg.trainer.total_steps)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c of n samples correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Validator:
    """Held-out evaluation of one job (see the module docstring)."""

    def __init__(self, cfg: PPOConfig, dataset: PromptDataset, rollout, reward_fn, placement: Placement,
                 out_dir: Path):
        self.cfg, self.dataset, self.rollout, self.placement, self.out_dir = cfg, dataset, rollout, placement, out_dir
        self.reward_fn = reward_fn
        if rollout is not None and reward_fn is None:  # split placement: the reward's ranks are elsewhere
            if cfg.reward.uses_model:
                raise VerlConfigError("validation scores on the rollout's ranks, but the reward model runs on "
                                      "reward.ranks apart from them; use trainer.placement=colocated, or leave "
                                      "data.val_files empty and val.num_examples=0")
            from verl.workers import build_reward
            self.reward_fn = build_reward(cfg.reward, placement.device, cfg.rollout.max_new_tokens)

    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        v = self.cfg.val
        chunk = v.batch_size or self.cfg.data.train_batch_size
        samples: list[tuple] = []
        for start in range(0, len(self.dataset), chunk):
            samples += self._chunk(list(range(start, min(start + chunk, len(self.dataset)))))
        everyone = [samples]
        if self.placement.distributed:
            everyone = [None] * self.placement.world_size
            dist.all_gather_object(everyone, samples)
        by_key = {(s[0], s[1]): s for part in everyone for s in part}  # model-parallel peers report alike
        ordered = [by_key[k] for k in sorted(by_key)]
        metrics = self._metrics(ordered)
        metrics["timing/validation_s"] = time.perf_counter() - t0
        if v.log_generations and self.placement.is_main:
            self._log(step, ordered)
        return metrics

    def _chunk(self, index: list[int]) -> list[tuple]:
        """(row, sample, data source, score, correct, length, response) of this rank's share of rows `index`."""
        if self.rollout is None:
            return []
        # rows padded with copies to a multiple of the ranks that split them; the copies are dropped below
        p = self.rollout.placement
        parts = math.lcm(p.dp_size, p.world_size // self.rollout.cfg.tp)  # the training and generation splits
        padded = index + [index[i % len(index)] for i in range(-len(index) % parts)]
        v = self.cfg.val
        sampling = {"temperature": v.temperature, "top_p": v.top_p, "top_k": v.top_k}
        batch = self.rollout.generate([self.dataset[i] for i in padded], n=v.n, greedy=v.temperature == 0,
                                      seed=VAL_SEED, sampling=sampling)
        # the engine's counters (padded share, agent metrics) describe the training steps' generation: validation's
        # would otherwise land in the next step's metrics (and a recovered run, which does not validate again
        # at the step it resumes from, would log other values there than the uninterrupted run)
        self.rollout.take_metrics()
        rows = padded[self.rollout.rows_of_rank(len(padded))]
        scores = self.reward_fn.score(batch).tolist()
        lengths = batch.response_mask.sum(-1).tolist()
        out, seen = [], set()
        for j, score in enumerate(scores):
            row = rows[j // v.n]
            if (row, j % v.n) in seen:
                continue
            seen.add((row, j % v.n))
            out.append((row, j % v.n, batch.data_sources[j], score, score >= v.correct_threshold, lengths[j],
                        batch.response_texts[j]))
        return out

    def _metrics(self, samples: list[tuple]) -> dict[str, float]:
        n = self.cfg.val.n
        m = {"val/reward_mean": _mean([s[3] for s in samples]), "val/response_length": _mean([s[5] for s in samples])}
        for source in sorted({s[2] for s in samples}):
            m[f"val/{source}/reward_mean"] = _mean([s[3] for s in samples if s[2] == source])
        correct: dict[int, int] = {}
        for s in samples:
            correct[s[0]] = correct.get(s[0], 0) + int(s[4])
        k = 1
        while k <= n:
            m[f"val/pass@{k}"] = _mean([pass_at_k(n, c, k) for c in correct.values()])
            k *= 2
        if n > 1:
            m[f"val/pass@{n}"] = _mean([pass_at_k(n, c, n) for c in correct.values()])
            m[f"val/mean@{n}"] = m["val/reward_mean"]
        return m

    def _log(self, step: int, samples: list[tuple]) -> None:
        keep = self.cfg.val.log_generations
        with (self.out_dir / "val_generations.jsonl").open("a") as f:
            for row, j, source, score, _, _, text in samples:
                if row < keep:
                    f.write(json.dumps({"step": step, "row": row, "sample": j, "data_source": source,
                                        "prompt": self.dataset.prompts[row], "ground_truth": self.dataset.answers[row],
                                        "response": text, "score": score}) + "\n")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
