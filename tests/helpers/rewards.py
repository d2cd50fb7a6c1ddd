"""Reward functions the tests name by dotted path (``reward.fn=tests.helpers.rewards:sevens``).
Reward workers and sandbox processes import this module, so it imports only the standard library."""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import time


def sevens(prompt, completion, answer, **row):
    """Easy reward for the learning test: the fraction of '7' characters in the completion."""
    return completion.count("7") / max(len(completion), 1)


def sevens_and_length(prompt, completion, answer, **row):
    """A reward that varies between samples of a random tiny model (so GRPO has a gradient)."""
    return completion.count("7") / max(len(completion), 1) + 0.1 * len(completion)


def first_char(prompt, completion, answer, **row):
    """A reward that varies within every group of a random model: the first character's code."""
    return (ord(completion[0]) % 7) / 7.0 if completion else 0.0


def digit_fraction(prompt, completion, answer, **row):
    """Varies across a group, so GRPO advantages (and gradients) are non-zero."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def exploding(prompt, completion, answer, **row):
    raise RuntimeError("reward bug")


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
