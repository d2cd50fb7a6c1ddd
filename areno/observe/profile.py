"""Operator- and kernel-level profiles of chosen trainer steps (``observe.profile_steps``).

``profiled_step`` runs one whole step (rollout, training, policy sync) under ``torch.profiler``:
CPU operators of the trainer's thread and, on CUDA, every kernel this process launches (the rollout
engine's thread and CUDA-graph replays included). It writes ``run_dir/profile/step_<N>.json.gz``
(a Chrome trace: https://ui.perfetto.dev) and ``step_<N>.txt``, the operators that took the most
self time (device time on CUDA). A partitioned run's rollout workers are other processes: only the
trainer's side shows. The profiled step runs slower than the others (the profiler's own cost)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PROFILE_DIRNAME = "profile"
TABLE_ROWS = 60


def profiles_missed(run_dir: Path, steps: Collection[int], trained: int) -> list[int]:
    """The steps of ``steps`` at or before ``trained`` (a resumed run's checkpoint step, which it does not
    train again) that have no profile in ``run_dir``: a resumed run cannot profile them."""
    return sorted(s for s in steps if s <= trained and not (run_dir / PROFILE_DIRNAME / f"step_{s:08d}.txt").is_file())


@contextlib.contextmanager
def profiled_step(run_dir: Path, step: int, steps: Collection[int]) -> Iterator[None]:
    """Profile the body when ``step`` is one of ``steps``; otherwise do nothing."""
    if step not in steps:
        yield
        return
    # imported here: torch.profiler is heavy and a run that profiles nothing never needs it
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        yield
    out = run_dir / PROFILE_DIRNAME
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"step_{step:08d}.json.gz"
    prof.export_chrome_trace(str(trace))
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
    (out / f"step_{step:08d}.txt").write_text(table + "\n")
    logger.info("profile of step %d: %s (%s)", step, trace, sort_by)
