"""The worker side of the scheduler protocol.

A worker process holds one instance of a user class (``"package.module:Class"``), built from
pickled constructor arguments, and executes calls by method name with pickled arguments. A call
target may also be a module-level function (pickled by reference), which lets the launcher run
its own checks (e.g. the storage probe) on any worker without the user class knowing.

Messages controller -> worker (tuples):
    ("init", cls_path, args, kwargs, env) set env (e.g. MASTER_ADDR once the controller knows the
                                         host of rank 0), then build the worker object
    ("call", target, args, kwargs)       target: method name (str) or module-level function
    ("stop",)                            reply, then exit
Replies: ("ok", value) or ("err", exc_type_name, message, traceback_text).

The same ``WorkerRuntime`` runs in a subprocess that dialled back to the controller
(``python -m areno.launch.worker``: local and SLURM schedulers) and inside a Ray actor.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client
from typing import Any

# The scheduler owns the name and does not import this module. Workers start through
# ``scheduler.worker_command`` (``python -c ... main()``), not ``python -m``: the package imports this
# module (its Ray scheduler does), so runpy would load it a second time as ``__main__``.
from areno.launch.scheduler import AUTHKEY_ENV, PARENT_PID_ENV, RUN_DIR_ENV


def import_object(path: str) -> Any:
    """``"pkg.mod:Name"`` (or ``"pkg.mod.Name"``) -> the object."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"worker class path {path!r} must look like 'package.module:Class'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


LOG_CALLS_ENV = "ARENO_WORKER_LOG_CALLS"
"""When set (to anything but ``0``), each call's start and end are written to the worker's stderr (its
log) with a wall-clock time: after a stall, the last unfinished call of each worker is in its log."""


class WorkerRuntime:
    """Executes protocol messages against the worker object of this process."""

    def __init__(self) -> None:
        self.obj: Any = None
        self.log_calls = os.environ.get(LOG_CALLS_ENV, "0") not in ("", "0")

    def _log(self, text: str) -> None:
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        print(f"[areno worker {os.getpid()} {stamp}] {text}", file=sys.stderr, flush=True)

    def handle(self, msg: tuple) -> tuple:
        try:
            kind = msg[0]
            if kind == "init":
                _, cls_path, args, kwargs, env = msg
                os.environ.update(env)
                self.obj = import_object(cls_path)(*args, **kwargs)
                return ("ok", None)
            if kind == "call":
                _, target, args, kwargs = msg
                if callable(target):
                    method = target
                elif self.obj is None:
                    raise RuntimeError("worker object not initialised")
                else:
                    method = getattr(self.obj, target, None)
                    if method is None:
                        raise AttributeError(f"{type(self.obj).__name__} has no method {target!r}")
                if not self.log_calls:
                    return ("ok", method(*args, **kwargs))
                name = getattr(target, "__qualname__", target)
                self._log(f"call {name} started")
                t0 = time.perf_counter()
                try:
                    return ("ok", method(*args, **kwargs))
                finally:
                    self._log(f"call {name} ended after {time.perf_counter() - t0:.3f} s")
            if kind == "stop":
                return ("ok", None)
            raise ValueError(f"unknown message kind {kind!r}")
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            return ("err", type(e).__name__, str(e), traceback.format_exc())


def serve(address: tuple[str, int], authkey: bytes, role: str, rank: int) -> None:
    """Dial the controller, introduce ourselves, then serve messages until ``stop`` or EOF."""
    conn = Client(address, authkey=authkey)
    conn.send(("hello", role, rank, os.getpid(), socket.gethostname()))
    runtime = WorkerRuntime()
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        try:
            msg = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - an argument that does not unpickle here is the caller's error
            conn.send(
                ("err", type(e).__name__, f"cannot unpickle the call on this worker: {e}", traceback.format_exc())
            )
            continue
        reply = runtime.handle(msg)
        try:
            # plain pickle: Connection.send's pickler hands tensors over by shared memory, whose file
            # descriptors the controller, not this worker's parent, cannot fetch (AuthenticationError)
            conn.send_bytes(pickle.dumps(reply))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            conn.send(("err", type(e).__name__, f"result of {msg[1]!r} cannot be pickled: {e}", ""))
        if msg[0] == "stop":
            conn.close()
            return


def _slurm_rendezvous_env() -> None:
    """Derive torch.distributed env from SLURM's per-task variables (``srun`` steps)."""
    offset = int(os.environ.get("ARENO_RANK_OFFSET", "0"))
    rank = offset + int(os.environ["SLURM_PROCID"])
    os.environ["RANK"] = str(rank)
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def header_line(role: str, index: int) -> str:
    """The first line a worker writes to its log: who it is, where, since when, for which run, and how
    it was started."""
    command = os.environ.get("ARENO_WORKER_COMMAND") or " ".join([sys.executable, *sys.argv])
    return (
        f"==== areno worker {role}[{index}] rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}, "
        f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S %z')}, "
        f"run_dir {os.environ.get(RUN_DIR_ENV, '(none)')} ====\n==== command: {command}"
    )


PARENT_POLL_S = 1.0


def watch_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> threading.Thread | None:
    """End this process when the controller ``parent_pid`` is gone (a daemon thread polling ``getppid``):
    a controller killed outright (``kill -9``) cannot stop its workers, and one blocked in a collective
    would otherwise wait out its timeout, holding its devices. None when the parent is gone already or
    is not ``parent_pid`` (a SLURM step's is ``srun``)."""
    if os.getppid() != parent_pid:
        return None

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        print(
            f"[areno worker {os.getpid()}] the controller (pid {parent_pid}) is gone: exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    thread = threading.Thread(target=watch, name="areno-parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's stack to the worker log, from the start
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = argparse.ArgumentParser(description="areno scheduler worker (started by a Scheduler)")
    parser.add_argument("--connect", required=True, help="controller host:port")
    parser.add_argument("--role", required=True)
    parser.add_argument("--rank", type=int, default=None, help="worker index in its role (default: SLURM_PROCID)")
    parser.add_argument("--slurm", action="store_true", help="derive RANK/LOCAL_RANK from SLURM variables")
    ns = parser.parse_args(argv)
    if ns.slurm:
        _slurm_rendezvous_env()
    rank = ns.rank if ns.rank is not None else int(os.environ.get("SLURM_PROCID", "0"))
    print(header_line(ns.role, rank), file=sys.stderr, flush=True)
    if os.environ.get(PARENT_PID_ENV, "").isdigit():
        watch_parent(int(os.environ[PARENT_PID_ENV]))
    host, _, port = ns.connect.rpartition(":")
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    serve((host, int(port)), authkey, ns.role, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
