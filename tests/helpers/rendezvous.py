"""A race-free rendezvous for the spawned gloo worlds of the tests: rank 0 starts the TCPStore on port 0
(the kernel picks a free port as it binds) and publishes it in a file the other ranks wait for. A port
picked in the parent and bound seconds later, once the child imported torch, could be taken meanwhile."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

HOST = "127.0.0.1"


@contextlib.contextmanager
def port_file() -> Iterator[str]:
    """A path no world used before (a stale port would send the ranks to a dead store); removed after."""
    folder = tempfile.mkdtemp(prefix="areno-world-")
    try:
        yield str(Path(folder) / "port")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def tcp_store(rank: int, world: int, port_path: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """The world's store: rank 0 hosts it and writes its port to ``port_path``; the others wait for that
    (up to ``timeout``: rank 0 may still be importing torch) and connect."""
    if rank == 0:
        # not waiting for the workers here: they learn the port only from the file written below
        store = dist.TCPStore(HOST, 0, world, True, timeout=timeout, wait_for_workers=False)
        tmp = f"{port_path}.{os.getpid()}"
        Path(tmp).write_text(str(store.port))
        os.replace(tmp, port_path)  # atomic: a reader never sees a half-written port
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not os.path.exists(port_path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no store port in {port_path} within {timeout}")
        time.sleep(0.05)
    return dist.TCPStore(HOST, int(Path(port_path).read_text()), world, False, timeout=timeout)
