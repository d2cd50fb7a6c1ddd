"""The fused inference kernels' routing on CPU: every kernel replaced by its eager reference."""

from __future__ import annotations

import torch

from areno.models import cpu_train_ops, fused_ops
from areno.models.eager_ops import eager_rms_norm, eager_rms_norm_fp32_scale, eager_rms_norm_offset, eager_rope


def _eager_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_float32: bool = False, offset: float = 0.0
):
    """``fused_ops.rms_norm``'s eager reference, in either order (with Gemma 3's offset weights)."""
    if offset:
        return eager_rms_norm_offset(x, weight, eps, offset)
    return (eager_rms_norm_fp32_scale if scale_in_float32 else eager_rms_norm)(x, weight, eps)


def _cpu_rope(x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """The RoPE a CPU forward takes (``cpu_train_ops``' forward-only form in float32, else the eager op)."""
    out = cpu_train_ops.rope(x_THD, cos_TF, sin_TF, x_THD.dtype)
    return eager_rope(x_THD, cos_TF, sin_TF) if out is None else out


def emulate_fused_path_on_cpu(monkeypatch) -> None:
    """Route every forward through the fused-kernel code paths (as on CUDA inside ``inference()``)
    with the kernels replaced by their eager references: the routing (fused projections' single
    RoPE over q and k, add+norm pairs, the MLP's halves) is then checked on the CPU."""
    monkeypatch.setattr(fused_ops, "active", lambda x: not torch.is_grad_enabled())
    monkeypatch.setattr(fused_ops, "add_norm_active", lambda x: not torch.is_grad_enabled())
    monkeypatch.setattr(fused_ops, "rms_norm", _eager_rms_norm)
    monkeypatch.setattr(fused_ops, "rope", _cpu_rope)
    monkeypatch.setattr(fused_ops, "add_rms_norm", fused_ops.eager_add_rms_norm)
    monkeypatch.setattr(fused_ops, "norm_add_norm", fused_ops.eager_norm_add_norm)
    monkeypatch.setattr(fused_ops, "glu", fused_ops.eager_glu)
    monkeypatch.setattr(
        fused_ops,
        "write_kv",
        lambda k, v, k_S, v_S, slots: (k_S.index_copy_(0, slots, k), v_S.index_copy_(0, slots, v)),
    )
    monkeypatch.setattr(fused_ops, "eager_rope", _cpu_rope)  # inside eager_rope_write_kv
    monkeypatch.setattr(fused_ops, "rope_write_kv", fused_ops.eager_rope_write_kv)
