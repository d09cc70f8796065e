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
    assert len(ds) == 10 and ds[0] == {"prompt": "0+1=", "answer": "1", "data_source": "a", "extra_info": None}
    assert ds[7]["answer"] == "3" and ds[7]["data_source"] == "b"  # no data_source column: the file's stem


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


def test_chat_prompts_load_and_malformed_ones_are_named(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": chat, "answer": "4"}]), tmp_path / "chat.parquet")
    ds = load_prompt_dataset([str(tmp_path / "chat.parquet")])
    assert ds[0]["prompt"] == chat and ds[0]["answer"] == "4"
    write_jsonl([{"prompt": [{"role": "user"}], "answer": "4"}], tmp_path / "bad.jsonl")
    with pytest.raises(VerlConfigError, match=r"row 0: column 'prompt' must be a non-empty string or a list of chat"):
        load_prompt_dataset([str(tmp_path / "bad.jsonl")])


def test_gsm_symbolic_task_rows_are_chat_prompts_with_numeric_answers():
    pytest.importorskip("reasoning_gym")
    from verl.data.tasks import GSM_SYSTEM_PROMPT
    rows = make_task("gsm_symbolic", 6, seed=3)
    assert rows == make_task("gsm_symbolic", 6, seed=3) and rows != make_task("gsm_symbolic", 6, seed=4)
    for r in rows:
        system, user = r["prompt"]
        assert system == {"role": "system", "content": GSM_SYSTEM_PROMPT} and user["role"] == "user"
        assert user["content"].endswith("Give the result as your final answer. Do not include units.")
        float(r["answer"])


def test_prompt_lengths_checked_against_the_limit_error_or_filter(capsys):
    from verl.data import PromptDataset, fit_prompt_lengths
    ds = PromptDataset(["short", "a much longer prompt here", "tiny",
                        [{"role": "user", "content": "a chat whose question is long"}]], ["1", "2", "3", "4"])
    encode = lambda p: (p if isinstance(p, str) else "<s>user " + p[-1]["content"]).split()  # noqa: E731
    assert fit_prompt_lengths(ds, encode, 10) is ds
    with pytest.raises(VerlConfigError, match=r"task x row 1 \('a much longer prompt here'\) is 5 tokens after the "
                                              r"tokenizer's chat template.*max_prompt_length=3 \(2 rows are\).*"
                                              r"overlong_prompts=filter"):
        fit_prompt_lengths(ds, encode, 3, source="task x")
    kept = fit_prompt_lengths(ds, encode, 3, "filter")
    assert kept.prompts == ["short", "tiny"] and kept.answers == ["1", "3"]
    assert "dropped 2 of 4 prompts" in capsys.readouterr().err
    with pytest.raises(VerlConfigError, match="every prompt .* is longer than data.max_prompt_length=0"):
        fit_prompt_lengths(ds, encode, 0, "filter")
