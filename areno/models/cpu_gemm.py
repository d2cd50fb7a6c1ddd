"""oneDNN-packed weights for the CPU inference GEMMs of the rollout engine.

On CPU a decode step's time is its GEMMs (bench/rollout.py: ~55% of the step at 32 rows of a
24M-parameter model), and at a few dozen rows ``F.linear`` (MKL's sgemm) re-lays out the weight on
every call: measured on a 2-core AVX2 VM, the 32k x 256 output projection ran at 27 GFLOP/s of the
cores' ~90. oneDNN's linear over a weight reordered once into its blocked layout runs the same fp32
product at 72 GFLOP/s there (bench/LOG.md); the engine keeps such a packed copy beside each large
weight and re-packs it when the weight changes. The same dot products are summed in another order,
so values differ from ``F.linear`` in the last bits (tests: ``allclose`` at fp32 tolerances).

A ``PackedWeight`` watches the tensors its copy was made from (their storage pointer and in-place
version counter): an in-place write through a parameter (``param.copy_``, ``load_state_dict``) or a
replaced storage makes it re-pack at its next use, and ``invalidate()`` (which the engine calls
whenever it commits new weights) covers writes that bypass the version counter (``param.data``). A
copy is only read for no-grad, non-compiled CPU products in the weight's dtype (``applies``): fp32
ones with at least ``MIN_ROWS`` rows, or any rows for weights of ``LARGE_ELEMENTS`` elements or more
(measured: at one or a few rows oneDNN's per-call cost makes small fp32 products slower; the output
projection is faster at every row count), and bf16 ones at any row count where the CPU has native bf16
dot products (``F.linear`` reorders the bf16 weight at every call too: the packed copy measured
1.1-3.9x faster from 1 to 2,048 rows on an AVX512-BF16 VM, with the same values). ``Decoder.pack_cpu_gemms``
attaches copies to every weight of ``MIN_ELEMENTS`` elements or more.

Legend: N = output features, K = input features, M = rows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MIN_ELEMENTS = 1 << 17
"""Weights smaller than this (N * K) keep ``F.linear``: measured on a 2-core AVX2 VM, 256 x 256 ran
0.5-0.9x at 32 and 64 rows; 384 x 384, 512 x 256 and 640 x 384 (the cpu12m and cpu5m shapes' q/k/v and
o_proj) 0.96-1.6x."""
MIN_ROWS = 8
"""Products of fewer rows keep ``F.linear`` (measured 0.3-0.7x at one row), except ``LARGE_ELEMENTS`` weights."""
LARGE_ELEMENTS = 1 << 22
"""Weights this large (an output projection over a vocabulary) take the packed copy at any row count (1.3x at one row)."""


@functools.cache
def supported() -> bool:
    """Whether this PyTorch has oneDNN's packed linear on CPU and it computes ``F.linear`` (checked once)."""
    ops = torch.ops.mkldnn
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    ):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(16, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
        y = ops._linear_pointwise(x, ops._reorder_linear_weight(w, 16), b, "none", [], "")
        ok = torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    except RuntimeError as exc:  # an op present but not built for this CPU
        log.info("oneDNN packed linear unavailable (%s): CPU inference GEMMs use F.linear", exc)
        return False
    if not ok:
        log.warning("oneDNN packed linear disagrees with F.linear on this machine: CPU inference GEMMs use F.linear")
    return ok


@functools.cache
def supported_bf16() -> bool:
    """Whether bf16 weights get packed copies: the CPU has native bf16 dot products (elsewhere oneDNN
    emulates them and a bf16 engine is not the ``auto`` choice) and the packed bf16 product computes
    ``F.linear`` (checked once)."""
    if not (native_bf16() and supported()):
        return False
    ops = torch.ops.mkldnn
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(16, 64, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
        y = ops._linear_pointwise(x, ops._reorder_linear_weight(w, 16), None, "none", [], "")
        ok = y.dtype == torch.bfloat16 and torch.allclose(y.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    except RuntimeError as exc:
        log.info("oneDNN packed bf16 linear unavailable (%s): bf16 CPU inference GEMMs use F.linear", exc)
        return False
    if not ok:
        log.warning("oneDNN packed bf16 linear disagrees with F.linear on this machine: bf16 GEMMs use F.linear")
    return ok


class PackedWeight:
    """A oneDNN-packed copy of a weight [N, K] (fp32 or bf16, CPU), re-packed when a watched tensor changes.

    ``weight``: ``(owner, attribute)`` of the weight the product reads (a fused group's storage, a
    parameter); ``watch``: ``(owner, attribute)`` of every tensor whose in-place writes change it (the
    parameters a sync writes; the weight itself is always watched). Both are read again at every use,
    so a replaced parameter or storage re-packs, and a deep copy of the model packs its own weights.
    ``batch_hint``: the row count oneDNN lays the copy out for (any count works)."""

    def __init__(
        self, weight: tuple[object, str], watch: Sequence[tuple[object, str]] = (), batch_hint: int = 32
    ) -> None:
        self._sources = (weight, *[w for w in watch if w != weight])
        self._batch_hint = max(int(batch_hint), 1)
        self._packed: torch.Tensor | None = None
        self._stamp: tuple[int, ...] | None = None
        self.large = self.weight().numel() >= LARGE_ELEMENTS
        self.dtype = self.weight().dtype
        self.repacks = 0

    def weight(self) -> torch.Tensor:
        owner, name = self._sources[0]
        return getattr(owner, name)

    def _current_stamp(self) -> tuple[int, ...]:
        stamp = []
        for owner, name in self._sources:
            t = getattr(owner, name)
            stamp += (t.data_ptr(), t._version)
        return tuple(stamp)

    def invalidate(self) -> None:
        """Re-pack at the next use (the weights were written in a way the version counters miss)."""
        self._stamp = None

    def applies(self, x: torch.Tensor) -> bool:
        """Whether the product with ``x`` [..., K] reads the packed copy."""
        return (
            x.device.type == "cpu"
            and x.dtype == self.dtype
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and (self.large or self.dtype == torch.bfloat16 or x.numel() >= MIN_ROWS * x.shape[-1])
        )

    def packed(self) -> torch.Tensor:
        """The packed copy, re-packed first if any watched tensor changed since the last packing."""
        stamp = self._current_stamp()
        if stamp != self._stamp or self._packed is None:
            w = self.weight().detach()
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self._batch_hint)
            self._stamp = stamp
            self.repacks += 1
        return self._packed

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` through the packed copy (call only where ``applies(x)``)."""
        lead = x.shape[:-1]
        x_MK = x.reshape(-1, x.shape[-1])
        if not x_MK.is_contiguous():
            x_MK = x_MK.contiguous()
        b = bias.detach() if bias is not None else None
        y_MN = torch.ops.mkldnn._linear_pointwise(x_MK, self.packed(), b, "none", [], "")
        return y_MN.view(*lead, y_MN.shape[-1])


def pack(
    weight: tuple[object, str], watch: Sequence[tuple[object, str]] = (), batch_hint: int = 32
) -> PackedWeight | None:
    """A ``PackedWeight`` for a CPU weight of at least ``MIN_ELEMENTS`` elements, fp32 where oneDNN's
    packed linear is ``supported()`` or bf16 where ``supported_bf16()``; else None (the product keeps
    ``F.linear``)."""
    w = getattr(*weight)
    if w.device.type != "cpu" or w.dim() != 2 or w.numel() < MIN_ELEMENTS:
        return None
    if not (supported() if w.dtype == torch.float32 else w.dtype == torch.bfloat16 and supported_bf16()):
        return None
    return PackedWeight(weight, watch, batch_hint)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` where it applies."""
    if packed is not None and packed.applies(x):
        return packed(x, bias)
    return F.linear(x, weight, bias)


BF16_MIN_HIDDEN = 256
"""``auto`` dtypes choose bfloat16 on a CPU with native bfloat16 dot products only for models at least
this wide: there the GEMMs dominate a step; a narrower model's step is overhead and keeps float32."""


@functools.cache
def native_bf16() -> bool:
    """Whether the CPU has native bfloat16 dot products (AVX512-BF16 or AMX, from ``/proc/cpuinfo``):
    oneDNN's bfloat16 GEMMs then run at several times the float32 rate; elsewhere they are emulated."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:  # no /proc (not Linux): treat bfloat16 as emulated
        return False
    return False


def prefers_bf16(hidden_size: int) -> bool:
    """Whether ``auto`` picks bfloat16 for a model of ``hidden_size`` on this CPU."""
    return hidden_size >= BF16_MIN_HIDDEN and native_bf16()
