"""Training forwards that compute a group's common prompt once.

A GRPO batch holds n samples of each prompt, packed one after another, and every sample's prompt
tokens have the same hidden states (a token attends only to what precedes it). ``plan`` finds runs
of adjacent sequences whose prompts (the tokens before the first loss-mask token) are equal and
packs each run as its prompt once, then every sequence's rest: the forward then runs over C
packed rows instead of T tokens. ``SharedPrefixAttention`` gives each rest the prompt's keys and
its own (the rest's queries are the last of those keys), and ``expand_T`` maps every original
token to its packed row, so the [T, D] hidden states the heads and losses read are the unshared
forward's, up to summation order; their gradients flow back summed over the samples that share a
row.

Legend: T = tokens of the batch, C = packed rows, Q = query sequences, K = gathered keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from areno.models.attention import (
    PaddedLayout,
    check_score_terms,
    explicit_attention,
    flash_runs,
    layer_slides,
    padded_layout,
    padded_sdpa,
    varlen_available,
    varlen_causal,
    varlen_features,
)
from areno.models.config import ModelConfig


@dataclass(frozen=True)
class PrefixSharing:
    """Host int64 index tensors of a shared-prompt packing (``plan``)."""

    source_C: torch.Tensor
    """The original token of each packed row."""
    expand_T: torch.Tensor
    """The packed row of each original token."""
    cu_q_B1: torch.Tensor
    """Query sequences: sequence q is rows ``cu_q_B1[q]:cu_q_B1[q+1]`` (a run's prompt, a sequence's
    rest after it, or a sequence that shares nothing)."""
    key_index_K: torch.Tensor
    """Each query sequence's key rows, concatenated in order (``cu_k_B1`` bounds them): a prompt's
    own rows, a rest's prompt rows then its own."""
    cu_k_B1: torch.Tensor

    @property
    def saved_tokens(self) -> int:
        return int(self.expand_T.numel() - self.source_C.numel())


def _prompt_runs(
    input_ids_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, loss_mask_T: torch.Tensor
) -> tuple[list[list[int]], list[int]]:
    """``plan``'s runs of adjacent sequences that share a prompt, and every sequence's prompt length."""
    ids = input_ids_T.numpy()
    cu = cu_seqlens_B1.tolist()
    mask = loss_mask_T.numpy().astype(bool)
    B = len(cu) - 1
    prompt_len = []
    for b in range(B):
        first = np.flatnonzero(mask[cu[b] : cu[b + 1]])
        prompt_len.append(int(first[0]) if first.size else cu[b + 1] - cu[b])
    runs: list[list[int]] = []
    for b in range(B):
        p = prompt_len[b]
        shares = (
            runs
            and p > 0
            and p < cu[b + 1] - cu[b]
            and prompt_len[runs[-1][0]] == p
            and np.array_equal(ids[cu[b] : cu[b] + p], ids[cu[runs[-1][0]] : cu[runs[-1][0]] + p])
        )
        if shares:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs, prompt_len


def shared_prompt_tokens(
    input_ids_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, loss_mask_T: torch.Tensor
) -> list[int]:
    """Per sequence of a packed batch (host tensors), the tokens ``plan`` saves on it: its prompt's length
    where it continues the previous sequence's run, else 0. A micro-batch of sequences i..j of one run
    packs their tokens less ``shared[i+1..j]`` rows (the micro-batch planner's cost)."""
    runs, prompt_len = _prompt_runs(input_ids_T, cu_seqlens_B1, loss_mask_T)
    shared = [0] * len(prompt_len)
    for run in runs:
        for b in run[1:]:
            shared[b] = prompt_len[b]
    return shared


def plan(input_ids_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, loss_mask_T: torch.Tensor) -> PrefixSharing | None:
    """The shared-prompt packing of a packed batch (host tensors), or None when no two adjacent
    sequences share a prompt. A sequence's prompt is its tokens before its first loss-mask token
    (all of it without one); a run shares when every member's prompt has the first member's length
    (at least one token) and ids, and the rest of each member is non-empty."""
    runs, prompt_len = _prompt_runs(input_ids_T, cu_seqlens_B1, loss_mask_T)
    ids = input_ids_T.numpy()
    cu = cu_seqlens_B1.tolist()
    if all(len(run) == 1 for run in runs):
        return None
    source, key_index = [], []
    cu_q, cu_k = [0], [0]
    expand = np.empty(len(ids), dtype=np.int64)
    rows = 0

    def query(key_rows: np.ndarray, n: int) -> None:  # a query sequence over the last n of its keys
        key_index.append(key_rows)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + key_rows.size)

    for run in runs:
        s0 = cu[run[0]]
        p = prompt_len[run[0]] if len(run) > 1 else 0
        prompt_rows = np.arange(rows, rows + p)
        if p:
            source.append(np.arange(s0, s0 + p))
            query(prompt_rows, p)
            rows += p
        for b in run:
            s, e = cu[b], cu[b + 1]
            own = np.arange(rows, rows + e - s - p)
            expand[s : s + p] = prompt_rows
            expand[s + p : e] = own
            source.append(np.arange(s + p, e))
            if own.size:
                query(np.concatenate([prompt_rows, own]), own.size)
            rows += own.size
    as_tensor = lambda parts: torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    return PrefixSharing(
        source_C=as_tensor(source),
        expand_T=torch.from_numpy(expand),
        cu_q_B1=torch.tensor(cu_q, dtype=torch.long),
        key_index_K=as_tensor(key_index),
        cu_k_B1=torch.tensor(cu_k, dtype=torch.long),
    )


def pays_by_default(config: ModelConfig, device_type: str) -> bool:
    """Whether ``train.share_prompts=auto`` shares a group's prompt for ``config`` on ``device_type``: not on a
    GPU where the layers soft-cap their scores (Gemma 2), which ``SharedPrefixAttention`` then attends per
    query sequence in float32 while the unshared forward takes one flex kernel a layer (bench/LOG.md)."""
    return not (device_type == "cuda" and config.attn_logit_softcapping is not None)


class SharedPrefixAttention:
    """The ``AttentionBackend`` of a shared-prompt packing: query sequence q attends causally to
    its gathered keys, its queries being the last of them (flash's varlen kernel with the causal
    mask aligned to the end of the keys on CUDA in 16-bit dtypes; elsewhere SDPA calls over the
    query sequences right-padded into batches by length, with masks: ``attention.padded_layout``).
    ``sliding_window`` / ``window_layers``: as ``PackedCausalAttention``'s (a window-less twin serves the
    other layers where only some slide). ``sinks``: the layers pass sink logits (gpt-oss); ``softcap``: they
    soft-cap their scores (Gemma 2); ``attention.explicit_attention`` applies either per query sequence over its
    gathered keys, except a cap alone on CPU, which the padded batches' explicit attention applies where they
    all fit (``padded_layout(scored=True)``)."""

    def __init__(
        self,
        sharing: PrefixSharing,
        *,
        sliding_window: int | None = None,
        window_layers: tuple[int, ...] | None = None,
        sinks: bool = False,
        softcap: float | None = None,
    ) -> None:
        self.sharing = sharing
        self.sliding_window = sliding_window
        self.sinks = sinks
        self.softcap = softcap
        self.window_layers = window_layers if sliding_window is not None else None
        self._full = (
            None if self.window_layers is None else SharedPrefixAttention(sharing, sinks=sinks, softcap=softcap)
        )
        self._state: tuple | None = None
        self._prepared_for: tuple | None = None

    def prepare(
        self,
        num_tokens: int,
        device: torch.device,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        cuda_impl: str | None = None,
        query_heads: int | None = None,
    ) -> None:
        """Move the index tensors to ``device`` and pick the kernel once per forward (``Decoder.forward``
        calls this before the layers, so compiled layers only read the result). ``cuda_impl`` is
        accepted for ``PackedCausalAttention``'s signature; flex has no shared-prefix mask here.
        ``query_heads``: q's heads, for the padded batches' split (``attention.length_buckets``)."""
        device = torch.device(device)
        if self._full is not None:
            self._full.prepare(num_tokens, device, head_dim, dtype, cuda_impl, query_heads)
        flash = device.type == "cuda" and dtype is not None and flash_runs(dtype, head_dim) and varlen_available()
        # a torch whose varlen kernel has no window takes the padded batches, whose masks carry it
        flash = flash and (self.sliding_window is None or varlen_features()[1])
        if self._prepared_for == (num_tokens, device, flash):
            return
        sh = self.sharing
        if int(sh.cu_q_B1[-1]) != num_tokens:
            raise ValueError(
                f"the shared-prefix packing covers {int(sh.cu_q_B1[-1])} rows, the forward has {num_tokens}"
            )
        seq_q = sh.cu_q_B1[1:] - sh.cu_q_B1[:-1]
        seq_k = sh.cu_k_B1[1:] - sh.cu_k_B1[:-1]
        scored = self.sinks or self.softcap is not None
        # a soft-cap alone, on CPU: explicit padded batches with the cap, where they all fit
        capped = self.softcap is not None and not self.sinks and device.type == "cpu"
        layout = None
        if capped or not (flash or scored):
            layout = padded_layout(
                sh.cu_q_B1.numpy(),
                sh.cu_k_B1.numpy(),
                device,
                end_aligned=True,
                key_rows=sh.key_index_K.numpy(),
                query_heads=query_heads or 1,
                dtype=dtype,
                window=self.sliding_window,
                scored=self.softcap is not None,
            )
        if layout is not None and (not scored or layout.explicit_everywhere):
            self._state = ("padded", layout)
        elif scored:  # per query sequence: its rows, and where its keys come from
            keys = sh.key_index_K.to(device, non_blocking=True)
            self._state = ("explicit", sh.cu_q_B1.tolist(), sh.cu_k_B1.tolist(), keys)
        else:
            i32 = lambda cu: cu.to(device=device, dtype=torch.int32, non_blocking=True)
            # varlen_features inspects a signature: read here, not inside compiled layers
            self._state = (
                "varlen",
                sh.key_index_K.to(device, non_blocking=True),
                i32(sh.cu_q_B1),
                i32(sh.cu_k_B1),
                int(seq_q.max()),
                int(seq_k.max()),
                *varlen_features(),
            )
        self._prepared_for = (num_tokens, device, flash)

    @property
    def padded(self) -> PaddedLayout | None:
        """The padded batches ``prepare`` built (None before it, or on the varlen path)."""
        return self._state[1] if self._state is not None and self._state[0] == "padded" else None

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
        if self._state is None:
            self.prepare(q_THD.shape[0], q_THD.device, q_THD.shape[-1], q_THD.dtype, query_heads=q_THD.shape[1])
        if self._state[0] == "explicit":
            _, cu_q, cu_k, keys_K = self._state
            outs = []
            for b in range(len(cu_q) - 1):
                if cu_q[b + 1] == cu_q[b]:
                    continue
                rows_K = keys_K[cu_k[b] : cu_k[b + 1]]
                k_KHD, v_KHD = k_THD.index_select(0, rows_K), v_THD.index_select(0, rows_K)
                q_QHD = q_THD[cu_q[b] : cu_q[b + 1]]
                outs.append(explicit_attention(q_QHD, k_KHD, v_KHD, sinks_H, self.sliding_window, softcap=softcap))
            return torch.cat(outs) if outs else torch.empty_like(q_THD)
        if self._state[0] == "varlen":
            _, key_index, cu_q, cu_k, max_q, max_k, has_gqa, has_window = self._state
            k_KHD, v_KHD = k_THD.index_select(0, key_index), v_THD.index_select(0, key_index)
            window = self.sliding_window
            return varlen_causal(
                q_THD, k_KHD, v_KHD, cu_q, cu_k, max_q, max_k, window, has_gqa=has_gqa, has_window=has_window
            )
        # the layout gathers each padded key slot from k and v directly
        return padded_sdpa(q_THD, k_THD, v_THD, self._state[1], softcap)
