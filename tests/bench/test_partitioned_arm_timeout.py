"""bench/partitioned.py --arm-timeout: a stalled arm is dumped (stacks, thread states), reported
as an error, and the next arm still runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_arm_past_its_deadline_is_dumped_killed_and_reported(tmp_path):
    # A deadline far shorter than an arm's start-up (~10 s here): it fires while the workers start.
    cmd = [sys.executable, str(ROOT / "bench" / "partitioned.py"), "--etas", "0", "--steps", "1",
           "--arm-timeout", "3", "--work-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    (arm,) = result["arms"]
    assert arm["eta"] == 0 and "stalled: no result within --arm-timeout 3 s" in arm["error"]
    assert "=== stall: controller stacks" in proc.stderr
    assert "run_arm" in proc.stderr  # the controller's own stack names where it waited
