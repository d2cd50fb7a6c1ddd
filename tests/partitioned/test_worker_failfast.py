"""A worker whose constructor fails while its peers wait in the world's rendezvous: the error
reaches the controller at once instead of hanging until the rendezvous times out."""

from __future__ import annotations

import time

import pytest

from areno.launch.scheduler import LocalScheduler, RoleSpec, WorkerError


def test_constructor_error_is_raised_while_peers_block_in_rendezvous(tmp_path):
    with LocalScheduler(log_dir=str(tmp_path)) as sched:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"rollout\[0\].*ImportError: No module named 'pydantic'"):
            sched.create_roles(
                [
                    RoleSpec(role="train", worker_cls="tests.helpers.failfast_workers:JoinsWorld", n=1, world="w"),
                    RoleSpec(
                        role="rollout",
                        worker_cls="tests.helpers.failfast_workers:FailsBeforeJoining",
                        n=1,
                        world="w",
                    ),
                ]
            )
        assert time.monotonic() - t0 < 120  # the rendezvous would block for 600 s
        assert sched.roles == []
