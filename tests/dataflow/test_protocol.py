"""DataProto: per-sample tensors and non-tensor fields in one TensorDict, plus batch-level meta."""

from __future__ import annotations

import pytest
import torch

from verl.errors import VerlConfigError
from verl.protocol import DataProto


def make(n=5, offset=0):
    ids = torch.arange(n * 3).view(n, 3) + offset
    return DataProto.from_dict(tensors={"input_ids": ids, "mask": torch.ones(n, 3, dtype=torch.bool)},
                               non_tensors={"prompt": [f"p{i + offset}" for i in range(n)],
                                            "uid": [f"u{i + offset}" for i in range(n)]},
                               meta={"temperature": 0.7})


def test_fields_and_indexing():
    b = make()
    assert len(b) == 5 and b.tensor_keys == ["input_ids", "mask"] and b.non_tensor_keys == ["prompt", "uid"]
    assert b["prompt"] == ["p0", "p1", "p2", "p3", "p4"]
    assert b[1:3]["prompt"] == ["p1", "p2"] and b[1:3].meta == {"temperature": 0.7}
    assert b[torch.tensor([4, 0])]["uid"] == ["u4", "u0"]
    assert b[2]["input_ids"].tolist() == [[6, 7, 8]]
    b["reward"] = torch.arange(5.0)
    b["answer"] = ["a"] * 5
    assert b.select("reward", "answer").keys() == ["reward", "answer"]
    assert "reward" not in b.exclude("reward")
    with pytest.raises(VerlConfigError, match="put batch-level values in .meta"):
        b["scalar"] = torch.tensor(1.0)
    with pytest.raises(KeyError, match="did you mean 'prompt'"):
        b["promt"]
    with pytest.raises(VerlConfigError, match="share the batch size"):
        DataProto.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"b": ["x"]})


def test_union():
    b = make()
    extra = DataProto.from_dict(tensors={"old_log_probs": torch.randn(5, 3)}, non_tensors={"prompt": b["prompt"]},
                                meta={"step": 3})
    u = b.union(extra)
    assert set(u.keys()) == {"input_ids", "mask", "prompt", "uid", "old_log_probs"}
    assert u.meta == {"temperature": 0.7, "step": 3}
    assert "old_log_probs" not in b  # inputs untouched
    with pytest.raises(VerlConfigError, match="field 'prompt' differs"):
        b.union(DataProto.from_dict(non_tensors={"prompt": ["x"] * 5}))
    with pytest.raises(VerlConfigError, match="batches of 5 and 2 samples"):
        b.union(make(2))


def test_chunk_concat_round_trip():
    b = make(7)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    back = DataProto.concat(parts)
    assert back["prompt"] == b["prompt"] and torch.equal(back["input_ids"], b["input_ids"])
    assert back.meta == b.meta
    with pytest.raises(VerlConfigError, match="select the same fields first"):
        DataProto.concat([b, b.select("input_ids")])


def test_repeat_interleave_keeps_groups_adjacent():
    b = make(2)
    r = b.repeat_interleave(3)
    assert r["uid"] == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert torch.equal(r["input_ids"][:3], b["input_ids"][:1].expand(3, 3))


def test_pad_to_divisor_and_unpad():
    b = make(5)
    padded, pad = b.pad_to_divisor(4)
    assert len(padded) == 8 and pad == 3
    assert padded["prompt"][5:] == ["p0", "p1", "p2"]  # padding repeats real samples
    assert padded.unpad(pad)["prompt"] == b["prompt"]
    same, zero = b.pad_to_divisor(5)
    assert zero == 0 and same is b
    tiny, pad = make(1).pad_to_divisor(3)
    assert tiny["prompt"] == ["p0"] * 3 and pad == 2


def test_dp_shard_matches_chunk():
    b = make(6)
    shards = [b.dp_shard(r, 3) for r in range(3)]
    assert [s["uid"] for s in shards] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    with pytest.raises(VerlConfigError, match="outside 0..2"):
        b.dp_shard(3, 3)


def test_pickles_and_summarises():
    import pickle
    b = make(3)
    c = pickle.loads(pickle.dumps(b))
    assert c["prompt"] == b["prompt"] and torch.equal(c["input_ids"], b["input_ids"]) and c.meta == b.meta
    s = b.summary()
    assert s["len"] == 3 and s["fields"]["input_ids"] == {"shape": [3, 3], "dtype": "int64"}
    assert s["fields"]["prompt"] == {"type": "list", "len": 3}
