"""Reward workers: rule-based sources (a registered function per response), model-based sources (a reward model
scoring prompt + response) and `RewardWorker`, the weighted ensemble of them that the PPO dataflow's `reward` node
calls. `build_reward(cfg, device)` builds it from a `RewardConfig`.

    score = sum_i weight_i * s_i      s_i = source i's scores, z-scored over the batch if it sets `normalize`

    reward:                           # or the one-source shorthand: reward: {type: model, model_path: ...}
      micro_batch_size: 16            # responses per reward-model forward
      sources:
        - {type: rule, name: arithmetic, weight: 1.0}
        - {type: model, model_path: /ckpt/rm, label: rm, weight: 0.5, normalize: true}

Model sources (`ModelRewardWorker`) read one of two directory formats:
- a Hugging Face sequence-classification model (`AutoModelForSequenceClassification`, one label): its first logit,
  which Hugging Face pools at the last non-padding token;
- a value-head model (`value_head.safetensors` beside a causal-LM or trunk directory, the format of
  `verl.workers.critic.ValueModel.save_pretrained`): the value at the last real token.

A reward model re-tokenizes text with its own tokenizer (the policy's token ids are never reused, so the two
vocabularies may differ): a text prompt is scored as `prompt + response`, encoded with the tokenizer's own special
tokens (e.g. its BOS; no EOS is appended); a chat prompt (a list of {"role", "content"} messages) is scored as the
reward tokenizer's chat template over the messages plus {"role": "assistant", "content": response}.

Metrics: `RewardWorker.score_with_metrics(batch)` returns (scores, metrics) with `reward/<source>/mean` and
`reward/<source>/std` of each source's raw scores, `reward/<key>/mean` of every numeric
entry a rule's dict results carry besides 'score' (`reward/<source>/<key>/mean` with several sources) and, with
`reward.overlong_buffer`, `reward/overlong_penalty/mean`; `score(batch)` returns the scores alone and keeps those
metrics in `last_metrics`. Every failure (a source raising, a NaN / inf score) is a `VerlRuntimeError` of the `reward`
node naming the source and the first bad sample index.
"""

from __future__ import annotations

from pathlib import Path

import torch

from verl.config.ppo import RewardConfig, RewardSourceConfig
from verl.errors import VerlConfigError, VerlRuntimeError, library_errors
from verl.rewards import get_reward, score_samples
from verl.workers.batch import RolloutBatch, micro_slices
from verl.workers.critic import VALUE_HEAD_FILE, ValueModel

__all__ = ["ModelRewardWorker", "RewardWorker", "RuleRewardWorker", "build_reward"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _first_bad(scores: torch.Tensor) -> int | None:
    bad = torch.nonzero(~torch.isfinite(scores))
    return int(bad[0, 0]) if len(bad) else None


class RuleRewardWorker:
    """A rule-based source: `fn(response, ground_truth, prompt)` per response, or upstream verl's compute_score
    (`verl.rewards`); the numeric extras of dict results of the last call are in `last_extra`."""

    def __init__(self, name: str, label: str | None = None):
        self.name, self.fn = name, get_reward(name)
        self.label = label or name
        self.last_extra: dict[str, torch.Tensor] = {}

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        scores, self.last_extra = score_samples(self.fn, batch.response_texts, batch.answers, batch.prompts,
                                                batch.data_sources or None, batch.extra_infos or None,
                                                name=self.label)
        return scores


class ModelRewardWorker:
    """A reward model (sequence-classification or value-head directory) scoring prompt + response text in
    micro-batches of `micro_batch_size`. `onload(device)` / `offload()` let the dataflow's `cpu_offload` keep it
    on the CPU between calls."""

    def __init__(self, path: str, device: torch.device, micro_batch_size: int = 32, *, label: str = "model",
                 tokenizer_path: str | None = None, dtype: torch.dtype = torch.float32, key: str = "reward"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        for what, p in (("model_path", path), ("tokenizer_path", tokenizer_path or path)):
            if not Path(p).is_dir():
                raise VerlConfigError(f"{key}.{what}={p!r} is not a directory; give a Hugging Face sequence-"
                                      f"classification model directory, or a value-head model directory "
                                      f"(ValueModel.save_pretrained)")
        self.label, self.device, self.micro_batch_size = label, torch.device(device), micro_batch_size
        tok_key = f"{key}.tokenizer_path" if tokenizer_path else f"{key}.model_path"
        with library_errors(f"{tok_key}={tokenizer_path or path!r}: cannot load its tokenizer",
                            f"put the tokenizer files (tokenizer.json or tokenizer.model with its config) there, "
                            f"or set {key}.tokenizer_path"):
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path)
        self.value_head = (Path(path) / VALUE_HEAD_FILE).is_file()
        with library_errors(f"{key}.model_path={path!r}: cannot load the reward model",
                            "give a sequence-classification model directory or a value-head model directory"):
            if self.value_head:
                self.model = ValueModel.from_pretrained(path, dtype=dtype)
                config = self.model.trunk.config
            else:
                self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
                config = self.model.config
            if config.num_labels != 1:
                raise VerlConfigError(f"{key}.model_path={path!r} has num_labels={config.num_labels}; a reward "
                                      f"model scores with one label (num_labels=1)")
        self.pad_id = next((i for i in (config.pad_token_id, self.tokenizer.pad_token_id,
                                        self.tokenizer.eos_token_id) if i is not None), 0)
        config.pad_token_id = self.pad_id  # HF's classifier pools at the last token that is not this id
        self.max_length = getattr(config, "max_position_embeddings", None)
        self.model.to(self.device).eval()

    def onload(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.model.to(self.device)

    def offload(self) -> None:
        self.model.to("cpu")

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> torch.Tensor:
        ids = self._encode(batch)
        out = []
        for sl in micro_slices(len(ids), self.micro_batch_size):
            try:
                out.append(self._forward(ids[sl]))
            except Exception as e:  # noqa: BLE001 - re-raised with the source and the samples it was scoring
                raise VerlRuntimeError(f"reward source {self.label!r} raised {type(e).__name__}: {e} on samples "
                                       f"{sl.start}..{sl.stop - 1} (first: {sl.start})", node="reward",
                                       cause=e) from e
        scores = torch.cat(out) if out else torch.zeros(0)
        i = _first_bad(scores)
        if i is not None:
            raise VerlRuntimeError(f"reward source {self.label!r} returned {scores[i].item()} for sample {i} "
                                   f"(response {batch.response_texts[i]!r}); a reward must be finite",
                                   node="reward")
        return scores

    def _encode(self, batch: RolloutBatch) -> list[list[int]]:
        """Token ids of prompt + response per sample, by the reward model's own tokenizer."""
        out = []
        for i, (prompt, response) in enumerate(zip(batch.prompts, batch.response_texts, strict=True)):
            if isinstance(prompt, str):
                ids = self.tokenizer(prompt + response)["input_ids"]
            elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
                if getattr(self.tokenizer, "chat_template", None) is None:
                    raise VerlRuntimeError(f"reward source {self.label!r}: sample {i} has a chat prompt but the "
                                           f"reward model's tokenizer has no chat template; give the reward "
                                           f"source a tokenizer_path with one, or text prompts", node="reward")
                text = self.tokenizer.apply_chat_template(
                    [*prompt, {"role": "assistant", "content": response}], tokenize=False)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                raise VerlRuntimeError(f"reward source {self.label!r}: the prompt of sample {i} is "
                                       f"{type(prompt).__name__}; a reward model re-tokenizes text, so prompts must "
                                       f"be text or chat messages", node="reward")
            if self.max_length is not None and len(ids) > self.max_length:
                raise VerlRuntimeError(f"reward source {self.label!r}: sample {i} is {len(ids)} tokens, longer "
                                       f"than the reward model's max_position_embeddings={self.max_length}",
                                       node="reward")
            out.append(ids)
        return out

    def _forward(self, ids: list[list[int]]) -> torch.Tensor:
        """[b] float32 scores of right-padded token ids."""
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for r, x in enumerate(ids):
            input_ids[r, :len(x)] = torch.tensor(x, dtype=torch.long)
            mask[r, :len(x)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        if not self.value_head:
            return self.model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float().cpu()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        values = self.model(input_ids, mask, positions)
        last = mask.sum(1) - 1
        return values[torch.arange(len(ids), device=values.device), last].float().cpu()


class RewardWorker:
    """The weighted ensemble of reward sources (one source is an ensemble of one, weight 1)."""

    def __init__(self, sources: list, configs: list[RewardSourceConfig], *, overlong_buffer: int = 0,
                 overlong_penalty_factor: float = 1.0, max_response_length: int = 0):
        if len(sources) != len(configs) or not sources:
            raise VerlConfigError(f"RewardWorker: {len(sources)} sources for {len(configs)} configs; give one "
                                  f"config per source (at least one)")
        if overlong_buffer and not 0 < overlong_buffer <= max_response_length:
            raise VerlConfigError(f"reward.overlong_buffer={overlong_buffer} must be at most the response length "
                                  f"limit rollout.max_new_tokens={max_response_length}")
        self.sources, self.configs = sources, configs
        self.overlong = (overlong_buffer, overlong_penalty_factor, max_response_length)
        self.last_metrics: dict[str, float] = {}

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        """[B] float32 scores; the per-source metrics of this call are left in `last_metrics`."""
        scores, self.last_metrics = self.score_with_metrics(batch)
        return scores

    def score_with_metrics(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        total = torch.zeros(len(batch), dtype=torch.float32)
        metrics: dict[str, float] = {}
        several = len(self.sources) > 1
        for src, cfg in zip(self.sources, self.configs):
            raw = self._score_source(src, batch)
            if len(raw):
                metrics[f"reward/{src.label}/mean"] = raw.mean().item()
                metrics[f"reward/{src.label}/std"] = raw.std(unbiased=False).item()
            for key, values in getattr(src, "last_extra", {}).items():
                if not values.isnan().all():
                    metrics[f"reward/{src.label}/{key}/mean" if several else f"reward/{key}/mean"] = \
                        values.nanmean().item()
            total += cfg.weight * (_zscore(raw) if cfg.normalize else raw)
        if self.overlong[0] and len(batch):
            penalty = self._overlong_penalty(batch)
            metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
            total += penalty
        i = _first_bad(total)
        if i is not None:  # finite sources whose weighted sum overflows
            raise VerlRuntimeError(f"the weighted sum of the reward sources is {total[i].item()} for sample {i}; "
                                   f"lower the reward.sources weights", node="reward")
        return total, metrics

    def _overlong_penalty(self, batch: RolloutBatch) -> torch.Tensor:
        """DAPO's soft overlong punishment: -factor x (length - (limit - buffer)) / buffer past limit - buffer."""
        buffer, factor, limit = self.overlong
        lengths = batch.response_mask.sum(-1).float().cpu()
        return torch.clamp(-(lengths - (limit - buffer)) / buffer * factor, max=0.0)

    @staticmethod
    def _score_source(src, batch: RolloutBatch) -> torch.Tensor:
        try:
            raw = src.score(batch)
        except VerlRuntimeError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised naming the source
            raise VerlRuntimeError(f"reward source {src.label!r} raised {type(e).__name__}: {e}", node="reward",
                                   cause=e) from e
        raw = torch.as_tensor(raw, dtype=torch.float32).reshape(-1).cpu()
        if len(raw) != len(batch):
            raise VerlRuntimeError(f"reward source {src.label!r} returned {len(raw)} scores for {len(batch)} "
                                   f"samples", node="reward")
        i = _first_bad(raw)
        if i is not None:
            raise VerlRuntimeError(f"reward source {src.label!r} returned {raw[i].item()} for sample {i}; a reward "
                                   f"must be finite", node="reward")
        return raw

    def onload(self, device: torch.device) -> None:
        for src in self.sources:
            if callable(getattr(src, "onload", None)):
                src.onload(device)

    def offload(self) -> None:
        for src in self.sources:
            if callable(getattr(src, "offload", None)):
                src.offload()


def _zscore(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std over the batch (population std, so one sample gives 0 rather than NaN); a constant batch
    only loses its mean, since dividing by a zero spread would blow up."""
    if not len(x):
        return x
    std = x.std(unbiased=False)
    return (x - x.mean()) / std if std > 0 else x - x.mean()


def build_reward(cfg: RewardConfig, device: torch.device, max_response_length: int = 0) -> RewardWorker:
    """The reward of a job: every source of `cfg` (its `sources`, or the one-source shorthand) on `device`;
    `max_response_length` (rollout.max_new_tokens) places reward.overlong_buffer."""
    cfg.check()
    configs = cfg.resolved_sources()
    workers = []
    for i, s in enumerate(configs):
        key = f"reward.sources[{i}]" if cfg.sources else "reward"
        if s.type == "rule":
            try:
                workers.append(RuleRewardWorker(s.name, s.display_name))
            except VerlConfigError as e:
                raise VerlConfigError(f"{key}.name: {e}") from None
        else:
            workers.append(ModelRewardWorker(s.model_path, device, cfg.micro_batch_size, label=s.display_name,
                                             tokenizer_path=s.tokenizer_path, dtype=_DTYPES[s.dtype], key=key))
    return RewardWorker(workers, configs, overlong_buffer=cfg.overlong_buffer,
                        overlong_penalty_factor=cfg.overlong_penalty_factor, max_response_length=max_response_length)
