"""The stream transport's batched copies, in one process: packing a bucket with one multi-tensor
copy (``BucketPacker``) and staging it (``BucketStager``) give the same bytes as the per-item
``copy_`` / ``write_rows`` path, for dim-0, dim-1 and replicated shards and mixed dtypes; the
cached staging views follow a swap commit across syncs."""

from __future__ import annotations

import pytest
import torch

from areno.sync.base import StagedReceiver, copy_into, swap_into, write_rows
from areno.sync.buckets import BucketPacker, BucketStager, chunk_views, foreach_copy, tensor_chunks
from areno.sync.collectives import Collectives
from areno.sync.plan import plan_buckets, shard_specs_from_tp_plan
from tests.helpers.sync import TP_PLAN, tiny_weights


def mixed_weights(seed: int) -> dict[str, torch.Tensor]:
    """``tiny_weights`` with the norms and biases kept fp32, everything else bf16, plus a 0-dim
    scalar: buckets mix dtypes."""
    w = {n: (t if t.dim() == 1 else t.to(torch.bfloat16)) for n, t in tiny_weights(seed).items()}
    w["model.logit_scale"] = torch.tensor(float(seed) + 0.5)
    return w


def plan_for(weights, wire_dtype, cuts=True):
    meta = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
    # TP-2 dim-0 shard boundaries, as the transport publishes them.
    cut = {n: [s[0] // 2] for n, s, _ in meta if len(s) == 2} if cuts else None
    return meta, plan_buckets(meta, 1, 2048, wire_dtype, cuts=cut, direct_bytes=4096)


def chunks_of(bucket, weights):
    return [weights[i.name].reshape(i.shape)[i.row_start : i.row_end] for i in bucket.items]


def per_item_pack(bucket, buf, weights):
    """The previous sender path: one ``copy_`` per item into its byte range."""
    for item, chunk in zip(bucket.items, chunks_of(bucket, weights)):
        buf[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.chunk_shape).copy_(chunk)


def test_foreach_copy_groups_by_dtype_pair():
    a, b = torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)
    assert foreach_copy([a, b], [torch.ones(3), torch.full((2,), 2.0)]) == 2
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.full((2,), 2.0, dtype=torch.bfloat16))
    assert foreach_copy([a, torch.zeros(1)], [torch.full((3,), 3.0), torch.ones(1)]) == 1
    assert torch.equal(a, torch.full((3,), 3.0))
    assert foreach_copy([], []) == 0


@pytest.mark.parametrize("wire_dtype", [None, torch.bfloat16])
def test_packed_buckets_equal_the_per_item_path(wire_dtype):
    weights = mixed_weights(1)
    _, plan = plan_for(weights, wire_dtype)
    assert any(len({i.dtype for i in b.items}) > 1 for b in plan.buckets) or wire_dtype is not None
    assert any(len({weights[i.name].dtype for i in b.items}) > 1 for b in plan.buckets)  # mixed sources
    packer = BucketPacker()
    size = plan.max_bucket_bytes
    bufs = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]
    for k, bucket in enumerate(plan.buckets):
        want = torch.zeros(size, dtype=torch.uint8)
        per_item_pack(bucket, want, weights)
        slot = k % 2
        bufs[slot].zero_()
        chunks = chunks_of(bucket, weights)
        half = len(chunks) // 2  # two flushes, as when a gathered tensor is copied out early
        packer.pack(bucket, slot, bufs[slot], 0, chunks[:half])
        packer.pack(bucket, slot, bufs[slot], half, chunks[half:])
        assert torch.equal(bufs[slot], want), bucket.index
    # The slot views are built once: packing again reuses the same view objects.
    views = packer.views(plan.buckets[0], 0, bufs[0])
    assert packer.views(plan.buckets[0], 0, bufs[0]) is views


@pytest.mark.parametrize("wire_dtype,recv_dtype", [(None, None), (torch.bfloat16, torch.float32)])
def test_staged_slices_equal_write_rows_for_every_tp_rank(wire_dtype, recv_dtype):
    weights = mixed_weights(2)
    meta, plan = plan_for(weights, wire_dtype)
    bufs = []
    for bucket in plan.buckets:
        buf = torch.zeros(plan.max_bucket_bytes, dtype=torch.uint8)
        per_item_pack(bucket, buf, weights)
        bufs.append(buf[: bucket.nbytes])
    for tp_rank in range(2):
        specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=tp_rank, tp_size=2, dtype=recv_dtype)
        assert {s.dim for s in specs.values()} == {None, 0, 1}  # replicated, colwise and rowwise shards
        receiver = StagedReceiver(specs, lambda named, v: None)
        receiver.begin(1)
        stager = BucketStager(receiver, specs)
        old = {n: torch.zeros(s.local_shape, dtype=s.dtype) for n, s in specs.items()}
        for bucket, buf in zip(plan.buckets, bufs):
            calls = stager.stage(bucket, buf)
            assert calls <= len({(i.dtype, specs[i.name].dtype) for i in bucket.items})
            for item in bucket.items:  # the previous receiver path
                rows = buf[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.chunk_shape)
                dest = old[item.name]
                write_rows(specs[item.name], dest if dest.dim() else dest.view(1), rows, item.row_start)
        for name, spec in specs.items():
            got = receiver.stage(name)
            assert got.dtype == spec.dtype and torch.equal(got, old[name]), (tp_rank, name)
            want = spec.take(
                weights[name].to(wire_dtype) if wire_dtype and weights[name].is_floating_point() else weights[name]
            ).to(spec.dtype)
            assert torch.equal(got, want), (tp_rank, name)


@pytest.mark.parametrize("commit", [swap_into, copy_into])
def test_cached_staging_views_follow_the_commit_across_syncs(commit):
    """Four syncs in one process (pack -> buffer -> stage -> commit), new weights each time: with
    a swap commit the staging storage alternates, and the stager finds both sets of views again."""
    meta, plan = plan_for(mixed_weights(0), None)
    specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=1, tp_size=2)
    live = {n: torch.zeros(s.local_shape, dtype=s.dtype) for n, s in specs.items()}
    live_ids = {n: id(t) for n, t in live.items()}
    receiver = StagedReceiver(specs, commit(live))
    packer, stager = BucketPacker(), BucketStager(receiver, specs)
    bufs = [torch.empty(plan.max_bucket_bytes, dtype=torch.uint8) for _ in range(2)]
    ptrs = []
    for version in (1, 2, 3, 4):
        weights = mixed_weights(version)
        receiver.begin(version)
        for k, bucket in enumerate(plan.buckets):
            packer.pack(bucket, k % 2, bufs[k % 2], 0, chunks_of(bucket, weights))
            stager.stage(bucket, bufs[k % 2][: bucket.nbytes])
        ptrs.append(receiver.stage("model.norm.weight").data_ptr())
        receiver.commit(version)
        for name, spec in specs.items():
            assert torch.equal(live[name], spec.take(weights[name])), (version, name)
        assert {n: id(t) for n, t in live.items()} == live_ids  # the live tensor objects stay
    entries = {k: len(v) for k, v in stager._dst.items()}
    if commit is swap_into:
        assert ptrs[0] != ptrs[1] and ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3]  # storages alternate
        assert set(entries.values()) == {2}  # both sets cached, reused from the third sync on
    else:
        assert len(set(ptrs)) == 1 and set(entries.values()) == {1}


def test_stager_keeps_at_most_keep_view_sets_per_bucket():
    meta, plan = plan_for(mixed_weights(0), None, cuts=False)
    specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=0, tp_size=1)
    weights = mixed_weights(5)
    buf = torch.zeros(plan.max_bucket_bytes, dtype=torch.uint8)
    bucket = plan.buckets[0]
    per_item_pack(bucket, buf, weights)
    receiver = StagedReceiver(specs, lambda named, v: None)
    stager = BucketStager(receiver, specs, keep=2)
    for _ in range(3):  # fresh staging storage each time (a receiver reallocating)
        receiver._staging = {}
        receiver.begin(1)
        stager.stage(bucket, buf[: bucket.nbytes])
        for item in bucket.items:
            rows = slice(item.row_start, item.row_end)
            assert torch.equal(
                receiver.stage(item.name).reshape(item.shape)[rows], weights[item.name].reshape(item.shape)[rows]
            ), item.name
    assert len(stager._dst[bucket.index]) == 2


def test_chunk_views_are_the_item_rows_as_views():
    weights = mixed_weights(3)
    _, plan = plan_for(weights, None)
    buckets = list(plan.buckets)
    names = list(weights)
    for subset in (buckets, buckets[1::2]):  # all of one row's buckets (cover every tensor), or some
        for idx, chunks in tensor_chunks(subset).items():
            full = weights[names[idx]]
            entries, shape, sizes = chunks
            covered = sum(i.row_end - i.row_start for _, i in entries) == shape[0]
            assert (sizes is not None) == covered
            views = chunk_views(full, chunks)
            assert len(views) == len(entries)
            for (pos, item), view in zip(entries, views):
                assert item in subset[pos].items
                assert torch.equal(view, full.reshape(item.shape)[item.row_start : item.row_end])
                assert view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # no copy
    scalar = tensor_chunks(buckets)[names.index("model.logit_scale")]
    assert scalar[1] == (1,) and chunk_views(weights["model.logit_scale"], scalar)[0].shape == (1,)


class FakeWork:
    """Records how it was waited on; ``fail``: a wait with a timeout raises as a timed-out NCCL work;
    ``polls``: ``is_completed`` answers False that many times first (None: never True)."""

    def __init__(self, fail: bool = False, polls: int | None = 0) -> None:
        self.calls: list[object] = []
        self.fail = fail
        self.polls = polls
        self.polled = 0

    def is_completed(self) -> bool:
        self.polled += 1
        return self.polls is not None and self.polled > self.polls

    def wait(self, timeout=None):
        self.calls.append(timeout)
        if timeout is not None and self.fail:
            raise RuntimeError("Watchdog caught collective operation timeout")
        return True


def collectives(ordered: bool) -> Collectives:
    return Collectives(timeout_s=5, stream_ordered=ordered)  # the wait logic alone, no process groups


def test_stream_ordered_waits_defer_the_timed_host_wait_to_the_drain():
    from areno.sync.base import PolicySyncError

    t = collectives(True)
    works = [FakeWork(), FakeWork(fail=True), FakeWork()]
    for k, w in enumerate(works):
        t.order(w, f"receiving bucket {k} from training rank 0", k)
    assert [w.calls for w in works] == [[None], [None], [None]]  # stream-ordered: no host block yet
    with pytest.raises(PolicySyncError, match="receiving bucket 1 from training rank 0: Watchdog") as e:
        t.drain()
    assert e.value.buckets_done == 1
    assert works[0].calls == [None, t.timeout] and works[1].calls == [None, t.timeout]
    assert t.inflight == []
    # gloo: every wait blocks at once, with the timeout, and nothing is left for a drain.
    t = collectives(False)
    w = FakeWork()
    t.order(w, "fan-out of bucket 0", 0)
    assert w.calls == [t.timeout] and t.inflight == []


def test_nccl_host_waits_poll_before_the_millisecond_granular_timed_wait(monkeypatch):
    import datetime
    import time

    import areno.sync.collectives as collectives_module

    t = collectives(True)
    w = FakeWork(polls=3)  # done after a few polls: waited at once with the whole timeout
    t0 = time.perf_counter()
    t.wait(w, "commit vote", poll=True)
    assert w.polled == 4 and w.calls == [t.timeout] and time.perf_counter() - t0 < 0.5
    monkeypatch.setattr(collectives_module, "POLL_S", 0.05)
    w = FakeWork(polls=None)  # still running after POLL_S: Work.wait gets the rest of the timeout
    t.wait(w, "commit vote", poll=True)
    assert w.polled > 1 and len(w.calls) == 1
    assert t.timeout - datetime.timedelta(seconds=1) < w.calls[0] <= t.timeout - datetime.timedelta(seconds=0.05)
    w = FakeWork(polls=None)  # gloo works are not polled
    t.wait(w, "commit vote")
    assert w.polled == 0 and w.calls == [t.timeout]
