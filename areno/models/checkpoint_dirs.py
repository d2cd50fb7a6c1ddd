"""Where a run keeps its checkpoints, read without torch: ``run_dir/checkpoints/step_N`` holds a
checkpoint once its ``COMPLETE`` marker is there (``areno.train.checkpoint`` writes them), and its
``hf/`` export is a Hugging Face directory. ``areno eval --checkpoint`` and ``areno serve`` read
paths with these, as resume does."""

from __future__ import annotations

import re
from pathlib import Path

from areno.errors import ModelDirError

COMPLETE_MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d+)$")


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def complete_checkpoints(checkpoints_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every completed ``step_N`` directory, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def newest_complete(checkpoints_dir: str | Path) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest completed ``step_N`` directory, or None: the names sorted, and the
    marker read from the newest down (a background evaluation asks every few seconds, and a run that keeps
    every checkpoint has thousands)."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return None
    steps = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match:
            steps.append((int(match.group(1)), child))
    for step, child in sorted(steps, reverse=True):
        if child.is_dir() and is_complete(child):
            return step, child
    return None


def model_dir_of(path: Path, flag: str) -> tuple[Path, Path | None] | None:
    """``(model directory, checkpoint or None)`` of a directory that names one model by itself: a
    checkpoint ``step_N`` or its ``hf/`` export (the export, of a complete checkpoint: a ModelDirError
    naming ``flag`` otherwise), or a Hugging Face directory (itself). None for anything else (a run
    directory). ``areno eval --checkpoint`` and ``areno serve`` read paths with it."""
    if path.name == "hf" and path.parent.name.startswith("step_"):
        path = path.parent  # a checkpoint's export named directly: the checkpoint must be complete
    if (path / "hf" / "config.json").is_file():
        if not is_complete(path):
            raise ModelDirError(f"{flag}: {path} is incomplete (no COMPLETE marker): pick a complete checkpoint")
        return path / "hf", path
    if (path / "config.json").is_file():
        return path, None
    return None


def newest_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint of a run directory or of its ``checkpoints/``; None if none."""
    for checkpoints in (path / "checkpoints", path):
        done = complete_checkpoints(checkpoints)
        if done:
            return done[-1][1]
    return None
