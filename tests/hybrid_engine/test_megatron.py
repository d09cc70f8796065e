"""The hybrid engine on verl's real megatron-core GPT (verl.models): its ShardSpecs drive the planner, the
engine weights that come out equal the Hugging Face checkpoint the model was loaded from, bit for bit, and
the metadata-only `megatron_shard_specs` describes the live model exactly."""

from __future__ import annotations

import pytest

from tests.hybrid_engine import _megatron_workers
from verl.testing import run_distributed

# (TP, PP, TP_g, format) on 4 ranks. TP=4 > 2 KV heads is megatron-core's split-group QKV layout.
LAYOUTS = [(2, 2, 1, "hf"), (4, 1, 2, "vllm"), (2, 1, 4, "hf"), (1, 2, 2, "vllm")]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_real_megatron_model_reshards_bit_exactly(tmp_path):
    pytest.importorskip("megatron.core")
    from verl.models.tiny import save_tiny, tiny_model
    path = save_tiny(tiny_model(num_heads=4, num_kv_heads=2, vocab_size=101, noise=0.1), None, tmp_path / "ckpt")
    per_rank = run_distributed(_megatron_workers.reshard_real_model_body, 4, args=(str(path), LAYOUTS), timeout=600)
    for rank, results in enumerate(per_rank):
        for res in results:
            assert res["bad"] == [], f"rank {rank} {res['layout']}: {res['bad']}"
            assert res["intact"] and res["n"] > 0
            assert res["same_specs"], f"{res['layout']}: megatron_shard_specs differs from the live model's"
