"""Prompt datasets from parquet / JSONL, clear errors for missing files and columns, resumable order."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.data import BatchSampler, load_prompt_dataset, make_task, write_jsonl
from verl.errors import VerlConfigError


def test_jsonl_and_parquet_round_trip(tmp_path):
    rows = [{"question": f"{i}+1=", "solution": i + 1} for i in range(5)]
    write_jsonl(rows, tmp_path / "a.jsonl")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    ds = load_prompt_dataset([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], "question", "solution")
    assert len(ds) == 10 and ds[0] == {"prompt": "0+1=", "answer": "1"} and ds[7]["answer"] == "3"


def test_missing_column_names_the_columns(tmp_path):
    write_jsonl([{"question": "1+1=", "answer": "2"}], tmp_path / "a.jsonl")
    with pytest.raises(VerlConfigError, match=r"no column 'prompt'.*\['answer', 'question'\].*data.prompt_key"):
        load_prompt_dataset([str(tmp_path / "a.jsonl")])


@pytest.mark.parametrize("name, content, match", [
    ("missing.jsonl", None, "does not exist"),
    ("bad.jsonl", "{not json}\n", "line 1 is not JSON"),
    ("data.csv", "a,b\n", "unsupported format"),
    ("empty.jsonl", "", "is empty"),
])
def test_bad_files(tmp_path, name, content, match):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(VerlConfigError, match=match):
        load_prompt_dataset([str(tmp_path / name)])


def test_sampler_resumes_the_same_order():
    a = BatchSampler(10, 4, seed=3)
    first = [a.next_batch() for _ in range(3)]
    b = BatchSampler(10, 4, seed=3)
    b.next_batch()
    state = b.state_dict()
    c = BatchSampler(10, 4, seed=3)
    c.load_state_dict(state)
    assert [c.next_batch(), c.next_batch()] == first[1:]
    assert first[2] != first[0]
    with pytest.raises(VerlConfigError, match="larger than the dataset"):
        BatchSampler(3, 4, seed=0)


def test_tasks_are_verifiable():
    for r in make_task("arithmetic", 50, seed=0):
        a, op, b = r["prompt"][:-1].partition("+") if "+" in r["prompt"] else r["prompt"][:-1].partition("-")
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    for r in make_task("counting", 20, seed=0):
        target, text = r["prompt"][len("count "):-1].split(" in ")
        assert int(r["answer"]) == text.count(target)
