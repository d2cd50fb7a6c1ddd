"""Reading back what a run wrote for TensorBoard."""

from __future__ import annotations

from pathlib import Path


def read_tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's ``(step, value)`` events in ``log_dir``, in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
