"""walk6 B: a run that logs neither a rollout reward nor held-out accuracy (sft on a file without
``data.eval_path``) ends without matplotlib's "No artists with labels found to put in legend" warning; its
curve.png says what is missing instead."""

from __future__ import annotations

import json
import warnings

from areno.api.pipeline import plot_curve


def _write(run_dir, rows):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_curve_with_nothing_to_plot_warns_nothing(tmp_path):
    _write(tmp_path / "sft", [{"step": 1, "train/policy/loss": 2.5}, {"step": 2, "train/policy/loss": 2.1}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's legend UserWarning would raise here
        out = plot_curve(tmp_path / "sft")
    assert out == tmp_path / "sft" / "curve.png" and out.stat().st_size > 1000


def test_a_curve_with_a_reward_keeps_its_legend(tmp_path):
    _write(tmp_path / "grpo", [{"step": 1, "rollout/reward_mean": 0.2}, {"step": 1, "eval/accuracy": 0.1}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_curve(tmp_path / "grpo").stat().st_size > 1000
