"""A tiny Qwen2.5-VL-layout model under GRPO, partitioned on the CPU (1 training + 1 rollout worker
process, gloo): the images reach the rollout worker over HTTP, the trainer fetches the pixels
for its batch, and the policy sync carries the vision tower and merger."""

from __future__ import annotations

import pytest
import torch

from areno.api.config import load_config
from areno.engine.api import prepare_model_dir
from areno.engine.partitioned import is_partitioned
from areno.engine.placement import build_engine
from tests.vlm.test_vlm_grpo import vl_overrides

PARTITIONED = ("cluster.train_devices=[0]", "cluster.rollout_devices=[1]")


def _config(tmp_path, *extra: str, **settings: str):
    base = {"optim.lr": "0.01", "reward.fn": "tests.helpers.rewards:first_char", "rollout.batch_size": "2"}
    return load_config(None, [*vl_overrides(tmp_path, 3, **{**base, **settings}), *extra])


def _steps(engine, n: int) -> list:
    rows = []
    for i in range(n):
        rollout = engine.generate_rollout(i)
        assert len(rollout.batch.images_B) == rollout.batch.num_seqs  # the trainer fetched every image
        assert all(isinstance(im["pixel_values"], torch.Tensor) for im in rollout.batch.images_B)
        rows.append((rollout, engine.step(rollout)))
        engine.update_weights()
    return rows


def _run(cfg, run_dir, n: int) -> list:
    engine = build_engine(cfg, run_dir)
    engine.initialize()
    try:
        return _steps(engine, n)
    finally:
        engine.shutdown()


def test_partitioned_vlm_grpo_matches_colocated(tmp_path):
    """η = 0: three steps, the same completions, rewards and losses as the colocated run."""
    cfg = _config(tmp_path, *PARTITIONED)
    assert is_partitioned(cfg)
    prepare_model_dir(cfg)
    ref = _run(_config(tmp_path), tmp_path / "ref", 3)
    got = _run(cfg, tmp_path / "run", 3)
    for (r_ref, m_ref), (r_got, m_got) in zip(ref, got):
        assert [t.completion_ids for t in r_got.trajectories] == [t.completion_ids for t in r_ref.trajectories]
        assert r_got.metrics["rollout/reward_mean"] == pytest.approx(r_ref.metrics["rollout/reward_mean"])
        assert m_got["train/policy/loss"] == pytest.approx(m_ref["train/policy/loss"], rel=1e-4, abs=1e-6)
    assert got[-1][1]["policy_sync_bytes"] > 0
