"""A small stand-in for ``triton`` / ``triton.language`` that runs a Triton kernel's Python body on CPU, one
program at a time, with torch ops: pointers are (flat tensor, element offsets), loads and stores masked,
``tl.dot`` in fp32. The paged decode kernel's CPU tests run its own code under it (no triton here)."""

from __future__ import annotations

import torch


class Ptr:
    def __init__(self, base: torch.Tensor, off=0) -> None:
        self.base, self.off = base, off
        self.dtype = type("PtrType", (), {"element_ty": base.dtype})

    def __add__(self, other) -> Ptr:
        return Ptr(self.base, self.off + other)

    __radd__ = __add__


def fake_triton():
    import types

    tl = types.ModuleType("triton.language")
    state = {"pid": (0, 0)}
    tl.constexpr, tl.float32, tl.int32, tl.int64 = object, torch.float32, torch.int32, torch.int64
    tl.program_id = lambda axis: state["pid"][axis]
    tl.arange = lambda a, b: torch.arange(a, b)
    tl.full = lambda shape, value, dtype: torch.full(shape, value, dtype=dtype)
    tl.zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype)
    tl.dot = lambda a, b, input_precision=None: a.float() @ b.float()
    tl.trans = lambda x: x.t()
    tl.where = lambda c, a, b: torch.where(c, a, b)
    tl.maximum = lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    tl.minimum = lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    tl.max = lambda x, axis: x.amax(axis)
    tl.sum = lambda x, axis: x.sum(axis)
    tl.exp = torch.exp
    tl.abs = torch.abs
    tl.math = types.SimpleNamespace(rsqrt=torch.rsqrt)

    def load(ptr, mask=None, other=0.0):
        off = torch.as_tensor(ptr.off)
        if mask is None:
            return ptr.base[off]
        mask = torch.broadcast_to(mask, off.shape)
        val = ptr.base[torch.where(mask, off, 0)]
        return torch.where(mask, val, torch.tensor(other, dtype=val.dtype))

    def store(ptr, val, mask=None):
        off = torch.as_tensor(ptr.off)
        mask = torch.ones_like(off, dtype=torch.bool) if mask is None else torch.broadcast_to(mask, off.shape)
        ptr.base[off[mask]] = torch.broadcast_to(val, off.shape)[mask].to(ptr.base.dtype)

    tl.load, tl.store = load, store

    class Launcher:
        def __init__(self, fn) -> None:
            self.fn = fn

        def __call__(self, *args, **kw):  # a jit helper called from a kernel
            return self.fn(*args, **kw)

        def __getitem__(self, grid):
            def launch(*args, num_warps=None, num_stages=None, **kw):
                # A tensor becomes a flat view of its memory span: the kernel addresses it by its strides.
                ptrs = [
                    Ptr(a.as_strided((1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride())),), (1,)))
                    if isinstance(a, torch.Tensor)
                    else a
                    for a in args
                ]
                import itertools

                for pid in itertools.product(*(range(g) for g in grid)):
                    state["pid"] = pid
                    self.fn(*ptrs, **kw)

            return launch

    triton_mod = types.ModuleType("triton")
    triton_mod.language = tl
    triton_mod.jit = Launcher
    triton_mod.next_power_of_2 = lambda n: 1 << (n - 1).bit_length()
    return triton_mod, tl


def emulated_paged_decode(monkeypatch):
    """``areno/rollout/paged_decode.py`` loaded afresh under the stand-in (its Triton kernels then run on CPU);
    skips the test where triton is importable (the gpu-marked tests run the real kernel)."""
    import importlib.util
    import sys

    import pytest

    import areno.rollout.paged_decode as real
    from areno.models import fused_ops

    if real.triton_available():
        pytest.skip("triton is importable: the gpu-marked tests run the real kernel")
    triton_mod, tl = fake_triton()
    # the kernel rounds RoPE's products with fused_ops' helper, defined only where triton is
    monkeypatch.setattr(fused_ops, "_round_to", lambda x, dtype: x.to(dtype).float(), raising=False)
    monkeypatch.setitem(sys.modules, "triton", triton_mod)
    monkeypatch.setitem(sys.modules, "triton.language", tl)
    spec = importlib.util.spec_from_file_location("_paged_decode_emulated", real.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.triton_available()
    return mod
