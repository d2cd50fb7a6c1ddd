"""The one Llama-family decoder used by training and rollout (plain PyTorch, no torch.distributed).

Module names equal the Hugging Face names (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
``model.norm``, ``lm_head`` …), so ``Decoder.state_dict()`` *is* the HF state dict; the tied output
projection has no ``lm_head`` module. Mixture-of-experts layers (``moe.SparseMoE``: Qwen3-MoE, Mixtral, gpt-oss,
GLM-4.5, Qwen2-MoE, GraniteMoE, OLMoE) hold their experts fused as transformers 5 does in memory; ``hf_io`` maps them
to the per-expert names checkpoints store. Qwen2-MoE's shared expert and GLM-4.5's shared experts are ``MLP``s
inside the block (``mlp.shared_expert``, ``mlp.shared_experts``).

Inputs are packed and 1-D: ``input_ids_T`` holds all sequences concatenated and ``position_ids_T``
restarts at 0 for each. Attention is delegated to an ``AttentionBackend`` called in every layer as
``attn(layer_idx, q_THD, k_THD, v_THD)`` after RoPE (and Qwen3 q/k norms); ``PackedCausalAttention``
(``attention.py``) is the training/scoring backend, the rollout engine supplies a paged-KV one.

The model reads what the inference-only rewrites of ``inference.py`` attach (fused q/k/v and
gate/up groups, packed CPU GEMM copies) and the fused kernels of ``fused_ops`` where they are on;
the methods that apply those rewrites delegate there.

Legend: T = packed tokens, D = hidden size, H = heads (Hq query, Hkv key/value), Dh = head dim,
V = vocabulary, B = sequences, P = positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from areno.models import cpu_gemm, cpu_train_ops, decode_mlp, fused_linear, fused_ops, inference, moe
from areno.models.attention import (
    FLEX_MIN_HEAD_DIM,
    SDPA_MASK_MAX_TOKENS,
    AttentionBackend,
    HeadNorms,
    PackedCausalAttention,
    varlen_available,
)
from areno.models.config import ModelConfig
from areno.models.eager_ops import (
    LogitMap,
    eager_glu,
    eager_rms_norm,
    eager_rms_norm_fp32_scale,
    eager_rms_norm_offset,
    eager_rope,
)
from areno.models.prefix_sharing import SharedPrefixAttention
from areno.models.tp_plan import TPReduce, check_tp_size

__all__ = [
    "FLEX_MIN_HEAD_DIM",
    "MLP",
    "SDPA_MASK_MAX_TOKENS",
    "Attention",
    "AttentionBackend",
    "Decoder",
    "DecoderLayer",
    "DecoderModel",
    "PackedCausalAttention",
    "RMSNorm",
    "RotaryCache",
    "TPReduce",
    "apply_rope",
    "eager_rms_norm",
    "eager_rms_norm_fp32_scale",
    "eager_rope",
    "rope_inv_freq",
    "varlen_available",
]


# ----------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [R/2] inverse frequencies of the ``rotary_dim`` R turned dimensions, with linear / Llama 3 /
    YaRN / LongRoPE scaling, computed as transformers does (LongRoPE: its short factors, ``max_seq_len``)."""
    dim = config.rotary_dim
    base = config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "longrope":
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (short * base**exponents)
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config, device)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = scaling["factor"]
    low_ff, high_ff = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(config: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """YaRN's frequencies (transformers' ``_compute_yarn_parameters``): interpolated by ``factor`` below the
    ``beta_slow`` rotations over the original context, extrapolated (unchanged) above ``beta_fast``, ramped
    linearly between."""
    scaling, dim, base = config.rope_scaling or {}, config.rotary_dim, config.rope_theta
    factor, original = yarn_factor(config), scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_factor(config: ModelConfig) -> float:
    """YaRN's scale: ``factor``, else the context's growth over the original (transformers 5's fallback)."""
    scaling = config.rope_scaling or {}
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return config.max_position_embeddings / scaling["original_max_position_embeddings"]


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1, or YaRN's attention factor (given, or its ``mscale`` rule)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":  # the LongRoPE paper's, over the context's growth
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or config.max_position_embeddings / original
        return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    factor = yarn_factor(config)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


class RotaryCache:
    """cos/sin tables [P, R/2] (R: ``rotary_dim``) for every position < max_position_embeddings, one per
    (device, dtype).

    Tables are computed in float32 (as transformers does) and then cast, so bf16 models see the
    same rounded cos/sin as the reference. Not a buffer: it never enters the state dict.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (torch.device(device), dtype)
        if key not in self._tables:
            inv_freq = rope_inv_freq(self.config, device)
            pos_P = torch.arange(self.config.max_position_embeddings, device=device, dtype=torch.float32)
            freqs = pos_P[:, None] * inv_freq[None, :]
            scale = rope_attention_factor(self.config)  # YaRN's, as transformers applies it to cos and sin
            self._tables[key] = ((freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype))
        return self._tables[key]


def apply_rope(
    x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate-half RoPE (HF convention: first half pairs with second half). cos/sin: [T, R/2]; where R is
    less than Dh (a partial ``rotary_dim``) the first R dimensions turn and the rest pass as they are.
    ``interleaved``: pairs of adjacent dimensions turn (GLM-4), as rotate-half over them laid out evens first."""
    rotary = 2 * cos_TF.shape[-1]
    if interleaved or rotary < x_THD.shape[-1]:
        part = x_THD[..., :rotary]
        if interleaved:  # evens first, then odds: rotate-half's pairs
            part = part.unflatten(-1, (rotary // 2, 2)).transpose(-1, -2)
        turned = apply_rope(part.reshape(*x_THD.shape[:-1], rotary), cos_TF, sin_TF)  # a contiguous copy
        if interleaved:
            turned = turned.unflatten(-1, (2, rotary // 2)).transpose(-1, -2).reshape(turned.shape)
        if rotary == x_THD.shape[-1]:
            return turned
        return torch.cat((turned, x_THD[..., rotary:].to(turned.dtype)), dim=-1)
    if fused_ops.active(x_THD):
        return fused_ops.rope(x_THD, cos_TF, sin_TF)
    if cpu_train_ops.applies(x_THD):
        # in autocast's dtype already: attention takes q and k in it (_in_autocast_dtype)
        out_dtype = _autocast_dtype("cpu") or torch.promote_types(x_THD.dtype, cos_TF.dtype)
        out = cpu_train_ops.rope(x_THD, cos_TF, sin_TF, out_dtype)
        if out is not None:
            return out
    return eager_rope(x_THD, cos_TF, sin_TF)


# ------------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    """RMSNorm computed in float32, output cast back, then scaled (transformers' Llama order); with
    ``scale_in_float32`` scaled in float32 and cast once, to x's dtype (OLMo 2's order)."""

    def __init__(self, dim: int, eps: float, *, scale_in_float32: bool = False, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32
        self.offset = offset
        """Added to the weight (Gemma 3's are offsets from 1); such a norm scales in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.active(x):
            return fused_ops.rms_norm(
                x, self.weight, self.eps, scale_in_float32=self.scale_in_float32, offset=self.offset
            )
        fp32_scale = self.scale_in_float32 or self.offset
        if cpu_train_ops.applies(x) and not (fp32_scale and x.dtype != torch.float32):
            # float32 only: every order agrees there, and (offset + w) * x equals x * (offset + w)
            weight = self.weight + self.offset if self.offset else self.weight
            out = cpu_train_ops.rms_norm(x, weight, self.eps)
            if out is not None:
                return out
        if self.offset:
            return eager_rms_norm_offset(x, self.weight, self.eps, self.offset)
        if self.scale_in_float32:
            return eager_rms_norm_fp32_scale(x, self.weight, self.eps)
        return eager_rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, tp_size: int = 1, tp_reduce: TPReduce | None = None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.head_dim = config.head_dim
        self.tp_reduce = tp_reduce
        d, dh = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * dh, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * dh, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * dh, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=config.attention_out_bias)
        # SmolLM3 leaves every fourth layer unrotated, EXAONE 4 its full-attention layers
        self.use_rope = layer_idx not in config.nope_layers
        # which of a stacked [2, T, F] cos/sin this layer turns by (OLMo 3's window layers: their own RoPE)
        self.rope_slot = int(config.window_rope is not None and config.layer_window(layer_idx) is not None)
        self.windowed = None if config.window_layers is None else config.layer_window(layer_idx) is not None
        """Where only some layers slide (``window_layers``), whether this one does, told to the backend as a bool:
        compiled layers then share two graphs, where reading ``layer_idx`` would specialise one per layer."""
        self.rope_interleaved = config.rope_interleaved
        """GLM-4, Ernie 4.5: adjacent dimensions turn together (``apply_rope(interleaved=True)``)."""
        self.rope_in_float32 = config.rope_in_float32
        """Ernie 4.5: q and k turn in float32 (by float32 tables, ``Decoder.rope_at``), rounded once after."""
        self.scaled_queries = config.query_position_scale is not None
        """Ministral 3: q turns by its own tables, the position's query scale folded in (``Decoder.rope_at``)."""
        # Qwen3 normalises each head (weights [Dh]); OLMo 2 and OLMoE the whole projection, before the head split
        self.qk_norm_heads = config.qk_norm and config.qk_norm_scope == "head"
        self.clip_qkv = config.clip_qkv
        """OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] after the q/k norms (None: not clamped). Only OLMoE
        has it, and its norms over whole projections keep q and k off the fused paths that read the raw product."""
        if config.qk_norm:
            fp32 = config.norms_scale_in_float32  # OLMo 2's norms all scale in float32
            q_width, k_width = (dh, dh) if self.qk_norm_heads else (self.num_heads * dh, self.num_kv_heads * dh)
            offset = config.norm_weight_offset
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps, scale_in_float32=fp32, offset=offset)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps, scale_in_float32=fp32, offset=offset)
        # the backends scale scores by head_dim^-1/2; Gemma by query_pre_attn_scalar^-1/2 and Granite by its
        # attention_multiplier: q takes the ratio, so every backend (training and engine) scales alike
        scalar, multiplier = config.query_pre_attn_scalar, config.attention_multiplier
        self.q_scale = 1.0 if scalar is None else math.sqrt(dh / scalar)
        if multiplier is not None and multiplier != dh**-0.5:
            self.q_scale = multiplier * math.sqrt(dh)
        self.qkv: fused_linear.FusedRows | None = None
        """Set by ``Decoder.fuse_projections``: q/k/v weights as row slices of one tensor."""
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        """gpt-oss: a logit per query head in every softmax's denominator (``attention.explicit_attention``)."""
        self.softcap = config.attn_logit_softcapping
        """Gemma 2: every score capped to ``cap * tanh(s / cap)`` before the softmax, passed to the backend."""

    def forward(
        self, x_TD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        T = x_TD.shape[0]
        qcos_TF, qsin_TF = cos_TF, sin_TF
        if self.scaled_queries:  # k's tables, then q's (``Decoder.rope_at``)
            (cos_TF, qcos_TF), (sin_TF, qsin_TF) = cos_TF.unbind(0), sin_TF.unbind(0)
        elif cos_TF.dim() == 3:  # one RoPE table per layer kind (``Decoder.rope_at``)
            cos_TF, sin_TF = cos_TF[self.rope_slot], sin_TF[self.rope_slot]
            qcos_TF, qsin_TF = cos_TF, sin_TF
        # Head counts come from the weights, so a TP-sharded projection works unchanged.
        qkv_TN = self.qkv(x_TD) if self.qkv is not None and self.qkv.usable() else None  # one GEMM
        if qkv_TN is not None:
            q_TN, k_TN, v_TN = self.qkv.split(qkv_TN)  # column views
        else:
            q_TN, k_TN, v_TN = (
                inference.linear(self.q_proj, x_TD),
                inference.linear(self.k_proj, x_TD),
                inference.linear(self.v_proj, x_TD),
            )
        if hasattr(self, "q_norm") and not self.qk_norm_heads:
            q_TN, k_TN = self.q_norm(q_TN), self.k_norm(k_TN)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q_TN, k_TN, v_TN = q_TN.clamp(-c, c), k_TN.clamp(-c, c), v_TN.clamp(-c, c)
        q_THD = q_TN.view(T, -1, self.head_dim)
        k_THD = k_TN.view(T, -1, self.head_dim)
        v_THD = v_TN.view(T, -1, self.head_dim)
        if self.use_rope:  # a NoPE layer (SmolLM3) attends with q and k as projected
            hq, hk = q_THD.shape[1], k_THD.shape[1]
            out_THD = self._attend_rotary(attn, qkv_TN, hq, hk, cos_TF, sin_TF)
            if out_THD is not None:
                return inference.rowwise(self.o_proj, out_THD.reshape(T, -1), self.tp_reduce)
            if qkv_TN is not None and not hasattr(self, "q_norm") and not self.scaled_queries:
                # q and k are adjacent columns of one product: one RoPE over their heads (one kernel;
                # eager, half the ops of two calls: the same products per element)
                qk_THD = self._turn(
                    qkv_TN[:, : (hq + hk) * self.head_dim].view(T, hq + hk, self.head_dim), cos_TF, sin_TF
                )
                q_THD, k_THD = qk_THD[:, :hq], qk_THD[:, hq:]
            else:
                if self.qk_norm_heads:
                    q_THD = self.q_norm(q_THD)
                    k_THD = self.k_norm(k_THD)
                q_THD = self._turn(q_THD, qcos_TF, qsin_TF)
                k_THD = self._turn(k_THD, cos_TF, sin_TF)
        elif self.qk_norm_heads:  # EXAONE 4's layers without RoPE still norm each head
            q_THD, k_THD = self.q_norm(q_THD), self.k_norm(k_THD)
        if self.q_scale != 1.0:
            q_THD = q_THD * self.q_scale
        out_THD = attn(self.layer_idx, *_in_autocast_dtype(q_THD, k_THD, v_THD), **self.score_terms())
        return inference.rowwise(self.o_proj, out_THD.reshape(T, -1), self.tp_reduce)

    def score_terms(self) -> dict:
        """What this layer's attention scores take beyond q k^T, as the backends' keyword arguments: gpt-oss's
        ``sinks_H``, Gemma 2's ``softcap``, and ``windowed`` where only some layers slide (only those a model has,
        so a backend without them serves the rest)."""
        terms: dict = {}
        if self.windowed is not None:
            terms["windowed"] = self.windowed
        if self.sinks is not None:
            terms["sinks_H"] = self.sinks
        if self.softcap is not None:
            terms["softcap"] = self.softcap
        return terms

    def _turn(self, x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
        """``apply_rope`` in this layer's form: adjacent pairs or halves; Ernie 4.5's in float32, rounded once to
        x's dtype."""
        if self.rope_in_float32:
            return apply_rope(x_THD.float(), cos_TF, sin_TF, interleaved=self.rope_interleaved).to(x_THD.dtype)
        return apply_rope(x_THD, cos_TF, sin_TF, interleaved=self.rope_interleaved)

    def _attend_rotary(
        self,
        attn: AttentionBackend,
        qkv_TN: torch.Tensor | None,
        hq: int,
        hk: int,
        cos_TF: torch.Tensor,
        sin_TF: torch.Tensor,
    ) -> torch.Tensor | None:
        """The rollout engine's backend from the fused q/k/v product before RoPE (and before per-head
        q/k norms): q and k rotated and K/V written to its pools in one kernel. None where it does not
        serve: no such backend or product, autocast, a q scale, or norms over whole projections
        (OLMo 2's, already applied: q and k are no longer the product's columns)."""
        rotary = getattr(attn, "attend_rotary", None)
        if rotary is None or qkv_TN is None or self.q_scale != 1.0 or _autocast_dtype(qkv_TN.device.type) is not None:
            return None
        if self.scaled_queries:  # q's tables differ from k's: the kernel turns both by one
            return None
        if 2 * cos_TF.shape[-1] != self.head_dim or self.rope_interleaved:  # the fused kernels turn whole heads
            return None
        if self.rope_in_float32:  # the kernels turn in the model dtype
            return None
        terms = self.score_terms()
        if not hasattr(self, "q_norm"):
            return rotary(self.layer_idx, qkv_TN, hq, hk, cos_TF, sin_TF, **terms)
        if self.qk_norm_heads:
            return rotary(self.layer_idx, qkv_TN, hq, hk, cos_TF, sin_TF, qk_norm=self.head_norms(), **terms)
        return None

    def head_norms(self) -> HeadNorms:
        """q's and k's per-head norms as ``attend_rotary`` takes them (one eps, offset and order: both
        are built from the same config fields)."""
        q, k = self.q_norm, self.k_norm
        return HeadNorms(q.weight, k.weight, q.eps, q.offset, scale_in_float32=bool(q.scale_in_float32 or q.offset))


def _in_autocast_dtype(*xs_THD: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in autocast's dtype when it is on (fp32 weights trained under bf16 autocast): RoPE's
    fp32 cos/sin promote q and k back to fp32, and the packed attention kernels are not autocast ops,
    so without this a one-GPU run attended in fp32 - flex instead of the flash varlen kernel, and a
    second ``prepare`` (a graph break) inside the first compiled layer. Identity without autocast."""
    dtype = _autocast_dtype(xs_THD[0].device.type)
    if dtype is None:
        return xs_THD
    return tuple(x.to(dtype) for x in xs_THD)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype on ``device_type`` when autocast is on there, else None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class MLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp_size: int = 1,
        tp_reduce: TPReduce | None = None,
        *,
        intermediate_size: int | None = None,
    ) -> None:
        """``intermediate_size``: the width where it is not ``config.intermediate_size`` (Qwen2-MoE's shared expert)."""
        super().__init__()
        d, b = config.hidden_size, config.mlp_bias
        i = (intermediate_size or config.intermediate_size) // tp_size
        self.tp_reduce = tp_reduce
        self.gate_proj = nn.Linear(d, i, bias=b)
        self.up_proj = nn.Linear(d, i, bias=b)
        self.down_proj = nn.Linear(i, d, bias=b)
        self.gate_up: fused_linear.FusedRows | None = None
        """Set by ``Decoder.fuse_projections``: gate/up weights as the two halves of one tensor."""
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        """Gemma 3's GeGLU: the tanh GELU in place of SiLU."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.gate_up.usable():
            gate_up_TN = self.gate_up(x_TD)  # one GEMM: [T, 2I], gate then up
            if fused_ops.active(x_TD):
                act = fused_linear.glu_halves(gate_up_TN, gelu=self.gelu)
            else:
                act = eager_glu(*self.gate_up.split(gate_up_TN), gelu=self.gelu)
        elif fused_ops.active(x_TD):
            gate_TI, up_TI = inference.linear(self.gate_proj, x_TD), inference.linear(self.up_proj, x_TD)
            act = fused_ops.glu(gate_TI, up_TI, gelu=self.gelu)
        else:
            act = eager_glu(
                inference.linear(self.gate_proj, x_TD), inference.linear(self.up_proj, x_TD), gelu=self.gelu
            )
        return inference.rowwise(self.down_proj, act, self.tp_reduce)

    def decode_partials(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        """This MLP's output as fp32 partials [P, T, D] of its down projection (``decode_mlp``, a CUDA
        decode step's few rows), for the residual add + RMSNorm to sum; None where those kernels do
        not serve (the caller then runs ``forward``)."""
        if self.tp_reduce is not None or self.gate_up is None or not decode_mlp.active(x_TD):
            return None
        if not self.gate_up.usable():
            return None
        return decode_mlp.partials(x_TD, self.gate_up, self.down_proj, gelu=self.gelu)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, tp_size: int = 1, tp_reduce: TPReduce | None = None
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, tp_size, tp_reduce)
        if config.is_moe_layer(layer_idx):
            # shared experts as dense MLPs (expert models run whole): Qwen2-MoE's gated one, GLM-4.5's ungated ones
            gated, ungated = (
                config.shared_expert_intermediate_size,
                config.moe_intermediate_size * config.n_shared_experts,
            )
            self.mlp = moe.SparseMoE(
                config,
                layer_idx,
                shared_expert=MLP(config, intermediate_size=gated) if gated else None,
                shared_experts=MLP(config, intermediate_size=ungated) if ungated else None,
            )
        else:
            self.mlp = MLP(config, tp_size, tp_reduce)
        d, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
        self.layout = config.norm_layout
        self.residual_scale = config.residual_multiplier
        """Granite's scale of each block's output before its residual add (1: none)."""
        self.post_norms = self.layout == "post"
        self.sandwich_names = config.sandwich_norm_names
        if self.layout == "sandwich":  # Gemma 3, GLM-4: a norm before and after each block
            for name in self.sandwich_names:
                setattr(self, name, RMSNorm(d, eps, offset=offset))
        elif self.post_norms:  # OLMo 2, EXAONE 4: each block's output normed before its residual add
            fp32 = config.norms_scale_in_float32
            self.post_attention_layernorm = RMSNorm(d, eps, scale_in_float32=fp32)
            self.post_feedforward_layernorm = RMSNorm(d, eps, scale_in_float32=fp32)
        else:
            self.input_layernorm = RMSNorm(d, eps)
            self.post_attention_layernorm = RMSNorm(d, eps)

    def sandwich_norms(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """The sandwich layout's norms: before attention, after it, before the MLP, after it."""
        return tuple(getattr(self, name) for name in self.sandwich_names)  # type: ignore[return-value]

    def forward(
        self, x_TD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        if self.layout == "sandwich":
            attn_in, attn_out, mlp_in, mlp_out = self.sandwich_norms()
            x_TD = x_TD + attn_out(self.self_attn(attn_in(x_TD), cos_TF, sin_TF, attn))
            return x_TD + mlp_out(self.mlp(mlp_in(x_TD)))
        if self.post_norms:
            x_TD = x_TD + self.post_attention_layernorm(self.self_attn(x_TD, cos_TF, sin_TF, attn))
            return x_TD + self.post_feedforward_layernorm(self.mlp(x_TD))
        if self.residual_scale != 1.0:  # Granite: in the model dtype, as transformers scales
            x_TD = x_TD + self.self_attn(self.input_layernorm(x_TD), cos_TF, sin_TF, attn) * self.residual_scale
            return x_TD + self.mlp(self.post_attention_layernorm(x_TD)) * self.residual_scale
        x_TD = x_TD + self.self_attn(self.input_layernorm(x_TD), cos_TF, sin_TF, attn)
        return x_TD + self.mlp(self.post_attention_layernorm(x_TD))


class DecoderModel(nn.Module):
    """The ``model.`` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, tp_size: int = 1, tp_reduce: TPReduce | None = None) -> None:
        super().__init__()
        pad = config.pad_token_id
        # transformers' padding_idx: the pad token's row takes no gradient from the lookup
        padding_idx = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=padding_idx)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp_size, tp_reduce) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size,
            config.rms_norm_eps,
            scale_in_float32=config.norms_scale_in_float32,
            offset=config.norm_weight_offset,
        )


class Decoder(nn.Module):
    """Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral / OLMo 2 / OLMo 3 / Gemma 3 / Phi-3 / SmolLM3 / gpt-oss /
    GLM-4 / Ernie 4.5 / EXAONE 4 / Gemma 2 / Granite 3 / GLM-4.5 / Qwen2-MoE / Granite 3 MoE / OLMoE decoder over packed
    1-D token streams.

    Tensor parallelism without torch.distributed in the model: with ``tp_size > 1`` this module
    holds one rank's shards as laid out by ``tp_plan`` (1/tp of the heads, the MLP columns and,
    untied, the ``lm_head`` vocabulary rows; norms and embedding whole) under the HF names, and
    calls ``tp_reduce`` (the caller's all-reduce over the TP group) after o_proj and down_proj.
    ``logits`` then returns this rank's vocabulary shard when untied. Use ``hf_io.load_model(...,
    tp_rank=, tp_size=)`` to load shards. The reduce is not differentiable: this path is for
    inference; training TP applies DTensor styles from ``tp_plan`` to a ``tp_size=1`` model.
    """

    cuda_attention: str = "auto"
    """What ``PackedCausalAttention``'s ``impl="auto"`` runs on CUDA in this model's forwards:
    ``varlen`` (``auto`` is the same) or ``flex`` (``PackedCausalAttention.prepare``); the training
    backend sets it from ``train.attention``."""
    share_prompts: bool = False
    """Whether training forwards over packed batches compute a run of sequences' common prompt once
    (``models.prefix_sharing``; ``specializations.forward.hidden_states_TD`` reads it); the training
    backend sets it from ``train.share_prompts``."""

    def __init__(self, config: ModelConfig, *, tp_size: int = 1, tp_reduce: TPReduce | None = None) -> None:
        super().__init__()
        if tp_size > 1:
            check_tp_size(config, tp_size)
            if tp_reduce is None:
                raise ValueError(f"Decoder with tp_size={tp_size} needs tp_reduce (an all-reduce over the TP group)")
        self.config = config
        self.tp_size = tp_size
        self.model = DecoderModel(config, tp_size, tp_reduce if tp_size > 1 else None)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // tp_size, bias=False)
        self.rope = RotaryCache(config)
        window_rope = config.window_rope_config()
        self.window_rope = RotaryCache(window_rope) if window_rope is not None else None
        """The window layers' RoPE tables where theirs differs (OLMo 3); the layers pick theirs by
        ``Attention.rope_slot`` from cos/sin stacked [2, T, F]."""
        self.logit_map = LogitMap.of(config)
        """What the model does to its head's product (Granite's divisor, Gemma 2's cap), or None."""
        self._cpu_packs = inference.CpuGemmPacks()
        """Filled by ``pack_cpu_gemms``: the oneDNN-packed weight copies (inference on CPU)."""
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """transformers' init: normal(0, initializer_range) for linear/embedding weights, zero
        biases, ones for norms, and a zero row for the pad token embedding."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0 - module.offset)  # a scale of 1 (Gemma 3's weights: offsets from 1)
            elif isinstance(module, moe.SparseMoE):
                module.reset_parameters(std)
            elif isinstance(module, Attention) and module.sinks is not None:
                module.sinks.normal_(0.0, std)  # transformers' init of GptOssAttention.sinks
        pad = self.config.pad_token_id
        if pad is not None and 0 <= pad < self.config.vocab_size:
            self.model.embed_tokens.weight[pad].zero_()

    def float32_modules(self) -> list[nn.Module]:
        """Modules whose parameters stay float32 under mixed precision (FSDP2 gives each a float32 group of its
        own): GLM-4.5's routers (``moe.float32_routers``), as transformers keeps them."""
        return moe.float32_routers(self)

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, D] output projection (the embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    # inference-only rewrites (the rollout engine applies them; ``inference.py`` says how)
    def fuse_projections(self) -> None:
        """Run each layer's q/k/v and gate/up as one GEMM each in no-grad forwards
        (``inference.fuse_projections``); idempotent."""
        inference.fuse_projections(self.model.layers)

    def unfuse_projections(self) -> None:
        """Undo ``fuse_projections`` (``inference.unfuse_projections``)."""
        inference.unfuse_projections(self.model.layers)

    @property
    def projections_fused(self) -> bool:
        """Whether every layer's q/k/v and gate/up run as one GEMM each in no-grad forwards."""
        return inference.projections_fused(self.model.layers)

    def pack_cpu_gemms(self, batch_hint: int = 32) -> int:
        """oneDNN-packed copies of the large fp32 CPU weights for no-grad forwards
        (``inference.CpuGemmPacks.pack``); returns the number of weights packed."""
        return self._cpu_packs.pack(self, batch_hint)

    def unpack_cpu_gemms(self) -> None:
        """Drop the packed copies of ``pack_cpu_gemms`` (forwards use ``F.linear`` again)."""
        self._cpu_packs.unpack()

    @property
    def cpu_packed_bytes(self) -> int:
        """Memory the packed copies of ``pack_cpu_gemms`` take (once packed: at first use)."""
        return self._cpu_packs.nbytes

    def invalidate_cpu_gemms(self) -> None:
        """Make every packed copy re-pack at its next use (the weights changed)."""
        self._cpu_packs.invalidate()

    def prepare_attention(self, attn: PackedCausalAttention | SharedPrefixAttention, x_TD: torch.Tensor) -> None:
        """Prepare ``attn`` for the layers with the head dim, heads and q dtype they will pass, so that no
        layer prepares again (inside a compiled region that would be a graph break)."""
        q_dtype = _autocast_dtype(x_TD.device.type) or x_TD.dtype
        attn.prepare(
            x_TD.shape[0],
            x_TD.device,
            self.config.head_dim,
            q_dtype,
            cuda_impl=self.cuda_attention,
            query_heads=self.config.num_attention_heads,
        )

    def forward(
        self,
        input_ids_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        attn: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, D]. ``attn=None`` treats the input as one sequence."""
        if attn is None:
            cu_seqlens_B1 = torch.tensor([0, input_ids_T.numel()], dtype=torch.long)
            attn = PackedCausalAttention.for_model(cu_seqlens_B1, self.config)
        x_TD = self.model.embed_tokens(input_ids_T)
        if self.config.scale_embeddings:  # Gemma 3: by sqrt(hidden_size) rounded to the embeddings' dtype
            scale = torch.tensor(math.sqrt(self.config.hidden_size), dtype=self.model.embed_tokens.weight.dtype)
            x_TD = x_TD * scale.item()
        if self.config.embedding_multiplier != 1.0:  # Granite: by its multiplier, in the embeddings' dtype
            x_TD = x_TD * self.config.embedding_multiplier
        if isinstance(attn, (PackedCausalAttention, SharedPrefixAttention)):
            self.prepare_attention(attn, x_TD)
        cos_TF, sin_TF = self.rope_at(position_ids_T, x_TD.device, x_TD.dtype)
        # the fused add + norm kernels join each residual add with the norms on either side of it
        if fused_ops.add_norm_active(x_TD):
            return inference.forward_add_norm(self.model.layers, self.model.norm, x_TD, cos_TF, sin_TF, attn)
        return self.forward_layers(x_TD, cos_TF, sin_TF, attn)

    def rope_at(
        self, position_ids_T: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, R/2] at ``position_ids_T``; [2, T, R/2] (the full layers', the window
        layers') where the window layers turn otherwise (``Attention.rope_slot`` picks), or (k's, q's) where
        queries are scaled by position (Ministral 3: a scale times a rotation is the scaled rotation)."""
        if self.config.rope_in_float32:  # Ernie 4.5 keeps its tables in float32 (``Attention._turn``)
            dtype = torch.float32
        cos_PF, sin_PF = self.rope.get(device, dtype)
        cos_TF, sin_TF = cos_PF[position_ids_T], sin_PF[position_ids_T]
        if self.config.query_position_scale is not None:  # Ministral 3: q's tables times its position's scale
            beta, period = self.config.query_position_scale
            steps_T = torch.div(position_ids_T, period, rounding_mode="floor").to(torch.float32)
            scale_T1 = (1.0 + beta * torch.log1p(steps_T))[:, None]
            qcos_TF, qsin_TF = (cos_TF * scale_T1).to(cos_TF.dtype), (sin_TF * scale_T1).to(sin_TF.dtype)
            return torch.stack((cos_TF, qcos_TF)), torch.stack((sin_TF, qsin_TF))
        if self.window_rope is None:
            return cos_TF, sin_TF
        wcos_PF, wsin_PF = self.window_rope.get(device, dtype)
        return torch.stack((cos_TF, wcos_PF[position_ids_T])), torch.stack((sin_TF, wsin_PF[position_ids_T]))

    def forward_layers(
        self, x_TD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The decoder layers and the final norm over embedded tokens: the part of ``forward``
        that ``areno.train.parallelize.apply_compile(scope="model")`` compiles as one graph."""
        for layer in self.model.layers:
            x_TD = layer(x_TD, cos_TF, sin_TF, attn)
        return self.model.norm(x_TD)

    def logits(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """[T, V] logits in the model dtype, or mapped in float32 where the model maps them (``LogitMap``:
        Granite's ``logits_scaling``, Gemma 2's ``final_logit_softcapping``); use ``logprobs.py`` for chunked
        fp32 log-probs."""
        logits_TV = cpu_gemm.linear(hidden_TD, self.output_weight, None, self.__dict__.get("cpu_pack"))
        return logits_TV if self.logit_map is None else self.logit_map(logits_TV)
