"""The decode loop's bookkeeping (areno/rollout/fused_loop.py): the eager reference by hand, the routing
on CPU, and on CUDA (gpu tests) the kernels against the reference, inside a CUDA graph too."""

from __future__ import annotations

import pytest
import torch

from areno.rollout import fused_loop


def test_decode_slots_by_hand():
    """Block size 4, table [[7, 9], [3, 5]]: context 6 puts the new token at position 5, block 9 slot 1
    (37); context 1 at position 0 of block 3 (12); past the table's 8 positions the scratch slot. The
    position is clamped to the RoPE table (max_position 6 -> at most 5)."""
    bt = torch.tensor([[7, 9], [3, 5], [3, 5]])
    ctx = torch.tensor([6, 1, 9])
    slot, pos = fused_loop.decode_slots_torch(bt, ctx, 4, 400, 6)
    assert slot.tolist() == [37, 12, 400]
    assert pos.tolist() == [5, 0, 5]
    assert fused_loop.new_token_slots_torch(bt, ctx, 4, 400).tolist() == [37, 12, 400]


def test_advance_rows_by_hand():
    """Row 0 draws its valid stop id with min_new reached: it keeps j + 1 = 3 tokens and dies; row 1
    draws a stop id below min_new: goes on; row 2 has no room after this token: keeps 3; row 3 draws an
    id that is a stop id only in an invalid (padding) column: goes on; row 4 was dead already: its keep
    stays. The drawn tokens become the inputs and every context grows by one."""
    tok = torch.tensor([5, 5, 1, 6, 5])
    stops = torch.tensor([[5, 2], [5, 2], [9, 9], [2, 6], [5, 5]])
    valid = torch.tensor([[True, True], [True, True], [False, False], [True, False], [True, True]])
    n_gen = torch.tensor([4, 0, 4, 4, 4])
    min_new = torch.tensor([1, 3, 0, 0, 0])
    room = torch.tensor([9, 9, 3, 9, 9])
    keep, alive = torch.full((5,), 8), torch.tensor([True, True, True, True, False])
    keep[4] = 1
    ids, ctx = torch.zeros(5, dtype=torch.long), torch.tensor([10, 11, 12, 13, 14])
    fused_loop.advance_rows_torch(tok, stops, valid, n_gen, min_new, room, 2, keep, alive, ids, ctx)
    assert keep.tolist() == [3, 8, 3, 8, 1]
    assert alive.tolist() == [False, True, False, True, False]
    assert ids.tolist() == tok.tolist()
    assert ctx.tolist() == [11, 12, 13, 14, 15]
    # the last step of a loop (no next input) at j = 8: the rows still alive run out of room (9 <= 9)
    fused_loop.advance_rows_torch(tok, stops, valid, n_gen, min_new, room, 8, keep, alive)
    assert ctx.tolist() == [11, 12, 13, 14, 15]
    assert keep.tolist() == [3, 9, 3, 9, 1] and not alive.any()


def test_cpu_tensors_take_the_eager_ops():
    """CPU tensors never reach a kernel, whatever the switch says; without CUDA it never turns on."""
    bt, ctx = torch.tensor([[7, 9]]), torch.tensor([6])
    assert [t.tolist() for t in fused_loop.decode_slots(bt, ctx, 4, 400, 6)] == [[37], [5]]
    if not torch.cuda.is_available():
        assert fused_loop.enable() is False


@pytest.mark.gpu
def test_kernels_equal_the_eager_ops_on_gpu():
    """The self-check passes; at the engine's sizes (up to 300 rows, 4 stop columns as RowTensors holds
    them: transposed views) both kernels give exactly the eager outputs, and inside a CUDA graph too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert fused_loop.self_check() is None
    assert fused_loop.enable()
    g = torch.Generator().manual_seed(3)
    for B in (1, 64, 300):
        bt = torch.randint(0, 1000, (B, 33), generator=g).cuda()
        ctx = torch.randint(1, 33 * 16 + 40, (B,), generator=g).cuda()
        want = fused_loop.decode_slots_torch(bt, ctx, 16, 16 * 1001, 512)
        static_ctx = ctx.clone()
        fused_loop.decode_slots(bt, static_ctx, 16, 16 * 1001, 512)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fused_loop.decode_slots(bt, static_ctx, 16, 16 * 1001, 512)
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        table = torch.randint(0, 8, (8, B), generator=g).cuda()
        tok = torch.randint(0, 8, (B,), generator=g).cuda()
        stops, valid = table[:4].T, (table[4:] > 2).T
        n_gen, min_new, room = (torch.randint(0, 5, (B,), generator=g).cuda() for _ in range(3))
        for j, more in ((0, True), (6, False)):
            state = [torch.randint(1, 9, (B,), generator=g).cuda(), (torch.rand(B, generator=g) > 0.2).cuda()]
            state += [torch.zeros(B, dtype=torch.long).cuda(), ctx.clone()] if more else []
            ref = [t.clone() for t in state]
            fused_loop.advance_rows_torch(tok, stops, valid, n_gen, min_new, room, j, *ref)
            fused_loop.advance_rows(tok, stops, valid, n_gen, min_new, room, j, *state)
            assert all(torch.equal(a, b) for a, b in zip(state, ref)), (B, j)
