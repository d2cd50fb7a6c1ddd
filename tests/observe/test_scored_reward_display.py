"""Under dynamic sampling the kept groups' reward (``rollout/reward_mean``) varies by construction and does
not rise as the policy learns: the console, the run's curve and the report show ``rollout/scored_reward_mean``
(every scored sample) where it is logged, and the report's reward panel holds a reward's named figures."""

from __future__ import annotations

import io
import json

import pytest

from areno.api.pipeline import plot_curve
from areno.observe import report
from areno.observe.metrics import METRICS_FILENAME, ConsoleSink


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
