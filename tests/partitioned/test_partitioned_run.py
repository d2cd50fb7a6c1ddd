"""A partitioned run on CPU: 1 training + 1 rollout worker process in one gloo world."""

import concurrent.futures

import pytest
import torch
from transformers import AutoTokenizer  # noqa: F401 - imported before two threads race to import it

from areno.api.config import load_config
from areno.engine.api import prepare_model_dir
from areno.engine.cluster import LayoutError
from areno.engine.local import LocalRolloutSide, LocalTrainingSide
from areno.engine.partitioned import is_partitioned
from areno.engine.placement import build_engine, partitioned_engine
from areno.engine.remote import RemoteRolloutSide, RemoteTrainingSide
from tests.helpers.configs import tiny_run_overrides


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            *tiny_run_overrides(tmp_path),
            *extra,
        ],
    )


PARTITIONED_ONLY = (
    "rollout/engine_",
    "rollout/healthy_servers",
    "rollout/unhealthy_servers",
    "rollout/server_",
    "policy_sync_phase_",
    "policy_sync_rollout_phase_",
    "policy_sync_controller",
)
"""Metric name prefixes a partitioned run logs beyond a colocated run's."""


def _two_steps(engine):
    rows = []
    for i in range(2):
        rollout = engine.generate_rollout(i)
        rows.append((rollout, engine.step(rollout)))
        engine.update_weights()
    return rows


def test_partitioned_grpo_matches_colocated_metric_keys(tmp_path):
    cfg = _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[1]")
    assert is_partitioned(cfg)
    prepare_model_dir(cfg)  # once, before the two engines start side by side
    engine = build_engine(cfg, tmp_path / "run")
    assert isinstance(engine.training, RemoteTrainingSide) and isinstance(engine.rollout, RemoteRolloutSide)
    scheduler = lambda: engine.rollout.cluster.scheduler
    # the workers start (processes, imports) while the colocated reference runs here
    starting = concurrent.futures.ThreadPoolExecutor(1).submit(engine.initialize)
    colocated_cfg = _config(tmp_path)
    assert not is_partitioned(colocated_cfg)
    colocated = build_engine(colocated_cfg, tmp_path / "run")
    assert isinstance(colocated.training, LocalTrainingSide) and isinstance(colocated.rollout, LocalRolloutSide)
    colocated.initialize()
    try:
        ref = _two_steps(colocated)
    finally:
        colocated.shutdown()
    try:
        starting.result()
        assert [(h.rank, h.role) for h in scheduler().workers("train") + scheduler().workers("rollout")] == [
            (0, "train"),
            (1, "rollout"),
        ]
        got = _two_steps(engine)
        versions = scheduler().call("rollout", "version")
        accuracy = engine.evaluate()
        engine.export_policy(tmp_path / "export")
    finally:
        engine.shutdown()

    engine_keys = {
        "rollout/engine_0_busy_frac",
        "rollout/engine_busy_frac",
        "rollout/engine_generated_tokens_per_s",
        "rollout/engine_preemptions",
        "rollout/engine_kv_usage_max",
        "rollout/engine_graph_captures",
        "rollout/engine_graph_capture_s",
        "rollout/engine_prefill_tokens",
        "rollout/engine_mixed_steps",
        "rollout/engine_steps",
        "rollout/engine_round_trips",
        "rollout/engine_graph_deferred_steps",
    }
    for step, ((r_ref, m_ref), (r_got, m_got)) in enumerate(zip(ref, got)):
        # the same keys, plus the health monitor's view of the rollout replicas and, from the
        # second step (a difference of counters), the rollout engines' own figures
        health = {"rollout/healthy_servers", "rollout/unhealthy_servers", "rollout/server_0_healthy"}
        assert set(r_got.metrics) == set(r_ref.metrics) | health | (engine_keys if step else set())
        # (a /health miss on a loaded machine may briefly mark the one replica unhealthy)
        assert r_got.metrics["rollout/healthy_servers"] + r_got.metrics["rollout/unhealthy_servers"] == 1.0
        # plus, once a sync ran, where the partitioned sync's time went: each phase on the training
        # rank and the slowest rollout rank, and the controller's own share
        breakdown = {
            k
            for k in m_got
            if k.startswith(("policy_sync_phase_", "policy_sync_rollout_phase_", "policy_sync_controller"))
        }
        assert set(m_got) - breakdown == set(m_ref), (set(m_got) - breakdown) ^ set(m_ref)
        if "policy_sync_time_s" in m_got:
            assert {
                "policy_sync_phase_pack_s",
                "policy_sync_phase_device_sync_s",
                "policy_sync_rollout_phase_commit_s",
                "policy_sync_rollout_phase_hold_captures_s",
                "policy_sync_rollout_phase_wake_s",
                "policy_sync_controller_check_s",
                "policy_sync_controller_s",
            } <= breakdown
            assert m_got["policy_sync_rollout_phase_commit_s"] > 0 and m_got["policy_sync_phase_commit_s"] == 0
            assert m_got["policy_sync_controller_s"] >= m_got["policy_sync_controller_check_s"]
        assert all(isinstance(v, float) and v == v for v in m_got.values())  # finite floats, no NaN
        assert r_got.batch.input_ids_T.numel() > 0 and len(r_got.trajectories) == 2 * 4
    busy = got[1][0].metrics["rollout/engine_busy_frac"]
    assert 0.0 < busy <= 1.0 and got[1][0].metrics["rollout/engine_generated_tokens_per_s"] > 0
    first, second = got[0][1], got[1][1]
    assert "policy_sync_time_s" not in first and second["policy_sync_bytes"] > 0
    assert second["policy_sync_tensors"] == got[0][1].get("policy_sync_tensors", second["policy_sync_tensors"])
    assert 0.0 <= got[1][0].metrics["rollout/reward_mean"] <= 2.0
    # the rollout engine got each new policy; the second rollout ran on version 1
    assert versions == [2] and engine.version == 2
    assert {v for t in got[1][0].trajectories for v in t.versions} == {1}
    assert set(accuracy) == {
        "eval/accuracy", "eval/num_prompts", "eval/samples_per_prompt", "eval/pass@1", "eval/reward_errors",
        "eval/completion_tokens_mean", "eval/truncated_fraction", "eval/time_s",
    }  # fmt: skip
    # the exported policy is the trained one (its weights moved away from the initial checkpoint)
    from areno.models.hf_io import load_model

    before, _ = load_model(tmp_path / "model", dtype=torch.float32, device="cpu")
    after, _ = load_model(tmp_path / "export", dtype=torch.float32, device="cpu")
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


def test_memory_check_refuses_an_overlapping_layout_before_launch(tmp_path):
    # both workers on logical device 0 of 1 MiB: the tiny model's training state alone does not fit
    engine = partitioned_engine(
        _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[0]"),
        tmp_path / "run",
        device_capacity=1 << 20,
    )
    with pytest.raises(
        LayoutError, match=r"^device 0 needs ~\d+\.\d+ GiB \(train_model_grad_optim .* but has 0\.00 GiB"
    ):
        engine.initialize()
    assert engine.rollout.cluster.scheduler is None  # nothing was launched


def test_partitioned_engine_refuses_colocated_config_and_offline_recipe(tmp_path):
    with pytest.raises(LayoutError, match="needs cluster.train_devices"):
        partitioned_engine(_config(tmp_path), tmp_path / "run").initialize()
    sft = _config(tmp_path, "train.algorithm=sft", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]")
    assert not is_partitioned(sft)  # ArenoBackend runs it colocated
    assert isinstance(build_engine(sft, tmp_path / "run").training, LocalTrainingSide)
    with pytest.raises(ValueError, match="trains offline"):
        partitioned_engine(sft, tmp_path / "run").initialize()


@pytest.mark.slow
def test_async_train_dp2_to_rollout_dp2_with_save_and_load(tmp_path):
    """η = 1 (everlasting pool), FSDP over 2 training ranks, 2 rollout replicas; a checkpoint
    saved mid-run loads back (version, data position) and the policy streams again."""
    cfg = _config(
        tmp_path,
        "cluster.train_devices=[0, 1]",
        "cluster.rollout_devices=[2, 3]",
        "rollout.max_head_offpolicyness=1",
        "rollout.max_concurrent=4",
    )
    engine = partitioned_engine(cfg, tmp_path / "run")
    engine.initialize()
    cluster = engine.rollout.cluster
    try:
        assert cluster.layout.train_mesh_shape == (1, 2, 1) and cluster.layout.sender_ranks == (0, 1)
        assert [h.rank for h in cluster.scheduler.workers("rollout")] == [2, 3]
        rows = _two_steps(engine)
        for rollout, metrics in rows:
            assert "rollout/staleness_max" in rollout.metrics and rollout.metrics["rollout/staleness_max"] <= 1
            assert "train/policy/loss" in metrics
        assert rows[1][1]["policy_sync_bytes"] > 0
        # both replicas served requests (round-robin)
        assert all(n > 0 for n in engine.rollout.client.requests_per_server)
        ckpt = tmp_path / "ckpt"
        engine.save(ckpt, {"step": 2})
        assert (ckpt / "COMPLETE").exists() and (ckpt / "hf" / "config.json").exists()
        # the running pool has samples in flight: a checkpoint loads only into a new engine
        with pytest.raises(
            RuntimeError,
            match=r"rollout pool has started \(\d+ samples handed out\); load a "
            "checkpoint into a new engine",
        ):
            engine.load(ckpt)
    finally:
        engine.shutdown()
    # resume: a new engine loads the checkpoint before its first rollout
    engine = partitioned_engine(cfg, tmp_path / "run2")
    engine.initialize()
    cluster = engine.rollout.cluster
    try:
        state = engine.load(ckpt)
        assert state["step"] == 2 and engine.version == 2
        assert engine.train_stream.state_dict() == state["data"]["stream"]
        # the checkpoint's untrained samples are replayed first, none handed out yet
        assert engine.ledger.num_handed_out == 0 and engine.ledger.num_pending == len(state["data"]["pending"]) > 0
        assert cluster.scheduler.call("rollout", "version") == [2, 2]  # the loaded policy, synced as v2
        rollout, metrics = _two_steps(engine)[0]
        assert "train/policy/loss" in metrics and rollout.metrics["rollout/staleness_max"] <= 1
        assert cluster.scheduler.call("rollout", "version") == [4, 4]
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_hsdp_replicas_train_as_fsdp_over_the_same_ranks(tmp_path):
    """``cluster.train_dp_replicate=2``: two replicas of a one-rank FSDP group (HSDP) train the first
    step as FSDP sharding over both ranks does: the same rollout, the same loss and gradient norm up
    to summation order; the policy streams from the replicas to the rollout worker."""
    runs = {}
    for replicas in (1, 2):
        cfg = _config(
            tmp_path,
            "cluster.train_devices=[0, 1]",
            "cluster.rollout_devices=[2]",
            f"cluster.train_dp_replicate={replicas}",
        )
        engine = partitioned_engine(cfg, tmp_path / f"run{replicas}")
        engine.initialize()
        try:
            assert engine.rollout.cluster.layout.train_mesh_shape == (replicas, 2 // replicas, 1)
            runs[replicas] = _two_steps(engine)
        finally:
            engine.shutdown()
    (fsdp_rollout, fsdp_metrics), (hsdp_rollout, hsdp_metrics) = runs[1][0], runs[2][0]
    assert torch.equal(hsdp_rollout.batch.input_ids_T, fsdp_rollout.batch.input_ids_T)
    for key in ("train/policy/loss", "train/policy/grad_norm"):
        assert hsdp_metrics[key] == pytest.approx(fsdp_metrics[key], rel=1e-5, abs=1e-7), key
    assert runs[2][1][1]["policy_sync_bytes"] > 0 and "train/policy/loss" in runs[2][1][1]


@pytest.mark.slow
def test_dead_rollout_replica_requests_rerouted_then_sync_refused(tmp_path):
    """rollout[1] dies: the batch still completes on rollout[0] (no trajectory lost or
    duplicated); the next policy sync is refused with a one-line error naming the worker."""
    import os
    import signal

    from areno.engine.partitioned import WorkerLostError

    cfg = _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[1, 2]")
    engine = partitioned_engine(cfg, tmp_path / "run")
    engine.initialize()
    try:
        dead = engine.rollout.cluster.scheduler.workers("rollout")[1]
        os.kill(dead.pid, signal.SIGKILL)
        rollout = engine.generate_rollout(0)
        assert len(rollout.trajectories) == 2 * 4
        prompts = [t.info.get("prompt") for t in rollout.trajectories]
        assert all(prompts.count(p) == 4 for p in prompts)  # two groups of 4, nothing duplicated
        # each group is one /generate_many request (RolloutClient.agenerate_many): both went to rollout[0]
        assert engine.rollout.client.requests_per_server[1] == 0 and engine.rollout.client.requests_per_server[0] == 2
        engine.step(rollout)
        with pytest.raises(WorkerLostError, match=r"^rollout\[1\] \(pid \d+\) died"):
            engine.update_weights()
        assert engine.version == 0
    finally:
        engine.shutdown()


def test_every_rollout_replica_dead_fails_requests_at_once(tmp_path):
    """The only rollout worker dies: a rollout (and the evaluation) fails at once with a one-line
    error naming the worker, instead of waiting rollout.request_timeout_s (600 s by default) for a
    recovery that cannot come (a world cannot take a new process)."""
    import os
    import signal
    import time

    from areno.rollout.client import RolloutServersLost

    cfg = _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[1]")
    engine = partitioned_engine(cfg, tmp_path / "run")
    engine.initialize()
    try:
        assert engine.rollout.lost_replicas() == {}
        dead = engine.rollout.cluster.scheduler.workers("rollout")[0]
        os.kill(dead.pid, signal.SIGKILL)
        t0 = time.monotonic()
        # until the side knows (its answer is cached for a second), a request could fail on the dead server
        # often enough to end as NoHealthyServerError first
        while not engine.rollout.lost_replicas():
            assert time.monotonic() - t0 < 30, "the killed rollout worker was never found dead"
            time.sleep(0.1)
        with pytest.raises(
            RolloutServersLost,
            match=r"^every rollout server is gone: http://127\.0\.0\.1:\d+: "
            r"rollout\[0\] \(pid \d+\) died; .* start it again \(no checkpoint yet\) "
            r"\(log: .*rollout-0\.log\)$",
        ):
            engine.generate_rollout(0)
        with pytest.raises(RolloutServersLost, match=r"rollout\[0\] \(pid \d+\) died"):
            engine.evaluate()
        assert time.monotonic() - t0 < 60
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_partitioned_on_two_gpus_overlapping_lists(tmp_path):
    """Both lists [0, 1]: each GPU holds a training and a rollout worker; NCCL subgroups in a gloo
    world, relays on the other GPU. Same metric keys as the CPU run, finite values."""
    cfg = _config(
        tmp_path,
        "cluster.device=cuda",
        "cluster.train_devices=[0, 1]",
        "cluster.rollout_devices=[0, 1]",
        "rollout.kv_blocks=256",
    )
    engine = partitioned_engine(cfg, tmp_path / "run")
    engine.initialize()
    cluster = engine.rollout.cluster
    try:
        assert cluster.layout.overlapping == (0, 1) and cluster.layout.relays() == [3, 2]
        rows = _two_steps(engine)
        assert rows[1][1]["policy_sync_bytes"] > 0 and "train/policy/loss" in rows[1][1]
        assert all(v == v for v in rows[1][1].values())
        assert cluster.scheduler.call("rollout", "version") == [2, 2]
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_trainer_loop_on_arenobackend_colocated_and_partitioned(tmp_path):
    """The Trainer's loop (rollout, train, sync, checkpoint) on ArenoBackend, which builds the
    engine's sides from the config: metrics.jsonl has the colocated run's keys; the final
    checkpoint completes."""
    import json

    from areno.api.trainer import Trainer

    def run(name, *extra):
        cfg = _config(tmp_path / name, "train.steps=2", "train.eval_interval=0", *extra)
        trainer = Trainer.init(cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
        rows = [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
        return rows, tmp_path / name / "run"

    ref, _ = run("colocated")
    got, run_dir = run("partitioned", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]")
    keys = lambda rows: set().union(*(r.keys() for r in rows)) - {"time", "wall_time"}
    # the colocated run's keys, plus what only a partitioned run has: the replicas' health, the
    # rollout engines' own counters, and where each policy sync's time went
    extra = {k for k in keys(got) if k.startswith(PARTITIONED_ONLY)}
    assert extra and keys(got) - extra == keys(ref), (keys(got) - extra) ^ keys(ref)
    assert (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists()
