"""bench/partitioned.py --arm-timeout: a stalled arm is dumped (stacks, thread states), reported
as an error, and the next arm still runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.partitioned import paired_summary, partitioned_headline

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # over 10 s: the default suite keeps within its 10 minutes
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_arm_past_its_deadline_is_dumped_killed_and_reported(tmp_path):
    # A deadline far shorter than an arm's start-up (~10 s here): it fires while the workers start.
    # 1000 steps: the arm cannot finish on any machine before the workers are killed (after the dump).
    cmd = [
        sys.executable,
        "-m",
        "bench.partitioned",
        "--etas",
        "0",
        "--steps",
        "1000",
        "--arm-timeout",
        "3",
        "--work-dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    (arm,) = result["arms"]
    assert arm["eta"] == 0 and "stalled: no result within --arm-timeout 3 s" in arm["error"]
    assert result["bench"] == "partitioned" and result["figure"] is None and result["ratio"] is None
    assert "=== stall: controller stacks" in proc.stderr
    assert "run_arm" in proc.stderr  # the controller's own stack names where it waited


def test_paired_summary_ratios_within_each_repeat():
    arms = [
        {"eta": 0, "repeat": 0, "trained_tokens_per_s": 100.0},
        {"eta": 4, "repeat": 0, "trained_tokens_per_s": 250.0},
        {"eta": 0, "repeat": 1, "trained_tokens_per_s": 200.0},
        {"eta": 4, "repeat": 1, "trained_tokens_per_s": 300.0},
        {"eta": 0, "repeat": 2, "error": "stalled"},
        {"eta": 4, "repeat": 2, "trained_tokens_per_s": 400.0},
    ]
    s = paired_summary(arms, [0, 4])
    assert s["0"]["trained_tokens_per_s"] == [100.0, 200.0] and s["0"]["trained_tokens_per_s_median"] == 150.0
    assert s["0"]["ratio_to_eta0"] == [1.0, 1.0]
    # repeat 2 has no eta 0 arm: its eta 4 rate counts, but gives no ratio
    assert s["4"]["trained_tokens_per_s"] == [250.0, 300.0, 400.0] and s["4"]["trained_tokens_per_s_median"] == 300.0
    assert s["4"]["ratio_to_eta0"] == [2.5, 1.5] and s["4"]["ratio_to_eta0_median"] == 2.0
    head = partitioned_headline(s, [0, 4])
    assert head["figure"] == 300.0 and head["baseline"] == 150.0 and head["ratio"] == 2.0
