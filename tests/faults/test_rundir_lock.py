"""One owner per run directory: `areno train` holds ``run_dir/areno.lock`` (PID and host) while it
runs, a second run on the directory stops at once naming the holder, a lock left by a killed run is
taken over with a warning; a run without resume refuses a directory holding another run unless
``overwrite=true``, so metrics.jsonl never holds a step twice."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.api.rundir import LOCK_FILENAME, RunDirLock, check_fresh, set_aside_untrained
from areno.engine.api import prepare_model_dir
from areno.errors import ConfigError
from tests.helpers.resume import overrides, run_areno, start_areno, train_rows


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(run_dir: Path, pid: int, host: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILENAME
    path.write_text(json.dumps({"pid": pid, "host": host}))
    return path


def _cli(args: list[str], capsys) -> tuple[int, list[str]]:
    from areno.cli import main

    rc = main(["train", *args])
    return rc, capsys.readouterr().err.strip().splitlines()


def test_lock_holds_pid_and_host_and_is_released(tmp_path):
    lock = RunDirLock(tmp_path / "run")
    with lock:
        owner = json.loads(lock.path.read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        with RunDirLock(tmp_path / "run"):  # the pipeline and its trainer, in one process
            pass
        assert lock.path.exists()
    assert not lock.path.exists()


def test_live_holder_refuses_in_one_line(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path / "run", holder.pid, socket.gethostname())
        rc, err = _cli([f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'no-model'}"], capsys)
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2 and len(err) == 1, err
    assert f"pid {holder.pid} on {socket.gethostname()}" in err[0] and "in use" in err[0], err


def test_other_hosts_lock_is_never_taken_over(tmp_path):
    _write_lock(tmp_path, _dead_pid(), "some-other-host")
    with pytest.raises(ConfigError, match="pid .* on some-other-host"):
        RunDirLock(tmp_path).acquire()


def test_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = _dead_pid()
    path = _write_lock(tmp_path, dead, socket.gethostname())
    with caplog.at_level(logging.WARNING, logger="areno.api.rundir"), RunDirLock(tmp_path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"pid {dead}" in caplog.text and "no longer alive" in caplog.text


def test_rerun_without_resume_refuses_a_run_dir_holding_a_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    rc, err = _cli([f"run_dir={run_dir}", f"model.path={tmp_path / 'no-model'}", "resume=false"], capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"run_dir {run_dir} already holds a run" in err[0] and "overwrite=true" in err[0], err
    assert not (run_dir / LOCK_FILENAME).exists()  # released on the way out


def test_an_untrained_run_s_files_stay_when_a_later_check_refuses_the_rerun(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "time": 1.0}\n')
    rc, err = _cli([f"run_dir={run_dir}", f"model.path={tmp_path / 'no-model'}", "resume=false"], capsys)
    assert rc == 2 and len(err) == 1 and "no-model" in err[0], err
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]  # nothing renamed by a refused run


def test_a_run_dir_whose_run_trained_no_step_is_reused_and_its_files_kept(tmp_path, caplog):
    """A run that failed after its step-0 evaluation left metrics.jsonl but trained nothing and saved
    no checkpoint: a rerun starts over there, with the old metrics.jsonl and config.yaml set aside
    (numbered when an earlier rerun's are there), never appended to or deleted."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for attempt, kept in enumerate(["untrained", "untrained.1"]):
        (run_dir / "metrics.jsonl").write_text(f'{{"step": 0, "time": 1.0, "eval/accuracy": 0.{attempt}}}\n')
        (run_dir / "config.yaml").write_text(f"attempt: {attempt}\n")
        check_fresh(run_dir, resume=False, overwrite=False)  # passes, and leaves the files where they are
        assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "config.yaml").is_file()
        with caplog.at_level(logging.WARNING, logger="areno.api.rundir"):
            set_aside_untrained(run_dir)  # what the trainer does once every check passed
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists()
        assert json.loads((run_dir / f"metrics.{kept}.jsonl").read_text())["eval/accuracy"] == float(f"0.{attempt}")
        assert (run_dir / f"config.{kept}.yaml").read_text() == f"attempt: {attempt}\n"
        assert f"metrics.{kept}.jsonl" in caplog.text and "trained no step" in caplog.text
    # a trained step, a checkpoint or a line that does not parse: a run, refused as before
    for metrics, checkpoint in [('{"step": 0}\n{"step": 1}\n', False), ('{"step": 0}\n', True), ('{"st', False)]:
        (run_dir / "metrics.jsonl").write_text(metrics)
        if checkpoint:
            (run_dir / "checkpoints" / "step_00000001").mkdir(parents=True)
        with pytest.raises(ConfigError, match="already holds a run"):
            check_fresh(run_dir, resume=False, overwrite=False)
        assert (run_dir / "metrics.jsonl").read_text() == metrics
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


# ------------------------------------------------------------------------------ through `areno train`
@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rundir")
    prepare_model_dir(load_config(None, overrides(tmp, tmp / "unused")))
    return tmp


@pytest.mark.slow
def test_second_run_on_a_run_dir_stops_and_a_killed_runs_lock_is_taken_over(tmp):
    run_dir = tmp / "busy"
    first = start_areno(overrides(tmp, run_dir, steps=100_000, save_interval=0))  # killed long before the end
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():  # it holds the lock and trains
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        second = run_areno(overrides(tmp, run_dir, steps=1))
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"(pid {first.pid} on {socket.gethostname()}" in second.stderr.strip().splitlines()[-1]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (run_dir / LOCK_FILENAME).exists()  # a killed run cannot release it

    third = run_areno(overrides(tmp, run_dir, steps=1))
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"pid {first.pid}" in third.stderr and "no longer alive" in third.stderr
    assert sorted(train_rows(run_dir)) == [1]
    assert not (run_dir / LOCK_FILENAME).exists()


@pytest.mark.slow
def test_overwrite_starts_over_and_logs_every_step_once(tmp):
    run_dir = tmp / "rerun"
    args = overrides(tmp, run_dir, "resume=false", steps=1, save_interval=1)
    assert run_areno(args).returncode == 0
    refused = run_areno(args)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr.strip().splitlines()[-1]
    redone = run_areno([*args, "overwrite=true"])
    assert redone.returncode == 0, redone.stderr[-3000:]
    assert sorted(train_rows(run_dir)) == [1]  # train_rows fails on a step logged twice
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]


@pytest.mark.slow
def test_a_run_killed_before_its_first_step_is_rerun_without_overwrite(tmp):
    """The audit's case: the step-0 evaluation is logged, then the run dies in step 1's rollout."""
    run_dir = tmp / "untrained"
    args = overrides(tmp, run_dir, "resume=false", steps=1, save_interval=1)
    died = run_areno(args, fault="kill:rollout:1")
    assert died.returncode != 0 and not (run_dir / "checkpoints").exists()
    first = (run_dir / "metrics.jsonl").read_text()
    assert [json.loads(line)["step"] for line in first.splitlines()] == [0]
    again = run_areno(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trained no step" in again.stderr
    assert (run_dir / "metrics.untrained.jsonl").read_text() == first  # kept, not appended to
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(0) == 1 and sorted(train_rows(run_dir)) == [1]


def test_a_full_disk_at_the_lock_says_so_and_leaves_no_file(tmp_path, monkeypatch):
    """walk31: a full disk was told to "pick a writable directory" and left areno.lock.<pid>.tmp behind."""
    import errno

    write_text = Path.write_text

    def full(self, *args, **kwargs):
        if self.name.endswith(".tmp"):
            self.touch()  # opened, then the write fails
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ConfigError, match=r"cannot write there \(No space left on device\): free space on its disk"):
        RunDirLock(run_dir).acquire()
    assert list(run_dir.iterdir()) == []
