"""Attention over packed sequences: the ``AttentionBackend`` contract the decoder calls in every
layer, and ``PackedCausalAttention``, the training and scoring backend (SDPA, varlen flash or
FlexAttention, chosen per device, dtype and batch shape). The rollout engine supplies its own
paged-KV backend (``areno.rollout.attention``).

Legend: T = packed tokens, H = heads (Hq query, Hkv key/value), Dh = head dim, B = sequences,
S = the longest sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from areno.models import compiled
from areno.models.config import ModelConfig
from areno.models.eager_ops import soft_cap
from areno.types import sequence_index_T


class AttentionBackend(Protocol):
    """Computes attention for one layer of a packed batch.

    ``q_THD``: [T, Hq, Dh]; ``k_THD``, ``v_THD``: [T, Hkv, Dh] (after RoPE). Returns [T, Hq, Dh].
    The backend handles GQA (Hq a multiple of Hkv) and uses the scale 1/sqrt(Dh).

    A backend may also have ``attend_rotary(layer_idx, qkv_TN, Hq, Hkv, cos_TF, sin_TF, qk_norm=None)``:
    the same attention from a fused q/k/v product before RoPE (with ``qk_norm``, a ``HeadNorms``, before
    its per-head norms too), or None when it cannot serve it (the decoder then norms, rotates and calls
    the backend); the rollout engine's ``PagedAttention`` has one.

    Layers with attention sinks (gpt-oss) pass ``sinks_H=`` [Hq], a logit per query head that joins each
    softmax's denominator (``explicit_attention``); layers with soft-capped scores (Gemma 2) pass ``softcap=``,
    a float: each scaled score s becomes ``softcap * tanh(s / softcap)`` before the mask and softmax. Only the
    layers of such models pass them, so a backend that takes neither fails loudly, never computes without.
    Where only some layers slide (``ModelConfig.window_layers``) every layer passes ``windowed=``, whether it takes
    the window (``layer_slides``).
    """

    def __call__(
        self, layer_idx: int, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor
    ) -> torch.Tensor: ...


def layer_slides(layer_idx: int, windowed: bool | None, window_layers: Collection[int]) -> bool:
    """Whether layer ``layer_idx`` takes the window where only ``window_layers`` do: the layer's own ``windowed``
    when it passes one (``Attention.windowed``; a compiled layer reads no ``layer_idx``), else its index."""
    return layer_idx in window_layers if windowed is None else windowed


@dataclass(frozen=True)
class HeadNorms:
    """Per-head RMSNorms of q and k before RoPE (``AttentionBackend.attend_rotary``'s ``qk_norm``): weights [Dh],
    ``eps``, a weight ``offset`` (Gemma 3's weights are offsets from 1) and the scaling order
    (``scale_in_float32``: scaled in float32 and rounded once; else rounded, scaled, rounded)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    offset: float = 0.0
    scale_in_float32: bool = False


def explicit_attention(
    q_QHD: torch.Tensor,
    k_KHD: torch.Tensor,
    v_KHD: torch.Tensor,
    sinks_H: torch.Tensor | None = None,
    window: int | None = None,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of Q queries, the last Q of K key positions, from explicit float32 scores: the form of
    the score terms SDPA has not. ``sinks_H``: a learned logit per query head that joins each softmax's
    denominator and has no value (gpt-oss's sinks: transformers' eager attention with the sink as one more
    column, dropped after the softmax); ``softcap``: each scaled score s becomes ``softcap * tanh(s / softcap)``
    before the mask (Gemma 2's, as transformers' eager attention). Over query blocks of at most
    ``SINK_SCORES_MAX`` entries; the result in q's dtype. ``window``: a query sees the last ``window`` keys up to
    itself."""
    Q, H, D = q_QHD.shape
    K, G = k_KHD.shape[0], H // k_KHD.shape[1]
    k_HKD = k_KHD.transpose(0, 1).float().repeat_interleave(G, 0)
    v_HKD = v_KHD.transpose(0, 1).float().repeat_interleave(G, 0)
    qpos_Q = torch.arange(K - Q, K, device=q_QHD.device)
    kpos_K = torch.arange(K, device=q_QHD.device)
    sink_H11 = None if sinks_H is None else sinks_H.float()[:, None, None]
    step = max(1, SINK_SCORES_MAX // max(1, H * K))
    outs = []
    for s in range(0, Q, step):
        q_HqD = q_QHD[s : s + step].transpose(0, 1).float()
        keep_qK = kpos_K[None, :] <= qpos_Q[s : s + step, None]
        if window is not None:
            keep_qK &= kpos_K[None, :] > qpos_Q[s : s + step, None] - window
        scores_HqK = soft_cap(torch.matmul(q_HqD, k_HKD.transpose(1, 2)).mul_(D**-0.5), softcap)
        scores_HqK = scores_HqK.masked_fill(~keep_qK, float("-inf"))
        outs.append(torch.matmul(sink_softmax(scores_HqK, sink_H11), v_HKD).transpose(0, 1))
    return (torch.cat(outs) if len(outs) > 1 else outs[0]).to(q_QHD.dtype)


def sink_softmax(scores_XL: torch.Tensor, sink_X1: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax over the keys with the sink logit as one more, value-less column (dropped):
    transformers' eager gpt-oss attention. Masked keys (-inf) weigh 0; the sink keeps every row's
    denominator positive. ``sink_X1`` broadcasts against ``scores_XL`` with 1 key; None: the plain float32
    softmax (a row needs one unmasked key)."""
    s_XL = scores_XL.float()
    if sink_X1 is None:
        return torch.softmax(s_XL, dim=-1)
    m_X1 = torch.maximum(s_XL.amax(dim=-1, keepdim=True), sink_X1.float())
    p_XL = (s_XL - m_X1).exp()
    return p_XL / (p_XL.sum(dim=-1, keepdim=True) + (sink_X1 - m_X1).exp())


SINK_SCORES_MAX = 1 << 24
"""Score entries (heads x queries x keys) ``explicit_attention`` computes at once (64 MB in float32)."""


@functools.cache
def softcap_score_mod(softcap: float):
    """FlexAttention's ``score_mod`` of Gemma 2's soft-capping (flex passes it the scaled score): its
    backward takes the tanh's derivative through the compiled kernel. One function per cap, so that the
    compiled flex sees the same object at every call (a new closure would fail its guards and recompile)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def apply_sinks(out_BHTD: torch.Tensor, lse_BHT: torch.Tensor, sinks_H: torch.Tensor) -> torch.Tensor:
    """Attention output without sinks rescaled to the output with them: a sink s adds e^s to the
    softmax's denominator e^lse, so every weight shrinks by e^lse / (e^lse + e^s) = sigmoid(lse - s).
    Differentiable through ``lse`` where the kernel that gave it is (flex attention)."""
    scale_BHT = torch.sigmoid(lse_BHT.float() - sinks_H.float()[None, :, None])
    return (out_BHTD.float() * scale_BHT[..., None]).to(out_BHTD.dtype)


SDPA_MASK_MAX_TOKENS = 2048
FLEX_DECODING_MIN_QUERIES = 128
"""Inductor compiles flex attention with fewer queries than this as its decoding kernel."""
FLEX_MIN_HEAD_DIM = 16
"""FlexAttention's compiled kernels need head dims of at least this (``auto`` picks sdpa below)."""


class PackedCausalAttention:
    """Causal attention inside each packed sequence (no attention across sequence boundaries).

    ``cu_seqlens_B1``: int [B+1] boundaries. ``sliding_window``: Mistral's window (a query sees
    itself and the previous ``sliding_window - 1`` tokens), or None; ``window_layers``: the layers it
    applies to where only some slide (None: every layer; ``for_model`` reads both). ``impl``:
    - ``"sdpa"``: SDPA per sequence with ``is_causal`` (the CPU default: no work across sequences).
    - ``"sdpa_mask"``: one SDPA call with a block-diagonal causal boolean mask [T, T].
    - ``"flex"``: FlexAttention with a document block mask, compiled (the CUDA default).
    - ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (flash, CUDA bf16/fp16 only; torch
      versions whose varlen lacks GQA get k/v repeated, and lack sliding windows fall back to flex).
    - ``"sdpa_padded"``: gather the sequences into right-padded batches of similar lengths
      (``padded_layout``) and run one causal SDPA call a batch (padding sits after every real token,
      so causality hides it); costs about sum of S^2 instead of T^2, the fast path for many short
      sequences on CPU.
    - ``"auto"``: on CUDA the model's choice (``prepare``'s ``cuda_impl``: varlen, or flex), varlen
      falling back to flex (or sdpa below ``FLEX_MIN_HEAD_DIM``) where flash does not run (fp32
      inputs, head dims that are not a multiple of 8 or exceed 256, a torch without a varlen
      kernel); elsewhere sdpa_padded when its batches' padding wastes at most half the rows, else
      sdpa_mask up to ``SDPA_MASK_MAX_TOKENS`` tokens, else per-sequence sdpa.
    ``prepare`` builds the mask (or boundaries, or padded layout) once; ``Decoder.forward`` calls it before the
    layers, so compiled layers only read it (no host sync or mask construction inside them).

    With ``sinks`` (gpt-oss) or ``softcap`` (Gemma 2's soft-capped scores) ``auto`` is flex on CUDA (sinks:
    its log-sum-exp rescaled by ``apply_sinks``; the cap: a ``score_mod``) and sdpa elsewhere, whose
    per-sequence calls are then ``explicit_attention``; on CPU the cap alone takes sdpa_padded's explicit
    batches (``CpuExplicitAttention`` with the cap) where they all fit and pad little. The other impls,
    which have neither, are refused.
    """

    IMPLS = ("auto", "sdpa", "sdpa_mask", "sdpa_padded", "flex", "varlen")

    SINK_IMPLS = ("auto", "sdpa", "flex")
    """The impls that take sinks and soft-capped scores."""

    @classmethod
    def for_model(cls, cu_seqlens_B1: torch.Tensor, config: ModelConfig, impl: str = "auto") -> PackedCausalAttention:
        """The attention of ``config``'s layers: its window, in the layers that take it; its sinks and soft-cap."""
        return cls(
            cu_seqlens_B1,
            sliding_window=config.sliding_window,
            impl=impl,
            window_layers=config.window_layers,
            sinks=config.attention_sinks,
            softcap=config.attn_logit_softcapping,
        )

    def __init__(
        self,
        cu_seqlens_B1: torch.Tensor,
        *,
        sliding_window: int | None = None,
        impl: str = "auto",
        window_layers: tuple[int, ...] | None = None,
        sinks: bool = False,
        softcap: float | None = None,
    ) -> None:
        if impl not in self.IMPLS:
            raise ValueError(f"PackedCausalAttention impl must be one of {self.IMPLS}, got {impl!r}")
        if (sinks or softcap is not None) and impl not in self.SINK_IMPLS:
            raise ValueError(
                f"attention with {score_terms_name(sinks, softcap)} runs as one of {self.SINK_IMPLS}, not "
                f"impl={impl!r}: use auto"
            )
        self.cu_seqlens_B1 = cu_seqlens_B1
        self.sliding_window = sliding_window
        self.sinks = sinks
        self.softcap = softcap
        self.window_layers = window_layers if sliding_window is not None else None
        # where only some layers slide, the others attend through a window-less twin (its own mask or layout)
        self._full = (
            None
            if self.window_layers is None
            else PackedCausalAttention(cu_seqlens_B1, impl=impl, sinks=sinks, softcap=softcap)
        )
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
        query_heads: int | None = None,
    ) -> None:
        """Resolve ``auto`` and build what every layer reuses: sequence bounds (sdpa), the mask
        (sdpa_mask, flex), the padded batches (sdpa_padded) or int32 boundaries and the longest length
        (varlen). ``head_dim``: when known, ``auto`` on CUDA avoids flex below ``FLEX_MIN_HEAD_DIM``
        (its kernels need 16). ``dtype`` (of q): when known, ``auto`` on CUDA avoids varlen for fp32
        (flash is 16-bit); it also does for head dims flash lacks (not a multiple of 8, or above 256).
        ``cuda_impl``: what ``auto`` runs on CUDA (``Decoder.cuda_attention``), kept for later calls;
        default auto. ``query_heads``: q's heads, which ``length_buckets`` weighs a padded batch's
        cost against (1 when not given)."""
        device = torch.device(device)
        if self._full is not None:
            self._full.prepare(num_tokens, device, head_dim, dtype, cuda_impl, query_heads)
        if cuda_impl is not None:
            self._cuda_impl = cuda_impl
        small_heads = head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
        flash_ok = flash_runs(dtype, head_dim)
        if self._prepared_for == (num_tokens, device, small_heads, flash_ok, self._cuda_impl):
            return
        impl, layout = self.impl, None
        scored = self.sinks or self.softcap is not None
        if scored and self._cuda_impl not in ("auto", "flex"):
            what = score_terms_name(self.sinks, self.softcap)
            raise ValueError(
                f"train.attention={self._cuda_impl}: attention with {what} runs as flex on CUDA (flash's varlen "
                "kernel has neither sinks nor a soft-cap); set train.attention=auto"
            )
        if scored and impl == "auto":  # the impls that take them: flex (log-sum-exp, score_mod) or explicit scores
            impl = "flex" if device.type == "cuda" and not small_heads else "sdpa"
            if device.type == "cpu" and not self.sinks:  # soft-capped scores as explicit padded batches where they fit
                layout = self._padded_layout(device, dtype, query_heads)
                if layout.explicit_everywhere and _pads_little(layout, num_tokens):
                    impl = "sdpa_padded"
        if scored and impl == "flex" and (device.type != "cuda" or small_heads):
            raise ValueError(
                f"attention with {score_terms_name(self.sinks, self.softcap)} as flex runs on CUDA with head dims "
                f"of at least {FLEX_MIN_HEAD_DIM} (its backward); use impl auto here"
            )
        if impl == "auto":
            if device.type == "cuda":
                impl = "varlen" if self._cuda_impl == "auto" else self._cuda_impl
                if impl == "varlen" and not (flash_ok and varlen_available()):
                    impl = "flex"
                if impl == "flex" and small_heads:
                    impl = "sdpa"  # tiny test models: flex's kernels need a head dim of at least 16
            else:
                # padded batches where they pad at most as many rows as the batch has; else many short
                # sequences cost one SDPA call each, so below a few thousand tokens one masked call per
                # layer is cheaper (the T x T mask stays small)
                layout = self._padded_layout(device, dtype, query_heads)
                if _pads_little(layout, num_tokens):
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
            self._state = layout or self._padded_layout(device, dtype, query_heads)
        elif impl == "flex":
            self._state = self._flex_mask(num_tokens, device)
        else:
            cu = self.cu_seqlens_B1.to(device=device, dtype=torch.int32)
            max_len = int((self.cu_seqlens_B1[1:] - self.cu_seqlens_B1[:-1]).max()) if num_tokens else 0
            # this torch's varlen_attn features, read here (eagerly) so compiled layers do not trace
            # inspect.signature or the GQA probe
            self._state = (cu, max_len, *varlen_features())
        self._impl = impl
        self._prepared_for = (num_tokens, device, small_heads, flash_ok, self._cuda_impl)

    def _padded_layout(self, device: torch.device, dtype: torch.dtype | None, query_heads: int | None) -> PaddedLayout:
        """The sequences' ``padded_layout`` (explicit bf16 batches, in query blocks where they pay, on CPU)."""
        cu = self.cu_seqlens_B1.cpu().numpy()
        return padded_layout(
            cu,
            cu,
            device,
            end_aligned=False,
            query_heads=query_heads or 1,
            dtype=dtype,
            window=self.sliding_window,
            scored=self.softcap is not None,
        )

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

    def _sdpa_per_sequence(
        self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, sinks_H: torch.Tensor | None = None
    ) -> torch.Tensor:
        bounds = self._state
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e == s:
                continue
            if sinks_H is not None or self.softcap is not None:
                window, cap = self.sliding_window, self.softcap
                outs.append(explicit_attention(q_THD[s:e], k_THD[s:e], v_THD[s:e], sinks_H, window, softcap=cap))
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
        return padded_sdpa(q_THD, k_THD, v_THD, self._state, self.softcap)

    def _varlen(self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor) -> torch.Tensor:
        cu, max_len, has_gqa, has_window = self._state
        return varlen_causal(
            q_THD, k_THD, v_THD, cu, cu, max_len, max_len, self.sliding_window, has_gqa=has_gqa, has_window=has_window
        )

    def __call__(
        self,
        layer_idx: int,
        q_THD: torch.Tensor,
        k_THD: torch.Tensor,
        v_THD: torch.Tensor,
        sinks_H: torch.Tensor | None = None,
        softcap: float | None = None,
        windowed: bool | None = None,
    ) -> torch.Tensor:
        if self._full is not None and not layer_slides(layer_idx, windowed, self.window_layers):
            return self._full(layer_idx, q_THD, k_THD, v_THD, sinks_H, softcap)
        check_score_terms(self.sinks, self.softcap, sinks_H, softcap)
        self.prepare(q_THD.shape[0], q_THD.device, q_THD.shape[-1], q_THD.dtype, query_heads=q_THD.shape[1])
        impl = self._impl
        if impl == "sdpa":
            return self._sdpa_per_sequence(q_THD, k_THD, v_THD, sinks_H)
        if impl == "varlen":
            return self._varlen(q_THD, k_THD, v_THD)
        if impl == "sdpa_padded":
            return self._sdpa_padded(q_THD, k_THD, v_THD)
        q = q_THD.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, Dh]
        k = k_THD.transpose(0, 1).unsqueeze(0)
        v = v_THD.transpose(0, 1).unsqueeze(0)
        if impl == "flex":
            # below 128 queries inductor takes its decoding kernel, which has no configuration for small head
            # dims (16): the main kernel there (checked on an H100; larger shapes keep inductor's choice)
            small = q.shape[-2] < FLEX_DECODING_MIN_QUERIES and q.shape[-1] < 64
            options = {"FORCE_USE_FLEX_ATTENTION": True} if small else None
            flex = _compiled_flex_attention()
            mod = {} if self.softcap is None else {"score_mod": softcap_score_mod(self.softcap)}
            if sinks_H is not None:
                out, lse = flex(
                    q, k, v, block_mask=self._state, enable_gqa=True, kernel_options=options, return_lse=True, **mod
                )
                return apply_sinks(out, lse, sinks_H).squeeze(0).transpose(0, 1)
            out = flex(q, k, v, block_mask=self._state, enable_gqa=True, kernel_options=options, **mod)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._state, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


def _pads_little(layout: PaddedLayout, num_tokens: int) -> bool:
    """Whether a padded layout's batches pad at most as many query rows as the sequences have."""
    return sum(b.num_seqs * b.len_q for b in layout.buckets) <= 2 * num_tokens


_FLEX = None


def score_terms_name(sinks: bool, softcap: float | None) -> str:
    """The score terms a backend was built with, for its errors: ``sinks (gpt-oss)``, ``soft-capped scores
    (Gemma 2)`` or both."""
    names = [n for n, on in (("sinks (gpt-oss)", sinks), ("soft-capped scores (Gemma 2)", softcap is not None)) if on]
    return " and ".join(names)


def check_score_terms(
    sinks: bool, softcap: float | None, sinks_H: torch.Tensor | None, called_cap: float | None
) -> None:
    """A backend built for ``sinks`` / ``softcap`` is called with the same: one built from another model's
    config would attend without them (or with another cap)."""
    if (sinks_H is not None) != sinks:
        raise ValueError(f"attention built with sinks={sinks} called with sinks_H={sinks_H is not None}")
    if called_cap != softcap:
        raise ValueError(f"attention built with softcap={softcap} called with softcap={called_cap}")


CPU_SLICE_BYTES = 1 << 20
"""fp32 bytes of scores whose element-wise passes ``CpuExplicitAttention`` runs together (in L2)."""
CPU_EXPLICIT_MAX_SCORES = 1 << 24
"""Largest score tensor (B * Hq * Sq * Sk entries) that ``padded_sdpa`` computes as two bf16 GEMMs
around an fp32 softmax on CPU (``CpuExplicitAttention``, which keeps the bf16 probabilities for
backward: 32 MB a layer at this bound); larger batches take the flash kernel in fp32."""


PAD_CALL_ENTRIES = 1 << 17
"""What one more padded batch costs, in score entries over all query heads (query rows x keys x
heads): ``length_buckets`` splits sequences into batches of similar lengths where the padding this
saves is worth more. About the fixed work of a CPU attention call's forward and backward (~0.65 ms,
against ~8 ns an entry; bench/LOG.md)."""


def length_buckets(
    len_q: np.ndarray, len_k: np.ndarray, query_heads: int = 1, call_entries: int | None = None
) -> tuple[list[np.ndarray], float]:
    """Sequence indices grouped into right-padded batches, and their cost: the grouping of the sequences
    sorted by key length (then query length) into runs that minimises the padded score entries, sum over
    the runs of (sequences x longest queries x longest keys x ``query_heads``), plus ``call_entries``
    (default ``PAD_CALL_ENTRIES``) a run. One run when the lengths are equal; a group's shared prompt
    apart from its samples' rests where they are long; a long tail of lengths in a few runs instead of
    all padded to the longest."""
    call_entries = PAD_CALL_ENTRIES if call_entries is None else call_entries
    len_q, len_k = np.asarray(len_q, dtype=np.int64), np.asarray(len_k, dtype=np.int64)
    n = len(len_q)
    order = np.lexsort((-len_q, -len_k))
    lq, lk = len_q[order], len_k[order]
    best = np.zeros(n + 1, dtype=np.float64)
    start = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        # a last run order[i:j]: its keys are lk[i] long, its queries the longest of lq[i:j]
        max_q = np.maximum.accumulate(lq[:j][::-1])[::-1]
        cost = best[:j] + (j - np.arange(j)) * max_q * lk[:j] * query_heads + call_entries
        start[j] = int(np.argmin(cost))
        best[j] = cost[start[j]]
    runs, j = [], n
    while j > 0:
        runs.append(order[start[j] : j])
        j = int(start[j])
    return runs[::-1], float(best[n])


QUERY_BLOCK = 64
"""Query rows per block of a long query sequence where a CPU bfloat16 padded layout attends as explicit
GEMMs (``padded_layout``'s ``query_block``): block j sees only the keys up to its last row, so a causal
sequence's scores above the diagonal are not computed block-wise (the CPU flash kernel skips them itself)."""


BLOCKED_ENTRY_COST = 1.15
"""A blocked layout's score entry against a whole sequence's: the blocks' smaller products run below
the GEMMs' rate (at fixed 128-token completions after a shared prompt, 12-15% fewer entries in blocks
ran the layer 0.96-1.0x; bench/LOG.md)."""


@dataclass(frozen=True)
class PadBucket:
    """One right-padded batch of ``padded_sdpa``: ``num_seqs`` pieces of ``len_q`` query rows and
    ``len_k`` keys. ``mask_BQK``: bool [B, len_q, len_k], or None for the causal mask aligned to the
    top left; ``bias_B1QK``: the same as an fp32 additive bias [B or 1, 1, len_q, len_k] (0 or -inf)
    for ``CpuExplicitAttention``, built once per layout where a CPU bfloat16 batch attends through it
    (None elsewhere: such a batch takes SDPA)."""

    num_seqs: int
    len_q: int
    len_k: int
    mask_BQK: torch.Tensor | None
    bias_B1QK: torch.Tensor | None


@dataclass(frozen=True)
class PaddedLayout:
    """Query sequences right-padded into batches (``padded_layout``): the q row of every padded query
    slot (``src_q``), the k/v row of every padded key slot (``src_k``; a padding slot repeats a real row of
    its piece, which the mask hides, so its gradient is zero), the padded slot of every q row
    (``out_index``), and the batches in slot order."""

    src_q: torch.Tensor
    src_k: torch.Tensor
    out_index: torch.Tensor
    buckets: list[PadBucket]

    @property
    def explicit_everywhere(self) -> bool:
        """Whether every batch attends through ``CpuExplicitAttention`` (has its bias)."""
        return all(b.bias_B1QK is not None for b in self.buckets)


def padded_layout(
    cu_q_B1: np.ndarray,
    cu_k_B1: np.ndarray,
    device: torch.device,
    *,
    end_aligned: bool,
    key_rows: np.ndarray | None = None,
    query_heads: int = 1,
    dtype: torch.dtype | None = None,
    query_block: int | None = None,
    window: int | None = None,
    scored: bool = False,
) -> PaddedLayout:
    """``padded_sdpa``'s layout of query sequences: sequence s's queries are rows ``cu_q_B1[s]:cu_q_B1[s+1]``
    of q, its keys entries ``cu_k_B1[s]:cu_k_B1[s+1]`` of ``key_rows`` (rows of k and v; default: the
    rows themselves). ``end_aligned``: the queries are the last of their keys (causal mask aligned to the
    end of the keys; padded query rows see their first key, so that no row is empty); else queries and
    keys are the same rows (causal, top left). The sequences go into the padded batches of
    ``length_buckets`` (``query_heads`` weighs their cost). With q's ``dtype`` bfloat16 on CPU (explicit
    GEMMs), each batch within ``CPU_EXPLICIT_MAX_SCORES`` gets the additive bias ``CpuExplicitAttention``
    reads, and the sequences may be cut into blocks of ``query_block`` (default ``QUERY_BLOCK``; elsewhere
    none unless given) query rows, each with the keys up to its last row (end-aligned), where those blocks'
    batches cost less. ``window``: a query at position p sees keys p - window < j <= p only (every batch
    then takes a mask). ``scored``: the scores are soft-capped (Gemma 2), which SDPA cannot do, so on CPU the
    batches are explicit in any dtype (``explicit_everywhere`` says whether every one of them fits)."""
    len_q, len_k = np.diff(cu_q_B1), np.diff(cu_k_B1)
    if np.any((len_q == 0) & (len_k > 0)):
        raise ValueError("padded_layout: a query sequence without query rows has keys")
    key_rows = np.arange(int(cu_k_B1[-1])) if key_rows is None else np.asarray(key_rows)
    explicit = torch.device(device).type == "cpu" and (dtype == torch.bfloat16 or scored)
    if explicit and query_block is None:
        query_block = QUERY_BLOCK
    whole = max(int(len_q.max(initial=0)), 1)
    pieces = _pieces(len_q, len_k, whole)
    runs, cost = length_buckets(pieces[2], pieces[3], query_heads)
    masked = end_aligned or window is not None
    if query_block and query_block < whole:  # blocks where their batches cost less than the whole sequences'
        blocked = _pieces(len_q, len_k, query_block)
        blocked_runs, blocked_cost = length_buckets(blocked[2], blocked[3], query_heads)
        if blocked_cost * BLOCKED_ENTRY_COST < cost:
            pieces, runs, masked = blocked, blocked_runs, True
    seq, j, pq, pk, block = pieces
    q_start, k_start = cu_q_B1[:-1][seq] + j * block, cu_k_B1[:-1][seq]
    src_q, src_k, buckets = [], [], []
    out_index = np.zeros(int(cu_q_B1[-1]), dtype=np.int64)
    off_q = 0
    for idx in runs:
        sq, sk, n = int(pq[idx].max()), int(pk[idx].max()), len(idx)
        rq, rk = np.arange(sq)[None, :], np.arange(sk)[None, None, :]
        nq, nk = pq[idx][:, None], pk[idx][:, None]
        src_q.append((q_start[idx][:, None] + np.minimum(rq, nq - 1)).ravel())
        src_k.append(key_rows[k_start[idx][:, None] + np.minimum(rk[0], nk - 1)].ravel())
        slots = off_q + np.arange(n)[:, None] * sq + rq
        real = rq < nq
        out_index[(q_start[idx][:, None] + rq)[real]] = slots[real]
        off_q += n * sq
        mask = None
        if masked:
            a, nq3, nk3 = rq[..., None], nq[..., None], nk[..., None]
            seen = (rk <= a + (nk3 - nq3)) & (a < nq3)
            if window is not None:
                seen &= rk > a + (nk3 - nq3) - window
            # a padding query row sees its piece's first key only (no empty row)
            mask = torch.from_numpy(seen | ((rk == 0) & (a >= nq3))).to(device)
        bias = None
        if explicit and n * query_heads * sq * sk <= CPU_EXPLICIT_MAX_SCORES:
            allowed = mask if mask is not None else torch.ones(sq, sk, dtype=torch.bool).tril()[None]
            bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, None]
        buckets.append(PadBucket(n, sq, sk, mask, bias))
    cat = lambda parts: torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    return PaddedLayout(cat(src_q).to(device), cat(src_k).to(device), torch.from_numpy(out_index).to(device), buckets)


def _pieces(len_q: np.ndarray, len_k: np.ndarray, block: int) -> tuple[np.ndarray, ...]:
    """Sequences cut into blocks of ``block`` query rows, each with its sequence's keys up to its last
    row: (sequence, block index, query rows, keys) of every piece, and ``block``."""
    blocks = -(-len_q // block)
    seq = np.repeat(np.arange(len(len_q)), blocks)
    j = np.arange(len(seq)) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    q_hi = np.minimum((j + 1) * block, len_q[seq])
    return seq, j, q_hi - j * block, len_k[seq] - len_q[seq] + q_hi, block


def padded_sdpa(
    q_THD: torch.Tensor,
    k_KHD: torch.Tensor,
    v_KHD: torch.Tensor,
    layout: PaddedLayout,
    softcap: float | None = None,
) -> torch.Tensor:
    """SDPA over packed query sequences right-padded into batches (``padded_layout``): q's rows and k's and
    v's gathered into the batches' slots, one SDPA call a batch. Returns q's rows. ``softcap``: soft-capped
    scores (Gemma 2), for a layout made ``scored`` whose batches are all explicit."""
    buckets = layout.buckets
    if not buckets:  # no query rows
        return q_THD.clone()

    def pad(x: torch.Tensor, src: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, ...]:
        out = x.index_select(0, src)
        return out.split(rows) if len(rows) > 1 else (out,)

    rows_q = [b.num_seqs * b.len_q for b in buckets]
    rows_k = [b.num_seqs * b.len_k for b in buckets]
    qs, ks, vs = pad(q_THD, layout.src_q, rows_q), pad(k_KHD, layout.src_k, rows_k), pad(v_KHD, layout.src_k, rows_k)
    outs = []
    for b, q, k, v in zip(buckets, qs, ks, vs):
        q, k, v = (
            x.view(b.num_seqs, length, *x.shape[1:]).transpose(1, 2)
            for x, length in ((q, b.len_q), (k, b.len_k), (v, b.len_k))
        )
        out = _padded_batch(q, k, v, b, softcap)
        outs.append(out.transpose(1, 2).reshape(b.num_seqs * b.len_q, *q_THD.shape[1:]))
    out_flat = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out_flat.index_select(0, layout.out_index)


def _padded_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: PadBucket, softcap: float | None = None
) -> torch.Tensor:
    """One padded batch's attention [B, Hq, len_q, Dh] (``padded_sdpa``)."""
    # the CPU flash kernel runs slower in bfloat16 than in float32 (forward and backward), and in float32
    # slower than explicit GEMMs where the scores fit
    cpu_bf16 = q.dtype == torch.bfloat16 and q.device.type == "cpu"
    if softcap is not None:
        if b.bias_B1QK is None:
            raise ValueError("soft-capped scores need the explicit batches of a padded_layout(scored=True) on CPU")
        return CpuExplicitAttention.apply(q, k, v, b.bias_B1QK, softcap)
    if cpu_bf16 and b.bias_B1QK is not None:  # padded_layout's explicit batches
        return CpuExplicitAttention.apply(q, k, v, b.bias_B1QK)
    mask = {"is_causal": True} if b.mask_BQK is None else {"attn_mask": b.mask_BQK[:, None]}
    if cpu_bf16:
        with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back
            out_BHSD = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True, **mask)
        return out_BHSD.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask)


class CpuExplicitAttention(torch.autograd.Function):
    """(q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D], an fp32 additive bias [B or 1, 1, Sq, Sk], and optionally
    Gemma 2's ``softcap``) -> softmax(cap(q k^T / sqrt(D)) + bias) v [B, Hq, Sq, D] in q's dtype, with flash
    attention's precision on a GPU: the scores S and dP in fp32 (float32 GEMMs: a CPU GEMM has no bf16 product
    with an fp32 result), P and dS rounded to q's dtype for the other four GEMMs, the softmax, the cap
    ``c * tanh(s / c)`` and their gradients in fp32 (the cap's tanh kept for backward). The query heads of a
    key head are stacked into one matrix (GQA without repeating k and v); every row needs one finite bias
    entry. Faster than the CPU flash kernel at the short padded sequences of RL batches (bench/LOG.md: the
    CPU training attention)."""

    @staticmethod
    def forward(ctx, q_BHSD, k_BHSD, v_BHSD, bias_B1QK, softcap=None):
        B, Hq, Sq, D = q_BHSD.shape
        Hkv, Sk = k_BHSD.shape[1], k_BHSD.shape[2]
        g = Hq // Hkv
        with torch.autocast(q_BHSD.device.type, enabled=False):  # the dtypes below are the point
            q_BGD = q_BHSD.reshape(B, Hkv, g * Sq, D)  # a key head's query heads, one after another
            scores_BGK = torch.matmul(
                q_BGD.to(torch.float32, copy=True).mul_(D**-0.5), k_BHSD.float().transpose(-1, -2)
            )
            tanh_BGK = None
            if softcap is not None:
                tanh_BGK = scores_BGK.div_(softcap).tanh_()
                scores_BGK = tanh_BGK * softcap
            p_BGK = torch.empty_like(scores_BGK, dtype=q_BHSD.dtype)
            for a, b in _batch_slices(B, Hq * Sq * Sk):
                bias = bias_B1QK[a:b] if bias_B1QK.shape[0] > 1 else bias_B1QK  # per sequence, or one for all
                z = scores_BGK[a:b].view(b - a, Hkv, g, Sq, Sk).add_(bias[:, :, None])
                p_BGK[a:b] = torch.softmax(z, dim=-1).view(b - a, Hkv, g * Sq, Sk)
            ctx.save_for_backward(q_BGD, k_BHSD, v_BHSD, p_BGK, tanh_BGK)
            return torch.matmul(p_BGK, v_BHSD).view(B, Hq, Sq, D)

    @staticmethod
    def backward(ctx, grad_out_BHSD):
        q_BGD, k_BHSD, v_BHSD, p_BGK, tanh_BGK = ctx.saved_tensors
        B, Hkv, GS, D = q_BGD.shape
        with torch.autocast(q_BGD.device.type, enabled=False):
            grad_out_BGD = grad_out_BHSD.reshape(B, Hkv, GS, D)
            grad_p_BGK = torch.matmul(grad_out_BGD.float(), v_BHSD.float().transpose(-1, -2))
            grad_s_BGK = torch.empty_like(p_BGK)
            for a, b in _batch_slices(B, Hkv * GS * p_BGK.shape[-1]):
                # softmax backward: dZ = P * (dP - rowsum(dP * P)), over the bf16 P the second GEMM read
                dp, p = grad_p_BGK[a:b], p_BGK[a:b].float()
                dz = dp.sub_((dp * p).sum(-1, keepdim=True)).mul_(p)
                if tanh_BGK is not None:  # through the cap: d(c tanh(s / c)) / ds = 1 - tanh^2
                    t = tanh_BGK[a:b]
                    dz.mul_(1 - t * t)
                grad_s_BGK[a:b] = dz
            grad_out_BGD = grad_out_BGD.to(p_BGK.dtype)
            grad_v = torch.matmul(p_BGK.transpose(-1, -2), grad_out_BGD)
            grad_q = (torch.matmul(grad_s_BGK, k_BHSD).float() * D**-0.5).to(q_BGD.dtype)
            grad_k = (torch.matmul(grad_s_BGK.transpose(-1, -2), q_BGD).float() * D**-0.5).to(q_BGD.dtype)
        return grad_q.view(grad_out_BHSD.shape), grad_k, grad_v, None, None


def _batch_slices(batch: int, scores_per_item: int) -> list[tuple[int, int]]:
    """[start, end) slices of a batch whose fp32 scores take about ``CPU_SLICE_BYTES`` (at least one
    item): the softmax's element-wise passes over one slice run in the cores' L2 caches."""
    step = max(1, CPU_SLICE_BYTES // (4 * scores_per_item))
    return [(a, min(a + step, batch)) for a in range(0, batch, step)]


def flash_runs(dtype: torch.dtype | None, head_dim: int | None) -> bool:
    """Whether flash kernels take q of this dtype and head dim (None: not known yet, assumed so):
    16-bit, a head dim that is a multiple of 8 and at most 256."""
    return (dtype is None or dtype in (torch.bfloat16, torch.float16)) and (
        head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)
    )


@functools.lru_cache(maxsize=1)
def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn``."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_causal(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THD: torch.Tensor,
    cu_q_B1: torch.Tensor,
    cu_k_B1: torch.Tensor,
    max_q: int,
    max_k: int,
    sliding_window: int | None,
    *,
    has_gqa: str,
    has_window: bool,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal flash attention of packed sequences (``varlen_attn``): sequence b's queries
    ``cu_q_B1[b]:cu_q_B1[b+1]`` are the last tokens of its keys ``cu_k_B1[b]:cu_k_B1[b+1]`` (the
    causal mask is aligned to the end of the keys, so a chunk after a cached prefix sees that prefix).
    ``cu_*``: int32 boundaries; ``max_q`` / ``max_k``: bounds of the lengths; ``has_gqa`` /
    ``has_window``: this torch's ``varlen_features()``, read outside compiled code. A sliding window
    needs ``has_window``. ``return_lse``: also the log-sum-exp [Hq, T] (a torch whose ``varlen_attn``
    takes ``return_aux``), no gradient through it."""
    from torch.nn.attention.varlen import varlen_attn

    groups = q_THD.shape[1] // k_THD.shape[1]
    if groups > 1 and not has_gqa:  # k/v repeated to the query heads
        k_THD = k_THD.repeat_interleave(groups, dim=1)
        v_THD = v_THD.repeat_interleave(groups, dim=1)
    kw: dict = {"enable_gqa": True} if groups > 1 and has_gqa == GQA_FLAG else {}
    if return_lse:
        from torch.nn.attention.varlen import AuxRequest

        kw["return_aux"] = AuxRequest(lse=True)
    if has_window:  # newer torch: causal (sliding) window as (left, right)
        kw["window_size"] = (-1 if sliding_window is None else sliding_window - 1, 0)
    elif sliding_window is not None:
        raise ValueError("this torch's varlen_attn has no sliding window")
    else:
        kw["is_causal"] = True
    return varlen_attn(q_THD, k_THD, v_THD, cu_q_B1, cu_k_B1, max_q, max_k, **kw)


GQA_FLAG, GQA_NATIVE = "flag", "native"
"""How ``varlen_attn`` takes k/v with fewer heads than q: through its ``enable_gqa`` flag, or as they
are (a torch whose wrapper has no flag but passes them to flash, which supports GQA); "" when it
takes neither (``varlen_causal`` then repeats them)."""


def varlen_features() -> tuple[str, bool]:
    """How this torch's ``varlen_attn`` takes GQA inputs (``GQA_FLAG``, ``GQA_NATIVE`` or "") and
    whether it takes a sliding window (``varlen_causal``'s ``has_gqa`` / ``has_window``)."""
    params = _varlen_params()
    gqa = GQA_FLAG if "enable_gqa" in params else GQA_NATIVE if _native_gqa() else ""
    return gqa, "window_size" in params


_NATIVE_GQA: bool | None = None


def _native_gqa() -> bool:
    """Whether ``varlen_attn`` without an ``enable_gqa`` flag gives, for k/v with fewer heads, what it
    gives them repeated to the query heads, values and gradients (a tiny forward and backward on
    the current CUDA device, once per process; False before the process uses CUDA, which a CPU run
    on a GPU machine never does, and not asked during a CUDA graph capture, whose stream must not run it)."""
    global _NATIVE_GQA
    if _NATIVE_GQA is not None:
        return _NATIVE_GQA
    if not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
        return False
    # the first caller may be the rollout engine's step (inference mode, no grad): the probe's
    # backward needs normal tensors, else it fails and caches False
    with torch.inference_mode(False), torch.enable_grad():
        _NATIVE_GQA = _probe_native_gqa()
    return _NATIVE_GQA


def _probe_native_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(24, h, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for h in (4, 2, 2))
        cu = torch.tensor([0, 9, 24], device="cuda", dtype=torch.int32)
        grads = []
        for expand in (False, True):
            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            k_in, v_in = (x.repeat_interleave(2, dim=1) if expand else x for x in (kk, vv))
            out = varlen_attn(qq, k_in, v_in, cu, cu, 15, 15, window_size=(-1, 0))
            out.float().square().sum().backward()
            grads.append((out.detach(), qq.grad, kk.grad, vv.grad))
        return all(
            a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in zip(*grads)
        )
    except (RuntimeError, ValueError, TypeError):  # a wrapper or kernel that refuses them: repeat
        return False


def varlen_lse_available() -> bool:
    """Whether this torch's ``varlen_attn`` returns its log-sum-exp (``return_aux``), which the flash varlen
    form needs for attention sinks."""
    return varlen_available() and "return_aux" in _varlen_params()


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

        compiled.allow_kinds()  # sliding or full masks, grad or not, static then dynamic: more than dynamo's 8
        _FLEX = torch.compile(flex_attention, dynamic=None)
    return _FLEX
