"""A reward that fails on every call stops the run after ``REWARD_FAILED_BATCHES`` such rollout batches,
instead of training on zero rewards; one that fails now and then does not."""

from __future__ import annotations

import json

from areno.cli import main
from areno.engine.api import REWARD_FAILED_BATCHES
from tests.helpers.configs import train_args


def test_a_reward_failing_every_call_stops_the_run(tmp_path, capsys):
    args = train_args(tmp_path, "train.steps=10", "reward.fn=tests.helpers.rewards:exploding", "reward.sandbox=false")
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"areno: error: every reward call of the last {REWARD_FAILED_BATCHES} rollout batches")
    assert "RuntimeError: reward bug" in err[-1] and "fix reward.fn (tests.helpers.rewards:exploding)" in err[-1]
    steps = [json.loads(line).get("step") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == REWARD_FAILED_BATCHES - 1  # the third batch stopped it


def test_a_reward_failing_on_some_rows_trains_on(tmp_path):
    args = train_args(
        tmp_path, "train.steps=4", "reward.fn=tests.helpers.rewards:every_other_raises", "reward.sandbox=false"
    )
    assert main(args) == 0
