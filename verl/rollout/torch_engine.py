"""The `torch` rollout engine: batched sampling with a KV cache on any causal LM.

Works with a transformers model (including one loaded with device_map="auto": the model is never moved,
inputs go to the device of its input embeddings and each layer runs where `hf_device_map` put it), or any
module with the same call signature (verl's own models). Prompts are left-padded so that every row's next
token sits in the last column; positions come from the attention mask, so padding never shifts RoPE.
Models without a KV cache (`use_cache` unsupported) are run with `kv_cache=False`: the full sequence is
recomputed each step (slow, but exact).

Mixture-of-experts models run their experts on verl's fused token dispatch (verl.models.hf_moe) and the engine
records the experts every token went to in every MoE layer (`GenerationOutput.routes`: the prompt's tokens and the
generated ones fed back), which router replay trains with (actor.router_replay=rollout).

Partial rollouts: with a `pause_hook` set (see RolloutEngine.pause_hook) the engine asks it for the weight
version before sampling every token. When the version moved (or weights were loaded through update_weights
meanwhile) it rebuilds the KV cache of every computed row by prefilling the ids fed so far with the current
weights, samples from those fresh logits, and records each token's version. Without a hook nothing extra is
kept or computed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout.base import (GenerationOutput, RolloutEngine, SamplingParams, TurnRequest, TurnSource,
                               length_limit, turn_seed)
from verl.rollout.config import RolloutConfig
from verl.rollout.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["TorchRollout", "model_length_limit", "model_vocab_size", "process_logits", "sample_tokens"]


def model_length_limit(config: RolloutConfig, model: torch.nn.Module) -> int | None:
    """The one length rule (`verl.rollout.base.length_limit`) for a model object."""
    return length_limit(config.max_model_len, getattr(getattr(model, "config", None), "max_position_embeddings", None))


def model_vocab_size(model: torch.nn.Module) -> int | None:
    """The token ids a model embeds (its input embedding's rows), None when it does not say."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    return int(rows) if rows is not None else getattr(getattr(model, "config", None), "vocab_size", None)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 logits [B, V] with temperature, top-k and top-p applied (filtered tokens at -inf)."""
    logits = logits.float()
    if params.greedy:
        return logits
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass BEFORE it already reaches top_p; the most likely token always stays.
        drop = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of processed logits: argmax when greedy, else the exponential race argmax(p / q)
    with q ~ Exp(1) in float64 drawn from each row's own generator (one draw per step)."""
    if params.greedy:
        return logits.argmax(-1)
    probs = logits.softmax(-1)
    if probs.device.type == "cpu" and all(g is None or g.device.type == "cpu" for g in generators) and \
            _cpu_exponential_is_log1p():
        return _race_cpu(probs, generators)
    q = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)
    for i, g in enumerate(generators):
        q[i].exponential_(generator=g)
    return (q.reciprocal_() * probs).argmax(-1)


# The exponential race on CPU without computing most of the exponentials. torch's CPU generator draws an Exp(1)
# float64 as q = -log1p(-u) from the uniform float64 u that `uniform_` draws from the same generator state (one
# draw per element, in order), so drawing u with `uniform_` consumes the stream exactly as `exponential_` does,
# and the q the race needs can be computed from u where needed. Since q >= u, p / u bounds a token's score
# (1 / q) * p from above: only tokens whose bound reaches the score of the bound's best token can win, a handful
# per row of a 49k vocabulary, and only theirs take the logarithm (math.log1p: the C library's log1p, which
# torch's CPU kernel calls). The winner, ties (first index), inf and NaN (first NaN) are those of
# `(q.reciprocal_() * probs).argmax(-1)`, bit for bit; the logarithm, 2/3 of the draw's time, goes.
_RACE_SLACK = 1e-12  # >> the rounding of p / u, 1 / q and the product (a few ulps, ~1e-15 relative)
_exponential_checked: list[bool] = []


def _cpu_exponential_is_log1p() -> bool:
    """Whether this torch's CPU `exponential_` is -log1p(-u) of `uniform_`'s u, bit for bit (checked once on a
    few thousand draws; False keeps `sample_tokens` on `exponential_` itself)."""
    if not _exponential_checked:
        q = torch.empty(4096, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(12345))
        u = torch.empty(4096, dtype=torch.float64).uniform_(generator=torch.Generator().manual_seed(12345))
        _exponential_checked.append(all(-math.log1p(-x) == y for x, y in zip(u.tolist(), q.tolist())))
    return _exponential_checked[0]


def _race_score(u: float, p: float) -> float:
    """(1 / q) * p with q = -log1p(-u), as float64 (torch's `q.reciprocal_() * probs`)."""
    q = -math.log1p(-u)
    return (math.inf if q == 0.0 else 1.0 / q) * p


def _race_cpu(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    u = torch.empty(probs.shape, dtype=torch.float64)
    for i, g in enumerate(generators):
        u[i].uniform_(generator=g)
    return _race(probs, u)


def _race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmax over each row of (1 / q) * p, q = -log1p(-u): probs [B, V] float32, u [B, V] float64 in [0, 1)."""
    p = probs.double()
    bound = p / u  # >= the score; NaN exactly where the score is NaN (p NaN, or p = u = 0)
    best = bound.argmax(-1)  # a NaN row: its first NaN, as the score's argmax
    rows = best.tolist()
    floor = torch.tensor([_race_score(u[i, j].item(), p[i, j].item()) for i, j in enumerate(rows)],
                         dtype=torch.float64) * (1.0 - _RACE_SLACK)
    # row-major: each row's candidates in index order (none in a NaN row, which keeps its first NaN)
    hits = (bound >= floor[:, None]).nonzero().tolist()
    top = [-math.inf] * len(rows)
    for i, j in hits:
        score = _race_score(u[i, j].item(), p[i, j].item())
        if score > top[i]:
            top[i], rows[i] = score, j
    return torch.tensor(rows, dtype=best.dtype)


class TorchRollout(RolloutEngine):
    """Batched KV-cache sampling on a causal LM (see the module docstring)."""

    name = "torch"
    # successful update_weights calls (a class default: HFRollout skips this __init__); a load inside the pause
    # hook's first call, which no earlier version can reveal, shows here
    _loads: int = 0
    last_swap_s: float = 0.0
    """Seconds the last update_weights took to put its staged tensors in place (the swap itself)."""

    @classmethod
    def from_config(cls, config: RolloutConfig, *, model=None, model_path: str | None = None, tokenizer=None):
        """Runs `model` (any causal LM, usually the actor's own module), or the one loaded from `model_path`."""
        if model is None:
            if model_path is None:
                raise VerlConfigError(f"the {cls.name} rollout engine needs `model=` (a causal LM) or "
                                      f"`model_path=` (a Hugging Face directory)")
            from transformers import AutoModelForCausalLM
            dtype = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        elif config.dtype != "auto" and next(model.parameters()).dtype != getattr(torch, config.dtype):
            # a generation copy of its own in rollout.dtype (e.g. bfloat16 beside a float32 actor)
            import copy
            model = copy.deepcopy(model).to(getattr(torch, config.dtype))
        return cls(model, tokenizer if tokenizer is not None else model_path, config)

    def __init__(self, model: torch.nn.Module, tokenizer, config: RolloutConfig | None = None):
        config = config or RolloutConfig(engine="torch")
        super().__init__(Tokenizer.wrap(tokenizer), max_model_len=model_length_limit(config, model))
        self.vocab_size = model_vocab_size(model)
        self.model = model  # may be the actor's own module: put back in its training mode after each call
        self.config = config
        self._offloaded: dict[str, torch.device] | None = None
        self._fast = None
        from verl.models.hf_moe import RouteRecorder, install_experts
        install_experts(model)
        # the train decoder re-runs the whole buffer at every step: its routes are the actor's own, not recorded
        self._routes = RouteRecorder.attach(model) if config.decoder != "train" else None
        # token positions computed, the non-padding ones, and KV rebuilds after a weight update mid-generation
        self.stats = self._new_stats()
        if self.config.decoder == "fast" and self.config.kv_cache:
            from verl.rollout.fast_decoder import LlamaFamilyDecoder, unsupported_reason
            reason = unsupported_reason(model)
            if reason is None:
                self._fast = LlamaFamilyDecoder(model, quantization=config.quantization)
            else:
                logger.info("torch engine: decoding with the model's own forward (%s)", reason)
        # linear layers the int8 kernel never serves (the model's own forward): counted once, the module is fixed
        self._unserved_linears = 0
        if config.quantization != "none" and self._fast is None:
            self._unserved_linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
            logger.warning("rollout.quantization=%s: the torch engine decodes this model with its own forward (%s), "
                           "which the int8 kernel does not serve: all %d linear layers generate in %s",
                           config.quantization, reason, self._unserved_linears, next(model.parameters()).dtype)
        self._quant_warned: set[str] = set()

    # -- devices ----------------------------------------------------------------------------------------------

    @property
    def device_map(self) -> dict | None:
        return getattr(self.model, "hf_device_map", None)

    def _input_device(self) -> torch.device:
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        if emb is not None and hasattr(emb, "weight"):
            return emb.weight.device
        return next(self.model.parameters()).device

    # -- generation ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        jobs = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
        out: list[GenerationOutput] = []
        was_training = self.model.training
        self.model.eval()
        # The train decoder pads every batch to the call's longest prompt: the training batch's layout
        width = max(len(p) for p in prompt_ids) if self.config.decoder == "train" else None
        try:
            if len(jobs) > self.config.max_batch_size and self._fast is not None and self.pause_hook is None \
                    and self._routes is None:
                return self._generate_continuous(jobs, prompt_ids, params)
            for b in range(0, len(jobs), self.config.max_batch_size):
                batch = jobs[b:b + self.config.max_batch_size]
                out += self._generate_batch(batch, prompt_ids, params, width)
        finally:
            self.model.train(was_training)
        return out

    def _generate_continuous(self, jobs: list[tuple[int, int]], prompt_ids: list[list[int]],
                             params: SamplingParams) -> list[GenerationOutput]:
        """More rows than max_batch_size, with the fast decoder: continuous batching. Once an eighth of the batch
        has finished, those slots take the next pending rows (a GRPO group's samples are admitted together, so
        their prompt is prefilled once), instead of the next wave waiting for the last row of this one. Row (i, j)
        samples from its own `sample_seed(i, j)` stream, as it would in a wave. (A pause hook rebuilds the cache of
        a fixed batch, and MoE routes are recorded per wave: those run in waves.)"""
        source = _Jobs([TurnRequest(key=k, prompt_ids=list(prompt_ids[i]), max_new_tokens=params.max_new_tokens,
                                    seed=params.sample_seed(i, j), turn=0) for k, (i, j) in enumerate(jobs)])
        try:
            _Continuous(self, source, params, max_wait=None).run()
        finally:
            self._fast.finish()
        self.stats["continuous_joins"] += source.joins
        return [dataclasses.replace(source.outputs[k], prompt_index=i, sample_index=j)
                for k, (i, j) in enumerate(jobs)]

    # -- multi-turn (verl.agents) ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _generate_turns(self, requests, params: SamplingParams) -> list[GenerationOutput]:
        """A wave of turns, each from its own `turn_seed` stream and within its own budget."""
        params = dataclasses.replace(params, n=1, max_new_tokens=max(r.max_new_tokens for r in requests))
        prompts = [list(r.prompt_ids) for r in requests]
        was_training = self.model.training
        self.model.eval()
        out: list[GenerationOutput] = []
        try:
            for b in range(0, len(requests), self.config.max_batch_size):
                rs = requests[b:b + self.config.max_batch_size]
                out += self._generate_batch([(b + k, 0) for k in range(len(rs))], prompts, params, None,
                                            seeds=[turn_seed(r.seed, r.turn) for r in rs],
                                            limits=[r.max_new_tokens for r in rs])
        finally:
            self.model.train(was_training)
        return out

    def serve(self, source: TurnSource, params: SamplingParams) -> None:
        """Continuous batching with the fast decoder: between two tokens the rows that finished their turn leave
        the batch (their trajectory goes to its tools) and the turns that became ready join it (prefilled on their
        own, then appended to the cache), so no trajectory waits for another's tools or turn. A join copies the
        cache, so ready turns join together: once they are an eighth of the batch, or after 4 decode steps.
        Without the fast decoder, or with a pause hook (partial rollouts rebuild the cache of a fixed batch), it
        runs waves."""
        if self._fast is None or self.pause_hook is not None:
            return super().serve(source, params)
        if self.released:
            raise VerlRuntimeError("the torch rollout engine is released; call resume() before serve()")
        was_training = self.model.training
        self.model.eval()
        try:
            with self._engine_errors("serve"), torch.inference_mode():
                _Continuous(self, source, params).run()
        finally:
            self._fast.finish()
            self.model.train(was_training)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    def _generate_batch(self, batch, prompt_ids, params: SamplingParams, width: int | None,
                        seeds: list[int | None] | None = None,
                        limits: list[int] | None = None) -> list[GenerationOutput]:
        """`seeds` / `limits`: per-row seeds and token limits (multi-turn waves) instead of the call's."""
        prompts = [prompt_ids[i] for i, _ in batch]
        gens = [None if s is None else torch.Generator().manual_seed(s)
                for s in (seeds if seeds is not None else [params.sample_seed(i, j) for i, j in batch])]
        stop_ids = self._stop_ids(params)
        B = len(batch)
        tokens = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        done = [False] * B
        reasons = ["length"] * B
        limits = limits or [params.max_new_tokens] * B
        budgets = [min(self.budget(len(p), params), lim) for p, lim in zip(prompts, limits)]
        rows = list(range(B))  # the batch row of each row the decoder computes (finished rows leave it)
        versions: list[list[int]] | None = None if self.pause_hook is None else [[] for _ in range(B)]
        routes = _Routes(self._routes, B)
        try:
            forward, logits, mask, seq = self._prefill(prompts, params, width)
            routes.prefill(mask.shape[1])
            # only a pausable generation keeps the ids fed so far ([rows, L], aligned with mask) to rebuild from
            pause = None if versions is None else _Pause(loads=self._loads, cap=mask.shape[1] + params.max_new_tokens)
            seq = None if pause is None else seq
            for _ in range(max(budgets)):
                if pause is not None:
                    forward, logits = self._pause(pause, forward, logits, seq, mask, params, routes)
                processed = process_logits(logits.to("cpu") if logits.device.type != "cpu" else logits, params)
                nxt = sample_tokens(processed, params, [gens[r] for r in rows])
                if params.logprobs:
                    lp = getattr(forward, "logprobs", lambda _t: None)(nxt)
                    lp = processed.log_softmax(-1).gather(-1, nxt[:, None])[:, 0].tolist() if lp is None else lp
                for k, (r, t) in enumerate(zip(rows, nxt.tolist())):
                    if done[r]:
                        continue
                    tokens[r].append(t)
                    if params.logprobs:
                        lps[r].append(lp[k])
                    if versions is not None:
                        versions[r].append(pause.version)
                    if t in stop_ids or self._hit_stop_string(tokens[r], params):
                        done[r], reasons[r] = True, "stop"
                    elif len(tokens[r]) >= budgets[r]:
                        done[r] = True
                if all(done):
                    break
                nxt, mask, rows, seq = self._drop_finished(nxt, mask, rows, done, seq)
                live = ~torch.tensor([done[r] for r in rows])
                self.stats["positions"] += len(rows)
                self.stats["valid_positions"] += int(live.sum())
                nxt = torch.where(live, nxt, torch.tensor(self.tokenizer.pad_token_id))
                mask = torch.cat([mask, live.long()[:, None].to(mask.device)], 1)
                if seq is not None:
                    seq = torch.cat([seq, nxt[:, None].to(seq.device)], 1)
                logits = forward(nxt[:, None].to(mask.device), mask)
                routes.step()
        finally:
            if self._fast is not None:
                self._fast.finish()  # the KV buffers go back before anything else (training) runs
        return [self._finish(i, j, prompt_ids[i], tokens[r], reasons[r], lps[r] if params.logprobs else None,
                             params.stop, None if versions is None else versions[r],
                             routes=routes.of_row(r, len(prompt_ids[i]), len(tokens[r])))
                for r, (i, j) in enumerate(batch)]

    def _pause(self, pause: "_Pause", forward, logits: torch.Tensor, seq: torch.Tensor, mask: torch.Tensor,
               params: SamplingParams, routes: "_Routes"):
        """Asks the pause hook for the weight version before a token is sampled; when the weights changed since
        the cache was computed, returns the rebuilt forward and fresh logits, else (forward, logits) as given."""
        returned = self.pause_hook()
        try:
            version = operator.index(returned)
        except TypeError:
            raise VerlRuntimeError(f"the torch engine's pause_hook returned {returned!r}; it must return the weight "
                                   f"version (an int) the engine holds after the call") from None
        stale = (pause.version is not None and version != pause.version) or self._loads != pause.loads
        pause.version, pause.loads = version, self._loads
        if not stale:
            return forward, logits
        out = self._rebuild(forward, seq, mask, params, pause.cap)
        routes.rebuilt()  # every token so far was computed again, with the new weights' routes
        return out

    def _rebuild(self, forward, seq: torch.Tensor, mask: torch.Tensor, params: SamplingParams, cap: int):
        """(forward, last logits [rows, V]) from the current weights over the ids fed so far: the fast decoder
        re-fuses the weights and prefills `seq` into a fresh cache, the model's forward starts a new cache; the
        cache-less paths (kv_cache=false, decoder=train) recompute from the module at every step anyway and only
        run their last forward again. Positions come from `mask`, so finished rows' masked columns are harmless."""
        self.stats["rebuilds"] += 1
        self._count_prefill(mask)
        if isinstance(forward, _TrainForward):
            return forward, forward.refresh()
        if self._fast is not None:
            self._fast.start(len(seq), cap)
            return forward, self._fast.step(seq, mask)
        forward = self._forward_fn(seq, params)
        return forward, forward(seq, mask)

    def _prefill(self, prompts: list[list[int]], params: SamplingParams, width: int | None):
        """(forward, the prompts' last logits [B, V], mask [B, P], ids [B, P]). The fast decoder prefills each
        distinct prompt once and repeats its cache rows for the group's other samples (a GRPO group of n shares one
        prompt: n - 1 of n prefills would be the same arithmetic again)."""
        dev = self._input_device()
        if self._fast is None:
            ids, mask = self.tokenizer.pad(prompts, side="left", width=width)
            ids, mask = ids.to(dev), mask.to(dev)
            forward = self._forward_fn(ids, params)
            self._count_prefill(mask)
            return forward, forward(ids, mask), mask, ids
        first: dict[tuple[int, ...], int] = {}
        which = [first.setdefault(tuple(p), len(first)) for p in prompts]
        ids, mask = self.tokenizer.pad([list(p) for p in first], side="left")
        ids, mask = ids.to(dev), mask.to(dev)
        self._fast.start(len(first), ids.shape[1] + params.max_new_tokens)
        logits = self._fast.step(ids, mask)
        self._count_prefill(mask)
        index = torch.tensor(which, device=dev)
        self._fast.select(index)
        return self._fast.step, logits[index], mask[index], ids[index]

    def _drop_finished(self, nxt: torch.Tensor, mask: torch.Tensor, rows: list[int], done: list[bool],
                       seq: torch.Tensor | None):
        """Drops finished rows from the fast decoder's batch once they are an eighth of it: each drop copies
        the KV cache, so finished rows ride along (masked) until that copy costs less than computing them.
        `seq` (the ids fed so far, kept for a KV rebuild; None without a pause hook) follows the rows."""
        finished = sum(done[r] for r in rows)
        if self._fast is None or finished == 0 or 8 * finished < len(rows):
            return nxt, mask, rows, seq
        keep = [k for k, r in enumerate(rows) if not done[r]]
        index = torch.tensor(keep)
        self._fast.select(index.to(mask.device))
        return (nxt[index], mask[index.to(mask.device)], [rows[k] for k in keep],
                None if seq is None else seq[index.to(seq.device)])

    def _count_prefill(self, mask: torch.Tensor) -> None:
        self.stats["positions"] += mask.numel()
        self.stats["valid_positions"] += int(mask.sum())

    @staticmethod
    def _new_stats() -> dict[str, int]:
        """The counts take_metrics reads (and resets), zero."""
        return {"positions": 0, "valid_positions": 0, "rebuilds": 0, "continuous_joins": 0}

    def take_metrics(self) -> dict[str, float]:
        """rollout/padded_share: the share of the positions the decoder computed since the last call that were
        padding or finished rows (prefill, decode and KV rebuilds together); rollout/partial_rebuilds: KV cache
        rebuilds after a weight update mid-generation (when any); rollout/continuous_joins: times pending rows took
        the slots of finished ones in a continuous batch (`_generate_continuous`, when any). Resets the counts."""
        pos, valid, rebuilds = self.stats["positions"], self.stats["valid_positions"], self.stats["rebuilds"]
        joins = self.stats["continuous_joins"]
        self.stats = self._new_stats()
        metrics = {"rollout/padded_share": 1.0 - valid / pos} if pos else {}
        if rebuilds:
            metrics["rollout/partial_rebuilds"] = float(rebuilds)
        if joins:
            metrics["rollout/continuous_joins"] = float(joins)
        if self.config.quantization != "none":
            metrics.update(self._quant_metrics())
        return metrics

    def _quant_metrics(self) -> dict[str, float]:
        """rollout/quantized_layers, rollout/unquantized_layers (projections the int8 kernel does not serve, each
        named once in a warning) and rollout/quantize_s (the last quantization's seconds)."""
        fast = self._fast
        if fast is None:
            return {"rollout/quantized_layers": 0.0, "rollout/unquantized_layers": float(self._unserved_linears)}
        fresh = {n: why for n, why in fast.unquantized.items() if n not in self._quant_warned}
        if fresh:
            logger.warning("rollout.quantization=%s: %d projection(s) stay unquantized (the int8 kernel cannot "
                           "serve them): %s", self.config.quantization, len(fresh),
                           "; ".join(f"{n}: {why}" for n, why in list(fresh.items())[:8]) +
                           (f"; ... {len(fresh) - 8} more" if len(fresh) > 8 else ""))
            self._quant_warned |= set(fresh)
        return {"rollout/quantized_layers": float(fast.quantized),
                "rollout/unquantized_layers": float(len(fast.unquantized)),
                "rollout/quantize_s": fast.quantize_s}

    def _hit_stop_string(self, tokens: list[int], params: SamplingParams) -> bool:
        if not params.stop:
            return False
        # Only the tail can contain a new match: decode a window wide enough for the longest stop string.
        tail = self.tokenizer.decode(tokens[-(max(len(s) for s in params.stop) + 8):])
        return any(s in tail for s in params.stop)

    def _forward_fn(self, prompt_ids: torch.Tensor, params: SamplingParams):
        """`forward(ids, mask) -> last logits [B, V]` for one batch, first called on `prompt_ids`: the training
        forward (decoder=train), the whole sequence so far at every step (kv_cache=false), or the model's forward
        with the cache it returns threaded through (the fast decoder: `_prefill`)."""
        if self.config.decoder == "train":
            return _TrainForward(self.model, prompt_ids, params, self.tokenizer.pad_token_id)
        if not self.config.kv_cache:
            full_ids = prompt_ids

            def recompute(step_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                nonlocal full_ids
                full_ids = full_ids if step_ids is full_ids else torch.cat([full_ids, step_ids], 1)
                return self._forward(full_ids, mask, None)[0]
            return recompute
        cache = None

        def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            nonlocal cache
            logits, cache = self._forward(ids, mask, cache)
            return logits
        return forward

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, cache):
        # Positions follow the mask: left padding does not shift RoPE, and rows stay aligned per step.
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        pos = pos[:, -input_ids.shape[1]:]
        kwargs = dict(input_ids=input_ids, attention_mask=mask, position_ids=pos)
        if self.config.kv_cache:
            kwargs.update(use_cache=True, past_key_values=cache)
        out = self.model(**kwargs)
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
        new_cache = getattr(out, "past_key_values", None) if self.config.kv_cache else None
        if self.config.kv_cache and new_cache is None:
            raise VerlRuntimeError("the model returned no past_key_values; build the torch engine with "
                                   "rollout.kv_cache=false for models without a KV cache")
        return logits[:, -1, :], new_cache

    # -- weights and memory ----------------------------------------------------------------------------------

    def _module_weights(self) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        return params

    def _expert_slots(self) -> dict:
        """Checkpoint name -> where it lives in the module, for the experts a transformers MoE module keeps fused
        (verl.models.layout.hf_module_slots): a megatron actor sends them by those names. {} otherwise."""
        from verl.models.config import arch_from_hf
        from verl.models.layout import hf_module_slots
        try:
            return hf_module_slots(arch_from_hf(self.model.config))
        except (VerlConfigError, AttributeError):
            return {}

    def weight_names(self) -> set[str]:
        return set(self._module_weights()) | set(self._expert_slots())

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {n: t.data for n, t in self._module_weights().items()}
        tensors.update({n: slot.view(tensors) for n, slot in self._expert_slots().items()})  # views: written in place
        return tensors

    @torch.no_grad()
    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Atomic: every tensor is checked (name, shape, dtype) and staged in a copy of its own while the stream
        is consumed, then all of them replace the engine's at once (`last_swap_s`: that swap alone; it is the
        only moment the weights change, so no token is ever computed from a mix of two versions). A failure
        while staging leaves the engine's weights untouched. An MoE expert's tensor (checkpoint name) is staged
        into a copy of the fused parameter that holds it."""
        params, slots = self._module_weights(), self._expert_slots()
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        fused: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            slot = slots.get(name)
            if slot is None:
                dst = self._checked_destination(params, name, tensor)
                # stays on the device hf_device_map chose; a copy, since the stream's tensors are views it reuses
                staged.append((dst, tensor.to(dst.device, copy=True)))
                continue
            self._checked_destination({name: slot.view(params)}, name, tensor)
            if slot.param not in fused:
                fused[slot.param] = params[slot.param].detach().clone()
            slot.view(fused).copy_(tensor)
        staged += [(params[n], t) for n, t in fused.items()]
        t0 = time.perf_counter()
        for dst, new in staged:
            dst.data = new
        self.last_swap_s = time.perf_counter() - t0
        self._loads += 1
        return len(staged)

    def _checked_destination(self, params: dict, name: str, tensor: torch.Tensor) -> torch.Tensor:
        dst = params.get(name)
        if dst is None:
            near = [k for k in params if k.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]][:3]
            raise VerlRuntimeError(f"the {self.name} engine's model has no weight named {name!r}"
                                   f"{f' (similar: {near})' if near else ''}; the weight stream and the model "
                                   f"disagree on names")
        if tuple(dst.shape) != tuple(tensor.shape) or dst.dtype != tensor.dtype:
            raise VerlRuntimeError(f"weight {name!r} arrived as {tuple(tensor.shape)} {tensor.dtype} but the "
                                   f"{self.name} engine's model holds {tuple(dst.shape)} {dst.dtype}; nothing was "
                                   f"changed (the engine keeps its previous weights)")
        if dst.device.type == "meta":
            raise VerlRuntimeError(f"weight {name!r} is offloaded to disk by the model's device_map "
                                   f"({self.device_map}); weights offloaded to disk cannot be updated in place, "
                                   f"load the rollout model with a device_map that keeps them in memory")
        return dst

    def _release(self) -> None:
        # The KV cache lives only inside generate(); weights are offloaded only when asked (and when they are
        # not already on the CPU).
        if self.config.cpu_offload and self._offloaded is None:
            self._offloaded = {n: p.device for n, p in self.model.named_parameters()}
            for p in self.model.parameters():
                p.data = p.data.to("cpu")

    def _resume(self) -> None:
        if self._offloaded is not None:
            for n, p in self.model.named_parameters():
                p.data = p.data.to(self._offloaded[n])
            self._offloaded = None


class _Routes:
    """The experts each row's tokens went to, one column per token fed to the model (None: nothing recorded):
    the prefill's [B, P, L, K], then one column per decode step (a recomputing forward's last)."""

    def __init__(self, recorder, batch: int):
        self.recorder, self.batch = recorder, batch
        self.cols: list[torch.Tensor] = []
        self.width = 0
        self.ok = recorder is not None

    def _take(self) -> torch.Tensor | None:
        ids = self.recorder.take(self.batch) if self.ok else None
        self.ok = ids is not None
        return ids

    def prefill(self, width: int) -> None:
        ids = self._take()
        if ids is not None:
            self.cols, self.width = [ids[:, -width:]], width

    def step(self) -> None:
        ids = self._take()
        if ids is not None:
            self.cols.append(ids[:, -1:])

    def rebuilt(self) -> None:
        """A KV rebuild ran the prompt and every fed token again: its routes replace the recorded ones."""
        ids = self._take()
        if ids is not None:
            self.cols = [ids]

    def of_row(self, r: int, prompt_len: int, generated: int) -> torch.Tensor | None:
        """[prompt_len + generated - 1, L, K]: the row's prompt tokens (left-padded to `width`), then each generated
        token the model was fed (all but the last)."""
        if not self.ok or not self.cols:
            return None
        row = torch.cat([c[r] for c in self.cols])
        return row[self.width - prompt_len:self.width + max(generated - 1, 0)].clone()


@dataclass(slots=True)
class _Pause:
    """A pausable generation's weight bookkeeping: the version its cache holds (None until the first hook
    call), the engine's load count when the cache was computed, and the fast decoder's cache length."""

    loads: int
    cap: int
    version: int | None = None


class _TrainForward:
    """decoder=train: every step runs the training forward (`base_model` over the whole [B, P + R] buffer,
    future columns masked, then the LM head over the R response positions) exactly as the actor's log-prob
    pass will, so the logits a token is sampled from are bit for bit the trainer's. Causal attention gives a
    masked future key a weight of exactly 0, and every GEMM has the training batch's shape, so column t does not
    depend on what later fills the buffer."""

    def __init__(self, model: torch.nn.Module, prompt_ids: torch.Tensor, params: SamplingParams, pad_id: int):
        B, P = prompt_ids.shape
        self.model, self.params, self.P, self.t = model, params, P, -1
        R = params.max_new_tokens
        self.ids = torch.full((B, P + R), pad_id, dtype=torch.long, device=prompt_ids.device)
        self.ids[:, :P] = prompt_ids
        self.mask = torch.zeros_like(self.ids)
        self.hidden = None

    def __call__(self, step_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.t += 1
        if self.t > 0:
            self.ids[:, self.P + self.t - 1] = step_ids[:, -1]
        self.mask[:, :mask.shape[1]] = mask
        return self.refresh()

    def refresh(self) -> torch.Tensor:
        """The current step's logits from the module's weights as they are now: nothing derived from the
        weights is kept between steps, so after a weight update this is the whole KV rebuild."""
        P, t = self.P, self.t
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model.base_model(input_ids=self.ids, attention_mask=self.mask, position_ids=pos, use_cache=False)
        self.hidden = out.last_hidden_state[:, P - 1:-1]
        lm_head = self.model.get_output_embeddings()
        from verl.ops.logprob import lm_head_is_fused
        # the same GEMM the training forward runs (unfused path), so the sampled-from logits are its logits
        logits = lm_head(self.hidden[:, t]) if lm_head_is_fused(lm_head) else lm_head(self.hidden)[:, t]
        return logits

    def logprobs(self, nxt: torch.Tensor) -> list[float] | None:
        """The sampled tokens' log-probs from the training log-prob function itself (when the sampling
        distribution is its distribution: temperature only, no top-k / top-p)."""
        p = self.params
        if p.greedy or 0 < p.top_k or p.top_p < 1.0:
            return None
        from verl.ops.logprob import lm_head_logprob_entropy
        targets = self.ids[:, self.P:].clone()
        targets[:, self.t] = nxt.to(targets.device)
        lp, _ = lm_head_logprob_entropy(self.hidden, self.model.get_output_embeddings(), targets, p.temperature)
        return lp[:, self.t].tolist()


class _Jobs:
    """`generate`'s rows as the TurnSource of a continuous batch: all ready from the start, taken in order."""

    def __init__(self, requests: list[TurnRequest]):
        self.pending = collections.deque(requests)
        self.total = len(requests)
        self.outputs: dict[int, GenerationOutput] = {}
        self.joins = 0
        """Admissions after the first (slots freed by finished rows taken by pending ones)."""

    def take(self, block: bool, limit: int | None = None) -> list[TurnRequest]:
        n = len(self.pending) if limit is None else min(limit, len(self.pending))
        self.joins += n > 0 and len(self.pending) < self.total
        return [self.pending.popleft() for _ in range(n)]

    def finish(self, request: TurnRequest, output: GenerationOutput) -> None:
        self.outputs[request.key] = output

    def done(self) -> bool:
        return len(self.outputs) == self.total


@dataclass(slots=True)
class _Row:
    """A turn in the continuous batch."""

    request: TurnRequest
    gen: torch.Generator | None
    limit: int
    tokens: list[int]
    logprobs: list[float]
    done: bool = False


class _Continuous:
    """One `TorchRollout.serve` call: the fast decoder's cache holds the rows in `rows` (finished ones ride along,
    masked, until they are an eighth of the batch), `mask` [rows, columns] their real positions, `logits` the next
    token's logits of each row."""

    def __init__(self, engine: TorchRollout, source: TurnSource, params: SamplingParams, max_wait: int | None = 4):
        self.engine, self.source, self.params = engine, source, params
        self.max_wait = max_wait
        """Decode steps a ready row may wait for others to join with it (None: until they are enough)."""
        self.held: list[TurnRequest] = []
        """Ready rows not yet admitted: each admission copies the whole cache, so rows join in groups."""
        self.waited = 0
        self.fast, self.tok = engine._fast, engine.tokenizer
        self.stop_ids = engine._stop_ids(params)
        self.rows: list[_Row] = []
        self.mask: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.device = engine._input_device()
        self.fast.prepare(1)

    def live(self) -> int:
        return sum(not r.done for r in self.rows)

    def run(self) -> None:
        while True:
            live = self.live()
            room = self.engine.config.max_batch_size - live - len(self.held)
            if room > 0:
                self.held += self.source.take(block=live == 0 and not self.held, limit=room)
            # ready rows join once they are an eighth of the batch (an admission costs about a decode step), or
            # after max_wait steps, or at once into an empty batch
            if self.held and (live == 0 or 8 * len(self.held) >= live or
                              (self.max_wait is not None and self.waited >= self.max_wait)):
                self.engine._check_contexts(self.held)
                self._admit(self.held)
                self.held, self.waited = [], 0
            elif self.held:
                self.waited += 1
            if self.live() == 0:
                if self.source.done():
                    return
                continue
            self._step()

    def _admit(self, requests: list[TurnRequest]) -> None:
        self._compact(force=True)
        new = [_Row(request=r, gen=None if r.seed is None else torch.Generator().manual_seed(turn_seed(r.seed, r.turn)),
                    limit=min(r.max_new_tokens, self.engine.budget(len(r.prompt_ids), self.params)), tokens=[],
                    logprobs=[]) for r in requests]
        first: dict[tuple[int, ...], int] = {}  # each distinct prompt is prefilled once (a group's samples)
        which = [first.setdefault(tuple(r.prompt_ids), len(first)) for r in requests]
        ids, mask = self.tok.pad([list(p) for p in first], side="left")
        ids, mask = ids.to(self.device), mask.to(self.device)
        rows = self.rows + new
        reserve = max(r.limit - len(r.tokens) for r in rows)
        index = None if len(first) == len(requests) else torch.tensor(which, device=self.device)
        logits = self.fast.join(ids, mask, reserve, repeat=index)
        self.engine._count_prefill(mask)
        mask = mask if index is None else mask[index]
        width = self.fast.length
        parts = [] if self.mask is None else [_left(self.mask, width)]
        self.mask = torch.cat(parts + [_left(mask, width)])
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.rows = rows

    def _step(self) -> None:
        params = self.params
        logits = self.logits.to("cpu") if self.logits.device.type != "cpu" else self.logits
        processed = process_logits(logits, params)
        nxt = sample_tokens(processed, params, [r.gen for r in self.rows])
        lp = processed.log_softmax(-1).gather(-1, nxt[:, None])[:, 0].tolist() if params.logprobs else None
        finished = []
        for k, (row, t) in enumerate(zip(self.rows, nxt.tolist())):
            if row.done:
                continue
            row.tokens.append(t)
            if lp is not None:
                row.logprobs.append(lp[k])
            stop = t in self.stop_ids or self.engine._hit_stop_string(row.tokens, params)
            if stop or len(row.tokens) >= row.limit:
                row.done = True
                finished.append((row, "stop" if stop else "length"))
        for row, reason in finished:
            r = row.request
            self.source.finish(r, self.engine._finish(r.key, 0, r.prompt_ids, row.tokens, reason,
                                                      row.logprobs if params.logprobs else None, params.stop))
        if self.live() == 0:
            return
        self._compact(force=False)
        live = torch.tensor([not r.done for r in self.rows])
        self.engine.stats["positions"] += len(self.rows)
        self.engine.stats["valid_positions"] += int(live.sum())
        feed = torch.where(live, torch.tensor([r.tokens[-1] if r.tokens else 0 for r in self.rows]),
                           torch.tensor(self.tok.pad_token_id))
        self.mask = torch.cat([self.mask, live.long()[:, None].to(self.mask.device)], 1)
        self.logits = self.fast.step(feed[:, None].to(self.device), self.mask)

    def _compact(self, force: bool) -> None:
        """Drops finished rows (all of them when `force`, else once they are an eighth of the batch: each drop
        copies the cache) and the leading columns no remaining row uses."""
        dead = len(self.rows) - self.live()
        if dead == 0 or (not force and 8 * dead < len(self.rows)):
            return
        keep = [k for k, r in enumerate(self.rows) if not r.done]
        self.rows = [self.rows[k] for k in keep]
        if not keep:
            self.fast.clear()  # an empty batch: the next join starts a fresh cache
            self.mask = self.logits = None
            return
        index = torch.tensor(keep, device=self.mask.device)
        self.fast.select(index)
        self.mask, self.logits = self.mask[index], self.logits[index.to(self.logits.device)]
        first = int(self.mask.argmax(-1).min())  # the leftmost column any remaining row uses
        self.fast.trim(first)
        self.mask = self.mask[:, first:]


def _left(mask: torch.Tensor, width: int) -> torch.Tensor:
    """`mask` padded with zero columns on the left to `width` columns."""
    pad = width - mask.shape[1]
    return mask if pad == 0 else torch.cat([mask.new_zeros((mask.shape[0], pad)), mask], 1)
