"""The shipped agent examples: their first steps run (default tier); their reward rises (slow tier)."""

import json
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["agent_calculator", "agent_multiturn"]


def _config(name, tmp_path, *extra):
    overrides = [f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", "observe.console=false"]
    cfg = load_config(ROOT / "examples" / f"{name}.yaml", overrides)
    if cfg.data.train_path:  # the shipped data files sit next to the config
        overrides += [f"data.train_path={ROOT / cfg.data.train_path}", f"data.eval_path={ROOT / cfg.data.eval_path}"]
    return load_config(ROOT / "examples" / f"{name}.yaml", overrides + list(extra))


# Each example's first GRPO step in the default tier (a few seconds each: imports and Trainer.init
# dominate); the warm start is skipped (see the slow tests below for whole runs).
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_first_step(name, tmp_path):
    cfg = _config(
        name,
        tmp_path,
        "rollout.batch_size=2",
        "rollout.n_samples=2",
        "data.num_eval=2",
        "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
    )
    trainer = Trainer.init(cfg)
    try:
        rollout = trainer.rollout_token_batch(0)
        metrics = trainer.train(0, rollout)
    finally:
        trainer.shutdown()
    trajs = rollout.trajectories
    assert len(trajs) == 4 and all(0.0 <= t.reward <= 1.0 for t in trajs)
    assert all(t.info["num_turns"] >= 1 for t in trajs)
    # multi-turn sequences train only on model tokens: masked tokens carry version -1 and log-prob 0
    for t in trajs:
        for m, v, lp in zip(t.completion_mask, t.versions, t.logprobs):
            assert (m == 1) == (v >= 0) and (m == 1 or lp == 0.0)
    assert any(k.startswith("train/") for k in metrics)


def _curves(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return rewards, accuracy


@pytest.mark.slow
def test_calculator_learns_to_use_the_tool(tmp_path):
    """The shipped config, 10 GRPO steps (~3 min on 2 idle cores): held-out accuracy (answer
    correct) rises from the warm start's mostly-direct answers as the model switches to calls."""
    from areno.api.pipeline import run_pipeline

    summary = run_pipeline(_config("agent_calculator", tmp_path, "train.steps=10", "train.eval_interval=5"))
    rewards, accuracy = _curves(tmp_path / "run")
    assert summary["accuracy_before"] < 0.5 and summary["accuracy_after"] > summary["accuracy_before"] + 0.3, accuracy
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


@pytest.mark.slow
def test_multiturn_correctness_rises(tmp_path):
    from areno.api.pipeline import run_pipeline

    summary = run_pipeline(_config("agent_multiturn", tmp_path))
    rewards, accuracy = _curves(tmp_path / "run")
    k = max(len(rewards) // 4, 1)
    assert sum(rewards[-k:]) / k > sum(rewards[:k]) / k + 0.05, rewards
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.1, accuracy
