"""Planner: LPT balance, bounded buckets with chunking, global order, relays, TP shard specs."""

from __future__ import annotations

import pytest
import torch

from areno.sync.base import ShardSpec, write_rows
from areno.sync.plan import ALIGN_BYTES, assign_rows, choose_relays, plan_buckets, shard_specs_from_tp_plan
from tests.helpers.sync import TP_PLAN, tiny_weights


def test_assign_rows_is_greedy_lpt():
    # Sorted: a 10, b 7, c 6, d 5, e 2 -> a:r0, b:r1, c:r1 (7<10), d:r0 (10<13), e:r0 (15 vs 13 -> r1)
    owner = assign_rows([("e", 2), ("a", 10), ("c", 6), ("b", 7), ("d", 5)], 2)
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}
    with pytest.raises(ValueError, match="num_rows"):
        assign_rows([("a", 1)], 0)


def test_plan_balances_rows_and_bounds_buckets():
    meta = [(n, tuple(t.shape), t.dtype) for n, t in tiny_weights(0).items()]
    total = sum(t.numel() * 4 for t in tiny_weights(0).values())
    plan = plan_buckets(meta, num_rows=2, bucket_bytes=2048)
    assert plan.total_bytes == total and sum(plan.row_bytes) == total
    assert max(plan.row_bytes) - min(plan.row_bytes) <= max(t.numel() * 4 for t in tiny_weights(0).values())
    assert plan.max_bucket_bytes <= 2048
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))
    # Every byte of every tensor is covered exactly once, rows in order, offsets aligned.
    covered: dict[str, list[tuple[int, int]]] = {}
    for b in plan.buckets:
        assert all(plan.owner[i.name] == b.row for i in b.items)
        for i in b.items:
            assert i.offset % ALIGN_BYTES == 0 and i.offset + i.nbytes <= b.nbytes
            covered.setdefault(i.name, []).append((i.row_start, i.row_end))
    for name, shape, _ in meta:
        spans = sorted(covered[name])
        assert spans[0][0] == 0 and spans[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # The embedding (8 KiB) does not fit a 2 KiB bucket: it became 4 chunks of 16 rows.
    assert sorted(covered["model.embed_tokens.weight"]) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    # Global order follows the source: a bucket is sent once its last tensor has been read.
    ready = [b.ready_after for b in plan.buckets]
    assert ready == sorted(ready)


def test_plan_wire_dtype_and_errors():
    meta = [("w", (4, 8), torch.float32), ("ids", (4,), torch.int64)]
    plan = plan_buckets(meta, 1, 4096, wire_dtype=torch.bfloat16)
    dtypes = {i.name: i.dtype for b in plan.buckets for i in b.items}
    assert dtypes == {"w": torch.bfloat16, "ids": torch.int64}
    assert plan.total_bytes == 4 * 8 * 2 + 4 * 8
    kept = plan_buckets(meta, 1, 4096, wire_dtype=torch.bfloat16, float32_names={"w"})  # a float32 router
    assert {i.name: i.dtype for b in kept.buckets for i in b.items} == {"w": torch.float32, "ids": torch.int64}
    with pytest.raises(ValueError, match="smaller than one row"):
        plan_buckets([("w", (2, 1024), torch.float32)], 1, 1024)
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([("w", (2,), torch.float32)] * 2, 1, 1024)


def test_relays_on_distinct_devices_for_overlapping_lists():
    # Train and rollout on the same two GPUs: each row's relay is the rollout rank on the other one.
    assert choose_relays(["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"]) == [1, 0]
    # Partial overlap: train 0-3, rollout 2-5: relays avoid the sender's GPU and spread out.
    relays = choose_relays(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], ["cuda:2", "cuda:3", "cuda:4", "cuda:5"])
    rollout = ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]
    assert all(rollout[j] != s for j, s in zip(relays, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]))
    assert sorted(relays) == [0, 1, 2, 3]
    # More rows than rollout ranks: relays are reused evenly.
    assert choose_relays(["a", "b", "c", "d"], ["x", "y"]) == [0, 1, 0, 1]


def test_relays_impossible_or_invalid():
    with pytest.raises(ValueError, match="no rollout rank on another device"):
        choose_relays(["cuda:0"], ["cuda:0"])
    with pytest.raises(ValueError, match="share devices"):
        choose_relays(["cuda:0"], ["cuda:1", "cuda:1"])


def test_shard_specs_from_tp_plan():
    meta = [(n, tuple(t.shape), t.dtype) for n, t in tiny_weights(0).items()]
    specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=1, tp_size=2, dtype=torch.bfloat16)
    q, qb = specs["model.layers.0.self_attn.q_proj.weight"], specs["model.layers.0.self_attn.q_proj.bias"]
    assert (q.dim, q.start, q.length, q.local_shape, q.dtype) == (0, 16, 16, (16, 32), torch.bfloat16)
    assert (qb.dim, qb.start, qb.length) == (0, 16, 16)
    o = specs["model.layers.1.self_attn.o_proj.weight"]
    assert (o.dim, o.start, o.length) == (1, 16, 16)
    assert specs["model.norm.weight"].dim is None
    assert specs["model.embed_tokens.weight"].dim == 0
    with pytest.raises(ValueError, match="not divisible"):
        shard_specs_from_tp_plan([("model.layers.0.mlp.up_proj.weight", (5, 4), torch.float32)], TP_PLAN, 0, 2)


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_write_rows_assembles_the_slice_from_chunks(dim):
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    spec = ShardSpec(
        name="w",
        full_shape=(6, 4),
        dtype=torch.bfloat16,
        dim=dim,
        start=2 if dim is not None else 0,
        length=2 if dim is not None else 0,
    )
    dest = torch.zeros(spec.local_shape, dtype=torch.bfloat16)
    for r0, r1 in [(0, 3), (3, 5), (5, 6)]:
        write_rows(spec, dest, full[r0:r1], r0)
    assert torch.equal(dest, spec.take(full).to(torch.bfloat16))


def test_shard_specs_agree_with_the_models_tp_plan():
    """The rollout slices the planner computes from ``areno.models.tp_plan`` are exactly the ones
    the model package cuts (``shard_tensor``), for every parameter of a tiny Qwen2."""
    from areno.models.decoder import Decoder
    from areno.models.hf_io import tiny_config
    from areno.models.tp_plan import shard_tensor, tp_plan, tp_style

    cfg = tiny_config(64, hidden_size=32, layers=2, heads=4, kv_heads=2)
    state = Decoder(cfg).state_dict()
    meta = [(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    plan = tp_plan(cfg)
    for rank in range(2):
        specs = shard_specs_from_tp_plan(meta, plan, tp_rank=rank, tp_size=2)
        for name, full in state.items():
            expected = shard_tensor(full, tp_style(plan, name), rank, 2)
            assert torch.equal(specs[name].take(full), expected), name


def test_plan_cuts_at_shard_boundaries_and_sends_large_chunks_unpacked():
    meta = [
        ("big", (64, 8), torch.float32),
        ("b1", (8,), torch.float32),
        ("mid", (24, 8), torch.float32),
        ("b2", (8,), torch.float32),
    ]
    # big: 2 KiB, cut at row 32 (a TP-2 boundary) -> two 1 KiB chunks; mid: 768 B, cuts at 6/12/18.
    plan = plan_buckets(meta, 1, 4096, cuts={"big": [0, 32, 64], "mid": [6, 12, 18]}, direct_bytes=1024)
    spans = [[(i.name, i.row_start, i.row_end, i.offset) for i in b.items] for b in plan.buckets]
    assert spans == [
        [("big", 0, 32, 0)],
        [("big", 32, 64, 0)],  # each chunk on its own, from offset 0
        # small chunks packed, aligned, in source order, cut at every boundary
        [
            ("b1", 0, 8, 0),
            ("mid", 0, 6, 64),
            ("mid", 6, 12, 256),
            ("mid", 12, 18, 448),
            ("mid", 18, 24, 640),
            ("b2", 0, 8, 832),
        ],
    ]
    assert [b.ready_after for b in plan.buckets] == [0, 0, 3]
    # Cuts combine with the bucket bound: a 2 KiB bucket splits the 1 KiB halves no further, a
    # 512 B one splits each half in two; no chunk straddles row 32.
    small = plan_buckets(meta[:1], 1, 512, cuts={"big": [32]})
    assert [(i.row_start, i.row_end) for b in small.buckets for i in b.items] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    # direct_bytes None: everything is packed as it comes.
    assert len(plan_buckets(meta, 1, 4096, cuts={"big": [32]}).buckets) == 1


def test_nccl_stream_groups_outlast_the_syncs_host_wait():
    """walk34: NCCL's watchdog counts the group's timeout from a bucket's enqueue, before the host wait's
    own timeout starts, and tore the process down before PolicySyncError could name the silent ranks."""
    from areno.sync.stream import StreamSyncConfig, stream_group_timeout

    config = StreamSyncConfig(timeout_s=600.0, connect_timeout_s=300.0)
    assert stream_group_timeout(config, "nccl").total_seconds() == 1500.0
    assert stream_group_timeout(config, "cpu:gloo,cuda:nccl").total_seconds() == 1500.0
    # gloo has no watchdog: the longer of the two bounds creation, as before
    assert stream_group_timeout(config, "gloo").total_seconds() == 600.0
    short = StreamSyncConfig(timeout_s=2.0, connect_timeout_s=30.0)
    assert stream_group_timeout(short, "nccl").total_seconds() > short.timeout_s + short.connect_timeout_s
