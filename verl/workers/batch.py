"""The rollout batch the workers exchange: token tensors plus the texts they came from, and the one adapter
that turns a rollout engine's `GenerationOutput`s into it.

Layout: `input_ids` [B, P + R] holds left-padded prompts (P columns) followed by right-padded responses
(R columns). Response position t is predicted by the logits at column P - 1 + t.

Multi-turn trajectories (verl.agents) put every turn and the observations between them in the response columns:
`attention_mask` is 1 on all of them (the observations are context), `response_mask` only on the tokens the
engine sampled, so every loss, advantage, log-prob mismatch and metric that reads it skips the observations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from verl.errors import VerlConfigError

MicroLossFn = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]],
                       tuple[torch.Tensor, Mapping[str, torch.Tensor]]]
"""loss_fn(outputs, fields) -> (loss, statistics) for one micro-batch: `outputs` are the engine's [b, R] response
outputs (log_probs and entropy, or values), `fields` the micro-batch's response_mask and per-sample tensors."""


@dataclass(slots=True)
class RolloutBatch:
    """B responses (n per prompt, grouped by `group`) and their prompts."""

    input_ids: torch.Tensor
    """[B, P + R] prompt and response token ids."""
    attention_mask: torch.Tensor
    """[B, P + R] 1 on real tokens (prompt padding and tokens after EOS are 0)."""
    position_ids: torch.Tensor
    """[B, P + R] positions counting real tokens only (left padding does not shift them)."""
    response_mask: torch.Tensor
    """[B, R] float, the loss mask: 1 on the response tokens the engine sampled, up to and including EOS (0 on
    padding, and on the observation / template tokens of a multi-turn trajectory, which attention_mask keeps)."""
    group: torch.Tensor
    """[B] long, index of the prompt each response answers (GRPO groups)."""
    rollout_log_probs: torch.Tensor | None = None
    """[B, R] log-probs of the sampled tokens under the rollout engine's sampling distribution (0 on padding)."""
    weight_version: torch.Tensor | None = None
    """[B] long: the policy version (actor optimizer steps taken) whose weights generated each sample; the
    trainer compares it with the version that trains on it (rollout/staleness). With partial rollouts, the
    oldest version among the sample's tokens."""
    token_version: torch.Tensor | None = None
    """[B, R] long: the policy version that produced each response token, -1 on padding (partial rollouts;
    None when the engine recorded no per-token versions)."""
    env_rewards: torch.Tensor | None = None
    """[B] float: the environment's reward of each multi-turn trajectory (reward source type=env); None for
    single-turn rollouts."""
    routes: torch.Tensor | None = None
    """[B, P + R, L, K] int16: the K experts the rollout engine sent each token to in each of the model's L
    mixture-of-experts layers, aligned with input_ids; -1 where it computed nothing (padding, the last
    generated token). None when the engine recorded no routes (router replay, verl/models/moe.py)."""
    prompts: list = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    response_texts: list[str] = field(default_factory=list)
    data_sources: list[str] = field(default_factory=list)
    """Each sample's data source (its row's; empty when the rows had none)."""
    extra_infos: list = field(default_factory=list)
    """Each sample's row `extra_info` (upstream verl's layout; None where absent)."""
    data_indices: list[int] = field(default_factory=list)
    """Each sample's row index in the training dataset (-1 for rows given without one): what samples.jsonl
    records per step, so a recovered run can be checked to train every row exactly once per epoch."""

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def check_token_ids(self, vocab_size: int | None, what: str) -> None:
        """Every id of input_ids in [0, vocab_size) (one host sync); else VerlConfigError naming the row, the
        position and the id, instead of the embedding's bare IndexError (a device-side assert on a GPU)."""
        ids = self.input_ids
        if vocab_size is None or ids.numel() == 0:
            return
        bad = (ids < 0) | (ids >= vocab_size)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise VerlConfigError(f"{what}: row {row} of the batch has token id {int(ids[row, col])} at position "
                                  f"{col}, outside the model's vocabulary of {vocab_size} ids [0, {vocab_size})")

    def select(self, idx: slice | torch.Tensor) -> "RolloutBatch":
        """Rows `idx` (a slice or index tensor) of the batch."""
        rows = range(len(self))[idx] if isinstance(idx, slice) else idx.tolist()
        pick = (lambda xs: xs[idx]) if isinstance(idx, slice) else (lambda xs: [xs[i] for i in rows] if xs else [])
        return replace(self, input_ids=self.input_ids[idx], attention_mask=self.attention_mask[idx],
                       position_ids=self.position_ids[idx], response_mask=self.response_mask[idx],
                       group=self.group[idx],
                       rollout_log_probs=None if self.rollout_log_probs is None else self.rollout_log_probs[idx],
                       weight_version=None if self.weight_version is None else self.weight_version[idx],
                       token_version=None if self.token_version is None else self.token_version[idx],
                       env_rewards=None if self.env_rewards is None else self.env_rewards[idx],
                       routes=None if self.routes is None else self.routes[idx],
                       prompts=pick(self.prompts), answers=pick(self.answers), response_texts=pick(self.response_texts),
                       data_sources=pick(self.data_sources), extra_infos=pick(self.extra_infos),
                       data_indices=pick(self.data_indices))

    def __getitem__(self, idx: slice | torch.Tensor) -> "RolloutBatch":
        return self.select(idx)

    @classmethod
    def concat(cls, pieces: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """The rows of `pieces` in order, as one batch: how the dataflow joins the shards of different ranks.
        Prompts are left-padded again to the longest (masked, so the pad id is irrelevant), and group ids are
        renumbered so that groups of different pieces stay apart."""
        if len(pieces) == 1:
            return pieces[0]
        P = max(b.prompt_length for b in pieces)

        def left(t: torch.Tensor, b: RolloutBatch, fill: int) -> torch.Tensor:
            pad = P - b.prompt_length
            return t if pad == 0 else torch.cat([t.new_full((len(b), pad, *t.shape[2:]), fill), t], dim=1)
        groups, offset = [], 0
        for b in pieces:
            groups.append(b.group - (b.group.min() if len(b) else 0) + offset)
            offset = int(groups[-1].max()) + 1 if len(b) else offset
        lps, wvs, tvs, ers = ([b.rollout_log_probs for b in pieces], [b.weight_version for b in pieces],
                              [b.token_version for b in pieces], [b.env_rewards for b in pieces])
        routes = None if any(b.routes is None for b in pieces) else torch.cat([left(b.routes, b, -1) for b in pieces])
        return cls(input_ids=torch.cat([left(b.input_ids, b, 0) for b in pieces]),
                   attention_mask=torch.cat([left(b.attention_mask, b, 0) for b in pieces]),
                   position_ids=torch.cat([left(b.position_ids, b, 0) for b in pieces]),
                   response_mask=torch.cat([b.response_mask for b in pieces]), group=torch.cat(groups),
                   rollout_log_probs=None if any(x is None for x in lps) else torch.cat(lps),
                   weight_version=None if any(x is None for x in wvs) else torch.cat(wvs),
                   token_version=None if any(x is None for x in tvs) else torch.cat(tvs), routes=routes,
                   env_rewards=None if any(x is None for x in ers) else torch.cat(ers),
                   prompts=[x for b in pieces for x in b.prompts], answers=[x for b in pieces for x in b.answers],
                   response_texts=[x for b in pieces for x in b.response_texts],
                   data_sources=[x for b in pieces for x in b.data_sources],
                   extra_infos=[x for b in pieces for x in b.extra_infos],
                   data_indices=[x for b in pieces for x in b.data_indices])

    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def micro_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def batch_from_outputs(outputs: Sequence, rows: Sequence[Mapping], n: int, response_length: int,
                       pad_id: int) -> RolloutBatch:
    """The training batch of `n` samples per row from an engine's outputs (prompt-major, as every engine returns
    them). Responses end where the engine stopped them (EOS or stop token included) and are right-padded to
    `response_length` columns; prompts are left-padded to the longest. When every output carries
    token_versions (partial rollouts), `token_version` holds them and `weight_version` each row's oldest; a
    row with no tokens takes the newest version in the batch (it adds no token to any loss, so only its
    staleness reading depends on the choice). Otherwise both stay None and the caller sets weight_version.
    Multi-turn outputs (`loss_mask`) keep their observation tokens out of `response_mask` and carry their
    environment's reward into `env_rewards`."""
    if len(outputs) != len(rows) * n:
        raise ValueError(f"{len(outputs)} generation outputs for {len(rows)} prompts x n={n}")
    B, R = len(outputs), response_length
    P = max(len(o.prompt_token_ids) for o in outputs)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    logps = torch.zeros((B, R), dtype=torch.float32) if all(o.logprobs is not None for o in outputs) else None
    tver = torch.full((B, R), -1, dtype=torch.long) if all(o.token_versions is not None for o in outputs) else None
    loss = torch.zeros((B, R), dtype=torch.float32)
    routes = _routes(outputs, P, R)
    for b, o in enumerate(outputs):
        p, r = o.prompt_token_ids, o.token_ids[:R]
        ids[b, P - len(p):P] = torch.as_tensor(p, dtype=torch.long)
        ids[b, P:P + len(r)] = torch.as_tensor(r, dtype=torch.long)
        attn[b, P - len(p):P + len(r)] = 1
        loss[b, :len(r)] = 1.0 if o.loss_mask is None else torch.as_tensor(o.loss_mask[:R], dtype=torch.float32)
        if logps is not None:
            logps[b, :len(r)] = torch.as_tensor(o.logprobs[:R], dtype=torch.float32)
        if tver is not None:
            tver[b, :len(r)] = torch.as_tensor(o.token_versions[:R], dtype=torch.long)
        if routes is not None:  # prompt tokens, then the generated ones the engine fed back
            fed = o.routes[:len(p) + len(r)]
            routes[b, P - len(p):P - len(p) + len(fed)] = fed
    response_mask = attn[:, P:].float() * loss
    multi_turn = any(o.loss_mask is not None for o in outputs)
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        response_mask=response_mask, group=torch.arange(len(rows)).repeat_interleave(n), rollout_log_probs=logps,
        token_version=tver, weight_version=None if tver is None else _oldest_versions(tver), routes=routes,
        env_rewards=torch.tensor([o.reward or 0.0 for o in outputs], dtype=torch.float32) if multi_turn else None,
        prompts=[r["prompt"] for r in rows for _ in range(n)], answers=[r["answer"] for r in rows for _ in range(n)],
        response_texts=[o.text for o in outputs],
        data_sources=[r.get("data_source", "default") for r in rows for _ in range(n)],
        extra_infos=[r.get("extra_info") for r in rows for _ in range(n)],
        data_indices=[int(r.get("index", -1)) for r in rows for _ in range(n)])


def _routes(outputs: Sequence, P: int, R: int) -> torch.Tensor | None:
    """[B, P + R, L, K] int16 filled with -1, when every output carries routes (else None)."""
    if not outputs or any(getattr(o, "routes", None) is None for o in outputs):
        return None
    _, L, K = outputs[0].routes.shape
    return torch.full((len(outputs), P + R, L, K), -1, dtype=torch.int16)


def _oldest_versions(token_version: torch.Tensor) -> torch.Tensor:
    """[B] each row's oldest token version (padding is -1); empty rows take the newest version present (0 when
    no row has a token)."""
    real = token_version >= 0
    newest = int(token_version.max()) if bool(real.any()) else 0
    return torch.where(real, token_version, newest).min(-1).values
