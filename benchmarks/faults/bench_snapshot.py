"""What a recovery snapshot costs for a real model: SmolLM2-135M-Instruct with its AdamW state, as the SmolLM2
example's actor holds it (float32, one process). Measures the part on the step's critical path (the copy of the
model and optimizer tensors into CPU memory, `Snapshots.save`), the background write to /dev/shm, and the
restore (load + fill + apply_state), over --repeats snapshots; and compares the copy with the example's step
time on this machine, read from benchmarks/results/train_smollm2_gsm8k.json (a training step of the example
itself, too long to repeat here: ~17 min on 2 cores).

    python benchmarks/faults/bench_snapshot.py                 # writes benchmarks/results/bench_snapshot.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from verl.utils.checkpoint import apply_state, checkpoint_tensors, rng_state  # noqa: E402
from verl.utils.snapshot import DEFAULT_ROOT, Snapshots, fill  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_snapshot.json"))
    args = ap.parse_args()
    from verl.models.pretrained import load_pretrained, resolve_model_path
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    torch.set_num_threads(1)
    model, _ = load_pretrained(resolve_model_path("smollm2-135m-instruct"), "float32")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()  # the AdamW state exists after the first step
    optim.step()
    modules = {"actor": (model, optim)}
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
        t.numel() * t.element_size() for st in optim.state.values() for t in st.values() if torch.is_tensor(t))
    root = DEFAULT_ROOT if DEFAULT_ROOT.parent.is_dir() else Path(tempfile.mkdtemp())
    store = Snapshots(root, root, f"bench-{int(time.time())}", 0, 1, "bench")
    copy_s, write_s, restore_s = [], [], []
    try:
        for step in range(1, args.repeats + 1):
            copy_s.append(store.save(step, checkpoint_tensors(modules, {}, for_load=False), {"step": step},
                                     rng_state()))
            store.wait()
            write_s.append(store.last_write_s)
            t0 = time.perf_counter()
            payload = store.load(step)
            apply_state(fill(checkpoint_tensors(modules, {}, for_load=True), payload["tensors"]), modules, {},
                        "bench")
            restore_s.append(time.perf_counter() - t0)
    finally:
        store.clear()
        if root != DEFAULT_ROOT:
            shutil.rmtree(root, ignore_errors=True)
    ref = ROOT / "benchmarks" / "results" / "train_smollm2_gsm8k.json"
    step = json.loads(ref.read_text())["step_time_s_median"] if ref.exists() else None
    row = {"model": "SmolLM2-135M-Instruct", "state_bytes": nbytes, "root": str(root),
           "copy_s_median": statistics.median(copy_s), "write_s_median": statistics.median(write_s),
           "restore_s_median": statistics.median(restore_s), "copy_s": copy_s, "write_s": write_s,
           "restore_s": restore_s, "example_step_s": step, "example_step_from": str(ref.relative_to(ROOT)),
           "copy_share_of_step": statistics.median(copy_s) / step if step else None}
    print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}, indent=1))
    write_result(args.out, {"rows": [row]}, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
