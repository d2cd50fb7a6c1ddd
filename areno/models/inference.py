"""Inference-only rewrites of a decoder (the rollout engine applies them; training never does).

- Fused projections: per layer, q/k/v and gate/up as one GEMM each (``fuse_projections``,
  ``fused_linear.FusedRows``): names, ``state_dict()`` and the parameter objects are unchanged. A sparse
  layer's dense MLPs (Qwen2-MoE's shared expert: ``dense_mlps``) take gate/up as a dense layer's MLP does.
- Packed CPU GEMMs: a oneDNN-packed copy beside each large fp32 CPU weight (``CpuGemmPacks``,
  ``cpu_gemm.PackedWeight``), read by no-grad forwards through ``linear`` and ``rowwise``.
- Fused residual add + RMSNorm between the blocks of every layer (``forward_add_norm``), where the
  fused kernels are on (``fused_ops.add_norm_active``).

The functions take the decoder's parts (its ``model.layers``, its final norm) rather than the
``Decoder``, so the model imports this module and not the other way round.

Legend: T = tokens, D = hidden size, F = head dim / 2.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from areno.models import cpu_gemm, fused_linear, fused_ops, moe
from areno.models.attention import AttentionBackend
from areno.models.tp_plan import TPReduce


def linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)``, through its oneDNN-packed copy where one applies (``CpuGemmPacks.pack``)."""
    pack = lin.__dict__.get("cpu_pack")
    if pack is not None and pack.applies(x):
        return pack(x, lin.bias)
    return lin(x)


def rowwise(lin: nn.Linear, x: torch.Tensor, tp_reduce: TPReduce | None) -> torch.Tensor:
    """A row-parallel projection: partial product, reduce over TP ranks, then the bias once."""
    if tp_reduce is None:
        return linear(lin, x)
    y = tp_reduce(cpu_gemm.linear(x, lin.weight, None, lin.__dict__.get("cpu_pack")))
    return y + lin.bias if lin.bias is not None else y


# ------------------------------------------------------------------------------ fused projections
def dense_mlps(layer: nn.Module) -> list[nn.Module]:
    """The dense (gate/up/down) MLPs of a decoder layer: its MLP, or a sparse block's shared experts (whose
    routed experts are fused tensors already)."""
    m = layer.mlp
    if not isinstance(m, moe.SparseMoE):
        return [m]
    return [x for x in (m.shared_expert, m.shared_experts) if x is not None]


@torch.no_grad()
def fuse_projections(layers: nn.ModuleList) -> None:
    """Per layer, stack the q/k/v projections' weights (and biases) into one [Dq + 2 Dkv, D] tensor
    and gate/up into one [2I, D] tensor, and make each projection's ``weight`` / ``bias`` a row
    slice of it (``fused_linear.FusedRows``), so no-grad forwards run one GEMM for each group
    instead of three and two. Names, ``state_dict()`` and the parameter objects are unchanged, and
    in-place writes to them (``update_weights``, policy sync, ``load_state_dict``) land in the fused
    tensors. Call it after the weights have their final device, dtype and (TP) shard; idempotent.
    Forwards with gradients enabled keep the per-projection GEMMs (gradients reach the parameters
    as before); a module never fused behaves exactly as before. On CUDA the replaced per-projection
    storages go back to PyTorch's cache (still used memory to ``torch.cuda.mem_get_info`` until
    reused)."""
    for layer in layers:
        a = layer.self_attn
        if a.qkv is None or not a.qkv.intact():
            a.qkv = fused_linear.FusedRows([a.q_proj, a.k_proj, a.v_proj])
        for m in dense_mlps(layer):
            if m.gate_up is None or not m.gate_up.intact():
                m.gate_up = fused_linear.FusedRows([m.gate_proj, m.up_proj])


@torch.no_grad()
def unfuse_projections(layers: nn.ModuleList) -> None:
    """Undo ``fuse_projections``: every projection gets its own storage again (a copy of its
    current values) and forwards run one GEMM per projection; a no-op on layers never fused."""
    for layer in layers:
        groups = [(layer.self_attn, "qkv")] + [(m, "gate_up") for m in dense_mlps(layer)]
        for owner, attr in groups:
            group = getattr(owner, attr)
            if group is None:
                continue
            for lin in group.members:
                lin.weight.data = lin.weight.detach().clone()
                if lin.bias is not None:
                    lin.bias.data = lin.bias.detach().clone()
            setattr(owner, attr, None)


def projections_fused(layers: nn.ModuleList) -> bool:
    """Whether every layer's q/k/v and gate/up run as one GEMM each in no-grad forwards."""
    return all(
        layer.self_attn.qkv is not None
        and layer.self_attn.qkv.intact()
        and all(m.gate_up is not None and m.gate_up.intact() for m in dense_mlps(layer))
        for layer in layers
    )


# ------------------------------------------------------------------------------ packed CPU GEMMs
class CpuGemmPacks:
    """The oneDNN-packed weight copies of one decoder (inference on CPU) and the modules and fused
    groups that hold them as their ``cpu_pack`` attribute."""

    def __init__(self) -> None:
        self.packs: list[cpu_gemm.PackedWeight] = []
        self.holders: list[object] = []

    def __len__(self) -> int:
        return len(self.packs)

    def __iter__(self) -> Iterator[cpu_gemm.PackedWeight]:
        return iter(self.packs)

    @torch.no_grad()
    def pack(self, decoder: nn.Module, batch_hint: int = 32) -> int:
        """Give every fp32 (or, on a CPU with native bf16, bf16) CPU weight of ``decoder`` of at least
        ``cpu_gemm.MIN_ELEMENTS`` elements a oneDNN-packed copy that no-grad forwards multiply with
        (``cpu_gemm.PackedWeight``: the fused q/k/v and gate/up groups or their projections, o_proj,
        down_proj, the output projection);
        values equal ``F.linear``'s up to summation order. A copy re-packs itself when its
        parameters are written in place or get new storage; call ``invalidate()`` after writes
        through ``.data``. Call it after ``fuse_projections`` (a group fused later has no copy).
        Costs one more copy of the packed weights' memory. Returns the number of weights packed (0
        where oneDNN is unavailable or off CPU)."""
        self.unpack()

        def attach(owner: object, weight: tuple[object, str], watch: list[tuple[object, str]] = ()) -> None:
            pack = cpu_gemm.pack(weight, watch, batch_hint)
            if pack is not None:
                owner.__dict__["cpu_pack"] = pack
                self.packs.append(pack)
                self.holders.append(owner)

        for layer in decoder.model.layers:
            a = layer.self_attn
            mlps = dense_mlps(layer)  # a sparse block's experts multiply per-expert slices: no packed copy
            groups = [(a.qkv, (a.q_proj, a.k_proj, a.v_proj))]
            groups += [(m.gate_up, (m.gate_proj, m.up_proj)) for m in mlps]
            for rows, lins in groups:
                if rows is not None and rows.intact():  # one copy for the group's one GEMM
                    attach(rows, (rows, "weight"), [(lin, "weight") for lin in lins])
                else:
                    for lin in lins:
                        attach(lin, (lin, "weight"))
            for lin in (a.o_proj, *(m.down_proj for m in mlps)):
                attach(lin, (lin, "weight"))
        attach(decoder, (decoder, "output_weight"))
        return len(self.packs)

    def unpack(self) -> None:
        """Drop the packed copies (forwards use ``F.linear`` again)."""
        for owner in self.holders:
            owner.__dict__.pop("cpu_pack", None)
        self.packs, self.holders = [], []

    @property
    def nbytes(self) -> int:
        """Memory the packed copies take (once packed: at first use)."""
        return sum(p.weight().numel() * p.weight().element_size() for p in self.packs)

    def invalidate(self) -> None:
        """Make every packed copy re-pack at its next use (the weights changed)."""
        for pack in self.packs:
            pack.invalidate()


# ------------------------------------------------------------------------------ fused add + norm
def forward_add_norm(
    layers: nn.ModuleList,
    final_norm: nn.Module,
    x_TD: torch.Tensor,
    cos_TF: torch.Tensor,
    sin_TF: torch.Tensor,
    attn: AttentionBackend,
) -> torch.Tensor:
    """The decoder layers with each residual add and the RMSNorm after it as one op
    (``fused_ops.add_rms_norm``): the post-attention norm, the next layer's input norm, and the
    final norm after the last layer. Same values as the layer-by-layer loop, except where a dense
    MLP's ``decode_partials`` serves (``decode_mlp``: its GEMMs summed in another order). The
    post-norm and sandwich layouts (``DecoderLayer.layout``) take ``forward_norm_add_norm``. Granite's
    ``residual_scale`` scales each block's output in the model dtype before the fused add, as the layer does;
    its MLPs take no ``decode_partials`` (the kernel sums them unscaled into the residual)."""
    assert layers[0].layout == "pre" or layers[0].residual_scale == 1.0, "a residual scale is Granite's (pre-norm)"
    if layers[0].layout != "pre":
        # every layer is built from one config: the first's norms stand for all
        if not fused_ops.norms_fit_norm_add_norm([final_norm, *_norms(layers[0])]):
            for layer in layers:  # GLM-4's sandwich norms scale in the model dtype: the kernel does not serve
                x_TD = layer(x_TD, cos_TF, sin_TF, attn)
            return final_norm(x_TD)
        return forward_norm_add_norm(layers, final_norm, x_TD, cos_TF, sin_TF, attn)
    h_TD = layers[0].input_layernorm(x_TD)
    scale = layers[0].residual_scale  # one config builds every layer

    def scaled(branch_TD: torch.Tensor) -> torch.Tensor:
        return branch_TD if scale == 1.0 else branch_TD * scale

    for i, layer in enumerate(layers):
        post = layer.post_attention_layernorm
        branch_TD = scaled(layer.self_attn(h_TD, cos_TF, sin_TF, attn))
        x_TD, h_TD = fused_ops.add_rms_norm(x_TD, branch_TD, post.weight, post.eps)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        parts = getattr(layer.mlp, "decode_partials", None) if scale == 1.0 else None  # the split down projection
        parts_PTD = parts(h_TD) if parts is not None else None
        if parts_PTD is not None:
            x_TD, h_TD = fused_ops.add_parts_rms_norm(x_TD, parts_PTD, nxt.weight, nxt.eps)
        else:
            x_TD, h_TD = fused_ops.add_rms_norm(x_TD, scaled(layer.mlp(h_TD)), nxt.weight, nxt.eps)
    return h_TD


def _norms(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A post-norm or sandwich layer's norms."""
    if layer.layout == "post":
        return (layer.post_attention_layernorm, layer.post_feedforward_layernorm)
    return layer.sandwich_norms()


def forward_norm_add_norm(
    layers: nn.ModuleList,
    final_norm: nn.Module,
    x_TD: torch.Tensor,
    cos_TF: torch.Tensor,
    sin_TF: torch.Tensor,
    attn: AttentionBackend,
) -> torch.Tensor:
    """``forward_add_norm`` for the layouts that norm each block's output before its residual add
    (``fused_ops.norm_add_norm``): post (OLMo 2: the sum is the next block's input; the final norm
    joins the last add) and sandwich (Gemma 3: the sum's norm is the next block's input norm)."""
    post = layers[0].layout == "post"
    h_TD = x_TD if post else layers[0].sandwich_norms()[0](x_TD)
    for i, layer in enumerate(layers):
        attn_out, mid, mlp_out = (
            (layer.post_attention_layernorm, None, layer.post_feedforward_layernorm)
            if post
            else layer.sandwich_norms()[1:]
        )
        x_TD, h_TD = fused_ops.norm_add_norm(x_TD, layer.self_attn(h_TD, cos_TF, sin_TF, attn), attn_out, mid)
        h_TD = x_TD if post else h_TD
        last = i + 1 == len(layers)
        nxt = final_norm if last else None if post else layers[i + 1].sandwich_norms()[0]
        parts = getattr(layer.mlp, "decode_partials", None)  # the dense MLP's split down projection
        parts_PTD = parts(h_TD) if parts is not None else None
        branch = parts_PTD if parts_PTD is not None else layer.mlp(h_TD)
        x_TD, h_TD = fused_ops.norm_add_norm(x_TD, branch, mlp_out, nxt, parts=parts_PTD is not None)
        h_TD = x_TD if h_TD is None else h_TD
    return h_TD
