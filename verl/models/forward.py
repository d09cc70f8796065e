"""Forward/backward over micro-batches through megatron's pipeline schedules; logits, log-probs, entropy, values.

Batches are padded: `input_ids [b, s]` with `attention_mask [b, s]` (1 = real token, left or right padding).
Position ids are the running count of real tokens (so left padding gives the same positions as no padding),
and the attention mask combines causality with key padding.

Token alignment: position t of `log_probs` / `entropy` scores the NEXT token, i.e.
``log_probs[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1])``; the last position, and positions whose
next token is padding, are 0 and excluded from `token_mask`.

With sequence parallelism megatron splits every activation's sequence into TP equal parts, so each micro-batch
is right-padded inside the forward step to a multiple of TP (`sp_padded_length`): the extra tokens are masked keys
whose positions continue the row's, they come after every real token (which causal attention never lets see
them), and the output is cut back to the real length before the loss sees it, so results are unchanged.

Losses are pluggable: a `LossFn` gets the last stage's output for one micro-batch — vocab-parallel logits
``[b, s, V_pad/tp]`` (or values ``[b, s]`` for a value-head model) — plus the micro-batch dict, and returns
``(loss, metrics)``; megatron averages the loss over micro-batches (and DDP over data-parallel replicas).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.distributed as dist

from verl.errors import VerlConfigError
from verl.models.gpt import MegatronGPT
from verl.models.vocab_parallel import masked_vocab_logits
from verl.ops.logprob import vocab_parallel_logprob_entropy

LossFn = Callable[[torch.Tensor, dict], tuple]
"""(output of the last stage for one micro-batch, the micro-batch dict) -> (loss, metrics dict)."""

IGNORE_INDEX = -100


def next_token_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = input_ids[:, t+1] where both positions are real tokens, else IGNORE_INDEX."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    labels[:, :-1] = torch.where(valid, input_ids[:, 1:], torch.full_like(input_ids[:, 1:], IGNORE_INDEX))
    return labels


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Running count of real tokens minus one (0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """[b, 1, s, s] bool, True = masked out (megatron's convention); None when nothing is padded (causal only)."""
    if bool(attention_mask.all()):
        return None
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None, :, :] & attention_mask.bool()[:, None, :]
    return ~allowed[:, None, :, :]


def make_micro_batches(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, micro_batch_size: int,
                       **extra: torch.Tensor) -> list[dict]:
    """Splits a padded batch into micro-batch dicts with labels, positions and masks (extra tensors split too)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if input_ids.shape != attention_mask.shape:
        raise VerlConfigError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                              f"must have the same [batch, seq] shape")
    b = input_ids.shape[0]
    if micro_batch_size < 1 or b % micro_batch_size:
        raise VerlConfigError(f"batch size {b} is not a multiple of micro_batch_size={micro_batch_size}")
    out = []
    for i in range(0, b, micro_batch_size):
        ids, mask = input_ids[i:i + micro_batch_size], attention_mask[i:i + micro_batch_size]
        mb = {"input_ids": ids, "attention_mask": mask, "labels": next_token_labels(ids, mask),
              "position_ids": position_ids_for(mask), "mask_4d": attention_mask_4d(mask)}
        for k, v in extra.items():
            mb[k] = v[i:i + micro_batch_size]
        out.append(mb)
    return out


def sp_padded_length(model: MegatronGPT, s: int) -> int:
    """The sequence length the model runs `s` tokens at: the next multiple of TP under sequence parallelism."""
    tp = model.pg.tp_size
    return -(-s // tp) * tp if model.pg.sequence_parallel and tp > 1 else s


def _pad_inputs(mb: dict, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, position_ids, mask_4d) right-padded to `length` columns: pad id 0, positions counting on from
    each row's last, the new columns masked as keys. Real queries are causal and precede them, so their results
    do not change; without padding in the batch (mask_4d None) causality alone keeps them out."""
    ids, pos, mask = mb["input_ids"], mb["position_ids"], mb["attention_mask"]
    extra = length - ids.shape[1]
    if extra == 0:
        return ids, pos, mb["mask_4d"]
    steps = torch.arange(1, extra + 1, device=pos.device, dtype=pos.dtype)
    ids = torch.nn.functional.pad(ids, (0, extra), value=0)
    pos = torch.cat([pos, pos[:, -1:] + steps], dim=1)
    mask_4d = None if mb["mask_4d"] is None else attention_mask_4d(torch.nn.functional.pad(mask, (0, extra)))
    return ids, pos, mask_4d


def _forward_step(model: MegatronGPT, loss_fn: LossFn):
    arch = model.arch

    device = model.device

    def step(data_iterator, module):
        mb = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in next(data_iterator).items()}
        s = mb["input_ids"].shape[1]
        if model.spec == "te" and mb["mask_4d"] is not None:
            _check_right_padded(mb["attention_mask"])
            mb["mask_4d"] = None   # right padding under a causal mask leaves every real token's context intact
        # a packed micro-batch (verl/workers/packing.py) is one row of several sequences, each at most max_seqlen
        longest = mb.get("max_seqlen", s)
        if arch.sliding_window is not None and longest > arch.sliding_window:
            raise VerlConfigError(f"sequence length {longest} exceeds the model's sliding_window="
                                  f"{arch.sliding_window}; the megatron local attention is full attention, so use "
                                  f"sequences <= the window")
        ids, pos, mask_4d = _pad_inputs(mb, sp_padded_length(model, s))
        if arch.moe is not None:  # routes to compare with or replay, and which tokens are real (verl.models.moe)
            from verl.models.moe import set_route_contexts
            pg = model.pg
            set_route_contexts(model.gpt, arch, mb, ids.shape[1], sequence_parallel=pg.sequence_parallel,
                               tp_rank=pg.tp_rank, tp=pg.tp_size)
        with rope_at_positions(model.gpt, pos) if mb.get("rope_positions") else nullcontext():
            out = module(ids, pos, attention_mask=mask_4d)
        return out, partial(_loss_adapter, loss_fn, model, mb)
    return step


@contextmanager
def rope_at_positions(gpt, position_ids: torch.Tensor) -> Iterator[None]:
    """Runs megatron-core's GPT with its rotary embedding taken at `position_ids` [1, S] instead of at the column
    index (megatron-core's RoPE ignores position ids): the layout of a packed prefix tree, where the tokens after a
    shared prefix are not at the columns their positions name. The backward reuses what the forward computed."""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if type(rope).__name__ != "RotaryEmbedding" or getattr(gpt.config, "multi_latent_attention", False):
        raise VerlConfigError(f"actor.share_prompt_prefix on megatron needs plain RoPE (got "
                              f"{type(rope).__name__ if rope is not None else gpt.position_embedding_type}); set "
                              f"actor.share_prompt_prefix=false for this model")
    pos = position_ids[0]
    emb = rope.get_emb(int(pos.max()) + 1)  # [max position + 1, 1, 1, D]

    def at_positions(max_seq_len: int, *args, **kwargs) -> torch.Tensor:
        if max_seq_len != pos.numel():
            raise VerlConfigError(f"rope_at_positions: megatron asked for {max_seq_len} rotary positions, the packed "
                                  f"row has {pos.numel()} (context parallelism is not supported with prefix trees)")
        return emb[pos.to(emb.device)]
    rope.forward = at_positions  # the instance attribute shadows the class's cached forward
    try:
        yield
    finally:
        del rope.forward


def _check_right_padded(mask: torch.Tensor) -> None:
    # TE's fused attention takes a causal or a padding mask type fixed at build time, not our [b,1,s,s] mask.
    starts_real = mask[:, 0].bool()
    contiguous = (mask.long().diff(dim=-1) <= 0).all()
    if not bool(starts_real.all()) or not bool(contiguous):
        raise VerlConfigError("the Transformer Engine layer spec supports right-padded batches only; left-pad-free "
                              "your batch (pad on the right) or build with BuildOptions(spec='local')")


def _loss_adapter(loss_fn: LossFn, model: MegatronGPT, mb: dict, output: torch.Tensor):
    if model.options.value_head:
        output = output.squeeze(-1)
    return loss_fn(output[:, :mb["input_ids"].shape[1]], mb)  # without the sequence-parallel padding


def forward_backward(model: MegatronGPT, micro_batches: Sequence[dict], loss_fn: LossFn, *,
                     forward_only: bool = False) -> list[dict]:
    """Runs the micro-batches through megatron's schedule (1F1B when PP > 1); returns the last stage's
    per-micro-batch metric dicts (empty list on other stages). With forward_only=False grads accumulate in
    the model (in `main_grad` once wrapped for the optimizer)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    if not micro_batches:
        raise VerlConfigError("forward_backward needs at least one micro-batch")
    seq = sp_padded_length(model, max(mb["input_ids"].shape[1] for mb in micro_batches))
    mbs = micro_batches[0]["input_ids"].shape[0]
    fb = get_forward_backward_func()
    ctx = torch.no_grad() if forward_only else torch.enable_grad()
    with ctx:
        return fb(forward_step_func=_forward_step(model, loss_fn), data_iterator=iter(list(micro_batches)),
                  model=[model.module], num_microbatches=len(micro_batches), seq_length=seq,
                  micro_batch_size=mbs, forward_only=forward_only)


def _broadcast_from_last_stage(model: MegatronGPT, tensors: list[torch.Tensor] | None,
                               shapes: list[tuple]) -> list[torch.Tensor]:
    pg = model.pg
    if pg.pp_size == 1:
        return tensors
    src = pg.pp_global_ranks[-1]
    out = []
    for i, shape in enumerate(shapes):
        t = (tensors[i].contiguous() if pg.is_last_stage
             else torch.empty(shape, dtype=torch.float32, device=model.device))
        dist.broadcast(t, src=src, group=pg.pp)
        out.append(t)
    return out


def compute_log_probs(model: MegatronGPT, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                      temperature: float = 1.0, micro_batch_size: int | None = None,
                      with_entropy: bool = True) -> dict[str, torch.Tensor]:
    """Per-token log-probs of the next token (and entropy), [b, s] float32, on every rank of the model.

    Returns {'log_probs', 'entropy' (zeros when with_entropy=False), 'token_mask'}.
    """
    mbs = micro_batch_size or input_ids.shape[0]
    batches = make_micro_batches(input_ids, attention_mask, mbs)

    def loss_fn(logits, mb):
        lp, ent = vocab_parallel_logprob_entropy(masked_vocab_logits(logits, model), mb["labels"], temperature,
                                                 model.pg.tp, ignore_index=IGNORE_INDEX)
        return logits.new_zeros(()), {"log_probs": lp.detach(), "entropy": ent.detach() if with_entropy else None}
    outs = forward_backward(model, batches, loss_fn, forward_only=True)
    b, s = input_ids.shape
    mask = torch.cat([(mb["labels"] != IGNORE_INDEX) for mb in batches]).to(model.device)
    if model.pg.is_last_stage:
        lp = torch.cat([o["log_probs"] for o in outs]).float()
        ent = (torch.cat([o["entropy"] for o in outs]).float() if with_entropy
               else torch.zeros(b, s, device=model.device))
        lp, ent = lp * mask, ent * mask
        tensors = [lp, ent]
    else:
        tensors = None
    lp, ent = _broadcast_from_last_stage(model, tensors, [(b, s), (b, s)])
    return {"log_probs": lp, "entropy": ent, "token_mask": mask}


def compute_logits(model: MegatronGPT, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   micro_batch_size: int | None = None) -> torch.Tensor:
    """Full-vocabulary logits [b, s, vocab] (padding columns dropped) on every rank; for checks and small models."""
    mbs = micro_batch_size or input_ids.shape[0]
    batches = make_micro_batches(input_ids, attention_mask, mbs)

    def loss_fn(logits, mb):
        return logits.new_zeros(()), {"logits": _gather_vocab(logits, model)}
    outs = forward_backward(model, batches, loss_fn, forward_only=True)
    b, s = input_ids.shape
    v = model.arch.vocab_size
    tensors = [torch.cat([o["logits"] for o in outs]).float()] if model.pg.is_last_stage else None
    return _broadcast_from_last_stage(model, tensors, [(b, s, v)])[0]


def compute_values(model: MegatronGPT, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   micro_batch_size: int | None = None) -> torch.Tensor:
    """Value-head outputs [b, s] float32 (critic / reward model) on every rank."""
    if not model.options.value_head:
        raise VerlConfigError("compute_values needs a model built with BuildOptions(value_head=True)")
    mbs = micro_batch_size or input_ids.shape[0]
    batches = make_micro_batches(input_ids, attention_mask, mbs)
    outs = forward_backward(model, batches, lambda v, mb: (v.new_zeros(()), {"values": v.detach()}),
                            forward_only=True)
    tensors = [torch.cat([o["values"] for o in outs]).float()] if model.pg.is_last_stage else None
    return _broadcast_from_last_stage(model, tensors, [tuple(input_ids.shape)])[0]


def _gather_vocab(logits: torch.Tensor, model: MegatronGPT) -> torch.Tensor:
    pg = model.pg
    if pg.tp_size > 1:
        parts = [torch.empty_like(logits) for _ in range(pg.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=pg.tp)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :model.arch.vocab_size].detach()


# ----------------------------------------------------------------------------------------------- losses

def causal_lm_loss(model: MegatronGPT, temperature: float = 1.0) -> LossFn:
    """Token-mean negative log-likelihood of the next token (padding excluded); metrics: loss, entropy."""
    def loss_fn(logits, mb):
        labels = mb["labels"]
        lp, ent = vocab_parallel_logprob_entropy(masked_vocab_logits(logits, model), labels, temperature,
                                                 model.pg.tp, ignore_index=IGNORE_INDEX)
        mask = (labels != IGNORE_INDEX).float()
        n = mask.sum().clamp(min=1)
        loss = -(lp * mask).sum() / n
        # clone: megatron divides the returned loss in place by the number of micro-batches
        return loss, {"loss": loss.detach().clone(), "entropy": ((ent * mask).sum() / n).detach()}
    return loss_fn


def value_mse_loss() -> LossFn:
    """Mean squared error of the value head against `mb['returns']` over `mb['response_mask']` (critic)."""
    def loss_fn(values, mb):
        mask = mb.get("response_mask", mb["attention_mask"]).float()
        err = (values - mb["returns"]) ** 2
        loss = (err * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"value_loss": loss.detach().clone()}
    return loss_fn
