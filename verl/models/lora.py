"""LoRA adapters on a Hugging Face causal LM, with PEFT as the library (actor.lora, docs/lora.md).

    apply_lora(policy, LoRAConfig(enabled=True, rank=16))   # adapters injected in place; base frozen
    with adapters_disabled(policy): ...                      # the base model: the reference, no second copy
    sync_tensors(policy, "adapter")                          # what the weight sync moves: the adapters only
    export_adapter(policy, "out/hf_actor")                   # PEFT's format (PeftModel.from_pretrained reads it)

The adapters are injected into the model itself (`peft.inject_adapter_in_model`), not wrapped in a PeftModel, so
the model keeps its class and everything that reads it (`base_model`, `get_output_embeddings`, `config`, FSDP2's
decoder-layer units) works unchanged. A wrapped linear `<p>` holds `<p>.base_layer.weight` (frozen) and the
trainable `<p>.lora_A.default.weight` [r, in] and `<p>.lora_B.default.weight` [out, r]; its output is
base(x) + (alpha / r) * B A dropout(x). B starts at zero, so a fresh adapter leaves the model unchanged.

PEFT's linear runs the adapter as two more modules, a scaling and an out-of-place add, each recorded by autograd.
apply_lora gives each injected linear `FusedLoraLinear`'s forward instead (still a PEFT layer: isinstance, export,
merge and disable work as before): one autograd node computing base(x) with (x A^T) B^T accumulated into it in
place (the scaling as the GEMM's alpha), and in backward only the frozen base's d x and the adapter's four small
GEMMs, accumulated the same way. It falls back to PEFT's forward whenever PEFT has something more to do: adapters
off or merged, active dropout, a variant (DoRA), dtypes that PEFT would cast, a trainable base.

Sync views (what the 3D-HybridEngine plans from and reads each step, by name):
- "all": every parameter under its own name (full fine-tuning).
- "adapter": the lora_A / lora_B tensors only, under their own names (the engine holds the same adapters).
- "merged": every weight under its plain Hugging Face name, a wrapped linear's as base + scale * B A (the
  fallback for engines that cannot take adapters; FSDP2 chunks merge their own rows: B's dim-0 chunk lines up
  with the base weight's, A is gathered whole, r rows).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from verl.errors import VerlConfigError

__all__ = ["ADAPTER", "SYNC_VIEWS", "adapter_bytes", "adapter_dropout", "adapters_disabled", "apply_lora",
           "export_adapter", "has_lora", "linear_names", "merged_model", "strip_lora", "sync_tensors",
           "unique_bytes"]

ADAPTER = "default"
"""PEFT's adapter name; the one adapter verl trains."""
SYNC_VIEWS = ("all", "adapter", "merged")
_BASE = ".base_layer."


def _tuner_layers(module: torch.nn.Module):
    """The module's LoRA layers; none where peft is not installed (nothing can have injected one: the vLLM and TRL
    environments train full models without it)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [(n, m) for n, m in module.named_modules() if isinstance(m, LoraLayer)]


def has_lora(module: torch.nn.Module) -> bool:
    """The module carries LoRA adapters (apply_lora ran on it, or on the module it was copied from)."""
    return bool(_tuner_layers(module))


def linear_names(module: torch.nn.Module) -> list[str]:
    """The distinct leaf names of the model's linear layers (what target_modules may name), LM head excluded."""
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    return sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def apply_lora(module: torch.nn.Module, cfg) -> torch.nn.Module:
    """Injects adapters (`cfg`: verl.config.ppo.LoRAConfig) into `module` in place and freezes the base; returns
    it. Raises VerlConfigError naming a target that matches no linear layer, with the names that exist."""
    from peft import LoraConfig, inject_adapter_in_model
    targets = list(cfg.target_modules)
    existing = linear_names(module)
    if "all-linear" not in targets:
        missing = [t for t in targets if t not in existing]
        if missing:
            raise VerlConfigError(f"actor.lora.target_modules: {missing} match no linear layer of this "
                                  f"{type(module).__name__}; its linear layers are {existing} (or 'all-linear')")
    elif len(targets) > 1:
        raise VerlConfigError(f"actor.lora.target_modules={targets}: 'all-linear' already names every linear "
                              f"layer; give it alone, or list layers from {existing}")
    peft_cfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules="all-linear" if "all-linear" in targets else targets,
                          init_lora_weights=True)
    inject_adapter_in_model(peft_cfg, module, adapter_name=ADAPTER)
    for name, p in module.named_parameters():
        p.requires_grad_(".lora_" in name)
    fused = _fused_class()
    for _, layer in _tuner_layers(module):
        if type(layer) is fused.__base__:
            layer.__class__ = fused
    return module


class _LoraLinearFn(torch.autograd.Function):
    """y = x W^T + bias + scale (x A^T) B^T, W and bias frozen; saves x and x A^T (PEFT's layers save the same)."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scale):
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2 @ a.t()
        y = torch.nn.functional.linear(x2, weight, bias)
        y.addmm_(xa, b.t(), alpha=scale)
        ctx.save_for_backward(x2, xa, weight, a, b)
        ctx.scale, ctx.x_shape = scale, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, xa, weight, a, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyb = dy2 @ b
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            dx = dy2 @ weight
            dx.addmm_(dyb, a, alpha=ctx.scale)
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[3]:
            da = (dyb.t() @ x2).mul_(ctx.scale)
        if ctx.needs_input_grad[4]:
            db = (dy2.t() @ xa).mul_(ctx.scale)
        return dx, None, None, da, db, None


@functools.cache
def _fused_class() -> type:
    """FusedLoraLinear, made once peft is imported (the vLLM and TRL environments have no peft)."""
    from peft.tuners.lora import Linear

    class FusedLoraLinear(Linear):
        """PEFT's LoRA linear with the one-node forward of the module docstring where nothing else applies."""

        def _fusable(self, x: torch.Tensor) -> bool:
            if self.disable_adapters or self.merged or list(self.active_adapters) != [ADAPTER]:
                return False
            base, drop = self.base_layer, self.lora_dropout[ADAPTER]
            if type(base) is not torch.nn.Linear or ADAPTER in self.lora_variant:
                return False
            if drop.training and not isinstance(drop, torch.nn.Identity) and drop.p > 0:
                return False
            frozen = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
            return frozen and x.dtype == base.weight.dtype == self.lora_A[ADAPTER].weight.dtype \
                == self.lora_B[ADAPTER].weight.dtype

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if args or kwargs or not self._fusable(x):
                return super().forward(x, *args, **kwargs)
            base = self.base_layer
            return _LoraLinearFn.apply(x, base.weight, base.bias, self.lora_A[ADAPTER].weight,
                                       self.lora_B[ADAPTER].weight, float(self.scaling[ADAPTER]))

    FusedLoraLinear.__module__, FusedLoraLinear.__qualname__ = __name__, "FusedLoraLinear"
    globals()["FusedLoraLinear"] = FusedLoraLinear  # importable by name (pickling a model finds it)
    return FusedLoraLinear


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module):
    """The base model for the duration (the reference's forward): every adapter of `module` off, then back."""
    layers = [m for _, m in _tuner_layers(module)]
    was = [m.disable_adapters for m in layers]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield module
    finally:
        for m, off in zip(layers, was):
            m.enable_adapters(not off)


@contextlib.contextmanager
def adapter_dropout(module: torch.nn.Module):
    """actor.lora.dropout on for the duration (the update's forward and backward) and nothing else: the model's
    own dropout modules keep the mode they have, and log-prob passes and generation never drop."""
    drops = [d for _, m in _tuner_layers(module) for d in m.lora_dropout.values()]
    was = [d.training for d in drops]
    for d in drops:
        d.train(True)
    try:
        yield module
    finally:
        for d, mode in zip(drops, was):
            d.train(mode)


def strip_lora(module: torch.nn.Module) -> torch.nn.Module:
    """`module` (a copy the caller owns) with every adapter layer replaced by its base layer, all of it trainable:
    the plain model (a critic's trunk, or the generation copy a merged sync writes into)."""
    for name, layer in _tuner_layers(module):
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, layer.base_layer)
    if hasattr(module, "peft_config"):
        del module.peft_config
    return module.requires_grad_(True)


def adapter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the adapter tensors (what an adapter-only sync hands the engine)."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if ".lora_" in n)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 DTensor (collective over its mesh), else the tensor."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def sync_tensors(module: torch.nn.Module, view: str, *, local: bool = True) -> dict[str, torch.Tensor]:
    """The module's weights as the sync view `view` names them (see the module docstring). `local`: this rank's
    FSDP2 chunks (what the hybrid engine reads; the merged view then gathers each A, a collective every rank of
    the mesh runs in the same order); else the parameters themselves (DTensors keep their global shape: what
    the layout is planned from; the merged view is then the base weights, standing in for their shapes)."""
    if view not in SYNC_VIEWS:
        raise VerlConfigError(f"unknown sync view {view!r}; choose one of {SYNC_VIEWS}")
    params = dict(module.named_parameters())
    if view == "merged":
        return _merged(module, params, "local" if local else "layout")
    if view == "adapter":
        params = {n: p for n, p in params.items() if ".lora_" in n}
    return {n: (_local(p) if local else p).detach() for n, p in params.items()}


def _merged(module: torch.nn.Module, params: dict, how: str) -> dict[str, torch.Tensor]:
    """HF name → base + scale * B A for wrapped linears (their bias as it is), every other parameter as it is.
    how: "layout" (the parameters, unmerged: names, global shapes, dtypes), "local" (this rank's FSDP2 rows,
    merged) or "whole" (gathered whole, merged)."""
    scales = {f"{n}{_BASE}weight": m.scaling[ADAPTER] for n, m in _tuner_layers(module)}
    rows = {"layout": lambda t: t, "local": _local, "whole": _whole}[how]
    out = {}
    for name, p in params.items():
        if ".lora_" in name:
            continue
        hf = name.replace(_BASE, ".")
        base = rows(p.detach())
        if name not in scales or how == "layout":
            out[hf] = base
            continue
        prefix = name[: -len(_BASE + "weight")]
        a = _whole(params[f"{prefix}.lora_A.{ADAPTER}.weight"].detach()).float()
        b = rows(params[f"{prefix}.lora_B.{ADAPTER}.weight"].detach()).float()
        out[hf] = (base.float() + scales[name] * (b @ a)).to(base.dtype)
    return out


def merged_model(module: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of `module` (whole tensors, no adapters) with every adapter merged into its base weight."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(module.config)
    state = _merged(module, dict(module.named_parameters()), "whole")
    state.update({n: b.detach().clone() for n, b in module.named_buffers()})  # rotary tables are not persistent
    plain.load_state_dict(state, strict=False, assign=True)
    for name, buf in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        setattr(plain.get_submodule(owner) if owner else plain, leaf, buf.detach().clone())
    plain.tie_weights()
    return plain


def export_adapter(module: torch.nn.Module, path: str | Path, *, base_model: str | None = None,
                   write: bool = True) -> Path:
    """Writes the adapter in PEFT's format (adapter_config.json + adapter_model.safetensors, the keys PeftModel
    saves), readable by `peft.PeftModel.from_pretrained(base, path)`; `base_model` is recorded in the config.
    FSDP2's chunks are gathered first (collective: every rank of the mesh calls it, `write` only on one)."""
    import dataclasses

    from safetensors.torch import save_file
    tensors = {f"base_model.model.{n.replace(f'.{ADAPTER}.', '.')}": _whole(p.detach()).cpu().contiguous()
               for n, p in module.named_parameters() if ".lora_" in n}
    path = Path(path)
    if write:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        cfg = dataclasses.replace(module.peft_config[ADAPTER], base_model_name_or_path=base_model,
                                  inference_mode=True)
        cfg.save_pretrained(str(path))
    return path


def unique_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters and buffers of `modules` (shared weights, as the
    reference shares the actor's base, counted once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            t = _local(t.detach())
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
