"""Start-up time: seconds from this process's start (the kernel's record of it, so the interpreter's
own start and every import count) to the first token a rollout engine of the process generated."""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

_first_token_s: float | None = None


def process_age_s() -> float | None:
    """Seconds since this process started; None where the start time is unknown."""
    try:  # Linux: /proc's clock-tick start time, exact to 10 ms (psutil's rounds boot time to 1 s)
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # optional: other platforms' process start time
    except ImportError:
        return None
    return time.time() - psutil.Process().create_time()


def mark_first_token() -> None:
    """Record (once per process) that a rollout engine generated its first token, and log when."""
    global _first_token_s
    if _first_token_s is not None:
        return
    age_s = process_age_s()
    _first_token_s = age_s if age_s is not None else float("nan")
    logger.info("start-up: first generated token %.2f s after the process started", _first_token_s)


def startup_to_first_token_s() -> float | None:
    """Seconds from process start to the first generated token (None before it, NaN if unknown)."""
    return _first_token_s
