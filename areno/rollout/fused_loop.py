"""The decode loop's per-step bookkeeping in two Triton kernels (CUDA): what the CUDA-graph loop of
``DecodeGraphRunner`` runs around each forward and draw, without a kernel per tensor op.

Around each decode step of the loop the eager form launches about 25 one-block kernels: the new
token's cache slot and position (subtract, divide, clamp, gather, multiply, remainder, add, compare,
select) and, after the draw, the stop test and the row counters (compare with the stop ids, reduce,
compare with ``min_new_tokens`` and the room left, the keep / alive updates, the next step's input
token and context length). Each costs a launch slot and ~1.2 us of GPU time inside the graph,
~25 us per step of a 0.5B model on an H200 (bench/LOG.md). Here:

1. ``decode_slots``: one kernel giving each row's cache slot of its new token (the scratch slot past
   the table's width) and its RoPE position, clamped to the model's table;
2. ``advance_rows``: one kernel for the stop test and the counters, in place.

Both compute integers only, so they are exact: the self-check and the GPU test compare them with
the eager reference (``*_torch``) for equality. Off (no Triton, no CUDA, the switch off) the eager
reference runs.

Legend: B = rows, N = block-table width, S = stop-id columns.
"""

from __future__ import annotations

import torch

from areno.models import fused_ops

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ROWS_PER_PROGRAM = 128


def decode_slots_torch(
    bt_BN: torch.Tensor, ctx_B: torch.Tensor, block_size: int, scratch_slot: int, max_position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_B, pos_B): the cache slot of each row's new token at position ``ctx - 1`` (its block
    from the table; ``scratch_slot`` when the position is past the table's ``N`` blocks) and that
    position clamped to ``max_position - 1`` (rows run past their end in a multi-step decode)."""
    return new_token_slots_torch(bt_BN, ctx_B, block_size, scratch_slot), (ctx_B - 1).clamp(max=max_position - 1)


def new_token_slots_torch(bt_BN: torch.Tensor, ctx_B: torch.Tensor, block_size: int, scratch_slot: int) -> torch.Tensor:
    """``decode_slots_torch``'s slots alone."""
    N = bt_BN.shape[1]
    pos_B = ctx_B - 1
    col_B = pos_B // block_size
    slot_B = bt_BN.gather(1, col_B.clamp(max=N - 1)[:, None]).squeeze(1) * block_size + pos_B % block_size
    return torch.where(col_B < N, slot_B, scratch_slot)


def advance_rows_torch(
    tokens_B: torch.Tensor,
    stop_ids_BS: torch.Tensor,
    stop_valid_BS: torch.Tensor,
    n_gen_B: torch.Tensor,
    min_new_B: torch.Tensor,
    room_B: torch.Tensor,
    j: int,
    keep_B: torch.Tensor,
    alive_B: torch.Tensor,
    ids_B: torch.Tensor | None = None,
    ctx_B: torch.Tensor | None = None,
) -> None:
    """After the ``j``-th draw of a loop (0-based), in place: a row that is still ``alive_B`` and
    ends here (one of its valid stop ids once ``min_new_tokens`` are reached, as
    ``RowParams.advance`` counts, or no room left) keeps ``j + 1`` tokens (``keep_B``) and stops
    being alive. With ``ids_B`` / ``ctx_B``: the drawn tokens become the next step's input and
    every context grows by one."""
    hit_B = ((tokens_B[:, None] == stop_ids_BS) & stop_valid_BS).any(dim=1)
    done_B = (hit_B & (n_gen_B + 1 >= min_new_B)) | (room_B <= j + 1)
    keep_B.copy_(torch.where(done_B & alive_B, j + 1, keep_B))
    alive_B &= ~done_B
    if ids_B is not None:
        ids_B.copy_(tokens_B)
    if ctx_B is not None:
        ctx_B.add_(1)


if triton is not None:

    @triton.jit
    def _slots_kernel(BT, CTX, SLOT, POS, stride_bt, B, N, bs, scratch_slot, max_pos, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < B
        pos = tl.load(CTX + offs, mask=m, other=1) - 1  # >= 0: every row's context holds its new token
        col = pos // bs
        blk = tl.load(BT + offs * stride_bt + tl.minimum(col, N - 1), mask=m, other=0)
        slot = tl.where(col < N, blk * bs + pos % bs, scratch_slot)
        tl.store(SLOT + offs, slot, mask=m)
        tl.store(POS + offs, tl.minimum(pos, max_pos - 1), mask=m)

    @triton.jit
    def _advance_kernel(
        TOK,
        STOP,
        VALID,
        NGEN,
        MINNEW,
        ROOM,
        KEEP,
        ALIVE,
        IDS,
        CTX,
        s_stop_b,
        s_stop_s,
        s_valid_b,
        s_valid_s,
        B,
        S,
        j,
        ADVANCE: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < B
        cols = tl.arange(0, BLOCK_S)
        ms = m[:, None] & (cols[None, :] < S)
        tok = tl.load(TOK + offs, mask=m, other=0)
        stops = tl.load(STOP + offs[:, None] * s_stop_b + cols[None, :] * s_stop_s, mask=ms, other=0)
        valid = tl.load(VALID + offs[:, None] * s_valid_b + cols[None, :] * s_valid_s, mask=ms, other=0) != 0
        hit = tl.max(((stops == tok[:, None]) & valid & ms).to(tl.int32), axis=1) > 0
        n_gen = tl.load(NGEN + offs, mask=m, other=0)
        min_new = tl.load(MINNEW + offs, mask=m, other=0)
        room = tl.load(ROOM + offs, mask=m, other=0)
        done = (hit & (n_gen + 1 >= min_new)) | (room <= j + 1)
        alive = tl.load(ALIVE + offs, mask=m, other=0) != 0
        keep = tl.load(KEEP + offs, mask=m, other=0)
        tl.store(KEEP + offs, tl.where(done & alive, j + 1, keep), mask=m)
        tl.store(ALIVE + offs, alive & (done == 0), mask=m)
        if ADVANCE:
            tl.store(IDS + offs, tok, mask=m)
            tl.store(CTX + offs, tl.load(CTX + offs, mask=m, other=0) + 1, mask=m)


def _serves(*tensors: torch.Tensor) -> bool:
    return _SWITCH.on and all(t.is_cuda for t in tensors)


def decode_slots(
    bt_BN: torch.Tensor, ctx_B: torch.Tensor, block_size: int, scratch_slot: int, max_position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_slots_torch`` in one kernel where the switch is on and the tensors are on CUDA."""
    if not _serves(bt_BN, ctx_B):
        return decode_slots_torch(bt_BN, ctx_B, block_size, scratch_slot, max_position)
    B, N = bt_BN.shape
    slot_B = torch.empty(B, dtype=torch.long, device=ctx_B.device)
    pos_B = torch.empty_like(slot_B)
    grid = (triton.cdiv(B, ROWS_PER_PROGRAM),)
    _slots_kernel[grid](
        bt_BN,
        ctx_B,
        slot_B,
        pos_B,
        bt_BN.stride(0),
        B,
        N,
        block_size,
        scratch_slot,
        max_position,
        BLOCK=ROWS_PER_PROGRAM,
    )
    return slot_B, pos_B


def advance_rows(
    tokens_B: torch.Tensor,
    stop_ids_BS: torch.Tensor,
    stop_valid_BS: torch.Tensor,
    n_gen_B: torch.Tensor,
    min_new_B: torch.Tensor,
    room_B: torch.Tensor,
    j: int,
    keep_B: torch.Tensor,
    alive_B: torch.Tensor,
    ids_B: torch.Tensor | None = None,
    ctx_B: torch.Tensor | None = None,
) -> None:
    """``advance_rows_torch`` in one kernel where the switch is on and the tensors are on CUDA
    (``ids_B`` and ``ctx_B`` both given or both None)."""
    args = (tokens_B, stop_ids_BS, stop_valid_BS, n_gen_B, min_new_B, room_B)
    if not _serves(*args, keep_B, alive_B) or (ids_B is None) != (ctx_B is None):
        advance_rows_torch(*args, j, keep_B, alive_B, ids_B, ctx_B)
        return
    for t in (tokens_B, n_gen_B, min_new_B, room_B, keep_B, alive_B, *((ids_B, ctx_B) if ids_B is not None else ())):
        if t.dim() != 1 or t.stride(0) != 1:
            raise ValueError("advance_rows: the per-row tensors must be contiguous [B] vectors")
    B, S = stop_ids_BS.shape
    advance = ids_B is not None
    grid = (triton.cdiv(B, ROWS_PER_PROGRAM),)
    _advance_kernel[grid](
        tokens_B,
        stop_ids_BS,
        stop_valid_BS,
        n_gen_B,
        min_new_B,
        room_B,
        keep_B,
        alive_B,
        ids_B if advance else keep_B,
        ctx_B if advance else keep_B,
        *stop_ids_BS.stride(),
        *stop_valid_BS.stride(),
        B,
        S,
        j,
        ADVANCE=advance,
        BLOCK=ROWS_PER_PROGRAM,
        BLOCK_S=triton.next_power_of_2(max(S, 1)),
    )


def self_check(device: torch.device | str = "cuda") -> str | None:
    """Both kernels on random rows (several batch sizes, stop columns, padded and past-the-table
    positions) against the eager reference; None when every output is equal, else what differs."""
    gen = torch.Generator().manual_seed(0)
    try:
        for B, S, N in ((1, 1, 3), (64, 2, 40), (200, 5, 9), (7, 0, 2)):
            bs = 16
            bt = torch.randint(0, 500, (B, N), generator=gen)
            ctx = torch.randint(1, N * bs + 20, (B,), generator=gen)  # some past the table's width
            want = decode_slots_torch(bt, ctx, bs, 16 * 501, 300)
            got = decode_slots(bt.to(device), ctx.to(device), bs, 16 * 501, 300)
            if not all(torch.equal(g.cpu(), w) for g, w in zip(got, want)):
                return f"decode_slots differs from the eager ops at B={B}, N={N}"
            tok = torch.randint(0, 6, (B,), generator=gen)
            stops = torch.randint(0, 6, (S, B), generator=gen).T  # transposed, as RowTensors holds them
            valid = (torch.rand(S, B, generator=gen) > 0.3).T
            n_gen, min_new = torch.randint(0, 4, (B,), generator=gen), torch.randint(0, 4, (B,), generator=gen)
            room = torch.randint(0, 4, (B,), generator=gen)
            for j, adv in ((0, True), (2, False)):
                keep, alive = torch.full((B,), 8), torch.rand(B, generator=gen) > 0.2
                ids, ctx2 = torch.zeros(B, dtype=torch.long), ctx.clone()
                cpu = [keep.clone(), alive.clone(), ids.clone(), ctx2.clone()]
                advance_rows_torch(tok, stops, valid, n_gen, min_new, room, j, *cpu[:2], *(cpu[2:] if adv else ()))
                dev = [t.to(device) for t in (keep, alive, ids, ctx2)]
                ins = (tok, stops, valid, n_gen, min_new, room)
                advance_rows(*(t.to(device) for t in ins), j, *dev[:2], *(dev[2:] if adv else ()))
                if not all(torch.equal(d.cpu(), c) for d, c in zip(dev, cpu)):
                    return f"advance_rows differs from the eager ops at B={B}, S={S}, j={j}"
    except Exception as e:  # noqa: BLE001 - a compiler or driver error leaves the eager ops
        return f"{type(e).__name__}: {e}"
    return None


_SWITCH = fused_ops.KernelSwitch("the fused decode-loop bookkeeping (the eager ops run)", lambda: self_check())


def enable() -> bool:
    """Turn both kernels on for this process after their self-check (idempotent; the rollout engine
    calls it with its other fused kernels, before any graph is captured)."""
    return _SWITCH.enable()


def disable() -> None:
    _SWITCH.disable()
