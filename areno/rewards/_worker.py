"""A reward worker process: ``python -m areno.rewards._worker REQ_FD RESP_FD`` (started by
:class:`areno.rewards.sandbox.RewardSandbox`, never by hand).

Protocol over two pipes (``multiprocessing.connection`` framing):
- requests, parent → worker, pickled (the trainer writes them): first ``(fn_path, memory_mb, cpu_s,
  allow_network)``, then per call ``(prompt, completion, answer, fields)``;
- replies, worker → parent, JSON bytes only (the worker runs user code, which can write to this pipe,
  so the parent must never unpickle what comes back): ``["ready", {"network": ..., "pid": ...}]`` or
  ``["fatal", message]`` once, then per call ``["ok", float]`` (``["ok", float, {name: float}]`` with named
  figures: ``reward_parts``) or ``["error", kind, message]`` with
  kind ``memory`` or ``error``. The parent checks this shape strictly (:func:`areno.rewards._protocol.decode_reply`).
A hang, a crash or a CPU-limit kill sends nothing: the parent's timeout or EOF notices.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from multiprocessing.connection import Connection
from typing import Any

from areno.rewards import _exec
from areno.rewards._protocol import MAX_MESSAGE_CHARS, encode_reply
from areno.rewards.loader import import_object
from areno.rewards.sandbox import reward_parts


def _send(replies: Connection, reply: list) -> None:
    replies.send_bytes(encode_reply(reply))


def _serve(requests: Connection, replies: Connection, pid_isolation: str) -> None:
    fn_path, memory_mb, cpu_s, allow_network = requests.recv()
    isolation = "none" if allow_network else _exec.isolate_network()
    try:
        fn = import_object(fn_path, what="reward.fn")
    except ValueError as exc:
        _send(replies, ["fatal", str(exc)[:MAX_MESSAGE_CHARS]])
        return
    _exec.limit_memory(memory_mb)
    _send(replies, ["ready", {"network": isolation, "pid": pid_isolation}])
    while True:
        try:
            prompt, completion, answer, fields = requests.recv()
        except EOFError:  # the parent closed the pool or died
            return
        _exec.limit_cpu_from_now(cpu_s)
        reply: list[Any]
        try:
            value = fn(prompt, completion, answer, **fields)
            if inspect.isawaitable(value):
                value = asyncio.run(_await(value))
            # NaN and inf travel as JSON's NaN/Infinity extension: the parent counts them as non-finite
            score, extras = reward_parts(value)
            reply = ["ok", score, extras] if extras else ["ok", score]
        except MemoryError as exc:
            reply = ["error", "memory", f"MemoryError: {exc}"[:MAX_MESSAGE_CHARS]]
        except BaseException as exc:  # noqa: BLE001 - user code: reported to the parent, which counts it and scores 0
            reply = ["error", "error", f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE_CHARS]]
        finally:
            _exec.clear_cpu_limit()
        _send(replies, reply)


async def _await(value):
    return await value


def main() -> None:
    req_fd, resp_fd = int(sys.argv[1]), int(sys.argv[2])
    sys.stdin.close()
    _exec.die_with_parent()
    # from here on this process is the worker: in a fresh PID namespace when the kernel allows it
    pid_isolation = _exec.enter_pid_namespace(close_in_waiters=(req_fd, resp_fd))
    _serve(Connection(req_fd, writable=False), Connection(resp_fd, readable=False), pid_isolation)
    os._exit(0)  # skip interpreter teardown of whatever the user module started


if __name__ == "__main__":
    main()
