"""The patches verl applies to megatron-core, each with why it exists and which versions it was verified on.

All of them make megatron-core run on a CPU-only machine with the gloo backend (so that models, converters,
pipeline schedules and the optimizer are testable without GPUs). On a machine with CUDA none is needed and
`apply()` does nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_patches import _mechanisms as mech

VERIFIED_MEGATRON = ("0.16.1",)
"""megatron-core versions every patch below was written against and tested on."""
VERIFIED_TORCH = ("2.13",)
"""torch major.minor versions the patches were tested with."""


@dataclass(kw_only=True, slots=True)
class Patch:
    """One named change to megatron-core."""

    name: str
    """Stable identifier (used by `apply(exclude=...)` and in reports)."""
    why: str
    """What fails without it, on which code path."""
    targets: tuple[str, ...]
    """The megatron-core functions or modules it touches."""
    install: Callable[[], None]
    """Performs the change (through `_mechanisms`, so that it can be reverted)."""
    megatron_versions: tuple[str, ...] = VERIFIED_MEGATRON
    """megatron-core versions it is verified on."""
    torch_versions: tuple[str, ...] = VERIFIED_TORCH
    """torch major.minor versions it is verified on."""
    mechanism: str = field(default="replace")
    """replace | rewrite | torch-view: how narrow the change is (see `_mechanisms`)."""


# ------------------------------------------------------------------------------------------------- RNG

def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    # The CPU generator's state is a plain byte tensor; graph-safe capture only exists for CUDA graphs.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _install_rng() -> None:
    mech.replace_attr("megatron.core.tensor_parallel.random:_get_cuda_rng_state", lambda orig: _cpu_get_rng_state)
    mech.replace_attr("megatron.core.tensor_parallel.random:_set_cuda_rng_state", lambda orig: _cpu_set_rng_state)
    # `CudaRNGStatesTracker.add` and `model_parallel_cuda_manual_seed` call torch.cuda.get_rng_state/manual_seed.
    mech.install_torch_view("megatron.core.tensor_parallel.random")


# ------------------------------------------------------------------------------------- device placement

# Only modules whose CUDA-only lines lie on verl's paths (build, forward/backward with TP/SP/PP, recompute).
# Deliberately left out: transformer_layer (CUDA-graph static inputs), attention (inference KV cache),
# dot_product_attention (off-by-one / learnable softmax), tensor_parallel.utils (distributed saved activations).
_MODEL_MODULES = (
    "megatron.core.tensor_parallel.layers",          # weight allocation, SP all-gather buffers
    "megatron.core.tensor_parallel.mappings",        # gather/scatter output buffers
    "megatron.core.models.gpt.gpt_model",            # rotary position ids
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq placement
    "megatron.core.transformer.utils",               # default causal mask on device="cuda"
)

_PIPELINE_MODULES = (
    "megatron.core.pipeline_parallel.schedules",        # token counters on device="cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # shape buffers, torch.cuda.synchronize()
)

_MOE_MODULES = (
    "megatron.core.transformer.moe.token_dispatcher",  # a CUDA stream for device-to-host copies, its syncs
    "megatron.core.transformer.moe.moe_utils",         # aux-loss tracker buffers on device="cuda"
    "megatron.core.transformer.moe.router",            # expert-bias / global aux-loss buffers on the current device
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",    # a CUDA stream for the overlapped shared expert
)

_OPTIMIZER_MODULES = (
    "megatron.core.optimizer.optimizer",             # found_inf / scale tensors on device='cuda'
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",            # grad-norm reduction buffers on device='cuda'
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers on torch.cuda.current_device()
    "megatron.core.utils",                           # GlobalMemoryBuffer (SP gathers), grad-norm helpers
)


def _installer(modules: tuple[str, ...]) -> Callable[[], None]:
    def install() -> None:
        for name in modules:
            mech.install_torch_view(name)
    return install


# ------------------------------------------------------------------------------------- type checks

_HALF_TYPES = "['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']"


def _install_param_type_checks() -> None:
    # The optimizers classify parameters by legacy CUDA type strings ('torch.cuda.FloatTensor' /
    # 'torch.cuda.BFloat16Tensor'), which read 'torch.FloatTensor' / 'torch.BFloat16Tensor' on the CPU; what
    # they mean is "an fp32 / a 16-bit parameter", so compare the dtype.
    half = "{}.dtype in (torch.float16, torch.bfloat16)"
    mech.rewrite_source(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
        [("model_param.type() == 'torch.cuda.FloatTensor'", "model_param.dtype == torch.float32", 1),
         (f"model_param.type() in {_HALF_TYPES}", half.format("model_param"), 1)])
    mech.rewrite_source(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
        [(f"param.type() in {_HALF_TYPES}", half.format("param"), 1)])
    mech.rewrite_source(
        "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
        [(f"param.type() in {_HALF_TYPES}", half.format("param"), 1),
         ("param.type() == 'torch.cuda.FloatTensor'", "param.dtype == torch.float32", 1)])
    mech.rewrite_source(
        "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
        [("assert param.grad.type() == 'torch.cuda.FloatTensor'", "assert param.grad.dtype == torch.float32", 1)],
        also_in=("megatron.core.optimizer.optimizer",))


def _install_tied_embedding_copy() -> None:
    # With tied embeddings the last pipeline stage's output layer copy is all-reduced from the first stage;
    # megatron moves it with `.cuda()` first, which has no meaning (and fails) on a CPU-only build.
    mech.rewrite_source(
        "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
        [("weight.data = weight.data.cuda()", "weight.data = weight.data", 1)])


# ------------------------------------------------------------------------------- RMSNorm under SP

def _torch_norm_new(original_new):
    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                normalization)
        # The torch norm is a per-token op, so it is correct on a sequence shard. What SP needs is that its
        # weight grads (partial sums over this rank's tokens) are all-reduced over TP; megatron's
        # finalize_model_grads does that for parameters flagged `sequence_parallel`, as TE/apex norms are.
        plain = copy.copy(config)
        object.__setattr__(plain, "sequence_parallel", False)
        norm = original_new(cls, plain, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm
    return staticmethod(__new__)


def _install_torch_norm_sp() -> None:
    mech.replace_attr("megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",
                      lambda orig: _torch_norm_new(orig.__func__ if isinstance(orig, staticmethod) else orig))


PATCHES: tuple[Patch, ...] = (
    Patch(name="rng_tracker_on_cpu", mechanism="replace + torch-view",
          why="model_parallel_cuda_manual_seed and the RNG tracker's add/fork (used for weight init and dropout) "
              "read and set torch.cuda RNG state; on CPU they must fork the CPU generator instead.",
          targets=("tensor_parallel.random._get_cuda_rng_state", "tensor_parallel.random._set_cuda_rng_state",
                   "tensor_parallel.random (torch.cuda.get_rng_state/manual_seed)"),
          install=_install_rng),
    Patch(name="model_device_cpu", mechanism="torch-view",
          why="model construction and forward allocate on torch.cuda.current_device() or device='cuda' "
              "(rotary inv_freq, causal masks, SP gather buffers, TP layer weights).",
          targets=_MODEL_MODULES, install=_installer(_MODEL_MODULES)),
    Patch(name="pipeline_device_cpu", mechanism="torch-view",
          why="pipeline schedules count tokens on device='cuda', p2p communication allocates shape buffers on "
              "torch.cuda.current_device() and calls torch.cuda.synchronize() around batched isend/irecv.",
          targets=_PIPELINE_MODULES, install=_installer(_PIPELINE_MODULES)),
    Patch(name="moe_device_cpu", mechanism="torch-view",
          why="the mixture-of-experts layer creates a CUDA stream in its all-to-all token dispatcher (and syncs "
              "on it), and its router and aux-loss tracker allocate buffers on device='cuda'.",
          targets=_MOE_MODULES, install=_installer(_MOE_MODULES)),
    Patch(name="optimizer_device_cpu", mechanism="torch-view",
          why="DDP grad buffers, the distributed optimizer, grad clipping and the grad scaler allocate on "
              "torch.cuda.current_device() / device='cuda'.",
          targets=_OPTIMIZER_MODULES, install=_installer(_OPTIMIZER_MODULES)),
    Patch(name="param_type_checks", mechanism="rewrite",
          why="the distributed optimizer, the bf16/fp16 optimizer and grad clipping classify params by "
              "param.type() == 'torch.cuda.FloatTensor' / in ['torch.cuda.HalfTensor', "
              "'torch.cuda.BFloat16Tensor'], which never match CPU tensors.",
          targets=("optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
                   "optimizer.distrib_optimizer.DistributedOptimizer.__init__",
                   "optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
                   "optimizer.clip_grads.clip_grad_by_total_norm_fp32"),
          install=_install_param_type_checks),
    Patch(name="tied_embedding_no_cuda_copy", mechanism="rewrite",
          why="with tied embeddings LanguageModule.setup_embeddings_and_output_layer moves the shared weight "
              "with .cuda() before all-reducing it over the embedding group.",
          targets=("models.common.language_module.language_module.LanguageModule"
                   ".setup_embeddings_and_output_layer",),
          install=_install_tied_embedding_copy),
    Patch(name="torch_norm_sequence_parallel", mechanism="replace",
          why="without apex/TE the local spec's WrappedTorchNorm asserts `not sequence_parallel`; the torch norm "
              "is per-token so it is correct under SP once its params are flagged for the TP grad all-reduce.",
          targets=("transformer.torch_norm.WrappedTorchNorm.__new__",),
          install=_install_torch_norm_sp),
)
