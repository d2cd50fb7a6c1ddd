"""Paged-KV attention backend that plugs into ``Decoder.forward(..., attn=...)``.

One engine step packs every scheduled sequence's new tokens into ``T`` tokens: first the *decode*
group (sequences with exactly one new token), then the *prefill* group (chunks of several tokens).
For each layer the backend (1) writes the new K/V into their cache slots, then (2) attends every
query to its sequence's cached keys ``0..position``. Because all writes of a layer precede all reads
of that layer, a sequence may read prefix blocks another sequence writes in the same step.

Kernels: keys are gathered from the slot tensors through the block tables and fed to
``scaled_dot_product_attention`` with a boolean mask (GQA via ``enable_gqa``); on CUDA this runs the
memory-efficient SDPA kernel, on CPU the fused CPU kernel. Decode queries form a ``[Bd, Hq, 1, Dh]``
batch, prefill chunks a padded ``[Bp, Hq, Qmax, Dh]`` batch, so a long prefill chunk never pads the
decode rows.
Pure-decode steps built by ``for_decode(..., decode_attention="paged")`` skip the gather: they
attend over the pool directly through the block tables (``paged_decode.py``). Steps built by
``for_prefill`` (the prefill CUDA graphs, ``prefill_graph.py``) gather each sequence's keys
end to end and attend with one flash varlen call, no padding and no mask.

Attention sinks (gpt-oss: ``sinks_H``, a logit per query head that joins every softmax's denominator
with no value) are served by every form: SDPA has none, so the gathered forms then attend through an
explicit fp32 softmax with the sink as one more column (``_explicit_attention``, ``_cpu_decode_attention``);
the paged decode kernels start their online softmax from it; the flash varlen call scales its output
by ``sigmoid(lse - sink)``, the mass the sink leaves the keys (``varlen_causal_sinks``). Soft-capped
scores (Gemma 2: ``softcap``, each scaled score s as ``softcap * tanh(s / softcap)`` before the mask) take
the same explicit forms (``_explicit_attention``; the CPU decode form caps before adding its mask) and the
paged decode kernels cap each tile's scores; flash has no cap, so a prefill CUDA graph refuses it (the
engine does not capture prefill graphs for such a model, ``PrefillGraphRunner.supported``).

Legend: T = packed new tokens, B = sequences, L = key positions (padded), Q = query positions
(padded), N = blocks per sequence (padded), Hq/Hkv = query/KV heads, Dh = head dim, S = KV slots,
K = KV heads and C = key capacity of ``DecodeCarry``'s copies (in the CPU decode form, ``N``-prefixed
names there count B * K rows).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from areno.models import fused_ops
from areno.models.attention import (
    HeadNorms,
    layer_slides,
    sink_softmax,
    varlen_causal,
    varlen_features,
    varlen_lse_available,
)
from areno.models.eager_ops import soft_cap
from areno.rollout.fused_loop import new_token_slots_torch
from areno.rollout.kv_cache import KVCache
from areno.rollout.paged_decode import paged_decode, paged_decode_rotary, triton_available


@dataclass
class _Group:
    """Key gather indices and mask of one query group."""

    kv_slots_BL: torch.Tensor
    """long [B, L] cache slot of each key position (padding points at slot 0, masked out)."""
    mask_B1QL: torch.Tensor
    """bool [B, 1, Q, L] True where the query may attend the key."""
    q_index_BQ: torch.Tensor | None = None
    """long [B, Q] row of each padded query in the group's packed tokens (prefill only)."""
    grouped_mask_B1ML: torch.Tensor | None = None
    """bool [B, 1, G * Q, L]: ``mask_B1QL`` repeated for the G query heads of one KV head (the grouped
    prefill form; built at the step's first layer, reused by the others)."""
    q_real_R: torch.Tensor | None = None
    """long [R] flat index (into B * Q) of each real query, in packed-token order (prefill only):
    picks the outputs with ``index_select`` (a boolean-mask index would sync the host with the device
    at every layer)."""
    cpu_rows_R: torch.Tensor | None = None
    """long [B * K * L]: row of ``k_S.reshape(-1, Dh)`` of each (sequence, KV head, key) (CPU decode)."""
    cpu_bias_NQL: torch.Tensor | None = None
    """[B * K, Q, L] additive mask (0 / -inf) of the CPU decode form."""
    carry: DecodeCarry | None = None
    """CPU pure-decode steps: the K/V gathered by the previous step, kept across steps (``DecodeCarry``)."""
    extend: bool = False
    """Whether this step extends ``carry`` (else it gathers afresh and keeps that)."""
    pos_B: torch.Tensor | None = None
    """long [B] position of each decode row's new token (``carry`` only)."""
    carry_rows_N: torch.Tensor | None = None
    """long [B * K]: row of the carried ``[B * K * L, Dh]`` K/V of each (sequence, KV head)'s new token."""


class DecodeCarry:
    """CPU decode attention across pure-decode steps: each layer's K/V of the decode rows as a
    previous step gathered them from the pool (head-major ``[B * K, capacity, Dh]``, the first ``L``
    keys in use), kept and extended by each step's new token instead of gathered again: measured
    ~0.3 ms per layer and tensor for 32 rows of 4 KV heads over ~150 keys on two cores, ~10% of the
    step (bench/LOG.md). A fresh gather happens when the batch's rows change.

    Valid only while nothing but these steps wrote the rows' slots: ``begin`` extends only when the
    batch has the same rows with the same blocks for every key already carried (a row may have
    gained a block) and every context grew by exactly one token; any forward that does not extend
    it (prefill chunks, a mixed step, the paged decode form) and the pool's ``allocate``/``release``
    drop it. ``max_bytes`` bounds the copies (a batch beyond it gathers per step as before). The
    values are the pool's: the same attention as the gathered form, bit for bit (test)."""

    def __init__(self, num_layers: int, capacity: int, max_bytes: int) -> None:
        self.num_layers = num_layers
        self.capacity = capacity
        """Most keys per (row, KV head) a copy may hold: the engine's longest block table, in keys."""
        self.max_bytes = max_bytes
        self.keys = 0
        """Keys per (row, KV head) of the current batch's copies: sized at each fresh gather for the
        batch's tables and the growth after them, not the longest table the engine allows (at a
        long ``max_model_len`` that would exceed ``max_bytes`` and turn the carry off)."""
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._bt_BN: torch.Tensor | None = None
        self._ctx_B: torch.Tensor | None = None
        self.steps = {"extended": 0, "gathered": 0}
        """Pure-decode steps that extended the copies, and that gathered afresh (observability, tests)."""

    def invalidate(self) -> None:
        self.k.clear()
        self.v.clear()
        self._bt_BN = self._ctx_B = None

    def begin(
        self,
        bt_BN: torch.Tensor,
        ctx_B: torch.Tensor,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        itemsize: int,
        final_keys: int | None = None,
    ) -> bool | None:
        """Before a pure-decode step: True to extend the carried K/V, False to gather afresh and
        carry that, None when this batch's copies would exceed ``max_bytes`` or its tables the
        capacity (no carry). ``final_keys``: keys the longest row can reach before its length limit
        (a fresh gather leaves no room past it)."""
        B, N = bt_BN.shape
        need = N * block_size
        if need > self.capacity:
            self.invalidate()
            return None
        prev_bt, prev_ctx = self._bt_BN, self._ctx_B
        extend = (
            prev_bt is not None
            and prev_bt.shape[0] == B
            and prev_bt.shape[1] <= N
            and need <= self.keys
            and torch.equal(prev_ctx + 1, ctx_B)
        )
        if extend:  # the blocks of every key carried so far are unchanged (new blocks may follow)
            n_old = prev_bt.shape[1]
            used_BN = torch.arange(n_old)[None, :] <= (prev_ctx - 1)[:, None] // block_size
            extend = bool(((bt_BN[:, :n_old] == prev_bt) | ~used_BN).all())
        if not extend:
            self.k.clear()
            self.v.clear()
            # room for the tables to double (or grow by 8 blocks) before the next fresh gather, but
            # none past the rows' limits: zeroing room no key reaches cost a short rollout (7 tokens
            # after a 10-token prompt) more than its attention
            per_key = 2 * self.num_layers * B * num_kv_heads * head_dim * itemsize
            room = max(2 * need, need + 8 * block_size)
            if final_keys is not None:
                room = min(room, max(need, -(-final_keys // block_size) * block_size))
            keys = min(self.capacity, room)
            if per_key * keys > self.max_bytes:
                keys = need
            if per_key * keys > self.max_bytes:
                self.invalidate()
                return None
            self.keys = keys
        self.steps["extended" if extend else "gathered"] += 1
        self._bt_BN, self._ctx_B = bt_BN.clone(), ctx_B.clone()  # the engine advances ctx in place
        return extend


DECODE_CARRY_MAX_BYTES = 1 << 28
"""Most bytes of carried K/V copies (``DecodeCarry``) over all layers: 256 MiB."""


@dataclass
class _PagedDecode:
    """What the paged decode path reads per layer (device tensors, static shapes)."""

    bt_BN: torch.Tensor
    """long [B, N] block tables (padding: any valid block id)."""
    ctx_B: torch.Tensor
    """long [B] context length including the new token."""
    sliding_window: int | None = None


DECODE_ATTENTION = ("gather", "paged")
"""Decode attention implementations (``RolloutEngineConfig.decode_attention``)."""


@dataclass
class _VarlenPrefill:
    """A prefill step's attention as one flash varlen call (``PagedAttention.for_prefill``)."""

    kv_slots_L: torch.Tensor
    """long [L]: the pool slot of every key, sequence after sequence (its cached prefix, then its chunk)."""
    cu_q_B1: torch.Tensor
    cu_k_B1: torch.Tensor
    """int32 boundaries of each sequence's queries (this step's tokens) and keys."""
    max_q: int
    max_k: int
    sliding_window: int | None
    has_gqa: str
    has_window: bool


@dataclass
class SeqChunk:
    """One sequence's share of a step: its block table and the token range computed now."""

    block_table: list[int]
    start: int
    """Tokens already in the cache before this step (the chunk's first position)."""
    num_new: int


class LayerWindowAttention:
    """A step's attention where only some layers slide (OLMo 3; Qwen's ``max_window_layers``): the
    ``window_layers`` attend through one ``PagedAttention`` with the window, the others through one
    without, over the same pools and slots (each layer writes its K/V through the one it calls)."""

    def __init__(self, full: PagedAttention, window: PagedAttention, window_layers: tuple[int, ...]) -> None:
        self.full, self.window = full, window
        self.window_layers = frozenset(window_layers)

    def _of(self, layer_idx: int, windowed: bool | None) -> PagedAttention:
        return self.window if layer_slides(layer_idx, windowed, self.window_layers) else self.full

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
        return self._of(layer_idx, windowed)(layer_idx, q_THD, k_THD, v_THD, sinks_H, softcap)

    def attend_rotary(
        self, layer_idx: int, *args: Any, windowed: bool | None = None, **kwargs: Any
    ) -> torch.Tensor | None:
        """``PagedAttention.attend_rotary`` of the layer's kind."""
        return self._of(layer_idx, windowed).attend_rotary(layer_idx, *args, **kwargs)


def _block_tables_BN(chunks: list[SeqChunk]) -> torch.Tensor:
    n_max = max(len(c.block_table) for c in chunks)
    return torch.tensor([c.block_table + [0] * (n_max - len(c.block_table)) for c in chunks], dtype=torch.long)


class PagedAttention:
    """Per-step attention backend; build with ``PagedAttention.build`` then pass as ``attn``."""

    GROUPED_DECODE: bool = True
    """Decode queries of one KV head as one group (see ``__call__``): on CUDA the memory-efficient
    kernel then takes the masked call; on CPU it is 15-30% faster than ``enable_gqa`` (measured)."""

    def __init__(
        self,
        cache: KVCache,
        slot_mapping_T: torch.Tensor,
        num_decode: int,
        decode: _Group | None,
        prefill: _Group | None,
        paged: _PagedDecode | None = None,
        varlen: _VarlenPrefill | None = None,
    ) -> None:
        self.cache = cache
        self.slot_mapping_T = slot_mapping_T
        self.num_decode = num_decode
        self.decode = decode
        self.prefill = prefill
        self.paged = paged
        """Set under ``decode_attention="paged"``: the decode rows (the first ``num_decode``; all of a
        pure-decode step, or those of a mixed step beside its prefill chunks) attend over the pool
        directly instead of through ``decode``'s gathered keys."""
        self.varlen = varlen
        """Set by ``for_prefill``: every row a chunk (decode rows of one token), one flash varlen call."""

    @classmethod
    def build(
        cls,
        cache: KVCache,
        chunks: list[SeqChunk],
        device: torch.device,
        sliding_window: int | None = None,
        bt_BN: torch.Tensor | None = None,
        *,
        window_layers: tuple[int, ...] | None = None,
    ) -> PagedAttention | LayerWindowAttention:
        """``chunks`` must list the decode sequences (``num_new == 1``) first. With
        ``sliding_window`` a query at position p sees keys p - sliding_window < j <= p (Mistral), in the
        ``window_layers`` only where given (``LayerWindowAttention``). ``bt_BN``: the chunks' block
        tables as a CPU tensor (any padding id; built from the chunks when None)."""
        if sliding_window is not None and window_layers is not None:
            return LayerWindowAttention(
                cls.build(cache, chunks, device, None, bt_BN), cls.build(cache, chunks, device, sliding_window, bt_BN),
                window_layers,
            )  # fmt: skip
        bs = cache.block_size
        num_decode = 0
        while num_decode < len(chunks) and chunks[num_decode].num_new == 1:
            num_decode += 1
        assert all(c.num_new > 1 for c in chunks[num_decode:]), "decode chunks must come first"
        if bt_BN is None:
            bt_BN = _block_tables_BN(chunks)
        starts_B = torch.tensor([c.start for c in chunks], dtype=torch.long)
        new_B = torch.tensor([c.num_new for c in chunks], dtype=torch.long)
        # Position of every new token and its cache slot.
        seq_T = torch.repeat_interleave(torch.arange(len(chunks)), new_B)
        first_T = torch.repeat_interleave(torch.cumsum(new_B, 0) - new_B, new_B)
        pos_T = starts_B[seq_T] + torch.arange(int(new_B.sum())) - first_T
        slot_T = bt_BN[seq_T, pos_T // bs] * bs + pos_T % bs

        decode = prefill = None
        if num_decode:
            ctx_B = starts_B[:num_decode] + 1
            decode = cls._group(bt_BN[:num_decode], ctx_B, (ctx_B - 1)[:, None], bs, sliding_window)
        if num_decode < len(chunks):
            p_new_B = new_B[num_decode:]
            q_max = int(p_new_B.max())
            q_pos_Q = torch.arange(q_max)
            q_valid_BQ = q_pos_Q[None, :] < p_new_B[:, None]
            p_first_B = torch.cumsum(p_new_B, 0) - p_new_B
            q_index_BQ = torch.where(q_valid_BQ, p_first_B[:, None] + q_pos_Q[None, :], 0)
            # Padding queries sit at position 0: they attend key 0 only (never a fully masked row).
            qpos_BQ = torch.where(q_valid_BQ, starts_B[num_decode:, None] + q_pos_Q[None, :], 0)
            prefill = cls._group(bt_BN[num_decode:], starts_B[num_decode:] + p_new_B, qpos_BQ, bs, sliding_window)
            prefill.q_index_BQ = q_index_BQ
            prefill.q_real_R = torch.nonzero(q_valid_BQ.reshape(-1)).squeeze(1)
        to = dict(device=device, non_blocking=True)
        for g in (decode, prefill):
            if g is not None:
                g.kv_slots_BL, g.mask_B1QL = g.kv_slots_BL.to(**to), g.mask_B1QL.to(**to)
                if g.q_index_BQ is not None:
                    g.q_index_BQ, g.q_real_R = g.q_index_BQ.to(**to), g.q_real_R.to(**to)
        return cls(cache, slot_T.to(**to), num_decode, decode, prefill)

    @classmethod
    def for_decode(
        cls,
        cache: KVCache,
        bt_BN: torch.Tensor,
        ctx_B: torch.Tensor,
        sliding_window: int | None = None,
        kv_slots_BL: torch.Tensor | None = None,
        decode_attention: str = "gather",
        carry: bool = False,
        slot_B: torch.Tensor | None = None,
        final_keys: int | None = None,
        *,
        window_layers: tuple[int, ...] | None = None,
    ) -> PagedAttention | LayerWindowAttention:
        """A pure-decode step from device tensors only (static shapes: usable inside a CUDA graph).

        ``bt_BN``: block tables padded with any block id (padding keys are masked); ``ctx_B``: context
        length including the new token (its position is ``ctx - 1``). A position past the table's
        ``N`` blocks writes its K/V to the scratch block (rows the engine runs past their end in a
        multi-step decode). ``kv_slots_BL``: the slots of every key (``decode_kv_slots``), when the
        caller reuses them across steps. ``decode_attention``: ``"gather"`` copies every key into a
        dense [B, L] batch for SDPA; ``"paged"`` reads K/V straight from the pool
        (``paged_decode.py``: Triton on CUDA, a chunked torch loop elsewhere). ``carry``: a
        pure-decode step of the gathered form on CPU may extend the keys gathered by the previous
        step (``cache.decode_carry``, ``DecodeCarry``) instead of gathering them again; ``final_keys``:
        the longest row's length limit, which bounds the carried copies. ``slot_B``: the new tokens'
        slots when the caller has them (``fused_loop.decode_slots``). ``window_layers``: the layers the
        window applies to where only some slide (``LayerWindowAttention``; both kinds of layer extend their
        own carried copies of one carry, whose step begins once)."""
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        if sliding_window is not None and window_layers is not None:
            full = cls.for_decode(cache, bt_BN, ctx_B, None, kv_slots_BL, decode_attention, carry, slot_B, final_keys)
            slots_BL = kv_slots_BL if full.decode is None else full.decode.kv_slots_BL
            window = cls.for_decode(
                cache, bt_BN, ctx_B, sliding_window, slots_BL, decode_attention, slot_B=full.slot_mapping_T
            )
            if full.decode is not None and full.decode.carry is not None:
                g, f = window.decode, full.decode
                g.carry, g.extend, g.pos_B = f.carry, f.extend, f.pos_B
            return LayerWindowAttention(full, window, window_layers)
        bs = cache.block_size
        N = bt_BN.shape[1]
        if slot_B is None:
            slot_B = new_token_slots_torch(bt_BN, ctx_B, bs, cache.scratch_block * bs)
        if decode_attention == "paged":
            paged = _PagedDecode(bt_BN=bt_BN, ctx_B=ctx_B, sliding_window=sliding_window)
            return cls(cache, slot_B, bt_BN.shape[0], None, None, paged)
        pos_B = ctx_B - 1
        key_L = torch.arange(N * bs, device=bt_BN.device)
        if kv_slots_BL is None:
            kv_slots_BL = cls.decode_kv_slots(bt_BN, bs)
        mask_BL = key_L[None, :] <= pos_B[:, None]
        if sliding_window is not None:
            mask_BL &= key_L[None, :] > pos_B[:, None] - sliding_window
        group = _Group(kv_slots_BL=kv_slots_BL, mask_B1QL=mask_BL[:, None, None, :])
        dc = cache.decode_carry
        if carry and dc is not None and bt_BN.device.type == "cpu" and CPU_DECODE_MATMUL:
            extend = dc.begin(bt_BN, ctx_B, cache.num_kv_heads, cache.head_dim, bs, cache.dtype.itemsize, final_keys)
            if extend is not None:
                group.carry, group.extend, group.pos_B = dc, extend, pos_B
        return cls(cache, slot_B, bt_BN.shape[0], group, None)

    @classmethod
    def for_prefill(
        cls,
        cache: KVCache,
        slot_T: torch.Tensor,
        kv_slots_L: torch.Tensor,
        cu_q_B1: torch.Tensor,
        cu_k_B1: torch.Tensor,
        max_q: int,
        max_k: int,
        sliding_window: int | None = None,
        *,
        window_layers: tuple[int, ...] | None = None,
    ) -> PagedAttention | LayerWindowAttention:
        """A step of prompt chunks (decode rows as one-token chunks) from device tensors only (static
        shapes: usable inside a CUDA graph; CUDA with 16-bit K/V and ``varlen_available()``). Each
        layer writes the step's K/V at ``slot_T``, gathers every sequence's keys at ``kv_slots_L`` (its
        cached prefix and its chunk, sequence after sequence) and attends with one ``varlen_causal``
        call (``cu_q_B1`` / ``cu_k_B1``: int32 boundaries; ``max_q`` / ``max_k``: bounds of the
        lengths). The queries of a sequence are the last of its keys, so a chunk sees its prefix; a
        sequence with queries and no keys gets 0. ``window_layers``: as ``build``'s."""
        if sliding_window is not None and window_layers is not None:
            args = (cache, slot_T, kv_slots_L, cu_q_B1, cu_k_B1, max_q, max_k)
            return LayerWindowAttention(cls.for_prefill(*args), cls.for_prefill(*args, sliding_window), window_layers)
        has_gqa, has_window = varlen_features()
        varlen = _VarlenPrefill(kv_slots_L, cu_q_B1, cu_k_B1, max_q, max_k, sliding_window, has_gqa, has_window)
        return cls(cache, slot_T, 0, None, None, varlen=varlen)

    @classmethod
    def mixed(
        cls, dec: PagedAttention | LayerWindowAttention, pre: PagedAttention | LayerWindowAttention
    ) -> PagedAttention | LayerWindowAttention:
        """One step of ``dec``'s decode rows (``for_decode``) then ``pre``'s prompt chunks (``build``),
        each kind of layer apart where only some slide."""
        if isinstance(dec, LayerWindowAttention):
            return LayerWindowAttention(
                cls.mixed(dec.full, pre.full), cls.mixed(dec.window, pre.window), tuple(dec.window_layers)
            )
        slots_T = torch.cat((dec.slot_mapping_T, pre.slot_mapping_T))
        return cls(dec.cache, slots_T, dec.num_decode, dec.decode, pre.prefill, dec.paged)

    @staticmethod
    def decode_kv_slots(bt_BN: torch.Tensor, block_size: int) -> torch.Tensor:
        """long [B, N * block_size]: the cache slot of every key position of the block tables."""
        key_L = torch.arange(bt_BN.shape[1] * block_size, device=bt_BN.device)
        return bt_BN[:, key_L // block_size] * block_size + key_L % block_size

    @staticmethod
    def _group(bt_BN: torch.Tensor, ctx_B: torch.Tensor, qpos_BQ: torch.Tensor, bs: int, window: int | None) -> _Group:
        L = int(ctx_B.max())
        key_L = torch.arange(L)
        kv_slots_BL = bt_BN[:, key_L // bs] * bs + key_L % bs
        kv_slots_BL = torch.where(key_L[None, :] < ctx_B[:, None], kv_slots_BL, 0)
        mask_BQL = key_L[None, None, :] <= qpos_BQ[:, :, None]
        if window is not None:
            mask_BQL &= key_L[None, None, :] > qpos_BQ[:, :, None] - window
        return _Group(kv_slots_BL=kv_slots_BL, mask_B1QL=mask_BQL[:, None])

    def __call__(
        self,
        layer_idx: int,
        q_THD: torch.Tensor,
        k_THD: torch.Tensor,
        v_THD: torch.Tensor,
        sinks_H: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Writes the step's K/V, then attends. ``sinks_H``: [Hq] sink logits of this rank's query
        heads (gpt-oss), or None; ``softcap``: Gemma 2's score cap, or None."""
        k_S, v_S = self.cache.k_S[layer_idx], self.cache.v_S[layer_idx]
        k_TKD, v_TKD = k_THD.to(k_S.dtype), v_THD.to(v_S.dtype)
        if fused_ops.write_kv_fits(k_TKD, v_TKD, k_S, v_S):
            fused_ops.write_kv(k_TKD, v_TKD, k_S, v_S, self.slot_mapping_T)  # one kernel for both
        else:
            k_S.index_copy_(0, self.slot_mapping_T, k_TKD)
            v_S.index_copy_(0, self.slot_mapping_T, v_TKD)
        return self._attend(layer_idx, q_THD, k_TKD, v_TKD, sinks_H, softcap)

    def attend_rotary(
        self,
        layer_idx: int,
        qkv_TN: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        cos_TF: torch.Tensor,
        sin_TF: torch.Tensor,
        qk_norm: HeadNorms | None = None,
        sinks_H: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor | None:
        """Attention of a fused q/k/v product before RoPE (``AttentionBackend``'s optional form): q and
        k rotated and K/V written into the pools by one kernel (``fused_ops.rope_write_kv``) instead
        of a RoPE and a pool write. None where that kernel does not serve (the caller then rotates and
        calls the backend), or where the CPU decode carry needs this step's K/V as tensors.
        ``qk_norm``: q's and k's per-head norms before RoPE, served in a pure paged decode step only
        (inside the decode kernel); None elsewhere. ``sinks_H``, ``softcap``: as ``__call__``'s."""
        k_S, v_S = self.cache.k_S[layer_idx], self.cache.v_S[layer_idx]
        if (self.decode is not None and self.decode.carry is not None) or not fused_ops.rope_write_fits(
            qkv_TN, cos_TF, k_S, v_S
        ):
            return None
        pure_paged = self.paged is not None and self.prefill is None and triton_available()
        if qk_norm is not None and not pure_paged:
            return None
        if pure_paged:
            # a pure paged decode step: RoPE and the K/V write inside the decode kernel (one launch fewer)
            p = self.paged
            return paged_decode_rotary(
                qkv_TN,
                num_q_heads,
                num_kv_heads,
                cos_TF,
                sin_TF,
                k_S,
                v_S,
                self.slot_mapping_T,
                p.bt_BN,
                p.ctx_B,
                self.cache.block_size,
                p.sliding_window,
                qk_norm=qk_norm,
                sinks_H=sinks_H,
                softcap=softcap,
            )
        q_THD = fused_ops.rope_write_kv(
            qkv_TN, num_q_heads, num_kv_heads, cos_TF, sin_TF, k_S, v_S, self.slot_mapping_T
        )
        return self._attend(layer_idx, q_THD, None, None, sinks_H, softcap)

    def _attend(
        self,
        layer_idx: int,
        q_THD: torch.Tensor,
        k_TKD: torch.Tensor | None,
        v_TKD: torch.Tensor | None,
        sinks_H: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of this step's queries once its K/V are in the pools (``k_TKD`` / ``v_TKD``: those
        K/V as tensors, which only the CPU decode carry reads; None when the carry is off). Each form's
        q rows are query heads grouped by KV head (h = kv_head * G + g) or not; its ``sinks_HQ`` (the
        sink of each of q's (head, query row), [H, Q] or [H, 1]) follows that layout. ``softcap``: every
        form caps its scores (the flash varlen form has no cap and refuses one)."""
        k_S, v_S = self.cache.k_S[layer_idx], self.cache.v_S[layer_idx]
        nd = self.num_decode
        dc = self.cache.decode_carry
        if dc is not None and (self.decode is None or self.decode.carry is None or self.prefill is not None):
            dc.invalidate()  # the pool changed under a step that does not extend the carried K/V
        if self.varlen is not None:
            p = self.varlen
            k_LKD = k_S.index_select(0, p.kv_slots_L).to(q_THD.dtype)
            v_LKD = v_S.index_select(0, p.kv_slots_L).to(q_THD.dtype)
            if softcap is not None:
                raise ValueError(
                    "soft-capped attention scores (Gemma 2) in a prefill CUDA graph: flash's varlen kernel has no "
                    "cap; set rollout.prefill_cuda_graphs=false"
                )
            if sinks_H is not None:
                return varlen_causal_sinks(q_THD, k_LKD, v_LKD, p, sinks_H)
            return varlen_causal(
                q_THD, k_LKD, v_LKD, p.cu_q_B1, p.cu_k_B1, p.max_q, p.max_k, p.sliding_window,
                has_gqa=p.has_gqa, has_window=p.has_window,
            )  # fmt: skip
        outs = []
        if self.paged is not None:  # the decode rows (all rows of a pure-decode step) over the pool
            p = self.paged
            out_BHD = paged_decode(
                q_THD[:nd], k_S, v_S, p.bt_BN, p.ctx_B, self.cache.block_size, p.sliding_window, sinks_H, softcap
            )
            if self.prefill is None:
                return out_BHD
            outs.append(out_BHD)
        elif self.decode is not None:
            g = self.decode
            Hq, Hkv = q_THD.shape[1], k_S.shape[1]
            if self.GROUPED_DECODE and Hq != Hkv:
                # GQA decode as Hkv heads of G = Hq / Hkv queries each (query head h reads KV head
                # h // G): no enable_gqa, so CUDA's memory-efficient kernel takes the masked call
                # (it rejects GQA and flash rejects masks: enable_gqa with a mask runs the math
                # kernel, which expands K/V G-fold). Same attention up to summation order.
                q_BKGD = q_THD[:nd].reshape(nd, Hkv, Hq // Hkv, -1)
                sinks_KG = None if sinks_H is None else sinks_H.view(Hkv, Hq // Hkv)
                if g.carry is not None:
                    out_BKGD = _cpu_decode_attention(
                        q_BKGD, k_S, v_S, g, layer_idx, k_TKD[:nd], v_TKD[:nd], sinks_KG, softcap
                    )
                else:
                    out_BKGD = self._sdpa(q_BKGD, k_S, v_S, g, decode=True, sinks_HQ=sinks_KG, softcap=softcap)
                outs.append(out_BKGD.reshape(nd, Hq, -1))
            else:
                q_BH1D = q_THD[:nd].unsqueeze(2)  # [Bd, Hq, 1, Dh]
                sinks_H1 = None if sinks_H is None else sinks_H[:, None]
                if g.carry is not None and Hq == Hkv:
                    out_BH1D = _cpu_decode_attention(
                        q_BH1D, k_S, v_S, g, layer_idx, k_TKD[:nd], v_TKD[:nd], sinks_H1, softcap
                    )
                else:
                    out_BH1D = self._sdpa(q_BH1D, k_S, v_S, g, decode=True, sinks_HQ=sinks_H1, softcap=softcap)
                outs.append(out_BH1D.squeeze(2))
        if self.prefill is not None:
            g = self.prefill
            q_BHQD = q_THD[nd:][g.q_index_BQ].transpose(1, 2)
            B, H, Q, D = q_BHQD.shape
            Hkv = k_S.shape[1]
            if self.GROUPED_DECODE and H != Hkv:
                # As for decode: the G query heads of one KV head as G x Q queries of that head, the
                # mask repeated per head, so no enable_gqa (which, with a mask, leaves CUDA only the
                # math kernel).
                G = H // Hkv
                if g.grouped_mask_B1ML is None:
                    g.grouped_mask_B1ML = g.mask_B1QL.repeat(1, 1, G, 1)
                # row g * Q + q of KV head k is query head k * G + g
                sinks_KM = None if sinks_H is None else sinks_H.view(Hkv, G).repeat_interleave(Q, dim=1)
                out_BKMD = self._sdpa(
                    q_BHQD.reshape(B, Hkv, G * Q, D),
                    k_S,
                    v_S,
                    g,
                    g.grouped_mask_B1ML,
                    sinks_HQ=sinks_KM,
                    softcap=softcap,
                )
                out_BHQD = out_BKMD.reshape(B, H, Q, D)
            else:
                sinks_H1 = None if sinks_H is None else sinks_H[:, None]
                out_BHQD = self._sdpa(q_BHQD, k_S, v_S, g, sinks_HQ=sinks_H1, softcap=softcap)
            outs.append(out_BHQD.transpose(1, 2).reshape(B * Q, H, D).index_select(0, g.q_real_R))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    @staticmethod
    def _sdpa(
        q_BHQD: torch.Tensor,
        k_S: torch.Tensor,
        v_S: torch.Tensor,
        g: _Group,
        mask_B1QL: torch.Tensor | None = None,
        decode: bool = False,
        sinks_HQ: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``sinks_HQ``: the sink logit of each of q's (head, query row), [H, Q] or [H, 1]; or None.
        ``softcap``: Gemma 2's score cap, or None."""
        if decode and CPU_DECODE_MATMUL and q_BHQD.device.type == "cpu" and q_BHQD.shape[1] == k_S.shape[1]:
            return _cpu_decode_attention(q_BHQD, k_S, v_S, g, sinks_KQ=sinks_HQ, softcap=softcap)
        # index_select over the flattened slots: same values as k_S[kv_slots_BL], about 2x faster
        # on CPU than advanced indexing (and a single gather kernel on CUDA).
        B, L = g.kv_slots_BL.shape
        flat_slots = g.kv_slots_BL.reshape(-1)
        k_BHLD = k_S.index_select(0, flat_slots).view(B, L, *k_S.shape[1:]).transpose(1, 2)
        v_BHLD = v_S.index_select(0, flat_slots).view(B, L, *v_S.shape[1:]).transpose(1, 2)
        if sinks_HQ is not None or softcap is not None:
            mask = g.mask_B1QL if mask_B1QL is None else mask_B1QL
            return _explicit_attention(q_BHQD, k_BHLD, v_BHLD, mask, sinks_HQ, softcap)
        with _sdpa_backends(q_BHQD.device):
            return F.scaled_dot_product_attention(
                q_BHQD,
                k_BHLD.to(q_BHQD.dtype),
                v_BHLD.to(q_BHQD.dtype),
                attn_mask=g.mask_B1QL if mask_B1QL is None else mask_B1QL,
                enable_gqa=q_BHQD.shape[1] != k_BHLD.shape[1],
            )


CPU_DECODE_MATMUL = True
"""CPU decode rows attend through ``_cpu_decode_attention`` (head-major gather, two batched matmuls:
the faster form on CPU). An engine internal, not a setting: False sends them through the gathered
SDPA that every other row takes, for tests and benches that compare the two."""


def _cpu_decode_attention(
    q_BKQD: torch.Tensor,
    k_S: torch.Tensor,
    v_S: torch.Tensor,
    g: _Group,
    layer_idx: int | None = None,
    k_new_BKD: torch.Tensor | None = None,
    v_new_BKD: torch.Tensor | None = None,
    sinks_KQ: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """CPU decode rows (q and k/v with the same head count: the grouped form, or no GQA): K/V
    gathered head-major, ``[B * K, L, Dh]`` contiguous (one row of ``Dh`` per slot and head), then
    two batched matmuls around a softmax, the mask an additive bias. ``scaled_dot_product_attention``
    over the slot-major gather's strided ``[B, K, L, Dh]`` view took ~1.6 ms per layer for 32 rows of 4
    KV heads over 130 keys on two cores, this ~0.8 ms (bench/LOG.md); same attention up to fp32
    summation order. The row indices and the bias are built at the step's first layer. With
    ``g.carry`` (``DecodeCarry``: ``layer_idx`` and the step's new K/V ``[B, K, Dh]`` as written to
    the pool), the previous step's gathered K/V of this layer, extended by the new token, when
    ``g.extend``; else a fresh gather, kept for the next step. ``sinks_KQ``: the sink logit of each
    of q's (head, query row), [K, Q] or [K, 1], folded into the softmax (in fp32); or None. ``softcap``:
    the scores capped (in fp32) before the mask is added; or None."""
    B, K, Q, D = q_BKQD.shape
    L = g.kv_slots_BL.shape[1]
    if g.cpu_bias_NQL is None:
        bias_B11L = torch.zeros(B, 1, 1, L, dtype=q_BKQD.dtype).masked_fill_(~g.mask_B1QL, float("-inf"))
        g.cpu_bias_NQL = bias_B11L.expand(B, K, Q, L).reshape(B * K, Q, L)
    carry = g.carry if layer_idx is not None else None
    if carry is not None and g.extend and layer_idx in carry.k:
        k_NCD, v_NCD = carry.k[layer_idx], carry.v[layer_idx]
        if g.carry_rows_N is None:  # a row past its table (discarded later) writes its last key
            C = k_NCD.shape[1]
            g.carry_rows_N = torch.arange(B * K) * C + g.pos_B.clamp(max=L - 1).repeat_interleave(K)
        k_NCD.view(-1, D).index_copy_(0, g.carry_rows_N, k_new_BKD.reshape(B * K, D).to(k_NCD.dtype))
        v_NCD.view(-1, D).index_copy_(0, g.carry_rows_N, v_new_BKD.reshape(B * K, D).to(v_NCD.dtype))
        k_NLD, v_NLD = k_NCD[:, :L], v_NCD[:, :L]
    else:
        if g.cpu_rows_R is None:
            g.cpu_rows_R = (g.kv_slots_BL[:, None, :] * K + torch.arange(K)[None, :, None]).reshape(-1)
        k_NLD = k_S.reshape(-1, D).index_select(0, g.cpu_rows_R).view(B * K, L, D).to(q_BKQD.dtype)
        v_NLD = v_S.reshape(-1, D).index_select(0, g.cpu_rows_R).view(B * K, L, D).to(q_BKQD.dtype)
        if carry is not None:  # kept with room for the keys of later steps
            for store, x_NLD in ((carry.k, k_NLD), (carry.v, v_NLD)):
                # zeros, not empty: masked keys still multiply their (zero) weight with V
                x_NCD = x_NLD.new_zeros(B * K, carry.keys, D)
                x_NCD[:, :L] = x_NLD
                store[layer_idx] = x_NCD
    if softcap is None:
        scores_NQL = torch.baddbmm(g.cpu_bias_NQL, q_BKQD.reshape(B * K, Q, D), k_NLD.transpose(1, 2), alpha=D**-0.5)
    else:  # the cap before the mask: tanh would turn a masked key's -inf into -softcap
        raw_NQL = torch.bmm(q_BKQD.reshape(B * K, Q, D), k_NLD.transpose(1, 2)).mul_(D**-0.5)
        scores_NQL = soft_cap(raw_NQL, softcap).add_(g.cpu_bias_NQL)
    if sinks_KQ is None:
        probs_NQL = torch.softmax(scores_NQL, dim=-1).to(v_NLD.dtype)
    else:
        sink_NQ1 = sinks_KQ.float().expand(B, K, Q).reshape(B * K, Q, 1)
        probs_NQL = sink_softmax(scores_NQL, sink_NQ1).to(v_NLD.dtype)
    return torch.bmm(probs_NQL, v_NLD).view(B, K, Q, D)


SINK_SCORES_BYTES = 1 << 28
"""``_explicit_attention``: most bytes of fp32 scores per block of query rows (a long prefill chunk's
[B, H, Q, L] scores would not fit at once)."""


def _explicit_attention(
    q_BHQD: torch.Tensor,
    k_BKLD: torch.Tensor,
    v_BKLD: torch.Tensor,
    mask_B1QL: torch.Tensor,
    sinks_HQ: torch.Tensor | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The gathered SDPA call with attention sinks or soft-capped scores, which SDPA cannot take: fp32
    scores, capped (``softcap``), the mask as -inf, ``sink_softmax`` (the plain softmax without sinks), in
    blocks of query rows of at most ``SINK_SCORES_BYTES`` of scores. K/V with fewer heads
    (``GROUPED_DECODE`` off) are repeated to q's. Returns q's dtype."""
    B, H, Q, D = q_BHQD.shape
    L = k_BKLD.shape[2]
    if k_BKLD.shape[1] != H:
        G = H // k_BKLD.shape[1]
        k_BKLD, v_BKLD = k_BKLD.repeat_interleave(G, dim=1), v_BKLD.repeat_interleave(G, dim=1)
    kt_BHDL, v_BHLD = k_BKLD.float().transpose(2, 3), v_BKLD.float()
    sinks_HQ1 = None if sinks_HQ is None else sinks_HQ.float()[..., None]
    step = max(1, SINK_SCORES_BYTES // (4 * B * H * L))

    def rows(x: torch.Tensor, a: int) -> torch.Tensor:  # query rows a.. of x (a broadcast dim as it is)
        return x if x.shape[-2] == 1 else x[..., a : a + step, :]

    outs = []
    for a in range(0, Q, step):
        s_BHqL = soft_cap(torch.matmul(q_BHQD[:, :, a : a + step].float(), kt_BHDL).mul_(D**-0.5), softcap)
        s_BHqL.masked_fill_(~rows(mask_B1QL, a), float("-inf"))
        sink = None if sinks_HQ1 is None else rows(sinks_HQ1, a)
        outs.append(torch.matmul(sink_softmax(s_BHqL, sink), v_BHLD))
    out_BHQD = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out_BHQD.to(q_BHQD.dtype)


def varlen_causal_sinks(
    q_THD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor, p: _VarlenPrefill, sinks_H: torch.Tensor
) -> torch.Tensor:
    """``varlen_causal`` with attention sinks, which flash cannot take: the sink's share of the
    softmax leaves the keys ``sigmoid(lse - s_h)`` of their mass (lse over the keys, as ``varlen_attn``
    returns it on request), so the output is flash's scaled by that, in fp32. Inference only (no
    gradient through the log-sum-exp). A sequence with no key stays 0."""
    if not varlen_lse_available():
        raise ValueError(
            "attention sinks in a prefill CUDA graph need torch's varlen_attn to return its log-sum-exp "
            "(return_aux): set rollout.prefill_cuda_graphs=false or upgrade torch"
        )
    out_THD, lse_HT = varlen_causal(
        q_THD, k_LKD, v_LKD, p.cu_q_B1, p.cu_k_B1, p.max_q, p.max_k, p.sliding_window,
        has_gqa=p.has_gqa, has_window=p.has_window, return_lse=True,
    )  # fmt: skip
    keep_TH = torch.sigmoid(lse_HT.t().float() - sinks_H.float())
    return (out_THD.float() * keep_TH[..., None]).to(out_THD.dtype)


_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA kernels of the engine's gathered attention on CUDA: not cuDNN's, which builds an execution
plan per new shape (a mixed step's shapes are new nearly every step: ~2 ms of host time per layer
on an H200, bench/LOG.md); the memory-efficient kernel takes these masked calls."""


def _sdpa_backends(device: torch.device) -> AbstractContextManager:
    return sdpa_kernel(_CUDA_SDPA_BACKENDS) if device.type == "cuda" else nullcontext()
