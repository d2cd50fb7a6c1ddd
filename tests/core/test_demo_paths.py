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
