"""Fused inference kernels for the decoder's element-wise ops (CUDA + Triton, no-grad forwards).

A decode step of a small model is a few thousand tiny kernels: eager RMSNorm is eight of them
(cast, square, mean, add, rsqrt, multiply, cast, scale), rotate-half RoPE seven per tensor, SiLU-
and-multiply two. Inside a CUDA graph each still costs its launch slot and a few microseconds of
GPU time, which is most of the step at 64 sequences (bench/rollout.py --profile). Here each is one
Triton kernel that reproduces the eager op's roundings: the value is computed in fp32 and rounded
to the model dtype exactly where the eager code rounds (after the normalisation, before the
weight; after each product of RoPE; after SiLU), so outputs agree with the eager path to within
a rounding step of the model dtype (RMSNorm's mean of squares is summed in another order).

``add_rms_norm`` also folds the residual add before each RMSNorm into it (two kernels fewer per
layer; ``Decoder`` then runs its layers as attention, add+norm, MLP, add+norm); it has its own
self-check and switch, so a failure there leaves only it off.

``enable()`` turns them on for the process after a self-check against the eager ops on random
inputs (a failure leaves them off and says why); ``areno.models.decoder`` routes ``RMSNorm``,
``apply_rope`` and the MLP's activation here only inside ``with inference():`` on the calling
thread (the rollout engine's steps and graph captures), for CUDA tensors with gradients disabled
and outside ``torch.compile`` tracing. Training, the trainer's no-grad forwards (pi_prox, reference
log-probs: the same kernels as its gradient forward, so a fresh PPO ratio is exactly 1) and every
CPU path keep the eager reference ops.

Legend: N = rows (tokens), D = features, T = tokens, H = heads, Dh = head dim, F = Dh / 2.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from collections.abc import Callable, Iterator

import torch
from torch import nn

from areno.models.eager_ops import (
    eager_glu,
    eager_rms_norm,
    eager_rms_norm_fp32_scale,
    eager_rms_norm_offset,
    eager_rope,
)

try:  # Triton ships with CUDA builds of torch; CPU-only installs have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

log = logging.getLogger(__name__)

_LOCAL = threading.local()


class KernelSwitch:
    """A process-wide on/off for Triton kernels that turn on only once their self-check (a function
    returning None, or what is wrong) passes on this machine; ``what`` names them in the warning."""

    def __init__(self, what: str, check: Callable[..., str | None]) -> None:
        self.what = what
        self._check = check
        self.on = False
        self.allowed = True
        """False keeps the kernels off whatever ``enable`` is asked: not a setting (the engine's
        ``fused_kernels`` is), but how a test or bench runs the eager ops in a process that would
        enable them."""

    def enable(self, *args: object) -> bool:
        """Idempotent; returns whether the kernels are on (never without Triton and CUDA, or when
        not ``allowed``)."""
        if self.on:
            return True
        if not available() or not self.allowed:
            return False
        problem = self._check(*args)
        if problem is not None:
            log.warning("%s stay off: %s", self.what, problem)
            return False
        self.on = True
        return True

    def disable(self) -> None:
        self.on = False


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


@contextlib.contextmanager
def thread_flag(local: threading.local, name: str, value: bool) -> Iterator[None]:
    """``local.<name> = value`` for this thread inside the block; the previous value (default
    False) is restored after it."""
    prev = getattr(local, name, False)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, prev)


def inference(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Let (``on``) or forbid the fused kernels in forwards run by this thread inside the block
    (they also need ``enable()``); the rollout engine wraps its steps and graph captures in it."""
    return thread_flag(_LOCAL, "on", on)


def active(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve an op on ``x`` (enabled, inside ``inference()`` on this
    thread, CUDA, no grad, not compiling)."""
    return (
        _SWITCH.on
        and getattr(_LOCAL, "on", False)
        and x.is_cuda
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


if triton is not None:

    @triton.jit
    def _round_to(x, dtype: tl.constexpr):
        """fp32 ``x`` rounded (to nearest, ties to even) to ``dtype``'s precision, kept in fp32.
        bf16 uses integer bit arithmetic: a ``truncf`` + ``extf`` pair may be folded away by the
        compiler (measured: RoPE then differed from eager in a quarter of the values)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif dtype == tl.float32:
            return x
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(
        X, W, Y, stride_x, stride_y, D, eps, BLOCK_D: tl.constexpr, SCALE_FP32: tl.constexpr, OFFSET: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / D
        xn = x * tl.math.rsqrt(var + eps)
        if not SCALE_FP32:  # eager (Llama): x32 * rsqrt(...), cast, then scaled; OLMo 2 scales in float32
            xn = _round_to(xn, X.dtype.element_ty)
        w = tl.load(W + cols, mask=mask, other=0.0)
        y = (w.to(tl.float32) + OFFSET) * xn  # eager: weight * x (rounded once, to Y's dtype); Gemma 3: (1 + w)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(
        X,
        R,
        W,
        S,
        Y,
        WR,
        stride_x,
        stride_r,
        stride_s,
        stride_y,
        D,
        eps,
        eps_r,
        stride_part,
        BLOCK_D: tl.constexpr,
        NUM_PARTS: tl.constexpr,
        NORM_R: tl.constexpr,
        NORM_S: tl.constexpr,
        SCALE_FP32: tl.constexpr,
        OFFSET: tl.constexpr,
    ):
        # NUM_PARTS > 0: R holds that many fp32 partial sums of the residual branch (a split GEMM's),
        # added in order and rounded to the model dtype as the GEMM's own output would be.
        # NORM_R: the branch normed (weights WR, scaled in float32) before the add (post and sandwich
        # norm layouts); NORM_S: the sum normed after it (weights W) and written to Y.
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        dt = S.dtype.element_ty
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if NUM_PARTS == 0:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            r = tl.zeros([BLOCK_D], tl.float32)
            for p in tl.static_range(NUM_PARTS):
                r += tl.load(R + p * stride_part + row * stride_r + cols, mask=mask, other=0.0)
            r = _round_to(r, dt)
        if NORM_R:  # eager_rms_norm_fp32_scale / _offset: (OFFSET + w) * (r32 * rsqrt(...)), rounded once
            var_r = tl.sum(r * r, axis=0) / D
            wr = tl.load(WR + cols, mask=mask, other=0.0).to(tl.float32) + OFFSET
            r = _round_to(wr * (r * tl.math.rsqrt(var_r + eps_r)), dt)
        s = _round_to(x + r, dt)  # eager: the residual add, rounded to the model dtype
        tl.store(S + row * stride_s + cols, s.to(dt), mask=mask)
        if NORM_S:
            var = tl.sum(s * s, axis=0) / D
            sn = s * tl.math.rsqrt(var + eps)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + OFFSET
            if not SCALE_FP32:  # eager (Llama): x32 * rsqrt(...), cast, then scaled
                sn = _round_to(sn, dt)
            y = w * sn
            tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(
        X,
        COS,
        SIN,
        Y,
        stride_xt,
        stride_xh,
        stride_ct,
        stride_yt,
        stride_yh,
        H,
        F,
        BLOCK_H: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.arange(0, BLOCK_H)[:, None]
        f = tl.arange(0, BLOCK_F)[None, :]
        mask = (h < H) & (f < F)
        dt = Y.dtype.element_ty
        x1 = tl.load(X + t * stride_xt + h * stride_xh + f, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + t * stride_xt + h * stride_xh + F + f, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(COS + t * stride_ct + f, mask=f < F, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * stride_ct + f, mask=f < F, other=0.0).to(tl.float32)
        # eager (model dtype): cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin), every product rounded
        a = _round_to(x1 * c, dt) - _round_to(x2 * s, dt)
        b = _round_to(x2 * c, dt) + _round_to(x1 * s, dt)
        tl.store(Y + t * stride_yt + h * stride_yh + f, a.to(dt), mask=mask)
        tl.store(Y + t * stride_yt + h * stride_yh + F + f, b.to(dt), mask=mask)

    @triton.jit
    def _kv_write_kernel(K, V, KS, VS, SLOT, stride_k, stride_v, n, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOT + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        k = tl.load(K + t * stride_k + offs, mask=mask)
        v = tl.load(V + t * stride_v + offs, mask=mask)
        tl.store(KS + slot * n + offs, k, mask=mask)
        tl.store(VS + slot * n + offs, v, mask=mask)

    @triton.jit
    def _rope_write_kernel(
        X,
        COS,
        SIN,
        Q,
        KS,
        VS,
        SLOT,
        stride_xt,
        stride_ct,
        stride_qt,
        HQ,
        HK,
        F,
        BLOCK_H: tl.constexpr,
        BLOCK_F: tl.constexpr,
        BLOCK_KV: tl.constexpr,
    ):
        # Token t of a fused q/k/v row: RoPE of its q heads into Q, of its k heads into the K pool
        # at the token's slot, its v heads copied into the V pool: ``_rope_kernel`` + ``_kv_write_kernel``.
        t = tl.program_id(0)
        slot = tl.load(SLOT + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        f = tl.arange(0, BLOCK_F)[None, :]
        D = 2 * F
        mask = (h < HQ + HK) & (f < F)
        dt = Q.dtype.element_ty
        row = X + t.to(tl.int64) * stride_xt
        x1 = tl.load(row + h * D + f, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + h * D + F + f, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(COS + t * stride_ct + f, mask=f < F, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * stride_ct + f, mask=f < F, other=0.0).to(tl.float32)
        a = _round_to(x1 * c, dt) - _round_to(x2 * s, dt)
        b = _round_to(x2 * c, dt) + _round_to(x1 * s, dt)
        is_q = h < HQ
        q_row = Q + t.to(tl.int64) * stride_qt
        tl.store(q_row + h * D + f, a.to(dt), mask=mask & is_q)
        tl.store(q_row + h * D + F + f, b.to(dt), mask=mask & is_q)
        k_row = KS + slot * HK * D
        tl.store(k_row + (h - HQ) * D + f, a.to(dt), mask=mask & ~is_q)
        tl.store(k_row + (h - HQ) * D + F + f, b.to(dt), mask=mask & ~is_q)
        o = tl.arange(0, BLOCK_KV)
        v = tl.load(row + (HQ + HK) * D + o, mask=o < HK * D)
        tl.store(VS + slot * HK * D + o, v, mask=o < HK * D)

    @triton.jit
    def _mix32(h, mask32):
        """``sampling._mix32`` on int64 values below 2**32 (the same rounds, the same integers)."""
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) & mask32
        h = h ^ (h >> 15)
        h = (h * 0x5BD1E995) & mask32
        h = h ^ (h >> 16)
        h = (h * 0x27D4EB2F) & mask32
        return h ^ (h >> 16)

    @triton.jit
    def _hash_uniform_kernel(SEED, COUNTER, OUT, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        seed = tl.load(SEED + offs, mask=mask, other=0)
        counter = tl.load(COUNTER + offs, mask=mask, other=0)
        mask32 = tl.full((BLOCK,), 0xFFFFFFFF, tl.int64)
        key = _mix32(counter & mask32, mask32)
        key = _mix32(((seed >> 32) & mask32) ^ key, mask32)
        key = _mix32((seed & mask32) ^ key, mask32)
        u = (((key >> 9) & 0x7FFFFF).to(tl.float32) + 0.5) * (2.0**-23)
        tl.store(OUT + offs, u, mask=mask)

    @triton.jit
    def _gate_act(g, GELU: tl.constexpr):
        """A gated MLP's activation of fp32 ``g``: SiLU, or with ``GELU`` the tanh GELU, written as
        g * sigmoid(2y) (= 0.5 g (1 + tanh y), y = sqrt(2 / pi) (g + 0.044715 g^3)): no tanh needed."""
        if GELU:
            y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            return g / (1.0 + tl.exp(-2.0 * y))
        return g / (1.0 + tl.exp(-g))

    @triton.jit
    def _glu_kernel(G, U, Y, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        act = _round_to(_gate_act(g, GELU), Y.dtype.element_ty)  # eager: the activation rounded
        tl.store(Y + offs, (act * u).to(Y.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_float32: bool = False, offset: float = 0.0
) -> torch.Tensor:
    """``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` over the last dim, one kernel; with
    ``scale_in_float32`` ``(weight * x32 * rsqrt(...)).to(x.dtype)`` (``eager_rms_norm_fp32_scale``); with an
    ``offset`` (scaled in float32) ``((offset + weight) * x32 * rsqrt(...)).to(x.dtype)``
    (``eager_rms_norm_offset``)."""
    scale_in_float32 = scale_in_float32 or bool(offset)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dtype = x.dtype if scale_in_float32 else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight,
            out,
            x2.stride(0),
            out.stride(0),
            D,
            eps,
            BLOCK_D=triton.next_power_of_2(D),
            SCALE_FP32=scale_in_float32,
            OFFSET=float(offset),
        )
    return out.view(*x.shape[:-1], D)


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + r`` (the residual add, in x's dtype) and ``rms_norm(s)``, in one kernel: the pair a
    decoder layer computes between its blocks (``eager_add_rms_norm`` is the reference)."""
    D = x.shape[-1]
    r2 = r.reshape(-1, D)
    return _add_rms_norm(x, r2 if r2.stride(-1) == 1 else r2.contiguous(), weight, eps, 0)


def add_parts_rms_norm(
    x: torch.Tensor, parts_PTD: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(x, r, ...)`` where ``r`` is the sum of fp32 partials ``parts_PTD`` [P, T, D] (a
    split GEMM's: ``decode_mlp``), added in order and rounded to x's dtype, inside the same kernel."""
    if parts_PTD.stride(-1) != 1:
        parts_PTD = parts_PTD.contiguous()
    return _add_rms_norm(x, parts_PTD, weight, eps, parts_PTD.shape[0])


def norms_fit_norm_add_norm(norms: list[nn.Module]) -> bool:
    """Whether ``norm_add_norm`` serves these ``RMSNorm``s: all scale in float32, with one weight offset."""
    return all(n.scale_in_float32 or n.offset for n in norms) and len({n.offset for n in norms}) <= 1


def norm_add_norm(
    x: torch.Tensor, r: torch.Tensor, branch_norm: nn.Module, next_norm: nn.Module | None, *, parts: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``s = x + branch_norm(r)`` and ``next_norm(s)`` (None without ``next_norm``), in one kernel: the
    post-norm layout's residual add (OLMo 2: the branch normed, then added; ``next_norm`` only after the
    last layer) and the sandwich layout's (Gemma 3: also the next block's input norm). The norms are
    ``RMSNorm`` modules that scale in float32, with one weight offset; ``parts``: ``r`` is fp32 partials
    [P, T, D] summed in order and rounded to x's dtype first (``add_parts_rms_norm``).
    ``eager_norm_add_norm`` is the reference."""
    norms = [branch_norm] if next_norm is None else [branch_norm, next_norm]
    if not norms_fit_norm_add_norm(norms):
        raise ValueError("norm_add_norm: the norms must scale in float32 and share one weight offset")
    r = r if parts else r.reshape(-1, x.shape[-1])
    r = r if r.stride(-1) == 1 else r.contiguous()
    weight, eps = (next_norm.weight, next_norm.eps) if next_norm is not None else (None, 0.0)
    return _add_rms_norm(
        x,
        r,
        weight,
        eps,
        r.shape[0] if parts else 0,
        branch=(branch_norm.weight, branch_norm.eps),
        scale_in_float32=True,
        offset=branch_norm.offset,
    )


def _add_rms_norm(
    x: torch.Tensor,
    r: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    num_parts: int,
    *,
    branch: tuple[torch.Tensor, float] | None = None,
    scale_in_float32: bool = False,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = None
    if weight is not None:
        y_dtype = x.dtype if scale_in_float32 else torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty(x2.shape, dtype=y_dtype, device=x.device)
    branch_w, branch_eps = branch if branch is not None else (None, 0.0)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2,
            r,
            weight if weight is not None else x2,  # unread without NORM_S
            s,
            y if y is not None else s,
            branch_w if branch_w is not None else x2,  # unread without NORM_R
            x2.stride(0),
            r.stride(-2),
            s.stride(0),
            y.stride(0) if y is not None else 0,
            D,
            eps,
            branch_eps,
            r.stride(0) if num_parts else 0,
            BLOCK_D=triton.next_power_of_2(D),
            NUM_PARTS=num_parts,
            NORM_R=branch is not None,
            NORM_S=weight is not None,
            SCALE_FP32=scale_in_float32,
            OFFSET=float(offset),
        )
    return s.view(*x.shape[:-1], D), (y.view(*x.shape[:-1], D) if y is not None else None)


def eager_add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` in eager ops: what a decoder layer does without the fused kernels."""
    s = x + r
    return s, eager_rms_norm(s, weight, eps)


def eager_norm_add_norm(
    x: torch.Tensor, r: torch.Tensor, branch_norm: nn.Module, next_norm: nn.Module | None, *, parts: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``norm_add_norm`` in eager ops (``parts``: r's fp32 partials summed in order, rounded to x's dtype)."""
    if parts:
        r = _eager_parts_sum(r).to(x.dtype).view(x.shape)
    s = x + _eager_fp32_scale_norm(branch_norm, r)
    return s, (_eager_fp32_scale_norm(next_norm, s) if next_norm is not None else None)


def _eager_fp32_scale_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if norm.offset:
        return eager_rms_norm_offset(x, norm.weight, norm.eps, norm.offset)
    return eager_rms_norm_fp32_scale(x, norm.weight, norm.eps)


def _eager_parts_sum(parts_PTD: torch.Tensor) -> torch.Tensor:
    r = parts_PTD[0].float()
    for p in parts_PTD[1:]:
        r = r + p
    return r


def eager_add_parts_rms_norm(
    x: torch.Tensor, parts_PTD: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_parts_rms_norm`` in eager ops: the partials summed in order in fp32, rounded to x's dtype."""
    return eager_add_rms_norm(x, _eager_parts_sum(parts_PTD).to(x.dtype).view(x.shape), weight, eps)


def rope(x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x_THD`` with per-token ``cos_TF``/``sin_TF`` [T, Dh/2], one kernel."""
    T, H, Dh = x_THD.shape
    F = Dh // 2
    if x_THD.stride(-1) != 1:
        x_THD = x_THD.contiguous()
    cos_TF, sin_TF = cos_TF.contiguous(), sin_TF.contiguous()
    out = torch.empty((T, H, Dh), dtype=torch.promote_types(x_THD.dtype, cos_TF.dtype), device=x_THD.device)
    if T:
        _rope_kernel[(T,)](
            x_THD,
            cos_TF,
            sin_TF,
            out,
            x_THD.stride(0),
            x_THD.stride(1),
            cos_TF.stride(0),
            out.stride(0),
            out.stride(1),
            H,
            F,
            BLOCK_H=triton.next_power_of_2(H),
            BLOCK_F=triton.next_power_of_2(F),
        )
    return out


def glu(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU), or with ``gelu`` ``gelu(gate, approximate="tanh") * up`` (GeGLU),
    the activation rounded to the dtype first as eager; one kernel."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _glu_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, GELU=gelu, BLOCK=1024)
    return out


def hash_uniform(seed_R: torch.Tensor, counter_R: torch.Tensor) -> torch.Tensor:
    """``sampling.hash_uniform`` (int64 CUDA tensors) in one kernel instead of ~40 element-wise ones
    on a few rows each, every decode step; the same integers, so the same floats."""
    seed_R, counter_R = seed_R.contiguous(), counter_R.contiguous()
    out = torch.empty(seed_R.shape, dtype=torch.float32, device=seed_R.device)
    n = seed_R.numel()
    if n:
        _hash_uniform_kernel[(triton.cdiv(n, 256),)](seed_R, counter_R, out, n, BLOCK=256)
    return out


def write_kv(
    k_TKD: torch.Tensor, v_TKD: torch.Tensor, k_S: torch.Tensor, v_S: torch.Tensor, slots_T: torch.Tensor
) -> None:
    """``k_S.index_copy_(0, slots_T, k_TKD)`` and the same for V (a paged pool's K/V write) in one
    kernel; call only where ``write_kv_fits``."""
    n = k_TKD.shape[1] * k_TKD.shape[2]
    if k_TKD.shape[0]:
        _kv_write_kernel[(k_TKD.shape[0],)](
            k_TKD, v_TKD, k_S, v_S, slots_T, k_TKD.stride(0), v_TKD.stride(0), n, BLOCK=triton.next_power_of_2(n)
        )


def rope_write_kv(
    qkv_TN: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    cos_TF: torch.Tensor,
    sin_TF: torch.Tensor,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    slots_T: torch.Tensor,
) -> torch.Tensor:
    """Of a fused q/k/v product ``qkv_TN`` [T, (Hq + 2 Hkv) Dh]: RoPE of q (returned, [T, Hq, Dh]) and
    of k written with v into the pools at ``slots_T``, one kernel for what ``rope`` over q and k and
    ``write_kv`` do in two, with their roundings; call only where ``rope_write_fits``."""
    T = qkv_TN.shape[0]
    F = cos_TF.shape[-1]
    q_THD = torch.empty(T, num_q_heads, 2 * F, dtype=qkv_TN.dtype, device=qkv_TN.device)
    if T:
        cos_TF, sin_TF = cos_TF.contiguous(), sin_TF.contiguous()
        _rope_write_kernel[(T,)](
            qkv_TN,
            cos_TF,
            sin_TF,
            q_THD,
            k_S,
            v_S,
            slots_T,
            qkv_TN.stride(0),
            cos_TF.stride(0),
            q_THD.stride(0),
            num_q_heads,
            num_kv_heads,
            F,
            BLOCK_H=triton.next_power_of_2(num_q_heads + num_kv_heads),
            BLOCK_F=triton.next_power_of_2(F),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads * 2 * F),
        )
    return q_THD


def eager_rope_write_kv(
    qkv_TN: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    cos_TF: torch.Tensor,
    sin_TF: torch.Tensor,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    slots_T: torch.Tensor,
) -> torch.Tensor:
    """``rope_write_kv`` in eager ops: one RoPE over q and k, then the two pool writes."""
    T, D = qkv_TN.shape[0], 2 * cos_TF.shape[-1]
    hq, hk = num_q_heads, num_kv_heads
    qk_THD = eager_rope(qkv_TN[:, : (hq + hk) * D].view(T, hq + hk, D), cos_TF, sin_TF)
    k_S.index_copy_(0, slots_T, qk_THD[:, hq:])
    v_S.index_copy_(0, slots_T, qkv_TN[:, (hq + hk) * D :].view(T, hk, D))
    return qk_THD[:, :hq]


def rope_write_fits(qkv_TN: torch.Tensor, cos_TF: torch.Tensor, k_S: torch.Tensor, v_S: torch.Tensor) -> bool:
    """Whether ``rope_write_kv`` serves this layer: the fused kernels ``active``, q/k/v, the RoPE tables
    and both pools in one dtype (no cast between RoPE and the pool), columns contiguous, pools contiguous."""
    dt = qkv_TN.dtype
    return (
        active(qkv_TN)
        and cos_TF.dtype == dt
        and k_S.dtype == dt
        and v_S.dtype == dt
        and qkv_TN.stride(1) == 1
        and k_S.is_contiguous()
        and v_S.is_contiguous()
    )


def write_kv_fits(k_TKD: torch.Tensor, v_TKD: torch.Tensor, k_S: torch.Tensor, v_S: torch.Tensor) -> bool:
    """Whether ``write_kv`` serves this write: the fused kernels ``active``, K/V in the pools' dtypes,
    each token's ``K x Dh`` values one contiguous run (the views of a fused q/k/v product are; any row
    stride), contiguous pools."""

    def rows_contiguous(x_TKD: torch.Tensor) -> bool:
        return x_TKD.stride(2) == 1 and x_TKD.stride(1) == x_TKD.shape[2]

    return (
        active(k_TKD)
        and k_TKD.dtype == k_S.dtype
        and v_TKD.dtype == v_S.dtype
        and rows_contiguous(k_TKD)
        and rows_contiguous(v_TKD)
        and k_S.is_contiguous()
        and v_S.is_contiguous()
    )


def self_check(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Compare each kernel with the eager op on random inputs; None when all agree (within two
    roundings of the model dtype: RMSNorm's sum runs in another order, exp may differ by an ulp,
    and the compiler may contract a product into the following add), else what failed."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    try:
        with torch.no_grad():
            x, w = rand(37, 896), rand(896)
            got, ref = rms_norm(x, w, 1e-6), eager_rms_norm(x, w, 1e-6)
            ulp = torch.finfo(dtype).eps * ref.abs().float().clamp(min=1e-3)
            if not bool(((got.float() - ref.float()).abs() <= 2 * ulp).all()):
                return f"rms_norm differs from eager by {(got.float() - ref.float()).abs().max().item():.3g}"
            q, cos, sin = rand(5, 14, 64), rand(5, 32), rand(5, 32)
            got, ref = rope(q, cos, sin), eager_rope(q, cos, sin)
            ulp = torch.finfo(dtype).eps * ref.abs().float().clamp(min=1e-3)
            if not bool(((got.float() - ref.float()).abs() <= 2 * ulp).all()):
                return (
                    f"rope differs from eager by {(got.float() - ref.float()).abs().max().item():.3g} "
                    f"({int((got != ref).sum())} of {ref.numel()} values)"
                )
            g, u = rand(7, 4864), rand(7, 4864)
            for gelu in (False, True):
                got, ref = glu(g, u, gelu=gelu), eager_glu(g, u, gelu=gelu)
                ulp = torch.finfo(dtype).eps * ref.abs().float().clamp(min=1e-3)
                if not bool(((got.float() - ref.float()).abs() <= 2 * ulp).all()):  # exp may differ by an ulp
                    return (
                        f"glu (gelu={gelu}) differs from eager by {(got.float() - ref.float()).abs().max().item():.3g}"
                    )
            qkv, slots = rand(6, (14 + 2 * 2) * 64), torch.randperm(40, generator=gen)[:6].to(device)
            k, v = qkv[:, 14 * 64 : 16 * 64].view(6, 2, 64), qkv[:, 16 * 64 :].view(6, 2, 64)  # views, as in a layer
            k_S, v_S = rand(40, 2, 64), rand(40, 2, 64)
            k_ref, v_ref = k_S.clone().index_copy_(0, slots, k), v_S.clone().index_copy_(0, slots, v)
            write_kv(k, v, k_S, v_S, slots)
            if not (torch.equal(k_S, k_ref) and torch.equal(v_S, v_ref)):
                return "write_kv differs from index_copy_"
            qkv, cos, sin = rand(6, (14 + 2 * 2) * 64), rand(6, 32), rand(6, 32)
            k_S, v_S = rand(40, 2, 64), rand(40, 2, 64)
            k_ref, v_ref = k_S.clone(), v_S.clone()
            qk_ref = rope(qkv[:, : 16 * 64].view(6, 16, 64), cos, sin)
            write_kv(qk_ref[:, 14:], qkv[:, 16 * 64 :].view(6, 2, 64), k_ref, v_ref, slots)
            q = rope_write_kv(qkv, 14, 2, cos, sin, k_S, v_S, slots)
            if not (torch.equal(q, qk_ref[:, :14]) and torch.equal(k_S, k_ref) and torch.equal(v_S, v_ref)):
                return "rope_write_kv differs from rope and write_kv"
    except Exception as e:  # noqa: BLE001 - a compiler or driver error disables the kernels
        return f"{type(e).__name__}: {e}"
    return None


def add_norm_self_check(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16) -> str | None:
    """``add_rms_norm`` against ``eager_add_rms_norm`` on random inputs: the sum exactly, the norm
    within two roundings of the model dtype; None when they agree, else what failed."""
    gen = torch.Generator(device="cpu").manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    try:
        with torch.no_grad():
            x, r, w = rand(37, 896), rand(37, 896), rand(896)
            (s, y), (s_ref, y_ref) = add_rms_norm(x, r, w, 1e-6), eager_add_rms_norm(x, r, w, 1e-6)
            if not torch.equal(s, s_ref):
                return f"add_rms_norm's sum differs from eager in {int((s != s_ref).sum())} of {s.numel()} values"
            ulp = torch.finfo(dtype).eps * y_ref.abs().float().clamp(min=1e-3)
            if not bool(((y.float() - y_ref.float()).abs() <= 2 * ulp).all()):
                return f"add_rms_norm differs from eager by {(y.float() - y_ref.float()).abs().max().item():.3g}"
            parts = torch.randn(3, 37, 896, generator=gen).to(device)
            for offset, scale, nxt in ((0.0, True, None), (0.0, True, rand(896)), (1.0, False, rand(896))):
                norm = types.SimpleNamespace(weight=w, eps=1e-6, offset=offset, scale_in_float32=scale)
                nxt = (
                    None
                    if nxt is None
                    else types.SimpleNamespace(weight=nxt, eps=1e-5, offset=offset, scale_in_float32=scale)
                )
                for branch, split in ((r, False), (parts, True)):
                    (s, y), (s_ref, y_ref) = (
                        f(x, branch, norm, nxt, parts=split) for f in (norm_add_norm, eager_norm_add_norm)
                    )
                    # an ulp of the normed branch moves s by that much wherever x cancels it, and y with s
                    s_scale = x.abs().float() + s_ref.abs().float()
                    checks = [(s, s_ref, s_scale)]
                    if nxt is not None:
                        rms = s_ref.float().pow(2).mean(-1, keepdim=True).sqrt()
                        checks.append(
                            (y, y_ref, y_ref.abs().float() + (nxt.weight.float() + offset).abs() * s_scale / rms)
                        )
                    for got, ref, scale in checks:
                        ulp = torch.finfo(dtype).eps * scale.clamp(min=1e-3)
                        if not bool(((got.float() - ref.float()).abs() <= 2 * ulp).all()):
                            return (
                                f"norm_add_norm (offset {offset}, parts {split}) differs from eager by "
                                f"{(got.float() - ref.float()).abs().max().item():.3g}"
                            )
    except Exception as e:  # noqa: BLE001 - a compiler or driver error disables the kernel
        return f"{type(e).__name__}: {e}"
    return None


_SWITCH = KernelSwitch("fused inference kernels (eager ops are used)", lambda: self_check())
_ADD_NORM = KernelSwitch(
    "the fused residual-add + RMSNorm kernel (an add and the RMSNorm kernel are used)", lambda: add_norm_self_check()
)


def enable() -> bool:
    """Turn the fused kernels on for this process if Triton and CUDA are here and the self-check
    passes (idempotent); returns whether they are on. The residual-add + RMSNorm kernel has its own
    check: if it fails, only that kernel stays off."""
    on = _SWITCH.enable()
    if on:
        _ADD_NORM.enable()
    return on


def disable() -> None:
    _SWITCH.disable()
    _ADD_NORM.disable()


def add_norm_active(x: torch.Tensor) -> bool:
    """Whether a decoder forward on ``x`` fuses each residual add with the RMSNorm after it."""
    return _ADD_NORM.on and active(x)
