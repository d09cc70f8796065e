"""The classes an independent audit found after round one (issue #31), each as a table of cases against its shared
mechanism: config ranges (every int key), config files (encodings, directories, nesting, alias bombs, scalars
where sections go), the step's memory bound, one length rule for every engine, token ids, dataflow outputs and
blame, and library errors named by path. (Non-finite ops: test_nonfinite_ops.py; fuzzing: test_fuzz.py.)"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import torch

from verl import DataflowNode, VerlConfigError, VerlRuntimeError, build_dataflow
from verl.config import PPOConfig, load_config
from verl.config.base import INT_RANGE, _dataclass_type, _hints, ranges

from tests.trainer.conftest import TINY


# ---- config ranges: every int key refuses huge values, naming the key ---------------------------------------
def _int_keys(cls: type = PPOConfig, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(_hints(cls)[f.name])
        if sub is not None:
            out += _int_keys(sub, f"{prefix}{f.name}.")
        elif f.name in ranges(cls) and "list" not in str(_hints(cls)[f.name]) \
                and "float" not in str(_hints(cls)[f.name]):  # int keys (a float's bound prints as a float)
            out.append((prefix + f.name, ranges(cls)[f.name]))
    return out


INT_KEYS = _int_keys()


@pytest.mark.parametrize("key, rng", INT_KEYS, ids=[k for k, _ in INT_KEYS])
def test_clear_huge_int_is_refused_naming_the_key(key, rng):
    with pytest.raises(VerlConfigError, match=rf"config key '{key}': 9223372036854775808 must be <= "):
        load_config(PPOConfig, None, [f"{key}={2 ** 63}"])
    if rng is not INT_RANGE:  # a declared range also bounds from below
        with pytest.raises(VerlConfigError, match=rf"config key '{key}': .* must be >= "):
            load_config(PPOConfig, None, [f"{key}={int(rng.low) - 1}"])


def test_behaves_declared_ranges_appear_in_help():
    from verl.config import describe
    help_text = "\n".join(describe(PPOConfig))
    assert "rollout.n = 8 in [1, 65536]:" in help_text and "trainer.seed = 1 in [0, 4294967295]:" in help_text


@pytest.mark.parametrize("override", ["rollout.n=1099511627776", "trainer.seed=1000000000000000000000000000000",
                                      "model.tiny.hidden_size=9223372036854775808", "rollout.max_model_len=2e30",
                                      "actor.ranks=[99999999999]", "rollout.top_k=-1"])
def test_clear_audit_huge_and_negative_values(override):
    key = override.split("=")[0]
    with pytest.raises(VerlConfigError, match=key.replace(".", r"\.")):
        load_config(PPOConfig, None, [override])


@pytest.mark.parametrize("override, key", [("trainer.output_dir=", "trainer.output_dir"),
                                           ("trainer.output_dir='  '", "trainer.output_dir"),
                                           ('trainer.output_dir="a\\0b"', "trainer.output_dir"),
                                           ('model.path="x\\0y"', "model.path")])
def test_clear_empty_or_nul_strings(override, key):
    with pytest.raises(VerlConfigError, match=key.replace(".", r"\.")):
        load_config(PPOConfig, None, [override])


# ---- config files ------------------------------------------------------------------------------------------
def _alias_bomb(levels: int = 10, width: int = 9) -> str:
    lines = ["    a0: &a0 [" + ", ".join(['"x"'] * width) + "]"]
    lines += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "rollout:\n  engine_kwargs:\n" + "\n".join(lines) + "\n"


FILES = {
    "utf-16 without a BOM": ("rollout:\n  n: 4\n".encode("utf-16-le"), "not a text file"),
    "latin-1": ("# caf\xe9\nrollout:\n  n: 4\n".encode("latin-1"), r"not UTF-8 text \(byte 0xe9 on line 1"),
    "binary": (bytes(range(256)), "not a text file"),
    "a BOM that lies": (b"\xff\xfe" + b"\x00\xd8", "UTF-16 byte-order mark but is not UTF-16 text"),
    "50000 levels of nesting": (("a: " + "[" * 50000 + "]" * 50000 + "\n").encode(), "nested too deeply"),
    "40 levels of nesting": (("rollout:\n  engine_kwargs: {x: " + "[" * 40 + "]" * 40 + "}\n").encode(),
                             "config key 'rollout.engine_kwargs.x.*' .* nested more than 32 levels"),
    "alias bomb (1.5 KB)": (_alias_bomb().encode(), r"config key 'rollout.engine_kwargs.a\d' .* expands to more "
                                                    r"than 100000 values"),
    "alias to itself": (b"rollout:\n  engine_kwargs: &me {x: *me}\n", "contains itself"),
    "actor: 5 (no override)": (b"actor: 5\n", "config key 'actor' is a section"),
    "model: gpt2 (no override)": (b"model: gpt2\n", "did you mean 'model.path=gpt2'"),
}


@pytest.mark.parametrize("name", list(FILES))
def test_clear_bad_config_file(tmp_path, name):
    data, match = FILES[name]
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    with pytest.raises(VerlConfigError, match=match) as info:
        load_config(PPOConfig, path)
    assert str(path) in str(info.value) or "config key" in str(info.value)


def test_clear_directory_is_not_reported_missing(tmp_path):
    with pytest.raises(VerlConfigError, match=rf"config file '{tmp_path}' is a directory"):
        load_config(PPOConfig, tmp_path)


@pytest.mark.parametrize("yaml_text, override, match", [
    ("actor: 5\n", "actor.optim.lr=1e-3", "config key 'actor' is a section, but the config file gives it the value 5"),
    ("model: gpt2\n", "model.dtype=float32", "did you mean 'model.path=gpt2'"),
    ("rollout:\n  engine_kwargs: 3\n", "rollout.engine_kwargs.x=1", "config key 'rollout.engine_kwargs' is a section"),
])
def test_clear_scalar_where_a_section_goes_is_not_dropped_by_an_override(tmp_path, yaml_text, override, match):
    path = tmp_path / "job.yaml"
    path.write_text(yaml_text)
    with pytest.raises(VerlConfigError, match=match):
        load_config(PPOConfig, path, [override])


def test_clear_alias_bomb_in_an_override():
    bomb = "[" + ",".join(["&a [1,1,1,1,1,1,1,1,1,1]"] + ["*a"] * 9) + "]"
    nested = bomb
    for _ in range(5):
        nested = f"&b{_} {nested}"
        nested = "[" + ",".join([nested] + [f"*b{_}"] * 9) + "]"
    with pytest.raises(VerlConfigError, match="rollout.engine_kwargs.*expands to more than"):
        load_config(PPOConfig, None, [f"rollout.engine_kwargs={{x: {nested}}}"])


def test_behaves_a_large_config_loads_when_the_limit_is_raised(tmp_path, monkeypatch):
    path = tmp_path / "job.yaml"
    path.write_bytes(_alias_bomb(levels=6, width=9).encode())  # 9^6 = 531441 values
    with pytest.raises(VerlConfigError, match="VERL_CONFIG_MAX_VALUES"):
        load_config(PPOConfig, path)
    monkeypatch.setenv("VERL_CONFIG_MAX_VALUES", "1000000")
    assert len(load_config(PPOConfig, path).rollout.engine_kwargs) == 6


def test_behaves_utf8_bom_and_utf16_bom_files_load(tmp_path):
    for enc in ("utf-8-sig", "utf-16", "utf-32"):
        path = tmp_path / f"{enc}.yaml"
        path.write_bytes("trainer:\n  output_dir: café\n".encode(enc))
        assert load_config(PPOConfig, path).trainer.output_dir == "café"


# ---- the memory a step needs, and sizes against the data ---------------------------------------------------
def _main(tmp_path, *extra):
    from verl.trainer.main_ppo import main
    return main([*TINY, f"trainer.output_dir={tmp_path / 'run'}", "trainer.export_hf=false", "trainer.plot=false",
                 *extra])


@pytest.mark.parametrize("extra, parts", [
    (["rollout.n=65536", "data.train_batch_size=4096", "data.num_examples=8192", "actor.mini_batch_size=4096"],
     ["the step's batch tensors", "rollout.n=65536", "data.train_batch_size=4096"]),
    (["model.tiny.hidden_size=65536", "model.tiny.num_layers=1024"],
     ["actor weights, gradients and Adam state", "model.tiny.hidden_size=65536", "model.tiny.num_layers=1024"]),
    (["data.num_examples=1048576", "data.train_batch_size=1048576", "actor.mini_batch_size=1048576",
      "rollout.n=64"], ["rollout.n=64", "data.train_batch_size=1048576"]),
])
def test_clear_a_step_that_cannot_fit_is_refused_naming_the_keys(tmp_path, extra, parts):
    with pytest.raises(VerlConfigError, match="one training step needs at least") as info:
        _main(tmp_path, *extra)
    for p in parts:
        assert p in str(info.value), (p, str(info.value))
    assert not (tmp_path / "run").exists()


def test_clear_warmup_batch_larger_than_the_dataset(tmp_path):
    with pytest.raises(VerlConfigError, match=r"warmup.batch_size=100000 .* exceeds the 64 rows of the dataset"):
        _main(tmp_path, "warmup.batch_size=100000")


def test_behaves_memory_estimate_is_a_lower_bound_of_a_real_step():
    """The estimate of the tiny job is far below what the process really holds: a bound, never a guess."""
    from verl.trainer.memory import estimate_step_memory, model_shape
    cfg = load_config(PPOConfig, None, TINY)
    need = sum(p.bytes for p in estimate_step_memory(cfg, model_shape(cfg), 1))
    assert 0 < need < 64 << 20


def test_behaves_tiny_model_is_built_in_model_dtype(tmp_path):
    from verl.data import PromptDataset
    from verl.trainer.ppo_trainer import load_policy
    cfg = load_config(PPOConfig, None, [*TINY, "model.dtype=bfloat16"])
    model, _ = load_policy(cfg, PromptDataset(["1+1="], ["2"]))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ---- one length rule, token ids, for every local engine ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from verl.models.tiny import tiny_model, tiny_tokenizer
    tok = tiny_tokenizer()
    return tiny_model(tokenizer=tok), tok  # 64 positions, 96 ids


def _engine(tiny, engine, **cfg):
    from verl.rollout import RolloutConfig, build_rollout
    model, tok = tiny
    return build_rollout(RolloutConfig(engine=engine, **cfg), model=model, tokenizer=tok)


def _gen(tiny, engine, prompt, max_new_tokens=4, **cfg):
    from verl.rollout import SamplingParams
    return _engine(tiny, engine, **cfg).generate([prompt], SamplingParams(max_new_tokens=max_new_tokens,
                                                                          temperature=0))[0]


ENGINES = ["torch", "hf"]


@pytest.mark.parametrize("engine", ENGINES)
def test_clear_max_model_len_past_the_models_positions(tiny, engine):
    with pytest.raises(VerlConfigError, match="rollout.max_model_len=200 exceeds the model's "
                                              "max_position_embeddings=64"):
        _engine(tiny, engine, max_model_len=200)


@pytest.mark.parametrize("engine", ENGINES)
def test_clear_prompt_past_the_models_positions(tiny, engine):
    with pytest.raises(VerlConfigError, match="prompt 0 is 70 tokens, which leaves no room .* max_model_len=64"):
        _gen(tiny, engine, [5] * 70)


@pytest.mark.parametrize("engine", ENGINES)
def test_behaves_generation_stops_at_the_models_positions(tiny, engine):
    out = _gen(tiny, engine, [5] * 60, max_new_tokens=10)
    assert len(out.token_ids) <= 4 and (out.finish_reason == "length" or len(out.token_ids) < 4)


def test_clear_trainer_refuses_max_model_len_past_the_positions(tmp_path):
    with pytest.raises(VerlConfigError, match="rollout.max_model_len=300 exceeds the model's "
                                              "max_position_embeddings=128"):
        _main(tmp_path, "rollout.max_model_len=300")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("prompt, match", [([5, 999], "token id 999 at position 1, outside the model's vocabulary "
                                                      "of 96 ids"),
                                           ([-1, 5], "token id -1 at position 0"),
                                           ([5, 2.5], r"has 2.5 \(float\) at position 1"),
                                           ([5, True], r"has True \(bool\) at position 1")],
                         ids=["past_vocab", "negative", "float", "bool"])
def test_clear_bad_token_ids_name_the_id_and_row(tiny, engine, prompt, match):
    with pytest.raises(VerlConfigError, match=f"prompt 0 {match}" if "token id" not in match else match):
        _gen(tiny, engine, prompt)


@pytest.mark.parametrize("what", ["forward", "train_step"])
def test_clear_training_engine_names_a_bad_token_id(tiny, what):
    from verl.config import OptimConfig
    from verl.distributed import init_placement
    from verl.workers import TorchEngine
    from verl.workers.batch import RolloutBatch
    model, _ = tiny
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 500, 4]])
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(4).expand(2, 4),
                         response_mask=torch.ones(2, 2), group=torch.tensor([0, 0]))
    engine = TorchEngine(model, OptimConfig(lr=1e-3), init_placement("cpu"))
    with pytest.raises(VerlConfigError, match=rf"TorchEngine.{what}: row 1 of the batch has token id 500 at "
                                              rf"position 2, outside the model's vocabulary of 96 ids"):
        if what == "forward":
            engine.forward(batch, 2)
        else:
            engine.train_step(batch, 2, lambda out, f: (out["log_probs"].sum(), {}), {})


# ---- dataflow outputs and blame ----------------------------------------------------------------------------
@DataflowNode(input_keys=["y"], output_keys=["z"])
def _use(y):
    return y + 1


@pytest.mark.parametrize("ret, match", [
    (None, "returned None for its output 'y'"),
    ({"yy": 1}, "returned a dict with the one key 'yy', close to its output 'y'"),
    ({"Y": 1}, "returned a dict with the one key 'Y', close to its output 'y'"),
], ids=["none", "misspelt", "case"])
def test_clear_one_output_node_is_checked_where_its_value_is_made(ret, match):
    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def make(x):
        return ret

    with pytest.raises(VerlRuntimeError, match=rf"\[node 'make', rank 0\] failed: {match}"):
        build_dataflow(nodes=[make, _use]).run({"x": 1})


def test_behaves_one_output_dict_keyed_by_the_output_is_its_value():
    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def make(x):
        return {"y": 41}

    assert build_dataflow(nodes=[make, _use]).run({"x": 1})["z"] == 42


def test_behaves_every_node_has_a_finite_default_timeout():
    from verl.dataflow.config import DEFAULT_NODE_TIMEOUT_S, NodeConfig, make_config
    from verl.trainer.ppo_flow import node_configs
    assert 0 < NodeConfig().timeout_s == make_config("n", {}, {}).timeout_s == DEFAULT_NODE_TIMEOUT_S < float("inf")
    assert make_config("n", {"timeout_s": 0}, {}).timeout_s == 0  # off only on request
    cfg = load_config(PPOConfig, None, [])
    assert all(c.timeout_s == 3600.0 for c in node_configs(cfg, cfg.roles(1)).values())


def _consumer_raises(rank, world_size):
    @DataflowNode(input_keys=["x"], output_keys=["made"])
    def produce(x):
        return torch.full((4, 2), float(x))

    @DataflowNode(input_keys=["made"], output_keys=["seen"])
    def consume(made):
        raise ValueError("the consumer broke")

    flow = build_dataflow([produce, consume], configs={"produce": dict(device_map=[1]), "consume": dict(
        device_map=[0], queue={"made": 1}, replicated_outputs=["seen"])})
    for i in range(6):
        try:
            flow.run({"x": i})
        except VerlRuntimeError as e:
            return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_clear_queue_producer_blames_the_consumer_not_itself():
    from verl.testing import run_distributed
    consumer, producer = run_distributed(_consumer_raises, world_size=2, timeout=180)
    assert "[node 'consume', rank 0] failed: ValueError: the consumer broke" in consumer
    assert "lost contact with ranks [0]" in producer and "the consumer's ranks [0] of 'made'" in producer
    assert "ranks [1]" not in producer, producer


def _producer_hangs(rank, world_size):
    import time

    @DataflowNode(input_keys=["x"], output_keys=["made"])
    def produce(x):
        time.sleep(3600)

    @DataflowNode(input_keys=["made"], output_keys=["seen"])
    def consume(made):
        return 1

    flow = build_dataflow([produce, consume], configs={"produce": dict(device_map=[1], timeout_s=3),
                                                       "consume": dict(device_map=[0], queue={"made": 1},
                                                                       replicated_outputs=["seen"])})
    start = time.monotonic()
    try:
        flow.run({"x": 0})
    except VerlRuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


@pytest.mark.multiprocess
def test_clear_a_hanging_producer_stage_ends_at_its_node_timeout():
    from verl.testing import run_distributed
    (consumer, _), (producer, waited) = run_distributed(_producer_hangs, world_size=2, timeout=120)
    assert "[node 'produce', rank 1]" in producer and "exceeded its timeout_s=3" in producer and waited < 60
    assert "node 'produce'" in consumer and "rank 1" in consumer  # the consumer is told who failed


# ---- library errors named by path --------------------------------------------------------------------------
def test_clear_reward_model_without_tokenizer_names_the_directory(tmp_path):
    from verl.models.tiny import tiny_model, tiny_tokenizer
    from verl.workers.reward import ModelRewardWorker
    tiny_model(head="score", tokenizer=tiny_tokenizer()).save_pretrained(tmp_path / "rm")
    with pytest.raises(VerlConfigError, match=rf"reward.model_path='{tmp_path / 'rm'}': cannot load its tokenizer"):
        ModelRewardWorker(str(tmp_path / "rm"), torch.device("cpu"))


def test_clear_tokenizer_directory_that_is_not_one(tmp_path):
    from verl.rollout import Tokenizer
    with pytest.raises(VerlConfigError, match=rf"tokenizer directory '{tmp_path}' cannot be loaded"):
        Tokenizer.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("name, data, match", [
    ("strings.jsonl", b'"hello"\n', r"line 1 is a JSON str \('\"hello\"'\), not an object"),
    ("lists.jsonl", b'[1, 2]\n', r"line 1 is a JSON list"),
    ("latin1.jsonl", '{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"), "is not UTF-8 text"),
    ("broken.parquet", b"PAR1 not really", "cannot be read as parquet: ArrowInvalid"),
])
def test_clear_dataset_files_named_with_the_problem(tmp_path, name, data, match):
    from verl.data import load_prompt_dataset
    (tmp_path / name).write_bytes(data)
    with pytest.raises(VerlConfigError, match=rf"dataset file '{tmp_path / name}'.*{match}"):
        load_prompt_dataset([str(tmp_path / name)])


def test_clear_records_that_are_not_mappings():
    from verl.data import PromptDataset
    with pytest.raises(VerlConfigError, match="row 1 is a str"):
        PromptDataset.from_records([{"prompt": "a", "answer": "b"}, "hello"])


# ---- found by the engine matrix ----------------------------------------------------------------------------
def test_behaves_unused_critic_does_not_block_an_exclusive_rollout():
    """A GRPO job has no critic: its default ranks (the second half in split placement) overlapping a vLLM rollout
    refused every one_step_off / async vLLM job; only roles that hold memory count (a critic only for gae)."""
    own = ["trainer.placement=split", "rollout.engine=vllm", "actor.ranks=[0]", "rollout.ranks=[1]", "reward.ranks=[0]",
           "data.train_batch_size=4", "actor.mini_batch_size=4", "rollout.n=4", "actor.micro_batch_size=4",
           "rollout.in_process=false"]
    load_config(PPOConfig, None, own).validate_world(2)
    with pytest.raises(VerlConfigError, match=r"critic.ranks=\[1\] overlaps the vllm rollout on ranks \[1\]"):
        load_config(PPOConfig, None, [*own, "algorithm.adv_estimator=gae"]).validate_world(2)


def _fsdp_one_rank_role(rank, world_size):
    from verl.config import FSDPConfig, OptimConfig
    from verl.distributed import init_placement
    from verl.models.tiny import tiny_model
    from verl.trainer.ppo_trainer import role_placements
    from verl.workers.fsdp import FSDPEngine
    import torch.distributed as dist
    cfg = load_config(PPOConfig, None, ["trainer.placement=split", "actor.engine=fsdp", "actor.ranks=[0]",
                                        "rollout.ranks=[1]", "reward.ranks=[0]"])
    placement = init_placement("cpu", process_group=True)
    places = role_placements(placement, cfg.roles(world_size))
    size = None
    if places["actor"] is not None:
        size = FSDPEngine(tiny_model(), OptimConfig(lr=1e-3), places["actor"], FSDPConfig()).mesh.size()
    # Rank 0 hosts the rendezvous store: leaving before rank 1 has finished creating its groups over that store
    # reset rank 1's connection (CI saw it once). Both leave together.
    dist.barrier()
    return size


@pytest.mark.multiprocess
def test_behaves_fsdp_role_on_one_rank_of_several_shards_alone():
    """An FSDP actor on rank 0 of 2 used the world group for its mesh and first broadcast, so it waited for rank 1,
    which never builds the actor: one_step_off / async with the rollout on rank 1 hung until the timeout."""
    from verl.testing import run_distributed
    assert run_distributed(_fsdp_one_rank_role, world_size=2, timeout=180) == [1, None]


def test_clear_in_process_vllm_on_part_of_the_ranks():
    """vLLM started inside a trainer process on rank 1 of 2 (one_step_off) created its groups over both ranks
    and hung the job until the collective timeout; refused before step 1, naming the way out."""
    own = ["trainer.placement=split", "rollout.engine=vllm", "actor.ranks=[0]", "rollout.ranks=[1]",
           "reward.ranks=[0]", "trainer.mode=one_step_off"]
    with pytest.raises(VerlConfigError, match=r"rollout.ranks=\[1\] are not all 2 ranks, .* set "
                                              r"rollout.in_process=false"):
        load_config(PPOConfig, None, own).validate_world(2)
    load_config(PPOConfig, None, [*own, "rollout.in_process=false"]).validate_world(2)
