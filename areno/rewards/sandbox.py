"""Reward functions in a pool of worker subprocesses: a timeout that really bounds time, rlimits,
optional network isolation, and every failure scored 0 and counted by name.

Why processes: a synchronous Python function cannot be interrupted from another thread, so an
in-process ``reward.timeout_s`` cannot stop a hung reward (and a segfault or ``os._exit`` in it takes
the whole run down). Here each call goes to an idle worker; when it does not answer within
``timeout_s`` its process group gets SIGKILL and a fresh worker takes its slot.

Workers are started with ``subprocess`` (``python -m areno.rewards._worker``), never forked from the
trainer, so they are safe whatever the parent holds (CUDA contexts, threads) and whatever the
multiprocessing start method is. They import the reward by its dotted path, with the parent's
``sys.path``. Limits of one worker:
- wall clock: ``timeout_s`` per call (kill + replace);
- CPU: RLIMIT_CPU re-armed before every call to ``cpu_s`` more seconds (SIGXCPU kills the worker);
- memory: RLIMIT_AS of ``memory_mb`` (allocations beyond raise MemoryError, scored 0; the worker
  is then replaced, in case the error left it half-initialised);
- network: with ``allow_network=False`` the worker enters a fresh network namespace when the kernel
  allows it, else Python sockets are refused (bypassable: see :mod:`areno.rewards._exec`);
- processes: each worker has its own session, a private temporary working directory and, where the
  kernel allows it, its own PID namespace (the trainer's PID does not exist there, so user code
  cannot signal it; see :mod:`areno.rewards._exec`). A replaced or closed worker's whole tree goes:
  its process group, and with a namespace every process in it (``setsid`` children included);
- a worker dies with its parent (PR_SET_PDEATHSIG), so a ``kill -9`` of the trainer leaves none behind;
- replies are JSON, decoded with a strict shape check (:func:`areno.rewards._protocol.decode_reply`):
  the trainer never unpickles what user code could write. A malformed or oversized reply is a
  ``malformed`` failure (worker replaced); NaN, ±inf and values beyond float32 are ``nonfinite``.

Failures raise :class:`RewardFailure`, whose message names the reward and the fix; the workflows'
``acall_reward`` turns it into reward 0, ``info["reward_error"]`` and a warning (a reward's first
failure in full, later ones once per batch with their count). The counts are in
:meth:`RewardSandbox.metrics` / :func:`reward_metrics` as ``rollout/reward_failures_<kind>``.
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import functools
import math
import numbers
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from areno.errors import RewardImportError
from areno.rewards._protocol import MAX_REPLY_BYTES, MalformedReply, decode_reply

SANDBOX_CWD_PREFIX = "areno-reward-"
"""The name of the temporary working directory each worker runs in begins with this."""
DIR_LOCK = ".areno-pool.lock"
"""In each worker's directory: a file its pool holds an exclusive ``flock`` on for the worker's life
(``_lock_dir``), released by the kernel however the pool's process ends (``_sweep_orphan_dirs``)."""
FAILURE_KINDS = ("timeout", "crash", "error", "memory", "cpu", "malformed", "nonfinite")
"""Named failures, counted as ``rollout/reward_failures_<kind>``."""

STARTUP_TIMEOUT_S = 120.0
"""How long a new worker may take to import the reward module (slow on a loaded machine)."""
FLOAT32_MAX = 3.4028234663852886e38
MAX_TIMEOUT_S = 1e6
"""Largest ``timeout_s`` / ``cpu_s`` (about 11 days): pipe polls overflow far above it."""


def is_finite_reward(value: float) -> bool:
    """Whether a reward can be averaged with the others: finite, and finite once stored as float32
    (the rollout metrics and advantages are float32 tensors; 1e308 becomes inf there)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def as_reward(value: Any) -> float:
    """``value``, a reward function's return, as a float: a number, or a bool as 1.0 / 0.0 (``return
    completion == answer``); a TypeError naming its type and value otherwise (a str, None, a list, a
    tensor), which ``float()`` would turn into a reward silently ("0.5" into 0.5)."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):  # a numpy comparison
        return float(value)
    if not isinstance(value, numbers.Real):  # bool, int, float and numpy's numbers are Real
        raise TypeError(
            f"the reward function returned {type(value).__name__} {value!r:.80}, not a number: return a float"
        )
    return float(value)


REWARD_SCORE_KEY = "score"
"""The key of the reward in a reward function's mapping return (``reward_parts``)."""
MAX_REWARD_EXTRAS = 32
"""The most named figures a reward function may return beside its reward."""


def reward_parts(value: Any) -> tuple[float, dict[str, float]]:
    """A reward function's return as (reward, named figures): a number or a bool is the reward alone; a
    mapping holds the reward under ``"score"`` and figures to log beside it (verl's convention: ``{"score": 1.0,
    "format": 1.0, "correct": 0.0}``), each a finite number. Anything else is a TypeError naming it."""
    if not isinstance(value, Mapping):
        return as_reward(value), {}
    if REWARD_SCORE_KEY not in value:
        raise TypeError(
            f"the reward function returned a mapping without a {REWARD_SCORE_KEY!r} key (keys {sorted(map(str, value))[:8]}): "
            f"return {{{REWARD_SCORE_KEY!r}: reward, 'name': figure, ...}}"
        )
    extras = {}
    for key, figure in value.items():
        if key == REWARD_SCORE_KEY:
            continue
        if not isinstance(key, str) or not key.isidentifier():
            raise TypeError(f"the reward function's figure name {key!r} must be a string of letters, digits and _")
        try:
            extras[key] = as_reward(figure)
        except TypeError as exc:
            raise TypeError(f"{exc} (its figure {key!r})") from None
        if not is_finite_reward(extras[key]):
            raise ValueError(f"the reward function's figure {key!r} is {figure!r}; it must be a finite number")
    if len(extras) > MAX_REWARD_EXTRAS:
        raise ValueError(
            f"the reward function returned {len(extras)} figures beside its score; at most {MAX_REWARD_EXTRAS}"
        )
    return as_reward(value[REWARD_SCORE_KEY]), extras


class RewardFailure(RuntimeError):
    """A sandboxed reward call failed (``kind`` in FAILURE_KINDS); the reward is scored 0."""

    def __init__(self, kind: str, message: str) -> None:
        assert kind in FAILURE_KINDS, kind
        super().__init__(message)
        self.kind = kind


def _child_env() -> dict[str, str]:
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # the worker runs in a temporary directory: the trainer's working directory goes on its path,
    # so a reward module there imports the same way (file paths arrive already made absolute)
    paths = [package_root] + [os.getcwd() if p == "" else p for p in sys.path] + [os.getcwd()]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class _Worker:
    """One worker process and its two pipe ends; restarted in place after a failure."""

    def __init__(self, init: tuple, starter: ThreadPoolExecutor) -> None:
        self._init = init
        self._starter = starter
        self.proc: subprocess.Popen | None = None
        self.isolation: dict[str, str] = {}
        self._cwd: str | None = None
        self._lock_fd: int | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._ready = False

    def start(self) -> None:
        # PR_SET_PDEATHSIG fires when the *thread* that started a worker exits: start them all from
        # one thread that lives as long as the pool, whichever thread asked
        self._starter.submit(self._popen).result()

    def _popen(self) -> None:
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        self._cwd = tempfile.mkdtemp(prefix=SANDBOX_CWD_PREFIX)
        self._lock_fd = _lock_dir(self._cwd)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areno.rewards._worker", str(req_r), str(resp_w)],
                pass_fds=(req_r, resp_w),
                start_new_session=True,
                cwd=self._cwd,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(req_r)
            os.close(resp_w)
        self._requests = Connection(req_w, readable=False)
        self._replies = Connection(resp_r, writable=False)
        self._requests.send(self._init)
        self._ready = False

    def ensure_ready(self) -> None:
        if self.proc is None:
            self.start()
        if self._ready:
            return
        if not self._replies.poll(STARTUP_TIMEOUT_S):
            self.stop()
            raise RewardFailure(
                "crash",
                f"reward worker for {self._init[0]} did not start within "
                f"{STARTUP_TIMEOUT_S:.0f} s: check that its module imports quickly",
            )
        try:
            status, payload = self._recv()
        except (EOFError, OSError, MalformedReply):
            code = self.stop()
            raise RewardFailure(
                "crash",
                f"reward worker for {self._init[0]} died while starting "
                f"({_describe_exit(code)}): run `python -c 'import ...'` on its module",
            ) from None
        if status == "fatal":
            self.stop()
            raise RewardFailure("crash", f"reward worker could not load {payload}")
        if status != "ready":  # the reward module wrote to the reply pipe while importing
            self.stop()
            raise RewardFailure("malformed", f"reward worker for {self._init[0]} sent {status!r} while starting")
        self.isolation, self._ready = payload, True

    def _recv(self) -> tuple[str, Any]:
        """One decoded reply; EOFError when the worker died, MalformedReply when it is not data of
        the protocol's shapes (``recv_bytes`` refuses a frame over MAX_REPLY_BYTES before reading it)."""
        try:
            data = self._replies.recv_bytes(MAX_REPLY_BYTES)
        except OSError as exc:
            if exc.args == ("bad message length",):
                raise MalformedReply(f"a reply frame longer than {MAX_REPLY_BYTES} bytes") from None
            raise
        reply = decode_reply(data)
        if reply[0] == "error":
            return "error", (reply[1], reply[2])
        return reply[0], reply[1]

    def call(self, args: tuple, timeout_s: float) -> tuple[str, Any]:
        """``("ok", value)``, ``("error", (kind, message))``, ``("timeout", None)``,
        ``("died", exit description)``, ``("malformed", what)`` or ``("gone", None)`` when the idle
        worker had already died."""
        # an idle worker writes nothing, so a readable reply pipe is its end closed: gone (the request
        # pipe may still take a send while the rest of its killed tree exits)
        if self._replies.poll(0):
            return "gone", None
        try:
            self._requests.send(args)
        except (BrokenPipeError, OSError):
            return "gone", None
        if not self._replies.poll(timeout_s):
            return "timeout", None
        try:
            status, payload = self._recv()
        except (EOFError, OSError):
            return "died", self.stop(grace_s=2.0)
        except MalformedReply as exc:
            return "malformed", str(exc)
        if status not in ("ok", "error"):  # a startup reply in mid-call: written by the reward itself
            return "malformed", f"unexpected {status!r} reply"
        return status, payload

    def stop(self, grace_s: float = 0.0) -> int | None:
        """Kill the worker's whole tree and reap it; the exit code. The process group goes at once;
        with a PID namespace its init dies with the killed leader (PR_SET_PDEATHSIG) and takes every
        process of the namespace with it, those that left the group by ``setsid`` included.
        ``grace_s``: how long a worker that already died may take to exit before the kill."""
        if self.proc is None:
            return None
        proc, self.proc, self._ready = self.proc, None, False
        for conn in (self._requests, self._replies):
            conn.close()
        if grace_s:  # a worker that died: let the waiters outside its namespace report how
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # a dead leader is a zombie until reaped: its exit code survives the kill
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = proc.wait()
        shutil.rmtree(self._cwd, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        return code


def _lock_dir(path: str) -> int | None:
    """An exclusive ``flock`` on ``path``'s ``DIR_LOCK``, taken before the file gets its name (a sweep
    never sees it unlocked); the descriptor, or None where the file system has no flock."""
    staging = os.path.join(path, DIR_LOCK + ".new")
    fd = os.open(staging, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(staging, os.path.join(path, DIR_LOCK))
    except OSError:
        os.close(fd)
        return None
    return fd


@functools.cache
def _sweep_orphan_dirs() -> int:
    """Remove the workers' directories no live pool holds (a trainer killed with SIGKILL cannot remove
    its own; its workers die with it), once per process; how many went. A directory counts as orphaned
    only when its ``DIR_LOCK`` can be locked: held by a live pool on this host or another PID namespace
    sharing the directory, missing, or on a file system without flock, it stays."""
    removed = 0
    for path in Path(tempfile.gettempdir()).glob(f"{SANDBOX_CWD_PREFIX}*"):
        try:
            fd = os.open(path / DIR_LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed += not path.exists()
        finally:
            os.close(fd)
    return removed


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "unknown exit"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class RewardSandbox:
    """A pool of ``workers`` reward processes for the reward at ``fn_path``.

    ``await sandbox(prompt, completion, answer, **fields)`` (the RewardFn signature) or the blocking
    ``sandbox.score(...)`` returns the float reward or raises :class:`RewardFailure`. Workers start
    on the first call and are reused; any number of threads and event loops may call at once.
    """

    def __init__(
        self,
        fn_path: str,
        *,
        workers: int = 4,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        cpu_s: float | None = None,
        allow_network: bool = True,
    ) -> None:
        if workers < 1:
            raise ValueError(f"reward.workers must be >= 1, got {workers}")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"reward.timeout_s must be > 0 and <= {MAX_TIMEOUT_S:g}, got {timeout_s}")
        self.fn_path = fn_path
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.cpu_s = timeout_s if cpu_s is None else cpu_s
        self.allow_network = allow_network
        init = (fn_path, memory_mb, self.cpu_s, allow_network)
        _sweep_orphan_dirs()
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="areno-reward-start")
        self._slots: list[_Worker] = [_Worker(init, self._starter) for _ in range(workers)]
        # LIFO: the warmest worker serves next, so a pool only starts as many workers as calls overlap
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        for slot in self._slots:
            self._idle.put(slot)
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="areno-reward")
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._busy_s = 0.0
        self._closed = False

    # ------------------------------------------------------------------------------ calling
    async def __call__(
        self, prompt: str, completion: str, answer: Any = None, **fields: Any
    ) -> float | dict[str, float]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, lambda: self.score(prompt, completion, answer, **fields))

    def score(self, prompt: str, completion: str, answer: Any = None, **fields: Any) -> float | dict[str, float]:
        """The reward, computed in a worker (a mapping with its ``"score"`` where the function returned named
        figures beside it: ``reward_parts``); raises RewardFailure (counted) when the call fails."""
        if self._closed:
            raise RuntimeError(f"reward sandbox for {self.fn_path} is closed")
        worker = self._idle.get()
        t0 = time.perf_counter()
        try:
            status, payload = self._call(worker, (prompt, completion, answer, fields))
            score = payload[REWARD_SCORE_KEY] if status == "ok" and isinstance(payload, dict) else payload
            if status == "ok" and not is_finite_reward(score):
                failure = RewardFailure(
                    "nonfinite",
                    f"reward {self.fn_path} returned {score!r} (non-finite, or beyond float32): scored 0; "
                    f"make the reward function return a finite float",
                )
            else:
                failure = None if status == "ok" else self._failure(worker, status, payload)
        except RewardFailure as exc:  # the worker could not start
            failure = exc
        finally:  # back to the pool only once a failed worker has been stopped (it restarts lazily)
            self._idle.put(worker)
        self._count(None if failure is None else failure.kind, time.perf_counter() - t0)
        if failure is not None:
            raise failure
        return payload

    def _call(self, worker: _Worker, args: tuple) -> tuple[str, Any]:
        worker.ensure_ready()
        status, payload = worker.call(args, self.timeout_s)
        if status == "gone":  # died while idle (killed from outside): not this call's fault, retry once
            worker.stop()
            self._count_restart()
            worker.ensure_ready()
            status, payload = worker.call(args, self.timeout_s)
        return status, payload

    def _failure(self, worker: _Worker, status: str, payload: Any) -> RewardFailure:
        name = f"reward {self.fn_path}"
        if status == "timeout":
            worker.stop()
            self._count_restart()
            return RewardFailure(
                "timeout",
                f"{name} did not return within reward.timeout_s={self.timeout_s:g} s "
                f"(worker killed and replaced): make it faster or raise reward.timeout_s",
            )
        if status in ("died", "gone"):
            self._count_restart()
            if payload == -signal.SIGXCPU:
                return RewardFailure(
                    "cpu",
                    f"{name} used more than {self.cpu_s:g} CPU-seconds (SIGXCPU; worker "
                    f"replaced): make it cheaper or raise reward.cpu_s",
                )
            return RewardFailure(
                "crash",
                f"{name} crashed the reward worker ({_describe_exit(payload)}; replaced): "
                f"fix the native code or exit call in the reward function",
            )
        if status == "malformed":
            worker.stop()  # the reply pipe may hold more of whatever the reward wrote: start clean
            self._count_restart()
            return RewardFailure(
                "malformed",
                f"{name} wrote a malformed reply to the sandbox ({payload}; worker replaced): "
                f"do not write to the worker's file descriptors",
            )
        kind, message = payload
        if kind == "memory":
            worker.stop()  # a MemoryError can leave module state half-built: start clean
            self._count_restart()
            return RewardFailure(
                "memory",
                f"{name} exceeded reward.memory_mb={self.memory_mb} ({message}): "
                f"reduce its memory use or raise reward.memory_mb",
            )
        return RewardFailure("error", f"{name} raised {message}: fix the reward function")

    def _count(self, kind: str | None, elapsed: float) -> None:
        with self._lock:
            self._counts["calls"] += 1
            self._busy_s += elapsed
            if kind is not None:
                self._counts[f"failures_{kind}"] += 1

    def _count_restart(self) -> None:
        with self._lock:
            self._counts["worker_restarts"] += 1

    # ------------------------------------------------------------------------------ state
    @property
    def network_isolation(self) -> str:
        """How started workers are cut off the network: none, netns or socket-patch."""
        return next(
            (w.isolation["network"] for w in self._slots if w.isolation),
            "none" if self.allow_network else "unknown",
        )

    @property
    def process_isolation(self) -> str:
        """How started workers are kept from other processes: pidns (own PID namespace and /proc),
        pidns-hostproc (own PID namespace, the host's /proc) or session (own session only: they can
        signal the trainer); unknown before a worker started."""
        return next((w.isolation["pid"] for w in self._slots if w.isolation), "unknown")

    def metrics(self) -> dict[str, float]:
        """Cumulative ``rollout/reward_calls``, ``rollout/reward_failures_<kind>``, ``rollout/reward_worker_restarts`` and
        ``rollout/reward_call_time_mean_s``."""
        with self._lock:
            counts, busy = dict(self._counts), self._busy_s
        out = {"rollout/reward_calls": float(counts.get("calls", 0))}
        for kind in FAILURE_KINDS:
            out[f"rollout/reward_failures_{kind}"] = float(counts.get(f"failures_{kind}", 0))
        out["rollout/reward_worker_restarts"] = float(counts.get("worker_restarts", 0))
        out["rollout/reward_call_time_mean_s"] = busy / max(counts.get("calls", 0), 1)
        return out

    # ------------------------------------------------------------------------------ start-up
    def start_early(self) -> None:
        """Start one worker now, so that it imports the reward while the caller loads its models;
        ``check_started`` then waits for it."""
        if self._closed:
            return
        worker = self._idle.get()
        try:
            if worker.proc is None:
                worker.start()
        finally:
            self._idle.put(worker)

    def check_started(self) -> None:
        """Wait until a worker has imported the reward: a one-line RewardImportError when none can.
        What imports in the caller's process may not in a worker's (its private working directory,
        PYTHONPATH set elsewhere), and would otherwise score every call 0 from the first step on."""
        worker = self._idle.get()
        try:
            worker.ensure_ready()
        except RewardFailure as exc:
            raise RewardImportError(
                f"reward.fn={self.fn_path}: the reward sandbox's worker cannot start: {exc} "
                "(reward.sandbox=false scores it in the trainer's process instead)"
            ) from None
        finally:
            self._idle.put(worker)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._slots if w.proc is not None]

    def close(self) -> None:
        """Stop every worker (idempotent). Calls in flight finish first."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        for slot in self._slots:
            slot.stop()
        self._starter.shutdown(wait=True)

    def __enter__(self) -> RewardSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------- shared pools
_POOLS: dict[tuple, RewardSandbox] = {}
_USERS: dict[int, int] = {}  # id(pool) -> holders that have not released it
_POOLS_LOCK = threading.Lock()


def shared_sandbox(fn_path: str, **settings: Any) -> RewardSandbox:
    """The process-wide pool for ``fn_path`` with these settings (created on first use), so the
    rollout workflows and evaluation share workers instead of starting a pool each. Each call
    counts one holder; ``release_shared`` gives it back and the last holder's release closes it."""
    key = (fn_path, tuple(sorted(settings.items())))
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool._closed:
            pool = _POOLS[key] = RewardSandbox(fn_path, **settings)
        _USERS[id(pool)] = _USERS.get(id(pool), 0) + 1
        return pool


def release_shared(pool: RewardSandbox) -> None:
    """One holder is done with ``pool`` (from ``shared_sandbox``); the last one closes it, so a run
    that ends never stops the workers another run in this process still scores with."""
    with _POOLS_LOCK:
        left = _USERS.get(id(pool), 1) - 1
        if left > 0:
            _USERS[id(pool)] = left
            return
        _USERS.pop(id(pool), None)
        for key, held in list(_POOLS.items()):
            if held is pool:
                del _POOLS[key]
    pool.close()


def reward_metrics() -> dict[str, float]:
    """The ``rollout/reward_*`` counters summed over every shared pool (empty when no reward is sandboxed)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    return pools_metrics(pools) if pools else {}


def pools_metrics(pools: list[RewardSandbox]) -> dict[str, float]:
    """The ``rollout/reward_*`` counters summed over ``pools`` (at least one), the mean call time
    weighted by each pool's calls."""
    per_pool = [p.metrics() for p in pools]
    out = {k: sum(m[k] for m in per_pool) for k in per_pool[0] if k != "rollout/reward_call_time_mean_s"}
    busy = sum(m["rollout/reward_call_time_mean_s"] * m["rollout/reward_calls"] for m in per_pool)
    out["rollout/reward_call_time_mean_s"] = busy / max(out["rollout/reward_calls"], 1.0)
    return out


def close_all() -> None:
    """Stop every shared pool (also run at interpreter exit)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
        _USERS.clear()
    for pool in pools:
        pool.close()


atexit.register(close_all)
