"""SIGTERM or Ctrl-C stops a run after the step in progress with that step's checkpoint saved, so
``resume=auto`` goes on from it; a second signal stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.configs import train_args
from tests.helpers.rewards import HOLD_ENV


def _start(tmp_path: Path, *extra: str, stderr=subprocess.PIPE, env: dict | None = None) -> subprocess.Popen:
    args = train_args(tmp_path, "train.steps=500", "data.num_eval=0", *extra)
    return subprocess.Popen(
        [sys.executable, "-m", "areno", *args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
    )


def _held_start(tmp_path: Path, *extra: str, stderr) -> tuple[subprocess.Popen, Path]:
    """A run whose reward (``tests.helpers.rewards:held``) waits while the returned path exists."""
    hold = tmp_path / "hold"
    env = {**os.environ, HOLD_ENV: str(hold)}
    return _start(
        tmp_path, "reward.fn=tests.helpers.rewards:held", "reward.sandbox=false", *extra, stderr=stderr, env=env
    ), hold


def _hold_a_step(proc: subprocess.Popen, hold: Path) -> None:
    """Hold the run inside a step's rollout: both signals then land in that step, however loaded the machine
    (with a step of ~0.2 s the first signal's step could end, checkpoint and stop before the second came)."""
    hold.touch()
    deadline = time.monotonic() + 60
    while not hold.with_suffix(".waiting").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hold.with_suffix(".waiting").exists(), "the run never reached the held reward"


def _signal_twice(proc: subprocess.Popen, sig: signal.Signals, err: Path, hold: Path | None = None) -> str:
    """``sig``, then again once the run said it heard the first: two signals sent before the handler
    runs arrive as one (the interpreter keeps one pending flag a signal), which a loaded machine showed.
    ``hold``: the held reward's file, removed once the second signal is heard (else the shutdown waits its
    30 s for a rollout loop stuck in that reward)."""
    proc.send_signal(sig)
    deadline = time.monotonic() + 60
    while "stopping after this step" not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(sig)
    if hold is not None:
        while "stopped at once" not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        hold.unlink(missing_ok=True)
    proc.communicate(timeout=120)
    return err.read_text()


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if '"step"' in line) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {steps} steps logged: {proc.poll()=}")


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


@pytest.mark.slow  # over 10 s: the default suite keeps within its 10 minutes
def test_sigterm_saves_the_step_and_resume_goes_on(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = _start(tmp_path)
    _wait_for_steps(proc, metrics, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("areno: stopped by SIGTERM after step ") and "resume=auto" in last, err[-2000:]
    step = int(last.split("after step ")[1].split()[0])
    assert (tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / "COMPLETE").is_file()
    assert _steps(metrics)[-1] == step and not (tmp_path / "run" / "areno.lock").exists()
    # the same command, resumed: the steps after the saved one, each once
    args = train_args(tmp_path, f"train.steps={step + 2}", "data.num_eval=0", "resume=auto")
    done = subprocess.run([sys.executable, "-m", "areno", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _steps(metrics) == list(range(1, step + 3))


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    with (tmp_path / "stderr.txt").open("w") as stderr:
        proc, hold = _held_start(tmp_path, stderr=stderr)
        _wait_for_steps(proc, metrics, 1)
        _hold_a_step(proc, hold)
        err = _signal_twice(proc, signal.SIGINT, tmp_path / "stderr.txt", hold)
    assert proc.returncode == 130, err[-2000:]
    # at once: no checkpoint of the step (an episode cut off in the middle may log a line after it)
    assert "stopping after this step" in err and "areno: interrupted" in err.splitlines(), err[-2000:]
    assert (
        "areno: stopped at once by a second SIGINT, without a checkpoint of the step in progress; the same command "
        "with resume=auto starts over (no checkpoint was saved)"
    ) in err.splitlines(), err[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "areno.lock").exists()


def test_a_second_sigterm_stops_at_once_and_says_where_to_go_on(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    with (tmp_path / "stderr.txt").open("w") as stderr:
        proc, hold = _held_start(tmp_path, "train.save_interval=1", stderr=stderr)
        _wait_for_steps(proc, metrics, 2)  # step 1's checkpoint is written before step 2 is logged
        _hold_a_step(proc, hold)
        err = _signal_twice(proc, signal.SIGTERM, tmp_path / "stderr.txt", hold)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]  # the signal's own end, as before: no cleanup
    last = err.strip().splitlines()[-1]
    newest = sorted((tmp_path / "run" / "checkpoints").glob("step_????????"))[-1]
    assert last == (
        "areno: stopped at once by a second SIGTERM, without a checkpoint of the step in progress; the same "
        f"command with resume=auto goes on from {newest}"
    ), err[-2000:]


def test_a_stopped_warm_start_says_it_starts_over(tmp_path):
    metrics = tmp_path / "run" / "warm_start" / "metrics.jsonl"
    proc = _start(tmp_path, "warm_start.steps=500", "warm_start.batch_size=4")
    _wait_for_steps(proc, metrics, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "warm_start; this stage starts over when the run is started again" in last, last
    assert not (tmp_path / "run" / "warm_start" / "checkpoints").exists()  # nothing saved that would be discarded
    assert not (tmp_path / "run" / "areno.lock").exists()


def test_a_signal_in_the_warm_starts_last_step_keeps_it_and_starts_no_main_stage(tmp_path):
    """The warm start's last step evaluates it (the first reward call, which signals): the warm start is
    finished and kept, the main stage does not start."""
    args = train_args(
        tmp_path, "warm_start.steps=2", "warm_start.batch_size=4", "reward.fn=tests.helpers.rewards:sigterm_once",
        "reward.sandbox=false",
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "areno", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "at the end of the warm start" in done.stderr.strip().splitlines()[-1]
    assert (tmp_path / "run" / "warm_start" / "final_model" / "COMPLETE").is_file()
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "areno.lock").exists()


def test_a_signal_during_a_save_stops_after_that_step(tmp_path, monkeypatch):
    """walk31: a first signal that arrived while a step's checkpoint was written was read at the next step's
    end, so one more whole step ran (and was saved) after "stopping after this step"."""
    import os

    from areno.api.config import load_config
    from areno.api.trainer import Trainer
    from areno.errors import RunStopped
    from areno.observe.metrics import read_metrics
    from tests.helpers.configs import tiny_grpo_overrides

    trainer = Trainer.init(
        load_config(None, [*tiny_grpo_overrides(tmp_path), "train.steps=4", "train.save_interval=1"])
    )
    save = trainer.backend.save

    def save_then_signal(path, state):
        save(path, state)
        if path.name == "step_00000002":
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(trainer.backend, "save", save_then_signal)
    try:
        with pytest.raises(RunStopped, match="stopped by SIGINT after step 2 of 4"):
            trainer.run()
    finally:
        trainer.shutdown()
    assert max(r["step"] for r in read_metrics(tmp_path / "run")) == 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
