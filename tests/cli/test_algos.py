"""`verl algos` lists every registered name a config accepts."""

import json

from verl.algos.advantages import ADVANTAGES
from verl.algos.policy_losses import POLICY_LOSS_FNS
from verl.cli.main import main


def test_algos_json_lists_every_registered_name(capsys):
    assert main(["algos", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key, registry in (("actor.policy_loss", POLICY_LOSS_FNS), ("algorithm.adv_estimator", ADVANTAGES)):
        listed = sorted(n for rec in data[key] for n in rec["names"])
        assert listed == registry.names()
    gmpo = next(rec for rec in data["actor.policy_loss"] if "gmpo" in rec["names"])
    assert gmpo["names"] == ["geo_mean", "gmpo"] and gmpo["summary"].startswith("GMPO")
    assert "token-sum" in data["actor.loss_agg_mode"]
    assert "bypass" in data["algorithm.rollout_correction"]


def test_algos_text_names_how_each_loss_is_computed(capsys):
    assert main(["algos"]) == 0
    out = capsys.readouterr().out
    assert "ppo (= vanilla)" in out and "fused kernel" in out and "plain PyTorch" in out
    assert "i.e. the policy gradient" in out  # an abbreviation does not cut the summary short
