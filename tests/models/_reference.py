"""What transformers computes on the tiny checkpoints: logits, per-row token-mean NLL, grads, AdamW steps."""

from __future__ import annotations

import torch



def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).float().eval()


def _loss(model, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    losses = []
    for i in range(ids.shape[0]):   # mean over micro-batches (rows) of the token-mean NLL, as megatron averages
        valid = (mask[i, 1:] * mask[i, :-1]).bool()
        lp = torch.log_softmax(logits[i, :-1].float(), -1).gather(-1, ids[i, 1:, None]).squeeze(-1)
        losses.append(-(lp[valid]).mean())
    return logits, torch.stack(losses).mean()


def hf_reference(path, ids, mask, *, steps: int, lr: float) -> dict:
    model = hf_model(path)
    logits, loss = _loss(model, ids, mask)
    loss.backward()
    lp, ent = _logprob_entropy(logits.detach(), ids, mask, 0.7)
    from verl.models.config import arch_from_hf
    from verl.models.layout import hf_checkpoint_view
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    grads = {n: g.clone() for n, g in hf_checkpoint_view(grads, arch_from_hf(model.config)).items()}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    model = hf_model(path)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    step_losses = []
    for _ in range(steps):
        opt.zero_grad()
        _, step_loss = _loss(model, ids, mask)
        step_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_losses.append(float(step_loss.detach()))
    return {"logits": logits.detach(), "loss": float(loss.detach()), "grads": grads, "step_losses": step_losses,
            "log_probs_t07": lp, "entropy_t07": ent}


def _logprob_entropy(logits, ids, mask, temperature):
    logp = torch.log_softmax(logits.float() / temperature, -1)
    lp = torch.zeros(ids.shape)
    lp[:, :-1] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent
