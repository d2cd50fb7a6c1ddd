"""``areno demo`` keeps everything in its run directory, wherever it is set, and says where."""

from __future__ import annotations

from pathlib import Path

import pytest

from areno.api import pipeline


@pytest.fixture
def captured(monkeypatch):
    seen = {}

    def fake_pipeline(config):
        seen["config"] = config
        return {"accuracy_before": 0.1, "accuracy_after": 0.25}

    monkeypatch.setattr(pipeline, "run_pipeline", fake_pipeline)
    return seen


@pytest.mark.parametrize("how", ["argument", "override"])
def test_demo_puts_its_initial_model_in_the_run_dir(tmp_path, captured, capsys, how):
    run_dir = tmp_path / "elsewhere"
    if how == "argument":
        pipeline.run_demo(run_dir=str(run_dir))
    else:  # `areno demo run_dir=...`: the override wins over the --run-dir default
        pipeline.run_demo(overrides=[f"run_dir={run_dir}"])
    config = captured["config"]
    assert Path(config.run_dir) == run_dir
    assert Path(config.model.path) == run_dir / "init_model"
    assert f"curve: {run_dir / 'curve.png'}" in capsys.readouterr().out


def test_demo_keeps_an_explicit_model_path(tmp_path, captured, capsys):
    pipeline.run_demo(run_dir=str(tmp_path / "run"), overrides=[f"model.path={tmp_path / 'mine'}"])
    assert Path(captured["config"].model.path) == tmp_path / "mine"
    out = capsys.readouterr().out
    assert "held-out accuracy 10.0% -> 25.0% (+15.0 points)" in out


def test_the_demo_line_names_the_recipe_it_ran(tmp_path, captured, capsys):
    """``areno demo train.algorithm=dapo`` said "after 120 GRPO steps"."""
    pipeline.run_demo(run_dir=str(tmp_path / "run"), overrides=["train.algorithm=dapo"])
    assert "after 120 dapo steps" in capsys.readouterr().out
    pipeline.run_demo(run_dir=str(tmp_path / "run2"))
    assert "after 120 grpo steps" in capsys.readouterr().out


def test_a_demo_with_a_reward_list_says_mean_reward_not_accuracy(tmp_path, monkeypatch, capsys):
    """With ``reward.fn`` a list, eval/accuracy is the weighted sum's mean (1.5 at best with weights 1, 0.5): the
    line says so, and where each function's mean is, instead of a percentage of rows solved."""
    monkeypatch.setattr(pipeline, "run_pipeline", lambda config: {"accuracy_before": 0.948, "accuracy_after": 1.2})
    overrides = [
        "reward.fn=[areno.rewards.tasks:exact_match,areno.rewards.tasks:exact_match]",
        "reward.weights=[1,0.5]",
    ]
    pipeline.run_demo(run_dir=str(tmp_path / "run"), overrides=overrides)
    out = capsys.readouterr().out
    assert "held-out mean reward (reward.fn's weighted sum) 0.948 -> 1.200 after 120 grpo steps" in out
    assert "eval/reward/<name>_mean" in out and "accuracy" not in out
