"""``observe.log_completions`` (TRL's ``log_completions``): each step's first N trajectories, prompt, completion,
reward (and the reward's figures), as JSON lines of run_dir/completions.jsonl."""

from __future__ import annotations

import json

import pytest

from areno.api.config import load_config
from areno.errors import ConfigError
from tests.helpers.configs import run_to_end, tiny_run_overrides


def test_each_steps_first_completions_are_written(tmp_path):
    overrides = [
        *tiny_run_overrides(tmp_path, reward="tests.helpers.rewards:with_figures"),
        "reward.sandbox=false",
        "data.num_eval=0",
        "train.eval_interval=0",
        "train.steps=2",
        "observe.log_completions=3",
    ]
    metrics = [r for r in run_to_end(load_config(None, overrides)) if "rollout/num_seqs" in r]
    lines = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 1, 1, 2, 2, 2]
    for row in lines:
        assert isinstance(row["prompt"], str) and isinstance(row["completion"], str)
        assert row["figures"]["double"] == pytest.approx(2 * row["reward"])
        assert row["finish_reason"] in ("stop", "length")
    assert len(metrics) == 2


def test_off_by_default_and_never_negative(tmp_path):
    run_to_end(
        load_config(None, [*tiny_run_overrides(tmp_path), "reward.sandbox=false", "data.num_eval=0", "train.steps=1"])
    )
    assert not (tmp_path / "run" / "completions.jsonl").exists()
    with pytest.raises(ConfigError, match=r"observe\.log_completions.*must be >= 0, got -1"):
        load_config(None, [*tiny_run_overrides(tmp_path), "observe.log_completions=-1"])
