"""Context parallelism on GPUs (``bench/context_parallel.py``, one ``torchrun`` per trial): the
Qwen2.5-0.5B shape trains with cp 1 and cp 2 at the same length to the same losses (bf16, flash
varlen or flex attention, compile as configured by default), and the long-context measurement runs.
A tiny-model CPU smoke run of the same bench (gloo) is slow-marked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str, timeout: float = 900) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.context_parallel", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_equal_losses(result: dict, length: int, rel: float) -> None:
    (one,) = [r for r in result["runs"]["1"] if r["length"] == length]
    (two,) = [r for r in result["runs"]["2"] if r["length"] == length]
    assert one["fits"] and two["fits"], (one, two)
    assert two["losses"] == pytest.approx(one["losses"], rel=rel)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cp2_equals_cp1_on_gpus_and_the_long_context_bench_runs():
    # bf16 compute: CP changes summation order inside attention and the all-to-alls' rounding
    result = _bench("--cp", "1", "2", "--lengths", "8192", "--tps-length", "16384", "--steps", "2")
    _check_equal_losses(result, 8192, rel=2e-2)
    assert result["figure"] >= 16384


@pytest.mark.slow
def test_bench_smoke_on_cpu():
    result = _bench("--device", "cpu", "--tiny", "--lengths", "96", "--tps-length", "128", "--steps", "2")
    _check_equal_losses(result, 96, rel=1e-5)  # fp32
    assert result["figure"] == 128
