"""The three mechanisms the patches use, narrowest first.

1. `replace_attr`: swap one function/method for ours (or a wrapper around the original).
2. `rewrite_source`: recompile one function from megatron-core's own source with a few exact string
   replacements. Used where a function is long and one line inside it is CUDA-only (copying the whole
   function here would fork megatron-core). Every replacement must match exactly the expected number of
   times, so a changed upstream body is refused instead of silently mis-patched.
3. `install_torch_view`: replace the module-global name ``torch`` in ONE listed megatron-core module with a
   view of torch whose ``torch.cuda`` answers for the CPU (current device, RNG, synchronize, streams) and
   whose tensor factories map ``device="cuda"`` to the CPU. Only code *in that module* sees it; the real
   ``torch`` (and every other library) is untouched. This replaces ~40 one-line allocation sites without
   40 source rewrites.

Every mechanism records what it replaced so that `revert_all` restores megatron-core exactly (tests use it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class _Undo:
    """One attribute we replaced, and how to put it back."""

    owner: object
    """The module or class whose attribute was replaced."""
    name: str
    """The attribute name."""
    original: object
    """The value before we replaced it."""


_UNDO: list[_Undo] = []


def resolve(path: str) -> tuple[object, str]:
    """'megatron.core.x.y:Class.method' -> (owner object, attribute name)."""
    module_name, _, attr_path = path.partition(":")
    owner: object = importlib.import_module(module_name)
    parts = attr_path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def _set(owner: object, name: str, value: object) -> None:
    _UNDO.append(_Undo(owner=owner, name=name, original=owner.__dict__[name] if isinstance(owner, type)
                       else getattr(owner, name)))
    setattr(owner, name, value)


def replace_attr(path: str, make: Callable[[object], object]) -> None:
    """Replaces the attribute at `path` with `make(original)`."""
    owner, name = resolve(path)
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _set(owner, name, make(original))


def rewrite_source(path: str, replacements: list[tuple[str, str, int]], extra_globals: dict | None = None,
                   also_in: tuple[str, ...] = ()) -> None:
    """Recompiles the function at `path` with `(old, new, expected_count)` text replacements.

    `also_in` lists modules that imported the function by name (``from .x import f``); their binding is
    replaced too, after checking it is the same original object.

    The new function runs in the defining module's globals (plus `extra_globals`), keeps the original's
    defaults, and keeps zero-argument `super()` working by rebuilding the `__class__` cell for methods.
    """
    owner, name = resolve(path)
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    func = inspect.unwrap(func)
    source = textwrap.dedent(inspect.getsource(func))
    for old, new, expected in replacements:
        found = source.count(old)
        if found != expected:
            raise RuntimeError(f"cannot patch {path}: expected {expected} occurrence(s) of {old!r} in its source, "
                               f"found {found}; this megatron-core build differs from the one the patch was "
                               f"written for")
        source = source.replace(old, new)
    # static/classmethod wrappers are re-applied below from the original attribute's type.
    lines = source.splitlines()
    while lines and lines[0].lstrip().startswith("@"):
        decorator = lines.pop(0).strip()
        if decorator not in ("@staticmethod", "@classmethod"):
            # Re-applying an arbitrary decorator is not something a text rewrite can do faithfully.
            raise RuntimeError(f"cannot patch {path}: it is decorated with {decorator}")
    body = "\n".join(lines)
    namespace: dict = {}
    glb = dict(func.__globals__) if extra_globals else func.__globals__
    if extra_globals:
        glb.update(extra_globals)
    # A factory binds `__class__` so that zero-argument super() inside a method still resolves.
    factory_src = "def __verl_factory(__class__):\n" + textwrap.indent(body, "    ") + f"\n    return {func.__name__}\n"
    code = compile(factory_src, f"<megatron_patches rewrite of {path}>", "exec")
    exec(code, glb, namespace)  # noqa: S102 - compiling megatron-core's own source with audited replacements
    new_func = namespace["__verl_factory"](owner if isinstance(owner, type) else None)
    new_func.__defaults__ = func.__defaults__
    new_func.__kwdefaults__ = func.__kwdefaults__
    new_func.__doc__ = func.__doc__
    new_func.__wrapped_by_verl__ = True
    if isinstance(raw, staticmethod):
        new_func = staticmethod(new_func)
    elif isinstance(raw, classmethod):
        new_func = classmethod(new_func)
    _set(owner, name, new_func)
    for module_name in also_in:
        module = importlib.import_module(module_name)
        if getattr(module, name, None) is not raw:
            raise RuntimeError(f"cannot patch {path} in {module_name}: it does not hold the original {name}")
        _set(module, name, new_func)


# --------------------------------------------------------------------------------------------------------
# The torch view


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)
    return wrapper


class _CpuStream:
    """Stands in for a CUDA stream/event: on CPU every op is already ordered, so waits and records are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        return event if event is not None else _CpuStream()

    def record(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        return None


class _CudaOnCpu(types.SimpleNamespace):
    """`torch.cuda` as seen by a patched megatron-core module on a CPU-only machine.

    Attributes not defined here fall through to the real `torch.cuda` (e.g. `is_available()` stays False).
    """

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _cuda_on_cpu() -> _CudaOnCpu:
    @contextlib.contextmanager
    def _stream_ctx(stream=None):
        yield

    def _nvtx_noop(*args, **kwargs):
        return None

    return _CudaOnCpu(
        current_device=lambda: torch.device("cpu"),
        device_count=lambda: 1,
        synchronize=lambda device=None: None,
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed),
        manual_seed_all=lambda seed: torch.manual_seed(seed),
        default_generators=(torch.default_generator,),
        current_stream=lambda device=None: _CpuStream(),
        default_stream=lambda device=None: _CpuStream(),
        Stream=_CpuStream,
        Event=_CpuStream,
        stream=_stream_ctx,
        empty_cache=lambda: None,
        memory_allocated=lambda device=None: 0,
        max_memory_allocated=lambda device=None: 0,
        nvtx=types.SimpleNamespace(range_push=_nvtx_noop, range_pop=_nvtx_noop),
    )


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like",
              "rand", "randn", "randint")


class _TorchView(types.ModuleType):
    """`torch` with `cuda` answering for the CPU and factories mapping device='cuda' to the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__["cuda"] = _cuda_on_cpu()
        for name in _FACTORIES:
            self.__dict__[name] = _cpu_factory(getattr(torch, name))
        self.__dict__["__verl_torch_view__"] = True

    def __getattr__(self, name):
        return getattr(torch, name)


_VIEW: _TorchView | None = None


def torch_view() -> _TorchView:
    global _VIEW
    if _VIEW is None:
        _VIEW = _TorchView()
    return _VIEW


def install_torch_view(module_name: str) -> None:
    """Binds the CPU torch view as the global `torch` of one megatron-core module."""
    module = importlib.import_module(module_name)
    if getattr(module, "torch", None) is not torch:
        raise RuntimeError(f"cannot patch {module_name}: its global 'torch' is not the torch module "
                           f"(found {type(getattr(module, 'torch', None)).__name__})")
    _set(module, "torch", torch_view())


def revert_all() -> None:
    """Restores every attribute any patch replaced, newest first."""
    while _UNDO:
        undo = _UNDO.pop()
        setattr(undo.owner, undo.name, undo.original)
