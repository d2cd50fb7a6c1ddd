"""Host-side fast paths of the rollout engine give what the plain forms give: sampling rows gathered
from the per-slot ``RowTable`` equal ``RowParams.build``; the scheduler keeps its running list in
arrival order when preempted requests come back."""

import pytest
import torch

from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.rollout.sampling import RowParams, RowTable
from areno.types import SamplingParams
from tests.helpers.rollout import make_model, random_prompts

EOS = (2,)
V = 50


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_new_tokens=9),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, min_new_tokens=3, seed=5),
        SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=7, max_new_tokens=30, stop_token_ids=(4, 9, 11), seed=1),
        SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, stop_token_ids=(8,)),
    ]


def _same(a: RowParams, b: RowParams) -> None:
    for name in (
        "table_FB",
        "scale_B",
        "greedy_B",
        "top_k_B",
        "top_p_B",
        "seed_B",
        "seeded_B",
        "stop_ids_BS",
        "stop_valid_BS",
        "min_new_B",
        "max_new_B",
        "n_gen_B",
        "room_B",
    ):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("any_stop_ids", "all_greedy", "any_greedy", "any_truncate", "any_min_new", "all_unseeded", "mode"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("seeded_idx", "unseeded_idx"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name


def test_row_table_gather_equals_build_for_any_subset_and_after_growth():
    params = _params()
    rows = [RowParams.row_of(p, EOS, V) for p in params]
    table = RowTable(8)
    cpu = torch.device("cpu")
    # slots written in an order where the widest stop list (4 ids) arrives after narrower ones
    slots = [6, 2, 0, 5, 3]
    table.sync(slots[:3], rows[:3])
    assert table.max_stops == 1
    table.sync(slots, rows)
    assert table.max_stops == 4  # EOS + three stop ids
    n_gen, lengths = [0, 2, 1, 7, 3], [5, 9, 4, 20, 8]
    for pick in ([0, 1, 2, 3, 4], [3, 0], [2], [4, 1], [0, 2, 4]):
        got = RowParams.gather(
            table, [slots[i] for i in pick], [n_gen[i] for i in pick], [lengths[i] for i in pick], 64, cpu
        )
        want = RowParams.build(
            [params[i] for i in pick],
            [n_gen[i] for i in pick],
            [lengths[i] for i in pick],
            EOS,
            V,
            64,
            cpu,
            slots=[slots[i] for i in pick],
        )
        _same(got, want)
    # a slot taken by another request is rewritten; one held by the same request is not
    before = table.table_FR.clone()
    table.sync([slots[0]], [rows[0]])
    assert torch.equal(table.table_FR, before)
    table.sync([slots[0]], [rows[2]])
    _same(
        RowParams.gather(table, [slots[0]], [1], [4], 64, cpu),
        RowParams.build([params[2]], [1], [4], EOS, V, 64, cpu, slots=[slots[0]]),
    )


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_running_stays_in_arrival_order_through_preemption(decode_steps):
    """A tight KV pool preempts the youngest requests; when they return they take their arrival
    place again (the oldest is never preempted for a younger one), the block-table tensor mirrors
    the running tables after every step, and outputs match a roomy pool."""
    model, cfg = make_model(0)
    prompts = random_prompts(9, seed=61, lo=8, hi=20)
    params = [
        SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (24, 10, 18, 6, 30, 12, 8, 20, 16)
    ]
    outs = {}
    for blocks in (200, 26):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(
                block_size=4,
                num_blocks=blocks,
                max_num_seqs=6,
                max_tokens_per_step=40,
                prefill_chunk_size=8,
                decode_steps=decode_steps,
                mixed_decode_min_rows=1,
            ),
            eos_token_ids=EOS,
        )
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                done[o.request_id] = o
            arrivals = [s.arrival for s in eng.scheduler.running]
            assert arrivals == sorted(arrivals)
            waiting = [s.arrival for s in eng.scheduler.waiting]
            assert waiting == sorted(waiting)
            # the block-table tensor mirrors every running sequence's table (entries written in batches)
            sched = eng.scheduler
            expect = torch.full_like(sched.block_tables_RN, sched.scratch_block)
            for seq in sched.running:
                expect[seq.row, : len(seq.block_table)] = torch.tensor(seq.block_table)
            assert torch.equal(sched.block_tables_RN, expect)
        outs[blocks] = [done[i].output_ids for i in ids]
        if blocks == 26:
            assert eng.scheduler.num_preemptions > 0
    assert outs[26] == outs[200]


def test_allocate_many_hands_out_what_single_allocations_would():
    from areno.rollout.kv_cache import BlockAllocator, OutOfBlocksError

    def pool():
        a = BlockAllocator(12, 4, enable_prefix_sharing=True)
        held = [a.allocate() for _ in range(6)]
        # three registered blocks become evictable (LRU order), one plain block goes back to the free list
        key = 0
        for b, toks in zip(held[:3], ((1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9))):
            key = a.register(b, key, toks)
        a.free_all(held[:4])
        return a

    one, many = pool(), pool()
    singles = [one.allocate() for _ in range(10)]  # the 7 free blocks, then the 3 evictable ones
    assert many.allocate_many(10) == singles
    assert [many.ref_count(b) for b in singles] == [1] * 10 and many.num_available == one.num_available == 0
    with pytest.raises(OutOfBlocksError):
        many.allocate_many(1)
    assert many.allocate_many(0) == []
