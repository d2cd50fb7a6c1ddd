"""Rollout workflows and clients the tests name by dotted path (``rollout.workflow=…``,
``WorkerSpec(workflow=…)``): runs and rollout worker processes import them from here."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import torch

from areno.rollout.client import RolloutServersLost
from areno.types import GenerationOutput, SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from areno.workflows.rlvr import RLVRWorkflow


class StoringWorkflow(RLVRWorkflow):
    """Puts a 64 KiB observation per episode into the engine's store and keeps only its reference."""

    def __init__(self, *args, store=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.store = store

    async def run_episode(self, client, sample):
        trajectories = await super().run_episode(client, sample)
        ref = self.store.put(torch.zeros(16, 1024))
        for t in trajectories:
            t.info["observation"] = ref
        return trajectories


class RouteDroppingWorkflow(RLVRWorkflow):
    """A user's workflow that builds its trajectories without the rollout's expert routes."""

    async def run_episode(self, client, sample):
        trajectories = await super().run_episode(client, sample)
        for t in trajectories:
            t.routes_TLK = None
        return trajectories


class AlwaysFailingWorkflow(RolloutWorkflow):
    """Every episode raises, as with a broken rollout engine or environment."""

    def __init__(self, **kwargs):
        pass

    async def run_episode(self, client, sample):
        raise RuntimeError("environment unreachable")


BROKEN_ENV = "ARENO_TEST_WORKFLOW_BROKEN"
"""``BrokenWhenToldWorkflow``'s switch: while it is set, every episode raises."""


class BrokenWhenToldWorkflow(RLVRWorkflow):
    """RLVR, but every episode raises while ``$ARENO_TEST_WORKFLOW_BROKEN`` is set (an environment gone mid-run,
    then fixed); ``failed`` notes the prompts of those episodes (in process)."""

    failed: list[str] = []

    async def run_episode(self, client, sample):
        if os.environ.get(BROKEN_ENV):
            self.failed.append(sample["prompt"])
            raise RuntimeError("environment unreachable")
        return await super().run_episode(client, sample)


class BreaksAfterWorkflow(RLVRWorkflow):
    """RLVR for its first ``break_after`` episodes, then every episode raises (an environment gone mid-run)."""

    def __init__(self, *args, break_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.left = break_after

    async def run_episode(self, client, sample):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("environment unreachable")
        return await super().run_episode(client, sample)


class ServersLostWorkflow(AlwaysFailingWorkflow):
    """Every episode finds the rollout servers gone for good (what the partitioned engine's client
    raises when every replica's worker died)."""

    async def run_episode(self, client, sample):
        raise RolloutServersLost("every rollout server is gone: http://127.0.0.1:1: rollout[0] (pid 7) died")


class EchoClient:
    """A rollout client double for worker processes: ``len`` tokens, one per 10 ms."""

    async def agenerate(self, prompt_ids, sampling_params, *, request_id=None):
        await asyncio.sleep(0.01 * prompt_ids[0])
        n = prompt_ids[0]
        return GenerationOutput(
            request_id=request_id or "r",
            prompt_ids=list(prompt_ids),
            output_ids=[5] * n,
            output_logprobs=[-0.5] * n,
            output_versions=[0] * n,
            finish_reason="stop",
        )


class StallOnceWorkflow(RolloutWorkflow):
    """Sample {"id", "len"[, "stall_marker"]}: the first attempt at a sample with a marker path hangs
    its whole process (a blocking call in the event loop, as a hung tool or C extension would)."""

    async def run_episode(self, client, sample):
        marker = sample.get("stall_marker")
        # Blocking calls in the event loop are the point: they hang the whole worker process.
        if marker and not Path(marker).exists():  # noqa: ASYNC240
            Path(marker).write_text(str(os.getpid()))  # noqa: ASYNC240
            time.sleep(3600)  # noqa: ASYNC251
        out = await client.agenerate([sample["len"]], SamplingParams(max_new_tokens=100))
        return Trajectory(
            prompt_ids=[1],
            completion_ids=out.output_ids,
            logprobs=out.output_logprobs,
            versions=out.output_versions,
            reward=float(sample["id"]),
            group_id=str(sample["id"]),
            info={"id": sample["id"], "pid": os.getpid()},
        )


class DictReturningWorkflow(RolloutWorkflow):
    """A user's workflow that returns a dict instead of a Trajectory (the contract's commonest slip)."""

    def __init__(self, **kwargs):
        pass

    async def run_episode(self, client, sample):
        return {"reward": 1.0}


class FirstRewardNanWorkflow(RLVRWorkflow):
    """A user's workflow whose own scoring gives one member of each group NaN (a division by zero)."""

    async def run_episode(self, client, sample):
        group = await super().run_episode(client, sample)
        group[0].reward = float("nan")
        return group


class OneByOneWorkflow(RLVRWorkflow):
    """A user's workflow whose ``return`` slipped into its sampling loop: one trajectory a row."""

    async def run_episode(self, client, sample):
        return (await super().run_episode(client, sample))[0]


class MaskedOutWorkflow(RLVRWorkflow):
    """A user's workflow with the mask convention inverted: every completion token marked 0."""

    async def run_episode(self, client, sample):
        group = await super().run_episode(client, sample)
        for traj in group:
            traj.completion_mask = [0] * len(traj.completion_ids)
        return group


class AllRewardsNanWorkflow(RLVRWorkflow):
    """A user's workflow whose own scoring gives every trajectory NaN."""

    async def run_episode(self, client, sample):
        group = await super().run_episode(client, sample)
        for traj in group:
            traj.reward = float("nan")
        return group


class ScriptedDynamicSamplingWorkflow(RLVRWorkflow):
    """Episodes, in the order they start: the first's rewards vary, the second's are equal (dynamic sampling
    filters it), the third and fourth are rejected, every later one's vary."""

    async def run_episode(self, client, sample):
        k = self.__dict__.get("_episodes", 0)
        self._episodes = k + 1
        if k in (2, 3):
            return None
        group = await super().run_episode(client, sample)
        for i, traj in enumerate(group):
            traj.reward = 0.0 if k == 1 else float(i)
        return group
