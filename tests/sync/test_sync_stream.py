"""Streaming transport across processes (gloo): train DP 2 -> rollout TP 2 on overlapping devices.

One spawned world runs the whole scenario (spawning is the slow part): v1 and v2 complete, then
rank 3 hangs during v3.
"""

from __future__ import annotations

import pytest
import torch

from areno.sync.base import METRIC_NAMES
from areno.sync.plan import shard_specs_from_tp_plan
from tests.helpers.sync import (
    DEVICES,
    EXACT_CONFIGS,
    ROLLOUT,
    TP_PLAN,
    mixed,
    spawn,
    tiny_weights,
    worker_exact,
    worker_scenario,
    worker_source_error,
)

BUCKET = 2048  # smaller than the embedding (8 KiB): it is split into row chunks
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    spawn(worker_scenario, 4, str(out), BUCKET, TIMEOUT_S)
    return {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)}


def test_every_rollout_shard_equals_its_slice_bit_for_bit(results):
    for version, seed in ((1, 1), (2, 2)):
        full = tiny_weights(seed=seed)
        meta = [(n, tuple(t.shape), t.dtype) for n, t in full.items()]
        for rank in ROLLOUT:
            specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=rank - ROLLOUT[0], tp_size=2)
            got = results[rank][f"v{version}"]
            assert got["receiver_version"] == version
            assert set(got["live"]) == set(full)
            for name, t in got["live"].items():
                assert torch.equal(t, specs[name].take(full[name])), (rank, version, name)
    # TP really splits: the two rollout ranks hold different halves of q_proj.
    q = "model.layers.0.self_attn.q_proj.weight"
    assert results[2]["v2"]["live"][q].shape == (16, 32)
    assert not torch.equal(results[2]["v2"]["live"][q], results[3]["v2"]["live"][q])


def test_relays_on_other_devices_and_both_rows_send(results):
    assert [DEVICES[r] for r in results[0]["relays"]] == ["dev1", "dev0"]
    assert set(results[0]["plan_rows"].values()) == {0, 1}


def test_bucket_memory_is_bounded(results):
    for r in range(4):
        assert results[r]["max_bucket"] <= BUCKET
        assert 0 < results[r]["peak_buffer_bytes"] <= 2 * BUCKET


def test_metrics_of_a_completed_sync(results):
    weights = tiny_weights(1)
    for r in range(4):
        m = results[r]["v2"]["metrics"]
        phases = {k for k in m if k.startswith("policy_sync_phase_")}
        assert set(m) - phases == set(METRIC_NAMES)
        # where the time went, the same phases on every rank (zero where a rank has no part)
        assert phases == {
            f"policy_sync_phase_{p}_s"
            for p in ("begin", "pack", "post", "wait", "stage", "vote", "commit", "device_sync")
        }
        assert all(m[k] >= 0 for k in phases)
        assert sum(m[k] for k in phases) <= m["policy_sync_time_s"] + 1e-6
        assert (m["policy_sync_phase_commit_s"] > 0) == (r in ROLLOUT), r  # only receivers commit
        assert m["policy_sync_bytes"] == sum(t.numel() * 4 for t in weights.values())
        assert m["policy_sync_tensors"] == len(weights)
        assert m["policy_sync_time_s"] >= m["policy_sync_transfer_time_s"] > 0
        assert m["policy_sync_throughput_gbps"] > 0
        assert results[r]["pop"] == m and results[r]["pop_again"] == {}


def test_hung_receiver_raises_within_timeout_naming_the_rank(results):
    for r in (0, 1, 2):
        err = results[r]["error"]
        assert err is not None and "policy sync v3 failed" in err, r
        assert results[r]["elapsed"] < 3 * TIMEOUT_S, (r, results[r]["elapsed"])
    for r in (0, 1, 2):
        assert "unresponsive rank(s) [3] (rank 3: never joined)" in results[r]["error"], results[r]["error"]


def test_failed_sync_keeps_the_old_version_intact(results):
    # Rank 2 staged part of v3, then aborted: v2 stays live, value for value.
    assert results[2]["receiver_version"] == 2
    for name, t in results[2]["after"].items():
        assert torch.equal(t, results[2]["v2"]["live"][name]), name


@pytest.mark.slow
def test_source_error_midway_aborts_everywhere_and_keeps_old_version(tmp_path):
    spawn(worker_source_error, 4, str(tmp_path), TIMEOUT_S)
    res = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)}
    assert res[1]["error"] == "ValueError: source broke"
    for r in (0, 2, 3):
        assert res[r]["error"].startswith("PolicySyncError: policy sync v2 failed"), res[r]["error"]
        assert res[r]["elapsed"] < 3 * TIMEOUT_S
    assert "failed rank(s) [1" in res[0]["error"], res[0]["error"]
    for r in ROLLOUT:
        assert res[r]["intact"] and res[r]["version"] == 1


def check_exact(res: dict) -> None:
    for tag, _, wire, _, mix, _ in EXACT_CONFIGS:
        # Both kinds of bucket occur: chunks on their own and packed small tensors.
        assert res[0][tag]["single"] > 0 and res[0][tag]["packed"] > 0, res[0][tag]
        for version in (1, 2):
            full = mixed(tiny_weights(seed=version)) if mix else tiny_weights(seed=version)
            meta = [(n, tuple(t.shape), t.dtype) for n, t in full.items()]
            for rank in ROLLOUT:
                specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=rank - ROLLOUT[0], tp_size=2)
                got = res[rank][tag][f"v{version}"]
                assert set(got) == set(full)
                for name, t in got.items():
                    want = specs[name].take(full[name]).to(wire or full[name].dtype)
                    assert t.dtype == want.dtype and torch.equal(t, want), (tag, version, rank, name)
        for r in range(4):
            assert res[r][tag]["peak_buffer_bytes"] <= 2 * 2048
            assert res[r][tag]["fanout"] == res[0][tag]["fanout"]
        # A chunk of the relay's own dim-0 slice is not fanned out; everything else is.
        fanout, total = res[0][tag]["fanout"], res[0][tag]["total_bytes"]
        assert any(fanout) and not all(fanout)
        assert total < res[0][tag]["wire_bytes"] < 2 * total
    # The swap commit moves no bytes; the rollout ranks report the phases they spent time in.
    assert set(res[2]["direct"]["phases"]) == {
        "begin",
        "pack",
        "post",
        "wait",
        "stage",
        "vote",
        "commit",
        "device_sync",
    }
    assert res[0]["direct"]["phases"]["stage"] == 0.0 and res[2]["direct"]["phases"]["pack"] == 0.0


def test_unpacked_chunks_cast_mixed_dtypes_skipped_fanout_and_swap_commit_are_bit_exact(tmp_path):
    spawn(worker_exact, 4, str(tmp_path))
    res = {r: torch.load(tmp_path / f"exact{r}.pt", weights_only=True) for r in range(4)}
    check_exact(res)
    assert not any(res[r][tag]["stream_ordered"] for r in range(4) for tag in res[r])  # gloo: host waits


@pytest.mark.gpu
def test_nccl_stream_ordered_sync_is_bit_exact_on_two_gpus(tmp_path):
    """Train DP 2 -> rollout TP 2 on 2 GPUs (overlapping), NCCL data plane: stream-ordered waits,
    one multi-tensor copy per bucket, same bytes as the CPU path."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")

    spawn(worker_exact, 4, str(tmp_path), True)
    res = {r: torch.load(tmp_path / f"exact{r}.pt", weights_only=True) for r in range(4)}
    check_exact(res)
    assert all(res[r][tag]["stream_ordered"] for r in range(4) for tag in res[r])
