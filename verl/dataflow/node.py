"""Dataflow nodes: plain functions with declared inputs and outputs.

    @DataflowNode(input_keys=["response", "reward_model"], output_keys=["reward"])
    def score_response(response, reward_model):
        return reward_model.score(response)

    @CustomNode()
    def safe_reward_filter(response, reward, threshold=0.5):   # inputs: response, reward; setting: threshold
        is_safe = reward > threshold
        return dict(reward=reward * is_safe, is_safe=is_safe)    # outputs: reward, is_safe

A decorated node stays a plain function (calling it calls the function). A parameter named ``ctx`` (or
annotated `NodeContext`) is not an input: the runtime passes the node's `NodeContext` there — the rank, the
node's ranks, its device, engine, config and process group. That is the only way a node sees its placement;
there is no global to read.

Return conventions: a node with one output returns the value itself; a node with several returns a tuple in
``output_keys`` order or a dict keyed by them; a node with no outputs returns None. A `CustomNode` returns a
dict whose keys are its outputs (read from the ``return dict(...)`` / ``return {...}`` in its source, or
given as ``CustomNode(output_keys=[...])``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.dataflow.config import NodeConfig
from verl.errors import VerlConfigError, nearest

CONTEXT_PARAM = "ctx"


class TransientError(Exception):
    """Raise (or subclass) this inside a node for a failure worth retrying (a flaky RPC, a busy engine).

    Only transient errors are retried, up to the node config's ``retries`` with exponential backoff; any other
    exception fails the node at once. ``mark_transient(exc)`` marks an exception of another type.
    """


def mark_transient(exc: BaseException) -> BaseException:
    """Marks ``exc`` as transient so the node's ``retries`` apply to it; returns it for ``raise mark_transient(e)``."""
    exc.transient = True  # type: ignore[attr-defined]
    return exc


@dataclass(slots=True)
class NodeContext:
    """What a running node knows about where it runs. Request it with a parameter named ``ctx``."""

    name: str
    """The node's name in this dataflow."""
    rank: int
    """This process's global rank (0 without torch.distributed)."""
    world_size: int
    """Number of ranks in the job (1 without torch.distributed)."""
    ranks: tuple[int, ...]
    """The global ranks that run this node (its device map), sorted."""
    device: Any
    """The `torch.device` this rank runs the node on."""
    engine: str
    """The engine named in the node's config (``torch``, ``vllm``, ``sglang``, ``megatron``, ``fsdp``, ``rule``)."""
    config: Any
    """The node's `NodeConfig`."""
    settings: Mapping[str, Any]
    """The node's settings (defaulted parameters, with per-node config overrides applied)."""
    process_group: Any = None
    """A torch.distributed group over ``ranks`` (the world group when the node runs everywhere; None alone)."""
    attempt: int = 0
    """0 on the first try, n on the n-th retry."""
    _offload: list = field(default_factory=list, repr=False)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the node's ranks: its data-parallel shard index."""
        return self.ranks.index(self.rank)

    @property
    def dp_size(self) -> int:
        """How many ranks run the node: the data-parallel size of the data it receives."""
        return len(self.ranks)

    @property
    def is_leader(self) -> bool:
        """True on the node's first rank (log, save or print once there)."""
        return self.rank == self.ranks[0]

    def register_module(self, module: Any) -> Any:
        """Registers a module the node owns (not one of its inputs) for ``cpu_offload``; returns it.

        With ``cpu_offload=True`` the runtime moves registered modules and module inputs to ``device`` before
        the node runs and back to CPU after it. Objects with ``onload(device)`` / ``offload()`` methods (an
        engine that frees its KV cache, say) are asked to do it themselves.
        """
        if not any(m is module for m in self._offload):
            self._offload.append(module)
        return module


@dataclass(frozen=True, slots=True)
class Node:
    """A function with declared inputs and outputs, made by `DataflowNode` or `CustomNode`."""

    fn: Callable
    """The user's function."""
    name: str
    """Default node name (the function's name); a dict dataflow's key overrides it."""
    input_keys: tuple[str, ...]
    """Keys read from the dataflow, in order."""
    output_keys: tuple[str, ...]
    """Keys written to the dataflow, in order."""
    settings: Mapping[str, Any]
    """Parameters with defaults that are not inputs: settings, overridable in the node's config."""
    wants_context: bool
    """The function has a ``ctx`` parameter for its `NodeContext`."""
    by_keyword: bool
    """Inputs are passed by parameter name (else positionally, in ``input_keys`` order)."""
    returns_dict: bool
    """A CustomNode: the return value is always a dict keyed by the outputs."""

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        kind = "CustomNode" if self.returns_dict else "DataflowNode"
        return f"{kind}({self.name}: {list(self.input_keys)} -> {list(self.output_keys)})"


@dataclass(frozen=True, slots=True)
class NodeEntry:
    """One node of a dataflow under its name there, with its resolved config."""

    name: str
    """The node's name in the dataflow (a dict dataflow's key, else the function's name)."""
    node: Node
    """The decorated function."""
    config: NodeConfig
    """Where and how it runs, with its settings resolved."""


def _check_keys(what: str, keys: Sequence[str], fn_name: str) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise VerlConfigError(f"{what} of node '{fn_name}' must be a list of strings, got the string {keys!r}; "
                              f"write {what}=[{keys!r}]")
    keys = tuple(keys)
    for k in keys:
        if not isinstance(k, str) or not k:
            raise VerlConfigError(f"{what} of node '{fn_name}' must be non-empty strings, got {k!r}")
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise VerlConfigError(f"{what} of node '{fn_name}' repeat {dup}; list each key once")
    if CONTEXT_PARAM in keys:
        raise VerlConfigError(f"node '{fn_name}': '{CONTEXT_PARAM}' is reserved for the node context; rename the key")
    return keys


def _is_context_param(p: inspect.Parameter) -> bool:
    if p.name == CONTEXT_PARAM:
        return True
    ann = p.annotation
    return ann is NodeContext or ann == "NodeContext"


def _signature(fn: Callable) -> inspect.Signature:
    if not callable(fn):
        raise VerlConfigError(f"a dataflow node must decorate a function, got {type(fn).__name__}")
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise VerlConfigError(f"cannot read the signature of {fn!r} ({e}); decorate a Python function") from e


def DataflowNode(input_keys: Sequence[str] = (),  # noqa: N802 - the SPEC's name
                 output_keys: Sequence[str] = ()) -> Callable[[Callable], Node]:
    """Declares a function as a dataflow node reading ``input_keys`` and writing ``output_keys``.

    Inputs are passed by parameter name when every key is a parameter (or the function takes ``**kwargs``),
    otherwise positionally in ``input_keys`` order. Other parameters must have defaults: they are settings.
    """

    def wrap(fn: Callable) -> Node:
        name = getattr(fn, "__name__", type(fn).__name__)
        ins = _check_keys("input_keys", input_keys, name)
        outs = _check_keys("output_keys", output_keys, name)
        params = _signature(fn).parameters
        wants_ctx = any(_is_context_param(p) for p in params.values())
        plain = {n: p for n, p in params.items() if not _is_context_param(p)
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
        has_var_pos = any(p.kind == p.VAR_POSITIONAL for p in params.values())
        by_keyword = all(k in plain for k in ins) or has_var_kw
        if by_keyword:
            settings = {n: p.default for n, p in plain.items() if n not in ins and p.default is not p.empty}
            unfilled = [n for n, p in plain.items() if n not in ins and p.default is p.empty]
        else:
            positional = [p for p in plain.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            names = list(params)
            ctx_first = [p.name for p in params.values() if _is_context_param(p) and positional
                         and names.index(p.name) < names.index(positional[min(len(ins), len(positional)) - 1].name)]
            if ctx_first:
                raise VerlConfigError(f"node '{name}' takes its inputs positionally, so its context parameter "
                                      f"'{ctx_first[0]}' must come after them; move it to the end")
            if len(positional) < len(ins) and not has_var_pos:
                missing = [k for k in ins if k not in plain]
                raise VerlConfigError(
                    f"node '{name}' declares input_keys {list(ins)} but its function has no parameter named "
                    f"{missing} and only {len(positional)} positional parameters; name the parameters after the "
                    f"keys (nearest: {[p.name for p in positional]})")
            rest = positional[len(ins):] + [p for p in plain.values() if p.kind == p.KEYWORD_ONLY]
            settings = {p.name: p.default for p in rest if p.default is not p.empty}
            unfilled = [p.name for p in rest if p.default is p.empty]
        if unfilled:
            raise VerlConfigError(f"node '{name}': parameters {unfilled} are neither in input_keys {list(ins)} nor "
                                  f"have defaults; add them to input_keys or give them a default (a setting)")
        return _register(Node(fn=fn, name=name, input_keys=ins, output_keys=outs, settings=settings,
                              wants_context=wants_ctx, by_keyword=by_keyword, returns_dict=False))

    return wrap


def CustomNode(output_keys: Sequence[str] | None = None) -> Callable[[Callable], Node]:  # noqa: N802
    """Declares a function as a node whose inputs are its parameters without defaults and whose outputs are
    the keys of the dict it returns. Parameters with defaults are settings, overridable per node config.

    The output keys are read from the function's ``return dict(a=..., b=...)`` / ``return {"a": ...}``
    statements; pass ``output_keys`` when they are built dynamically.
    """

    def wrap(fn: Callable) -> Node:
        name = getattr(fn, "__name__", type(fn).__name__)
        params = _signature(fn).parameters
        bad = [n for n, p in params.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if bad:
            raise VerlConfigError(f"CustomNode '{name}' takes *args/**kwargs ({bad}); its inputs are read from "
                                  f"named parameters, so list them explicitly")
        wants_ctx = any(_is_context_param(p) for p in params.values())
        plain = {n: p for n, p in params.items() if not _is_context_param(p)}
        ins = _check_keys("inputs", [n for n, p in plain.items() if p.default is p.empty], name)
        settings = {n: p.default for n, p in plain.items() if p.default is not p.empty}
        outs = output_keys if output_keys is not None else _returned_dict_keys(fn, name)
        outs = _check_keys("output_keys", outs, name)
        return _register(Node(fn=fn, name=name, input_keys=ins, output_keys=outs, settings=settings,
                              wants_context=wants_ctx, by_keyword=True, returns_dict=True))

    return wrap


def _returned_dict_keys(fn: Callable, name: str) -> list[str]:
    """The keys of the dict literals a function returns, read from its source."""
    hint = "pass them explicitly: @CustomNode(output_keys=[...])"
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as e:
        raise VerlConfigError(f"CustomNode '{name}': cannot read its source to find the returned keys ({e}); "
                              f"{hint}") from e
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if func is None:
        raise VerlConfigError(f"CustomNode '{name}' is not a def-function; {hint}")
    keysets = []
    for ret in _own_returns(func):
        keys = _literal_dict_keys(ret.value)
        if keys is None:
            raise VerlConfigError(f"CustomNode '{name}' returns something other than a dict literal on line "
                                  f"{ret.lineno + fn.__code__.co_firstlineno - 1} (it must return dict(key=...) or "
                                  f"{{'key': ...}}); {hint}")
        keysets.append(keys)
    if not keysets:
        raise VerlConfigError(f"CustomNode '{name}' has no return statement; return a dict of its outputs")
    first = keysets[0]
    for ks in keysets[1:]:
        if set(ks) != set(first):
            raise VerlConfigError(f"CustomNode '{name}' returns different keys on different paths ({first} vs {ks}); "
                                  f"return the same keys everywhere")
    return first


def _own_returns(func: ast.AST):
    """Return statements of ``func`` itself, not of functions or lambdas nested in it."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _literal_dict_keys(value: ast.AST | None) -> list[str] | None:
    if isinstance(value, ast.Dict):
        if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys):
            return [k.value for k in value.keys]  # type: ignore[union-attr]
        return None
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict"
            and not value.args and all(kw.arg is not None for kw in value.keywords)):
        return [kw.arg for kw in value.keywords]  # type: ignore[misc]
    return None


# Every decorated node, by "module:qualname", so that a config can name a node (a custom reward filter to
# inject, say) without the training script importing it. Lookup only; nothing reads it while running.
_REGISTRY: dict[str, Node] = {}


def _register(node: Node) -> Node:
    fn = node.fn
    _REGISTRY[f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', node.name)}"] = node
    return node


def registered_nodes() -> dict[str, Node]:
    """Every node decorated so far, by ``"module:qualname"``."""
    return dict(_REGISTRY)


def get_node(ref: str) -> Node:
    """The node ``"package.module:function"``, importing the module if needed (for nodes named in configs)."""
    from verl.registry import import_module_checked
    if ref in _REGISTRY:
        return _REGISTRY[ref]
    module, sep, qualname = ref.partition(":")
    if not sep or not module or not qualname:
        raise VerlConfigError(f"node reference {ref!r} must look like 'package.module:function'")
    import_module_checked(module, f"node reference {ref!r}: ", "dataflow node")  # verl.registry's search rule
    if ref not in _REGISTRY:
        known = [k.split(":", 1)[1] for k in _REGISTRY if k.startswith(module + ":")]
        raise VerlConfigError(f"module '{module}' has no dataflow node '{qualname}'"
                              f"{nearest(qualname, known, 'nodes there')}; decorate it with @DataflowNode or "
                              f"@CustomNode")
    return _REGISTRY[ref]


def as_node(obj: Any, where: str) -> Node:
    """``obj`` if it is a node, else a VerlConfigError that says how to make it one."""
    if isinstance(obj, Node):
        return obj
    if callable(obj):
        name = getattr(obj, "__name__", repr(obj))
        raise VerlConfigError(f"{where}: '{name}' is a plain function; decorate it with "
                              f"@DataflowNode(input_keys=[...], output_keys=[...]) or @CustomNode()")
    raise VerlConfigError(f"{where}: expected a node (a function decorated with @DataflowNode or @CustomNode), "
                          f"got {type(obj).__name__}")
