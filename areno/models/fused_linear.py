"""Fused input projections for inference: one GEMM for q/k/v and one for gate/up per layer.

A small model's decode step is bound by its kernel count, not by bytes (bench/rollout.py
--profile): each decoder layer launches five input GEMMs (q_proj, k_proj, v_proj, gate_proj,
up_proj) on the same activations. ``FusedRows`` stacks the output rows of several ``nn.Linear``
of one input into one contiguous [sum(N_i), D] weight (and [sum(N_i)] bias) and re-points each
member's ``weight`` / ``bias`` to its row slice (``param.data = fused[a:b]``): the parameter
objects, their Hugging Face names and ``state_dict()`` stay as they were, and an in-place write to
``...q_proj.weight`` (a policy sync, ``update_weights``, ``load_state_dict``) lands in the fused
storage, which the forwards read with one ``F.linear``. The row slices are contiguous, so
transports that receive straight into them work unchanged.

``Decoder.fuse_projections()`` applies it (the rollout engine calls it once, before any CUDA
graph is captured). A fused group is only read while it is ``usable()``: gradients disabled (a
gradient must reach the member parameters, so training forwards take the per-projection path), not
compiling, and every member still backed by the fused storage; something that replaces a member's
storage afterwards (``model.to(...)``, ``load_state_dict(assign=True)``, a storage swap) silently
sends that layer back to the per-projection path (one warning), never to stale weights.

``glu_halves`` is the MLP's gated activation (SiLU or the tanh GELU, times up) over the fused [T, 2I]
gate/up output: a Triton kernel reading both halves in place (``fused_ops.glu`` would first copy each strided half),
with the eager op's roundings; ``enable()`` turns it on after a self-check against the eager op.

Legend: T = tokens, D = input features, N = fused output rows, I = intermediate size.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch
from torch import nn

from areno.models import cpu_gemm, fused_ops
from areno.models.eager_ops import eager_glu
from areno.models.fused_ops import triton

log = logging.getLogger(__name__)

_WARNED = False


class FusedRows:
    """The output rows of several ``nn.Linear`` of one input, stacked in one tensor that backs them.

    ``weight``: [N, D] with N the sum of the members' output sizes (in member order); ``bias``:
    [N] or None (all members have a bias or none has); ``sizes``: each member's output size.
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        if not linears:
            raise ValueError("FusedRows needs at least one nn.Linear")
        first = linears[0].weight
        for lin in linears:
            w = lin.weight
            if w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device:
                raise ValueError(
                    f"FusedRows: weights of shape {tuple(w.shape)} ({w.dtype}, {w.device}) and "
                    f"{tuple(first.shape)} ({first.dtype}, {first.device}) cannot share one tensor; "
                    "fuse after every projection has its final shape, dtype and device"
                )
            if (lin.bias is None) != (linears[0].bias is None):
                raise ValueError("FusedRows: either every projection of a group has a bias or none has")
        self.sizes = tuple(int(lin.weight.shape[0]) for lin in linears)
        self.members = tuple(linears)
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in linears])
            self.bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
            start = 0
            for lin, n in zip(linears, self.sizes):
                lin.weight.data = self.weight[start : start + n]
                if self.bias is not None:
                    lin.bias.data = self.bias[start : start + n]
                start += n
        self._ptrs = self._member_ptrs()

    def _member_ptrs(self) -> tuple[int, ...]:
        # offsets into the fused tensors, not addresses: a storage freed and re-allocated in place
        # (sleep/wake offload) moves the fused tensors and their member views together
        ptrs = [lin.weight.data_ptr() - self.weight.data_ptr() for lin in self.members]
        if self.bias is not None:
            ptrs += [lin.bias.data_ptr() - self.bias.data_ptr() for lin in self.members]
        return tuple(ptrs)

    def intact(self) -> bool:
        """Whether every member's weight (and bias) is still its row slice of the fused storage."""
        return self._member_ptrs() == self._ptrs

    def usable(self) -> bool:
        """Whether a forward may read the fused tensors (see the module docstring)."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        if self.intact():
            return True
        global _WARNED
        if not _WARNED:
            _WARNED = True
            log.warning(
                "fused projections %s no longer share storage with their parameters (moved or replaced "
                "after fusion): such layers run them one by one; call fuse_projections() again to re-fuse",
                "/".join(str(n) for n in self.sizes),
            )
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The [..., N] product, one GEMM; member i's output is columns ``sizes[:i]`` on (``split``)."""
        return cpu_gemm.linear(x, self.weight, self.bias, self.__dict__.get("cpu_pack"))  # Decoder.pack_cpu_gemms

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each member's output: column views of the product ``y``, in member order."""
        return y.split(self.sizes, dim=-1)


def glu_halves(gate_up_TN: torch.Tensor, *, gelu: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (with ``gelu``: the tanh GELU, GeGLU) for ``gate_up_TN`` = [T, 2I] (gate in
    the first half, up in the second), the activation rounded to the dtype first as eager does; for
    CUDA tensors where ``fused_ops.active``. One Triton kernel reading the halves in place when
    ``enable()`` passed, else ``fused_ops.glu`` on the two halves (which copies each first)."""
    if _SWITCH.on:
        return _glu_halves_triton(gate_up_TN, gelu)
    half = gate_up_TN.shape[-1] // 2
    return fused_ops.glu(gate_up_TN[..., :half], gate_up_TN[..., half:], gelu=gelu)


def _glu_halves_triton(gate_up_TN: torch.Tensor, gelu: bool) -> torch.Tensor:
    lead = gate_up_TN.shape[:-1]
    x = gate_up_TN.reshape(-1, gate_up_TN.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, half = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, half), dtype=x.dtype, device=x.device)
    if rows and half:
        block = min(1024, triton.next_power_of_2(half))
        _glu_halves_kernel[(rows, triton.cdiv(half, block))](
            x, out, x.stride(0), out.stride(0), half, GELU=gelu, BLOCK=block
        )
    return out.view(*lead, half)


if triton is not None:
    import triton.language as tl

    _round_to = fused_ops._round_to  # jit helpers the kernel below calls by these global names
    _gate_act = fused_ops._gate_act

    @triton.jit
    def _glu_halves_kernel(X, Y, stride_x, stride_y, I, GELU: tl.constexpr, BLOCK: tl.constexpr):  # noqa: E741 - I: the intermediate width
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
        act = _round_to(_gate_act(g, GELU), Y.dtype.element_ty)  # eager: the activation rounded
        tl.store(Y + row * stride_y + cols, (act * u).to(Y.dtype.element_ty), mask=mask)


def self_check(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Compare the halves kernel with eager ``silu(gate) * up`` on random inputs (odd sizes, a
    strided row view); None when they agree within two roundings of ``dtype``, else what failed."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        with torch.no_grad():
            for (rows, half), gelu in itertools.product(((7, 4864), (3, 1000), (1, 13)), (False, True)):
                x = torch.randn(rows, 2 * half + 6, generator=gen).to(device=device, dtype=dtype)[:, 3 : 3 + 2 * half]
                got = _glu_halves_triton(x, gelu)
                ref = eager_glu(x[:, :half], x[:, half:], gelu=gelu)
                ulp = torch.finfo(dtype).eps * ref.abs().float().clamp(min=1e-3)
                if not bool(((got.float() - ref.float()).abs() <= 2 * ulp).all()):
                    return (
                        f"glu_halves [{rows}, {2 * half}] (gelu={gelu}) differs from eager by "
                        f"{(got.float() - ref.float()).abs().max().item():.3g}"
                    )
    except Exception as e:  # noqa: BLE001 - a compiler or driver error disables the kernel
        return f"{type(e).__name__}: {e}"
    return None


_SWITCH = fused_ops.KernelSwitch(
    "the fused gated activation over the gate/up halves (two-copy fallback)", lambda device: self_check(device)
)


def enable(device: torch.device | str = "cuda") -> bool:
    """Turn the halves kernel on for this process if Triton and CUDA are here and the self-check
    passes (idempotent); returns whether it is on. Off, CUDA forwards use ``fused_ops.glu``."""
    return _SWITCH.enable(device)


def disable() -> None:
    _SWITCH.disable()
