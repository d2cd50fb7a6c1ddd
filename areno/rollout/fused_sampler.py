"""The sampler's draw in two Triton kernels (CUDA): ``sampling.Sampler``'s contract without a [B, V] pass per op.

The eager sampler reads or writes the whole fp32 [B, V] logits about seven times per step (division
by the temperature, ``log_softmax``, ``exp``, the stop-id scatter, the block sums, the argmax, the
gathers): at a 151,936-token vocabulary and 64 rows that was about 0.2 ms of a 1.6 ms decode step of
a 0.5B model on an H200. Here the logits are read once whole and once more for one chunk per row:

1. ``_chunk_stats_kernel``, one program per (row, chunk of ``CHUNK`` entries): the chunk's maximum
   of ``x = logits / T``, its sum of ``exp(x - max)`` over all entries (for the log-probs) and over
   the entries not suppressed (stop/EOS ids below ``min_new_tokens``: the draw's weights), and the
   first index of its largest unsuppressed value (greedy rows).
2. ``_draw_kernel``, one program per row: the row's log-sum-exp from the chunks', the inverse-CDF
   draw of ``u`` in two levels (the chunk whose cumulative weight passes ``u * total``, then the
   entry inside it, from a cumulative sum over that chunk only), the greedy argmax, and the chosen
   token's log-prob ``x[token] - logsumexp(x)``.

Same contract as the eager path (``sampling.inverse_cdf_draw``): the token whose interval of the
cumulative distribution of the unsuppressed weights holds ``u``; a target that rounding puts at or
past the total takes the last entry of non-zero weight; the log-prob is under the full
temperature-scaled distribution, before suppression. The sums run in another order than the eager
ops', so a draw can differ from theirs only where ``u`` lies within rounding of an interval's edge
(the self-check and the GPU test check each draw against float64 interval bounds). Top-k / top-p
rows keep the eager sort (``Sampler`` picks per row, so a row's token never depends on its batch).
"""

from __future__ import annotations

import torch

from areno.models import fused_ops

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

CHUNK = 4096
"""Vocabulary entries per program of the first kernel (and per cumulative sum of the second)."""


if triton is not None:

    @triton.jit
    def _suppressed(STOPS, PEND, row, offs, s0, s1, s2, s3, NSTOP: tl.constexpr):
        """bool per entry: one of the row's pending stop ids (``NSTOP`` columns; the strides of both
        tables: stop row ``s0``, stop column ``s1``, pending row ``s2``, pending column ``s3``)."""
        sup = offs < 0
        for s in tl.static_range(NSTOP):
            sid = tl.load(STOPS + row * s0 + s * s1)
            pend = tl.load(PEND + row * s2 + s * s3)
            sup = sup | ((offs == sid) & (pend != 0))
        return sup

    @triton.jit
    def _chunk_stats_kernel(
        L,
        SCALE,
        STOPS,
        PEND,
        MX,
        SA,
        SW,
        AV,
        AI,
        stride_l,
        V,
        NC,
        s0,
        s1,
        s2,
        s3,
        NSTOP: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        valid = offs < V
        scale = tl.load(SCALE + row)
        x = tl.load(L + row.to(tl.int64) * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32) / scale
        sup = _suppressed(STOPS, PEND, row, offs, s0, s1, s2, s3, NSTOP)
        m = tl.max(x, 0)
        m0 = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf only: weights 0, not NaN
        e = tl.exp(x - m0)
        xs = tl.where(sup, float("-inf"), x)
        out = row * NC + c
        tl.store(MX + out, m)
        tl.store(SA + out, tl.sum(e, 0))
        tl.store(SW + out, tl.sum(tl.where(sup, 0.0, e), 0))
        tl.store(AV + out, tl.max(xs, 0))
        tl.store(AI + out, c * CHUNK + tl.argmax(xs, 0))

    @triton.jit
    def _draw_kernel(
        L,
        SCALE,
        STOPS,
        PEND,
        U,
        GREEDY,
        MX,
        SA,
        SW,
        AV,
        AI,
        TOK,
        LP,
        stride_l,
        V,
        NC,
        s0,
        s1,
        s2,
        s3,
        NSTOP: tl.constexpr,
        CHUNK: tl.constexpr,
        NCB: tl.constexpr,
        SAMPLE: tl.constexpr,
    ):
        row = tl.program_id(0)
        cidx = tl.arange(0, NCB)
        cm = cidx < NC
        base = row * NC
        m = tl.load(MX + base + cidx, mask=cm, other=float("-inf"))
        sa = tl.load(SA + base + cidx, mask=cm, other=0.0)
        mx = tl.max(m, 0)
        mx0 = tl.where(mx == float("-inf"), 0.0, mx)
        f = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx0))  # each chunk's sums rescaled to the row's max
        lse = mx0 + tl.log(tl.sum(sa * f, 0))
        # greedy: the first chunk holding the largest unsuppressed value, then its first index
        av = tl.load(AV + base + cidx, mask=cm, other=float("-inf"))
        ai = tl.load(AI + base + cidx, mask=cm, other=0)
        best = tl.max(av, 0)
        gi = tl.min(tl.where(av == best, cidx, NCB), 0)
        token = tl.sum(tl.where(cidx == gi, ai, 0), 0)
        if SAMPLE:
            w = tl.load(SW + base + cidx, mask=cm, other=0.0) * f
            cum = tl.cumsum(w, 0)
            total = tl.sum(tl.where(cidx == NC - 1, cum, 0.0), 0)
            target = tl.load(U + row) * total
            # the first chunk whose cumulative weight passes the target
            c = tl.sum(((cum <= target) & cm).to(tl.int32), 0)
            last_c = tl.max(tl.where(w > 0, cidx, -1), 0)
            c = tl.where(c >= NC, last_c, c)  # rounding put the target at or past the total
            c = tl.maximum(c, 0)
            rest = target - tl.sum(tl.where(cidx == c - 1, cum, 0.0), 0)
            k = tl.arange(0, CHUNK)
            offs = c * CHUNK + k
            valid = offs < V
            scale = tl.load(SCALE + row)
            x = tl.load(L + row.to(tl.int64) * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
            sup = _suppressed(STOPS, PEND, row, offs, s0, s1, s2, s3, NSTOP)
            e = tl.where(sup | ~valid, 0.0, tl.exp(x / scale - mx0))
            j = tl.sum((tl.cumsum(e, 0) <= rest).to(tl.int32), 0)
            j = tl.minimum(j, tl.max(tl.where(e > 0, k, -1), 0))  # past the chunk's total: its last weighted entry
            j = tl.maximum(j, 0)
            sampled = c * CHUNK + j
            greedy = tl.load(GREEDY + row) != 0
            token = tl.where(greedy, token, sampled)
        token = tl.minimum(tl.maximum(token, 0), V - 1)  # NaN logits still give an index in range
        scale = tl.load(SCALE + row)
        xt = tl.load(L + row.to(tl.int64) * stride_l + token).to(tl.float32) / scale
        tl.store(TOK + row, token.to(tl.int64))
        tl.store(LP + row, xt - lse)


def serves(logits_BV: torch.Tensor) -> bool:
    """Whether ``draw`` serves these logits: switched on (``enable``), CUDA, rows contiguous."""
    return _SWITCH.on and logits_BV.is_cuda and logits_BV.dim() == 2 and logits_BV.stride(1) == 1


def draw(
    logits_BV: torch.Tensor,
    scale_B: torch.Tensor,
    u_B: torch.Tensor | None,
    greedy_B: torch.Tensor | None,
    stop_ids_BS: torch.Tensor | None = None,
    pending_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids long [B], log-probs float32 [B]) of ``logits_BV / scale_B``: rows where ``greedy_B``
    (or every row when ``u_B`` is None) take the argmax of the unsuppressed entries, the others the
    inverse-CDF draw of ``u_B``; ``stop_ids_BS`` where ``pending_BS`` are suppressed (weight 0). No
    host synchronisation, fixed kernels for fixed shapes (safe inside a CUDA graph)."""
    B, V = logits_BV.shape
    dev = logits_BV.device
    NC = triton.cdiv(V, CHUNK)
    if stop_ids_BS is None or pending_BS is None or stop_ids_BS.shape[1] == 0:
        nstop = 0
        stops = pend = torch.empty(1, dtype=torch.int32, device=dev)  # unread
        strides = (0, 0, 0, 0)
    else:
        # read in place through their strides (a transposed table, an expanded mask): no copies
        nstop = stop_ids_BS.shape[1]
        stops = stop_ids_BS
        pend = pending_BS.view(torch.uint8) if pending_BS.dtype == torch.bool else pending_BS
        strides = (*stops.stride(), *pend.stride())
    scale = scale_B.to(torch.float32).contiguous()
    stats = torch.empty(3, B * NC, dtype=torch.float32, device=dev)
    amax_v = torch.empty(B * NC, dtype=torch.float32, device=dev)
    amax_i = torch.empty(B * NC, dtype=torch.int32, device=dev)
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return tokens, logprobs
    sample = u_B is not None
    u = u_B.to(torch.float32).contiguous() if sample else scale
    if sample and greedy_B is not None:
        greedy = greedy_B.view(torch.uint8) if greedy_B.dtype == torch.bool else greedy_B
        greedy = greedy if greedy.stride(0) == 1 else greedy.contiguous()
    else:
        greedy = torch.zeros_like(amax_i[:B])
    mx, sa, sw = stats[0], stats[1], stats[2]
    stride = logits_BV.stride(0)
    _chunk_stats_kernel[(B, NC)](
        logits_BV, scale, stops, pend, mx, sa, sw, amax_v, amax_i, stride, V, NC, *strides, NSTOP=nstop, CHUNK=CHUNK
    )
    _draw_kernel[(B,)](
        logits_BV,
        scale,
        stops,
        pend,
        u,
        greedy,
        mx,
        sa,
        sw,
        amax_v,
        amax_i,
        tokens,
        logprobs,
        stride,
        V,
        NC,
        *strides,
        NSTOP=nstop,
        CHUNK=CHUNK,
        NCB=triton.next_power_of_2(NC),
        SAMPLE=sample,
        num_warps=8,
    )
    return tokens, logprobs


def interval_misses(
    logits_BV: torch.Tensor,
    scale_B: torch.Tensor,
    u_B: torch.Tensor,
    tokens_B: torch.Tensor,
    suppressed_BV: torch.Tensor | None = None,
    rtol: float = 1e-5,
) -> torch.Tensor:
    """bool [B]: rows whose ``tokens_B`` is not the inverse-CDF draw of ``u_B`` (float64 cumulative
    weights of ``softmax(logits / scale)``, ``suppressed_BV`` at 0), allowing the target to lie
    within ``rtol`` of the total from the chosen interval: how the self-check and tests judge a draw
    whose sums ran in another order."""
    w_BV = torch.softmax(logits_BV.double() / scale_B.double()[:, None], dim=-1)
    if suppressed_BV is not None:
        w_BV = w_BV.masked_fill(suppressed_BV, 0.0)
    cdf_BV = w_BV.cumsum(dim=-1)
    total_B = cdf_BV[:, -1]
    target_B = u_B.double() * total_B
    t = tokens_B[:, None]
    hi_B = cdf_BV.gather(1, t).squeeze(1)
    lo_B = hi_B - w_BV.gather(1, t).squeeze(1)
    slack_B = rtol * total_B
    return (w_BV.gather(1, t).squeeze(1) <= 0) | (lo_B > target_B + slack_B) | (hi_B < target_B - slack_B)


def self_check(device: torch.device | str = "cuda") -> str | None:
    """``draw`` on random bf16 and fp32 logits (odd vocabulary sizes, temperatures, greedy rows,
    suppressed ids) against float64 interval bounds and ``log_softmax``; None when every row agrees,
    else what differs."""
    gen = torch.Generator().manual_seed(0)
    try:
        for V, dtype in ((151_936, torch.bfloat16), (5_003, torch.float32), (CHUNK, torch.bfloat16)):
            B = 9
            logits = (torch.randn(B, V, generator=gen) * 3).to(dtype)
            scale = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0])
            u = torch.rand(B, generator=gen).clamp_min(1e-6)
            greedy = torch.tensor([0, 0, 0, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
            stops = torch.randint(0, V, (B, 2), generator=gen)
            pending = torch.tensor([[1, 1], [0, 0], [1, 0]] * 3, dtype=torch.bool)
            scale[greedy] = 1.0
            args = (logits, scale, u, greedy, stops, pending)
            tok, lp = draw(*(a.to(device) for a in args))
            tok, lp = tok.cpu(), lp.cpu()
            x = logits.float() / scale[:, None]
            suppressed = torch.zeros(B, V, dtype=torch.bool).scatter_(1, stops, pending)
            ref_greedy = x.masked_fill(suppressed, float("-inf")).argmax(dim=-1)
            if not torch.equal(tok[greedy], ref_greedy[greedy]):
                return f"greedy rows differ at V={V}: {tok[greedy].tolist()} against {ref_greedy[greedy].tolist()}"
            miss = interval_misses(logits.float(), scale, u, tok, suppressed)
            if bool(miss[~greedy].any()):
                return f"{int(miss[~greedy].sum())} sampled rows outside their interval at V={V}"
            ref_lp = torch.log_softmax(x, dim=-1).gather(1, tok[:, None]).squeeze(1)
            if not torch.allclose(lp, ref_lp, rtol=0, atol=1e-4):
                return f"log-probs differ from log_softmax by {(lp - ref_lp).abs().max().item():.3g} at V={V}"
    except Exception as e:  # noqa: BLE001 - a compiler or driver error leaves the eager sampler
        return f"{type(e).__name__}: {e}"
    return None


_SWITCH = fused_ops.KernelSwitch("the fused sampler (the eager ops sample)", lambda: self_check())


def enable() -> bool:
    """Turn the fused draw on for this process after its self-check (idempotent; the rollout engine
    calls it with its other fused kernels, before any graph is captured)."""
    return _SWITCH.enable()


def disable() -> None:
    _SWITCH.disable()
