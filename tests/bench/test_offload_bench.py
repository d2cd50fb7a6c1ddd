"""bench/offload.py: its help, the summary by hand (largest shape that fits per setting), and a tiny CPU run of
both settings (slow: it trains)."""

from __future__ import annotations

import json

import pytest

from bench import offload
from bench._common import HEADLINE_KEYS


def test_help_names_the_module_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        offload.main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m bench.offload")


def test_summary_finds_the_largest_shape_that_fits_per_setting():
    rows = [
        {"shape": "1.5b", "offload": "none", "fits": True, "peak_gpu_gib": 40.0, "step_s_mean": 2.0},
        {"shape": "1.5b", "offload": "sleep", "fits": True, "peak_gpu_gib": 25.0, "step_s_mean": 2.2},
        {"shape": "3b", "offload": "none", "fits": False},
        {"shape": "3b", "offload": "sleep", "fits": True, "peak_gpu_gib": 60.0, "step_s_mean": 4.0},
        {"shape": "7b", "offload": "none", "fits": False},
        {"shape": "7b", "offload": "sleep", "fits": False},
    ]
    head, extra = offload.summarize(rows, ["1.5b", "3b", "7b"], ["none", "sleep"])
    assert (head["figure"], head["baseline"], head["ratio"]) == (25.0, 40.0, 1.6)
    assert extra["step_time_ratio"] == 1.1
    assert extra["largest_fit"] == {"none": "1.5b", "sleep": "3b"}


@pytest.mark.slow
def test_tiny_cpu_run_of_both_settings(tmp_path, capsys):
    argv = ["--shapes", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "1", "--workdir", str(tmp_path)]
    assert offload.main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    assert result["bench"] == "offload" and all(key in result for key in HEADLINE_KEYS)
    rows = {row["offload"]: row for row in result["rows"]}
    assert set(rows) == {"none", "sleep"} and all(row["fits"] for row in rows.values())
    assert rows["sleep"]["offload_medians"]["rollout_offload_freed_training_gib"] > 0
    assert rows["sleep"]["offload_medians"]["train_offload_freed_rollout_gib"] > 0
    assert not rows["none"]["offload_medians"]
    assert result["largest_fit"] == {"none": "tiny", "sleep": "tiny"}
