"""Start-up time: the first generated token of a process is logged once, with its age, and reaches the
first step's metrics as ``system/startup_to_first_token_s``."""

from __future__ import annotations

import json
import logging

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.observe import startup
from tests.helpers.configs import tiny_grpo_overrides


def test_process_age_is_positive_and_grows():
    first = startup.process_age_s()
    assert first is not None and 0 < first <= startup.process_age_s()


def test_first_token_reaches_the_first_step_metrics(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(startup, "_first_token_s", None)  # as in a fresh process
    cfg = load_config(
        None,
        [*tiny_grpo_overrides(tmp_path), "reward.sandbox=false", "train.steps=2", "train.eval_interval=0"],
    )
    with caplog.at_level(logging.INFO, logger="areno.observe.startup"):
        trainer = Trainer.init(cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert 0 < steps[0]["system/startup_to_first_token_s"] <= startup.process_age_s()
    assert all("system/startup_to_first_token_s" not in r for r in steps[1:])  # once per process
    lines = [r.getMessage() for r in caplog.records if "first generated token" in r.getMessage()]
    assert len(lines) == 1 and "after the process started" in lines[0]
