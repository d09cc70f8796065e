"""Hugging Face safetensors checkpoints <-> a TP x PP-sharded megatron GPT.

Loading: every rank opens the checkpoint lazily (`safe_open`) and reads, through `get_slice`, only the rows
or columns its own shards need — no rank materialises the whole model.

Export: each parameter is all-gathered over TP (a routed expert's over expert TP), the experts of the other
expert-parallel ranks are gathered to the first one, pipeline stages send their tensors to global rank 0 of the
PP group (first DP replica, TP rank 0), which cuts them back into HF tensors along the ShardSpec segments and
writes safetensors + config (+ tokenizer). Bit-exact: only concatenation and slicing, no arithmetic.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.models.gpt import MegatronGPT
from verl.models.config import ArchSpec
from verl.models.layout import ShardSpec, hf_tensor_shapes

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (sharded index or single file)."""
    if (path / _INDEX).exists():
        index = json.loads((path / _INDEX).read_text())
        return {name: path / fname for name, fname in index["weight_map"].items()}
    if (path / _SINGLE).exists():
        with safe_open(str(path / _SINGLE), framework="pt") as f:
            return {name: path / _SINGLE for name in f.keys()}
    raise VerlConfigError(f"{path} has neither {_INDEX} nor {_SINGLE}; pass a Hugging Face checkpoint directory "
                          f"saved with safetensors (save_pretrained(..., safe_serialization=True))")


class _LazyReader:
    """Opens each safetensors file at most once and reads slices on demand."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0

    def slice(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(name)
        fpath = self.files[name]
        if fpath not in self._handles:
            self._handles[fpath] = safe_open(str(fpath), framework="pt")
        sl = self._handles[fpath].get_slice(name)
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        t = sl[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _read_shard(reader: _LazyReader, spec: ShardSpec, tp_rank: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty(spec.local_shape(tp_rank), dtype=like.dtype)
    dim = spec.cut_dim
    for seg, offset in spec.local_segments(tp_rank):
        dst = out.narrow(dim, offset, seg.length)
        if seg.hf_name is None:
            dst.zero_()
        else:
            dst.copy_(reader.slice(seg.hf_name, dim, seg.start, seg.length))
    return out


def load_hf_checkpoint(model: MegatronGPT, path: str | os.PathLike, *, strict: bool = True) -> dict:
    """Loads this rank's shards from an HF checkpoint directory into `model` in place.

    Returns {'loaded': [megatron names], 'missing': [megatron names whose HF tensors are absent],
    'unused': [checkpoint tensors the model has no place for], 'bytes_read': int}. With strict=True a missing
    tensor raises, except the value head of a critic initialised from a causal-LM checkpoint (it keeps its
    fresh init), and so does an unused one: a tensor the model drops (a bias it lacks, an extra layer) means the
    loaded model is not the checkpoint's.
    """
    path = Path(path)
    reader = _LazyReader(_tensor_files(path))
    unused = unused_tensors(reader.files, model.arch, value_head=model.options.value_head)
    if unused and strict:
        reader.close()
        shown = ", ".join(unused[:8]) + (f", ... ({len(unused)} in all)" if len(unused) > 8 else "")
        raise VerlConfigError(f"checkpoint {path} has tensors the {model.arch.model_type} model does not use: "
                              f"{shown}. Loading would drop them and compute something else than the checkpoint; "
                              f"check that config.json matches the weights (e.g. attention_bias, "
                              f"num_hidden_layers), or pass strict=False to ignore them")
    optional = {"lm_head.weight"} if model.arch.tie_word_embeddings or model.options.value_head else set()
    absent = sorted(set(hf_tensor_shapes(model.arch)) - set(reader.files) - optional)
    if absent and strict:
        # checked on every rank against the whole model (not only this rank's shards), so every rank refuses:
        # an expert only one expert-parallel rank holds would otherwise stop that rank alone
        reader.close()
        shown = ", ".join(absent[:8]) + (f", ... ({len(absent)} in all)" if len(absent) > 8 else "")
        raise VerlConfigError(f"checkpoint {path} lacks {shown}, which the {model.arch.model_type} model needs; is it "
                              f"a checkpoint of this architecture and size (num_experts, num_hidden_layers)?")
    params = dict(model.gpt.named_parameters())
    loaded, missing = [], []
    try:
        _load_specs(model, reader, params, path, strict, loaded, missing)
    finally:
        reader.close()
    return {"loaded": loaded, "missing": missing, "unused": unused, "bytes_read": reader.bytes_read}


def unused_tensors(names, arch: ArchSpec, *, value_head: bool = False) -> list[str]:
    """Checkpoint tensor names the megatron model built from `arch` has no parameter for (over every pipeline
    stage, so each rank reaches the same verdict), sorted."""
    expected = set(hf_tensor_shapes(arch, value_head=value_head))
    # Rotary inverse frequencies are recomputed from rope_theta; a tied LM head is the embedding itself; a critic
    # initialised from a causal LM has no use for its LM head.
    optional = {"lm_head.weight"} if arch.tie_word_embeddings or value_head else set()
    return sorted(n for n in names if n not in expected and n not in optional
                  and not n.endswith("rotary_emb.inv_freq"))


def _load_specs(model: MegatronGPT, reader: _LazyReader, params: dict, path: Path, strict: bool,
                loaded: list, missing: list) -> None:
    with torch.no_grad():
        for spec in model.shard_specs():
            param = params[spec.local_name]
            absent = [n for n in spec.hf_names if n not in reader.files]
            if absent:
                if strict and spec.kind != "value-head":
                    raise VerlConfigError(f"checkpoint {path} lacks {absent} needed for megatron parameter "
                                          f"{spec.name}; is it a {model.arch.model_type} checkpoint of the same size?")
                missing.append(spec.name)
                continue
            pg = model.pg
            try:
                k = spec.chunk_index(tp=pg.tp_rank, dp=pg.dp_rank, etp=pg.etp_rank)
                shard = _read_shard(reader, spec, k, param)
            except Exception as e:
                raise VerlRuntimeError(f"reading {spec.hf_names} for {spec.name} from {path} failed: {e}",
                                       rank=dist.get_rank() if dist.is_initialized() else None, cause=e) from e
            if tuple(shard.shape) != tuple(param.shape):
                raise VerlConfigError(f"{spec.name}: checkpoint gives shape {tuple(shard.shape)}, the model has "
                                      f"{tuple(param.shape)}")
            param.copy_(shard)
            loaded.append(spec.name)


# ------------------------------------------------------------------------------------------------ export

def _gather_tp(t: torch.Tensor, spec: ShardSpec, pg) -> torch.Tensor:
    """The whole parameter from its TP (or, for an expert, expert-TP) chunks."""
    group = pg.etp if spec.axis == "etp" else pg.tp
    if spec.dim is None or spec.parts == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(spec.parts)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=spec.dim)


def _split_to_hf(full: torch.Tensor, spec: ShardSpec, out: dict[str, torch.Tensor],
                 shapes: dict[str, tuple[int, ...]]) -> None:
    dim = spec.cut_dim
    pos = 0
    for seg in spec.segments:
        piece = full.narrow(dim, pos, seg.length)
        pos += seg.length
        if seg.hf_name is None:
            continue
        if seg.hf_name not in out:
            out[seg.hf_name] = torch.empty(shapes[seg.hf_name], dtype=full.dtype)
        out[seg.hf_name].narrow(dim, seg.start, seg.length).copy_(piece)


def gather_hf_state_dict(model: MegatronGPT,
                         tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
    """HF-named full tensors on global rank 0 of the PP group's first stage (None elsewhere).

    `tensors` maps local parameter names to what to gather (default: the parameters themselves; pass the
    grads to map gradients back to HF names). Collective over TP, EP and PP.
    """
    pg = model.pg
    params = dict(model.gpt.named_parameters())
    shapes = hf_tensor_shapes(model.arch, value_head=model.options.value_head)
    stage_out: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    gathering = pg.tp_rank == 0 and (pg.ep_size == 1 or pg.expert_coords(pg.rank)[1:3] == (0, 0))
    for spec in model.shard_specs():
        if not spec.exported:
            continue
        local = (tensors[spec.local_name] if tensors is not None else params[spec.local_name]).detach()
        full = _gather_tp(local, spec, pg)
        if spec.ep is not None:
            if pg.etp_rank == 0:
                _split_to_hf(full, spec, experts, shapes)
        elif gathering:
            _split_to_hf(full, spec, stage_out, shapes)
    stage_out.update(_gather_experts(experts, pg))
    if pg.pp_size == 1:
        return stage_out if gathering else None
    # Stages' TP-rank-0 ranks send their HF tensors to stage 0 (object lists keep it simple; the checkpoint
    # goes to disk anyway).
    if not gathering:
        return None
    objs: list = [None] * pg.pp_size
    dist.gather_object(stage_out, objs if pg.is_first_stage else None, dst=pg.pp_global_ranks[0], group=pg.pp)
    if not pg.is_first_stage:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in objs:
        merged.update(part)
    return merged


def _gather_experts(experts: dict[str, torch.Tensor], pg) -> dict[str, torch.Tensor]:
    """Every EP rank's expert tensors, on the stage's writer (TP rank 0 of the first DP replica, which is EP rank
    0 of its expert group); {} elsewhere. Collective over the EP groups of expert-TP rank 0 and expert-DP rank 0."""
    if pg.ep_size == 1:
        return experts
    etp_i, ep_i, edp_i, _ = pg.expert_coords(pg.rank)
    if etp_i != 0 or edp_i != 0:
        return {}
    ranks = dist.get_process_group_ranks(pg.ep)
    objs: list = [None] * pg.ep_size if ep_i == 0 else None
    dist.gather_object(experts, objs, dst=ranks[0], group=pg.ep)
    if ep_i != 0 or pg.tp_rank != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in objs:
        merged.update(part)
    return merged


def export_hf_checkpoint(model: MegatronGPT, path: str | os.PathLike, *, tokenizer=None,
                         max_shard_bytes: int = 2 << 30) -> Path | None:
    """Writes `model` as a Hugging Face checkpoint directory transformers can load (collective).

    Rank 0 of the first DP replica writes safetensors (sharded with an index above `max_shard_bytes`),
    config.json and, when given, the tokenizer. Returns the path on the writing rank, None elsewhere.
    """
    hf = gather_hf_state_dict(model)
    writer = hf is not None and model.pg.dp_rank == 0
    if writer:
        expected = hf_tensor_shapes(model.arch, value_head=model.options.value_head)
        if set(hf) != set(expected):
            raise VerlRuntimeError(f"export produced {sorted(set(hf) ^ set(expected))} unexpectedly")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        _write_safetensors(hf, path, max_shard_bytes)
        config = model.hf_config
        if model.options.value_head:
            config = _token_classification_config(config)
        config.save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
    if dist.is_initialized():
        dist.barrier()
    return Path(path) if writer else None


def _token_classification_config(config):
    import copy
    arch_name = {"llama": "LlamaForTokenClassification", "qwen2": "Qwen2ForTokenClassification",
                 "mistral": "MistralForTokenClassification"}[config.model_type]
    c = copy.deepcopy(config)
    c.architectures = [arch_name]
    c.num_labels = 1
    return c


def _write_safetensors(hf: dict[str, torch.Tensor], path: Path, max_shard_bytes: int) -> None:
    names = sorted(hf)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = hf[n].numel() * hf[n].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: hf[n].contiguous() for n in shards[0]}, str(path / _SINGLE), metadata=meta)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: hf[n].contiguous() for n in shard}, str(path / fname), metadata=meta)
        for n in shard:
            weight_map[n] = fname
            total += hf[n].numel() * hf[n].element_size()
    (path / _INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
