"""LoRA's adapter-only weight sync against the full sync, the engine's swap, and the actor + reference memory:
SmolLM2-135M-Instruct with a rank-16 adapter on every linear layer, both sides in one process, one run.

Sync: an actor (the torch engine's module) and a torch rollout engine with a copy of its own (as on other ranks
or in another dtype), joined by the 3D-HybridEngine; the full fine-tune's sync moves every weight, the LoRA sync
(actor.lora.sync=adapter) the adapter tensors only. Measured per sync, alternating the two `--repeats` times:
bytes handed to the engine, wall time, the engine's swap (`TorchRollout.last_swap_s`: its staged tensors put in
place, the only moment its weights change) and the bytes this process wrote (/proc/self/io: write_bytes, what
reached the storage layer, and wchar, every write() call).

Memory: the actor plus its reference as the trainer builds them: full fine-tuning holds a second, frozen copy of
the policy; LoRA's reference is the actor's base with the adapters off (`BaseModelView`), no copy. Distinct
storage bytes of the weights (`verl.models.lora.unique_bytes`), and the same plus AdamW's state after one step
(AdamW keeps two tensors per trained parameter), each as a multiple of one model.

    python benchmarks/sync/bench_lora.py            # writes benchmarks/results/bench_lora_sync.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _sync(he, local, engine) -> dict:
    before = _io()
    t0 = time.perf_counter()
    he.sync(local, engine)
    seconds = time.perf_counter() - t0
    after = _io()
    return dict(sync_s=seconds, swap_s=engine.last_swap_s, bytes=sum(t.nbytes for t in he.plan.targets_of(0)),
                disk_write_bytes=after["write_bytes"] - before["write_bytes"],
                write_call_bytes=after["wchar"] - before["wchar"])


def _optimizer_bytes(module: torch.nn.Module) -> int:
    """AdamW's state after one step over the trainable parameters (zero gradients: the state exists all the same)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=False)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    total = sum(t.nbytes for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    for p in params:
        p.grad = None
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_lora_sync.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run_info = RunInfo.start()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from verl.config.ppo import LoRAConfig
    from verl.hybrid_engine import HybridEngineConfig, hybrid_engine_for_module, module_local_params
    from verl.models.lora import adapter_bytes, apply_lora, sync_tensors, unique_bytes
    from verl.models.pretrained import resolve_model_path
    from verl.rollout import RolloutConfig, TorchRollout
    from verl.workers.engine import BaseModelView, TorchEngine
    from verl.distributed import Placement

    path = resolve_model_path(args.model)
    full_actor = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    one_model = sum(p.nbytes for p in full_actor.parameters())
    lora_actor = copy.deepcopy(full_actor)
    torch.manual_seed(0)
    apply_lora(lora_actor, LoRAConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank))
    with torch.no_grad():  # a trained adapter (B starts at zero)
        for name, p in lora_actor.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.01)
    full_engine = TorchRollout(copy.deepcopy(full_actor), str(path), RolloutConfig())
    lora_engine = TorchRollout(copy.deepcopy(lora_actor), str(path), RolloutConfig())
    with torch.no_grad():
        for name, p in lora_engine.model.named_parameters():
            if ".lora_" in name:
                p.zero_()  # the engine starts from another version: the sync has to bring it
    he_full = hybrid_engine_for_module(full_actor, HybridEngineConfig())
    he_lora = hybrid_engine_for_module(lora_actor, HybridEngineConfig(),
                                       params=sync_tensors(lora_actor, "adapter", local=False))
    rows = {"full": [], "lora": []}
    for _ in range(args.repeats):
        rows["full"].append(_sync(he_full, module_local_params(full_actor), full_engine))
        rows["lora"].append(_sync(he_lora, sync_tensors(lora_actor, "adapter"), lora_engine))
    held = dict(sync_tensors(lora_engine.model, "adapter"))
    arrived = all(torch.equal(held[n], t) for n, t in sync_tensors(lora_actor, "adapter").items())
    del full_engine, lora_engine

    memory = {}
    full_ref = copy.deepcopy(full_actor).requires_grad_(False)  # the trainer's frozen copy
    memory["full"] = dict(weights=unique_bytes(full_actor, full_ref), optimizer=_optimizer_bytes(full_actor))
    del full_ref
    optimizer = _optimizer_bytes(lora_actor)
    ref = BaseModelView(TorchEngine(lora_actor, None, Placement()))  # (a frozen engine: only the view is used)
    memory["lora"] = dict(weights=unique_bytes(lora_actor, ref.view_of.module), optimizer=optimizer)
    for m in memory.values():
        m.update(weights_x_model=m["weights"] / one_model, with_optimizer_x_model=(m["weights"] + m["optimizer"]) /
                 one_model)

    med = statistics.median
    summary = {side: {k: med(r[k] for r in rs) for k in ("sync_s", "swap_s", "bytes")} |
               {"disk_write_bytes": max(r["disk_write_bytes"] for r in rs),
                "write_call_bytes": max(r["write_call_bytes"] for r in rs)} for side, rs in rows.items()}
    adapter = adapter_bytes(lora_actor)
    summary["ratios"] = dict(lora_bytes_over_adapter=summary["lora"]["bytes"] / adapter,
                             adapter_over_model=adapter / one_model,
                             lora_bytes_over_full=summary["lora"]["bytes"] / summary["full"]["bytes"],
                             lora_time_over_full=med(lr["sync_s"] / fr["sync_s"]
                                                     for lr, fr in zip(rows["lora"], rows["full"])))
    meta = {"model": args.model,
            "lora_rank": args.rank, "target_modules": "all-linear", "adapter_bytes": adapter, "model_bytes": one_model,
            "threads": 1, "host": platform.node(), "adapters_arrived_bit_exact": arrived,
            "note": "times are medians of alternating repeats in one process; bytes are what the engine is handed"}
    write_result(args.out, {"summary": summary, "memory": memory, "per_sync": rows}, run_info, **meta)
    print(json.dumps({"summary": summary, "memory": memory}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
