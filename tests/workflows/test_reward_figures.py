"""A reward function may return named figures beside its reward (verl's convention: ``{"score": r, "format":
1.0, ...}``): the reward is the score, each figure is logged as ``rollout/reward/<name>_mean`` (and
``eval/reward/<name>_mean``), in process and through the reward sandbox; a malformed mapping is a reward error
(scored 0, warned), never a crash."""

from __future__ import annotations

import math

import pytest

from areno.api.config import load_config
from areno.rewards._protocol import MalformedReply, decode_reply
from areno.rewards.sandbox import reward_parts
from tests.helpers.configs import run_to_end, tiny_run_overrides


def test_a_number_is_the_reward_alone_and_a_mapping_holds_figures():
    assert reward_parts(0.5) == (0.5, {})
    assert reward_parts(True) == (1.0, {})
    assert reward_parts({"score": 1, "format": True, "length": 3}) == (1.0, {"format": 1.0, "length": 3.0})


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ({"correct": 1.0}, TypeError, r"a mapping without a 'score' key .*return \{'score': reward"),
        ({"score": 1.0, "fmt": "yes"}, TypeError, r"returned str 'yes', not a number.*its figure 'fmt'"),
        ({"score": 1.0, "fmt": math.nan}, ValueError, r"figure 'fmt' is nan; it must be a finite number"),
        ({"score": 1.0, 3: 1.0}, TypeError, r"figure name 3 must be a string"),
        ({"score": "1"}, TypeError, r"returned str '1', not a number"),
    ],
)
def test_a_malformed_mapping_is_refused_naming_what_is_wrong(value, error, match):
    with pytest.raises(error, match=match):
        reward_parts(value)


def test_the_sandbox_reply_carries_the_figures_and_nothing_else():
    assert decode_reply(b'["ok", 1.0, {"fmt": 1, "len": 2.5}]') == ["ok", {"score": 1.0, "fmt": 1.0, "len": 2.5}]
    for bad in (b'["ok", 1.0, {"fmt": "x"}]', b'["ok", 1.0, {"score": 2}]', b'["ok", 1.0, {}]', b'["ok", 1.0, [1]]'):
        with pytest.raises(MalformedReply):
            decode_reply(bad)


@pytest.mark.parametrize("sandbox", [True, False])
def test_the_figures_are_logged_beside_the_reward(tmp_path, sandbox):
    overrides = [
        *tiny_run_overrides(tmp_path, reward="tests.helpers.rewards:with_figures"),
        f"reward.sandbox={str(sandbox).lower()}",
        "train.eval_interval=2",
        "train.steps=2",
    ]
    rows = run_to_end(load_config(None, overrides))
    steps = [r for r in rows if "rollout/num_seqs" in r]
    for row in steps:
        assert row["rollout/reward_errors"] == 0
        assert row["rollout/reward/double_mean"] == pytest.approx(2 * row["rollout/reward_mean"], rel=1e-6)
        assert 0.0 <= row["rollout/reward/high_mean"] <= 1.0
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and all(r["eval/reward/double_mean"] == pytest.approx(2 * r["eval/accuracy"]) for r in evals)


def test_a_mapping_without_its_score_is_a_reward_error(tmp_path):
    overrides = [
        *tiny_run_overrides(tmp_path, reward="tests.helpers.rewards:bad_figures"),
        "reward.sandbox=false",
        "data.num_eval=0",
        "train.eval_interval=0",
        "train.steps=1",
    ]
    (row,) = [r for r in run_to_end(load_config(None, overrides)) if "rollout/num_seqs" in r]
    assert row["rollout/reward_errors"] == row["rollout/num_seqs"] and row["rollout/reward_mean"] == 0.0
    assert not [k for k in row if k.startswith("rollout/reward/")]


def test_a_reply_the_worker_never_sends_is_malformed_never_an_overflow():
    """walk48: a figure named as no metric key, a NaN figure, and an int past float's range (an OverflowError out
    of the decoder, not a counted failure) came through a reply user code wrote on the pipe."""
    huge = b"1" + b"0" * 400
    for bad in (b'["ok", 1.0, {"a b/": 1}]', b'["ok", 1.0, {"fmt": NaN}]', b'["ok", 1.0, {"fmt": ' + huge + b"}]"):
        with pytest.raises(MalformedReply):
            decode_reply(bad)
    assert decode_reply(b'["ok", ' + huge + b"]") == ["ok", math.inf]  # counted as non-finite by the sandbox
