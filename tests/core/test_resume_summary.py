"""A resumed run's summary keeps the held-out accuracy its first process measured before any step."""

from __future__ import annotations

from areno.api.config import load_config
from areno.api.pipeline import run_pipeline
from areno.observe.metrics import read_metrics
from tests.helpers.resume import overrides


def test_a_resumed_run_reports_the_accuracy_before_its_first_step(tmp_path):
    run_dir = tmp_path / "run"
    first = run_pipeline(load_config(None, overrides(tmp_path, run_dir, steps=1, save_interval=1)))
    assert first["accuracy_before"] is not None
    resumed = run_pipeline(load_config(None, overrides(tmp_path, run_dir, steps=2, save_interval=1)))
    assert resumed["accuracy_before"] == first["accuracy_before"]
    at_start = [r for r in read_metrics(run_dir) if r.get("step") == 0 and "eval/accuracy" in r]
    assert len(at_start) == 1  # measured once, by the first process
