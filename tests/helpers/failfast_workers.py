"""Worker classes for the fail-fast construction test (imported by path in worker processes)."""

from __future__ import annotations

import datetime


class JoinsWorld:
    """Blocks in the world's rendezvous until every rank joins (as a TrainWorker does)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))


class FailsBeforeJoining:
    """Raises before joining the world (as a RolloutWorker whose imports fail does)."""

    def __init__(self) -> None:
        raise ImportError("No module named 'pydantic'")
