"""A decode step's MLP on CUDA in two Triton GEMMs, for the few rows a decode step has.

At a decode step's few rows the MLP's GEMMs are bound by launches and by how many SMs read the
weights, not by FLOPs (bench/LOG.md: the H200 decode step's kernels). cuBLAS runs the MLP as three
kernels and a fourth: the gate/up GEMM, the gated activation (``fused_linear.glu_halves``), the
down GEMM split over its long reduction, and that split's reduce kernel. Here:

- ``_gate_up_glu_kernel``: each program multiplies the rows by a column block of gate and the
  same block of up, and writes ``silu(gate) * up`` (GeGLU: the tanh GELU in place of SiLU; the eager
  op's roundings: each product rounded to the model dtype as a GEMM's output is, the activation
  rounded) — no [T, 2I] product in memory;
- ``_down_parts_kernel``: the down projection split over up to ``DOWN_SPLITS`` shares of the
  intermediate dimension (``down_splits``), each share's fp32 partial written to its own slice of
  ``[P, T, D]``;
- the partials are summed, in a fixed order, by the residual add + RMSNorm kernel that follows
  (``fused_ops.add_parts_rms_norm``), which rounds the sum to the model dtype as the GEMM's output.

No atomics: the same inputs give the same bits. Only where every condition of ``partials`` holds
(the fused gate/up weight, no biases, no tensor parallelism, a 16-bit model, the rows ``serves``
takes); elsewhere the MLP runs as before. ``enable()`` turns it on after a self-check against the
eager MLP; the rollout engine does so with its other fused kernels (``rollout.fused_kernels``).

Legend: T = rows, D = hidden size, I = intermediate size, P = down-projection splits.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from areno.models import fused_ops
from areno.models.eager_ops import eager_glu
from areno.models.fused_linear import FusedRows
from areno.models.fused_ops import triton

MAX_ROWS = 64
"""Most rows these kernels take (one row tile); more rows keep cuBLAS, faster there (bench/LOG.md)."""
DOWN_SPLITS = 8
"""Most shares of the intermediate dimension the down projection is split over: fewer where D / 64
programs times this would not fit the SMs in one wave (``down_splits``)."""
GATE_UP_BLOCK = (64, 128)
"""Gate/up kernel: columns of gate (and of up) per program, and reduction elements per step."""
WIDE_MAX_ROWS = 16
"""Most rows the kernels take where the gate/up programs (I / 64) need more than one wave of the SMs
(1.5B on an H200: 140 programs on 132 SMs): from 32 rows cuBLAS is faster there (bench/LOG.md)."""
DOWN_BLOCK = (64, 128)
"""Down kernel: output columns and reduction elements per program step."""


if triton is not None:
    import triton.language as tl

    _round_to = fused_ops._round_to  # jit helpers the kernels below call by these global names
    _gate_act = fused_ops._gate_act

    @triton.jit
    def _gate_up_glu_kernel(
        X,
        W,
        Y,
        T,
        D,
        inter,
        stride_x,
        stride_w,
        stride_y,
        GELU: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        offs_m = tl.arange(0, BM)
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        m_ok = offs_m < T
        n_ok = offs_n < inter
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, D, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < D
            a = tl.load(X + offs_m[:, None] * stride_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = n_ok[None, :] & k_ok[:, None]
            wg = tl.load(W + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None], mask=w_ok, other=0.0)
            wu = tl.load(W + (inter + offs_n[None, :]).to(tl.int64) * stride_w + offs_k[:, None], mask=w_ok, other=0.0)
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
        dt = Y.dtype.element_ty
        g = _round_to(acc_g, dt)  # the gate/up GEMM's output in the model dtype
        u = _round_to(acc_u, dt)
        act = _round_to(_gate_act(g, GELU), dt)  # eager: the activation rounded
        ptrs = Y + offs_m[:, None] * stride_y + offs_n[None, :]
        tl.store(ptrs, (act * u).to(dt), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_parts_kernel(
        A,
        W,
        P,
        T,
        inter,
        D,
        stride_a,
        stride_w,
        stride_pp,
        stride_pt,
        k_per,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        offs_m = tl.arange(0, BM)
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        part = tl.program_id(1)
        m_ok = offs_m < T
        n_ok = offs_n < D
        k_lo = part * k_per
        k_hi = tl.minimum(k_lo + k_per, inter)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < k_hi
            a = tl.load(A + offs_m[:, None] * stride_a + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(
                W + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            acc = tl.dot(a, w, acc)
        ptrs = P + part * stride_pp + offs_m[:, None] * stride_pt + offs_n[None, :]
        tl.store(ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (``cuda`` without an index: the current one)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def serves(rows: int, inter: int, sms: int) -> bool:
    """Whether the kernels take an MLP of intermediate width ``inter`` at ``rows`` rows on ``sms`` SMs:
    at most ``MAX_ROWS``, and at most ``WIDE_MAX_ROWS`` where the gate/up programs need two waves."""
    return 0 < rows <= MAX_ROWS and (rows <= WIDE_MAX_ROWS or -(-inter // GATE_UP_BLOCK[0]) <= sms)


def down_splits(hidden: int, sms: int) -> int:
    """Shares of the down projection's reduction: at most ``DOWN_SPLITS``, as many as keep its programs
    (``hidden`` / ``DOWN_BLOCK[0]`` per share) in one wave of ``sms``, at least one."""
    return max(1, min(DOWN_SPLITS, sms // -(-hidden // DOWN_BLOCK[0])))


def gate_up_glu(x_TD: torch.Tensor, gate_up_ND: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
    """``silu(x gate^T) * (x up^T)`` [T, I] for ``gate_up_ND`` = [2I, D] (gate rows, then up rows); with
    ``gelu`` the tanh GELU in place of SiLU (GeGLU)."""
    T, D = x_TD.shape
    I = gate_up_ND.shape[0] // 2  # noqa: E741 - the intermediate width
    y_TI = torch.empty(T, I, dtype=x_TD.dtype, device=x_TD.device)
    bn, bk = GATE_UP_BLOCK
    _gate_up_glu_kernel[(triton.cdiv(I, bn),)](
        x_TD, gate_up_ND, y_TI, T, D, I, x_TD.stride(0), gate_up_ND.stride(0), y_TI.stride(0), GELU=gelu,
        BM=_row_block(T), BN=bn, BK=bk, num_warps=4, num_stages=4,
    )  # fmt: skip
    return y_TI


def down_parts(a_TI: torch.Tensor, down_DI: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """fp32 partials [P, T, D] of ``a_TI @ down_DI^T`` over P shares of I, summed in order by the caller;
    ``splits``: the most shares (None: ``down_splits`` for this GPU)."""
    T, I = a_TI.shape  # noqa: E741 - the intermediate width
    D = down_DI.shape[0]
    bn, bk = DOWN_BLOCK
    splits = splits or down_splits(D, _sm_count(a_TI.device))
    k_per = triton.cdiv(I, splits * bk) * bk
    parts = triton.cdiv(I, k_per)  # no empty share
    p_PTD = torch.empty(parts, T, D, dtype=torch.float32, device=a_TI.device)
    _down_parts_kernel[(triton.cdiv(D, bn), parts)](
        a_TI, down_DI, p_PTD, T, I, D, a_TI.stride(0), down_DI.stride(0), p_PTD.stride(0), p_PTD.stride(1), k_per,
        BM=_row_block(T), BN=bn, BK=bk, num_warps=4, num_stages=4,
    )  # fmt: skip
    return p_PTD


def _row_block(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def active(x: torch.Tensor) -> bool:
    """Whether the kernels are on and ``x`` is a CUDA tensor."""
    return _SWITCH.on and x.is_cuda


def partials(x_TD: torch.Tensor, gate_up: FusedRows, down: nn.Linear, *, gelu: bool = False) -> torch.Tensor | None:
    """The MLP's output (``gelu``: a GeGLU MLP's) as the down projection's fp32 partials [P, T, D]
    (``fused_ops.add_parts_rms_norm`` sums them), or None where these kernels do not serve this call: off, not CUDA, rows ``serves``
    does not take, a biased or non-16-bit projection, or weights not laid out as one [2I, D] gate/up
    tensor and a [D, I] down weight."""
    if not active(x_TD) or x_TD.dim() != 2:
        return None
    if not serves(x_TD.shape[0], gate_up.sizes[0], _sm_count(x_TD.device)):
        return None
    w_gu, w_d = gate_up.weight, down.weight
    if (
        gate_up.bias is not None
        or down.bias is not None
        or len(gate_up.sizes) != 2
        or gate_up.sizes[0] != gate_up.sizes[1]
        or x_TD.dtype not in (torch.bfloat16, torch.float16)
        or w_gu.dtype != x_TD.dtype
        or w_d.dtype != x_TD.dtype
        or w_d.shape[1] != gate_up.sizes[0]
        or x_TD.stride(1) != 1
        or w_gu.stride(1) != 1
        or w_d.stride(1) != 1
    ):
        return None
    return down_parts(gate_up_glu(x_TD, w_gu, gelu=gelu), w_d)


def self_check(device: torch.device | str = "cuda") -> str | None:
    """The two kernels and the partials' sum against the eager MLP (``F.linear``, SiLU or the tanh GELU,
    ``F.linear``) at a few row counts and sizes (one not a multiple of the blocks), in bfloat16 and float16; None when,
    against a float64 MLP of the same inputs, their error is within twice the eager one's plus an ulp,
    else what failed."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    cases = [(torch.bfloat16, 1, 896, 4864), (torch.bfloat16, 37, 896, 4864), (torch.bfloat16, 64, 200, 600)]
    try:
        with torch.no_grad():
            for (dtype, rows, d, i), gelu in itertools.product([*cases, (torch.float16, 37, 896, 4864)], (False, True)):
                x = torch.randn(rows, d, generator=gen).to(device=device, dtype=dtype)
                w_gu = (torch.randn(2 * i, d, generator=gen) / d**0.5).to(device=device, dtype=dtype)
                w_d = (torch.randn(d, i, generator=gen) / i**0.5).to(device=device, dtype=dtype)
                got = down_parts(gate_up_glu(x, w_gu, gelu=gelu), w_d).sum(0).to(dtype)
                gate, up = F.linear(x, w_gu).chunk(2, dim=-1)
                eager = F.linear(eager_glu(gate, up, gelu=gelu), w_d)
                g64, u64 = F.linear(x.double(), w_gu.double()).chunk(2, dim=-1)
                ref = F.linear(eager_glu(g64, u64, gelu=gelu), w_d.double())
                e_got, e_eager = (got.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
                ulp = torch.finfo(dtype).eps * ref.abs().max().item()
                if e_got > 2 * e_eager + ulp:
                    return f"decode MLP [{rows}, {d}, {i}] {dtype} (gelu={gelu}): error {e_got:.3g} against float64, eager {e_eager:.3g}"
    except Exception as e:  # noqa: BLE001 - a compiler or driver error disables the kernels
        return f"{type(e).__name__}: {e}"
    return None


_SWITCH = fused_ops.KernelSwitch(
    "the decode MLP's Triton GEMMs (cuBLAS and the activation kernel are used)", lambda device: self_check(device)
)


def enable(device: torch.device | str = "cuda") -> bool:
    """Turn the kernels on for this process if Triton and CUDA are here and the self-check passes
    (idempotent); returns whether they are on."""
    return _SWITCH.enable(device)


def disable() -> None:
    _SWITCH.disable()
