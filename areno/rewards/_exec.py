"""Confinement steps shared by reward workers and candidate programs; standard library only.

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
import resource
import socket
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


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


def _run_program(argv: list[str]) -> None:
    program, memory_mb, cpu_s, fsize_mb = argv[0], int(argv[1]), float(argv[2]), int(argv[3])
    die_with_parent()
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
