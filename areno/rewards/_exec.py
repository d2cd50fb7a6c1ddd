"""Confinement steps shared by reward workers and candidate programs; standard library only.

Processes: :func:`enter_pid_namespace` puts the caller's future self in a fresh PID namespace
(``unshare(CLONE_NEWPID | CLONE_NEWNS)``, with ``CLONE_NEWUSER`` when not root) where the trainer's
PID does not exist, so user code cannot signal it, and killing the namespace's init kills every
process in it (``setsid`` children included). Where namespaces are unavailable the process only has
its own session (``"session"``): it can then still signal any process of the same user.

This file is also the launcher of a candidate program: ``python -I -c <this source> PROGRAM
MEMORY_MB CPU_S FSIZE_MB`` isolates the network, applies the rlimits and runs PROGRAM as
``__main__`` (see :func:`areno.rewards.code.run_program`).

What "no network" means here, honestly:
- ``netns``: the process entered a fresh network namespace (``unshare(CLONE_NEWUSER |
  CLONE_NEWNET)``, or ``CLONE_NEWNET`` alone with CAP_SYS_ADMIN). Only a down loopback device
  exists, so no socket can reach anything, whatever the code does (ctypes, subprocesses included).
- ``socket-patch``: namespaces are unavailable (user namespaces disabled, seccomp'd container).
  ``socket.socket`` then refuses AF_INET/AF_INET6 and ``socket.create_connection`` refuses. This stops
  ordinary Python networking (urllib, requests, http.client) but NOT determined code: ``_socket``,
  ctypes or a spawned ``curl`` still reach the network. Run untrusted code where namespaces work.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import signal
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000


def isolate_network() -> str:
    """Cut this (single-threaded) process off the network; returns ``"netns"`` or ``"socket-patch"``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for flags in (CLONE_NEWUSER | CLONE_NEWNET, CLONE_NEWNET):
            if libc.unshare(flags) == 0:
                return "netns"
    except (OSError, AttributeError):  # no libc.unshare (not Linux): fall back to the patch
        pass
    _patch_socket()
    return "socket-patch"


def _patch_socket() -> None:
    base = socket.socket

    class _NoNetworkSocket(base):  # type: ignore[misc, valid-type]
        def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: int | None = None) -> None:
            fam = socket.AF_INET if family == -1 and fileno is None else family
            if fam in (socket.AF_INET, socket.AF_INET6):
                raise PermissionError("network access is disabled in the areno reward sandbox")
            super().__init__(family, type, proto, fileno)

    def _refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError("network access is disabled in the areno reward sandbox")

    socket.socket = _NoNetworkSocket  # type: ignore[misc]
    socket.create_connection = _refuse  # type: ignore[assignment]


def limit_memory(memory_mb: int) -> None:
    """Cap the address space (RLIMIT_AS); allocations beyond it raise MemoryError. 0 = no cap."""
    if memory_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))


def limit_cpu_from_now(cpu_s: float) -> None:
    """SIGXCPU once this process has used ``cpu_s`` more CPU seconds (soft RLIMIT_CPU; the hard limit
    stays open so a reused worker can re-arm it before each call)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = math.ceil(spent + cpu_s)  # RLIMIT_CPU counts whole seconds
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def clear_cpu_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphaned hung workers after kill -9)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def enter_pid_namespace(close_in_waiters: tuple[int, ...] = ()) -> str:
    """Continue in a fresh PID namespace; returns how this process is contained: ``"pidns"`` (its
    own /proc too), ``"pidns-hostproc"`` (/proc still shows the host's processes, which cannot be
    signalled from here all the same) or ``"session"`` (no namespace: unchanged).

    Call it single-threaded, before any user code. Only children enter a new PID namespace, and its
    PID 1 ignores signals it has no handler for (a SIGXCPU of RLIMIT_CPU included), so this forks
    twice: this process waits for the namespace's init, init waits for the process that returns
    here, and each waiter exits as its child did (closing ``close_in_waiters`` first, so pipes see
    EOF when the real process dies). Every level dies with its parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if not _unshare_pid(libc):
            return "session"
    except (OSError, AttributeError):  # not Linux
        return "session"
    init = os.fork()
    if init:
        _exit_like(init, close_in_waiters, outside=True)
    die_with_parent()
    mounted = libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0 and (
        libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0
    )  # only inside the mount namespace unshared with the PID one: the host's mounts are untouched
    child = os.fork()
    if child:
        _exit_like(child, close_in_waiters, outside=False)
    die_with_parent()
    return "pidns" if mounted else "pidns-hostproc"


def _unshare_pid(libc: ctypes.CDLL) -> bool:
    if libc.unshare(CLONE_NEWPID | CLONE_NEWNS) == 0:  # root (CAP_SYS_ADMIN)
        return True
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS) != 0:  # unprivileged user namespaces
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:  # keep our own ids, seen the same from outside
            f.write(text)
    return True


def _exit_like(pid: int, close: tuple[int, ...], *, outside: bool) -> None:
    """Wait for ``pid`` and end this waiter the way it ended. A namespace's init cannot kill itself
    with most signals, so it reports a signal as exit code 128 + signal and the outside waiter,
    which can, turns that back into the signal (a program's own exit code above 128 reads the same)."""
    for fd in close:
        os.close(fd)
    while True:
        try:
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            break
        except InterruptedError:
            continue
    if outside and code > 128 and code - 128 in signal.valid_signals():
        code = 128 - code
    if code < 0 and outside:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(128 - code if code < 0 else code)


def _run_program(argv: list[str]) -> None:
    program, memory_mb, cpu_s, fsize_mb = argv[0], int(argv[1]), float(argv[2]), int(argv[3])
    die_with_parent()
    enter_pid_namespace()
    isolate_network()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_mb << 20, fsize_mb << 20))
    cpu = int(cpu_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    limit_memory(memory_mb)
    sys.argv = [program]
    import runpy

    runpy.run_path(program, run_name="__main__")


if __name__ == "__main__" and len(sys.argv) == 5:  # launched by run_program with `python -I -c`
    _run_program(sys.argv[1:])
