"""Groups of chosen rewards for the dynamic-sampling tests: a workflow that returns them, a sample source
that remembers what the executor released, and a fake engine."""

from __future__ import annotations

from areno.engine.executor import SampleSource
from areno.types import SamplingParams
from areno.workflows.base import RolloutWorkflow
from tests.helpers.async_fakes import FakeEngine, generated


class GroupWorkflow(RolloutWorkflow):
    """Sample {"id", "rewards": {group: [r, ...]}} -> one trajectory per reward, grouped as given."""

    async def run_episode(self, client, sample):
        out = []
        for group, rewards in sample["rewards"].items():
            for r in rewards:
                gen = await client.agenerate([2], SamplingParams(max_new_tokens=10))
                out.append(generated(gen, r, group_id=f"{sample['id']}/{group}", info={"id": sample["id"]}))
        return out


class Released(SampleSource):
    """Rows, remembering which ones the executor released (done without a trained group)."""

    def __init__(self, rows):
        self._rows = iter(rows)
        self.released = []

    def __next__(self):
        return next(self._rows)

    def release(self, sample):
        self.released.append(sample["id"])


def flat(i):
    return {"id": i, "rewards": {"a": [1.0, 1.0]}}


def varied(i):
    return {"id": i, "rewards": {"a": [0.0, 1.0]}}


def engine():
    return FakeEngine(lambda prompt_ids, params: [5, 6], step_s=0.0)
