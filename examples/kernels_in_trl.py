"""verl's kernels inside TRL: a `GRPOTrainer` whose loss runs through `verl.ops.linear_rl_loss`.

TRL 1.16's GRPOTrainer scores the completion tokens through its own chunked LM head (log-probs and entropy per
token, 4 GEMMs over the vocabulary with the backward's recompute) and then builds the clipped policy loss, the
KL term and the aggregation from [B, T] tensors in Python. `VerlGRPOTrainer` overrides one method,
`_compute_loss`: it runs the model's backbone, hands the completion positions' hidden states and the LM head
weight to verl's fused RL loss head, and gets the scalar loss whose gradients (to the hidden states and the
head weight) were made in the same pass: 3 GEMMs, one [rows, V] logits chunk at a time. The loss is TRL's,
term for term (policy loss `vanilla` = PPO clip without dual clip; KL `low_var_kl` = TRL's k3, or `k3+` for its
default bias-corrected k3 on-policy; the aggregation of each TRL `loss_type`); the metrics TRL logs are logged too.

What a user changes (the rest of a TRL script stays as it is):

    from trl import GRPOConfig
    from examples.kernels_in_trl import VerlGRPOTrainer      # was: from trl import GRPOTrainer
    trainer = VerlGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                              processing_class=tok)          # was: GRPOTrainer(...)
    trainer.train()

Fused: loss_type grpo / bnpo / dr_grpo / dapo / luspo, token-level importance sampling, beta >= 0, a static
entropy bonus with bnpo / dapo. A configuration the fused head does not cover (cispo / sapo / vespo, sequence-
level importance sampling, `delta`, the entropy mask, the off-policy mask, vLLM importance-sampling correction,
bias-corrected KL off-policy, the adaptive entropy bonus, MoE aux loss, vision inputs, an LM head with a bias or a logit
soft-cap / scale) runs TRL's own `_compute_loss`, named once in a warning. One process (or FSDP, whose hooks
sit on the modules): the backbone is called directly, outside a DDP wrapper's forward.

Run a short demonstration (a tiny Llama with a 32k vocabulary, built locally; needs TRL installed):

    PYTHONPATH=. python examples/kernels_in_trl.py --steps 2
Side-by-side figures against plain TRL: benchmarks/e2e/bench_trl_kernels.py.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
from trl import GRPOTrainer

import verl.ops as O

__all__ = ["VerlGRPOTrainer", "fused_unsupported"]

# TRL loss_type -> the aggregation of verl.ops (sequences counted as TRL does: every row, even an empty one).
_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
        "dapo": "token-mean", "luspo": "seq-mean-token-sum"}


def fused_unsupported(trainer: GRPOTrainer, inputs: dict) -> str | None:
    """Why this trainer's loss on `inputs` cannot run through the fused head, or None when it can."""
    args = trainer.args
    lm_head = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings()
    text_cfg = trainer.model.config.get_text_config()
    checks = [
        (trainer.loss_type not in _AGG, f"loss_type={trainer.loss_type!r}"),
        (trainer.importance_sampling_level != "token", "importance_sampling_level='sequence'"),
        (args.delta is not None, "delta (two-sided clipping)"),
        (trainer.top_entropy_quantile < 1.0, "top_entropy_quantile < 1"),
        (trainer.off_policy_mask_threshold is not None, "off_policy_mask_threshold"),
        (trainer.use_vllm and trainer.vllm_importance_sampling_correction, "vLLM importance-sampling correction"),
        (trainer.beta != 0.0 and args.use_bias_correction_kl and inputs.get("old_per_token_logps") is not None,
         "use_bias_correction_kl off-policy (num_iterations > 1 or vLLM)"),
        (trainer.use_adaptive_entropy, "use_adaptive_entropy"),
        (trainer.entropy_coef != 0.0 and trainer.loss_type not in ("bnpo", "dapo"),
         f"entropy_coef with loss_type={trainer.loss_type!r} (its entropy term is a token mean, the policy term "
         f"is not)"),
        (trainer.aux_loss_enabled, "MoE aux loss"),
        (any(k in inputs for k in ("pixel_values", "image_grid_thw", "token_type_ids", "mm_token_type_ids")),
         "vision inputs"),
        (lm_head is None or getattr(lm_head, "bias", None) is not None, "an LM head with a bias"),
        (getattr(text_cfg, "final_logit_softcapping", None) is not None, "a logit soft-cap"),
        (any(getattr(text_cfg, k, None) not in (None, 1.0) for k in ("logit_scale", "output_multiplier",
                                                                     "lm_head_multiplier", "logits_scaling")),
         "a logit scale"),
    ]
    return next((why for bad, why in checks if bad), None)


class VerlGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with its training loss computed by `verl.ops.linear_rl_loss` (see the module docstring)."""

    _warned: bool = False

    def _compute_loss(self, model, inputs):
        why = fused_unsupported(self, inputs)
        if why is not None:
            if not self._warned:
                warnings.warn(f"VerlGRPOTrainer: {why} is not covered by verl's fused loss head; using TRL's own "
                              f"loss", stacklevel=2)
                self._warned = True
            return super()._compute_loss(model, inputs)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        hidden, weight = self._completion_hidden(model, inputs)
        mode = "train" if self.model.training else "eval"
        out = O.linear_rl_loss(hidden, weight, inputs["completion_ids"], mask, self._advantages(inputs, mask),
                               old_logprob=inputs.get("old_per_token_logps"),
                               ref_logprob=inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
                               temperature=self.temperature, loss_type="vanilla", clip_low=self.epsilon_low,
                               clip_high=self.epsilon_high, clip_c=float("inf"), kl_kind=self._kl_kind(),
                               kl_coef=self.beta, **self._agg_and_entropy(inputs, mask, mode))
        loss = out.loss
        if self.loss_type != "dapo" and mode == "train":  # dapo's normaliser already holds the accumulation
            loss = loss / self.current_gradient_accumulation_steps
        self._log_metrics(mode, out, inputs, mask)
        return loss

    def _kl_kind(self) -> str:
        """TRL's KL term is k3; bias-corrected (its default) it is k3 * exp(logp - old), which on-policy (the only
        case fused) has k3's value and the gradient logp - ref: verl's "k3+"."""
        return "k3+" if self.args.use_bias_correction_kl else "low_var_kl"

    def _completion_hidden(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states at the positions that predict the completion tokens [B*C, H], and the LM head
        weight [V, H]: TRL's fused forward minus its LM head."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        lm = self.accelerator.unwrap_model(model)
        lm = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # PEFT
        with self.accelerator.autocast():
            hidden = lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        p, c = prompt_ids.size(1), completion_ids.size(1)
        hidden = hidden.last_hidden_state[:, p - 1:p + c - 1]  # position i predicts token i + 1
        weight = lm.get_output_embeddings().weight
        return hidden.to(weight.dtype).reshape(-1, hidden.size(-1)), weight

    def _advantages(self, inputs, mask) -> torch.Tensor:
        adv = inputs["advantages"]
        return (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand(mask.shape).to(torch.float32).contiguous()

    def _agg_and_entropy(self, inputs, mask, mode: str) -> dict:
        """The `agg` and `entropy_coeff` that make the fused loss equal TRL's loss for this loss_type."""
        rows = float(mask.size(0))
        a = _AGG[self.loss_type]
        coef = self.entropy_coef if self._entropy_bonus_enabled else 0.0
        if self.loss_type == "dapo":
            # TRL: token sum / normaliser, entropy bonus a token mean / accumulation steps
            norm = inputs["num_items_in_batch"].clamp(min=1.0).item() / self.accelerator.num_processes
            ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            if mode == "train":
                norm = norm * ga / self.args.steps_per_generation
            tokens = max(float((mask != 0).sum()), 1.0)
            return dict(agg=O.Aggregation(mode=a, global_tokens=norm), entropy_coeff=coef * norm / (tokens * ga))
        if self.loss_type == "bnpo":
            return dict(agg=O.Aggregation(mode=a), entropy_coeff=coef)
        norm_len = float(self.max_completion_length) if self.loss_type == "dr_grpo" else None
        return dict(agg=O.Aggregation(mode=a, global_seqs=rows, norm_len=norm_len), entropy_coeff=coef)

    @torch.no_grad()
    def _log_metrics(self, mode: str, out, inputs, mask) -> None:
        """The metrics TRL's `_compute_loss` logs, from the fused head's per-token log-probs and entropy."""
        m = mask.to(out.log_probs.dtype)
        adv = self._advantages(inputs, mask)

        def global_mean(x):
            totals = self.accelerator.reduce(torch.stack([(x * m).sum(), m.sum()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def seq_mean(x):
            return (x * m).sum(-1) / m.sum(-1)

        if self._entropy_bonus_enabled:
            self._metrics[mode]["policy_loss"].append(out.pg_loss.item())
        if self.beta != 0.0:
            d = inputs["ref_per_token_logps"] - out.log_probs
            self._metrics[mode]["kl"].append(global_mean(torch.exp(d) - d - 1))
        self._metrics[mode]["entropy"].append(global_mean(out.entropy))
        old = inputs.get("old_per_token_logps")
        ratio = torch.ones_like(out.log_probs) if old is None else torch.exp(out.log_probs - old)
        low = ((ratio < 1 - self.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).float()
        self._metrics[mode]["clip_ratio/low_mean"].append(global_mean(low))
        self._metrics[mode]["clip_ratio/high_mean"].append(global_mean(high))
        self._metrics[mode]["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high)))
        self._metrics[mode]["clip_ratio/low_min"].append(self.accelerator.gather(seq_mean(low)).nan_to_num(
            nan=float("inf")).min().item())
        self._metrics[mode]["clip_ratio/high_max"].append(self.accelerator.gather(seq_mean(high)).nan_to_num(
            nan=float("-inf")).max().item())


# ---------------------------------------------------------------------------------------------- demonstration

def demo_setup(path: str, vocab_size: int = 32768, hidden_size: int = 256, prompts: int = 4, seed: int = 1):
    """(model directory, tokenizer, dataset, reward) of a small local GRPO job whose LM head dominates: a 2-layer
    Llama with a `vocab_size` vocabulary (a tiny BPE tokenizer padded with added tokens so every id decodes) saved
    at `path` (TRL builds its reference model from the directory), and `demo_data`."""
    from verl.models.tiny import TinyModelConfig, save_tiny, tiny_config, tiny_model, tiny_tokenizer
    tok = tiny_tokenizer()
    tok.add_tokens([f"<x{i}>" for i in range(vocab_size - len(tok))])
    shape = TinyModelConfig(hidden_size=hidden_size, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=2 * hidden_size, max_position_embeddings=256, vocab_size=len(tok))
    cfg = tiny_config(shape, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    save_tiny(tiny_model(cfg, seed=seed), tok, path)
    return (path, tok, *demo_data(tok, prompts))


def demo_data(tok, prompts: int = 4):
    """(dataset, reward) of the demo: digit prompts, and a reward that prefers the lower half of the vocabulary
    (dense, so a group's advantages are rarely all zero)."""
    from datasets import Dataset
    vocab_size = len(tok)
    ds = Dataset.from_dict({"prompt": [f"{tok.bos_token}{' '.join(str(j) for j in range(i, i + 8))}"
                                       for i in range(prompts)]})

    def low_ids(completions, completion_ids, **kwargs):
        return [sum(1.0 for t in ids if t < vocab_size // 2) / max(len(ids), 1) for ids in completion_ids]

    return ds, low_ids


def main() -> None:
    from trl import GRPOConfig
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, ds, reward = demo_setup(tempfile.mkdtemp(prefix="verl-trl-demo-"), args.vocab)
    cfg = GRPOConfig(output_dir="/tmp/verl-kernels-in-trl", use_cpu=True, bf16=False, per_device_train_batch_size=8,
                     num_generations=4, max_completion_length=32, learning_rate=1e-4, max_steps=args.steps,
                     logging_steps=1, report_to=[], save_strategy="no", beta=0.04, seed=1, disable_tqdm=True)
    trainer = VerlGRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok)
    trainer.train()
    for h in trainer.state.log_history:
        if "loss" in h:
            print({k: h[k] for k in ("step", "loss", "reward", "entropy", "kl") if k in h})


if __name__ == "__main__":
    main()
