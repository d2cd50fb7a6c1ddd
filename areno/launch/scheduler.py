"""The Scheduler API: create the workers of each role, call them, restart one, tear down.

A *role* is a set of ``n`` workers, each an instance of one user class (``"pkg.mod:Class"``) in
its own process, with a torch.distributed rendezvous in its environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; ``CUDA_VISIBLE_DEVICES`` from the
role's device list). Roles created together with the same ``world`` key share one rendezvous
(ranks follow creation order), which is how the partitioned topology puts train and rollout
workers in one distributed world.

Calls address a method by name (or a module-level function) with pickled arguments:
``call`` blocks and returns one result per worker in rank order, ``submit`` returns
``concurrent.futures.Future``s, ``acall`` is the coroutine form. Calls to one worker run in
order; calls to different workers run concurrently (so collectives across workers work).

Stopping is bounded: ``shutdown`` asks every worker to stop at once and waits ``STOP_GRACE_S``, then
SIGTERM, then SIGKILL to each worker's process group; ``kill_worker`` kills one that stopped answering.
Local workers never outlive the controller: they are killed when its interpreter exits (even with a
thread blocked on a stalled worker's reply), and each ends itself when the controller's process is gone.

Implementations: ``LocalScheduler`` (subprocesses on this machine, the default),
``RayScheduler`` (``areno.launch.ray_scheduler``) and ``SlurmScheduler``
(``areno.launch.slurm``), which build on this module. Pick one from config with
``areno.launch.factory.scheduler_from_config``.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import difflib
import logging
import math
import os
import pickle
import random
import re
import secrets
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any, Literal, get_origin, get_type_hints

from areno.errors import ConfigError, RunFailure, is_of_type, wrong_type

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "ARENO_RPC_AUTHKEY"
"""Env var holding the hex authkey of the controller's listener (read by ``areno.launch.worker``)."""

__all__ = [
    "LocalScheduler",
    "RoleSpec",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerHandle",
    "free_port",
    "scheduler_config",
]

OPTIONS_KEY = "cluster.scheduler_options"
"""Where the run config holds the ``SchedulerConfig`` fields (``cluster.scheduler`` holds ``type``)."""


class SchedulerError(ConfigError):
    """A launch that cannot proceed for a setting of the user's (bad address, missing tool or package,
    resources the cluster lacks); a worker that dies or never connects is a :class:`WorkerError`."""


class WorkerError(RunFailure):
    """A worker call raised; the message names the worker, the remote traceback is attached."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback
        if remote_traceback:
            self.add_note("remote traceback:\n" + remote_traceback)


class WorkerDiedError(WorkerError):
    """The worker process went away (crash, kill, lost node) before answering."""


@dataclass(kw_only=True)
class RoleSpec:
    """What to start for one role."""

    role: str
    """Role name (``actor``, ``rollout``, ...); unique within a scheduler."""
    worker_cls: str
    """``"package.module:Class"`` instantiated in each worker process."""
    n: int
    """Number of workers."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every worker of the role."""
    args: tuple = ()
    """Positional constructor arguments (pickled)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword constructor arguments (pickled)."""
    devices: list[int] | None = None
    """Logical device indices (within the parent's CUDA_VISIBLE_DEVICES); its length must be a
    multiple of ``n`` and each worker gets a consecutive slice. None leaves devices alone."""
    world: str | None = None
    """Roles with the same key share one torch.distributed world; None gives the role its own."""

    def __post_init__(self) -> None:
        if not self.role or any(c in self.role for c in " /:"):
            raise ValueError(f"role name {self.role!r} must be non-empty without spaces, '/' or ':'")
        if self.n < 1:
            raise ValueError(f"role {self.role!r}: n must be >= 1, got {self.n}")
        if self.devices is not None and (not self.devices or len(self.devices) % self.n):
            raise ValueError(
                f"role {self.role!r}: {len(self.devices)} devices cannot be split over {self.n} workers; "
                f"give a multiple of n"
            )
        self.args = tuple(self.args)

    def worker_devices(self, index: int) -> list[int] | None:
        if self.devices is None:
            return None
        per = len(self.devices) // self.n
        return self.devices[index * per : (index + 1) * per]


@dataclass(frozen=True, kw_only=True)
class WorkerHandle:
    """Where one worker lives."""

    role: str
    index: int
    """Position within its role (0..n-1)."""
    rank: int
    """Rank in its torch.distributed world."""
    world_size: int
    pid: int | None
    host: str
    devices: tuple[int, ...] | None = None
    """Logical device indices of the worker (None when not assigned)."""
    log_path: str | None = None
    """File with the worker's stdout/stderr, when the scheduler keeps one."""

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


_PORT_RANDOM = random.SystemRandom()
LISTEN_PORTS = (20000, 32768)
"""Where ``free_port`` looks first: below Linux's default ephemeral range (ip_local_port_range)."""


def ephemeral_ports() -> tuple[int, int]:
    """This host's range of ports for outgoing connections (Linux's ip_local_port_range; its default
    elsewhere)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port free on this machine right now, outside the range outgoing connections draw from where
    there is one: a port is picked here and bound seconds later by a worker, and any connection the
    machine opens meanwhile could take an ephemeral one (``bind(0)`` hands those out). The usual race
    with other listeners remains."""
    low, high = ephemeral_ports()
    candidates = [p for p in range(*LISTEN_PORTS) if not low <= p <= high]
    # not the global random: a run seeds it with train.seed, and two runs of one seed would pick alike
    for port in _PORT_RANDOM.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def assign_ranks(specs: Sequence[RoleSpec]) -> dict[tuple[str, int], tuple[int, int, str]]:
    """``(role, index) -> (rank, world_size, world_key)``: ranks follow spec order within a world."""
    worlds: dict[str, list[tuple[str, int]]] = {}
    for spec in specs:
        key = spec.world if spec.world is not None else f"role:{spec.role}"
        worlds.setdefault(key, []).extend((spec.role, i) for i in range(spec.n))
    return {member: (rank, len(members), key) for key, members in worlds.items() for rank, member in enumerate(members)}


def python_path_env() -> str:
    """PYTHONPATH for workers: areno's root, then this interpreter's sys.path, then the old value."""
    areno_root = str(Path(__file__).resolve().parents[2])
    parts = [areno_root, *(p for p in sys.path if p), os.environ.get("PYTHONPATH", "")]
    seen: list[str] = []
    for p in parts:
        for q in p.split(os.pathsep):
            if q and q not in seen:
                seen.append(q)
    return os.pathsep.join(seen)


SLOW_CALL_WARN_S = float(os.environ.get("ARENO_SLOW_CALL_WARN_S", "300"))
"""A blocking ``Scheduler.call`` still waiting after this many seconds logs a warning naming the
workers it waits for and how to see where they are (again after 2x, 4x, ... as long as it waits);
0 turns the warning off. Env ``ARENO_SLOW_CALL_WARN_S``."""


STOP_GRACE_S = 10.0
"""How long ``shutdown`` waits for the workers to take their ``stop`` message (all at once), and then
for their processes to end after SIGTERM, before it kills what is left (SIGKILL to each worker's
process group): a stalled or stopped worker never holds the controller's exit for longer."""


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


WORKER_MAIN = "import sys; from areno.launch.worker import main; sys.exit(main())"
"""The ``python -c`` program of a worker process (``worker_command``)."""


def worker_command(*args: str, python: str | None = None) -> list[str]:
    """The command line of a scheduler worker process: ``areno.launch.worker``'s ``main`` with ``args``.

    Not ``python -m areno.launch.worker``: the package ``areno.launch`` imports that module (its Ray
    scheduler uses ``WorkerRuntime``), so runpy would execute it a second time as ``__main__`` and
    warn (``RuntimeWarning: 'areno.launch.worker' found in sys.modules``) at the top of every log."""
    return [python or sys.executable, "-c", WORKER_MAIN, *args]


RUN_DIR_ENV = "ARENO_RUN_DIR"
"""Env var naming the run directory a worker serves (written in its log's header line)."""
PARENT_PID_ENV = "ARENO_PARENT_PID"
"""Env var holding the controller's pid: a local worker ends itself when that process is gone."""

_LIVE_PROCS: dict[int, subprocess.Popen] = {}
"""Every local worker process started and not yet reaped (pid -> process), for ``kill_local_workers``."""
_EXIT_HOOK_SET = False


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process group of ``proc`` (a worker started in a session of its own: its pid is
    the group's id, so the worker's own children get it too)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    except OSError:  # not a group leader after all (or not ours): the process alone
        try:
            proc.send_signal(sig)
        except OSError:
            pass


def kill_local_workers(sig: int = signal.SIGKILL) -> list[int]:
    """``sig`` to the process group of every local worker still running; their pids. Takes no lock
    and only sends signals, so a signal handler may call it (the second SIGTERM does, before the
    controller dies: ``areno.api.trainer.StopSignals``), as does the interpreter's exit (a controller
    leaving without ``shutdown``: the workers would outlive it)."""
    killed = []
    for pid, proc in list(_LIVE_PROCS.items()):
        if proc.poll() is None:
            _signal_group(proc, sig)
            killed.append(pid)
    return killed


def signal_local_workers(sig: int) -> list[int]:
    """``sig`` to every local worker process still running (the process only, not its group: its
    children may not handle it, e.g. ``SIGUSR1``); their pids."""
    sent = []
    for pid, proc in list(_LIVE_PROCS.items()):
        if proc.poll() is None:
            try:
                os.kill(pid, sig)
            except OSError:
                continue
            sent.append(pid)
    return sent


def _kill_at_exit() -> None:
    killed = kill_local_workers()
    if killed:
        logger.warning("areno: killed worker processes %s left running at exit", killed)


def _ensure_exit_hook() -> None:
    """Kill the local workers when the interpreter exits. A ``threading`` exit hook, which runs before
    the interpreter joins its threads: a thread blocked on a stalled worker's reply (a scheduler
    call) would otherwise hold the exit forever, and ``atexit`` hooks run only after that join."""
    global _EXIT_HOOK_SET
    if not _EXIT_HOOK_SET:
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_kill_at_exit)
        else:  # pragma: no cover - every supported Python has it
            import atexit

            atexit.register(_kill_at_exit)
        _EXIT_HOOK_SET = True


def _gather(
    futures: list[concurrent.futures.Future],
    on_slow: Callable[[list[int], float], None] | None = None,
    warn_s: float = 0.0,
) -> list[Any]:
    """Results in order; the first failure is raised at once (the other workers may be blocked in
    a rendezvous or collective with the failed one and would never answer). ``on_slow(pending
    indices, seconds waited)`` is called after ``warn_s`` seconds and then at doubling intervals."""
    t0 = time.monotonic()
    wait_s = warn_s if on_slow is not None and warn_s > 0 else None
    while True:
        done, pending = concurrent.futures.wait(futures, timeout=wait_s, return_when=concurrent.futures.FIRST_EXCEPTION)
        if not pending or any(f.exception() is not None for f in done):
            break
        on_slow([i for i, f in enumerate(futures) if f in pending], time.monotonic() - t0)
        wait_s *= 2
    for f in futures:
        if f in done and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


def _raise_reply(worker: WorkerHandle, what: str, reply: tuple) -> Any:
    if reply[0] == "ok":
        return reply[1]
    _, exc_type, message, tb = reply
    log = f"; log {worker.log_path}" if worker.log_path else ""  # first: a remote message may span lines
    raise WorkerError(f"{worker.name} (pid {worker.pid} on {worker.host}{log}) {what} raised {exc_type}: {message}", tb)


def _target_name(target: str | Callable) -> str:
    return target if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}"


class Scheduler(abc.ABC):
    """Creates the workers of each role and calls them. Use as a context manager or call shutdown()."""

    # -- creation -------------------------------------------------------------------------------
    def create_workers(
        self,
        role: str,
        worker_cls_path: str,
        n: int,
        env: dict[str, str] | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        devices: list[int] | None = None,
    ) -> list[WorkerHandle]:
        """Start ``n`` workers of ``worker_cls_path`` as ``role`` (its own distributed world)."""
        spec = RoleSpec(
            role=role,
            worker_cls=worker_cls_path,
            n=n,
            env=dict(env or {}),
            args=tuple(args),
            kwargs=dict(kwargs or {}),
            devices=devices,
        )
        return self.create_roles([spec])[role]

    @abc.abstractmethod
    def create_roles(self, specs: Sequence[RoleSpec]) -> dict[str, list[WorkerHandle]]:
        """Start several roles at once (roles sharing a ``world`` key form one world)."""

    # -- calls ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def submit_one(
        self, role: str, index: int, target: str | Callable, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        """Call ``target`` (method name or module-level function) on one worker; a future of its result."""

    @abc.abstractmethod
    def workers(self, role: str) -> list[WorkerHandle]:
        """The current handles of a role, in index order."""

    @property
    @abc.abstractmethod
    def roles(self) -> list[str]:
        """Roles created so far."""

    def submit(self, role: str, target: str | Callable, *args: Any, **kwargs: Any) -> list[concurrent.futures.Future]:
        """The same call on every worker of ``role``; futures in index order."""
        return [self.submit_one(role, i, target, *args, **kwargs) for i in range(len(self.workers(role)))]

    def call(self, role: str, target: str | Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every worker of ``role``; blocks, results in index order. A call still
        running after ``SLOW_CALL_WARN_S`` is logged (not stopped) with the workers it waits for."""
        handles = self.workers(role)

        def on_slow(pending: list[int], waited_s: float) -> None:
            busy = ", ".join(
                f"{handles[i].name} (pid {handles[i].pid} on {handles[i].host}"
                + (f", log {handles[i].log_path}" if handles[i].log_path else "")
                + ")"
                for i in pending
            )
            logger.warning(
                "%s still running after %.0f s on %s; to see where: kill -USR1 <pid> writes its stacks to its log, "
                "ARENO_WORKER_LOG_CALLS=1 logs each call's start and end (a first step may also be compiling)",
                _target_name(target),
                waited_s,
                busy,
            )

        return _gather(self.submit(role, target, *args, **kwargs), on_slow, SLOW_CALL_WARN_S)

    async def acall(self, role: str, target: str | Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Coroutine form of ``call``."""
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in self.submit(role, target, *args, **kwargs))))

    def call_each(self, role: str, target: str | Callable, args_per_worker: Sequence[tuple]) -> list[Any]:
        """Worker ``i`` gets ``target(*args_per_worker[i])`` (scatter a batch, say)."""
        n = len(self.workers(role))
        if len(args_per_worker) != n:
            raise ValueError(f"call_each({role!r}, ...): {len(args_per_worker)} argument tuples for {n} workers")
        return _gather([self.submit_one(role, i, target, *a) for i, a in enumerate(args_per_worker)])

    # -- lifecycle ------------------------------------------------------------------------------
    @abc.abstractmethod
    def restart_worker(self, role: str, index: int) -> WorkerHandle:
        """Replace one worker by a fresh process with the same spec and rendezvous env.

        Collectives of the old world are not re-formed: callers re-initialise process groups."""

    def kill_worker(self, role: str, index: int) -> None:
        """Kill one worker's process (and its children) at once, without asking it: a worker that stopped
        answering. Its calls in flight and later ones fail with ``WorkerDiedError``. Schedulers that
        cannot do it raise ``NotImplementedError``; ``shutdown`` still ends the worker."""
        raise NotImplementedError(f"{type(self).__name__} cannot kill one worker")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; idempotent."""

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def log_workers(scheduler: Scheduler) -> None:
    """One line per worker of ``scheduler``, where to look: its log (``kill -USR1 <pid>`` writes its stacks
    there)."""
    for role in scheduler.roles:
        for h in scheduler.workers(role):
            logger.info(
                "worker %s (rank %d) pid %s on %s, log %s", h.name, h.rank, h.pid, h.host, h.log_path or "(scheduler's)"
            )


# ---------------------------------------------------------------------------------------------
# RPC over multiprocessing.connection: workers dial back to the controller (local and SLURM)


@dataclass(kw_only=True)
class _RpcWorker:
    spec: RoleSpec
    handle: WorkerHandle
    env: dict[str, str]
    conn: Connection | None = None
    proc: subprocess.Popen | None = None
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(max_workers=1)
    )


HANDSHAKE_TIMEOUT_S = 10.0
"""How long each read or write of a new connection's authentication and hello may take before the
connection is dropped: a peer that connects and sends nothing (a port scan, a health probe) holds
only its own handshake thread, never the workers connecting after it."""


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts on ``sock`` (0: none). The handshake reads through
    ``Connection``, which uses the raw descriptor, so Python's ``settimeout`` would not apply."""
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class _Hub:
    """A listener that accepts worker connections and files them by (role, index).

    The accept thread only accepts: each connection's authkey handshake and hello run in a thread of
    their own, bounded by ``HANDSHAKE_TIMEOUT_S``, so that one silent or slow peer (the SLURM
    controller listens on every interface) cannot keep the workers behind it from connecting."""

    def __init__(self, bind_host: str) -> None:
        self.authkey = secrets.token_bytes(32)
        self._sock = socket.create_server((bind_host, 0), backlog=128)
        self.port = self._sock.getsockname()[1]
        self._arrived: dict[tuple[str, int], tuple[Connection, int, str]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="areno-rpc-accept")
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of descriptors, say: try again without spinning
                continue
            threading.Thread(target=self._handshake, args=(sock, peer), daemon=True, name="areno-rpc-handshake").start()

    def _handshake(self, sock: socket.socket, peer: Any) -> None:
        """Authenticate one connection and read its hello; file it, or drop it (a stray or failed
        connection: the listener keeps accepting)."""
        conn = None
        try:
            sock.setblocking(True)
            _set_io_timeout(sock, HANDSHAKE_TIMEOUT_S)
            conn = Connection(os.dup(sock.fileno()))  # its own descriptor: `sock` stays to clear the timeouts
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            _, role, index, pid, host = conn.recv()
            _set_io_timeout(sock, 0)  # calls may run for hours
        except AuthenticationError as e:
            logger.warning("dropped a connection from %s to the worker listener: wrong authkey (%s)", peer, e)
        except Exception as e:  # noqa: BLE001 - whatever a stray peer sends (or not) ends its connection only
            logger.debug("dropped a connection from %s to the worker listener: %s: %s", peer, type(e).__name__, e)
        else:
            with self._cond:
                if not self._closed:
                    self._arrived[(role, index)] = (conn, pid, host)
                    self._cond.notify_all()
                    conn = None  # filed: stays open
        finally:
            sock.close()
            if conn is not None:
                conn.close()

    def wait(
        self,
        keys: list[tuple[str, int]],
        timeout_s: float,
        check: Callable[[], None],
        logs: dict | None = None,
        describe: Callable[[tuple[str, int]], str] | None = None,
    ) -> dict:
        """Wait until every key connected; ``check()`` raises early when a worker died; ``logs``:
        key -> log path, named in the timeout's message; ``describe(key)``: what else it says of a
        missing worker (its process still running, say)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                missing = [k for k in keys if k not in self._arrived]
                if not missing:
                    return {k: self._arrived.pop(k) for k in keys}
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(_missing_worker(k, logs, describe) for k in missing)
                    raise WorkerError(f"workers {names} did not connect within {timeout_s:.0f}s")
                self._cond.wait(min(left, 0.2))

    def close(self) -> None:
        with self._cond:
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (a bare close would not)
        except OSError:
            pass
        self._sock.close()


def _missing_worker(key: tuple[str, int], logs: dict | None, describe: Callable | None) -> str:
    role, index = key
    parts = [describe(key)] if describe is not None else []
    if logs and logs.get(key):
        parts.append(f"log {logs[key]}")
    return f"{role}[{index}]" + (f" ({', '.join(p for p in parts if p)})" if any(parts) else "")


class _RpcScheduler(Scheduler):
    """Shared machinery of schedulers whose workers run ``areno.launch.worker``'s ``main`` (``WORKER_MAIN``)."""

    connect_timeout_s: float

    def __init__(self, *, bind_host: str, connect_timeout_s: float, log_dir: str | None) -> None:
        self._hub = _Hub(bind_host)
        self.connect_timeout_s = connect_timeout_s
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="areno-workers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._workers: dict[str, list[_RpcWorker]] = {}
        self._closed = False

    # subclasses: start processes for (spec, index) pairs; check that none died; stop one
    @abc.abstractmethod
    def _start(self, workers: list[_RpcWorker]) -> None: ...

    @abc.abstractmethod
    def _check_alive(self, workers: list[_RpcWorker]) -> None: ...

    @abc.abstractmethod
    def _stop_process(self, worker: _RpcWorker) -> None: ...

    @property
    def roles(self) -> list[str]:
        return list(self._workers)

    def workers(self, role: str) -> list[WorkerHandle]:
        return [w.handle for w in self._role(role)]

    def _role(self, role: str) -> list[_RpcWorker]:
        if role not in self._workers:
            raise KeyError(f"no role {role!r}; created roles: {list(self._workers)}")
        return self._workers[role]

    def _describe_missing(self, w: _RpcWorker) -> str:
        """What a worker that has not connected is doing, for the connect timeout's message."""
        return ""

    @staticmethod
    def _start_timed_out(err: WorkerError, workers: list[_RpcWorker]) -> bool:
        """Whether ``_connect`` failed on its connect timeout alone (no worker died, none connected and
        then raised in its constructor): what a subclass explains with its own scheduler's causes."""
        return not isinstance(err, WorkerDiedError) and all(w.conn is None for w in workers)

    def _connect(self, workers: list[_RpcWorker]) -> None:
        by_key = {(w.handle.role, w.handle.index): w for w in workers}
        arrived = self._hub.wait(
            list(by_key),
            self.connect_timeout_s,
            lambda: self._check_alive(workers),
            logs={key: w.handle.log_path for key, w in by_key.items()},
            describe=lambda key: self._describe_missing(by_key[key]),
        )
        for w in workers:
            conn, pid, host = arrived[(w.handle.role, w.handle.index)]
            w.conn = conn
            w.handle = _replace(w.handle, pid=pid, host=host)
        futures = [
            w.executor.submit(
                self._roundtrip,
                w,
                ("init", w.spec.worker_cls, w.spec.args, w.spec.kwargs, self._init_env(w)),
                "constructor",
            )
            for w in workers
        ]
        _gather(futures)

    def _init_env(self, w: _RpcWorker) -> dict[str, str]:
        """Env a worker receives just before its object is built (after every worker connected)."""
        return {}

    def _roundtrip(self, w: _RpcWorker, msg: tuple, what: str) -> Any:
        assert w.conn is not None
        try:
            w.conn.send_bytes(pickle.dumps(msg))  # plain pickle both ways: tensors by value (worker.serve)
            reply = pickle.loads(w.conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise WorkerDiedError(self._died_message(w, what, e)) from None
        return _raise_reply(w.handle, what, reply)

    def _died_message(self, w: _RpcWorker, what: str, err: BaseException) -> str:
        code = ""
        if w.proc is not None:
            try:
                code = f", exit code {w.proc.wait(timeout=2)}"
            except subprocess.TimeoutExpired:
                code = ", still running"
        log = f"; log: {w.handle.log_path}" if w.handle.log_path else ""
        return f"{w.handle.name} (pid {w.handle.pid} on {w.handle.host}) died during {what} ({type(err).__name__}{code}){log}"

    def submit_one(
        self, role: str, index: int, target: str | Callable, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        w = self._role(role)[index]
        return w.executor.submit(self._roundtrip, w, ("call", target, args, kwargs), _target_name(target))

    def create_roles(self, specs: Sequence[RoleSpec]) -> dict[str, list[WorkerHandle]]:
        for spec in specs:
            if spec.role in self._workers:
                raise ValueError(f"role {spec.role!r} already exists; shut it down or pick another name")
        ranks = assign_ranks(specs)
        new: list[_RpcWorker] = []
        for spec in specs:
            for i in range(spec.n):
                rank, world_size, world = ranks[(spec.role, i)]
                devices = spec.worker_devices(i)
                handle = WorkerHandle(
                    role=spec.role,
                    index=i,
                    rank=rank,
                    world_size=world_size,
                    pid=None,
                    host="",
                    devices=tuple(devices) if devices is not None else None,
                    log_path=str(self.log_dir / f"{spec.role}-{i}.log"),
                )
                new.append(_RpcWorker(spec=spec, handle=handle, env={}))
        self._prepare_env(new, ranks)
        for spec in specs:
            self._workers[spec.role] = [w for w in new if w.spec is spec]
        try:
            self._start(new)
            self._connect(new)
        except BaseException:
            self._stop_workers([w for spec in specs for w in self._workers.pop(spec.role)], graceful=False)
            raise
        return {spec.role: self.workers(spec.role) for spec in specs}

    @abc.abstractmethod
    def _prepare_env(self, workers: list[_RpcWorker], ranks: dict) -> None: ...

    def restart_worker(self, role: str, index: int) -> WorkerHandle:
        old = self._role(role)[index]
        self._stop_worker(old)
        w = _RpcWorker(spec=old.spec, handle=_replace(old.handle, pid=None), env=old.env)
        self._workers[role][index] = w
        self._start([w])
        self._connect([w])
        return w.handle

    def _stop_worker(self, w: _RpcWorker, graceful: bool = False) -> None:
        self._stop_workers([w], graceful=graceful)

    def _stop_workers(self, workers: list[_RpcWorker], *, graceful: bool) -> None:
        """End ``workers``: with ``graceful``, each is sent ``stop`` first (all at once, one deadline of
        ``STOP_GRACE_S``; a worker busy in a call or stalled never takes it), then their connections
        close and their processes are stopped (``_stop_processes``)."""
        if graceful:
            asked = [
                w.executor.submit(self._roundtrip, w, ("stop",), "stop")
                for w in workers
                if w.conn is not None and not w.conn.closed
            ]
            concurrent.futures.wait(asked, timeout=STOP_GRACE_S)  # failures and timeouts: stopped below anyway
        for w in workers:
            if w.conn is not None:
                w.conn.close()
        self._stop_processes(workers)
        for w in workers:
            w.executor.shutdown(wait=False, cancel_futures=True)

    def _stop_processes(self, workers: list[_RpcWorker]) -> None:
        """Stop the processes of ``workers`` (each in turn; ``LocalScheduler``: all at once)."""
        for w in workers:
            self._stop_process(w)

    def kill_worker(self, role: str, index: int) -> None:
        self._kill_process(self._role(role)[index])

    def _kill_process(self, w: _RpcWorker) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot kill one worker")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_workers([w for ws in self._workers.values() for w in ws], graceful=True)
        self._workers.clear()
        self._hub.close()


def _replace(handle: WorkerHandle, **changes: Any) -> WorkerHandle:
    return dataclasses.replace(handle, **changes)


def physical_devices(devices: Sequence[int], visible: str | None, who: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a child given logical ``devices``: their ids in the parent's ``visible``
    list (None: every device, the logical ids as they are); a ValueError naming ``who`` past its end."""
    if visible is None:
        return ",".join(str(d) for d in devices)
    ids = [d for d in visible.split(",") if d.strip()]
    if max(devices, default=-1) >= len(ids):
        raise ValueError(
            f"{who} asks for logical device {max(devices)} but CUDA_VISIBLE_DEVICES={visible!r} has {len(ids)} devices"
        )
    return ",".join(ids[d] for d in devices)


class LocalScheduler(_RpcScheduler):
    """Workers as subprocesses of this machine (``areno.launch.worker``'s ``main``, ``WORKER_MAIN``).

    Each role gets ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` (one per world); a worker's
    ``CUDA_VISIBLE_DEVICES`` holds the physical ids of its logical devices. Worker output goes to
    ``<log_dir>/<role>-<index>.log``."""

    fresh_logs: bool = False
    """Truncate each worker's log when its process starts (a run that starts over); False appends,
    after a separator line (a resumed run, a restarted worker). Every start writes a header line."""

    def __init__(self, *, connect_timeout_s: float = 120.0, log_dir: str | None = None) -> None:
        super().__init__(bind_host="127.0.0.1", connect_timeout_s=connect_timeout_s, log_dir=log_dir)
        self._truncated: set[str] = set()

    def _prepare_env(self, workers: list[_RpcWorker], ranks: dict) -> None:
        ports = {world: free_port() for (_, _, world) in ranks.values()}
        pythonpath = python_path_env()
        for w in workers:
            rank, world_size, world = ranks[(w.handle.role, w.handle.index)]
            env = {
                **w.spec.env,
                "PYTHONPATH": pythonpath,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(ports[world]),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "ARENO_ROLE": w.handle.role,
                "ARENO_ROLE_INDEX": str(w.handle.index),
            }
            if w.handle.devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = physical_devices(
                    w.handle.devices, os.environ.get("CUDA_VISIBLE_DEVICES"), f"role {w.handle.role!r}"
                )
            w.env = env

    def _start(self, workers: list[_RpcWorker]) -> None:
        _ensure_exit_hook()
        for w in workers:
            cmd = worker_command(
                "--connect", f"127.0.0.1:{self._hub.port}", "--role", w.handle.role, "--rank", str(w.handle.index)
            )
            env = {
                **os.environ,
                **w.env,
                AUTHKEY_ENV: self._hub.authkey.hex(),
                PARENT_PID_ENV: str(os.getpid()),
                "ARENO_WORKER_COMMAND": shlex.join(cmd),
            }
            assert w.handle.log_path is not None
            with self._open_log(w.handle.log_path) as log:
                w.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            _LIVE_PROCS[w.proc.pid] = w.proc
            w.handle = _replace(w.handle, pid=w.proc.pid, host=socket.gethostname())

    def _open_log(self, path: str):
        """The worker's log, truncated the first time a ``fresh_logs`` scheduler starts a process on it;
        otherwise appended to after a separator line (the worker writes its header line itself)."""
        truncate = self.fresh_logs and path not in self._truncated
        self._truncated.add(path)
        return os.fdopen(open_worker_log(path, truncate=truncate), "ab")

    def _connect(self, workers: list[_RpcWorker]) -> None:
        try:
            super()._connect(workers)
        except WorkerError as e:
            if not self._start_timed_out(e, workers):
                raise  # a worker died, or a constructor raised: the message says which
            raise WorkerError(
                f"{e} ({OPTIONS_KEY}.connect_timeout_s): a worker still running is slow to start (imports, "
                f"model loading, a busy machine: {usable_cores()} cores here for {len(self._live_workers())} worker "
                "processes), or hangs at start (kill -USR1 <pid> writes its stacks to its log); raise "
                f"{OPTIONS_KEY}.connect_timeout_s for a slow machine"
            ) from None

    def _live_workers(self) -> list[_RpcWorker]:
        return [w for ws in self._workers.values() for w in ws if w.proc is not None and w.proc.poll() is None]

    def _describe_missing(self, w: _RpcWorker) -> str:
        if w.proc is None:
            return ""
        code = w.proc.poll()
        return f"pid {w.proc.pid}, still running" if code is None else f"pid {w.proc.pid}, exited with code {code}"

    def _check_alive(self, workers: list[_RpcWorker]) -> None:
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None and w.conn is None:
                tail = _tail(w.handle.log_path)
                raise WorkerDiedError(
                    f"{w.handle.name} exited with code {w.proc.returncode} before connecting; "
                    f"log {w.handle.log_path}: {tail}"
                )

    def _stop_process(self, w: _RpcWorker) -> None:
        self._stop_processes([w])

    def _stop_processes(self, workers: list[_RpcWorker]) -> None:
        """SIGTERM to every worker's process group at once, up to ``STOP_GRACE_S`` for them to end, then
        SIGKILL to the groups of those left (a stopped or deadlocked worker does not act on SIGTERM)."""
        procs = [w.proc for w in workers if w.proc is not None and w.proc.poll() is None]
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:  # not reaped yet: its pid still names its group
                _signal_group(proc, signal.SIGKILL)
        for proc in procs:
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:  # in an uninterruptible wait (a driver call, NFS): left, named
                logger.warning("worker process %d did not end %g s after SIGKILL; leaving it", proc.pid, STOP_GRACE_S)
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None:
                _LIVE_PROCS.pop(w.proc.pid, None)

    def _kill_process(self, w: _RpcWorker) -> None:
        if w.proc is not None and w.proc.poll() is None:
            _signal_group(w.proc, signal.SIGKILL)
            try:
                w.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:  # in an uninterruptible wait (a driver call): reaped at shutdown
                logger.warning("%s (pid %s) killed but not gone yet", w.handle.name, w.proc.pid)


def open_worker_log(path: str, *, truncate: bool, header: str | None = None) -> int:
    """A descriptor on a worker's log: truncated (a run that starts over) or appended to after a separator
    line (a resumed run, a restarted worker), then ``header`` when given (a local worker writes its own)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0), 0o644)
    try:
        if os.fstat(fd).st_size > 0:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(fd, f"\n==================== {stamp}: this worker starts again ====================\n".encode())
        if header is not None:
            os.write(fd, (header + "\n").encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _tail(path: str | None, n_chars: int = 400) -> str:
    if not path or not os.path.exists(path):
        return "(no log)"
    text = Path(path).read_text(errors="replace").strip()
    return text[-n_chars:].replace("\n", " | ") or "(empty)"


# ---------------------------------------------------------------------------------------------
# Config


@dataclass(kw_only=True)
class SchedulerConfig:
    """Which scheduler starts the workers, and its settings: ``cluster.scheduler`` is ``type``,
    ``cluster.scheduler_options`` holds the other fields."""

    type: Literal["local", "ray", "slurm"] = "local"
    """``local`` (subprocesses here), ``ray`` (a Ray cluster) or ``slurm`` (sbatch)."""
    connect_timeout_s: float = 120.0
    """How long to wait for started workers to report in (local, slurm)."""
    log_dir: str | None = None
    """Worker logs and generated scripts; a temporary directory when None."""
    ray_address: str | None = None
    """``None`` starts Ray in-process (``ray.init()``); ``auto`` joins the cluster of ``ray start
    --head`` on this machine; ``host:port`` or ``ray://host:port`` any other cluster."""
    ray_connect_timeout_s: float = 10.0
    """How long a Ray address may take to answer before the launch fails."""
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of each role."""
    ray_cpus_per_worker: float = 1.0
    """CPUs reserved per worker in its placement-group bundle; > 0 (Ray refuses an empty bundle), a
    fraction such as 0.5 lets workers share a CPU."""
    ray_placement_timeout_s: float = 60.0
    """How long a role's placement group may wait for resources."""
    slurm_partition: str | None = None
    """``#SBATCH --partition``."""
    slurm_account: str | None = None
    """``#SBATCH --account``."""
    slurm_time: str | None = "01:00:00"
    """``#SBATCH --time`` (minutes, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM`` or ``D-HH:MM:SS``); None:
    no such line, the partition's limit."""
    slurm_job_name: str = "areno"
    """``#SBATCH --job-name``."""
    slurm_cpus_per_task: int = 1
    """``--cpus-per-task`` of every worker."""
    slurm_extra_sbatch_lines: tuple[str, ...] = ()
    """Extra ``#SBATCH`` lines (e.g. ``--qos=high``), written after the generated ones."""
    slurm_setup_lines: tuple[str, ...] = ()
    """Shell lines run before the steps (``module load``, ``source venv/bin/activate``)."""
    slurm_controller_addr: str | None = None
    """Address workers dial back to; this host's name when None."""
    slurm_poll_interval_s: float = 2.0
    """How often squeue/sacct are polled while waiting."""
    slurm_queue_timeout_s: float = 24 * 3600.0
    """How long a submitted job may wait in the queue before the launch cancels it and fails; the
    connect timeout counts from when it runs."""

    def __post_init__(self) -> None:
        if self.type not in ("local", "ray", "slurm"):
            raise ValueError(f"cluster.scheduler must be one of local, ray, slurm; got {self.type!r}")
        self._check_types()  # first: the value checks below compare numbers and match strings
        for key in (*_TIMEOUT_KEYS, "ray_cpus_per_worker"):
            value = getattr(self, key)
            if not math.isfinite(value):  # nan passes every comparison, and a wait of nan returns at once
                raise ConfigError(f"{OPTIONS_KEY}.{key}: must be a finite number, got {value}")
        for key in _TIMEOUT_KEYS:
            if getattr(self, key) <= 0:
                raise ValueError(f"{OPTIONS_KEY}.{key} must be > 0, got {getattr(self, key)}")
        if self.ray_cpus_per_worker <= 0:
            raise ConfigError(
                f"{OPTIONS_KEY}.ray_cpus_per_worker: must be > 0 (a Ray bundle of a worker without GPUs holds "
                f"only these CPUs; a fraction such as 0.5 lets workers share one), got {self.ray_cpus_per_worker}"
            )
        if self.slurm_cpus_per_task < 1:
            raise ValueError(f"{OPTIONS_KEY}.slurm_cpus_per_task must be >= 1, got {self.slurm_cpus_per_task}")
        if self.ray_placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"{OPTIONS_KEY}.ray_placement_strategy must be one of PACK, SPREAD, STRICT_PACK, "
                f"STRICT_SPREAD; got {self.ray_placement_strategy!r}"
            )
        if self.slurm_time and not _SLURM_TIME.fullmatch(self.slurm_time):
            raise ConfigError(
                f"{OPTIONS_KEY}.slurm_time: must be a SLURM time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                f"D-HH:MM:SS, e.g. '2-00:00:00'), or null for the partition's limit; got {self.slurm_time!r}"
            )
        # each value becomes one line of the sbatch script: a line break would start a shell command
        for key in ("slurm_job_name", "slurm_partition", "slurm_account", "slurm_extra_sbatch_lines"):
            value = getattr(self, key)
            if any("\n" in v or "\r" in v for v in ([value] if isinstance(value, str) else value or ())):
                raise ConfigError(f"{OPTIONS_KEY}.{key}: must not hold a line break, got {value!r}")
        self.slurm_extra_sbatch_lines = tuple(self.slurm_extra_sbatch_lines)
        self.slurm_setup_lines = tuple(self.slurm_setup_lines)

    def _check_types(self) -> None:
        """ConfigError naming the first option whose value is not of its field's type (``'30'`` for a
        number, a string for a list of lines, which ``tuple()`` would split into characters)."""
        hints = get_type_hints(SchedulerConfig)
        for f in fields(self):
            hint, value = hints[f.name], getattr(self, f.name)
            if get_origin(hint) is Literal:
                continue  # checked against its names, which the message lists
            if isinstance(value, os.PathLike) and is_of_type(os.fspath(value), hint):
                setattr(self, f.name, os.fspath(value))  # log_dir=Path(...) from Python
            elif not is_of_type(value, hint):
                message = str(wrong_type(f"{OPTIONS_KEY}.{f.name}", hint, value))
                if isinstance(value, str) and get_origin(hint) is tuple:
                    message += f"; one line per item, e.g. [{value!r}]"
                raise ConfigError(message)


_TIMEOUT_KEYS = (
    "connect_timeout_s",
    "ray_connect_timeout_s",
    "ray_placement_timeout_s",
    "slurm_poll_interval_s",
    "slurm_queue_timeout_s",
)
"""``SchedulerConfig`` fields in seconds: finite and > 0."""

_SLURM_TIME = re.compile(r"(?i:infinite|unlimited)|\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}")
"""What ``sbatch --time`` takes: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
days-hours:minutes, days-hours:minutes:seconds, or no limit (``INFINITE``, ``UNLIMITED``)."""


def scheduler_config(scheduler: str, options: Mapping[str, Any] | None = None) -> SchedulerConfig:
    """``cluster.scheduler`` + ``cluster.scheduler_options`` as a validated ``SchedulerConfig``;
    a ValueError (one line) names an unknown option and lists the known ones."""
    options = dict(options or {})
    known = [f.name for f in fields(SchedulerConfig) if f.name != "type"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"{OPTIONS_KEY}.{unknown[0]} is not a scheduler option{hint}; known: {', '.join(known)}")
    return SchedulerConfig(type=scheduler, **options)
