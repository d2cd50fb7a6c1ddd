"""CUDA graphs for prefill steps.

A step with prompt chunks (a rollout's first step, a burst of new requests; decode rows beside them
count as chunks of one token) launches ~20 kernels per layer one by one, and at a small model the
host's launching, not the device, bounds it. While its keys are few (``MAX_KEYS``: every
sequence's cached prefix and chunk) such a step replays a graph captured for
``(T_pad, L_pad, B_pad, N)``: its new tokens and its keys (each sequence's cached prefix and chunk)
padded by ``padded_prefill_tokens``, its sequences by ``padded_prefill_batch`` and the block-table
width by ``graph_num_blocks``. The static inputs are the token ids, each sequence's start and chunk
length, and the block tables; positions, cache slots, key slots and boundaries are computed inside
the graph, and each layer gathers the keys from the pool and attends with one flash varlen call
(``PagedAttention.for_prefill``). The padding tokens form one more sequence over padding keys,
both in the KV cache's scratch block, so every row stays finite and no live K/V is touched. The graph
returns the hidden states of each sequence's last token; the engine applies the head to the rows
that sample.

Graphs share the decode graphs' memory pool, capture lock and warm-up stream (``DecodeGraphRunner``),
are captured when a shape recurs (``CAPTURE_AT``), at most ``MAX_GRAPHS`` of them (later shapes run
eagerly), and are dropped with the decode graphs when the engine sleeps.
"""

from __future__ import annotations

import torch

from areno.models.attention import varlen_available, varlen_features
from areno.models.moe import grouped_mm_serves, sparse_blocks
from areno.rollout.attention import PagedAttention, varlen_lse_available
from areno.rollout.cuda_graph import DecodeGraphRunner
from areno.rollout.graph_shapes import graph_num_blocks, padded_prefill_batch, padded_prefill_tokens
from areno.rollout.scheduler import ScheduledBatch

MAX_KEYS = 16384
"""Most keys (cached prefixes and chunks of all sequences) a prefill graph gathers per layer."""
MAX_GRAPHS = 16
"""Most prefill graphs an engine keeps; a step of another shape after that runs eagerly."""
CAPTURE_AT = 2
"""A shape is captured when a step needs it for this many times (the first times run eagerly): a
synchronous run's first rollout step has one shape every step, while an asynchronous run's mixed
steps take many shapes once, each not worth a capture (two warm-up forwards and the capture, a few
tenths of a second at a small model)."""


class PrefillGraphRunner:
    """The prefill CUDA graphs of one engine (see the module docstring)."""

    def __init__(self, runner: DecodeGraphRunner) -> None:
        self.runner = runner
        self.engine = runner.engine
        self._graphs: dict[tuple[int, int, int, int], tuple] = {}
        self._wanted: dict[tuple[int, int, int, int], int] = {}
        """Steps that needed each shape not captured yet."""
        self.replays = 0
        """Prefill steps served by a graph."""

    @staticmethod
    def supported(engine) -> str | None:
        """Why this engine's prefill steps cannot be graphed, or None."""
        cache = engine.cache
        if getattr(engine, "tp_size", 1) > 1:
            # a rank that captures runs two warm-up forwards, each with its collectives, while a rank
            # whose captures are held (a policy sync) runs one: the ranks' collectives would diverge
            return "the ranks of a tensor-parallel engine must launch the same collectives"
        if not varlen_available():
            return "this torch has no torch.nn.attention.varlen"
        if cache.dtype not in (torch.bfloat16, torch.float16):
            return f"flash varlen attention needs a 16-bit KV cache, not {cache.dtype}"
        if cache.head_dim % 8 or cache.head_dim > 256:
            return f"flash varlen attention needs a head dim that is a multiple of 8 up to 256, not {cache.head_dim}"
        if engine.sliding_window is not None and not varlen_features()[1]:
            return "this torch's varlen attention has no sliding window"
        if engine.model_config.attn_logit_softcapping is not None:
            return "flash varlen attention has no soft-cap, which the model's attention scores take (Gemma 2)"
        if engine.model_config.attention_sinks and not varlen_lse_available():
            return "this torch's varlen attention returns no log-sum-exp, which the model's attention sinks need"
        blocks = sparse_blocks(engine.model)
        if blocks and not all(grouped_mm_serves(cache.dtype, engine.device, b.experts.down_proj) for b in blocks):
            # under capture the experts run densely (``naive_experts``): every expert over every token
            return (
                "a mixture of experts prefills in a graph only with grouped GEMMs (bf16 on a Hopper or newer GPU, "
                "hidden and expert widths multiples of 8)"
            )
        return None

    def clear(self) -> None:
        self._graphs.clear()
        self._wanted.clear()

    def hidden(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Hidden states [B, D] of the last token of each sequence of a prefill or mixed ``batch`` (a
        decode row is a chunk of one token), from its graph; None when no graph serves it (more than
        ``MAX_KEYS`` keys, the graph cap reached, captures held): the caller runs the step eagerly."""
        if not batch.seqs:
            return None
        B = len(batch.seqs)
        T = batch.num_tokens
        L = sum(batch.starts) + T
        if L > MAX_KEYS:
            return None
        runner = self.runner
        N = min(graph_num_blocks(batch.max_blocks, True), runner.engine.scheduler.block_tables_RN.shape[1])
        key = (padded_prefill_tokens(T), padded_prefill_tokens(L), padded_prefill_batch(B), N)
        g = self._graphs.get(key)
        if g is None:
            wanted = self._wanted[key] = self._wanted.get(key, 0) + 1
            if wanted < CAPTURE_AT or len(self._graphs) >= MAX_GRAPHS:
                return None
            g = runner.try_capture(self._capture, *key)
            if g is None:
                return None
        graph, ids_T, meta_2B, bt_BN, hidden_BD = g
        Tp, Bp = ids_T.shape[0], meta_2B.shape[1]
        ids: list[int] = []
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new):
            ids.extend(seq.token_ids[start : start + n])
        pad_b = [0] * (Bp - B)
        host = torch.tensor(ids + [0] * (Tp - T) + batch.starts + pad_b + batch.num_new + pad_b, dtype=torch.long)
        ids_T.copy_(host[:Tp], non_blocking=True)
        meta_2B.copy_(host[Tp:].view(2, Bp), non_blocking=True)
        bt_BN.copy_(self.engine.scheduler.block_tables_for(batch.rows, width=N, batch_size=Bp), non_blocking=True)
        graph.replay()
        self.replays += 1
        return hidden_BD[:B]

    def _forward(
        self, ids_T: torch.Tensor, meta_2B: torch.Tensor, bt_BN: torch.Tensor, L: int, max_q: int
    ) -> torch.Tensor:
        """The prefill forward from the static inputs (static shapes only): hidden states [Bp, D] of
        each sequence's last token (a padding sequence's: any row)."""
        e = self.engine
        dev = ids_T.device
        bs = e.cache.block_size
        scratch = e.cache.scratch_block * bs
        T, Bp = ids_T.shape[0], meta_2B.shape[1]
        starts_B, new_B = meta_2B[0], meta_2B[1]
        ctx_B = starts_B + new_B
        end_q_B, end_k_B = new_B.cumsum(0), ctx_B.cumsum(0)
        zero = end_q_B.new_zeros(1)
        # the padding tokens and keys as one more sequence (the last boundary: the padded counts)
        cu_q = torch.cat((zero, end_q_B, zero + T)).to(torch.int32)
        cu_k = torch.cat((zero, end_k_B, zero + L)).to(torch.int32)

        def slots(begin_B: torch.Tensor, end_B: torch.Tensor, first_B: torch.Tensor, count: int):
            # (position, cache slot) of ``count`` packed entries, sequence b's at begin_B[b]:end_B[b]
            # from position first_B[b]; the padding entries: position 0, the scratch block
            i = torch.arange(count, device=dev)
            seq = torch.searchsorted(end_B, i, right=True)
            real = seq < Bp
            seq = seq.clamp(max=Bp - 1)
            pos = torch.where(real, first_B[seq] + i - begin_B[seq], 0)
            return pos, torch.where(real, bt_BN[seq, pos // bs] * bs + pos % bs, scratch + i % bs)

        pos_T, slot_T = slots(end_q_B - new_B, end_q_B, starts_B, T)
        _, kv_slots_L = slots(end_k_B - ctx_B, end_k_B, torch.zeros_like(starts_B), L)
        attn = PagedAttention.for_prefill(
            e.cache, slot_T, kv_slots_L, cu_q, cu_k, max_q, L, e.sliding_window, window_layers=e.window_layers
        )
        hidden_TD = e.model(ids_T, pos_T.clamp(max=e.max_position - 1), attn)
        return hidden_TD.index_select(0, (end_q_B - 1).clamp(min=0))

    @torch.no_grad()
    def _capture(self, T: int, L: int, Bp: int, N: int) -> tuple:
        dev = self.engine.device
        ids_T = torch.zeros(T, dtype=torch.long, device=dev)
        meta_2B = torch.zeros(2, Bp, dtype=torch.long, device=dev)
        bt_BN = torch.full((Bp, N), self.engine.cache.scratch_block, dtype=torch.long, device=dev)
        # max_q = T: the padding sequence may hold most of the tokens
        graph, hidden_BD = self.runner.record(lambda: self._forward(ids_T, meta_2B, bt_BN, L, T))
        g = (graph, ids_T, meta_2B, bt_BN, hidden_BD)
        self._graphs[(T, L, Bp, N)] = g
        return g
