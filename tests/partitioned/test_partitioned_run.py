"""A partitioned run on CPU: 1 training + 1 rollout worker process in one gloo world."""

import json

import pytest
import torch

from areno.api.config import load_config
from areno.engine.api import ArenoEngine
from areno.engine.cluster import LayoutError
from areno.engine.partitioned import PartitionedArenoEngine, is_partitioned


def sevens(prompt, completion, answer, **row):
    """A reward that varies between samples of a random tiny model (so GRPO has a gradient)."""
    return completion.count("7") / max(len(completion), 1) + 0.1 * len(completion)


def _config(tmp_path, *extra):
    return load_config(None, [
        f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}",
        "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
        "data.task=arithmetic", "data.num_eval=4", "rollout.batch_size=2", "rollout.n_samples=4",
        "rollout.max_new_tokens=4", "cluster.device=cpu", "cluster.cpu_threads=1", "observe.console=false",
        "train.seed=3", "optim.lr=0.01", "reward.fn=test_partitioned_run:sevens", *extra,
    ])


def _two_steps(engine):
    import time
    rows = []
    for i in range(2):
        print("step", i, time.time())
        rollout = engine.generate_rollout(i)
        rows.append((rollout, engine.step(rollout)))
        engine.update_weights()
    return rows


def test_partitioned_grpo_matches_colocated_metric_keys(tmp_path):
    colocated_cfg = _config(tmp_path)
    assert not is_partitioned(colocated_cfg)
    colocated = ArenoEngine(colocated_cfg, tmp_path / "run")
    colocated.initialize()
    try:
        ref = _two_steps(colocated)
    finally:
        colocated.shutdown()

    cfg = _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[1]")
    assert is_partitioned(cfg)
    engine = PartitionedArenoEngine(cfg, tmp_path / "run")
    import time
    t0 = time.time()
    engine.initialize()
    print("init", time.time() - t0)
    try:
        assert [(h.rank, h.role) for h in engine.scheduler.workers("train") + engine.scheduler.workers("rollout")] \
            == [(0, "train"), (1, "rollout")]
        got = _two_steps(engine)
        versions = engine.scheduler.call("rollout", "version")
        accuracy = engine.evaluate()
        engine.export_policy(tmp_path / "export")
    finally:
        engine.shutdown()

    for (r_ref, m_ref), (r_got, m_got) in zip(ref, got):
        assert set(r_got.metrics) == set(r_ref.metrics)
        assert set(m_got) == set(m_ref), set(m_got) ^ set(m_ref)
        assert all(isinstance(v, float) and v == v for v in m_got.values())  # finite floats, no NaN
        assert r_got.batch.input_ids_T.numel() > 0 and len(r_got.trajectories) == 2 * 4
    first, second = got[0][1], got[1][1]
    assert "policy_sync_time_s" not in first and second["policy_sync_bytes"] > 0
    assert second["policy_sync_tensors"] == got[0][1].get("policy_sync_tensors", second["policy_sync_tensors"])
    assert 0.0 <= got[1][0].metrics["rollout/reward_mean"] <= 2.0
    # the rollout engine got each new policy; the second rollout ran on version 1
    assert versions == [2] and engine.version == 2
    assert {v for t in got[1][0].trajectories for v in t.versions} == {1}
    assert set(accuracy) == {"eval/accuracy", "eval/num_prompts", "eval/time_s"}
    # the exported policy is the trained one (its weights moved away from the initial checkpoint)
    from areno.models.hf_io import load_model

    before, _ = load_model(tmp_path / "model", dtype=torch.float32, device="cpu")
    after, _ = load_model(tmp_path / "export", dtype=torch.float32, device="cpu")
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


def test_partitioned_engine_refuses_colocated_config_and_offline_recipe(tmp_path):
    with pytest.raises(LayoutError, match="needs cluster.train_devices"):
        PartitionedArenoEngine(_config(tmp_path), tmp_path / "run").initialize()
    with pytest.raises(ValueError, match="trains offline"):
        PartitionedArenoEngine(_config(tmp_path, "train.algorithm=sft", "cluster.train_devices=[0]",
                                       "cluster.rollout_devices=[1]"), tmp_path / "run").initialize()
