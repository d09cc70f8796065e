"""verl's kernels in a plain PyTorch GRPO loop around a Hugging Face causal LM: no trainer, no framework.

Each step samples `group` completions per prompt with `model.generate`, scores them, and then:
  advantages   verl.algos.get_advantage("grpo")           (registered estimator: group-normalised scores)
  old logprob  verl.ops.linear_logprob_entropy            (no grad; hidden states x LM head, chunked)
  loss         verl.ops.linear_rl_loss                    (the fused RL loss head: hidden states + LM head weight
                                                           -> PPO-clip loss + KL + entropy bonus, 3 GEMMs, the
                                                           gradients made in its forward)
               or, for a registered policy loss the fused head does not cover (e.g. cispo):
               linear_logprob_entropy -> verl.algos.get_policy_loss(name) + verl.algos.kl_loss
and takes `epochs` optimizer steps on the batch (so the ratio to the old log-probs is not always 1).

What a user changes in an existing loop: replace `logits = model(...).logits; logp = log_softmax(logits)...;
loss = <policy loss>` by

    hidden = model.model(input_ids, attention_mask=attn).last_hidden_state[:, P - 1:P + C - 1]   # no logits
    out = verl.ops.linear_rl_loss(hidden, model.lm_head.weight, completion_ids, mask, advantages,
                                  old_logprob=old, ref_logprob=ref, kl_coef=0.001, agg="token-mean")
    out.loss.backward()

Run (a 2-layer Llama with a 32k vocabulary built locally; a few seconds a step on one CPU thread):

    PYTHONPATH=. python examples/kernels_in_plain_loop.py --steps 4
    PYTHONPATH=. python examples/kernels_in_plain_loop.py --steps 4 --policy-loss cispo   # unfused registered loss
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

import verl.ops as O
from verl.algos import get_advantage, get_policy_loss, kl_loss
from verl.models.tiny import TinyModelConfig, tiny_config, tiny_model

__all__ = ["LoopConfig", "build_model", "grpo_loss", "train"]


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """The plain loop's settings."""

    steps: int = 4
    """Rollout + update steps."""
    prompts: int = 2
    """Prompts per step."""
    group: int = 4
    """Completions sampled per prompt (the GRPO group)."""
    new_tokens: int = 16
    """Tokens generated per completion (always this many: EOS is not allowed to end a completion early)."""
    epochs: int = 2
    """Optimizer steps per batch."""
    policy_loss: str = "vanilla"
    """A registered policy loss; vanilla / gspo / reinforce run inside the fused head, the others after it."""
    kl_coef: float = 0.001
    """Weight of the low_var_kl penalty to the initial (reference) policy."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    lr: float = 1e-4
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the sampling RNG."""


def build_model(vocab_size: int = 32768, hidden_size: int = 256, seed: int = 1):
    """A 2-layer Llama with a `vocab_size` vocabulary (random weights, float32): the LM head is most of it."""
    shape = TinyModelConfig(hidden_size=hidden_size, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=2 * hidden_size, max_position_embeddings=256, vocab_size=vocab_size)
    return tiny_model(tiny_config(shape, pad_token_id=0, bos_token_id=1, eos_token_id=2), seed=seed)


def completion_hidden(model, input_ids: torch.Tensor, attn: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Final hidden states of the positions that predict the completion tokens, [B * C, H]."""
    hidden = model.model(input_ids=input_ids, attention_mask=attn, use_cache=False).last_hidden_state
    h = hidden[:, prompt_len - 1:-1]  # position i predicts token i + 1
    return h.reshape(-1, h.size(-1))


def grpo_loss(model, batch: dict, cfg: LoopConfig) -> torch.Tensor:
    """The update's scalar loss on a rollout batch (keys: input_ids, attn, prompt_len, completion_ids, mask,
    advantages, old_logprob, ref_logprob)."""
    h = completion_hidden(model, batch["input_ids"], batch["attn"], batch["prompt_len"])
    w = model.get_output_embeddings().weight
    y, mask, adv = batch["completion_ids"], batch["mask"], batch["advantages"]
    if cfg.policy_loss in O.HEAD_LOSSES:
        return O.linear_rl_loss(h, w, y, mask, adv, old_logprob=batch["old_logprob"],
                                ref_logprob=batch["ref_logprob"], loss_type=cfg.policy_loss, clip_low=0.2,
                                clip_high=0.28, kl_kind="low_var_kl", kl_coef=cfg.kl_coef,
                                entropy_coeff=cfg.entropy_coeff, agg="token-mean").loss
    lp, ent = O.linear_logprob_entropy(h, w, y.reshape(-1))
    lp, ent = lp.view(mask.shape), ent.view(mask.shape)
    pg = get_policy_loss(cfg.policy_loss)(lp, batch["old_logprob"], adv, mask, clip_low=0.2, clip_high=0.28,
                                          agg="token-mean")
    loss = pg.loss + cfg.kl_coef * kl_loss("low_var_kl", lp, batch["ref_logprob"], mask)
    return loss - cfg.entropy_coeff * O.agg_loss(ent, mask, "token-mean")


@torch.no_grad()
def rollout(model, ref_model, prompts: torch.Tensor, reward_fn, cfg: LoopConfig, gen: torch.Generator) -> dict:
    """Sample, score and prepare one batch: advantages, old and reference log-probs."""
    x = prompts.repeat_interleave(cfg.group, dim=0)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    model.eval()
    seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, max_new_tokens=cfg.new_tokens,
                         min_new_tokens=cfg.new_tokens, pad_token_id=0)
    model.train()
    p = x.size(1)
    y = seq[:, p:]
    mask = torch.ones_like(y, dtype=torch.float32)
    scores = reward_fn(y)
    index = torch.arange(prompts.size(0)).repeat_interleave(cfg.group)
    adv = get_advantage("grpo")(scores[:, None] * mask, mask, index=index).advantages
    attn = torch.ones_like(seq)
    batch = dict(input_ids=seq, attn=attn, prompt_len=p, completion_ids=y, mask=mask, advantages=adv,
                 reward=float(scores.mean()))
    for key, m in (("old_logprob", model), ("ref_logprob", ref_model)):
        h = completion_hidden(m, seq, attn, p)
        batch[key] = O.linear_logprob_entropy(h, m.get_output_embeddings().weight, y.reshape(-1))[0].view(y.shape)
    return batch


def low_id_reward(vocab_size: int):
    """Share of a completion's tokens in the lower half of the vocabulary: dense, so groups rarely tie."""
    return lambda y: (y < vocab_size // 2).float().mean(-1)


def train(model, cfg: LoopConfig, prompts: torch.Tensor, reward_fn) -> list[dict]:
    """The loop; returns one record per step (reward, losses of each epoch, seconds)."""
    import copy
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    history = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        batch = rollout(model, ref_model, prompts, reward_fn, cfg, gen)
        losses = []
        for _ in range(cfg.epochs):
            opt.zero_grad(set_to_none=True)
            loss = grpo_loss(model, batch, cfg)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        history.append({"step": step, "reward": batch["reward"], "losses": losses,
                        "seconds": time.perf_counter() - t0})
    return history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--policy-loss", default="vanilla")
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = LoopConfig(steps=args.steps, policy_loss=args.policy_loss)
    model = build_model(args.vocab)
    prompts = torch.randint(3, args.vocab, (cfg.prompts, 8), generator=torch.Generator().manual_seed(0))
    for rec in train(model, cfg, prompts, low_id_reward(args.vocab)):
        print(f"step {rec['step']}: reward {rec['reward']:.3f}, loss per epoch "
              f"{', '.join(f'{v:+.5f}' for v in rec['losses'])}, {rec['seconds']:.1f}s", flush=True)


if __name__ == "__main__":
    main()
