"""The decoder's element-wise ops in eager PyTorch: what training and every CPU path run, and the
reference the fused inference kernels (``fused_ops``) are checked against.

Legend: T = tokens, H = heads, Dh = head dim, F = Dh / 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def eager_glu(gate: torch.Tensor, up: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
    """A gated MLP's activation times up: ``silu(gate) * up`` (SwiGLU), or with ``gelu`` the tanh GELU
    (GeGLU, Gemma 3's ``gelu_pytorch_tanh``)."""
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` in float32 (Gemma 2's soft-capping of attention scores and final logits; x itself
    where ``cap`` is None). transformers caps in the model dtype; float32 keeps every path's values alike."""
    if cap is None:
        return x
    return torch.tanh(x.float() / cap) * cap


def eager_rope(x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention: first half pairs with second half). cos/sin: [T, Dh/2]."""
    half = x_THD.shape[-1] // 2
    x1, x2 = x_THD[..., :half], x_THD[..., half:]
    cos, sin = cos_TF[:, None, :], sin_TF[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, output cast back, then scaled (transformers' order)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eager_rms_norm_fp32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed and scaled in float32, cast once to x's dtype (transformers' OLMo 2 order)."""
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def eager_rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm computed in float32 and scaled by ``offset + weight`` in float32, cast once to x's dtype
    (transformers' Gemma 3 order, whose weights are offsets from 1)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())).to(x.dtype)
