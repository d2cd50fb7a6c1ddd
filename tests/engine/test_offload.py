"""``cluster.offload=sleep``: a colocated run computes what ``none`` computes, and each phase really
leaves the other side's state off the device (storages freed, bytes held in host memory)."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.engine.local import LocalTrainingSide
from areno.engine.placement import build_engine
from areno.engine.residency import Phase
from areno.errors import ConfigError
from areno.models import Decoder, tiny_config
from areno.train import offload
from areno.train.offload import StorageOffloader, collect_tensors
from areno.train.packing import activation_bytes_per_token
from tests.helpers.configs import run_to_end, tiny_run_overrides

ROOT = Path(__file__).resolve().parents[2]


def _deterministic(key: str) -> bool:
    """Not a wall-clock figure (nor the offload's own ``system/*``): equal in any two seeded runs."""
    return key != "time" and not key.startswith(("timing/", "system/")) and not key.endswith(("_s", "_gbps"))


def _overrides(tmp_path, run_name, *extra) -> list[str]:
    overrides = tiny_run_overrides(tmp_path, run_name)
    return [*overrides, "reward.sandbox=false", "train.steps=3", "train.eval_interval=1", *extra]


def _config(tmp_path, run_name, *extra):
    return load_config(None, _overrides(tmp_path, run_name, *extra))


def _run(cfg) -> list[dict]:
    return [{k: v for k, v in row.items() if _deterministic(k)} for row in run_to_end(cfg)]


def test_sleep_gives_the_same_metrics_and_weights_as_none(tmp_path):
    rows_none = _run(_config(tmp_path, "none", "cluster.offload=none"))
    rows_sleep = _run(_config(tmp_path, "sleep", "cluster.offload=sleep"))
    assert len(rows_none) >= 3
    assert rows_sleep == rows_none  # bit-exact: sleep and wake copy bytes
    assert "train/policy/loss" in rows_none[0] and "eval/accuracy" in rows_none[1]
    final = "checkpoints/step_00000003/hf/model.safetensors"
    weights_none = load_file(tmp_path / "none" / final)
    weights_sleep = load_file(tmp_path / "sleep" / final)
    assert weights_none.keys() == weights_sleep.keys()
    for name, tensor in weights_none.items():
        assert torch.equal(tensor, weights_sleep[name]), name


@pytest.mark.slow
def test_a_sleeping_run_resumes_bit_exactly(tmp_path):
    """Load wakes the training side, the sync after it the engine's weights: as a run without offload."""
    rows_none = _run(_config(tmp_path, "none", "cluster.offload=none"))
    _run(_config(tmp_path, "resumed", "cluster.offload=sleep", "train.steps=2", "train.save_interval=1"))
    rows_resumed = _run(_config(tmp_path, "resumed", "cluster.offload=sleep", "resume=true"))
    assert _since_resume(rows_resumed) == _since_resume(rows_none)


CUMULATIVE = ("rollout/episodes_started", "rollout/accepted", "rollout/trajectories")
"""The pool's counters this run logs that count from the process's start (docs/metrics.md: cumulative since the
run or its resume started): a resumed run's count again from its resume."""


def _since_resume(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in CUMULATIVE} for row in rows]


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_each_phase_releases_the_other_sides_state(tmp_path):
    cfg = _config(tmp_path, "run", "cluster.offload=sleep")
    engine = build_engine(cfg, tmp_path / "run")
    engine.initialize()
    try:
        training, rollout = engine.training, engine.rollout
        backends = list(training.runner.backends.values())
        rollout_weights = list(rollout.engine.model.parameters())

        def optimizer_state():
            return [v for b in backends for s in b.optimizer.state.values() for v in s.values() if v.dim() > 0]

        batch = engine.generate_rollout(0)
        engine.step(batch)  # TRAIN: the KV cache and the rollout weights are gone
        assert engine.residency.phase is Phase.TRAIN
        assert not rollout.engine.cache.is_allocated and rollout.engine.cache.k_S == []
        assert _storage_bytes(rollout_weights) == 0
        assert rollout.weights_offloader.held_bytes > 0
        assert optimizer_state() and _storage_bytes(optimizer_state()) > 0

        engine.update_weights()  # SYNC: rollout weights back, KV cache still released
        assert _storage_bytes(rollout_weights) > 0 and not rollout.engine.cache.is_allocated

        engine.generate_rollout(1)  # ROLLOUT: optimizer state in host memory, the training weights stay
        assert rollout.engine.cache.is_allocated
        assert training.asleep
        assert _storage_bytes(optimizer_state()) == 0
        assert all(p.grad is None for b in backends for p in b.model.parameters())
        assert _storage_bytes(p for b in backends for p in b.model.parameters()) > 0

        engine.step(batch)  # and back: the state the step needs is whole again
        assert not training.asleep and _storage_bytes(optimizer_state()) > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "extra, match",
    [
        (["cluster.offload=swap"], "cluster.offload: must be none or sleep"),
        (["cluster.offload=sleep", "rollout.max_head_offpolicyness=1"], "max_head_offpolicyness=0"),
        (["cluster.offload=sleep", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]"], "partitioned"),
    ],
)
def test_offload_sleep_refuses_what_it_cannot_do(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _config(tmp_path, "run", *extra)


def test_a_fused_rollout_model_stays_fused_and_equal_through_sleep_and_wake():
    """The engine's q/k/v and gate/up are views of one storage each: freed and re-allocated at a
    new address, they still run fused, with the same weights."""
    model = Decoder(tiny_config(62, hidden_size=48, layers=2, heads=4, kv_heads=2, arch="qwen2")).eval()
    model.fuse_projections()
    ids = torch.arange(13) % 62
    with torch.no_grad():
        before = model(ids, torch.arange(13))
    offloader = StorageOffloader()
    assert offloader.sleep(collect_tensors(model, None)) > 0
    assert _storage_bytes(model.parameters()) == 0 and offloader.held_bytes > 0
    offloader.wake()
    assert model.projections_fused and offloader.held_bytes == 0
    with torch.no_grad():
        assert torch.equal(model(ids, torch.arange(13)), before)


@pytest.mark.gpu
def test_cuda_sleep_lowers_each_phases_peak_and_keeps_the_losses(tmp_path):
    """On one GPU: the rollout phase no longer holds the training state, the train phase no longer holds
    the rollout engine; the first step's loss and gradient norm stay within float noise of ``none``'s.
    The model is large enough (about 120M parameters, 2 GB of training state) that what sleep frees
    outweighs the transient buffers of a wake and the decode graphs' re-capture, which dominate at a
    few MB. Later steps are not compared: flash's backward adds a GQA layer's dK/dV over its query heads
    with atomics, so two runs' weights differ in rounding and their sampled tokens part after an
    update (the bit-exact comparison of the two modes is the CPU test above)."""
    model = "model.init_tiny={hidden_size: 1024, layers: 8, heads: 16, kv_heads: 4, intermediate_size: 4096}"
    peaks, losses = {}, {}
    for mode in ("none", "sleep"):
        # each mode in its own process: a run's peaks must not count what another run of the process left
        overrides = _overrides(tmp_path, mode, f"cluster.offload={mode}", "cluster.device=cuda", model)
        proc = subprocess.run(
            [sys.executable, "-m", "areno", "train", *overrides, "rollout.kv_blocks=256"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "train/policy/loss" in r]
        peaks[mode] = {p: max(r[f"system/{p}_peak_memory_gib"] for r in steps) for p in ("rollout", "train")}
        losses[mode] = [(r["train/policy/loss"], r["train/policy/grad_norm"]) for r in steps]
    assert peaks["sleep"]["rollout"] < peaks["none"]["rollout"], peaks
    assert peaks["sleep"]["train"] < peaks["none"]["train"], peaks
    assert len(losses["sleep"]) == len(losses["none"]) == 3, losses
    assert all(math.isfinite(x) for pair in losses["sleep"] for x in pair), losses
    assert losses["sleep"][0] == pytest.approx(losses["none"][0], rel=1e-3, abs=1e-4), losses


@pytest.mark.gpu
def test_a_new_cuda_run_collects_an_earlier_unreachable_one(tmp_path):
    """A notebook's finished run, dropped but still in reference cycles, gives its device memory
    back when the next run starts (else it shrinks the new run's KV pool and micro-batches)."""
    model = "model.init_tiny={hidden_size: 512, layers: 4, heads: 8, kv_heads: 2, intermediate_size: 2048}"
    gc.disable()  # only Trainer.init may collect the first run
    try:
        first = Trainer.init(_config(tmp_path, "first", "cluster.device=cuda", model, "train.steps=1"))
        try:
            first.run()
        finally:
            first.shutdown()
        policy = first.backend.engine.training.runner.backends["policy"]
        weight = weakref.ref(next(policy.model.parameters()))
        del first, policy
        second = Trainer.init(_config(tmp_path, "second", "cluster.device=cuda", model, "train.steps=1"))
        try:
            assert weight() is None
        finally:
            second.shutdown()
    finally:
        gc.enable()


def test_a_sleep_the_host_cannot_hold_is_refused_before_it_copies(monkeypatch):
    """The training state goes to host memory: more than the host has is a one-line error, not the
    kernel's out-of-memory killer ending the run (meta tensors stand in for device ones)."""
    monkeypatch.setattr(offload, "available_host_bytes", lambda: 2**30)
    offloader = StorageOffloader()
    with pytest.raises(ConfigError, match=r"cluster.offload=sleep: parking 2.0 GiB .* 1.0 GiB available"):
        offloader.sleep([torch.empty(2**29, dtype=torch.float32, device="meta")])
    assert not offloader.asleep


@pytest.mark.gpu
def test_a_finished_cuda_run_leaves_no_device_memory_behind(tmp_path):
    """After shutdown, dropping and collecting a run, the device holds what it held before it."""
    model = "model.init_tiny={hidden_size: 512, layers: 4, heads: 8, kv_heads: 2, intermediate_size: 2048}"
    gc.collect()
    before = torch.cuda.memory_allocated()
    trainer = Trainer.init(_config(tmp_path, "run", "cluster.device=cuda", model, "train.steps=2"))
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    del trainer
    gc.collect()
    assert torch.cuda.memory_allocated() - before < 2**20


def _parking_round_trip(device: str) -> StorageOffloader:
    """Three tensors of awkward sizes parked twice: the same bytes come back at the same storages, in one
    host buffer of their page-aligned sizes (no power-of-two rounding) that the second sleep reuses."""
    tensors = [torch.randn(n, device=device) for n in (1000, 70_001, 3)]  # one shared below
    tensors.append(tensors[1][5:10])
    before = [t.clone() for t in tensors]
    offloader = StorageOffloader()
    assert offloader.sleep(tensors) == 4 * (1000 + 70_001 + 3)
    buffer = offloader._host
    assert offloader.host_buffer_bytes == 4096 + 4096 * 69 + 4096  # 4,000 B, 280,004 B, 12 B, each page-aligned
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    offloader.wake()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    offloader.sleep(tensors)
    assert offloader._host is buffer
    offloader.wake()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    return offloader


def test_parked_bytes_share_one_exact_host_buffer_reused_by_the_next_sleep():
    offloader = _parking_round_trip("cpu")
    offloader.release()
    assert offloader.host_buffer_bytes == 0


@pytest.mark.gpu
def test_parked_cuda_bytes_sit_in_page_locked_memory_of_their_size():
    offloader = _parking_round_trip("cuda")
    assert offloader._host.is_pinned()
    offloader.release()
    assert offloader.host_buffer_bytes == 0


def _run_observed(cfg, probe) -> tuple[list[dict], list[tuple[list[tuple[str, object]], object]]]:
    """Run ``cfg`` through ``Trainer`` and call ``probe(optimizer)`` at every forward and backward of the
    policy and at each optimizer step; returns the metric rows and, per optimizer step, the probes
    (kind, value) of the forwards and backwards before it and the value at it."""
    trainer = Trainer.init(cfg)
    events: list[tuple[str, object]] = []
    try:
        policy = trainer.backend.engine.training.runner.backends["policy"]
        optimizer = policy.optimizer
        policy.model.register_forward_pre_hook(lambda module, args: events.append(("forward", probe(optimizer))))
        trained = next(p for p in policy.model.parameters() if p.requires_grad)
        trained.register_hook(lambda grad: events.append(("backward", probe(optimizer))))
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: events.append(("step", probe(optimizer))))
        trainer.run()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps, before = [], []
    for kind, value in events:  # split at each optimizer step
        if kind == "step":
            steps.append((before, value))
            before = []
        else:
            before.append((kind, value))
    return [{k: v for k, v in row.items() if _deterministic(k)} for row in rows], steps


def _moments(optimizer) -> list[torch.Tensor]:
    return [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]


def test_a_woken_training_phase_brings_the_optimizer_state_back_only_for_the_optimizer_step(tmp_path):
    """Under sleep, forwards and backwards of a step after the first run with the AdamW moments still in
    host memory (a phase never holds them with activations); they are back at the optimizer step. A
    checkpoint saved after every step (which wakes them too) leaves the run equal to ``none``'s."""

    def moment_bytes(optimizer) -> int | None:  # None before the first step creates the moments
        return _storage_bytes(_moments(optimizer)) if _moments(optimizer) else None

    rows_none = _run(_config(tmp_path, "none", "cluster.offload=none", "train.save_interval=1"))
    cfg = _config(tmp_path, "sleep", "cluster.offload=sleep", "train.save_interval=1")
    rows_sleep, steps = _run_observed(cfg, moment_bytes)
    assert rows_sleep == rows_none
    assert len(steps) == 3
    assert all(nbytes is None for _, nbytes in steps[0][0]) and steps[0][1] is None  # created by the first step
    for before_step, at_step in steps[1:]:
        assert {kind for kind, _ in before_step} == {"forward", "backward"}
        assert all(nbytes == 0 for _, nbytes in before_step), before_step
        assert at_step > 0
    for step in (1, 2, 3):
        weights_none = load_file(tmp_path / "none" / f"checkpoints/step_{step:08d}/hf/model.safetensors")
        weights_sleep = load_file(tmp_path / "sleep" / f"checkpoints/step_{step:08d}/hf/model.safetensors")
        assert all(torch.equal(t, weights_sleep[name]) for name, t in weights_none.items())


@pytest.mark.gpu
def test_later_cuda_train_phases_hold_no_more_than_the_first_during_forward_and_backward(tmp_path):
    """On one GPU under sleep: the device memory of a later step's forwards and backwards is that of the
    first step's (whose moments do not exist yet), not that plus the moments woken before them."""
    model = "model.init_tiny={hidden_size: 1024, layers: 8, heads: 16, kv_heads: 4, intermediate_size: 4096}"
    cfg = _config(tmp_path, "run", "cluster.offload=sleep", "cluster.device=cuda", model, "rollout.kv_blocks=256")
    moment_bytes = []

    def allocated(optimizer) -> int:
        moment_bytes.append(sum(t.nbytes for t in _moments(optimizer)))  # nominal sizes, also while parked
        return torch.cuda.memory_allocated()

    _, steps = _run_observed(cfg, allocated)
    assert len(steps) == 3
    first = max(value for _, value in steps[0][0])
    for before_step, _ in steps[1:]:
        assert max(value for _, value in before_step) < first + max(moment_bytes) / 2, (first, before_step)


def test_a_dropped_offloader_unregisters_its_page_locked_host_buffer(monkeypatch):
    """A backend never shut down left its page-locked host buffer registered after the memory was freed; a later
    host tensor allocated there failed its copy to the GPU ("CUDA error: invalid argument": the GPU suite's
    order-dependent failure of test_cuda_fp32_master_attends_with_bf16_varlen). A finalizer now unregisters it,
    once, whichever comes first of release() and the buffer's end."""
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    storages = [torch.zeros(1000).untyped_storage()]
    dropped = StorageOffloader()
    ptr = dropped._host_buffer(4096, storages, pin=True).data_ptr()
    del dropped
    gc.collect()
    assert calls == [("register", ptr), ("unregister", ptr)]
    calls.clear()
    released = StorageOffloader()
    ptr = released._host_buffer(4096, storages, pin=True).data_ptr()
    released.release()
    del released
    gc.collect()
    assert calls == [("register", ptr), ("unregister", ptr)]


@pytest.mark.parametrize("offload", ["none", "sleep"])
def test_a_colocated_engine_sizes_its_kv_pool_beside_what_training_will_take(tmp_path, monkeypatch, offload):
    """walk33: the rollout engine sized its pool from 80% of the device memory free after the training side loaded,
    which still held the gradients, AdamW moments and activations the first training step allocates (an OOM
    there for a 1.5B model on an 80 GB GPU). Now the training side names those bytes and the pool leaves them,
    unless cluster.offload=sleep takes turns on the device."""
    monkeypatch.setattr(LocalTrainingSide, "device_bytes_to_come", lambda self: 12345)
    cfg = _config(tmp_path, "run", f"cluster.offload={offload}")
    engine = build_engine(cfg, tmp_path / "run")
    engine.initialize()
    try:
        assert engine.rollout.engine.config.kv_reserved_bytes == (12345 if offload == "none" else 0)
        # engines started later there (the test rollout's, a teacher's) alike: under sleep the run's engine
        # releases more than that while training (walk35)
        assert engine.training_bytes_to_come(torch.device("cpu")) == (12345 if offload == "none" else 0)
    finally:
        engine.shutdown()


def test_the_training_side_names_its_state_to_come_and_its_largest_activations(tmp_path, monkeypatch):
    cfg = _config(tmp_path, "run", "train.max_tokens_per_mb=512")
    engine = build_engine(cfg, tmp_path / "run")
    engine.initialize()
    try:
        side = engine.training
        (backend,) = side.runner.backends.values()
        assert side.device_bytes_to_come() == 0  # a CPU run's pool does not come from free memory
        trainable = sum(p.numel() * p.element_size() for p in backend.model.parameters() if p.requires_grad)
        assert backend.lazy_state_bytes() == 3 * trainable  # gradients and two AdamW moments
        per_token = activation_bytes_per_token(**backend._activation_shape())
        assert backend.activation_bytes() == 512 * per_token
        monkeypatch.setattr(side, "device", torch.device("cuda"))
        assert side.device_bytes_to_come() == 3 * trainable + 512 * per_token
        # walk35: what a step (or a resumed checkpoint) allocated is no longer to come: the moments stay
        engine.step(engine.generate_rollout(0))
        not_allocated = sum(p.numel() * p.element_size() for p in backend.model.parameters() if p.grad is None)
        assert backend.optimizer.state and backend.lazy_state_bytes() == not_allocated < 3 * trainable
    finally:
        engine.shutdown()


def test_a_sleeping_backend_shuts_down_without_bringing_its_state_back(tmp_path, monkeypatch):
    """walk34: shutting down while asleep (a failure during the rollout phase) copied the gradients and optimizer
    state back to the device only to drop them, beside the engine's KV pool: an out-of-memory error at exit that
    could replace the run's own. They are dropped where they wait now."""
    cfg = _config(tmp_path, "run", "cluster.offload=sleep")
    engine = build_engine(cfg, tmp_path / "run")
    engine.initialize()
    (backend,) = engine.training.runner.backends.values()
    try:
        engine.step(engine.generate_rollout(0))
        engine.update_weights()
        engine.generate_rollout(1)  # ROLLOUT: the training state waits in host memory
        assert backend._offloader.asleep and backend._offloader.held_bytes > 0
        monkeypatch.setattr(StorageOffloader, "wake", lambda self: pytest.fail("woken at shutdown"))
    finally:
        engine.shutdown()
    assert not backend._offloader.asleep and backend._offloader.host_buffer_bytes == 0
    assert all(p.grad is None for p in backend.model.parameters())
