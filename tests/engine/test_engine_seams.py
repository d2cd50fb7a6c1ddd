"""The engine's two seams: ``TrainingSide`` and ``RolloutSide`` through their public contracts.

The in-process sides run a real tiny model here; the remote sides are exercised end to end by
``tests/partitioned`` (worker processes), and here over a stand-in cluster for what the
controller itself computes (the sync's figures, the version, the engine counters).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import pkgutil
import re
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import areno.engine
from areno.api.config import load_config
from areno.engine.api import ArenoEngine, load_tokenizer, prepare_model_dir, resolve_recipe
from areno.engine.local import LocalRolloutSide, LocalTrainingSide
from areno.engine.placement import build_engine
from areno.engine.remote import RemoteRolloutSide, RemoteTrainingSide, engine_metrics
from areno.engine.seams import SideSetup, WeightKind, WeightUpdate, choose_weight_kind
from areno.errors import ConfigError
from areno.types import SamplingParams, TokenBatch, Trajectory

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
            "data.task=arithmetic",
            "rollout.max_new_tokens=4",
            "cluster.device=cpu",
            "observe.console=false",
            "optim.lr=0.05",
            *extra,
        ],
    )


# ------------------------------------------------------------------------- one engine, no probes
def test_arenoengine_has_no_subclass_and_no_attribute_probes():
    for info in pkgutil.walk_packages(areno.engine.__path__, "areno.engine."):
        importlib.import_module(info.name)
    importlib.import_module("areno.api.backend")
    assert ArenoEngine.__subclasses__() == []
    tree = ast.parse((ROOT / "areno/engine/api.py").read_text())
    engine_cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ArenoEngine")
    probes = [
        n.lineno
        for n in ast.walk(engine_cls)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
    ]
    assert probes == []


def test_build_engine_places_both_sides_together(tmp_path):
    colocated = build_engine(_config(tmp_path), tmp_path / "run")
    assert isinstance(colocated.training, LocalTrainingSide) and isinstance(colocated.rollout, LocalRolloutSide)
    assert colocated.weight_kind is WeightKind.IN_PROCESS
    partitioned = build_engine(
        _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[1]"), tmp_path / "run"
    )
    assert isinstance(partitioned.training, RemoteTrainingSide) and isinstance(partitioned.rollout, RemoteRolloutSide)
    assert partitioned.training.cluster is partitioned.rollout.cluster
    assert partitioned.weight_kind is WeightKind.COLLECTIVE


def test_a_pairing_without_a_common_weight_kind_is_a_config_error(tmp_path):
    assert choose_weight_kind(frozenset(WeightKind), frozenset({WeightKind.DISK})) is WeightKind.DISK
    cfg = _config(tmp_path, "cluster.train_devices=[0]", "cluster.rollout_devices=[1]")
    remote = build_engine(cfg, tmp_path / "run")
    local = LocalTrainingSide(cfg, torch.device("cpu"), export_root=tmp_path)
    with pytest.raises(ConfigError, match=r"sends the policy as \['collective'\] but the rollout side receives"):
        ArenoEngine(cfg, tmp_path, training=remote.training, rollout=LocalRolloutSide(cfg, torch.device("cpu")))
    # a local training side and a remote rollout side have no way in common today
    with pytest.raises(ConfigError, match=r"receives \['collective'\]"):
        ArenoEngine(cfg, tmp_path, training=local, rollout=remote.rollout)


@pytest.mark.parametrize(
    "mode, words",
    [
        ("areno:d1+megatron:d1", "training backend 'megatron' (megatron[actor]:d1) is not supported: use fsdp"),
        (
            "vllm:d1+fsdp:d2",
            "fsdp[actor]:d2 with a vllm rollout: training runs in this process on one device with inference "
            "servers; use fsdp:d1",
        ),
    ],
)
def test_allocation_backends_areno_cannot_run_are_refused_at_validation(mode, words):
    with pytest.raises(ConfigError, match="^" + re.escape(f"cluster.allocation_mode: {words}")):
        load_config(None, ["model.path=m", f"cluster.allocation_mode={mode!r}"])
    load_config(None, ["model.path=m", "cluster.allocation_mode='areno:d1+fsdp:d1'"])  # supported
    load_config(None, ["model.path=m", "cluster.allocation_mode='vllm:d2+fsdp:d1'"])  # inference servers
    load_config(None, ["model.path=m", "cluster.allocation_mode='sglang:t2+fsdp:d1'"])


def test_backend_contract_does_not_import_the_areno_backend_back():
    from areno.api.backend.areno.backend import ArenoBackend
    from areno.api.backend.base import resolve_backend

    assert resolve_backend("areno") is ArenoBackend
    imported = {
        node.module
        for node in ast.walk(ast.parse((ROOT / "areno/api/backend/base.py").read_text()))
        if isinstance(node, ast.ImportFrom)
    }
    assert not any(m.startswith(("areno.api.backend.areno", "areno.engine.api")) for m in imported), imported


# ------------------------------------------------------------------------- the in-process sides
@pytest.fixture
def local_sides(tmp_path):
    cfg = _config(tmp_path, "rollout.temperature=1.0")
    model_dir = prepare_model_dir(cfg)
    setup = SideSetup(recipe=resolve_recipe(cfg), model_dir=model_dir, tokenizer=load_tokenizer(model_dir))
    cpu = torch.device("cpu")
    training = LocalTrainingSide(cfg, cpu, export_root=tmp_path / "policy")
    rollout = LocalRolloutSide(cfg, cpu)
    training.start(setup)
    rollout.start(setup)
    yield training, rollout, setup
    rollout.shutdown()
    training.shutdown()


def _group(rollout, tokenizer) -> TokenBatch:
    """Four samples of one prompt from the rollout side's client, rewarded by length."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)

    async def agenerate():
        return await asyncio.gather(*(rollout.client.agenerate(tokenizer.encode("1+2="), params) for _ in range(4)))

    outs = asyncio.run(agenerate())
    return TokenBatch.from_trajectories(
        [
            Trajectory(
                prompt_ids=o.prompt_ids,
                completion_ids=o.output_ids,
                logprobs=o.output_logprobs,
                versions=o.output_versions,
                reward=float(i),
                group_id="g",
            )
            for i, o in enumerate(outs)
        ]
    )


def _engine_matches_policy(training, rollout) -> bool:
    trained = dict(training.runner.backends[training.policy].named_weights())
    return all(torch.equal(t, trained[name]) for name, t in rollout.engine.weight_tensors().items())


@pytest.mark.parametrize("kind", [WeightKind.IN_PROCESS, WeightKind.DISK])
def test_local_sides_train_then_sync_each_weight_kind(local_sides, kind):
    training, rollout, setup = local_sides
    assert rollout.version == 0 and rollout.metrics() == {}
    batch = _group(rollout, setup.tokenizer)
    metrics = training.step(batch, pass_order=None, policy_version=rollout.version)
    assert "policy/loss" in metrics
    assert not _engine_matches_policy(training, rollout)  # trained: the rollout policy is behind
    update = training.publish_weights(1, kind)
    assert update.version == 1 and update.kind is kind
    rollout.pause()  # as the engine brackets an asynchronous sync
    sync = rollout.update_weights(update)
    rollout.resume()
    assert rollout.version == 1 and sync["policy_sync_bytes"] > 0
    assert _engine_matches_policy(training, rollout)
    out = _group(rollout, setup.tokenizer)  # generation continues on the new policy
    assert set(out.versions_T[out.loss_mask_T].tolist()) == {1}


@pytest.mark.parametrize("eta", [0, 2])
def test_local_rollout_side_is_stepped_by_the_trainer_thread_when_synchronous_on_cpu(tmp_path, eta):
    # one OpenMP thread team in a synchronous CPU process (InProcessRolloutClient's docstring)
    cfg = _config(tmp_path, f"rollout.max_head_offpolicyness={eta}")
    model_dir = prepare_model_dir(cfg)
    setup = SideSetup(recipe=resolve_recipe(cfg), model_dir=model_dir, tokenizer=load_tokenizer(model_dir))
    rollout = LocalRolloutSide(cfg, torch.device("cpu"))
    rollout.start(setup)
    try:
        assert rollout.client.caller_drives is (eta == 0)
    finally:
        rollout.shutdown()


def test_local_sides_save_load_export_and_rng(local_sides, tmp_path):
    training, rollout, setup = local_sides
    training.step(_group(rollout, setup.tokenizer), pass_order=None, policy_version=0)
    training.save(tmp_path / "ckpt", {"step": 1})
    assert (tmp_path / "ckpt" / "policy").is_dir()
    trained = {n: t.clone() for n, t in training.runner.backends["policy"].named_weights()}
    training.step(_group(rollout, setup.tokenizer), pass_order=None, policy_version=0)
    assert training.load(tmp_path / "ckpt") == {"step": 1}
    assert all(torch.equal(t, trained[n]) for n, t in training.runner.backends["policy"].named_weights())
    training.export_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    state = rollout.rng_state()
    first = _group(rollout, setup.tokenizer)
    rollout.set_rng_state(state)
    assert torch.equal(_group(rollout, setup.tokenizer).input_ids_T, first.input_ids_T)
    with rollout.hold_graph_captures():  # CPU: nothing to hold, but the block runs
        pass


# ------------------------------------------------------------------------- the remote sides' controller part
def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


class FakeScheduler:
    """The scheduler's answers for a world of one training and two rollout workers."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def submit(self, role: str, method: str, *args) -> list[Future]:
        self.calls.append((role, method, *args))
        if role == "train":
            return [_done({"policy_sync_time_s": 0.5, "policy_sync_bytes": 64.0, "policy_sync_phase_pack_s": 0.1})]
        return [
            _done({"policy_sync_generation_paused_s": paused, "policy_sync_phase_commit_s": paused})
            for paused in (0.01, 0.03)
        ]


class FakeCluster:
    def __init__(self) -> None:
        self.scheduler = FakeScheduler()
        self.checked = 0

    def check_workers(self) -> None:
        self.checked += 1


def test_remote_sides_collective_sync_figures_and_version():
    cluster = FakeCluster()
    training, rollout = RemoteTrainingSide(cluster), RemoteRolloutSide(cluster)
    update = training.publish_weights(3, WeightKind.COLLECTIVE)
    assert cluster.checked == 1 and update.version == 3 and len(update.sending) == 1
    assert ("train", "sync", 3) in cluster.scheduler.calls
    rollout.pause()  # each worker pauses its own engine to commit
    metrics = rollout.update_weights(update)
    rollout.resume()
    assert ("rollout", "sync", 3) in cluster.scheduler.calls and rollout.version == 3
    assert metrics["policy_sync_bytes"] == 64.0 and metrics["policy_sync_phase_pack_s"] == 0.1
    assert metrics["policy_sync_generation_paused_s"] == 0.03  # the slowest rollout commit
    assert metrics["policy_sync_rollout_phase_commit_s"] == 0.03
    assert metrics["policy_sync_controller_s"] >= metrics["policy_sync_controller_check_s"] >= 0
    assert rollout.rng_state() is None


def test_remote_sync_failure_keeps_the_version():
    cluster = FakeCluster()
    training, rollout = RemoteTrainingSide(cluster), RemoteRolloutSide(cluster)
    failed = Future()
    failed.set_exception(RuntimeError("rollout[0] broke"))
    update = WeightUpdate(version=1, kind=WeightKind.COLLECTIVE, sending=(failed,))
    with pytest.raises(RuntimeError, match="rollout\\[0\\] broke"):
        rollout.update_weights(update)
    assert rollout.version == 0
    assert training.weight_kinds == rollout.weight_kinds == {WeightKind.COLLECTIVE}


def test_engine_metrics_are_counter_differences_per_step():
    def stats(clock, busy, tokens, steps):
        return {
            "clock_s": clock,
            "busy_s": busy,
            "generated_tokens": tokens,
            "steps": steps,
            "kv_usage": 0.5,
            "cuda_graph_capture_s": 0.0,
        }

    out = engine_metrics([stats(0, 0, 0, 0), stats(0, 0, 0, 0)], [stats(2, 1, 100, 5), stats(2, 2, 300, 7)])
    assert out["rollout/engine_0_busy_frac"] == 0.5 and out["rollout/engine_1_busy_frac"] == 1.0
    assert out["rollout/engine_busy_frac"] == 0.75 and out["rollout/engine_generated_tokens_per_s"] == 200.0
    assert out["rollout/engine_steps"] == 12 and out["rollout/engine_kv_usage_max"] == 0.5
