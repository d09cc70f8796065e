"""verl.rollout's `torch` engine (batched KV-cache sampling) behind the rollout-worker interface."""

from __future__ import annotations

import torch

from verl.config.ppo import RolloutConfig
from verl.workers.batch import RolloutBatch
from verl.workers.rollout import assemble_batch, encode_prompts


class TorchEngineRollout:
    """Generates with `verl.rollout.TorchRollout` on the given module; weights arrive via `update_weights`."""

    def __init__(self, module: torch.nn.Module, tokenizer, cfg: RolloutConfig, max_prompt_length: int,
                 device: torch.device):
        from verl.rollout import TorchRollout, TorchRolloutConfig
        self.module, self.tokenizer, self.cfg = module, tokenizer, cfg
        self.max_prompt_length, self.device = max_prompt_length, device
        self.engine = TorchRollout(module, tokenizer, TorchRolloutConfig(max_batch_size=1 << 16,
                                                                        fast_decoder=cfg.fast_decoder))

    @torch.no_grad()
    def generate(self, rows: list[dict], n: int | None = None, greedy: bool = False) -> RolloutBatch:
        from verl.rollout import SamplingParams
        n = self.cfg.n if n is None else n
        tok, cfg = self.tokenizer, self.cfg
        ids, mask = encode_prompts(tok, [r["prompt"] for r in rows], self.max_prompt_length)
        prompt_ids = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, n=n, ignore_eos=cfg.ignore_eos,
                                temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
        was_training = self.module.training
        outs = self.engine.generate(prompt_ids, params)  # prompt-major: p0s0, p0s1, ..., p1s0, ...
        self.module.train(was_training)
        responses = torch.full((len(outs), cfg.max_new_tokens), tok.pad_token_id, dtype=torch.long)
        for r, o in enumerate(outs):
            responses[r, :len(o.token_ids)] = torch.tensor(o.token_ids[:cfg.max_new_tokens], dtype=torch.long)
        eos = -1 if cfg.ignore_eos else tok.eos_token_id
        return assemble_batch(ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), responses, eos,
                              tok.pad_token_id, rows, n, tok)

    def sync_weights(self, actor) -> int:
        """Nothing to move when the actor trains this module; otherwise stream its HF-named weights in."""
        if getattr(actor.engine, "module", None) is self.module:
            return 0
        weights = actor.hf_weights()
        self.engine.update_weights(weights.items())
        return sum(t.numel() * t.element_size() for t in weights.values())
