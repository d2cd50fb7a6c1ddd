"""One owner per run directory, and no run appended to another one's.

``areno train`` holds ``run_dir/areno.lock`` (a JSON file with its PID and host) while it runs: a
second run on the same directory stops at once, naming the holder. A lock whose PID is no longer
alive on this host (a run killed with SIGKILL) is taken over with a warning. A lock held by another
host cannot be checked and is never taken over: delete it by hand once that run is gone.

A run without ``resume`` refuses a run directory that already holds a run (a trained step in
metrics.jsonl, or checkpoints) unless ``overwrite=true``, which deletes them first. A previous run
that trained no step and saved no checkpoint (it failed after its step-0 evaluation) holds nothing
to resume or append to: its metrics.jsonl and config.yaml are set aside (``metrics.untrained.jsonl``,
``config.untrained.yaml``) and the directory is reused.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from areno.errors import ConfigError
from areno.observe.metrics import METRICS_FILENAME, WANDB_ID_FILENAME
from areno.observe.profile import PROFILE_DIRNAME
from areno.observe.session import SESSIONS_FILENAME
from areno.observe.trace import MERGED_FILENAME, TRACES_DIRNAME

LOCK_FILENAME = "areno.lock"

logger = logging.getLogger(__name__)


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (ticks since boot) where /proc has it: a PID reused by a
    later process has another one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the parenthesised name


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return start is None or _process_start(pid) in (None, start)


class RunDirLock:
    """The exclusive lock of a run directory; re-entrant within one process (the pipeline and its
    trainers take it in turn)."""

    _held: dict[Path, int] = {}  # resolved lock path -> how many times this process holds it
    _created: list[Path]  # the directories acquire() made, deepest first (removed again while empty)

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILENAME
        self._created = []

    def acquire(self) -> RunDirLock:
        key = self.path.resolve()
        if key in self._held:
            self._held[key] += 1
            return self
        self._created = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid())}
        tmp = self.path.with_name(f"{LOCK_FILENAME}.{me['pid']}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(me))
        except OSError as exc:  # a file in the way, no permission, a read-only or virtual file system
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # a full disk leaves it created and empty
            fix = "free space on its disk" if exc.errno == errno.ENOSPC else "pick a writable directory"
            raise ConfigError(
                f"run_dir {self.path.parent}: cannot write there ({exc.strerror or exc}): {fix}"
            ) from None
        try:
            while True:
                try:
                    os.link(tmp, self.path)  # atomic, and the lock file is never seen empty
                    break
                except FileExistsError:
                    self._take_over_if_stale(me["host"])
        finally:
            tmp.unlink()
        self._held[key] = 1
        return self

    def release(self) -> None:
        key = self.path.resolve()
        self._held[key] -= 1
        if self._held[key] == 0:
            del self._held[key]
            self.path.unlink(missing_ok=True)
            for directory in self._created:  # a run that stopped at a config error leaves no run_dir
                if any(directory.iterdir()):
                    break
                directory.rmdir()

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()

    def _take_over_if_stale(self, host: str) -> None:
        """Remove the lock when its holder is a dead process of this host; else a ConfigError."""
        try:
            owner = json.loads(self.path.read_text())
            pid, owner_host = int(owner["pid"]), str(owner["host"])
        except FileNotFoundError:  # released meanwhile: try again
            return
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"run_dir: {self.path} is not a lock areno wrote: delete it if no run uses {self.path.parent}"
            ) from None
        if owner_host != host or _alive(pid, owner.get("start")):
            raise ConfigError(
                f"run_dir {self.path.parent} is in use by another areno run (pid {pid} on {owner_host}, "
                f"lock {self.path}): wait for it to finish or use another run_dir"
            )
        logger.warning("taking over %s: its run (pid %d on %s) is no longer alive", self.path, pid, owner_host)
        self.path.unlink(missing_ok=True)


UNTRAINED = "untrained"
"""The infix of a set-aside untrained run's files: ``metrics.untrained.jsonl``, ``config.untrained.yaml``."""


def _trained_a_step(metrics: Path) -> bool:
    """Whether ``metrics`` logs a step >= 1 (a trained one; step 0 is the evaluation before training).
    A line that does not parse (a torn write) counts as trained: such a run is never reused unasked."""
    with metrics.open(encoding="utf-8") as f:  # stops at the first trained step: a long file is not read whole
        for line in f:
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                return True
            if step > 0:
                return True
    return False


def holds_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` already holds a run: checkpoints, or a trained step in its metrics."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILENAME
    checkpoints = run_dir / "checkpoints"
    return (metrics.is_file() and _trained_a_step(metrics)) or (checkpoints.is_dir() and any(checkpoints.iterdir()))


def set_aside_untrained(run_dir: str | Path) -> list[Path]:
    """Rename an untrained run's metrics.jsonl and config.yaml to ``*.untrained[.N].*`` (N: the
    first number free for both), so that a new run neither appends to them nor loses them. Returns
    the new paths. Called with the run directory locked, after ``check_fresh`` passed."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILENAME
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return []  # no run was there (a config.yaml alone is the new run's to write)
    found = [p for p in (metrics, run_dir / "config.yaml") if p.is_file()]
    suffix, n = UNTRAINED, 1
    while any(p.with_name(f"{p.stem}.{suffix}{p.suffix}").exists() for p in found):  # kept from a rerun before
        suffix, n = f"{UNTRAINED}.{n}", n + 1
    kept = [p.replace(p.with_name(f"{p.stem}.{suffix}{p.suffix}")) for p in found]
    logger.warning(
        "run_dir %s: its previous run trained no step and saved no checkpoint: starting over, its files kept as %s",
        run_dir,
        ", ".join(p.name for p in kept),
    )
    return kept


def check_fresh(run_dir: str | Path, *, resume: bool | str, overwrite: bool) -> None:
    """A run that starts over (``resume=false``) may not append to another one's run directory
    unless told to overwrite it. A previous run that trained no step passes: nothing of it can be
    resumed, and refusing would only make the user delete it by hand; the trainer sets its files
    aside once every check passed (``set_aside_untrained``)."""
    if resume is False and not overwrite and holds_run(run_dir):
        raise ConfigError(
            f"run_dir {run_dir} already holds a run (trained steps in metrics.jsonl, or checkpoints/): resume it "
            "with resume=auto, start over with overwrite=true (deletes them), or use another run_dir"
        )


RUN_PRODUCTS = ("checkpoints", TRACES_DIRNAME, MERGED_FILENAME, SESSIONS_FILENAME, PROFILE_DIRNAME, WANDB_ID_FILENAME)
"""What a run writes to its directory besides metrics.jsonl, config.yaml and what it rewrites whole
(curve.png, tensorboard/, which purges its old steps): ``overwrite=true`` deletes them, since a new
run appends to traces and sessions and would merge the old run's into its own."""


def clear_run(run_dir: str | Path) -> None:
    """Delete a previous run's metrics.jsonl, checkpoints/, traces, sessions, profiles, the configs of its
    resumes (``config.until_step_N.yaml``) and its W&B run id (``overwrite=true``)."""
    run_dir = Path(run_dir)
    found = [p for p in (run_dir / METRICS_FILENAME, *(run_dir / name for name in RUN_PRODUCTS)) if p.exists()]
    found += sorted(run_dir.glob("config.until_step_*.yaml"))
    if not found:
        return
    logger.warning("overwrite=true: deleting the previous run's %s in %s", ", ".join(p.name for p in found), run_dir)
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
