"""Rule-based rewards: GSM8K answer extraction and exact match; failing and NaN rewards are clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from verl.errors import VerlConfigError, VerlRuntimeError
from verl.rewards import extract_gsm8k_answer, get_reward, register_reward, score_batch


@pytest.mark.parametrize("text, expected", [
    ("so she has 3 + 4 = 7 apples\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("The answer is $18.", "18"),
    ("first 3 then 42", "42"),
    ("#### -5", "-5"),
    ("no number", None),
    ("total 12.0", "12"),
])
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_gsm8k_and_arithmetic_rewards():
    gsm8k = get_reward("gsm8k")
    assert gsm8k("reasoning... #### 72", "Natalia sold 48/2 = 24 clips...\n#### 72") == 1.0
    assert gsm8k("the answer is 72", "72") == 1.0
    assert gsm8k("#### 71", "72") == 0.0
    arith = get_reward("arithmetic")
    assert arith("32", "32") == 1.0 and arith("3", "32") == 0.0 and arith("", "1") == 0.0


def test_score_batch_errors():
    @register_reward("test_raises")
    def raises(response, gt, prompt):
        raise KeyError("boom")

    @register_reward("test_nan")
    def nan(response, gt, prompt):
        return math.nan

    with pytest.raises(VerlRuntimeError, match=r"reward 'test_raises' raised KeyError.*sample 1") as e:
        score_batch(lambda r, g, p: 1.0 if r == "a" else raises(r, g, p), ["a", "b"], ["1", "2"], ["", ""],
                    name="test_raises")
    assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(VerlRuntimeError, match="returned nan for sample 0"):
        score_batch(get_reward("test_nan"), ["a"], ["1"], [""], name="test_nan")
    out = score_batch(get_reward("arithmetic"), ["4", "5"], ["4", "4"], ["", ""])
    assert torch.equal(out, torch.tensor([1.0, 0.0]))
    with pytest.raises(VerlConfigError, match="did you mean 'gsm8k'"):
        get_reward("gsm8kk")


def test_gsm_symbolic_and_gsm8k_format_rewards():
    pytest.importorskip("reasoning_gym")
    score, fmt = get_reward("gsm_symbolic"), get_reward("gsm8k_format")
    cases = {  # response -> (gsm_symbolic: reasoning-gym's scorer, gsm8k_format)
        "3 + 4 = 7, so 7 * 41 = 287, plus 1 is 288.\n#### 288": (1.0, 1.0),
        "The total is 288.": (1.0, 0.0),                  # no '####': the last number is the answer
        "#### 1,288": (0.01, 1.0),                        # a wrong number: the scorer's 0.01
        "#### 288\nand then more text": (1.0, 0.0),
        "#### 2\nno wait\n#### 288": (1.0, 0.0),          # the last '####' counts; two of them: bad format
        "I do not know.": (0.0, 0.0),
        "#### two hundred": (0.0, 0.0),
    }
    for response, (want_score, want_format) in cases.items():
        assert score(response, "288", []) == want_score, response
        assert fmt(response, "288", []) == want_format, response
    assert score("#### $1,288.", "1288", []) == 1.0


def test_a_raising_reward_names_the_sample_and_its_text_head():
    long_response = "step " * 200
    def picky(response, gt, prompt):
        if response is long_response:
            raise ValueError("cannot parse")
        return 0.0
    with pytest.raises(VerlRuntimeError, match=r"node 'reward'.*reward 'picky' raised ValueError: cannot parse on "
                                               r"sample 2 \(response 'step step .*\.\.\. \(1000 chars\), ground "
                                               r"truth '3'\)") as e:
        score_batch(picky, ["a", "b", long_response], ["1", "2", "3"], ["", "", ""], name="picky")
    assert isinstance(e.value.__cause__, ValueError) and len(str(e.value)) < 400


def test_re_registering_a_reward_name_is_an_error_naming_both():
    def first(response, gt, prompt):
        return 1.0

    def second(response, gt, prompt):
        return 0.0

    register_reward("test_twice")(first)
    register_reward("test_twice")(first)  # the same function again is harmless
    with pytest.raises(VerlConfigError, match=r"reward 'test_twice' is already registered \(by .*first\).*second"):
        register_reward("test_twice")(second)
    assert get_reward("test_twice") is first
