"""How the translation table (verl.config.verl_dialect) covers upstream verl's config keys.

Reads verl's own flattened trainer configs kept as test data (tests/compat/verl_upstream/_generated_ppo_trainer.yaml
and _generated_ppo_megatron_trainer.yaml, source and commit in their headers) and counts each key's rule:
`map` (onto our keys), `refuse` (with the reason; accepted only at values that have no effect here), `ignore` (no
effect here, with the reason), Hydra's `_target_` class markers, and keys without a rule (dropped: must be 0).
Also translates both YAMLs as they are and counts the refusals (must be 0: verl's defaults all run here).

    python benchmarks/compat/bench_key_coverage.py          # or: verl bench compat

Writes benchmarks/results/verl_key_coverage.json.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
UPSTREAM = ROOT / "tests" / "compat" / "verl_upstream"
YAMLS = {"_generated_ppo_trainer": False, "_generated_ppo_megatron_trainer": True}


def main() -> int:
    from verl.config.verl_dialect import TABLE, _flatten, rule_for, translate
    from verl.utils.results import RunInfo, write_result
    run = RunInfo.start()
    keys: dict[str, object] = {}
    refused_at_defaults = {}
    for name in YAMLS:
        data = yaml.safe_load((UPSTREAM / f"{name}.yaml").read_text())
        keys.update(_flatten(data))
        t = translate(["actor_rollout_ref.rollout.name=vllm"], data, defaults=False)  # '???' upstream
        refused_at_defaults[name] = [e.key for e in t.refused]
    kinds = collections.Counter("_target_ marker" if k.endswith("._target_") else
                                (rule_for(k).kind if rule_for(k) else "dropped") for k in keys)
    settings = len(keys) - kinds["_target_ marker"]
    source = (UPSTREAM / "_generated_ppo_trainer.yaml").read_text().split("\n")[1]
    result = {"keys": len(keys), "settings": settings, "by_rule": dict(kinds),
              "map_or_refuse_share_of_settings": (kinds["map"] + kinds["refuse"]) / settings,
              "with_a_rule_share": (len(keys) - kinds["dropped"]) / len(keys), "dropped": kinds["dropped"],
              "refused_at_verl_defaults": refused_at_defaults, "table_patterns": len(TABLE)}
    meta = {"source": source.lstrip("# "),
            "note": "map: onto our keys (unit conversions included); refuse: stops the job with the reason unless "
                    "the value has no effect here (e.g. verl's default); ignore: no effect here at any value (memory "
                    "and speed knobs of verl's engines, Ray), listed with the reason by `verl compat --keys`."}
    path = ROOT / "benchmarks" / "results" / "verl_key_coverage.json"
    write_result(path, {"result": result}, run, **meta)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0 if kinds["dropped"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
