"""A tiny Qwen2.5-VL-layout model under GRPO, partitioned on the CPU (1 training + 1 rollout worker
process, gloo): the images reach the rollout worker over HTTP, the trainer fetches the pixels
for its batch, and the policy sync carries the vision tower and merger."""

from __future__ import annotations

import pickle

import pytest
import torch

from areno.api.config import load_config
from areno.engine.api import prepare_model_dir
from areno.engine.cluster import LayoutError
from areno.engine.partitioned import is_partitioned
from areno.engine.placement import build_engine, partitioned_engine
from areno.models.hf_io import load_model
from tests.helpers.vlm import vl_overrides

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


def test_rollout_tp_of_a_vlm_is_refused_before_launch(tmp_path):
    cfg = _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[1, 2]", "cluster.rollout_tp=2")
    prepare_model_dir(cfg)
    engine = partitioned_engine(cfg, tmp_path / "run")
    try:
        with pytest.raises(LayoutError, match=r"^cluster.rollout_tp=2: .*set cluster.rollout_tp=1$"):
            engine.initialize()
        assert engine.rollout.cluster.scheduler is None  # nothing was launched
    finally:
        engine.shutdown()  # what Trainer.init does after a failed start: the shared reward pool goes


def _run(cfg, run_dir, n: int, check=None) -> list:
    """``n`` steps of a new engine; ``check(engine)`` after them."""
    engine = build_engine(cfg, run_dir)
    engine.initialize()
    try:
        rows = _steps(engine, n)
        if check is not None:
            check(engine)
        return rows
    finally:
        engine.shutdown()


@pytest.mark.slow  # over 10 s: the default suite keeps within its 10 minutes
def test_partitioned_vlm_grpo_matches_colocated(tmp_path):
    """η = 0: three steps, the same completions, rewards and losses as the colocated run."""
    cfg = _config(tmp_path, *PARTITIONED)
    assert is_partitioned(cfg)
    prepare_model_dir(cfg)
    ref = _run(_config(tmp_path), tmp_path / "ref", 3)
    got = _run(cfg, tmp_path / "run", 3, _synced_tower(tmp_path))
    for (r_ref, m_ref), (r_got, m_got) in zip(ref, got):
        assert [t.completion_ids for t in r_got.trajectories] == [t.completion_ids for t in r_ref.trajectories]
        assert r_got.metrics["rollout/reward_mean"] == pytest.approx(r_ref.metrics["rollout/reward_mean"])
        assert m_got["train/policy/loss"] == pytest.approx(m_ref["train/policy/loss"], rel=1e-4, abs=1e-6)
    assert got[-1][1]["policy_sync_bytes"] > 0


def _synced_tower(tmp_path):
    """A check: the rollout worker's vision tower and merger equal the trained policy's."""

    def check(engine):
        engine.export_policy(tmp_path / "export")
        trained = dict(load_model(tmp_path / "export", dtype=torch.float32, device="cpu")[0].named_parameters())
        (live,) = [pickle.loads(b) for b in engine.rollout.cluster.scheduler.call("rollout", "weight_shards")]
        tower = [n for n in live if n.startswith("visual.")]
        assert "visual.merger.mlp.2.weight" in tower and "visual.blocks.0.attn.qkv.weight" in tower
        for name in tower:
            assert torch.equal(live[name], trained[name].to(live[name].dtype)), name
        return trained

    return check


@pytest.mark.slow  # a partitioned run of its own (worker processes)
def test_partitioned_vlm_async_syncs_the_trained_tower(tmp_path):
    """η = 1, placed by ``allocation_mode``: the run goes on while the rollout worker generates one
    version behind, and the policy sync carries the trained vision tower and merger."""
    cfg = _config(tmp_path, "cluster.allocation_mode='areno:d1+fsdp:d1'", "rollout.max_head_offpolicyness=1")
    assert is_partitioned(cfg)
    prepare_model_dir(cfg)
    initial = dict(_params(tmp_path / "model"))
    rows = _run(cfg, tmp_path / "run", 3, _synced_tower(tmp_path))
    for rollout, metrics in rows:
        assert (
            rollout.metrics["rollout/staleness_max"] <= 1
            and metrics["train/policy/loss"] == metrics["train/policy/loss"]
        )
    trained = dict(_params(tmp_path / "export"))
    assert not torch.equal(initial["visual.merger.mlp.2.weight"], trained["visual.merger.mlp.2.weight"])


@pytest.mark.slow  # two partitioned runs
def test_partitioned_vlm_frozen_tower_is_not_synced(tmp_path):
    """``model.freeze_vision=true``: the tower never changes, so the sync sends the decoder only."""
    tower = sum(1 for n, _ in _params(_config(tmp_path).model.path) if n.startswith("visual."))
    full = _config(tmp_path, *PARTITIONED)
    frozen = _config(tmp_path, *PARTITIONED, **{"model.freeze_vision": "true"})
    prepare_model_dir(full)
    sent_full = _run(full, tmp_path / "full", 2)[-1][1]["policy_sync_tensors"]
    sent_frozen = _run(frozen, tmp_path / "frozen", 2)[-1][1]["policy_sync_tensors"]
    assert tower > 0 and sent_frozen == sent_full - tower


def _params(path):
    """The parameters of the model saved at ``path``."""
    return load_model(path, dtype=torch.float32, device="cpu")[0].named_parameters()
