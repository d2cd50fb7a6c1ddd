"""The one Llama-family decoder used by training and rollout (plain PyTorch, no torch.distributed).

Module names equal the Hugging Face names (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
``model.norm``, ``lm_head`` …), so ``Decoder.state_dict()`` *is* the HF state dict; the tied output
projection has no ``lm_head`` module.

Inputs are packed and 1-D: ``input_ids_T`` holds all sequences concatenated and ``position_ids_T``
restarts at 0 for each. Attention is delegated to an ``AttentionBackend`` called in every layer as
``attn(layer_idx, q_THD, k_THD, v_THD)`` after RoPE (and Qwen3 q/k norms); ``PackedCausalAttention``
is the training/scoring backend, the rollout engine supplies a paged-KV one.

Legend: T = packed tokens, D = hidden size, H = heads (Hq query, Hkv key/value), Dh = head dim,
V = vocabulary, B = sequences, P = positions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from areno.models import cpu_gemm, fused_linear, fused_ops
from areno.models.config import ModelConfig
from areno.models.tp_plan import check_tp_size
from areno.types import repeat_per_sequence, sequence_index_T


class AttentionBackend(Protocol):
    """Computes attention for one layer of a packed batch.

    ``q_THD``: [T, Hq, Dh]; ``k_THD``, ``v_THD``: [T, Hkv, Dh] (after RoPE). Returns [T, Hq, Dh].
    The backend handles GQA (Hq a multiple of Hkv) and uses the scale 1/sqrt(Dh).
    """

    def __call__(
        self, layer_idx: int, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor
    ) -> torch.Tensor: ...


# ----------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [Dh/2] inverse frequencies, with linear / Llama 3 scaling, computed as transformers does."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
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


class RotaryCache:
    """cos/sin tables [P, Dh/2] for every position < max_position_embeddings, one per (device, dtype).

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
            self._tables[key] = (freqs.cos().to(dtype), freqs.sin().to(dtype))
        return self._tables[key]


def apply_rope(x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF convention: first half pairs with second half). cos/sin: [T, Dh/2]."""
    if fused_ops.active(x_THD):
        return fused_ops.rope(x_THD, cos_TF, sin_TF)
    return eager_rope(x_THD, cos_TF, sin_TF)


def eager_rope(x_THD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in eager ops (the reference the fused kernel is checked against)."""
    half = x_THD.shape[-1] // 2
    x1, x2 = x_THD[..., :half], x_THD[..., half:]
    cos, sin = cos_TF[:, None, :], sin_TF[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ------------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    """RMSNorm computed in float32, output cast back, then scaled (transformers' order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.active(x):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return eager_rms_norm(x, self.weight, self.eps)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` in eager ops (the reference the fused kernel is checked against)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


TPReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the tensor-parallel group and returns the sum (e.g. an all-reduce)."""


def _linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``, through its oneDNN-packed copy where one applies (``Decoder.pack_cpu_gemms``)."""
    pack = linear.__dict__.get("cpu_pack")
    if pack is not None and pack.applies(x):
        return pack(x, linear.bias)
    return linear(x)


def _rowwise(linear: nn.Linear, x: torch.Tensor, tp_reduce: TPReduce | None) -> torch.Tensor:
    """A row-parallel projection: partial product, reduce over TP ranks, then the bias once."""
    if tp_reduce is None:
        return _linear(linear, x)
    y = tp_reduce(cpu_gemm.linear(x, linear.weight, None, linear.__dict__.get("cpu_pack")))
    return y + linear.bias if linear.bias is not None else y


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
        if config.qk_norm:
            self.q_norm = RMSNorm(dh, config.rms_norm_eps)
            self.k_norm = RMSNorm(dh, config.rms_norm_eps)
        self.qkv: fused_linear.FusedRows | None = None
        """Set by ``Decoder.fuse_projections``: q/k/v weights as row slices of one tensor."""

    def forward(
        self, x_TD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        T = x_TD.shape[0]
        # Head counts come from the weights, so a TP-sharded projection works unchanged.
        qkv_TN = self.qkv(x_TD) if self.qkv is not None and self.qkv.usable() else None  # one GEMM
        if qkv_TN is not None:
            q_TN, k_TN, v_TN = self.qkv.split(qkv_TN)  # column views
        else:
            q_TN, k_TN, v_TN = _linear(self.q_proj, x_TD), _linear(self.k_proj, x_TD), _linear(self.v_proj, x_TD)
        q_THD = q_TN.view(T, -1, self.head_dim)
        k_THD = k_TN.view(T, -1, self.head_dim)
        v_THD = v_TN.view(T, -1, self.head_dim)
        if qkv_TN is not None and not hasattr(self, "q_norm"):
            # q and k are adjacent columns of one product: one RoPE over their heads (one kernel;
            # eager, half the ops of two calls: the same products per element)
            hq, hk = q_THD.shape[1], k_THD.shape[1]
            qk_THD = apply_rope(qkv_TN[:, : (hq + hk) * self.head_dim].view(T, hq + hk, self.head_dim), cos_TF, sin_TF)
            q_THD, k_THD = qk_THD[:, :hq], qk_THD[:, hq:]
        else:
            if hasattr(self, "q_norm"):
                q_THD = self.q_norm(q_THD)
                k_THD = self.k_norm(k_THD)
            q_THD = apply_rope(q_THD, cos_TF, sin_TF)
            k_THD = apply_rope(k_THD, cos_TF, sin_TF)
        out_THD = attn(self.layer_idx, *_in_autocast_dtype(q_THD, k_THD, v_THD))
        return _rowwise(self.o_proj, out_THD.reshape(T, -1), self.tp_reduce)


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
    def __init__(self, config: ModelConfig, tp_size: int = 1, tp_reduce: TPReduce | None = None) -> None:
        super().__init__()
        d, i, b = config.hidden_size, config.intermediate_size // tp_size, config.mlp_bias
        self.tp_reduce = tp_reduce
        self.gate_proj = nn.Linear(d, i, bias=b)
        self.up_proj = nn.Linear(d, i, bias=b)
        self.down_proj = nn.Linear(i, d, bias=b)
        self.gate_up: fused_linear.FusedRows | None = None
        """Set by ``Decoder.fuse_projections``: gate/up weights as the two halves of one tensor."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.gate_up.usable():
            gate_up_TN = self.gate_up(x_TD)  # one GEMM: [T, 2I], gate then up
            if fused_ops.active(x_TD):
                act = fused_linear.silu_mul_halves(gate_up_TN)
            else:
                gate_TI, up_TI = self.gate_up.split(gate_up_TN)
                act = F.silu(gate_TI) * up_TI
        elif fused_ops.active(x_TD):
            act = fused_ops.silu_mul(_linear(self.gate_proj, x_TD), _linear(self.up_proj, x_TD))
        else:
            act = F.silu(_linear(self.gate_proj, x_TD)) * _linear(self.up_proj, x_TD)
        return _rowwise(self.down_proj, act, self.tp_reduce)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, tp_size: int = 1, tp_reduce: TPReduce | None = None
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, tp_size, tp_reduce)
        self.mlp = MLP(config, tp_size, tp_reduce)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x_TD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x_TD = x_TD + self.self_attn(self.input_layernorm(x_TD), cos_TF, sin_TF, attn)
        return x_TD + self.mlp(self.post_attention_layernorm(x_TD))


class DecoderModel(nn.Module):
    """The ``model.`` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, tp_size: int = 1, tp_reduce: TPReduce | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp_size, tp_reduce) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    """Llama / Qwen2 / Qwen3 / Mistral decoder over packed 1-D token streams.

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
        self._cpu_packs: list[cpu_gemm.PackedWeight] = []
        """Set by ``pack_cpu_gemms``: the oneDNN-packed weight copies (inference on CPU)."""
        self._cpu_pack_holders: list[object] = []
        """The modules and fused groups ``pack_cpu_gemms`` gave a ``cpu_pack`` attribute."""
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
                module.weight.fill_(1.0)
        pad = self.config.pad_token_id
        if pad is not None and 0 <= pad < self.config.vocab_size:
            self.model.embed_tokens.weight[pad].zero_()

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, D] output projection (the embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Inference only (the rollout engine): per layer, stack the q/k/v projections' weights (and
        biases) into one [Dq + 2 Dkv, D] tensor and gate/up into one [2I, D] tensor, and make each
        projection's ``weight`` / ``bias`` a row slice of it (``fused_linear.FusedRows``), so no-grad
        forwards run one GEMM for each group instead of three and two. Names, ``state_dict()`` and
        the parameter objects are unchanged, and in-place writes to them (``update_weights``, policy
        sync, ``load_state_dict``) land in the fused tensors. Call it after the weights have their
        final device, dtype and (TP) shard; idempotent. Forwards with gradients enabled keep the
        per-projection GEMMs (gradients reach the parameters as before); a module never fused
        behaves exactly as before. On CUDA the replaced per-projection storages go back to
        PyTorch's cache (still used memory to ``torch.cuda.mem_get_info`` until reused)."""
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            if a.qkv is None or not a.qkv.intact():
                a.qkv = fused_linear.FusedRows([a.q_proj, a.k_proj, a.v_proj])
            if m.gate_up is None or not m.gate_up.intact():
                m.gate_up = fused_linear.FusedRows([m.gate_proj, m.up_proj])

    @torch.no_grad()
    def unfuse_projections(self) -> None:
        """Undo ``fuse_projections``: every projection gets its own storage again (a copy of its
        current values) and forwards run one GEMM per projection; a no-op on a model never fused."""
        for layer in self.model.layers:
            for owner, attr in ((layer.self_attn, "qkv"), (layer.mlp, "gate_up")):
                group = getattr(owner, attr)
                if group is None:
                    continue
                for lin in group.members:
                    lin.weight.data = lin.weight.detach().clone()
                    if lin.bias is not None:
                        lin.bias.data = lin.bias.detach().clone()
                setattr(owner, attr, None)

    @torch.no_grad()
    def pack_cpu_gemms(self, batch_hint: int = 32) -> int:
        """Inference only (the rollout engine on CPU): give every fp32 CPU weight of at least
        ``cpu_gemm.MIN_ELEMENTS`` elements a oneDNN-packed copy that no-grad forwards multiply with
        (``cpu_gemm.PackedWeight``: the fused q/k/v and gate/up groups or their projections, o_proj,
        down_proj, the output projection); values equal ``F.linear``'s up to fp32 summation order. A
        copy re-packs itself when its parameters are written in place or get new storage; call
        ``invalidate_cpu_gemms()`` after writes through ``.data``. Call it after ``fuse_projections``
        (a group fused later has no copy). Costs one more copy of the packed weights' memory. Returns
        the number of weights packed (0 where oneDNN is unavailable or off CPU)."""
        self.unpack_cpu_gemms()
        packs, holders = [], []

        def attach(owner: object, weight: tuple[object, str], watch: list[tuple[object, str]] = ()) -> None:
            pack = cpu_gemm.pack(weight, watch, batch_hint)
            if pack is not None:
                owner.__dict__["cpu_pack"] = pack
                packs.append(pack)
                holders.append(owner)

        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            for rows, lins in ((a.qkv, (a.q_proj, a.k_proj, a.v_proj)), (m.gate_up, (m.gate_proj, m.up_proj))):
                if rows is not None and rows.intact():  # one copy for the group's one GEMM
                    attach(rows, (rows, "weight"), [(lin, "weight") for lin in lins])
                else:
                    for lin in lins:
                        attach(lin, (lin, "weight"))
            for lin in (a.o_proj, m.down_proj):
                attach(lin, (lin, "weight"))
        attach(self, (self, "output_weight"))
        self._cpu_packs, self._cpu_pack_holders = packs, holders
        return len(packs)

    def unpack_cpu_gemms(self) -> None:
        """Drop the packed copies of ``pack_cpu_gemms`` (forwards use ``F.linear`` again)."""
        for owner in self._cpu_pack_holders:
            owner.__dict__.pop("cpu_pack", None)
        self._cpu_packs, self._cpu_pack_holders = [], []

    @property
    def cpu_packed_bytes(self) -> int:
        """Memory the packed copies of ``pack_cpu_gemms`` take (once packed: at first use)."""
        return sum(p.weight().numel() * p.weight().element_size() for p in self._cpu_packs)

    def invalidate_cpu_gemms(self) -> None:
        """Make every packed copy re-pack at its next use (the weights changed)."""
        for pack in self._cpu_packs:
            pack.invalidate()

    @property
    def projections_fused(self) -> bool:
        """Whether every layer's q/k/v and gate/up run as one GEMM each in no-grad forwards."""
        return all(
            layer.self_attn.qkv is not None
            and layer.self_attn.qkv.intact()
            and layer.mlp.gate_up is not None
            and layer.mlp.gate_up.intact()
            for layer in self.model.layers
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
            attn = PackedCausalAttention(cu_seqlens_B1, sliding_window=self.config.sliding_window)
        x_TD = self.model.embed_tokens(input_ids_T)
        if isinstance(attn, PackedCausalAttention):
            # with the head dim and q's dtype the layers will pass, so no layer prepares again
            # (inside a compiled region that would be a graph break)
            q_dtype = _autocast_dtype(x_TD.device.type) or x_TD.dtype
            attn.prepare(
                input_ids_T.shape[0], input_ids_T.device, self.config.head_dim, q_dtype, cuda_impl=self.cuda_attention
            )
        cos_PF, sin_PF = self.rope.get(x_TD.device, x_TD.dtype)
        cos_TF, sin_TF = cos_PF[position_ids_T], sin_PF[position_ids_T]
        if fused_ops.add_norm_active(x_TD):
            return self._forward_add_norm(x_TD, cos_TF, sin_TF, attn)
        return self.forward_layers(x_TD, cos_TF, sin_TF, attn)

    def forward_layers(
        self, x_TD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The decoder layers and the final norm over embedded tokens: the part of ``forward``
        that ``areno.train.parallelize.apply_compile(scope="model")`` compiles as one graph."""
        for layer in self.model.layers:
            x_TD = layer(x_TD, cos_TF, sin_TF, attn)
        return self.model.norm(x_TD)

    def _forward_add_norm(
        self, x_TD: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The layers of ``forward`` with each residual add and the RMSNorm after it as one op
        (``fused_ops.add_rms_norm``): the post-attention norm, the next layer's input norm, and the
        final norm after the last layer. Same values as the layer-by-layer loop."""
        layers = self.model.layers
        h_TD = layers[0].input_layernorm(x_TD)
        for i, layer in enumerate(layers):
            post = layer.post_attention_layernorm
            x_TD, h_TD = fused_ops.add_rms_norm(
                x_TD, layer.self_attn(h_TD, cos_TF, sin_TF, attn), post.weight, post.eps
            )
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x_TD, h_TD = fused_ops.add_rms_norm(x_TD, layer.mlp(h_TD), nxt.weight, nxt.eps)
        return h_TD

    def logits(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """[T, V] logits in the model dtype (use ``logprobs.py`` for chunked fp32 log-probs)."""
        return cpu_gemm.linear(hidden_TD, self.output_weight, None, self.__dict__.get("cpu_pack"))


# ------------------------------------------------------------------------------ packed sequences
# ------------------------------------------------------------------------------ packed attention
SDPA_MASK_MAX_TOKENS = 2048
FLEX_MIN_HEAD_DIM = 16
"""FlexAttention's compiled kernels need head dims of at least this (``auto`` picks sdpa below)."""


class PackedCausalAttention:
    """Causal attention inside each packed sequence (no attention across sequence boundaries).

    ``cu_seqlens_B1``: int [B+1] boundaries. ``sliding_window``: Mistral's window (a query sees
    itself and the previous ``sliding_window - 1`` tokens), or None. ``impl``:
    - ``"sdpa"``: SDPA per sequence with ``is_causal`` (the CPU default: no work across sequences).
    - ``"sdpa_mask"``: one SDPA call with a block-diagonal causal boolean mask [T, T].
    - ``"flex"``: FlexAttention with a document block mask, compiled (the CUDA default).
    - ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (flash, CUDA bf16/fp16 only; torch
      versions whose varlen lacks GQA get k/v repeated, and lack sliding windows fall back to flex).
    - ``"sdpa_padded"``: scatter the sequences into a right-padded [B, H, S_max, Dh] batch and run
      one causal SDPA call (padding sits after every real token, so causality hides it); costs
      B * S_max^2 instead of T^2, the fast path for many short sequences on CPU.
    - ``"auto"``: on CUDA the model's choice (``prepare``'s ``cuda_impl``: varlen, or flex), varlen
      falling back to flex (or sdpa below ``FLEX_MIN_HEAD_DIM``) where flash does not run (fp32
      inputs, head dims that are not a multiple of 8 or exceed 256, a torch without a varlen
      kernel); elsewhere sdpa_padded when padding wastes at most half the tokens, else sdpa_mask up
      to ``SDPA_MASK_MAX_TOKENS`` tokens, else per-sequence sdpa.
    ``prepare`` builds the mask (or boundaries) once; ``Decoder.forward`` calls it before the
    layers, so compiled layers only read it (no host sync or mask construction inside them).
    """

    IMPLS = ("auto", "sdpa", "sdpa_mask", "sdpa_padded", "flex", "varlen")

    def __init__(self, cu_seqlens_B1: torch.Tensor, *, sliding_window: int | None = None, impl: str = "auto") -> None:
        if impl not in self.IMPLS:
            raise ValueError(f"PackedCausalAttention impl must be one of {self.IMPLS}, got {impl!r}")
        self.cu_seqlens_B1 = cu_seqlens_B1
        self.sliding_window = sliding_window
        self.impl = impl
        self._prepared_for: tuple | None = None
        self._cuda_impl = "auto"
        self._impl = impl
        self._state = None

    def prepare(
        self,
        num_tokens: int,
        device: torch.device,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        cuda_impl: str | None = None,
    ) -> None:
        """Resolve ``auto`` and build what every layer reuses: sequence bounds (sdpa), the mask
        (sdpa_mask, flex) or int32 boundaries and the longest length (varlen). ``head_dim``: when
        known, ``auto`` on CUDA avoids flex below ``FLEX_MIN_HEAD_DIM`` (its kernels need 16).
        ``dtype`` (of q): when known, ``auto`` on CUDA avoids varlen for fp32 (flash is 16-bit); it
        also does for head dims flash lacks (not a multiple of 8, or above 256). ``cuda_impl``: what
        ``auto`` runs on CUDA (``Decoder.cuda_attention``), kept for later calls; default auto."""
        device = torch.device(device)
        if cuda_impl is not None:
            self._cuda_impl = cuda_impl
        small_heads = head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
        flash_ok = (dtype is None or dtype in (torch.bfloat16, torch.float16)) and (
            head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)
        )
        if self._prepared_for == (num_tokens, device, small_heads, flash_ok, self._cuda_impl):
            return
        impl = self.impl
        if impl == "auto":
            # CPU: many short sequences cost one SDPA call each, so below a few thousand tokens
            # one masked call per layer is cheaper (the T x T mask stays small).
            seqlens_B = self.cu_seqlens_B1[1:] - self.cu_seqlens_B1[:-1]
            padded_tokens = int(seqlens_B.max()) * seqlens_B.numel() if num_tokens else 0
            if device.type == "cuda":
                impl = "varlen" if self._cuda_impl == "auto" else self._cuda_impl
                if impl == "varlen" and not (flash_ok and varlen_available()):
                    impl = "flex"
                if impl == "flex" and small_heads:
                    impl = "sdpa"  # tiny test models: flex's kernels need a head dim of at least 16
            elif self.sliding_window is None and padded_tokens <= 2 * num_tokens:
                impl = "sdpa_padded"
            else:
                impl = "sdpa_mask" if num_tokens <= SDPA_MASK_MAX_TOKENS else "sdpa"
        if impl == "varlen" and self.sliding_window is not None and "window_size" not in _varlen_params():
            impl = "flex"
        covered = int(self.cu_seqlens_B1[-1])
        if covered != num_tokens:
            raise ValueError(f"cu_seqlens_B1 covers {covered} tokens but the batch has {num_tokens}")
        if impl == "sdpa":
            self._state = self.cu_seqlens_B1.tolist()
        elif impl == "sdpa_mask":
            self._state = self._sdpa_mask(num_tokens, device)
        elif impl == "sdpa_padded":
            if self.sliding_window is not None:
                raise ValueError("impl='sdpa_padded' has no sliding window; use 'sdpa' or 'sdpa_mask'")
            cu = self.cu_seqlens_B1.to(device)
            seqlens_B = cu[1:] - cu[:-1]
            max_len = int(seqlens_B.max()) if num_tokens else 0
            pos_T = torch.arange(num_tokens, device=device) - repeat_per_sequence(cu[:-1], self.cu_seqlens_B1)
            seq_T = sequence_index_T(self.cu_seqlens_B1, device)
            self._state = (seq_T * max_len + pos_T, seqlens_B.numel(), max_len)  # flat padded index
        elif impl == "flex":
            self._state = self._flex_mask(num_tokens, device)
        else:
            cu = self.cu_seqlens_B1.to(device=device, dtype=torch.int32)
            max_len = int((self.cu_seqlens_B1[1:] - self.cu_seqlens_B1[:-1]).max()) if num_tokens else 0
            # this torch's varlen_attn keywords, read here (eagerly) so compiled layers do not trace
            # inspect.signature
            params = _varlen_params()
            self._state = (cu, max_len, "enable_gqa" in params, "window_size" in params)
        self._impl = impl
        self._prepared_for = (num_tokens, device, small_heads, flash_ok, self._cuda_impl)

    def _doc_ids_T(self, device: torch.device) -> torch.Tensor:
        return sequence_index_T(self.cu_seqlens_B1, device)

    def _sdpa_mask(self, T: int, device: torch.device) -> torch.Tensor:
        doc_T = self._doc_ids_T(device)
        idx_T = torch.arange(T, device=device)
        mask_TT = (doc_T[:, None] == doc_T[None, :]) & (idx_T[None, :] <= idx_T[:, None])
        if self.sliding_window is not None:
            mask_TT &= (idx_T[:, None] - idx_T[None, :]) < self.sliding_window
        return mask_TT

    def _flex_mask(self, T: int, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        doc_T = self._doc_ids_T(device)
        window = self.sliding_window

        def mask_mod(b, h, q_idx, kv_idx):
            keep = (doc_T[q_idx] == doc_T[kv_idx]) & (kv_idx <= q_idx)
            if window is not None:
                keep = keep & (q_idx - kv_idx < window)
            return keep

        # Compiled mask construction never materialises a [T, T] mask on the GPU.
        return create_block_mask(mask_mod, None, None, T, T, device=device, _compile=device.type == "cuda")

    def _sdpa_per_sequence(self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor) -> torch.Tensor:
        bounds = self._state
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e == s:
                continue
            q, k, v = (x[s:e].transpose(0, 1) for x in (q_THD, k_THD, v_THD))  # [H, n, Dh]
            if self.sliding_window is not None and e - s > self.sliding_window:
                idx = torch.arange(e - s, device=q.device)
                diff = idx[:, None] - idx[None, :]
                mask = (diff >= 0) & (diff < self.sliding_window)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            outs.append(out.transpose(0, 1))
        if not outs:
            return torch.empty_like(q_THD)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _sdpa_padded(self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor) -> torch.Tensor:
        flat_T, num_seqs, max_len = self._state

        def pad(x_THD: torch.Tensor) -> torch.Tensor:  # [T, H, Dh] -> [B, H, S, Dh]
            out = x_THD.new_zeros(num_seqs * max_len, *x_THD.shape[1:])
            out = out.index_copy(0, flat_T, x_THD)
            return out.view(num_seqs, max_len, *x_THD.shape[1:]).transpose(1, 2)

        out_BHSD = F.scaled_dot_product_attention(pad(q_THD), pad(k_THD), pad(v_THD), is_causal=True, enable_gqa=True)
        out_flat = out_BHSD.transpose(1, 2).reshape(num_seqs * max_len, *q_THD.shape[1:])
        return out_flat.index_select(0, flat_T)

    def _varlen(self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        cu, max_len, has_gqa, has_window = self._state
        groups = q_THD.shape[1] // k_THD.shape[1]
        if groups > 1 and not has_gqa:  # torch 2.11: no GQA inside the kernel
            k_THD = k_THD.repeat_interleave(groups, dim=1)
            v_THD = v_THD.repeat_interleave(groups, dim=1)
        gqa = {"enable_gqa": True} if groups > 1 and has_gqa else {}
        if has_window:  # newer torch: causal (sliding) window as (left, right)
            left = -1 if self.sliding_window is None else self.sliding_window - 1
            return varlen_attn(q_THD, k_THD, v_THD, cu, cu, max_len, max_len, window_size=(left, 0), **gqa)
        return varlen_attn(q_THD, k_THD, v_THD, cu, cu, max_len, max_len, is_causal=True, **gqa)

    def __call__(self, layer_idx: int, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor) -> torch.Tensor:
        self.prepare(q_THD.shape[0], q_THD.device, q_THD.shape[-1], q_THD.dtype)
        impl = self._impl
        if impl == "sdpa":
            return self._sdpa_per_sequence(q_THD, k_THD, v_THD)
        if impl == "varlen":
            return self._varlen(q_THD, k_THD, v_THD)
        if impl == "sdpa_padded":
            return self._sdpa_padded(q_THD, k_THD, v_THD)
        q = q_THD.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, Dh]
        k = k_THD.transpose(0, 1).unsqueeze(0)
        v = v_THD.transpose(0, 1).unsqueeze(0)
        if impl == "flex":
            out = _compiled_flex_attention()(q, k, v, block_mask=self._state, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._state, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


_FLEX = None


@functools.lru_cache(maxsize=1)
def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn``."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _varlen_params() -> frozenset[str]:
    """Parameter names of this torch's varlen_attn (its signature changed between releases)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _compiled_flex_attention():
    """flex_attention compiled once per process (eager flex materialises the full score matrix)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=None)
    return _FLEX
