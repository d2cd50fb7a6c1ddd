"""gpt-oss checkpoints: their tensor names and layouts against the decoder's, and MXFP4 experts.

On disk (transformers' ``GptOssForCausalLM`` names): the router is ``mlp.router.{weight,bias}``; each
layer's experts are fused, ``mlp.experts.gate_up_proj`` [E, D, 2I] with the gate and up columns
interleaved (gate at even indices) and its bias [E, 2I] likewise, ``mlp.experts.down_proj`` [E, I, D] and
its bias [E, D]. The released checkpoints store the two expert weights in MXFP4 instead
(``{gate_up,down}_proj_blocks`` uint8 [E, N, K/32, 16]: two e2m1 values a byte, low nibble first;
``..._scales`` uint8 [E, N, K/32]: a power-of-two exponent per 32 values, biased by 127; N output rows,
K inputs), which ``dequantize_mxfp4`` turns into bf16 (exactly: every value is a small odd multiple of a
power of two).

In memory (``moe.SparseMoE``): the router is ``mlp.gate``; ``gate_up_proj`` [E, 2I, D] holds the gate rows,
then the up rows (what the grouped expert GEMMs split in halves), ``down_proj`` [E, D, I]. Loading maps the
disk's names and layouts to these (``held``), saving maps back (``to_disk_state``, bf16 unquantized,
read by transformers with no conversion).

Legend: E = experts, D = hidden size, I = expert width, N = output rows, K = input features.
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 values of the 16 nibbles (sign bit on top)."""
_ROUTER_DISK, _ROUTER_HELD = ".mlp.router.", ".mlp.gate."
_GATE_UP, _DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"
_QUANTIZED = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., N, K] values of MXFP4 ``blocks`` [..., N, K/32, 16] (uint8, two values a byte, low nibble
    first) and ``scales`` [..., N, K/32] (uint8 exponents biased by 127), one leading index at a time so
    that the lookup's index tensors stay the size of one expert."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype} do not "
            "pair (uint8 [..., N, K/32, 16] and [..., N, K/32])"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *lead, n, groups, width = blocks.shape
    flat_b, flat_s = blocks.reshape(-1, n, groups, width), scales.reshape(-1, n, groups)
    out = torch.empty(flat_b.shape[0], n, groups, 2 * width, dtype=dtype, device=blocks.device)
    for i in range(flat_b.shape[0]):
        b = flat_b[i]
        out[i, ..., 0::2] = lut[(b & 0x0F).long()]
        out[i, ..., 1::2] = lut[(b >> 4).long()]
        torch.ldexp(out[i], (flat_s[i].to(torch.int32) - 127)[..., None], out=out[i])
    return out.reshape(*lead, n, groups * 2 * width)


def is_disk_name(name: str) -> bool:
    """Whether ``name`` is one of the checkpoint tensors whose name or layout ``held`` maps."""
    return _ROUTER_DISK in name or _GATE_UP in name or _DOWN in name


def _gate_then_up(x_EnX: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) interleaved gate, up, gate, ... -> the gate rows, then the up rows."""
    return torch.cat((x_EnX[:, 0::2], x_EnX[:, 1::2]), dim=1)


def _interleaved(x_EnX: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_gate_then_up``."""
    gate, up = x_EnX.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).reshape(x_EnX.shape)


class HeldTensors:
    """Maps checkpoint tensors, as they are read, to the decoder's names and layouts; an MXFP4 weight
    comes out once both its blocks and its scales have been read (they may sit in different files)."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def held(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(held name, tensor)]`` for one tensor read under ``name`` (empty while an MXFP4 pair waits)."""
        if _ROUTER_DISK in name:
            return [(name.replace(_ROUTER_DISK, _ROUTER_HELD), tensor)]
        for suffix in _QUANTIZED:
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                pair = self._pending.setdefault(base, {})
                pair[suffix] = tensor
                if len(pair) < 2:
                    return []
                del self._pending[base]
                return self.held(base, dequantize_mxfp4(pair["_blocks"], pair["_scales"]).transpose(1, 2))
        if name.endswith(_GATE_UP):  # [E, D, 2I] interleaved -> [E, 2I, D] gate rows, then up rows
            return [(name, _gate_then_up(tensor.transpose(1, 2)))]
        if name.endswith(_GATE_UP + "_bias"):
            return [(name, _gate_then_up(tensor))]
        if name.endswith(_DOWN):  # [E, I, D] -> [E, D, I]
            return [(name, tensor.transpose(1, 2))]
        return [(name, tensor)]  # the down projection's bias [E, D]: as held

    def unpaired(self) -> list[str]:
        """The MXFP4 tensors read without their other half, by the name of the half that was read."""
        return [base + next(iter(pair)) for base, pair in self._pending.items()]


def to_disk_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder state dict under a gpt-oss checkpoint's names and layouts (the inverse of ``held``
    on unquantized tensors); order kept."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if _ROUTER_HELD in name:
            out[name.replace(_ROUTER_HELD, _ROUTER_DISK)] = t
        elif name.endswith(_GATE_UP):
            out[name] = _interleaved(t).transpose(1, 2).contiguous()
        elif name.endswith(_GATE_UP + "_bias"):
            out[name] = _interleaved(t).contiguous()
        elif name.endswith(_DOWN):
            out[name] = t.transpose(1, 2).contiguous()
        else:
            out[name] = t
    return out


def to_memory_items(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs read from a gpt-oss checkpoint under the decoder's names and layouts."""
    held = HeldTensors()
    out = [pair for name, t in items for pair in held.held(name, t)]
    if held.unpaired():
        raise ValueError(f"MXFP4 tensor {held.unpaired()[0]!r} without its blocks or scales")
    return out
