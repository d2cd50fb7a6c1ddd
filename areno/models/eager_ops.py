"""The decoder's element-wise ops in eager PyTorch: what training and every CPU path run, and the
reference the fused inference kernels (``fused_ops``) are checked against.

Legend: T = tokens, H = heads, Dh = head dim, F = Dh / 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areno.models.config import ModelConfig


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


@dataclass(frozen=True)
class LogitMap:
    """What a model does to its head's logits z before the softmax (and any temperature), in float32: ``z /
    divisor`` (Granite's ``logits_scaling``), then ``cap * tanh(. / cap)`` (Gemma 2's ``final_logit_softcapping``).
    Every place that makes logits or log-probs from the head applies it; ``of`` gives None for a model without."""

    divisor: float = 1.0
    cap: float | None = None

    @classmethod
    def of(cls, config: ModelConfig) -> LogitMap | None:
        """The map of ``config``'s head, or None where its logits are the product itself."""
        divisor, cap = config.logits_scaling, config.final_logit_softcapping
        return None if divisor == 1.0 and cap is None else cls(divisor, cap)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """The model's logits from the head's product ``z`` (float32)."""
        if self.divisor != 1.0:
            z = z.float() / self.divisor
        return soft_cap(z, self.cap)

    def derivative(self, c: torch.Tensor) -> torch.Tensor | float:
        """dc/dz at the mapped logits ``c``: ``(1 - (c / cap)^2) / divisor`` (a new tensor), or ``1 / divisor``
        without a cap."""
        if self.cap is None:
            return 1.0 / self.divisor
        d = (c.float() / self.cap).square_().neg_().add_(1.0)
        return d.div_(self.divisor) if self.divisor != 1.0 else d

    def temperature_form(self, temperature: float) -> tuple[float, LogitMap | None]:
        """``(temperature, map)`` of the same softmax with a divisor alone folded into the temperature
        (``softmax(z / s / tau) = softmax(z / (s tau))``): the chunked heads then keep their model-dtype
        logits and fused kernels, and their backward's division by the temperature is the map's derivative."""
        if self.cap is None:
            return temperature * self.divisor, None
        return temperature, self


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
