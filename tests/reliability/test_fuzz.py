"""Property-based fuzzing (hypothesis) of what a user hands verl: every config key with boundary and hostile values,
config files of every encoding, nesting and size, and the values dataflow nodes return (directly and through a
queue). Each case must be refused with a verl error naming the key / file / node, or work (a config that loads
runs one training step); never a raw traceback, a hang or an out-of-memory kill.

CI runs a fixed, derandomized number of examples per property (below); a longer run:

    VERL_FUZZ_EXAMPLES=2000 VERL_FUZZ_STEPS=200 python -m pytest tests/reliability/test_fuzz.py -s

prints each property's tally (cases, refused, accepted) at the end.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
import types
import typing
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl import DataflowNode, VerlConfigError, VerlRuntimeError, build_dataflow
from verl.config import PPOConfig, load_config
from verl.config.base import _dataclass_type, _hints, load_yaml
from verl.errors import VerlError

EXAMPLES = int(os.environ.get("VERL_FUZZ_EXAMPLES", "300"))
STEPS = int(os.environ.get("VERL_FUZZ_STEPS", "12"))  # accepted configs that then run a training step
TALLY: dict[str, Counter] = {}


def fuzz_settings(n: int = EXAMPLES):
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def _count(prop: str, outcome: str) -> None:
    TALLY.setdefault(prop, Counter())[outcome] += 1


@pytest.fixture(scope="module", autouse=True)
def _print_tally():
    yield
    for prop, c in sorted(TALLY.items()):
        print(f"\n[fuzz] {prop}: {sum(c.values())} cases, " + ", ".join(f"{k}={v}" for k, v in sorted(c.items())))


# ---- the config tree: every key, and what a hostile value of it looks like ----------------------------------
def _keys(cls: type, prefix: str = "") -> tuple[list[str], list[str]]:
    """(leaf keys, section keys) of the config tree under `cls`."""
    leaves, sections = [], []
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(_hints(cls)[f.name])
        if sub is not None:
            sections.append(prefix + f.name)
            more_leaves, more_sections = _keys(sub, f"{prefix}{f.name}.")
            leaves += more_leaves
            sections += more_sections
        else:
            leaves.append(prefix + f.name)
    return leaves, sections


LEAVES, SECTIONS = _keys(PPOConfig)
HOSTILE = ["0", "-1", "1", "2", "9223372036854775808", "-9223372036854775809", "4294967296", "1e308", "-1e308",
           "1e-320", "nan", ".nan", "inf", "-inf", ".inf", "''", '""', " ", "é", "\u202e", "𝕏𝕏", "'\\0x'",
           "true", "false", "null", "~", "[]", "[1, 2]", "[[[]]]", "{}", "{a: 1}", "{x: {y: [1]}}", "1.5", "-0.0",
           "0x10", "1_000", "'a' * 3", "x" * 300, "[" * 40 + "]" * 40, "!!binary aGk=", "2001-01-01", "*a", "&a 1"]


@st.composite
def _override(draw) -> tuple[str, str, str]:
    """(override, the key it sets, kind): a leaf with a hostile value, a section given a scalar, or a scalar
    given a sub-key."""
    kind = draw(st.sampled_from(["leaf", "leaf", "leaf", "section", "under_leaf"]))
    if kind == "section":
        key = draw(st.sampled_from(SECTIONS))
    elif kind == "under_leaf":
        key = draw(st.sampled_from(LEAVES)) + "." + draw(st.sampled_from(["x", "path", "n", "0"]))
    else:
        key = draw(st.sampled_from(LEAVES))
    value = draw(st.one_of(st.sampled_from(HOSTILE), st.integers(-(2 ** 70), 2 ** 70).map(str),
                           st.floats(allow_nan=True, allow_infinity=True).map(repr),
                           st.text(max_size=8).map(lambda t: yaml.safe_dump(t).strip().removesuffix("\n...")
                                                   .strip())))
    return f"{key}={value}", key, kind


def _names_key(message: str, key: str) -> bool:
    """The message names the key, or the section or sub-key it belongs to (a bad sub-key is named by its path)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in message for i in range(len(parts), 0, -1))


@fuzz_settings()
@given(case=_override())
def test_clear_fuzz_every_config_key(case):
    """A hostile override of any key (or section) is refused naming it, or loads into a config that passes
    every check made before step 1 on one process (world layout, memory bound)."""
    override, key, kind = case
    try:
        cfg = load_config(PPOConfig, None, [override])
    except VerlConfigError as e:
        assert _names_key(str(e), key), (override, str(e))
        _count("config keys", "refused")
        return
    try:
        cfg.validate_world(1)
    except VerlConfigError as e:  # a setting that needs more processes, or contradicts another, says so
        _count("config keys", "refused (world)")
        assert str(e)
        return
    _count("config keys", "accepted")


_ACCEPTED: list[str] = []


@st.composite
def _runnable(draw) -> str:
    """A hostile override that loads: what must then run a step."""
    for _ in range(20):
        override, _key, _kind = draw(_override())
        try:
            load_config(PPOConfig, None, [*_step_args("/tmp/x"), override]).validate_world(1)
        except VerlError:
            continue
        return override
    return "trainer.seed=2"


def _step_args(out: str) -> list[str]:
    from tests.trainer.conftest import TINY
    return [*TINY, "trainer.total_steps=1", "warmup.steps=0", "trainer.export_hf=false", "trainer.plot=false",
            "trainer.save_final=false", f"trainer.output_dir={out}"]


@fuzz_settings(STEPS)
@given(override=_runnable())
def test_behaves_fuzz_accepted_configs_run_a_step(tmp_path_factory, override):
    """A hostile value that passes every check runs one training step, or fails with a verl error (never a raw
    exception); the tiny job stays tiny, so a hang or an OOM would show as this test's timeout."""
    from verl.trainer.main_ppo import main
    out = tmp_path_factory.mktemp("run")
    if override.startswith("trainer.output_dir="):  # a drawn folder goes under the test's, never into the checkout
        override = f"trainer.output_dir={out}/{override.split('=', 1)[1].lstrip('/') or 'o'}"
    argv = [*_step_args(str(out / "o")), override, "trainer.overwrite=true"]
    try:
        assert main(argv) == 0
        _count("accepted configs run a step", "ran")
    except VerlError as e:
        assert str(e)
        _count("accepted configs run a step", f"verl error ({type(e).__name__})")


# ---- config files -----------------------------------------------------------------------------------------
SMALL_LIMIT = 2000  # VERL_CONFIG_MAX_VALUES while fuzzing files: over-limit cases stay small
_ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32", "latin-1", "cp1252", "shift_jis"]


@st.composite
def _yaml_file(draw) -> bytes:
    kind = draw(st.sampled_from(["encoded", "nested", "aliases", "bytes", "many_keys", "long_value"]))
    if kind == "encoded":
        text = f"rollout:\n  n: 4\ntrainer:\n  output_dir: {draw(st.sampled_from(['caf', 'café', 'π', 'ﾃｽﾄ']))}\n"
        enc = draw(st.sampled_from(_ENCODINGS))
        try:
            return text.encode(enc)
        except UnicodeEncodeError:
            return text.encode("utf-8")
    if kind == "nested":
        depth = draw(st.sampled_from([1, 5, 31, 32, 33, 200, 1200]))
        opener, closer = draw(st.sampled_from([("[", "]"), ("{a: ", "}")]))
        return ("rollout:\n  engine_kwargs: {x: " + opener * depth + "1" + closer * depth + "}\n").encode()
    if kind == "aliases":
        width, levels = draw(st.integers(1, 12)), draw(st.integers(1, 12))
        lines = ["    l0: &l0 [" + ", ".join(["x"] * width) + "]"]
        lines += [f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
        return ("rollout:\n  engine_kwargs:\n" + "\n".join(lines) + "\n").encode()
    if kind == "many_keys":  # the limit is lowered for these tests (SMALL_LIMIT), so sizes past it stay cheap
        n = draw(st.sampled_from([1, 10, SMALL_LIMIT - 2, SMALL_LIMIT + 1, 3 * SMALL_LIMIT]))
        return ("rollout:\n  engine_kwargs: {" + ", ".join(f"k{i}: {i}" for i in range(n)) + "}\n").encode()
    if kind == "long_value":
        return ("trainer:\n  output_dir: " + "a" * draw(st.sampled_from([1, 255, 4096, 1 << 20])) + "\n").encode()
    return draw(st.binary(max_size=300))


@fuzz_settings(max(20, EXAMPLES // 3))
@given(data=_yaml_file())
def test_clear_fuzz_config_files(tmp_path_factory, data):
    """A config file of any encoding, nesting or size loads (and then validates as a config or not), or is
    refused naming the file or the key; never a raw UnicodeDecodeError, RecursionError or MemoryError."""
    path = tmp_path_factory.mktemp("cfg") / "job.yaml"
    path.write_bytes(data)
    old, os.environ["VERL_CONFIG_MAX_VALUES"] = os.environ.get("VERL_CONFIG_MAX_VALUES"), str(SMALL_LIMIT)
    try:
        _load_file(path)
    finally:
        if old is None:
            del os.environ["VERL_CONFIG_MAX_VALUES"]
        else:
            os.environ["VERL_CONFIG_MAX_VALUES"] = old


def _load_file(path: Path) -> None:
    try:
        raw = load_yaml(path)
    except VerlConfigError as e:
        assert str(path) in str(e) or "config key" in str(e), str(e)
        _count("config files", "refused")
        return
    try:
        load_config(PPOConfig, path)
        _count("config files", "accepted")
    except VerlConfigError as e:
        assert "config" in str(e) or str(path) in str(e), str(e)
        _count("config files", "refused (as a config)")
    assert isinstance(raw, dict)


def test_behaves_utf16_and_bom_files_load(tmp_path):
    for enc in ("utf-8-sig", "utf-16", "utf-32"):
        path = tmp_path / f"{enc}.yaml"
        path.write_bytes("rollout:\n  n: 4\n".encode(enc))
        assert load_config(PPOConfig, path).rollout.n == 4, enc


# ---- dataflow values --------------------------------------------------------------------------------------
class _Weird:
    def __repr__(self):
        raise RuntimeError("repr exploded")


_VALUES = st.one_of(
    st.none(), st.integers(), st.floats(allow_nan=True), st.text(max_size=5), st.binary(max_size=5),
    st.just(torch.zeros(2)), st.just(torch.tensor(float("nan"))), st.just(_Weird()), st.just((1, 2, 3)),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.sampled_from(["a", "b", "c", "out", "outs", "A", ""]),
                                                         st.integers(), max_size=3),
    st.just(iter([1, 2])), st.just(lambda: 1), st.just({1: 2}), st.just(types.SimpleNamespace(a=1)))


@fuzz_settings()
@given(ret=_VALUES, n_out=st.sampled_from([0, 1, 2]), custom=st.booleans())
def test_clear_fuzz_node_return_values(ret, n_out, custom):
    """Whatever a node returns, the run gives the declared outputs or a VerlRuntimeError naming that node (the
    producer), never a raw exception and never the blameless consumer that passes the value on."""
    outs = ["a", "b"][:n_out] if not (custom and n_out == 0) else ["a"]
    if custom:
        from verl import CustomNode
        producer = CustomNode(output_keys=outs)(lambda x: ret)
    else:
        producer = DataflowNode(input_keys=["x"], output_keys=outs)(lambda x: ret)
    producer = dataclasses.replace(producer, name="producer")

    @DataflowNode(input_keys=outs, output_keys=["seen"])
    def consumer(**kw):
        return len(kw)

    nodes = [producer, consumer] if outs else [producer]
    # a declared output that comes back as None has no value to pass on: refused where it is made
    empty = ret is None and bool(outs) and not custom
    try:
        result = build_dataflow(nodes=nodes).run({"x": 1})
    except VerlRuntimeError as e:
        assert e.node == "producer", str(e)
        _count("node return values", "refused")
        return
    assert not empty, f"a node returned None for its declared outputs {outs} and the run went on"
    assert all(k in result for k in outs)
    _count("node return values", "accepted")


def _queue_body(rank, world_size, values):
    @DataflowNode(input_keys=["i"], output_keys=["made"])
    def make(i):
        return values[i]

    @DataflowNode(input_keys=["made"], output_keys=["seen"])
    def take(made):
        return type(made).__name__

    flow = build_dataflow([make, take], configs={"make": dict(device_map=[1]),
                                                 "take": dict(device_map=[0], queue={"made": 2},
                                                              replicated_outputs=["seen"])})
    got = []
    for i in range(len(values)):
        try:
            got.append(flow.run({"i": i}).get("seen"))
        except VerlRuntimeError as e:
            got.append(("error", e.node, e.rank))
            break
    return got


QUEUE_VALUES = [torch.arange(6.0).reshape(3, 2), {"m": 1.0}, "text", 7, [1, 2, 3], torch.zeros(0), None,
                float("nan"), ("a", "b")]


@pytest.mark.multiprocess
def test_clear_fuzz_queue_values():
    """Values of every kind through a queue (producer rank 1, consumer rank 0): each arrives (its type intact),
    or the run fails naming the producer's node ('make', rank 1); None is refused where it is made."""
    from verl.testing import run_distributed
    results = run_distributed(_queue_body, world_size=2, args=(QUEUE_VALUES,), timeout=180)
    consumer = results[0]
    assert consumer[:6] == ["Tensor", "dict", "str", "int", "list", "Tensor"], consumer
    assert consumer[6] == ("error", "make", 1), consumer  # None, refused on the producer's rank
    for r in results:
        _count("queue values", f"{len(r)} runs")
