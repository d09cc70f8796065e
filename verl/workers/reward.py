"""Reward workers: rule-based (a registered function per response) and model-based (a sequence-classification
reward model scoring prompt + response)."""

from __future__ import annotations

from pathlib import Path

import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rewards import get_reward, score_batch
from verl.workers.batch import RolloutBatch


class RuleRewardWorker:
    def __init__(self, name: str):
        self.name, self.fn = name, get_reward(name)

    def score(self, batch: RolloutBatch) -> torch.Tensor:
        return score_batch(self.fn, batch.response_texts, batch.answers, batch.prompts, name=self.name)


class ModelRewardWorker:
    """Scores with `AutoModelForSequenceClassification` (first logit of the last real token)."""

    def __init__(self, path: str, device: torch.device, micro_batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        if not Path(path).is_dir():
            raise VerlConfigError(f"reward.model_path={path!r} is not a directory; give a Hugging Face "
                                  f"sequence-classification model directory")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        self.device, self.micro_batch_size = device, micro_batch_size

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> torch.Tensor:
        texts = [p + r for p, r in zip(batch.prompts, batch.response_texts)]
        out = []
        for i in range(0, len(texts), self.micro_batch_size):
            enc = self.tokenizer(texts[i:i + self.micro_batch_size], return_tensors="pt", padding=True).to(self.device)
            out.append(self.model(**enc).logits[:, 0].float().cpu())
        scores = torch.cat(out)
        if not torch.isfinite(scores).all():
            raise VerlRuntimeError("reward model returned NaN/inf scores", node="reward")
        return scores


def build_reward(cfg, device: torch.device):
    if cfg.type == "model":
        return ModelRewardWorker(cfg.model_path, device)
    return RuleRewardWorker(cfg.name)
