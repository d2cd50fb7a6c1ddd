"""The stage after a warm start draws its prompts in an order of its own (it trained, step for step, on
the rows the warm start had just fitted with their answers), and resumes in it."""

from __future__ import annotations

import pytest

from areno.api.config import load_config
from areno.data.datasets import build_splits
from areno.data.tasks import PromptStream
from tests.helpers.resume import overrides, run_areno, trained_prompts


@pytest.mark.slow
def test_the_main_stage_does_not_retrace_the_warm_starts_rows(tmp_path):
    def args(run_dir):
        return overrides(
            tmp_path, run_dir, "warm_start.steps=3", "warm_start.batch_size=4", "rollout.batch_size=4", steps=3
        )

    run = tmp_path / "run"
    done = run_areno(args(run))
    assert done.returncode == 0, done.stderr[-3000:]
    # sft trains each step as one group: the recorder names its first row; the stream says the others
    rows = build_splits(load_config(None, args(run)).data)[0]
    warm = [r["prompt"] for r in PromptStream(rows, seed=0, batch_size=4).take(12)]
    assert [p for _, p in trained_prompts(run / "warm_start")] == warm[::4]
    main = [p for _, p in trained_prompts(run)]
    assert len(main) == 12
    assert not set(warm) & set(main)  # 12 of 18,000 rows each: independent orders share none here

    stopped = tmp_path / "stopped"  # the main stage killed, resumed after its finished warm start
    assert run_areno(args(stopped), fault="kill:train:3").returncode == -9
    assert run_areno(args(stopped)).returncode == 0
    assert trained_prompts(stopped) == trained_prompts(run)
