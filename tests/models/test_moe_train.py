"""GRPO on a tiny mixture-of-experts model through ``Trainer`` (``model.init_tiny`` with an expert
``arch``): a few steps train (finite loss, weights move, the router loss and the routing mismatch
are reported), and a longer seeded run learns the demo task."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.helpers.configs import grpo_rewards_on_tiny
from tests.helpers.moe import MOE_TINY, run_moe


def test_moe_grpo_steps_train(tmp_path):
    rows = run_moe(
        tmp_path,
        "reward.fn=tests.helpers.rewards:sevens",
        "train.steps=2",
        "train.num_train_passes=2",
        "train.eval_interval=0",
        "train.seed=1",
    )
    steps = [r for r in rows if "train/policy/loss" in r]
    assert len(steps) == 2
    for row in steps:
        assert torch.isfinite(torch.tensor(row["train/policy/loss"]))
        assert row["train/policy/router_aux_loss"] > 0
        assert 0.0 <= row["train/policy/moe_routing_mismatch"] <= 1.0
    before = load_file(str(tmp_path / "model" / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000002" / "hf" / "model.safetensors"))
    assert sorted(before) == sorted(after)  # exported under transformers' per-expert names
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in after
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(".experts." in k for k in moved) and any(".gate." in k for k in moved)


def test_moe_grpo_reward_goes_up(tmp_path):
    rewards = grpo_rewards_on_tiny(tmp_path, MOE_TINY)
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
