"""Under dynamic sampling the kept groups' reward (``rollout/reward_mean``) varies by construction and does
not rise as the policy learns: the console, the run's curve and the report show ``rollout/scored_reward_mean``
(every scored sample) where it is logged, and the report's reward panel holds a reward's named figures."""

from __future__ import annotations

import io
import json

import pytest

from areno.api.config import load_config
from areno.api.pipeline import plot_curve
from areno.observe import report
from areno.observe.metrics import METRICS_FILENAME, ConsoleSink
from tests.helpers.configs import run_to_end, tiny_run_overrides


def test_the_console_shows_every_samples_reward_where_logged():
    sink = ConsoleSink(total_steps=None, stream=io.StringIO())
    dapo = {"rollout/reward_mean": 0.5, "rollout/scored_reward_mean": 0.125, "rollout/completion_len_mean": 5.0}
    assert sink.summary(dapo, 1)["reward"] == "0.125"
    assert sink.summary({"rollout/reward_mean": 0.5}, 2)["reward"] == "0.5"


def write_run(run_dir, rows):
    run_dir.mkdir()
    (run_dir / METRICS_FILENAME).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_and_the_curve_read_the_scored_reward(tmp_path, monkeypatch):
    rows = [
        {"step": s, "time": float(s), "rollout/reward_mean": 0.5, "rollout/scored_reward_mean": 0.1 * s}
        | {"rollout/reward/format_mean": 1.0}
        for s in (1, 2, 3)
    ]
    write_run(tmp_path / "run", rows)
    run = report.load_run(tmp_path / "run")
    (panel,) = [p for p in report.PANELS if p.title == "Reward"]
    assert panel.select(run.keys()) == [
        "rollout/reward/format_mean",
        "rollout/reward_mean",
        "rollout/scored_reward_mean",
    ]
    summary = report.summarize(run)
    assert summary["first reward"] == pytest.approx(0.1) and summary["last reward"] == pytest.approx(0.3)
    plotted = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **kw: plotted.append(a) or real(ax, *a, **kw))
    plot_curve(tmp_path / "run")
    assert plotted and list(plotted[0][1]) == pytest.approx([0.1, 0.2, 0.3])


def test_the_console_shows_each_functions_mean_beside_a_listed_reward():
    """``reward.fn`` as a list: the step line gives each function's mean after the weighted sum, marked
    ``kept:`` where dynamic sampling shows the scored mean (the parts are the kept groups'); one function's
    figures (no parts given) and a workflow that logs no parts keep the plain reward."""
    sink = ConsoleSink(total_steps=None, stream=io.StringIO(), reward_parts=["accuracy", "format"])
    step = {"rollout/reward_mean": 1.4, "rollout/reward/accuracy_mean": 0.5, "rollout/reward/format_mean": 0.9}
    assert sink.summary(step, 1)["reward"] == "1.4 (accuracy 0.5, format 0.9)"
    scored = {**step, "rollout/scored_reward_mean": 1.2}
    assert sink.summary(scored, 2)["reward"] == "1.2 (kept: accuracy 0.5, format 0.9)"
    assert sink.summary({"rollout/reward_mean": 1.4}, 3)["reward"] == "1.4"
    plain = ConsoleSink(total_steps=None, stream=io.StringIO())
    assert plain.summary(step, 1)["reward"] == "1.4"


def test_a_run_with_a_reward_list_prints_its_functions_on_the_step_line(tmp_path, capsys):
    """End to end: a run with two reward functions prints each one's mean on every step line."""
    overrides = tiny_run_overrides(
        tmp_path, reward="[tests.helpers.rewards:sevens_and_length,tests.helpers.rewards:half]"
    )
    cfg = load_config(None, [*overrides, "observe.console=true", "reward.sandbox=false", "train.steps=2",
                             "train.eval_interval=0", "data.num_eval=0", "reward.weights=[1,2]"])  # fmt: skip
    rows = run_to_end(cfg)
    step_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 2
    for row, line in zip([r for r in rows if "rollout/reward_mean" in r], step_lines, strict=True):
        parts = f"sevens_and_length {row['rollout/reward/sevens_and_length_mean']:.3g}, half 0.5"
        assert f"| reward {row['rollout/reward_mean']:.3g} ({parts}) |" in line, line
