"""examples/dapo_sort.yaml runs as written (shrunk to a tiny model and two steps): a dapo run whose warm start
leaves most groups flat, re-sampling to fill its batches."""

from __future__ import annotations

import json
from pathlib import Path

from areno.api.config import load_config
from areno.api.pipeline import run_pipeline

ROOT = Path(__file__).resolve().parents[2]


def test_the_dapo_example_runs_and_resamples(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(
        ROOT / "examples/dapo_sort.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
            "warm_start.steps=2",
            "rollout.batch_size=4",
            "rollout.n_samples=4",
            "data.num_eval=4",
            "train.steps=2",
            "observe.console=false",
            # a tiny model two steps in scores all 0 on the exact match: half the prompts flat, half varied
            "reward.fn=tests.helpers.rewards:flat_on_odd_prompts",
            "reward.sandbox=false",
        ],
    )
    assert cfg.train.algorithm == "dapo" and cfg.train.algorithm_kwargs == {"dynamic_sampling_max_rounds": 10}
    run_pipeline(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/sampling_rounds" in r]
    assert len(steps) == 2 and all(1 <= r["rollout/sampling_rounds"] <= 10 for r in steps)
    assert all("rollout/scored_reward_mean" in r for r in steps)
