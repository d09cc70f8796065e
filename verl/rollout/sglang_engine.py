"""The `sglang` rollout engine: an adapter over SGLang's offline `sglang.Engine`, configured by the one
`RolloutConfig` (its fields marked "sglang:" and the shared ones).

    engine = SGLangRollout(RolloutConfig(engine="sglang", tp=2), "/ckpt/actor")   # on every torchrun rank

SGLang runs on CUDA GPUs (its CPU backend needs its kernel library, sgl-kernel, built from source for
CPU; PyPI carries only the CUDA build), so where it cannot run the engine refuses to start with the
reason, and its tests skip with it.

Layouts. Without a process group this process owns one `sglang.Engine` with tp_size = rollout.tp (SGLang
starts its own scheduler process per TP rank). Under torchrun with rollout.tp = T, the world is cut into
groups of T consecutive ranks (as vLLM's external launcher does); the group's first rank owns the Engine
(tp_size T, on the GPUs of the group's ranks) and the others drive it SPMD: every rank of a group calls
update_weights with its own shard and generate with the same prompts; results are broadcast to the group.

Weights: SGLang's `Engine.update_weights_from_tensor(named_tensors, load_format, flush_cache)` takes a list of
(name, tensor) pairs. A plain tensor goes to every TP rank: with `load_format=None` SGLang's loaders treat it
as a full checkpoint tensor (hf format: they fuse and shard it). For per-rank shards (the `vllm` format:
fused qkv_proj / gate_up_proj, this TP rank's piece) the value is a `LocalSerializedTensor` whose
`values[r]` is TP rank r's tensor serialised with `MultiprocessingSerializer` (a CUDA IPC handle, so the
sending ranks keep their tensors alive until the owner's call returns), loaded with `load_format="direct"`
(copied into the rank's parameter as is). Pushes go in buckets of rollout.sync_bucket_mb with
flush_cache=False, then one flush_cache() (cached prefixes hold the old weights' keys/values).

Log-probs: SGLang returns those of the temperature-scaled distribution (SGLANG_RETURN_ORIGINAL_LOGPROB is
forced off for the engine's processes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, length_limit
from verl.rollout.config import RolloutConfig
from verl.rollout.tokenizer import Tokenizer

__all__ = ["SGLangRollout", "sglang_available"]

_FUSED = (".qkv_proj.", ".gate_up_proj.")
_UNFUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# sglang.Engine arguments that RolloutConfig fields own.
_OWNED = {"model_path", "tokenizer_path", "dtype", "tp_size", "mem_fraction_static", "random_seed", "context_length",
          "max_running_requests", "disable_cuda_graph", "enable_memory_saver", "base_gpu_id"}


def sglang_available() -> tuple[bool, str]:
    """(usable here, reason if not)."""
    try:
        import sglang  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, (f"sglang is not importable ({type(e).__name__}: {e}); it runs on CUDA GPUs: "
                       f"`pip install verl[sglang]` on a GPU machine (its CPU backend needs sgl-kernel built "
                       f"from source for CPU)")
    if not torch.cuda.is_available():
        return False, "sglang is installed but there is no CUDA GPU; SGLang's offline engine needs one"
    return True, ""


class SGLangRollout(RolloutEngine):
    """SGLang's offline engine behind the rollout interface (see the module docstring)."""

    name = "sglang"

    def __init__(self, config: RolloutConfig, model_path: str, tokenizer=None):
        ok, why = sglang_available()
        if not ok:
            raise VerlConfigError(f"the sglang rollout engine cannot run here: {why}")
        owned = sorted(_OWNED & set(config.engine_kwargs))
        if owned:
            raise VerlConfigError(f"rollout.engine_kwargs sets {owned}, which rollout's own fields own; set those")
        super().__init__(Tokenizer.wrap(tokenizer if tokenizer is not None else model_path))
        from verl.rollout.vllm_engine import checkpoint_shapes, resolve_dtype
        self.config, self.model_path = config, model_path
        self.dtype = resolve_dtype(config.dtype, model_path)
        self._hf_shapes = checkpoint_shapes(model_path)
        hf = json.loads((Path(model_path) / "config.json").read_text())
        positions = hf.get("max_position_embeddings")
        self.max_model_len = length_limit(config.max_model_len, int(positions) if positions else None) or 1 << 30
        self.vocab_size = int(hf["vocab_size"]) if hf.get("vocab_size") else None
        self.group, self.group_ranks, self.tp_rank = _tp_group(config.tp)
        self._rng = torch.Generator().manual_seed(config.seed + 1_000_003 * (_rank() // config.tp))
        self._names = self._weight_names()
        self.engine = self._start() if self.tp_rank == 0 else None

    def _start(self):
        import sglang
        cfg = self.config
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"   # the processed distribution, as every engine
        kwargs = dict(model_path=self.model_path, dtype=self.dtype, tp_size=cfg.tp,
                      mem_fraction_static=cfg.gpu_memory_utilization, random_seed=cfg.seed,
                      max_running_requests=cfg.max_batch_size, disable_cuda_graph=cfg.enforce_eager,
                      enable_memory_saver=cfg.cpu_offload, context_length=self.max_model_len)
        if "LOCAL_RANK" in os.environ:
            kwargs["base_gpu_id"] = int(os.environ["LOCAL_RANK"])  # a group's GPUs start at its owner's
        kwargs.update(cfg.engine_kwargs)
        try:
            return sglang.Engine(**kwargs)
        except Exception as e:  # noqa: BLE001
            raise VerlRuntimeError(f"SGLang failed to start on {self.model_path!r}: {type(e).__name__}: {e}",
                                   cause=e) from e

    # -- generation ---------------------------------------------------------------------------------------------

    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, (1,), generator=self._rng))
        jobs = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
        if self.group is not None:
            _agree(self.group, self.group_ranks, (prompt_ids, repr(params), base))
        raw = self._run(prompt_ids, params, jobs, base) if self.engine is not None else None
        if self.group is not None:
            box = [raw]
            torch.distributed.broadcast_object_list(box, src=self.group_ranks[0], group=self.group)
            raw = box[0]
        return [self._finish(i, j, prompt_ids[i], tokens, reason, lps, params.stop)
                for (i, j), (tokens, reason, lps) in zip(jobs, raw)]

    def _run(self, prompt_ids, params: SamplingParams, jobs, base: int) -> list[tuple]:
        sp = [dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k > 0 else -1, stop=list(params.stop) or None,
                   stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
                   sampling_seed=base + i * params.n + j) for i, j in jobs]
        res = self.engine.generate(input_ids=[prompt_ids[i] for i, _ in jobs], sampling_params=sp,
                                   return_logprob=params.logprobs)
        out = []
        for r in res:
            meta = r.get("meta_info", {})
            tokens = list(r.get("output_ids") or self.tokenizer.encode(r["text"], add_special_tokens=False))
            lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])] if params.logprobs else None
            fr = meta.get("finish_reason") or {}
            kind = fr.get("type") if isinstance(fr, dict) else fr
            if kind == "abort":
                raise VerlRuntimeError(f"SGLang aborted a request: {fr}")
            out.append((tokens, "length" if kind == "length" else "stop", lps))
        return out

    # -- weights ------------------------------------------------------------------------------------------------

    def weight_names(self) -> set[str]:
        """Checkpoint names (hf format) and their fused counterparts (vllm format: qkv_proj, gate_up_proj)."""
        return set(self._names)

    def _weight_names(self) -> dict[str, tuple[int, ...]]:
        """name -> full (TP = 1) shape, for checkpoint names and the fused names built from them."""
        shapes = dict(self._hf_shapes)
        parts = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}
        for n, shape in self._hf_shapes.items():
            for fused, (first, *rest) in parts.items():
                if first in n and all(n.replace(first, p) in self._hf_shapes for p in rest):
                    rows = sum(self._hf_shapes[n.replace(first, p)][0] for p in (first, *rest))
                    shapes[n.replace(first, fused)] = (rows, *shape[1:])
        return shapes

    def _nbytes(self, name: str, t: torch.Tensor) -> int:
        shape = self._names.get(name, t.shape)
        return math.prod(shape) * t.element_size()

    def _check(self, name: str, t: torch.Tensor, loaded: int) -> None:
        if name not in self._names:
            raise VerlRuntimeError(f"the SGLang model has no weight named {name!r}; {loaded} tensors were loaded "
                                   f"before it")
        if str(t.dtype).removeprefix("torch.") != self.dtype:
            raise VerlRuntimeError(f"weight {name!r} has dtype {t.dtype}, the engine holds {self.dtype}; cast it on "
                                   f"the sending side")
        if self.group is None and self.config.tp > 1 and any(f in name for f in _FUSED):
            raise VerlConfigError(f"{name!r}: this process drives all {self.config.tp} TP ranks of its SGLang engine, "
                                  f"so it takes full checkpoint tensors (hf format), not one rank's fused shard")
        if self.group is not None and any(f".{p}." in name for p in _UNFUSED):
            raise VerlConfigError(f"{name!r}: rollout.engine=sglang with rollout.tp>1 under torchrun takes the vllm "
                                  f"weight format (each rank its fused shard); hf-format slices of q/k/v and gate/up "
                                  f"cannot be re-joined here; set the hybrid engine's weight_format='vllm'")
        want = self._names[name]
        if self.config.tp == 1 and tuple(t.shape) != tuple(want):  # per-rank shards (TP > 1) are SGLang's to check
            raise VerlRuntimeError(f"weight {name!r} has shape {tuple(t.shape)}, but the engine expects {want}; "
                                   f"{loaded} tensors were loaded before it")

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        count = 0
        # Bucket by each name's full size, the same on every rank of a group (shards can differ by a few rows).
        for bucket in _buckets(iter(named_tensors), self.config.sync_bucket_mb, self._nbytes):
            for name, t in bucket:
                self._check(name, t, count)
            direct = any(f in name for name, _ in bucket for f in _FUSED)
            if self.group is None:
                self.engine.update_weights_from_tensor(bucket, load_format="direct" if direct else None,
                                                       flush_cache=False)
            else:
                self._push_group_bucket(bucket)
            count += len(bucket)
        if self.engine is not None:
            self.engine.flush_cache()
        return count

    def _push_group_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Every rank of the group sends its own shard of each tensor; the owner hands SGLang one
        LocalSerializedTensor per name whose values[r] is TP rank r's tensor. Under torchrun only the `vllm`
        format (per-rank shards) arrives this way (checked in _check)."""
        import torch.distributed as dist
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor
        from sglang.srt.utils import MultiprocessingSerializer
        alive = [t.detach().cuda() for _, t in bucket]   # the CUDA IPC handles point into these until the barrier
        mine = [(n, MultiprocessingSerializer.serialize(t)) for (n, _), t in zip(bucket, alive)]
        gathered = [None] * len(self.group_ranks) if self.engine is not None else None
        dist.gather_object(mine, gathered, dst=self.group_ranks[0], group=self.group)
        verdict = [_name_mismatch(gathered, self.group_ranks) if self.engine is not None else None]
        dist.broadcast_object_list(verdict, src=self.group_ranks[0], group=self.group)
        if verdict[0] is not None:
            raise VerlRuntimeError(f"SGLang weight push: {verdict[0]}")
        if self.engine is not None:
            named = [(name, LocalSerializedTensor(values=[g[k][1] for g in gathered]))
                     for k, (name, _) in enumerate(mine)]
            self.engine.update_weights_from_tensor(named, load_format="direct", flush_cache=False)
        dist.barrier(group=self.group)  # the senders keep `alive` until the owner's engine has copied it
        del alive

    # -- memory -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Shuts SGLang's engine down (on the rank that owns it; idempotent)."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()

    def _release(self) -> None:
        if self.engine is not None and self.config.cpu_offload:
            self.engine.release_memory_occupation()

    def _resume(self) -> None:
        if self.engine is not None and self.config.cpu_offload:
            self.engine.resume_memory_occupation()


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _tp_group(tp: int):
    """(group, its global ranks, this rank's index in it) for a TP > 1 engine under torchrun; (None, [0], 0) when
    this process owns a whole engine."""
    import torch.distributed as dist

    from verl.distributed.placement import new_group
    if tp == 1 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None, [0], 0
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise VerlConfigError(f"rollout.tp={tp} must divide the world size {world}")
    mine = None
    for start in range(0, world, tp):      # new_group is collective: every rank creates every group
        ranks = list(range(start, start + tp))
        g = new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = (g, ranks, rank - start)
    return mine


def _name_mismatch(gathered: list[list], ranks: list[int]) -> str | None:
    """Why the group's buckets cannot be joined name by name (None when they can)."""
    names = [[n for n, _ in g] for g in gathered]
    for rank, got in zip(ranks, names):
        if got != names[0]:
            return (f"rank {rank} sent {got[:3]}..., the group's owner {names[0][:3]}...; the ranks of one engine must "
                    f"push the same names in the same order")
    return None


def _agree(group, ranks: list[int], payload) -> None:
    import torch.distributed as dist
    digest = hashlib.blake2b(repr(payload).encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)])
    got = [torch.zeros_like(mine) for _ in ranks]
    dist.all_gather(got, mine, group=group)
    if any(int(g) != int(mine) for g in got):
        raise VerlConfigError(f"the ranks {ranks} of one tensor-parallel SGLang engine called generate with different "
                              f"prompts or sampling settings; every rank of the group must pass the same ones (SPMD)")


def _buckets(stream: Iterator, bucket_mb: float, nbytes) -> Iterator[list]:
    bucket, size = [], 0
    for name, t in stream:
        bucket.append((name, t))
        size += nbytes(name, t)
        if size >= bucket_mb * (1 << 20):
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
