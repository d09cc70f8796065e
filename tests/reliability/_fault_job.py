"""A two-node dataflow run as one rank of a job, with a fault injected on rank 1; the reliability tests launch it
under torchrun or as plain processes and watch how every rank ends.

    python -m torch.distributed.run --nproc_per_node=2 tests/reliability/_fault_job.py SCENARIO DIR [TIMEOUT_S]

Scenarios (what rank 1 does inside node 'step'; rank 0 runs the same node normally):
    spin        every rank loops in 'step' forever (the test sends signals)
    spin1       rank 1 loops in 'step' forever; rank 0 waits for it in the runtime's agreement
    kill        rank 1 SIGKILLs itself while rank 0 waits for it in an all_reduce inside the node
    kill_after  rank 1 SIGKILLs itself; rank 0 has left the node and waits in the runtime's agreement
    hang        rank 1 sleeps 3 x TIMEOUT_S in the node (no node timeout); rank 0 waits in the agreement
    timeout     rank 1 loops in pure Python; the node's timeout_s is 1 s
    exit        rank 1 calls sys.exit(4) in the node
Every rank writes DIR/ready_<rank> (its pid) on entering 'step' and DIR/done_<rank> when the run returns.
TIMEOUT_S is the collective timeout (default 3 s). Exit codes: run_cli's (1: VerlRuntimeError, 130: Ctrl-C).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main(argv: list[str]) -> int:
    from verl import DataflowNode, build_dataflow
    from verl.distributed import init_placement

    scenario, out = argv[0], Path(argv[1])
    collective_timeout = float(argv[2]) if len(argv) > 2 else 3.0
    placement = init_placement("cpu", timeout_s=collective_timeout)
    rank = placement.rank

    @DataflowNode(input_keys=["x"], output_keys=["y"])
    def step(x, ctx):
        (out / f"ready_{rank}").write_text(str(os.getpid()))
        if scenario == "spin":
            while True:
                time.sleep(0.05)
        if rank == 1:
            if scenario == "spin1":
                while True:
                    time.sleep(0.05)
            if scenario in ("kill", "kill_after"):
                os.kill(os.getpid(), signal.SIGKILL)
            if scenario == "hang":
                time.sleep(3 * collective_timeout)
            if scenario == "timeout":
                while True:
                    pass
            if scenario == "exit":
                sys.exit(4)
        if scenario == "kill":
            t = torch.ones(1)
            dist.all_reduce(t, group=ctx.process_group)
        return x + 1

    @DataflowNode(input_keys=["y"], output_keys=["z"])
    def after(y):
        return y * 2

    timeout = 1.0 if scenario == "timeout" else 0.0
    df = build_dataflow(nodes=[step, after], configs={"step": {"timeout_s": timeout}})
    try:
        df.run({"x": torch.zeros(4)})
    finally:
        (out / f"done_{rank}").write_text(str(os.getpid()))
        if dist.is_initialized() and scenario not in ("kill", "kill_after", "hang"):
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from verl.errors import run_cli
    code = run_cli(main, sys.argv[1:], prog="fault_job")
    sys.stdout.flush()
    sys.stderr.flush()
    # A rank whose peer is gone must not wait in interpreter shutdown for the dead group's threads.
    os._exit(code)
