"""Reward functions the tests name by dotted path (``reward.fn=tests.helpers.rewards:sevens``).
Reward workers and sandbox processes import this module, so it imports only the standard library.
Those that ignore the answer take it with a default (``answer=None``): rows without one are theirs
too (preflight refuses them to a reward whose ``answer`` has no default)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import time


def sevens(prompt, completion, answer=None, **row):
    """Easy reward for the learning test: the fraction of '7' characters in the completion."""
    return completion.count("7") / max(len(completion), 1)


def sevens_and_length(prompt, completion, answer=None, **row):
    """A reward that varies between samples of a random tiny model (so GRPO has a gradient)."""
    return completion.count("7") / max(len(completion), 1) + 0.1 * len(completion)


def first_char(prompt, completion, answer=None, **row):
    """A reward that varies within every group of a random model: the first character's code."""
    return (ord(completion[0]) % 7) / 7.0 if completion else 0.0


def digit_fraction(prompt, completion, answer=None, **row):
    """Varies across a group, so GRPO advantages (and gradients) are non-zero."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def slow(prompt, completion, answer=None, **row):
    """A reward that takes 50 ms a call: a step long enough for a signal to arrive inside it."""
    time.sleep(0.05)
    return len(completion) / 10


HOLD_ENV = "ARENO_TEST_HOLD"
"""``held``'s switch: a path; while that file exists every call waits (after touching PATH.waiting)."""


def held(prompt, completion, answer=None, **row):
    """``slow``'s score, but a call waits while the file that ``$ARENO_TEST_HOLD`` names exists, so a test can
    hold a step in its rollout for as long as it needs (signals that must both land inside one step)."""
    hold = os.environ.get(HOLD_ENV)
    if hold and os.path.exists(hold):
        with open(hold + ".waiting", "w"):
            pass
        while os.path.exists(hold):
            time.sleep(0.01)
    return len(completion) / 10


def exploding(prompt, completion, answer=None, **row):
    raise RuntimeError("reward bug")


def sigterm_once(prompt, completion, answer=None, **row):
    """Sends SIGTERM to its own process on its first call (in-process rewards only), then scores 0."""
    if not os.environ.get("ARENO_TEST_SIGNALED"):
        os.environ["ARENO_TEST_SIGNALED"] = "1"
        os.kill(os.getpid(), 15)
    return 0.0


_calls = [0]


def every_other_raises(prompt, completion, answer=None, **row):
    """Raises on every second call of the process (in-process rewards only)."""
    _calls[0] += 1
    if _calls[0] % 2:
        raise RuntimeError("flaky reward")
    return 1.0


def misbehave(prompt: str, completion: str, answer=None, **row) -> float:
    """Does what the completion says: ok, hang, segfault, exit, raise, hog, spin or connect:PORT."""
    if completion == "ok":
        return 1.0
    if completion == "hang":
        while True:
            time.sleep(0.1)
    if completion == "segfault":
        ctypes.string_at(0)
    if completion == "exit":
        os._exit(3)
    if completion == "raise":
        raise KeyError("no such field")
    if completion == "hog":
        block = bytearray(8 << 30)
        return float(len(block))
    if completion == "spin":
        while True:
            pass
    if completion.startswith("connect:"):
        socket.create_connection(("127.0.0.1", int(completion.split(":")[1])), timeout=2).close()
        return 1.0
    return 0.0


async def async_reward(prompt: str, completion: str, answer=None, **row) -> float:
    await asyncio.sleep(0)
    return float(completion == answer)


class _RunOnUnpickle:
    """A pickle that runs a shell command wherever it is loaded (the attack on a pickled reply)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def hostile(prompt: str, completion: str, answer=None, **row) -> float:
    """Attacks the sandbox as the completion says: pickle:PATH (a pickle on the reply pipe that
    would create PATH), garbage, oversized, value:X (returns float(X)), killparent, kill:PID,
    killproc:MARKER (kills every process whose command line holds MARKER, found through /proc),
    setsid:MARKER (leaves a `setsid` sleeper holding MARKER), cwd."""
    import sys
    from multiprocessing.connection import Connection

    reply_fd = int(sys.argv[2])  # python -m areno.rewards._worker REQ_FD RESP_FD
    kind, _, arg = completion.partition(":")
    if kind == "pickle":
        Connection(reply_fd, readable=False).send(["ok", _RunOnUnpickle(f"touch {arg}")])
        time.sleep(30)  # the parent must act on the first reply, not on the one that follows
    if kind == "garbage":
        os.write(reply_fd, b"\x00\x00\x00\x05{nope")
        time.sleep(30)
    if kind == "oversized":
        Connection(reply_fd, readable=False).send_bytes(b"[" + b"1," * (1 << 20) + b"1]")
    if kind == "value":
        return float(arg)
    if kind == "killparent":
        os.kill(os.getppid(), 9)
        time.sleep(0.5)
        return 1.0
    if kind == "kill":
        os.kill(int(arg), 9)
        return 1.0
    if kind == "killproc":
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if arg.encode() in f.read():
                            os.kill(int(pid), 9)
                except OSError:
                    pass
        time.sleep(0.5)
        return 1.0
    if kind == "setsid":
        import subprocess

        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)", arg],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return 1.0
    if kind == "cwd":
        with open("probe", "w") as f:  # a relative path lands in the private working directory
            f.write("x")
        return float(os.path.basename(os.getcwd()).startswith("areno-reward-"))
    return 0.0


def flat_on_odd_prompts(prompt, completion, answer=None, **row):
    """0 for every completion of a prompt whose characters' codes sum to an odd number (a group dynamic
    sampling filters), else ``first_char``'s score, which varies within a group."""
    if sum(map(ord, prompt)) % 2:
        return 0.0
    return first_char(prompt, completion)


def flat(prompt, completion, answer=None, **row):
    """The same score for every completion: every group's rewards are equal."""
    return 0.5


FLAT_ENV = "ARENO_TEST_FLAT"
"""``flat_when_told``'s switch: while this variable is set, every call scores 0.5."""


def flat_when_told(prompt, completion, answer=None, **row):
    """``flat_on_odd_prompts``, but every group flat while ``$ARENO_TEST_FLAT`` is set (in-process rewards: a
    test turns a run's rewards flat from a step on, then fixes them)."""
    if os.environ.get(FLAT_ENV):
        return 0.5
    return flat_on_odd_prompts(prompt, completion)


def with_figures(prompt, completion, answer=None, **row):
    """``first_char``'s score with two named figures beside it (verl's convention): twice the score, and
    whether it is above 0.5 (a bool, counted 1 / 0)."""
    score = first_char(prompt, completion)
    return {"score": score, "double": 2 * score, "high": score > 0.5}


def bad_figures(prompt, completion, answer=None, **row):
    """A mapping without its ``score``: every call is a reward error."""
    return {"correct": 1.0}


def half(prompt, completion, answer=None, **row):
    """0.5 for every completion (weighted sums check against hand-computed values)."""
    return 0.5


def quarter_parsed(prompt, completion, answer=None, **row):
    """0.25 with a named figure beside it: ``parsed``, 1.0."""
    return {"score": 0.25, "parsed": 1.0}
