"""A reward that kills one of the inference servers this process started, mid-step (vLLM tests)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

KILL_AT_CALL = 10
"""With 2 prompts x 4 samples per step, the second call of the second step."""
_calls = 0


def served_children(module: str = "vllm.entrypoints.openai.api_server") -> list[int]:
    """PIDs of this process's children running ``python -m module`` (the servers it started)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and module in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def kill_a_server_at_step_two(prompt: str, completion: str, answer: str, **row) -> float:
    """Exact match; at the ``KILL_AT_CALL``-th call kills the newest server's process group (the
    run's own: servers of other tests of the session were started before it)."""
    global _calls
    _calls += 1
    if _calls == KILL_AT_CALL:
        pids = served_children()
        os.killpg(pids[-1], signal.SIGKILL)
    return float(completion.strip() == str(answer))
