"""A partitioned training rank trains its roles one after another: every role's collectives run over
the one training group, and a PPO critic trained beside its policy interleaved their collectives
differently on each rank (gloo aborted with "Connection reset by peer" or a size mismatch, every run
of ``ppo`` under ``areno:d1+fsdp:d2``)."""

from __future__ import annotations

import json

import pytest

from areno.api.config import load_config
from areno.api.pipeline import run_pipeline
from areno.engine.workers import training_rank_runner
from areno.recipes import get_recipe
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.recipes import RecordingBackend, rl_batch


def test_a_training_ranks_roles_train_one_after_another(tmp_path):
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), "train.algorithm=ppo"])
    log = []
    runner = training_rank_runner(
        get_recipe("ppo"),
        {"policy": RecordingBackend(log, hold_s=0.2), "value": RecordingBackend(log, hold_s=0.2)},
        cfg,
    )
    runner.step(rl_batch())
    assert [e for e, _ in log if e != "forward"] == ["enter", "exit", "enter", "exit"]


@pytest.mark.slow
def test_ppo_on_two_training_ranks_trains(tmp_path):
    overrides = [
        *tiny_run_overrides(tmp_path, num_eval=0),
        "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 2, intermediate_size: 64}",
        "train.algorithm=ppo",
        "train.steps=3",
        "train.eval_interval=0",
        "reward.sandbox=false",
        "cluster.allocation_mode='areno:d1+fsdp:d2'",
    ]
    run_pipeline(load_config(None, overrides))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/value/loss" in r for r in rows) == 3
