"""A reward worker process: ``python -m areno.rewards._worker REQ_FD RESP_FD`` (started by
:class:`areno.rewards.sandbox.RewardSandbox`, never by hand).

Protocol over two pipes (``multiprocessing.connection`` framing, pickled tuples):
- parent → ``(fn_path, memory_mb, cpu_s, allow_network)``; worker → ``("ready", isolation)`` or
  ``("fatal", message)``;
- then per call: parent → ``(prompt, completion, answer, fields)``; worker → ``("ok", float)`` or
  ``("error", (kind, message))`` with kind ``memory`` or ``error``.
A hang, a crash or a CPU-limit kill sends nothing: the parent's timeout or EOF notices.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from multiprocessing.connection import Connection

from areno.rewards import _exec
from areno.rewards.loader import import_object


def _serve(requests: Connection, replies: Connection) -> None:
    fn_path, memory_mb, cpu_s, allow_network = requests.recv()
    _exec.die_with_parent()
    isolation = "none" if allow_network else _exec.isolate_network()
    try:
        fn = import_object(fn_path, what="reward.fn")
    except ValueError as exc:
        replies.send(("fatal", str(exc)))
        return
    _exec.limit_memory(memory_mb)
    replies.send(("ready", isolation))
    while True:
        try:
            prompt, completion, answer, fields = requests.recv()
        except EOFError:  # the parent closed the pool or died
            return
        _exec.limit_cpu_from_now(cpu_s)
        try:
            value = fn(prompt, completion, answer, **fields)
            if inspect.isawaitable(value):
                value = asyncio.run(_await(value))
            reply = ("ok", float(value))
        except MemoryError as exc:
            reply = ("error", ("memory", f"MemoryError: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - user code: reported to the parent, which counts it and scores 0
            reply = ("error", ("error", f"{type(exc).__name__}: {exc}"))
        finally:
            _exec.clear_cpu_limit()
        replies.send(reply)


async def _await(value):
    return await value


def main() -> None:
    requests = Connection(int(sys.argv[1]), writable=False)
    replies = Connection(int(sys.argv[2]), readable=False)
    sys.stdin.close()
    _serve(requests, replies)
    os._exit(0)  # skip interpreter teardown of whatever the user module started


if __name__ == "__main__":
    main()
