"""Partitioned rollout with tensor parallelism: training TP 2 and rollout TP 2 in one gloo world.

The run (``slow``): 2 training ranks (one DP row of TP 2) and 2 rollout ranks (one replica of TP 2),
three GRPO steps; after each sync every rollout rank holds exactly its slice of the trained policy,
and the rollouts and losses equal a colocated run's. The default run checks the keys and the
one-line errors without starting a worker.
"""

import pickle

import pytest
import torch

from areno.api.config import load_config
from areno.engine.api import prepare_model_dir
from areno.engine.cluster import LayoutError
from areno.engine.placement import build_engine, partitioned_engine
from areno.errors import ConfigError
from areno.models.hf_io import load_model
from areno.models.tp_plan import shard_tensor, tp_plan, tp_style
from tests.helpers.configs import tiny_run_overrides

TP_MODEL = "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 2, intermediate_size: 64, tie_word_embeddings: true}"
"""The tiny model with as many KV heads as the TP size (one cannot be split) and a tied output
projection (the char tokenizer's 105 tokens cannot be split in two)."""


def _config(tmp_path, *extra):
    return load_config(None, [*tiny_run_overrides(tmp_path), TP_MODEL, *extra])


PLAIN_KEYS = (
    "cluster.train_devices=[0, 1]",
    "cluster.rollout_devices=[2, 3]",
    "cluster.train_tp=2",
    "cluster.rollout_tp=2",
)
ALLOCATION = ("cluster.allocation_mode=areno:d1t2+fsdp:d1t2",)


@pytest.mark.parametrize("keys", [PLAIN_KEYS, ALLOCATION], ids=["keys", "allocation_mode"])
def test_tp_layout_from_keys_and_allocation_mode(tmp_path, keys):
    layout = partitioned_engine(_config(tmp_path, *keys), tmp_path / "run").rollout.cluster.layout
    assert (layout.train_tp, layout.rollout_tp, layout.train_mesh_shape) == (2, 2, (1, 1, 2))
    assert layout.sender_ranks == (0,) and layout.rollout_tp_groups() == [(2, 3)] and layout.relays() == [2]


def test_tp_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^cluster.rollout_tp: 3 does not divide the 2 devices"):
        _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[1, 2]", "cluster.rollout_tp=3")
    with pytest.raises(ConfigError, match=r"^cluster.train_tp: 2 needs the partitioned placement"):
        _config(tmp_path, "cluster.train_tp=2")
    with pytest.raises(ConfigError, match=r"^cluster.rollout_tp: .*give TP as its t \(e.g. 'areno:d1t2\+fsdp:d1t2'\)$"):
        _config(tmp_path, *ALLOCATION, "cluster.rollout_tp=2")
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), *ALLOCATION, "cluster.allocation_mode=areno:d2+fsdp:d1t2"])
    assert partitioned_engine(cfg, tmp_path / "run").rollout.cluster.layout.train_tp == 2
    asynchronous = (*ALLOCATION, "rollout.max_head_offpolicyness=1")
    with pytest.raises(LayoutError, match=r"rollout TP 2 with asynchronous RL needs cluster.sync_commit=staged"):
        partitioned_engine(_config(tmp_path, *asynchronous, "cluster.sync_commit=inplace"), tmp_path / "run")
    assert partitioned_engine(_config(tmp_path, *asynchronous), tmp_path / "run").rollout.cluster.layout.rollout_tp == 2


@pytest.mark.parametrize(
    ("keys", "named"),
    [(ALLOCATION, r"cluster.allocation_mode='areno:d1t2\+fsdp:d1t2' \(t2\)"), (PLAIN_KEYS, "cluster.train_tp=2")],
    ids=["allocation_mode", "keys"],
)
def test_tp_that_does_not_split_the_heads_fails_before_any_worker_starts(tmp_path, keys, named):
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), *keys])  # the tiny model has one KV head
    prepare_model_dir(cfg)
    engine = partitioned_engine(cfg, tmp_path / "run")
    with pytest.raises(LayoutError, match=rf"^{named}: tp_size=2 does not divide "):
        engine.initialize()
    assert engine.rollout.cluster.scheduler is None


def _slices(policy_dir, tp_size):
    """Each rollout TP rank's slice of every tensor of an exported policy."""
    model, model_config = load_model(policy_dir, dtype=torch.float32, device="cpu")
    plan = tp_plan(model_config)
    full = model.state_dict()
    return [{n: shard_tensor(t, tp_style(plan, n), rank, tp_size) for n, t in full.items()} for rank in range(tp_size)]


def _steps(engine, n, check=None):
    rows = []
    for i in range(n):
        rollout = engine.generate_rollout(i)
        metrics = engine.step(rollout)
        engine.update_weights()
        if check is not None:
            check(i)
        rows.append((rollout, metrics))
    return rows


def _run_checking_shards(cfg, tmp_path, steps):
    """``steps`` GRPO steps of a partitioned run; after each sync, every rollout rank's weights
    must equal its slice of the trained policy (in the rollout dtype)."""
    engine = partitioned_engine(cfg, tmp_path / "run")
    engine.initialize()
    scheduler = engine.rollout.cluster.scheduler
    tp = engine.rollout.cluster.layout.rollout_tp

    def shards_equal_slices(i):
        engine.export_policy(tmp_path / f"policy{i}")
        want = _slices(tmp_path / f"policy{i}", tp)
        got = [pickle.loads(b) for b in scheduler.call("rollout", "weight_shards")]
        for rank in range(len(got)):
            assert got[rank] and set(got[rank]) <= set(want[rank % tp])  # (a tied lm_head is the embedding)
            for name, t in got[rank].items():
                assert torch.equal(t, want[rank % tp][name].to(t.dtype)), (i, rank, name)

    try:
        rows = _steps(engine, steps, shards_equal_slices)
        n_rollout = engine.rollout.cluster.layout.n_rollout
        assert scheduler.call("rollout", "version") == [steps] * n_rollout and engine.version == steps
    finally:
        engine.shutdown()
    return rows


@pytest.mark.slow  # over 10 s: the default suite keeps within its 10 minutes
def test_allocation_mode_tp2_one_step_syncs_every_shard(tmp_path):
    """The quick real run: ``areno:d1t2+fsdp:d1t2``, one step and its sync."""
    cfg = _config(tmp_path, *ALLOCATION, "data.num_eval=0")
    prepare_model_dir(cfg)
    ((rollout, metrics),) = _run_checking_shards(cfg, tmp_path, 1)
    assert len(rollout.trajectories) == 2 * 4 and "train/policy/loss" in metrics


@pytest.mark.slow  # four worker processes and a colocated reference on the CPU
def test_train_tp2_rollout_tp2_three_steps_match_colocated(tmp_path):
    cfg = _config(tmp_path, *PLAIN_KEYS)
    prepare_model_dir(cfg)
    colocated = build_engine(_config(tmp_path), tmp_path / "ref")
    colocated.initialize()
    try:
        ref = _steps(colocated, 3)
    finally:
        colocated.shutdown()
    got = _run_checking_shards(cfg, tmp_path, 3)
    for (r_ref, m_ref), (r_got, m_got) in zip(ref, got):
        assert [t.completion_ids for t in r_got.trajectories] == [t.completion_ids for t in r_ref.trajectories]
        assert r_got.metrics["rollout/reward_mean"] == pytest.approx(r_ref.metrics["rollout/reward_mean"])
        assert m_got["train/policy/loss"] == pytest.approx(m_ref["train/policy/loss"], rel=1e-4, abs=1e-6)
        assert "rollout/engine_1_busy_frac" not in r_got.metrics  # one replica, counted once
    # the policy moved: the last sync carried trained weights, not the initial ones
    initial, _ = load_model(tmp_path / "model", dtype=torch.float32, device="cpu")
    trained, _ = load_model(tmp_path / "policy2", dtype=torch.float32, device="cpu")
    assert any(not torch.equal(a, b) for a, b in zip(initial.state_dict().values(), trained.state_dict().values()))


@pytest.mark.slow  # four worker processes
def test_two_training_rows_relay_to_both_rollout_tp_shards(tmp_path):
    """Overlapping lists, FSDP over 2 training rows: each row streams its half of the bytes to
    its own relay, one rollout TP shard each, which keeps its slice and fans the rest out to the
    other shard (on GPU the relay of each row sits on the other GPU: ``test_gpu_train_tp2_rollout_tp2``).
    Received in place (``cluster.sync_commit=inplace``) into both shards."""
    cfg = _config(
        tmp_path,
        "cluster.train_devices=[0, 1]",
        "cluster.rollout_devices=[0, 1]",
        "cluster.rollout_tp=2",
        "cluster.sync_commit=inplace",  # (the other runs commit staged)
    )
    prepare_model_dir(cfg)
    layout = partitioned_engine(cfg, tmp_path / "plan").rollout.cluster.layout
    assert layout.sender_ranks == (0, 1) and layout.relays() == [2, 3]
    rows = _run_checking_shards(cfg, tmp_path, 2)
    assert rows[-1][1]["policy_sync_bytes"] > 0


@pytest.mark.slow  # four worker processes
def test_asynchronous_tp_replica_switches_weights_on_every_rank_at_once(tmp_path):
    """η = 1: the replica generates while a sync lands; its TP ranks commit at the leader's step."""
    cfg = _config(tmp_path, *ALLOCATION, "rollout.max_head_offpolicyness=1", "data.num_eval=0")
    prepare_model_dir(cfg)
    rows = _run_checking_shards(cfg, tmp_path, 3)
    assert all(r.metrics["rollout/staleness_max"] <= 1 for r, _ in rows)
    assert {v for t in rows[-1][0].trajectories for v in t.versions} <= {1, 2}


GPU_LAYOUTS = {
    # both roles on the same two GPUs: the training row's sender sits on GPU 0, so its relay is the
    # rollout TP rank on GPU 1, which fans the buckets out to the rank beside the sender
    2: (
        "cluster.train_devices=[0, 1]",
        "cluster.rollout_devices=[0, 1]",
        "cluster.train_tp=2",
        "cluster.rollout_tp=2",
        "rollout.kv_blocks=256",  # a shared GPU: a bounded KV pool beside the training state
    ),
    4: ALLOCATION,
}


@pytest.mark.gpu
@pytest.mark.parametrize("n_gpus", sorted(GPU_LAYOUTS))
def test_gpu_train_tp2_rollout_tp2(tmp_path, n_gpus):
    """``pytest -m gpu tests/partitioned/test_rollout_tp.py`` on a machine with 2 (or 4) GPUs."""
    if torch.cuda.device_count() < n_gpus:
        pytest.skip(f"needs {n_gpus} CUDA devices, found {torch.cuda.device_count()}")
    overrides = [o for o in tiny_run_overrides(tmp_path) if o not in ("cluster.device=cpu", "cluster.cpu_threads=1")]
    cfg = load_config(None, [*overrides, TP_MODEL, "cluster.device=cuda", *GPU_LAYOUTS[n_gpus]])
    prepare_model_dir(cfg)
    layout = partitioned_engine(cfg, tmp_path / "plan").rollout.cluster.layout
    assert layout.relays() == ([3] if n_gpus == 2 else [2])
    rows = _run_checking_shards(cfg, tmp_path, 3)
    assert all(m["train/policy/loss"] == m["train/policy/loss"] for _, m in rows)  # finite
    assert rows[-1][1]["policy_sync_bytes"] > 0


@pytest.mark.slow  # four worker processes
def test_trainer_run_with_tp_allocation_mode_evaluates_and_checkpoints(tmp_path):
    """The Trainer's loop on ``areno:d1t2+fsdp:d1t2``: rollout, train, sync, evaluation (served by
    the TP leader, mirrored to its follower) and a checkpoint of the TP-sharded training state."""
    import json

    from areno.api.trainer import Trainer

    cfg = _config(tmp_path, *ALLOCATION, "train.steps=2", "train.eval_interval=2")
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/policy/loss" in r for r in rows) and any("eval/accuracy" in r for r in rows)
    assert (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists()


def test_tp_of_a_model_whose_qk_norms_read_every_head_fails_before_any_worker_starts(tmp_path):
    # OLMo 2 norms q and k over all heads together: a TP rank holding half of them would norm another vector
    olmo2 = "model.init_tiny={arch: olmo2, hidden_size: 32, layers: 1, heads: 2, kv_heads: 2, intermediate_size: 64}"
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), *ALLOCATION, olmo2])
    prepare_model_dir(cfg)
    engine = partitioned_engine(cfg, tmp_path / "run")
    with pytest.raises(
        LayoutError, match=r"\(t2\): tp_size=2: Olmo2ForCausalLM normalises q and k over all heads.*use tp_size=1$"
    ):
        engine.initialize()
    assert engine.rollout.cluster.scheduler is None
