"""What every bench JSON records about the code and machine it measured: the commit and the host."""

from __future__ import annotations

import os
import platform
import subprocess

COMMIT_ENV = "ARENO_COMMIT"
"""Overrides the commit read from git: a run from an exported tree (``git archive``, no ``.git``)
sets it to the commit it exported."""


def git_commit() -> str:
    """The short commit of this checkout (``ARENO_COMMIT`` when set), or ``unknown`` outside git."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "unknown"


def stamp() -> dict[str, str]:
    """``{"commit": ..., "host": ...}`` for a bench's JSON."""
    return {"commit": git_commit(), "host": platform.node()}
