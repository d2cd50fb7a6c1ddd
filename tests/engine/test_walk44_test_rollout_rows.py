"""walk44 P3: ``test/num_prompts`` counted trajectories where a row's samples did not all come back (its
``eval/num_rows`` was set only when every row had the same number of samples): eval_samples times too many."""

from __future__ import annotations

from areno.engine.test_rollout import TestRolloutManager, test_metrics
from areno.types import SamplingParams
from areno.workflows.base import RolloutWorkflow
from tests.helpers.async_fakes import FakeEngine, generated


class Samples(RolloutWorkflow):
    """Row {"id", "n"} -> n trajectories of its group (a row that lost samples has fewer)."""

    async def run_episode(self, client, sample):
        out = []
        for _ in range(sample["n"]):
            gen = await client.agenerate([2], SamplingParams(max_new_tokens=4))
            out.append(generated(gen, 1.0, group_id=str(sample["id"])))
        return out


def test_the_prompt_count_is_the_rows_that_came_back(tmp_path):
    engine = FakeEngine(lambda prompt_ids, params: [5, 6])
    rows = [{"id": 0, "n": 4}, {"id": 1, "n": 3}, {"id": 2, "n": 4}]
    manager = TestRolloutManager(tmp_path, engine, engine, Samples(), rows, pass_threshold=1.0)
    try:
        metrics = manager._evaluate()
    finally:
        manager._executor.stop()
    assert metrics["eval/num_trajectories"] == 11 and metrics["eval/num_rows"] == 3
    assert test_metrics(1, {**metrics, "eval/load_s": 0.0})["test/num_prompts"] == 3
