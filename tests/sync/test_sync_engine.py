"""In-place and disk transports against the real trainer and rollout engine: after a sync the
engine's log-probs of a fixed sequence match the trainer's; failed updates keep the old version."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from areno.models.hf_io import load_model
from areno.models.logprobs import packed_logprobs
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.sync.base import (
    METRIC_NAMES,
    SLOW_SYNC_S,
    NamedTensorSource,
    PolicySyncError,
    ShardSpec,
    StagedReceiver,
    SyncStats,
    copy_into,
)
from areno.sync.disk import COMPLETE, DiskTransport, latest_policy
from areno.sync.inplace import InPlaceTransport
from areno.train import LocalTrainBackend, TrainBackendConfig
from areno.types import SamplingParams
from tests.helpers.sync import spawn, worker_engine

PROMPT = [5, 9, 12, 7, 3, 11]


@pytest.fixture()
def trainer(tiny_model_dir):
    torch.set_num_threads(1)
    b = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", grad_clip=None))
    b.initialize(tiny_model_dir)
    with torch.no_grad():  # stands in for an optimizer step: the trained policy differs from the checkpoint
        g = torch.Generator().manual_seed(7)
        for p in b.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return b


@pytest.fixture()
def engine(tiny_model_dir):
    model, cfg = load_model(tiny_model_dir, dtype=torch.float32, device="cpu")
    return RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64))


def engine_logprobs(engine) -> tuple[list[int], torch.Tensor]:
    out = engine.generate([PROMPT], SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3))[0]
    return out.output_ids, torch.tensor(out.output_logprobs)


def trainer_logprobs(trainer, output_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor(PROMPT + output_ids)
    with torch.no_grad():
        lp, _ = packed_logprobs(trainer.model, ids, torch.tensor([0, ids.numel()]))
    return lp[len(PROMPT) :]


def test_inplace_sync_then_engine_logprobs_match_trainer(trainer, engine):
    ids, before = engine_logprobs(engine)
    assert not torch.allclose(before, trainer_logprobs(trainer, ids), atol=1e-3)  # the test can fail

    transport = InPlaceTransport(
        NamedTensorSource(trainer.named_weights), engine.weight_tensors(), on_commit=engine.commit_weights
    )
    stats = transport.sync(1)
    assert engine.version == 1 and transport.version == 1
    assert stats.bytes == sum(t.numel() * t.element_size() for t in engine.weight_tensors().values())
    assert set(stats.as_metrics()) == set(METRIC_NAMES)
    ids, after = engine_logprobs(engine)
    torch.testing.assert_close(after, trainer_logprobs(trainer, ids), atol=1e-4, rtol=1e-4)


def test_inplace_aliased_tensors_move_nothing(caplog):
    w = {"a": torch.randn(4, 4), "b": torch.randn(3)}
    committed = []
    transport = InPlaceTransport(NamedTensorSource(lambda: w.items()), dict(w), on_commit=committed.append)
    with caplog.at_level("DEBUG", logger="areno.sync"):
        stats = transport.sync(5)
    assert stats.bytes == 0 and committed == [5]
    # Every completed sync logs one line carrying each metric by name: at DEBUG (the step's metrics
    # carry the figures), so the console does not get one line a step.
    (record,) = [r for r in caplog.records if r.name == "areno.sync"]
    line = record.getMessage()
    assert line.startswith("policy sync v5 (inplace)") and all(f"{name}=" in line for name in METRIC_NAMES)
    assert record.levelno == logging.DEBUG
    # A cast: fp32 trained -> bf16 engine, one copy.
    dst = {"a": torch.zeros(4, 4, dtype=torch.bfloat16)}
    stats = InPlaceTransport(NamedTensorSource(lambda: w.items()), dst).sync(6)
    assert torch.equal(dst["a"], w["a"].to(torch.bfloat16)) and stats.bytes == 32
    with pytest.raises(ValueError, match="engine shape"):
        InPlaceTransport(NamedTensorSource(lambda: w.items()), {"a": torch.zeros(2, 4)})


def test_a_slow_sync_is_logged_at_info(caplog):
    """A sync slower than ``SLOW_SYNC_S`` is worth a console line; a fast one is left to DEBUG."""
    stats = [
        SyncStats(version=v, total_time_s=t, transfer_time_s=t, bytes=8, tensors=1) for v, t in [(1, 0.5), (2, 12.0)]
    ]
    with caplog.at_level("DEBUG", logger="areno.sync"):
        for s in stats:
            s.log("nccl")
    assert SLOW_SYNC_S < 12.0
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records] == [
        (logging.DEBUG, "policy sync v1 (nccl)"),
        (logging.INFO, "policy sync v2 (nccl)"),
    ]


def test_disk_sync_is_atomic_and_engine_logprobs_match_trainer(trainer, engine, tiny_model_dir, tmp_path):
    root = tmp_path / "policies"
    seen = []
    transport = DiskTransport(
        NamedTensorSource(trainer.named_weights),
        root,
        receivers=[engine.update_weights_from_disk, lambda path, v: seen.append((path, v))],
        model_dir=tiny_model_dir,
        keep_last=1,
    )
    stats = transport.sync(3)
    path, version = latest_policy(root)
    assert version == 3 and seen == [(str(path), 3)] and engine.version == 3
    assert (path / COMPLETE).read_text() == "3" and (path / "config.json").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in trainer.named_weights()}
    assert stats.tensors == len(index["weight_map"])
    ids, after = engine_logprobs(engine)
    torch.testing.assert_close(after, trainer_logprobs(trainer, ids), atol=1e-4, rtol=1e-4)
    # The published directory is a Hugging Face checkpoint that transformers loads.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ref = dict(trainer.named_weights())["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(hf.state_dict()["model.layers.0.mlp.up_proj.weight"], ref)
    transport.sync(4)  # keep_last=1 prunes v3
    assert [p.name for p in root.iterdir()] == ["policy-v00000004"]


def test_staged_receiver_is_all_or_nothing():
    live = {"a": torch.zeros(2, 2), "b": torch.zeros(2)}
    specs = {n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=t.dtype) for n, t in live.items()}
    r = StagedReceiver(specs, copy_into(live))
    r.begin(1)
    r.stage("a").fill_(1.0)
    with pytest.raises(PolicySyncError, match="never arrived"):
        r.commit(1)  # "b" is missing: nothing is applied
    assert torch.equal(live["a"], torch.zeros(2, 2)) and r.version is None
    r.abort()
    r.begin(1)
    r.stage("a").fill_(1.0)
    r.stage("b").fill_(2.0)
    r.commit(1)
    assert r.version == 1 and torch.equal(live["b"], torch.full((2,), 2.0))


def test_deferred_staged_commit_returns_before_the_apply_and_the_next_sync_waits_for_it():
    import threading

    live = {"a": torch.zeros(2)}
    specs = {"a": ShardSpec(name="a", full_shape=(2,), dtype=torch.float32)}
    boundary = threading.Event()  # the engine's running step ending
    copy = copy_into(live)

    def apply(named, version):
        assert boundary.wait(10)
        copy(named, version)
        return 0.001  # seconds generation stopped

    r = StagedReceiver(specs, apply, deferred=True)
    r.begin(1)
    r.stage("a").fill_(1.0)
    r.commit(1)  # returns while the engine's step still runs
    assert r.version is None and torch.equal(live["a"], torch.zeros(2))
    with pytest.raises(PolicySyncError, match="did not end within 0.05 s"):
        r.wait_committed(timeout_s=0.05)
    boundary.set()
    r.wait_committed()
    assert r.version == 1 and torch.equal(live["a"], torch.ones(2)) and r.last_paused_s == 0.001
    # the next sync's begin waits for a pending apply before its bytes overwrite the staging copy
    boundary.clear()
    r.begin(2)
    r.stage("a").fill_(2.0)
    r.commit(2)
    threading.Timer(0.05, boundary.set).start()
    r.begin(3)
    assert r.version == 2 and torch.equal(live["a"], torch.full((2,), 2.0))


def test_deferred_commit_that_fails_is_reported_by_the_next_sync_and_keeps_the_old_weights():
    live = {"a": torch.zeros(2)}
    specs = {"a": ShardSpec(name="a", full_shape=(2,), dtype=torch.float32)}

    def apply(named, version):
        raise RuntimeError("engine refused the update")

    r = StagedReceiver(specs, apply, deferred=True)
    r.begin(1)
    r.stage("a").fill_(1.0)
    r.commit(1)
    with pytest.raises(PolicySyncError, match="previous policy sync failed: RuntimeError: engine refused the update"):
        r.begin(2)
    assert r.version is None and torch.equal(live["a"], torch.zeros(2))
    r.begin(2)  # reported once; the receiver takes the next sync


def test_engine_receiver_refuses_a_deferred_inplace_commit():
    from areno.sync.base import engine_receiver

    class Engine:
        def weight_tensors(self):
            return {"a": torch.zeros(2)}

    specs = {"a": ShardSpec(name="a", full_shape=(2,), dtype=torch.float32)}
    with pytest.raises(ValueError, match="deferred=True needs a staged or swap commit"):
        engine_receiver(Engine(), specs, commit="inplace", deferred=True)


@pytest.mark.slow
def test_stream_sync_into_rollout_engine_logprobs_match_trainer(tiny_model_dir, tmp_path):
    spawn(worker_engine, 2, str(tmp_path), str(tiny_model_dir))
    eng = torch.load(tmp_path / "engine.pt", weights_only=True)
    trn = torch.load(tmp_path / "trainer.pt", weights_only=True)
    assert eng["before_version"] == 0 and eng["version"] == 1
    torch.testing.assert_close(eng["logprobs"], trn["logprobs"], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_inplace_cast_on_gpu_is_exact_and_fast():
    dev = torch.device("cuda")
    trained = {f"w{i}": torch.randn(1024, 1024, device=dev) for i in range(32)}
    engine = {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in trained.items()}
    transport = InPlaceTransport(NamedTensorSource(lambda: trained.items()), engine)
    transport.sync(0)
    stats = transport.sync(1)
    assert all(torch.equal(engine[n], t.to(torch.bfloat16)) for n, t in trained.items())
    assert stats.bytes == 32 * 1024 * 1024 * 2 and stats.total_time_s < 0.05


def test_swap_commit_moves_no_bytes_and_keeps_old_version_on_failure():
    from areno.sync.base import swap_into

    tied = torch.zeros(4, 2)
    fused = torch.zeros(6)
    live = {"a": torch.zeros(3), "emb": tied, "head": tied, "q": fused[:3], "k": fused[3:]}
    specs = {n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=t.dtype) for n, t in live.items()}
    r = StagedReceiver(specs, swap_into(live))
    a_obj = live["a"]
    r.begin(1)
    staged_a = r.stage("a")
    staged_ptr = staged_a.data_ptr()
    staged_a.fill_(1.0)
    r.stage("emb").fill_(2.0)
    r.stage("head").fill_(2.0)
    r.stage("q").fill_(3.0)
    r.stage("k").fill_(4.0)
    r.commit(1)
    # Swapped: the live object now holds the staged storage, the staging tensor the old one.
    assert live["a"] is a_obj and live["a"].data_ptr() == staged_ptr and torch.equal(live["a"], torch.ones(3))
    assert torch.equal(r.stage("a"), torch.zeros(3))
    # One object under two names (tied) is swapped once; views of a fused tensor are copied.
    assert live["emb"] is live["head"] and torch.equal(tied, torch.full((4, 2), 2.0))
    assert torch.equal(fused, torch.tensor([3.0, 3, 3, 4, 4, 4]))
    # A failed sync writes staging only: the live version stays intact.
    r.abort()
    r.begin(2)
    r.stage("a").fill_(9.0)
    with pytest.raises(PolicySyncError, match="never arrived"):
        r.commit(2)
    r.abort()
    assert torch.equal(live["a"], torch.ones(3)) and r.version == 1


def test_staged_commit_counts_paused_time_from_the_step_boundary():
    """An engine's pause() returns at its step boundary (here after 0.3 s of a running step, during
    which generation goes on): the commit's paused time starts there, not when the commit began."""
    import time

    from areno.sync.base import TensorEngine, engine_receiver

    class SlowToPause(TensorEngine):
        def pause(self) -> None:
            time.sleep(0.3)  # the step in progress ends first
            super().pause()

    live = {"a": torch.zeros(64, 64), "b": torch.zeros(64)}
    specs = {n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=t.dtype) for n, t in live.items()}
    engine = SlowToPause(live)
    r = engine_receiver(engine, specs, commit="staged")
    r.begin(1)
    r.stage("a").fill_(1.0)
    r.stage("b").fill_(2.0)
    r.commit(1)
    assert engine.version == 1 and not engine.is_paused and torch.equal(live["b"], torch.full((64,), 2.0))
    # the paused interval lies inside the apply, after the 0.3 s pause(): whatever the load; counted from
    # the commit's start it would be the whole apply
    assert r.last_apply_s >= 0.3 and r.last_paused_s <= r.last_apply_s - 0.3, (r.last_apply_s, r.last_paused_s)
