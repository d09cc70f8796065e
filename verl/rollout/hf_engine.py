"""The `hf` rollout engine: Hugging Face `generate` on a causal LM, behind verl's rollout interface.

The reference engine: whatever transformers' `generate` does (its logits processors, its cache) is what it
samples with. Sampling draws from the global torch RNG, forked and seeded per call when SamplingParams.seed
is set (so one call is reproducible, but sample j of prompt i is not the same stream as in the torch / vLLM
engines, which seed every sample on its own). Log-probs are those of the processed distribution
(temperature, top-k and top-p applied), read from the scores `generate` returns.
"""

from __future__ import annotations

import torch

from verl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from verl.rollout.config import RolloutConfig
from verl.rollout.tokenizer import Tokenizer
from verl.rollout.torch_engine import TorchRollout, model_length_limit, model_vocab_size

__all__ = ["HFRollout"]


class HFRollout(TorchRollout):
    """The torch engine (weights, devices, release/resume) with transformers' `generate` as its decoder, in
    left-padded batches of `config.max_batch_size` sequences."""

    name = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer, config: RolloutConfig | None = None):
        config = config or RolloutConfig(engine="hf")
        RolloutEngine.__init__(self, Tokenizer.wrap(tokenizer), max_model_len=model_length_limit(config, model))
        self.vocab_size = model_vocab_size(model)
        self.model, self.config = model, config
        self._offloaded, self._fast = None, None
        self.stats = self._new_stats()  # read by take_metrics, as in torch

    @torch.inference_mode()
    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        jobs = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
        was_training = self.model.training
        self.model.eval()
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda", torch.cuda.current_device()))
        try:
            with torch.random.fork_rng(devices=[d.index for d in devices if d.type == "cuda"],
                                       enabled=params.seed is not None):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                out: list[GenerationOutput] = []
                for b in range(0, len(jobs), self.config.max_batch_size):
                    out += self._generate_batch(jobs[b:b + self.config.max_batch_size], prompt_ids, params)
        finally:
            self.model.train(was_training)
        return out

    def _generate_turns(self, requests, params: SamplingParams) -> list[GenerationOutput]:
        """Multi-turn waves (verl.agents): `generate` draws from one RNG per call, so a wave is one call seeded by
        its first turn, each turn cut to its own budget (RolloutEngine's way; the torch engine's per-row streams
        are its decoder's)."""
        return RolloutEngine._generate_turns(self, requests, params)

    def _generate_batch(self, batch, prompt_ids, params: SamplingParams) -> list[GenerationOutput]:
        prompts = [prompt_ids[i] for i, _ in batch]
        ids, mask = self.tokenizer.pad(prompts, side="left")
        dev = self.model.get_input_embeddings().weight.device
        ids, mask = ids.to(dev), mask.to(dev)
        budgets = [self.budget(len(p), params) for p in prompts]
        stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else
                                                        set(self.tokenizer.eos_token_ids)))
        sampling = dict(do_sample=False) if params.greedy else dict(
            do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
        extra = dict(stop_strings=list(params.stop), tokenizer=self.tokenizer.hf) if params.stop else {}
        res = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets),
                                  pad_token_id=self.tokenizer.pad_token_id, eos_token_id=stop_ids or None,
                                  use_cache=True, return_dict_in_generate=True, output_scores=params.logprobs,
                                  **sampling, **extra)
        gen = res.sequences[:, ids.shape[1]:].cpu()
        # generate computes every row of the left-padded batch at every step: prompt padding and finished rows
        self.stats["positions"] += res.sequences.numel()
        self.stats["valid_positions"] += int(mask.sum())
        lp = None
        if params.logprobs:
            # generate's scores are the processed logits of each step (warpers applied): the sampling distribution
            scores = torch.stack(res.scores, 1).float().cpu()
            lp = scores.log_softmax(-1).gather(-1, gen[:, :scores.shape[1], None])[..., 0]
        outs = []
        for r, (i, j) in enumerate(batch):
            tokens, reason = [], "length"
            for t in gen[r, :budgets[r]].tolist():
                tokens.append(t)
                if t in stop_ids:
                    reason = "stop"
                    break
            if params.stop and reason == "length":
                tokens, reason = self._cut_at_stop_string(tokens, params.stop)
            lps = lp[r, :len(tokens)].tolist() if lp is not None else None
            self.stats["valid_positions"] += len(tokens)
            outs.append(self._finish(i, j, prompts[r], tokens, reason, lps, params.stop))
        return outs

    def _cut_at_stop_string(self, tokens: list[int], stop) -> tuple[list[int], str]:
        """generate pads a row after its stop string; keep the tokens up to the one completing it."""
        for k in range(1, len(tokens) + 1):
            if any(x in self.tokenizer.decode(tokens[:k]) for x in stop):
                return tokens[:k], "stop"
        return tokens, "length"
