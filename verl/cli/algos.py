"""`verl algos`: what can be named in a config — the registered policy losses, advantage estimators and KL
penalties (with their aliases and how each is computed; for policy losses, how they read the actor's
clip_ratio_low / high / c and a fixed aggregation; where one deliberately differs from upstream verl's algorithm of
the same name, how and why), the loss aggregations and the rollout-correction modes.

    verl algos             # everything
    verl algos --json      # the same as one JSON object (for scripts and docs)
"""

from __future__ import annotations

import argparse
import json
import textwrap

from verl.algos.advantages import ADVANTAGES
from verl.algos.kl import KLS
from verl.algos.policy_losses import CLIP_READS, POLICY_LOSS_FNS
from verl.registry import Registry
from verl.ops.losses import AGG_MODES

SECTIONS = (("actor.policy_loss", POLICY_LOSS_FNS), ("algorithm.adv_estimator", ADVANTAGES),
            ("algorithm.kl_penalty / actor.kl_loss_type", KLS))


def registry_listing(registry: Registry) -> list[dict]:
    """One record per registered function: its primary name (the function's own), its aliases and the first
    sentence of its docstring, which says whether a fused kernel or plain PyTorch computes it."""
    by_fn: dict[int, dict] = {}
    for name in registry.names():
        fn = registry.get(name)
        rec = by_fn.setdefault(id(fn), {"names": [], "summary": _first_sentence(fn.__doc__)})
        rec["names"].append(name)
        meta = registry.meta(name)
        for field in ("clip", "agg", "upstream"):
            if getattr(meta, field, None):
                rec[field] = getattr(meta, field)
    return sorted(by_fn.values(), key=lambda r: r["names"][0])


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").split())
    end = text.find(". ")
    while end >= 0 and text[max(0, end - 3):end] in ("i.e", "e.g"):  # abbreviations do not end a sentence
        end = text.find(". ", end + 2)
    return text if end < 0 else text[:end + 1]


def listing() -> dict:
    from verl.config.ppo import RolloutCorrectionConfig
    rc = RolloutCorrectionConfig.__dataclass_fields__
    return {**{key: registry_listing(reg) for key, reg in SECTIONS},
            "actor.loss_agg_mode": list(AGG_MODES),
            "algorithm.rollout_correction": {f: str(rc[f].type) for f in rc}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="verl algos", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    data = listing()
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    for key, _ in SECTIONS:
        print(f"{key} ({len(data[key])}):")
        for rec in data[key]:
            names = rec["names"][0] + (f" (= {', '.join(rec['names'][1:])})" if len(rec["names"]) > 1 else "")
            print(f"  {names}")
            print(textwrap.fill(rec["summary"], width=110, initial_indent="      ", subsequent_indent="      "))
            extra = [CLIP_READS[rec["clip"]]] if "clip" in rec else []
            extra += [f"aggregation: {rec['agg']} (fixed)"] if "agg" in rec else []
            if extra:
                print(f"      [{'; '.join(extra)}]")
            if "upstream" in rec:
                print(textwrap.fill("vs upstream verl: " + rec["upstream"], width=110, initial_indent="      ",
                                    subsequent_indent="        "))
    print(f"actor.loss_agg_mode: {', '.join(data['actor.loss_agg_mode'])}")
    print("algorithm.rollout_correction: " + ", ".join(data["algorithm.rollout_correction"]))
    return 0
