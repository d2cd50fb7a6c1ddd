"""RMSNorm and RoPE for eager CPU forwards: the eager ops' values in fewer passes over memory.

On CPU nothing fuses element-wise ops (training does not compile by default there), so each op of
``eager_ops`` is a pass over a [T, D] tensor, and autograd adds its own for the backward: at a
small model's shapes these passes, not the GEMMs, are most of a training step. Here:

- ``rms_norm``: a float32 input's forward is the values of ``aten._fused_rms_norm`` (on CPU a
  composite of six ops) in four, two of them in place (~2x faster at a decode step's [64, 384];
  in forward-only passes too), and its backward the closed form
  ``dx = rstd * (g w - x^ mean(g w x^))``, ``dw = sum(g x^)`` (x^ = x rstd) instead of autograd's
  eleven ops through pow, mean and rsqrt. Other dtypes keep ``eager_rms_norm``: transformers rounds a
  bfloat16 input's normalised value before the weight multiplies it, which the fused kernel does not.
- ``rope``: rotate-half RoPE as ``x c + swap(x) s`` with ``c = [cos, cos]``, ``s = [-sin, sin]``
  (three products, no slice and no concatenation of halves in backward: its gradient is the same
  form with ``s`` swapped), computed in float32 and returned in ``out_dtype``, so under bfloat16
  autocast q and k reach attention already in its dtype (``eager_rope`` promotes them to float32
  and the layer casts them back). A forward-only float32 pass (the rollout engine's steps) writes
  each half of the output in place with a product and a multiply-add.

Both agree with ``eager_ops`` to float32 rounding (tests/models/test_cpu_train_ops.py). Used by the
decoder on CPU outside ``torch.compile`` (where inductor fuses the eager ops itself); CUDA keeps its
fused inference kernels and eager or compiled training ops.

Legend: T = tokens, D = features, H = heads, Dh = head dim, F = Dh / 2.
"""

from __future__ import annotations

import torch


def applies(x: torch.Tensor) -> bool:
    """Whether the decoder takes these ops for ``x``: a CPU tensor outside ``torch.compile``."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def _rms_forward(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * rstd * weight, rstd [..., 1]) of a float32 ``x``: bitwise ``aten._fused_rms_norm`` (test)."""
    rstd = torch.mean(x_TD * x_TD, dim=-1, keepdim=True).add_(eps).rsqrt_()
    return (x_TD * rstd).mul_(weight_D), rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weight_D, eps):
        y_TD, rstd_T1 = _rms_forward(x_TD, weight_D, eps)
        ctx.save_for_backward(x_TD, weight_D, rstd_T1)
        return y_TD

    @staticmethod
    def backward(ctx, g_TD):
        x_TD, weight_D, rstd_T1 = ctx.saved_tensors
        g_TD = g_TD.float()
        xhat_TD = x_TD * rstd_T1
        grad_w = (g_TD * xhat_TD).reshape(-1, g_TD.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw_TD = g_TD * weight_D
            mean_T1 = (gw_TD * xhat_TD).mean(-1, keepdim=True)
            grad_x = gw_TD.sub_(xhat_TD.mul_(mean_T1)).mul_(rstd_T1)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``eager_rms_norm(x, weight, eps)`` for a float32 ``x`` with a float32 weight; None for other
    dtypes (the caller keeps the eager op)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _rms_forward(x, weight, eps)[0]


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_THD, cos2_T1D, sin2_T1D, out_dtype):
        x32 = x_THD.float()
        out = torch.addcmul(x32 * cos2_T1D, _swap_halves(x32), sin2_T1D)
        ctx.save_for_backward(cos2_T1D, sin2_T1D)
        ctx.in_dtype = x_THD.dtype
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, g_THD):
        cos2_T1D, sin2_T1D = ctx.saved_tensors
        g32 = g_THD.float()
        # out = x c + P(x) s with P the half swap (its own transpose): dx = g c + P(g s)
        grad = torch.addcmul(_swap_halves(g32 * sin2_T1D), g32, cos2_T1D)
        return grad.to(ctx.in_dtype), None, None, None


def rope(
    x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor | None:
    """``eager_rope(x_THD, cos_TF, sin_TF).to(out_dtype)`` where a gradient reaches ``x_THD`` and the
    tables are float32 (so the eager op computes in float32 too), or in a forward-only float32 pass
    (``_rope_forward_only``); None otherwise (the caller keeps the eager op)."""
    if cos_TF.dtype != torch.float32:
        return None
    if not (torch.is_grad_enabled() and x_THD.requires_grad):
        if x_THD.dtype == out_dtype == torch.float32:
            return _rope_forward_only(x_THD, cos_TF, sin_TF)
        return None
    cos2_T1D = torch.cat((cos_TF, cos_TF), dim=-1)[:, None, :]
    sin2_T1D = torch.cat((-sin_TF, sin_TF), dim=-1)[:, None, :]
    return _Rope.apply(x_THD, cos2_T1D, sin2_T1D, out_dtype)


def _rope_forward_only(x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """``eager_rope`` without autograd, each half of the output written in place by a product and a
    multiply-add (four ops; the eager form's eight allocate each intermediate and concatenate): the
    same values up to the multiply-add's single rounding."""
    half = x_THD.shape[-1] // 2
    x1, x2 = x_THD[..., :half], x_THD[..., half:]
    cos, sin = cos_TF[:, None, :], sin_TF[:, None, :]
    out = torch.empty(x_THD.shape, dtype=x_THD.dtype, device=x_THD.device)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out
