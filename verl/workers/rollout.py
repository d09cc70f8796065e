"""Rollout worker: turns prompt rows into a `RolloutBatch` of n sampled responses per prompt.

Engines: ``hf`` (Hugging Face ``generate`` on the actor's own module, so weights are always current) and
``torch`` (verl's batched KV-cache engine, `verl.rollout`, which receives the actor's weights through
``update_weights`` at the sync_weights phase).
"""

from __future__ import annotations

import torch

from verl.config.ppo import RolloutConfig
from verl.errors import VerlConfigError
from verl.workers.batch import RolloutBatch


def encode_prompts(tokenizer, prompts: list[str], max_prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BOS + prompt tokens, left-padded: (input_ids, attention_mask) [N, P]."""
    ids = [[tokenizer.bos_token_id] + tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    longest = max(len(x) for x in ids)
    if longest > max_prompt_length:
        worst = prompts[max(range(len(ids)), key=lambda i: len(ids[i]))]
        raise VerlConfigError(f"prompt {worst[:60]!r} is {longest} tokens, longer than data.max_prompt_length="
                              f"{max_prompt_length}; raise data.max_prompt_length or shorten the prompts")
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (longest - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (longest - len(x)) + [1] * len(x) for x in ids])
    return input_ids, mask


def assemble_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, eos_id: int,
                   pad_id: int, rows: list[dict], n: int, tokenizer) -> RolloutBatch:
    """Builds the batch from sampled token ids [B, R]: response mask up to and including the first EOS."""
    is_eos = responses == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    response_mask = (~after_eos).float()
    responses = responses.masked_fill(after_eos, pad_id)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    texts = tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(responses, response_mask)],
                                   skip_special_tokens=True)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, responses], dim=1), attention_mask=attention_mask,
        position_ids=position_ids, response_mask=response_mask,
        group=torch.arange(len(rows), device=responses.device).repeat_interleave(n),
        prompts=[r["prompt"] for r in rows for _ in range(n)], answers=[r["answer"] for r in rows for _ in range(n)],
        response_texts=texts)


class HFRollout:
    """Sampling with `model.generate` (KV cache) on the actor's module itself."""

    def __init__(self, module: torch.nn.Module, tokenizer, cfg: RolloutConfig, max_prompt_length: int,
                 device: torch.device):
        self.module, self.tokenizer, self.cfg = module, tokenizer, cfg
        self.max_prompt_length, self.device = max_prompt_length, device

    @torch.no_grad()
    def generate(self, rows: list[dict], n: int | None = None, greedy: bool = False) -> RolloutBatch:
        n = self.cfg.n if n is None else n
        tok, cfg = self.tokenizer, self.cfg
        ids, mask = encode_prompts(tok, [r["prompt"] for r in rows], self.max_prompt_length)
        ids, mask = ids.repeat_interleave(n, 0).to(self.device), mask.repeat_interleave(n, 0).to(self.device)
        was_training = self.module.training
        self.module.eval()
        sampling = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
        out = self.module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                   min_new_tokens=cfg.max_new_tokens if cfg.ignore_eos else 0,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, use_cache=True,
                                   **sampling)
        self.module.train(was_training)
        responses = out[:, ids.shape[1]:]
        if responses.shape[1] < cfg.max_new_tokens:  # every sequence stopped early
            fill = torch.full((len(responses), cfg.max_new_tokens - responses.shape[1]), tok.pad_token_id,
                              dtype=responses.dtype, device=responses.device)
            responses = torch.cat([responses, fill], dim=1)
        eos = -1 if cfg.ignore_eos else tok.eos_token_id
        return assemble_batch(ids, mask, responses, eos, tok.pad_token_id, rows, n, tok)

    def sync_weights(self, actor) -> int:
        """Refreshes the generation weights from the actor; returns the bytes moved. A torch-engine actor
        trains this very module (nothing to move); a megatron actor hands over its gathered HF weights."""
        if getattr(actor.engine, "module", None) is self.module:
            return 0
        weights = actor.hf_weights()
        missing, unexpected = self.module.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(self.module.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"actor weights do not fit the rollout model: missing {sorted(set(missing) - tied)}, "
                               f"unexpected {sorted(unexpected)}")
        return sum(t.numel() * t.element_size() for t in weights.values())


def build_rollout(module, tokenizer, cfg: RolloutConfig, max_prompt_length: int, device: torch.device):
    if cfg.engine == "hf":
        return HFRollout(module, tokenizer, cfg, max_prompt_length, device)
    try:
        import verl.rollout  # noqa: F401
    except ImportError:
        return HFRollout(module, tokenizer, cfg, max_prompt_length, device)
    from verl.workers.torch_rollout import TorchEngineRollout
    return TorchEngineRollout(module, tokenizer, cfg, max_prompt_length, device)
