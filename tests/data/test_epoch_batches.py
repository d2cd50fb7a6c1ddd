"""A real run's batches at an epoch boundary: no prompt twice in one step, and a resume inside the
straddling step trains what the uninterrupted run does."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.helpers.resume import overrides, run_areno, trained_prompts


def _by_step(run_dir) -> list[list[str]]:
    steps: dict[int, list[str]] = {}
    for step, prompt in trained_prompts(run_dir):
        steps.setdefault(step, []).append(prompt)
    return [steps[s] for s in sorted(steps)]


@pytest.mark.slow
def test_a_step_across_an_epoch_boundary_trains_each_prompt_once_and_resumes_alike(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i:02d}?", "answer": str(i)}) + "\n" for i in range(10)))

    def args(run_dir):
        return overrides(
            tmp_path,
            run_dir,
            "data.task=null",
            f"data.train_path={data}",
            "rollout.batch_size=4",
            "rollout.n_samples=2",
            "data.seed=13",  # without the fix, step 3 of this order trains two prompts twice each
            steps=3,  # step 3 takes rows 8-11: the last two of epoch 0 and the first two of epoch 1
            save_interval=1,
        )

    whole = tmp_path / "whole"
    done = run_areno(args(whole))
    assert done.returncode == 0, done.stderr[-3000:]
    steps = _by_step(whole)
    assert [len(s) for s in steps] == [4, 4, 4]
    assert all(max(Counter(s).values()) == 1 for s in steps), steps
    assert sorted(steps[0] + steps[1] + steps[2][:2]) == [f"q{i:02d}?" for i in range(10)]  # epoch 0 whole

    stopped = tmp_path / "stopped"
    assert run_areno(args(stopped), fault="kill:train:3").returncode == -9
    assert run_areno(args(stopped)).returncode == 0
    assert _by_step(stopped) == steps
