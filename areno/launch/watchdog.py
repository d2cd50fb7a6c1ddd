"""Deadlines for scheduler calls: a stalled worker is named within the deadline, and restarted
when the topology allows it.

``Scheduler.call`` waits for as long as a worker takes; a worker stuck in a deadlock, a hung
collective or an infinite loop would hang the controller forever. ``call_with_timeout`` makes the
same call with a deadline and raises ``WorkerTimeoutError`` naming every worker that did not answer
(role[index], pid, host, log file). With ``restart=True`` the stalled workers that are alone in
their torch.distributed world are replaced by fresh processes (``Scheduler.restart_worker``); a
worker that shares a world with others cannot be replaced on its own (the process group would have
to be re-formed on every rank), so the error says to restart the run, which resumes from the last
complete checkpoint.

The worker-side stack of a stalled worker: ``kill -USR1 <pid>`` writes it to the worker's log (every
``areno.launch.worker`` process registers ``faulthandler`` at start). ``dump_hang`` gathers a stall's
evidence in one place: the controller's stacks, each worker's thread states and kernel wait channels
(``thread_states``: a thread blocked in the GPU driver cannot run the signal handler), then the
workers' own stacks from the tails of their logs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable
from typing import Any

from areno.launch.scheduler import Scheduler, WorkerError, WorkerHandle

logger = logging.getLogger("areno.launch.watchdog")


class WorkerTimeoutError(WorkerError):
    """Workers did not answer a call within its deadline."""

    def __init__(self, message: str, *, stalled: list[WorkerHandle], restarted: list[WorkerHandle]) -> None:
        super().__init__(message)
        self.stalled = stalled
        """The handles of the workers that did not answer (as they were when called)."""
        self.restarted = restarted
        """The handles of their replacements (empty unless ``restart=True`` allowed it)."""


def _describe(h: WorkerHandle) -> str:
    log = f", log {h.log_path}" if h.log_path else ""
    return f"{h.name} (pid {h.pid} on {h.host}{log})"


def call_with_timeout(
    scheduler: Scheduler,
    role: str,
    target: str | Callable,
    *args: Any,
    timeout_s: float,
    restart: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """``scheduler.call(role, target, *args, **kwargs)`` with a deadline; results in index order.

    Raises:
        WorkerTimeoutError: some workers did not answer within ``timeout_s``; they are named, and
            with ``restart=True`` the ones alone in their distributed world are restarted first.
        WorkerError: a worker raised (as ``Scheduler.call``).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    handles = scheduler.workers(role)
    futures = scheduler.submit(role, target, *args, **kwargs)
    _, pending = concurrent.futures.wait(futures, timeout=timeout_s)
    if not pending:
        return [f.result() for f in futures]
    stalled = [i for i, f in enumerate(futures) if f in pending]
    what = target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))
    names = ", ".join(_describe(handles[i]) for i in stalled)
    logger.error("%s did not return from %s within %gs: stalled", names, what, timeout_s)
    restarted: list[WorkerHandle] = []
    shared = [i for i in stalled if handles[i].world_size > 1]
    if restart:
        for i in stalled:
            if handles[i].world_size == 1:
                restarted.append(scheduler.restart_worker(role, i))
                logger.warning("restarted stalled worker %s as pid %s", handles[i].name, restarted[-1].pid)
    if restart and not shared:
        fix = f"restarted {len(restarted)} worker(s); their state is fresh, so re-initialise them"
    elif restart:
        fix = (
            f"{', '.join(handles[i].name for i in shared)} share a torch.distributed world of "
            f"{handles[shared[0]].world_size} ranks and cannot be restarted alone: restart the run "
            f"(resume=auto continues from the last complete checkpoint)"
        )
    else:
        fix = "see the worker log (kill -USR1 <pid> dumps its stacks there) or pass restart=True"
    raise WorkerTimeoutError(
        f"{names} did not return from {what} within {timeout_s:g}s (stalled); {fix}",
        stalled=[handles[i] for i in stalled],
        restarted=restarted,
    )


# ----------------------------------------------------------------------------- hang diagnosis
def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc``; empty elsewhere): a local scheduler's workers."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(name))
    return sorted(out)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), parents before children (Linux)."""
    out, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in child_pids(p)]
        out.extend(kids)
        frontier = kids
    return out


def process_line(pid: int) -> str:
    """``pid``'s parent, state, kernel wait channel, CPU seconds, resident memory and command line:
    a child stuck on a pipe (``pipe_write``) reads differently from one spinning (CPU seconds grow)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "-"
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError as e:
        return f"pid {pid}: {e.strerror}"
    fields = stat.rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu_s = (int(fields[11]) + int(fields[12])) / tick
    rss_mib = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return (
        f"pid {pid} ppid {fields[1]} state {fields[0]} wchan {wchan} cpu {cpu_s:.1f}s rss {rss_mib:.0f}MiB {cmd[:300]}"
    )


_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in an uninterruptible wait (a driver call, a stuck NFS read)",
    "T": "stopped (SIGSTOP, or a terminal's Ctrl-Z)",
    "t": "stopped by a debugger",
    "Z": "a zombie (exited, not reaped)",
    "X": "dead",
}


def process_state(pid: int) -> str | None:
    """``pid``'s scheduler state in words (``stopped (SIGSTOP, ...)``, ``sleeping``, ...), from ``/proc``
    on Linux; None where it cannot be read (no such process here, another OS)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return _STATES.get(letter, f"state {letter}")


def thread_states(pid: int) -> str:
    """One line per thread of ``pid``: id, name, scheduler state and kernel wait channel (Linux).

    A hung process whose threads sit in ``D`` (uninterruptible, e.g. inside the GPU driver) does not
    run its ``faulthandler`` signal handler, so this is the only view of where it waits."""
    lines = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except FileNotFoundError:
        return f"pid {pid}: no such process"
    except OSError as e:
        return f"pid {pid}: {e.strerror}"
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/stat") as f:
                stat = f.read()
            with open(f"{base}/wchan") as f:
                wchan = f.read().strip() or "-"
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state = stat.rsplit(")", 1)[1].split()[0]
        lines.append(f"pid {pid} tid {tid} {comm!r} state {state} wchan {wchan}")
    return "\n".join(lines)


def dump_hang(
    pids: list[int], *, log_paths: list[str] = (), tail_lines: int = 60, settle_s: float = 3.0, file=None
) -> None:
    """Everything known about a stall, to ``file`` (default stderr): this process's Python stacks,
    each pid's thread states and, where ``py-spy`` is installed, its Python and native stacks (which it
    reads from outside, so also of threads blocked in C), then ``SIGUSR1`` to each (workers that
    registered ``faulthandler`` write their stacks to their logs) and, after ``settle_s``, the tail of
    each log."""
    import shutil
    import signal
    import subprocess
    import sys
    import threading
    import time
    import traceback

    file = file or sys.stderr
    names = {t.ident: t.name for t in threading.enumerate()}
    print("=== stall: controller stacks", file=file, flush=True)
    for ident, frame in sys._current_frames().items():
        print(f"--- thread {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}", file=file, flush=True)
    for pid in pids:
        print(f"=== stall: threads of pid {pid}\n{thread_states(pid)}", file=file, flush=True)
        below = descendants(pid)
        if below:
            print(
                f"=== stall: processes below pid {pid}\n" + "\n".join(process_line(c) for c in below),
                file=file,
                flush=True,
            )
        spy = shutil.which("py-spy")
        if spy:
            try:
                out = subprocess.run(
                    [spy, "dump", "--pid", str(pid), "--native"], capture_output=True, text=True, timeout=30
                )
                text = out.stdout + out.stderr
            except (OSError, subprocess.TimeoutExpired) as e:
                text = f"(py-spy failed: {e})"
            print(f"=== stall: py-spy dump of pid {pid}\n{text}", file=file, flush=True)
        if hasattr(signal, "SIGUSR1"):
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(settle_s)
    below = [c for pid in pids for c in descendants(pid)]
    if below:  # a second look: do the workers' children (compilers, say) still use CPU?
        print(
            f"=== stall: processes below the workers, {settle_s:g} s later\n"
            + "\n".join(process_line(c) for c in below),
            file=file,
            flush=True,
        )
    for path in log_paths:
        try:
            with open(path, errors="replace") as f:
                tail = f.readlines()[-tail_lines:]
        except OSError as e:
            tail = [f"({e.strerror})\n"]
        print(f"=== stall: tail of {path}\n{''.join(tail)}", file=file, flush=True)
