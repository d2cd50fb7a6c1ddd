"""Decode attention read straight from the paged KV pool (``RolloutEngineConfig.decode_attention="paged"``).

The ``"gather"`` decode path copies every sequence's keys and values out of the block pool into a
dense ``[B, L, Hkv, Dh]`` tensor per layer and step before attending. This module attends one query
token per sequence directly over the pool, walking the block table:

- ``paged_decode_triton`` (CUDA, Triton importable): one program per (sequence, KV head) holding the
  ``G = Hq / Hkv`` query heads of that KV head; it loops over the sequence's keys ``TILE`` positions
  at a time (a tile may span several blocks: each key's block id is read from the table), with an
  online softmax and fp32 accumulation. Only keys ``lo .. ctx - 1`` are read (``lo`` > 0 with a
  sliding window), so the work follows each row's real context, not the padded table width. Shapes
  are static and bounds are read on the device: it runs inside CUDA-graph capture. When
  ``B * Hkv`` programs are too few to fill the GPU, each (sequence, KV head) is split over up to
  ``MAX_SPLITS`` programs sharing its key tiles (split-K, "flash decoding"); a second kernel merges
  their partial softmaxes.
- ``paged_decode_rotary`` (CUDA, a pure decode step of a model with RoPE): the same kernel fed the
  fused q/k/v product before RoPE. Each program rotates its query heads and the new key with
  ``fused_ops.rope_write_kv``'s roundings; the last split writes the new K/V into the pool and
  attends the new key from registers while every program reads only the cached keys before it, so
  no program reads a slot written in the same launch. One launch per layer instead of two.
- ``paged_decode_torch`` (everywhere else; the reference the Triton kernel is tested against): the
  same online softmax over chunks of block-table columns, so the temporary copy is one chunk
  ``[B, C, Hkv, Dh]`` (C ≈ 128 keys) rather than the whole context.

Semantics are those of ``PagedAttention.for_decode``'s gather path: the query at position
``p = ctx - 1`` sees keys ``j <= p`` (and ``j > p - sliding_window``) among the table's
``N * block_size`` positions; scale 1/sqrt(Dh). ``sinks_H`` (gpt-oss's attention sinks): a logit per
query head that joins the softmax's denominator with no value; the online softmax starts from it
(running max ``s_h``, running sum 1, accumulator 0), in the last split only, so split-K's combine
counts it once. ``softcap`` (Gemma 2's soft-capped scores): each scaled score s becomes
``softcap * tanh(s / softcap)`` before the mask, in fp32 (the Triton kernel writes tanh from ``exp``, with a
series near 0, ``_soft_cap``).

Legend: B = sequences, N = block-table width, Hq/Hkv = query/KV heads, G = Hq / Hkv, Dh = head dim,
S = KV slots (``(num_blocks + 1) * block_size``), C = keys per chunk.
"""

from __future__ import annotations

import math

import torch

from areno.models.attention import HeadNorms
from areno.models.eager_ops import soft_cap

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

TORCH_CHUNK_KEYS = 128
"""``paged_decode_torch``: keys gathered per iteration (rounded to whole blocks)."""
SPLIT_TARGET_PROGRAMS_PER_SM = 4
"""Triton: split each (sequence, KV head) while the programs stay at most this many per SM (small batches)."""
MAX_SPLITS = 8
"""Triton: most split-K programs per (sequence, KV head)."""
NUM_WARPS = 4
"""Triton: warps per decode program."""
NUM_STAGES = 2
"""Triton: software-pipelining stages of the decode program's key loop."""


def triton_available() -> bool:
    return triton is not None


def paged_decode(
    q_BHD: torch.Tensor,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    bt_BN: torch.Tensor,
    ctx_B: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention over the paged pool: Triton on CUDA when available, else the torch loop.

    ``q_BHD``: [B, Hq, Dh] one query per sequence; ``k_S``/``v_S``: [S, Hkv, Dh] the layer's pool;
    ``bt_BN``: long [B, N] block tables (padding: any valid block id); ``ctx_B``: long [B] context
    length including the new token; ``sinks_H``: [Hq] sink logits, or None; ``softcap``: the score cap,
    or None. Returns [B, Hq, Dh] in ``q_BHD``'s dtype."""
    if q_BHD.is_cuda and triton is not None:
        return paged_decode_triton(
            q_BHD, k_S, v_S, bt_BN, ctx_B, block_size, sliding_window, sinks_H=sinks_H, softcap=softcap
        )
    return paged_decode_torch(q_BHD, k_S, v_S, bt_BN, ctx_B, block_size, sliding_window, sinks_H, softcap)


def paged_decode_torch(
    q_BHD: torch.Tensor,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    bt_BN: torch.Tensor,
    ctx_B: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Online-softmax decode attention over chunks of block-table columns (fp32 accumulation).
    ``sinks_H``: [Hq] sink logits, the softmax's starting state (max ``s_h``, sum 1); ``softcap``: each
    score capped before the mask."""
    B, Hq, Dh = q_BHD.shape
    Hkv = k_S.shape[1]
    G = Hq // Hkv
    N = bt_BN.shape[1]
    bs = block_size
    cols = max(1, TORCH_CHUNK_KEYS // bs)
    q_BKGD = q_BHD.reshape(B, Hkv, G, Dh).float() * (1.0 / math.sqrt(Dh))
    pos_B1 = (ctx_B - 1)[:, None]
    if sinks_H is None:
        m_BKG = q_BKGD.new_full((B, Hkv, G), -math.inf)
        l_BKG = q_BKGD.new_zeros((B, Hkv, G))
    else:
        m_BKG = sinks_H.float().reshape(1, Hkv, G).expand(B, Hkv, G)
        l_BKG = q_BKGD.new_ones((B, Hkv, G))
    acc_BKGD = q_BKGD.new_zeros((B, Hkv, G, Dh))
    offs_C = torch.arange(cols * bs, device=bt_BN.device)
    for n0 in range(0, N, cols):
        nc = min(cols, N - n0)
        key_C = n0 * bs + offs_C[: nc * bs]
        slots_BC = (bt_BN[:, n0 : n0 + nc, None] * bs + torch.arange(bs, device=bt_BN.device)).reshape(B, nc * bs)
        flat = slots_BC.reshape(-1)
        k_BCKD = k_S.index_select(0, flat).view(B, nc * bs, Hkv, Dh).float()
        v_BCKD = v_S.index_select(0, flat).view(B, nc * bs, Hkv, Dh).float()
        valid_BC = key_C[None, :] <= pos_B1
        if sliding_window is not None:
            valid_BC &= key_C[None, :] > pos_B1 - sliding_window
        s_BKGC = soft_cap(torch.einsum("bkgd,bckd->bkgc", q_BKGD, k_BCKD), softcap)
        s_BKGC = s_BKGC.masked_fill(~valid_BC[:, None, None, :], -math.inf)
        m_new = torch.maximum(m_BKG, s_BKGC.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # a row with no valid key yet
        alpha = torch.exp(m_BKG - m_safe)
        p_BKGC = torch.exp(s_BKGC - m_safe[..., None])
        l_BKG = l_BKG * alpha + p_BKGC.sum(dim=-1)
        acc_BKGD = acc_BKGD * alpha[..., None] + torch.einsum("bkgc,bckd->bkgd", p_BKGC, v_BCKD)
        m_BKG = m_new
    out_BKGD = acc_BKGD / torch.where(l_BKG == 0, 1.0, l_BKG)[..., None]
    return out_BKGD.reshape(B, Hq, Dh).to(q_BHD.dtype)


if triton is not None:
    from areno.models.fused_ops import _round_to

    # One unit on purpose: the kernel body is one program's online softmax; split into jit helpers it reads worse.
    @triton.jit
    def _head_normed(x, rs, w, dt: tl.constexpr, FP32: tl.constexpr):
        """``fused_ops.rms_norm``'s output for fp32 ``x`` of inverse RMS ``rs`` and weight (+ offset)
        ``w``, kept in fp32: scaled in float32 and rounded once, or (Llama's order) rounded, scaled,
        rounded."""
        if FP32:
            return _round_to(w * (x * rs), dt)
        return _round_to(w * _round_to(x * rs, dt), dt)

    @triton.jit
    def _soft_cap(s, softcap):
        """``softcap * tanh(s / softcap)`` in fp32 to a few ulps: (1 - e) / (1 + e) of e = exp(-2|x|), whose
        1 - e would lose the relative precision of a small |x|, where the series of tanh to x^7 takes over
        (below 1/8 its next term is under 1e-9 of the value)."""
        x = s / softcap
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        x2 = ax * ax
        series = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        t = tl.where(ax < 0.125, series, (1.0 - e) / (1.0 + e))
        return softcap * tl.where(x < 0, -t, t)

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        ctx_ptr,
        out_ptr,
        part_acc_ptr,
        part_m_ptr,
        part_l_ptr,
        stride_qb,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_btb,
        stride_btn,
        stride_ctx,
        stride_ob,
        stride_oh,
        scale,
        num_cols,
        window,
        num_q_heads,
        cos_ptr,
        sin_ptr,
        stride_ct,
        slot_ptr,
        num_kv_heads,
        qn_ptr,
        kn_ptr,
        norm_eps,
        sink_ptr,
        softcap,
        BLOCK_SIZE: tl.constexpr,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        TILE: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        IEEE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        ROTARY: tl.constexpr,
        QK_NORM: tl.constexpr,
        NORM_FP32: tl.constexpr,
        NORM_OFFSET: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ):
        # Program (b, kvh, split): the query heads of KV head kvh of sequence b over split-th share
        # of its key tiles. NUM_SPLITS == 1 writes the output; otherwise the unnormalised partial
        # (acc, running max, sum) for _combine_kernel. ROTARY: q_ptr is the fused q/k/v product
        # before RoPE; q and the new key are rotated here, the new K/V written to the pool by the
        # last split, which also attends the new key from registers (the others read keys < pos).
        # QK_NORM (with ROTARY): each head of q and the new key RMS-normed first (weights qn / kn,
        # Qwen3's and Gemma 3's per-head norms), with the norm kernel's roundings. HAS_SINKS: the
        # last split's softmax starts from the heads' sink logits (max s_h, sum 1), counted once.
        # HAS_SOFTCAP: every scaled score s (the new key's too) becomes softcap * tanh(s / softcap) before the
        # mask (_soft_cap).
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = tl.arange(0, TILE)
        g_ok = offs_g < G
        d_ok = offs_d < D
        q_row = q_ptr + b * stride_qb
        q_head = (kvh * G + offs_g)[:, None] * stride_qh
        q_off = q_head + offs_d[None, :]
        if ROTARY:
            dt = q_ptr.dtype.element_ty
            half = D // 2
            f = offs_d % half
            partner = (offs_d + half) % D  # rotate-half: x[d] * cos - x[d + D/2] * sin for d < D/2
            sgn = tl.where(offs_d < half, -1.0, 1.0)
            c = tl.load(cos_ptr + b * stride_ct + f, mask=d_ok, other=0.0).to(tl.float32)
            sn = tl.load(sin_ptr + b * stride_ct + f, mask=d_ok, other=0.0).to(tl.float32)
            q_ok = g_ok[:, None] & d_ok[None, :]
            x = tl.load(q_row + q_off, mask=q_ok, other=0.0).to(tl.float32)
            xp = tl.load(q_row + q_head + partner[None, :], mask=q_ok, other=0.0).to(tl.float32)
            if QK_NORM:  # the partner column is the same head's: one inverse RMS serves both
                rs = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + norm_eps)[:, None]
                wq = tl.load(qn_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32) + NORM_OFFSET
                wqp = tl.load(qn_ptr + partner, mask=d_ok, other=0.0).to(tl.float32) + NORM_OFFSET
                x = _head_normed(x, rs, wq[None, :], dt, NORM_FP32)
                xp = _head_normed(xp, rs, wqp[None, :], dt, NORM_FP32)
            # rope_write_kv's roundings: each product, then the sum, in the model dtype
            q = (_round_to(x * c[None, :], dt) + sgn[None, :] * _round_to(xp * sn[None, :], dt)).to(dt)
            k_row = q_row + (num_q_heads + kvh) * D
            kx = tl.load(k_row + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            kxp = tl.load(k_row + partner, mask=d_ok, other=0.0).to(tl.float32)
            if QK_NORM:
                rs_k = tl.math.rsqrt(tl.sum(kx * kx, axis=0) / D + norm_eps)
                wk = tl.load(kn_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32) + NORM_OFFSET
                wkp = tl.load(kn_ptr + partner, mask=d_ok, other=0.0).to(tl.float32) + NORM_OFFSET
                kx = _head_normed(kx, rs_k, wk, dt, NORM_FP32)
                kxp = _head_normed(kxp, rs_k, wkp, dt, NORM_FP32)
            k_new = (_round_to(kx * c, dt) + sgn * _round_to(kxp * sn, dt)).to(dt)
            v_new = tl.load(q_row + (num_q_heads + num_kv_heads + kvh) * D + offs_d, mask=d_ok, other=0.0)
        else:
            q = tl.load(q_row + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        ctx = tl.load(ctx_ptr + b * stride_ctx).to(tl.int32)
        pos = ctx - 1
        if ROTARY:
            hi = tl.minimum(pos, num_cols * BLOCK_SIZE)  # the new key is attended from registers
        else:
            hi = tl.minimum(ctx, num_cols * BLOCK_SIZE)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        lo = (lo // TILE) * TILE
        n_tiles = (hi - lo + TILE - 1) // TILE
        per = ((n_tiles + NUM_SPLITS - 1) // NUM_SPLITS) * TILE
        s_lo = lo + split * per
        s_hi = tl.minimum(hi, s_lo + per)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if HAS_SINKS:
            if split == NUM_SPLITS - 1:
                m_i = tl.load(sink_ptr + kvh * G + offs_g, mask=g_ok, other=0.0).to(tl.float32)
                l_i = tl.full([BLOCK_G], 1.0, tl.float32)
        bt_row = bt_ptr + b * stride_btb
        for start in range(s_lo, s_hi, TILE):
            t = start + offs_t
            ok = t < hi
            if HAS_WINDOW:
                ok = ok & (t > pos - window)
            blk = tl.load(bt_row + (t // BLOCK_SIZE) * stride_btn, mask=ok, other=0).to(tl.int64)
            slot = blk * BLOCK_SIZE + (t % BLOCK_SIZE)
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_ok, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            if HAS_SOFTCAP:
                s = _soft_cap(s, softcap)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_ok, other=0.0)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if ROTARY:
            if split == NUM_SPLITS - 1:
                slot = tl.load(slot_ptr + b).to(tl.int64)
                tl.store(k_ptr + slot * stride_ks + kvh * stride_kh + offs_d, k_new, mask=d_ok)
                tl.store(v_ptr + slot * stride_vs + kvh * stride_vh + offs_d, v_new, mask=d_ok)
                # a row past its table (run on in a multi-step decode, discarded) does not see its key
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
                if HAS_SOFTCAP:
                    s_new = _soft_cap(s_new, softcap)
                s_new = tl.where(pos < num_cols * BLOCK_SIZE, s_new, float("-inf"))
                m_new = tl.maximum(m_i, s_new)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p_new = tl.exp(s_new - m_safe)
                l_i = l_i * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new
        if NUM_SPLITS == 1:
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + b * stride_ob + (kvh * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=g_ok[:, None] & d_ok[None, :],
            )
        else:
            row_g = (b * num_q_heads + kvh * G + offs_g) * NUM_SPLITS + split  # [B, Hq, NUM_SPLITS] layout
            tl.store(part_m_ptr + row_g, m_i, mask=g_ok)
            tl.store(part_l_ptr + row_g, l_i, mask=g_ok)
            tl.store(part_acc_ptr + row_g[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _combine_kernel(
        part_acc_ptr,
        part_m_ptr,
        part_l_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        num_q_heads,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program (b, h): merge the NUM_SPLITS partial softmaxes of query head h of sequence b.
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < NUM_SPLITS
        d_ok = offs_d < D
        row_s = (b * num_q_heads + h) * NUM_SPLITS + offs_s
        m = tl.load(part_m_ptr + row_s, mask=s_ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + row_s, mask=s_ok, other=0.0)
        acc = tl.load(
            part_acc_ptr + row_s[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp(m - m_max)  # an empty split (m = -inf) weighs 0
        denom = tl.sum(w * l_s, 0)
        denom = tl.where(denom == 0.0, 1.0, denom)
        out = tl.sum(acc * w[:, None], 0) / denom
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def auto_num_splits(num_seqs: int, num_kv_heads: int, max_keys: int, tile: int, device: torch.device) -> int:
    """Split-K programs per (sequence, KV head): the most that keep the programs at
    ``SPLIT_TARGET_PROGRAMS_PER_SM`` per SM or fewer, at least one, at most ``MAX_SPLITS`` and one tile of
    ``max_keys`` (the table width) each."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # rounded down: a batch that fills the SMs alone is slower split in two, combine kernel included
    want = SPLIT_TARGET_PROGRAMS_PER_SM * sms // (num_seqs * num_kv_heads)
    return max(1, min(MAX_SPLITS, -(-max_keys // tile), want))


def paged_decode_triton(
    q_BHD: torch.Tensor,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    bt_BN: torch.Tensor,
    ctx_B: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    tile: int = 64,
    num_splits: int | None = None,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The Triton kernel (CUDA tensors). ``tile``: keys per loop iteration (a power of two >= 16).
    ``num_splits``: programs per (sequence, KV head), each over a share of the key tiles, merged by a
    second kernel (split-K, for batches too small to fill the GPU). None: enough for about
    ``SPLIT_TARGET_PROGRAMS_PER_SM`` programs per SM, at most ``MAX_SPLITS`` and one tile each.
    ``sinks_H``: [Hq] sink logits, or None; ``softcap``: the score cap, or None."""
    if triton is None:
        raise RuntimeError("decode_attention='paged' on CUDA needs triton: install triton or use 'gather'")
    if k_S.stride(2) != 1 or v_S.stride(2) != 1:
        raise ValueError("paged_decode_triton needs K/V pools contiguous in the head dim")
    out_dtype = q_BHD.dtype  # a KV cache dtype other than the model's: compute in the cache's, return the model's
    q_BHD = q_BHD if q_BHD.stride(2) == 1 else q_BHD.contiguous()
    if q_BHD.dtype != k_S.dtype:
        q_BHD = q_BHD.to(k_S.dtype)
    B, Hq, Dh = q_BHD.shape
    out_BHD = _run_decode(
        q_BHD, Hq, k_S, v_S, bt_BN, ctx_B, block_size, sliding_window, tile, num_splits, None,
        sinks_H=sinks_H, softcap=softcap,
    )  # fmt: skip
    return out_BHD.to(out_dtype)


def paged_decode_rotary(
    qkv_BN: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    cos_BF: torch.Tensor,
    sin_BF: torch.Tensor,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    slot_B: torch.Tensor,
    bt_BN: torch.Tensor,
    ctx_B: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    tile: int = 64,
    num_splits: int | None = None,
    num_stages: int = NUM_STAGES,
    qk_norm: HeadNorms | None = None,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A decode step's attention from its fused q/k/v product before RoPE (``qkv_BN``: [B, (Hq + 2
    Hkv) Dh], one new token per sequence at position ``ctx - 1``): what ``fused_ops.rope_write_kv``
    then ``paged_decode_triton`` do, in the decode kernel itself (q and the new key rotated with
    that kernel's roundings, the new K/V written at ``slot_B``). Call only where
    ``fused_ops.rope_write_fits`` holds (one dtype, contiguous pools and columns). ``num_splits`` as
    ``paged_decode_triton``'s; ``num_stages``: the key loop's pipelining stages (``bench.paged_decode``
    times both). ``qk_norm``: each head of q and the new key RMS-normed before RoPE (Qwen3, Gemma 3).
    ``sinks_H``: [Hq] sink logits, or None; ``softcap``: the score cap, or None. Returns [B, Hq, Dh]."""
    if triton is None:
        raise RuntimeError("paged_decode_rotary needs triton")
    if k_S.shape[1] != num_kv_heads or qkv_BN.shape[1] != (num_q_heads + 2 * num_kv_heads) * k_S.shape[2]:
        raise ValueError(
            f"paged_decode_rotary: q/k/v width {qkv_BN.shape[1]} and pool heads {k_S.shape[1]} do not match "
            f"{num_q_heads} query and {num_kv_heads} KV heads of dim {k_S.shape[2]}"
        )
    dh = k_S.shape[2]
    if qk_norm is not None and not all(
        w.shape == (dh,) and w.is_contiguous() for w in (qk_norm.q_weight, qk_norm.k_weight)
    ):
        raise ValueError(f"paged_decode_rotary: qk_norm weights must be contiguous [{dh}] (one head's)")
    cos_BF, sin_BF = cos_BF.contiguous(), sin_BF.contiguous()
    rotary = (cos_BF, sin_BF, slot_B, qk_norm)
    return _run_decode(
        qkv_BN, num_q_heads, k_S, v_S, bt_BN, ctx_B, block_size, sliding_window, tile, num_splits, rotary, num_stages,
        sinks_H, softcap,
    )  # fmt: skip


def _run_decode(
    q: torch.Tensor,
    num_q_heads: int,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    bt_BN: torch.Tensor,
    ctx_B: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    tile: int,
    num_splits: int | None,
    rotary: tuple | None,
    num_stages: int = NUM_STAGES,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The decode kernel and, for more than one split, the combine kernel: [B, Hq, Dh] in ``q``'s dtype."""
    B, Hq, Dh = q.shape[0], num_q_heads, k_S.shape[2]
    Hkv = k_S.shape[1]
    out_BHD = torch.empty(B, Hq, Dh, dtype=q.dtype, device=q.device)
    tile = max(16, tile)
    if num_splits is None:
        num_splits = auto_num_splits(B, Hkv, bt_BN.shape[1] * block_size, tile, q.device)
    if num_splits > 1:
        part_acc = torch.empty(B, Hq, num_splits, Dh, dtype=torch.float32, device=q.device)
        part_m = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = out_BHD  # unused
    parts = (part_acc, part_m, part_l)
    _launch_decode(
        q, Hq, k_S, v_S, bt_BN, ctx_B, out_BHD, parts, num_splits, block_size, sliding_window, tile, rotary, num_stages,
        sinks_H, softcap,
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(B, Hq)](
            part_acc,
            part_m,
            part_l,
            out_BHD,
            out_BHD.stride(0),
            out_BHD.stride(1),
            Hq,
            NUM_SPLITS=num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            D=Dh,
            BLOCK_D=max(16, triton.next_power_of_2(Dh)),
            num_warps=1,
        )
    return out_BHD


def _launch_decode(
    q: torch.Tensor,
    num_q_heads: int,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    bt_BN: torch.Tensor,
    ctx_B: torch.Tensor,
    out_BHD: torch.Tensor,
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_splits: int,
    block_size: int,
    sliding_window: int | None,
    tile: int,
    rotary: tuple | None = None,
    num_stages: int = NUM_STAGES,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
) -> None:
    """``_paged_decode_kernel`` over (B, Hkv, num_splits) programs; ``parts``: the split-K partials
    (accumulators, running maxima, sums), unused for one split. ``q``: [B, Hq, Dh] queries, or with
    ``rotary`` = (cos, sin, new-token slots) the [B, (Hq + 2 Hkv) Dh] q/k/v product before RoPE.
    ``sinks_H``: [Hq] sink logits (any float dtype), or None; ``softcap``: the score cap, or None."""
    B, Hq, Dh = q.shape[0], num_q_heads, k_S.shape[2]
    Hkv = k_S.shape[1]
    G = Hq // Hkv
    part_acc, part_m, part_l = parts
    norms = None
    if rotary is None:
        stride_qb, stride_qh = q.stride(0), q.stride(1)
        cos_BF = sin_BF = slot_B = ctx_B  # unused
    else:
        stride_qb, stride_qh = q.stride(0), Dh
        cos_BF, sin_BF, slot_B, norms = rotary
    qn_w, kn_w = (norms.q_weight, norms.k_weight) if norms is not None else (ctx_B, ctx_B)  # unused without
    sinks = sinks_H.contiguous() if sinks_H is not None else ctx_B  # unused without
    _paged_decode_kernel[(B, Hkv, num_splits)](
        q,
        k_S,
        v_S,
        bt_BN,
        ctx_B,
        out_BHD,
        part_acc,
        part_m,
        part_l,
        stride_qb,
        stride_qh,
        k_S.stride(0),
        k_S.stride(1),
        v_S.stride(0),
        v_S.stride(1),
        bt_BN.stride(0),
        bt_BN.stride(1),
        ctx_B.stride(0),
        out_BHD.stride(0),
        out_BHD.stride(1),
        1.0 / math.sqrt(Dh),
        bt_BN.shape[1],
        sliding_window or 0,
        Hq,
        cos_BF,
        sin_BF,
        cos_BF.stride(0),
        slot_B,
        Hkv,
        qn_w,
        kn_w,
        norms.eps if norms is not None else 0.0,
        sinks,
        float(softcap or 1.0),  # unused without
        BLOCK_SIZE=block_size,
        G=G,
        BLOCK_G=max(16, triton.next_power_of_2(G)),
        D=Dh,
        BLOCK_D=max(16, triton.next_power_of_2(Dh)),
        TILE=tile,
        HAS_WINDOW=sliding_window is not None,
        IEEE=k_S.dtype == torch.float32,  # no TF32 for fp32 pools: parity with the gather path
        NUM_SPLITS=num_splits,
        ROTARY=rotary is not None,
        QK_NORM=norms is not None,
        NORM_FP32=norms is not None and norms.scale_in_float32,
        NORM_OFFSET=float(norms.offset) if norms is not None else 0.0,
        HAS_SINKS=sinks_H is not None,
        HAS_SOFTCAP=softcap is not None,
        num_warps=NUM_WARPS,
        num_stages=num_stages,
    )
