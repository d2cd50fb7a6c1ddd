"""Qwen2.5-VL layout: the vision tower, its patch merger (the projector) and M-RoPE positions, around
the one ``Decoder``.

Module names equal the Hugging Face names of a ``Qwen2_5_VLForConditionalGeneration`` checkpoint as
``transformers`` saves it (``visual.patch_embed.proj``, ``visual.blocks.N.attn.qkv``,
``visual.merger.mlp.0`` … beside the decoder's ``model.*`` and ``lm_head``), so the state dict *is*
the checkpoint's.

An image reaches the decoder as rows of pixel patches (``image_patches``: resized, rescaled,
normalised and flattened exactly as the Qwen2-VL image processor does) plus its grid (t, h, w) in
patches. The prompt holds ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch +
``<|vision_end|>`` (``expand_image_tokens``); the tower's output replaces the embeddings of those
pad tokens. Text positions are M-RoPE's: three axes (time, height, width) equal for text, the
patch's row and column for image tokens, and text after an image continues from the largest
position so far + 1 (``mrope_positions``).

Legend: N = patches, E = vision width, I = images, T = tokens, D = text width, F = Dh/2.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from areno.models import fused_ops, inference
from areno.models.attention import AttentionBackend, PackedCausalAttention
from areno.models.config import ModelConfig
from areno.models.decoder import Decoder
from areno.models.eager_ops import eager_rms_norm

# the Qwen2-VL image processor's normalisation (OpenAI CLIP's)
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The vision tower's shape (HF ``vision_config``) and the special token ids of the layout."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    min_pixels: int = 56 * 56
    """Smallest image area after resizing (the image processor's ``shortest_edge``)."""
    max_pixels: int = 28 * 28 * 1280
    """Largest image area after resizing (the image processor's ``longest_edge``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other ``vision_config`` keys, written back unchanged by ``to_hf``."""

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> VisionConfig:
        """From a VL ``config.json`` dict (its ``vision_config`` and top-level token ids)."""
        v = dict(d["vision_config"])
        if v.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision hidden_act={v['hidden_act']!r} is not supported (only 'silu')")
        rope = v.get("rope_parameters") or {}
        known = {
            "depth": v["depth"],
            "hidden_size": v["hidden_size"],
            "intermediate_size": v["intermediate_size"],
            "num_heads": v["num_heads"],
            "out_hidden_size": v["out_hidden_size"],
            "patch_size": v.get("patch_size", 14),
            "temporal_patch_size": v.get("temporal_patch_size", 2),
            "spatial_merge_size": v.get("spatial_merge_size", 2),
            "window_size": v.get("window_size", 112),
            "fullatt_block_indexes": tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
            "in_channels": v.get("in_channels", 3),
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
        }
        extra = {k: val for k, val in v.items() if k not in known and k not in ("rope_parameters", "hidden_act")}
        ids = {
            k: d[k]
            for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id", "min_pixels", "max_pixels")
            if k in d
        }
        return cls(**known, **ids, extra=extra)

    def to_hf(self) -> dict[str, Any]:
        """(``vision_config`` dict, top-level token ids) merged as one dict for the VL config.json."""
        vision = {
            **self.extra,
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "out_hidden_size": self.out_hidden_size,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "window_size": self.window_size,
            "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "in_channels": self.in_channels,
            "hidden_act": self.hidden_act,
            "model_type": "qwen2_5_vl_vision",
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }
        return {
            "vision_config": vision,
            "image_token_id": self.image_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
        }

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one row of ``pixel_values``: C · t · p · p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def tokens_per_image(self, grid_thw: tuple[int, int, int]) -> int:
        """How many ``<|image_pad|>`` tokens (merged patches) an image of this grid takes."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2


def processor_config(vc: VisionConfig) -> dict[str, Any]:
    """The ``preprocessor_config.json`` of the Qwen2-VL image processor these patches match."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": vc.patch_size,
        "temporal_patch_size": vc.temporal_patch_size,
        "merge_size": vc.spatial_merge_size,
        "min_pixels": vc.min_pixels,
        "max_pixels": vc.max_pixels,
        "image_mean": list(IMAGE_MEAN),
        "image_std": list(IMAGE_STD),
    }


def read_pixel_limits(d: dict[str, Any]) -> dict[str, int]:
    """``min_pixels``/``max_pixels`` of a ``preprocessor_config.json`` dict (either spelling)."""
    size = d.get("size") or {}
    out = {
        "min_pixels": d.get("min_pixels", size.get("shortest_edge")),
        "max_pixels": d.get("max_pixels", size.get("longest_edge")),
    }
    return {k: int(v) for k, v in out.items() if v is not None}


def tiny_vl_config(
    vocab_size: int,
    *,
    image_token_id: int,
    vision_start_token_id: int,
    vision_end_token_id: int,
    hidden_size: int = 32,
    layers: int = 1,
    heads: int = 2,
    kv_heads: int = 1,
    vision_hidden: int = 16,
    vision_depth: int = 1,
    patch_size: int = 4,
    min_pixels: int = 64,
    max_pixels: int = 64 * 64,
    **kw: Any,
) -> ModelConfig:
    """A small Qwen2.5-VL ``ModelConfig`` for tests and demos (token ids: the char tokenizer's
    pad 0, bos 1, eos 2, unless ``kw`` sets them)."""
    head_dim = hidden_size // heads
    half = head_dim // 2
    section = (half - 2 * (half // 3), half // 3, half // 3)
    vision = {
        "vision_config": {
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "intermediate_size": 2 * vision_hidden,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "patch_size": patch_size,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 4 * patch_size,
            "fullatt_block_indexes": [vision_depth - 1],
        },
        "image_token_id": image_token_id,
        "vision_start_token_id": vision_start_token_id,
        "vision_end_token_id": vision_end_token_id,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
    }
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        attention_bias=True,
        architecture="Qwen2_5_VLForConditionalGeneration",
        model_type="qwen2_5_vl",
        mrope_section=section,
        vision=vision,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(kw)
    return ModelConfig(**fields)


# ----------------------------------------------------------------------------------- images
def decode_image(image: Any) -> Any:
    """A PIL image from a PIL image, PNG/JPEG bytes, a base64 string or a ``data:image/...;base64,`` URL."""
    from PIL import Image  # imported by the VL path only (an image prompt)

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, str):
        if image.startswith("data:"):
            image = image.partition(",")[2]
        image = base64.b64decode(image)
    if isinstance(image, (bytes, bytearray)):
        return Image.open(io.BytesIO(image))
    raise ValueError(f"an image must be a PIL image, bytes or a base64 string, got {type(image).__name__}")


def encode_png(image: Any) -> str:
    """A ``data:image/png;base64,...`` URL of a PIL image (what the OpenAI ``image_url`` part carries)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL image processor's target size: both sides multiples of ``factor``, the area in
    [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be below 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_patches(image: Any, vc: VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """float32 pixel patches [N, C·t·p·p] and the grid (1, h, w) of one image, as the Qwen2-VL
    image processor makes them (RGB, bicubic resize, ÷255, CLIP normalisation, the still image
    repeated over the temporal patch, patches ordered by 2×2 merge block)."""
    from PIL import Image  # imported by the VL path only (an image prompt)

    image = decode_image(image).convert("RGB")
    p, m, tp = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
    h, w = smart_resize(image.height, image.width, p * m, vc.min_pixels, vc.max_pixels)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    x = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255)
    mean = np.asarray(IMAGE_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(IMAGE_STD, dtype=np.float32)[:, None, None]
    x = (x - mean) / std
    c, gh, gw = x.shape[0], h // p, w // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    return torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, c * tp * p * p)), (1, gh, gw)


def expand_image_tokens(ids: list[int], grids: list[tuple[int, int, int]], vc: VisionConfig) -> list[int]:
    """``ids`` with the i-th ``<|image_pad|>`` repeated ``tokens_per_image(grids[i])`` times (what the
    Qwen2.5-VL processor does to a rendered prompt); a count mismatch is a ValueError."""
    out: list[int] = []
    n = 0
    for tok in ids:
        if tok == vc.image_token_id:
            if n >= len(grids):
                raise ValueError(f"the prompt has more image tokens than the {len(grids)} images given")
            out.extend([tok] * vc.tokens_per_image(grids[n]))
            n += 1
        else:
            out.append(tok)
    if n != len(grids):
        raise ValueError(f"the prompt has {n} image tokens but {len(grids)} images were given")
    return out


def mrope_positions(ids: list[int] | torch.Tensor, grids: list[tuple[int, int, int]], vc: VisionConfig) -> torch.Tensor:
    """long [3, T] M-RoPE positions of one sequence (prompt and completion) whose image-pad runs are
    already expanded: text advances all three axes by one; an image of merged grid (t, h', w')
    starting at position s takes (s, s + row, s + col), and the text after it starts at s + max(h', w')."""
    positions, used, _ = _mrope(ids, grids, vc)
    if used != len(grids):
        raise ValueError(f"the sequence holds {used} images but {len(grids)} were given")
    return positions


def _mrope(
    ids: list[int] | torch.Tensor, grids: list[tuple[int, int, int]], vc: VisionConfig
) -> tuple[torch.Tensor, int, list[bool]]:
    """(``mrope_positions``, how many of ``grids`` the sequence used, which tokens are image rows).
    Image tokens past the last grid (a completion that sampled the pad token) are text."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    m = vc.spatial_merge_size
    cols: list[torch.Tensor] = []
    is_image = [False] * len(ids)
    pos, i, img = 0, 0, 0
    while i < len(ids):
        if ids[i] != vc.image_token_id or img >= len(grids):
            j = i + 1
            while j < len(ids) and (ids[j] != vc.image_token_id or img >= len(grids)):
                j += 1
            cols.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        t, h, w = grids[img]
        h, w = h // m, w // m
        n = t * h * w
        if ids[i : i + n] != [vc.image_token_id] * n:
            raise ValueError(f"image {img} has a grid of {n} tokens but its run of image tokens is shorter")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        cols.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        is_image[i : i + n] = [True] * n
        pos += max(h, w)
        i += n
        img += 1
    if not cols:
        return torch.zeros(3, 0, dtype=torch.long), img, is_image
    return torch.cat(cols, dim=1).long(), img, is_image


WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Pixel dtypes ``ImageInputs.from_wire`` accepts."""


@dataclass
class ImageInputs:
    """The images of a packed forward: patches of every image in token order, and their grids."""

    pixel_values: torch.Tensor
    """[N, C·t·p·p] patches of all images, concatenated in the order their tokens appear."""
    grid_thw: list[tuple[int, int, int]]
    """One (t, h, w) per image, in patches."""
    per_sequence: list[int] | None = None
    """Images of each packed sequence, in order (a training batch: ``concat``); None: one sequence."""

    @classmethod
    def from_images(cls, images: list[Any], vc: VisionConfig) -> ImageInputs:
        patches, grids = zip(*(image_patches(im, vc) for im in images), strict=True)
        return cls(torch.cat(patches), list(grids))

    def key(self) -> int:
        """A 63-bit content hash of the pixels and grids: the prefix cache's root for sequences
        with these images (equal token ids with other images must not share K/V)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr(self.grid_thw).encode())
        h.update(self.pixel_values.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return int.from_bytes(h.digest(), "little") >> 1

    def to_wire(self) -> dict[str, Any]:
        """JSON-safe form for the HTTP rollout server (partitioned placement): the pixels' raw
        bytes in base64 with their dtype and shape, so the server sees the very same values."""
        px = self.pixel_values.detach().to("cpu").contiguous()
        raw = px.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {
            "pixel_values": base64.b64encode(raw).decode("ascii"),
            "dtype": str(px.dtype).removeprefix("torch."),
            "shape": list(px.shape),
            "grid_thw": [list(g) for g in self.grid_thw],
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ImageInputs:
        """The inverse of ``to_wire``; a ValueError names what does not fit."""
        dtype = WIRE_DTYPES.get(wire.get("dtype", ""))
        if dtype is None:
            raise ValueError(f"images.dtype must be one of {sorted(WIRE_DTYPES)}, got {wire.get('dtype')!r}")
        try:
            raw = base64.b64decode(wire["pixel_values"], validate=True)
            shape = [int(n) for n in wire["shape"]]
            grid = [tuple(int(n) for n in g) for g in wire["grid_thw"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"images needs pixel_values (base64), shape and grid_thw: {e}") from None
        if len(shape) != 2 or len(raw) != math.prod(shape) * dtype.itemsize or any(len(g) != 3 for g in grid):
            raise ValueError(f"images: {len(raw)} bytes do not make a {dtype} tensor of shape {shape}")
        if sum(t * h * w for t, h, w in grid) != shape[0]:
            raise ValueError(f"images: grid_thw {grid} does not cover the {shape[0]} patches")
        pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        return cls(pixels, grid)  # type: ignore[arg-type]

    @classmethod
    def concat(cls, parts: list[ImageInputs | None]) -> ImageInputs | None:
        counts = [0 if p is None else len(p.grid_thw) for p in parts]
        parts = [p for p in parts if p is not None and p.grid_thw]
        if not parts:
            return None
        return cls(torch.cat([p.pixel_values for p in parts]), [g for p in parts for g in p.grid_thw], counts)


# ------------------------------------------------------------------------------ vision tower
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eager_rms_norm(x, self.weight, self.eps)


class PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.vc = vc
        k = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, pixels_NP: torch.Tensor) -> torch.Tensor:
        vc = self.vc
        x = pixels_NP.view(-1, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, vc.hidden_size)


@dataclass(frozen=True, kw_only=True)
class Segments:
    """The attention segments of a tower forward (windows, or whole images), grouped by length so
    that each distinct length runs one batched SDPA instead of one call per segment.

    ``order_N`` lists the rows segment by segment, the segments of one length together (lengths
    ascending, segments in their order); ``inverse_N`` puts them back. Both are None when the
    grouped order is the rows' own (every segment of one length). ``cos``/``sin`` [N, head_dim]
    are the tower's RoPE tables in the grouped order, taken once per forward rather than once per layer.
    """

    groups: tuple[tuple[int, int], ...]
    """(number of segments, length) per distinct length, in ``order_N``'s order."""
    order_N: torch.Tensor | None
    inverse_N: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> Segments:
        """From segment boundaries (rows ``cu_seqlens[i]:cu_seqlens[i + 1]``) and the RoPE tables of the rows."""
        starts_by_length: dict[int, list[int]] = {}
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            starts_by_length.setdefault(b - a, []).append(a)
        lengths = sorted(starts_by_length)
        groups = tuple((len(starts_by_length[n]), n) for n in lengths)
        order_N = torch.cat([(torch.tensor(starts_by_length[n])[:, None] + torch.arange(n)).flatten() for n in lengths])
        if torch.equal(order_N, torch.arange(order_N.numel())):
            return cls(groups=groups, order_N=None, inverse_N=None, cos=cos, sin=sin)
        order_N = order_N.to(cos.device)
        return cls(
            groups=groups,
            order_N=order_N,
            inverse_N=torch.argsort(order_N),
            cos=cos[order_N],
            sin=sin[order_N],
        )


class VisionAttention(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.num_heads = vc.num_heads
        self.qkv = nn.Linear(vc.hidden_size, 3 * vc.hidden_size, bias=True)
        self.proj = nn.Linear(vc.hidden_size, vc.hidden_size)

    def forward(self, x_NE: torch.Tensor, segments: Segments) -> torch.Tensor:
        """Bidirectional attention within each segment; rows in and out in ``x_NE``'s order."""
        n, h = x_NE.shape[0], self.num_heads
        # qkv and proj act row by row, so they run in the grouped order and only x and the output move
        x = x_NE if segments.order_N is None else x_NE[segments.order_N]
        q, k, v = self.qkv(x).reshape(n, 3, h, -1).permute(1, 0, 2, 3).unbind(0)
        dtype = q.dtype
        cos, sin = segments.cos[:, None].float(), segments.sin[:, None].float()
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(dtype)
        outs = []
        a = 0
        for count, length in segments.groups:  # one SDPA over all segments of this length
            b = a + count * length
            qs, ks, vs = (t[a:b].view(count, length, h, -1).transpose(1, 2) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(count * length, -1))
            a = b
        out = self.proj(outs[0] if len(outs) == 1 else torch.cat(outs))
        return out if segments.inverse_N is None else out[segments.inverse_N]


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=True)
        self.up_proj = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=True)
        self.down_proj = nn.Linear(vc.intermediate_size, vc.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(vc.hidden_size)
        self.norm2 = VisionRMSNorm(vc.hidden_size)
        self.attn = VisionAttention(vc)
        self.mlp = VisionMLP(vc)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """The projector: RMSNorm, then each 2×2 block of patches concatenated → MLP → the text width."""

    def __init__(self, vc: VisionConfig, out_dim: int) -> None:
        super().__init__()
        self.width = vc.hidden_size * vc.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(vc.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def _window_index(grids: list[tuple[int, int, int]], vc: VisionConfig) -> tuple[torch.Tensor, list[int]]:
    """(order of merged patches grouped by attention window, window boundaries in patches), as
    transformers' ``get_vision_window_index``."""
    m = vc.spatial_merge_size
    win = vc.window_size // m // vc.patch_size
    unit = m * m
    index: list[torch.Tensor] = []
    cu = [0]
    base = 0
    for t, h, w in grids:
        lh, lw = h // m, w // m
        idx = torch.arange(t * lh * lw).reshape(t, lh, lw)
        ph, pw = win - lh % win, win - lw % win
        nh, nw = (lh + ph) // win, (lw + pw) // win
        padded = F.pad(idx, (0, pw, 0, ph), "constant", -100)
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win, win)
        seqlens = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        index.append(flat[flat != -100] + base)
        for s in (seqlens.cumsum(0) * unit + cu[-1]).tolist():
            if s != cu[-1]:
                cu.append(s)
        base += t * lh * lw
    return torch.cat(index), cu


class VisionTower(nn.Module):
    """Qwen2.5-VL's ViT: 3-D patch embedding, blocks with 2-D RoPE and window attention (full
    attention in ``fullatt_block_indexes``), and the patch merger to the decoder's width."""

    def __init__(self, vc: VisionConfig, out_dim: int) -> None:
        super().__init__()
        self.vc = vc
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, out_dim)

    def _rope(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim] of every patch (row angles then column angles, twice)."""
        m = self.vc.spatial_merge_size
        pos = []
        for t, h, w in grids:
            hp, wp = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            hp = hp.reshape(shape).transpose(1, 2).flatten()
            wp = wp.reshape(shape).transpose(1, 2).flatten()
            pos.append(torch.stack([hp, wp], dim=-1).repeat(t, 1))
        pos_N2 = torch.cat(pos).to(device)
        spatial = self.vc.head_dim // 2
        inv_freq = 1.0 / (
            self.vc.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial)
        )
        freqs = pos_N2[..., None].float() * inv_freq  # [N, 2, Dh/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()

    def forward(self, pixels_NP: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[sum of merged patches, out_dim] image embeddings, images in the order of ``grids``."""
        unit = self.vc.spatial_merge_size**2
        x = self.patch_embed(pixels_NP)
        n = x.shape[0]
        window_index, cu_window = _window_index(grids, self.vc)
        cu_full = [0]
        for t, h, w in grids:
            for _ in range(t):
                cu_full.append(cu_full[-1] + h * w)

        def by_window(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)

        x = by_window(x)
        cos, sin = (by_window(c) for c in self._rope(grids, x.device))
        # every window layer attends within the same segments, as every full layer does: group them once
        windows, full = Segments.build(cu_window, cos, sin), Segments.build(cu_full, cos, sin)
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.vc.fullatt_block_indexes else windows)
        return self.merger(x)[torch.argsort(window_index)]


# ------------------------------------------------------------------------------ the VL model
def mrope_cos_sin(
    cos_PF: torch.Tensor, sin_PF: torch.Tensor, position_ids_3T: torch.Tensor, section: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, F] of M-RoPE: frequency block i (sizes ``section``) rotates by axis i's position."""
    bounds = np.cumsum((0, *section)).tolist()
    cos = torch.cat([cos_PF[position_ids_3T[i], a:b] for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))], -1)
    sin = torch.cat([sin_PF[position_ids_3T[i], a:b] for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))], -1)
    return cos, sin


def vision_towers(model: nn.Module) -> list[VisionTower]:
    """The vision towers inside ``model`` (wrappers included; empty for a text model)."""
    return [m for m in model.modules() if isinstance(m, VisionTower)]


class VisionLanguageModel(Decoder):
    """Qwen2.5-VL: the ``Decoder`` (``model.*``, ``lm_head``) plus ``visual``, the vision tower.

    ``forward`` takes ``position_ids_T`` as [T] (text only: M-RoPE's three axes are equal, so it is
    plain RoPE) or [3, T] (``mrope_positions`` per sequence, concatenated), and ``images`` whose
    embeddings replace the image-pad tokens of ``input_ids_T`` in order.
    """

    def __init__(self, config: ModelConfig, **kw: Any) -> None:
        if config.vision is None or config.mrope_section is None:
            raise ValueError("VisionLanguageModel needs a ModelConfig with vision and mrope_section")
        vc = VisionConfig.from_hf(config.vision)
        super().__init__(config, **kw)
        self.vision_config = vc
        self.visual = VisionTower(vc, config.hidden_size)
        self.reset_parameters()  # the tower's linear layers too

    def image_features(self, images: ImageInputs) -> torch.Tensor:
        """[image tokens, D] the vision tower's output for ``images`` (in their order)."""
        weight = self.visual.patch_embed.proj.weight
        return self.visual(images.pixel_values.to(weight.device), images.grid_thw)

    def embed(
        self,
        input_ids_T: torch.Tensor,
        images: ImageInputs | None,
        image_embeds: torch.Tensor | None = None,
        image_mask_T: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with the image rows (``image_mask_T``; default: every image-pad token)
        replaced by the vision tower's output (or by ``image_embeds``, rows already computed, as
        the rollout engine passes them)."""
        x_TD = self.model.embed_tokens(input_ids_T)
        if image_embeds is None and (images is None or not images.grid_thw):
            return x_TD
        feats = (image_embeds if image_embeds is not None else self.image_features(images)).to(x_TD.dtype)
        mask_T = input_ids_T == self.vision_config.image_token_id if image_mask_T is None else image_mask_T
        if int(mask_T.sum()) != feats.shape[0]:
            raise ValueError(f"{int(mask_T.sum())} image tokens in the input but the images give {feats.shape[0]}")
        return x_TD.masked_scatter(mask_T[:, None], feats)

    def forward(
        self,
        input_ids_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        attn: AttentionBackend | None = None,
        images: ImageInputs | None = None,
        image_embeds: torch.Tensor | None = None,
        image_mask_T: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, D]. With ``images`` and 1-D positions (a packed training
        batch: positions restart at 0 per sequence), the M-RoPE positions are computed here."""
        if attn is None:
            cu_seqlens_B1 = torch.tensor([0, input_ids_T.numel()], dtype=torch.long)
            attn = PackedCausalAttention.for_model(cu_seqlens_B1, self.config)
        if images is not None and images.grid_thw and position_ids_T.dim() == 1:
            position_ids_T, image_mask_T = self.packed_mrope_positions(input_ids_T, position_ids_T, images)
        x_TD = self.embed(input_ids_T, images, image_embeds, image_mask_T)
        if isinstance(attn, PackedCausalAttention):
            self.prepare_attention(attn, x_TD)
        cos_PF, sin_PF = self.rope.get(x_TD.device, x_TD.dtype)
        if position_ids_T.dim() == 2:
            cos_TF, sin_TF = mrope_cos_sin(cos_PF, sin_PF, position_ids_T, self.config.mrope_section)
        else:
            cos_TF, sin_TF = cos_PF[position_ids_T], sin_PF[position_ids_T]
        if fused_ops.add_norm_active(x_TD):  # as Decoder.forward
            return inference.forward_add_norm(self.model.layers, self.model.norm, x_TD, cos_TF, sin_TF, attn)
        return self.forward_layers(x_TD, cos_TF, sin_TF, attn)

    def packed_mrope_positions(
        self, input_ids_T: torch.Tensor, position_ids_T: torch.Tensor, images: ImageInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(long [3, T] M-RoPE positions, bool [T] image rows) of packed sequences (each starts
        where ``position_ids_T`` is 0) whose image-token runs take ``images``' grids in order."""
        vc = self.vision_config
        ids = input_ids_T.tolist()
        starts = (position_ids_T == 0).nonzero().flatten().tolist() + [len(ids)]
        out, mask, g = [], [], 0
        counts = images.per_sequence or [len(images.grid_thw)] + [0] * (len(starts) - 2)
        if len(counts) != len(starts) - 1:
            raise ValueError(f"images for {len(counts)} sequences but the batch packs {len(starts) - 1}")
        for a, b, c in zip(starts[:-1], starts[1:], counts):
            pos, n, is_image = _mrope(ids[a:b], images.grid_thw[g : g + c], vc)
            if n != c:
                raise ValueError(f"a packed sequence holds {n} images but {c} were given for it")
            out.append(pos)
            mask.extend(is_image)
            g += n
        device = position_ids_T.device
        return torch.cat(out, dim=1).to(device), torch.tensor(mask, dtype=torch.bool, device=device)


def position_delta(positions_3P: torch.Tensor) -> int:
    """Offset of generated tokens' positions: token i (i >= prompt length) sits at i + delta."""
    return int(positions_3P.max()) + 1 - positions_3P.shape[1] if positions_3P.numel() else 0
