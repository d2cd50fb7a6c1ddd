"""CUDA graphs for pure-decode steps.

A decode step of B sequences is replayed from a graph captured for ``(B_pad, N_pad)``: the batch size
padded to 1, 2, 4, then multiples of 8, and the block-table width padded to a power of two up to 16
blocks and to a multiple of 16 blocks beyond (so the attention gathers keys for about the longest
context of the batch, not for ``max_model_len``).
Graphs are captured lazily at first use and share one memory pool. The graph's inputs are three
static tensors — token ids, context lengths, block tables — and everything else (positions, cache
slots, masks, the forward pass and the logits) is computed inside the graph. A multi-step decode
(``RolloutEngineConfig.decode_steps``) replays the graph k times, writing each step's sampled tokens
into the static ids and advancing the context lengths on the device between replays (sampling runs
eagerly on the device between replays: no host round trip until the k steps are done). Padding rows use the KV
cache's scratch block, so they never touch a live sequence's K/V.

Weights are updated in place (same addresses), so graphs survive ``update_weights``; ``sleep()``
frees the KV tensors and therefore drops every graph (they are re-captured after ``wake()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from areno.rollout.attention import PagedAttention

if TYPE_CHECKING:
    from areno.rollout.engine import RolloutEngine
    from areno.rollout.scheduler import ScheduledBatch


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids_ctx_2B: torch.Tensor
    """Static input: row 0 the token ids, row 1 the context lengths."""
    bt_BN: torch.Tensor
    logits_BV: torch.Tensor


def padded_batch_size(n: int) -> int:
    if n <= 4:
        return 1 << (n - 1).bit_length()
    return -(-n // 8) * 8


def padded_num_blocks(n: int) -> int:
    # Powers of two up to 16 blocks, then multiples of 16: the gathered keys exceed the longest
    # context by at most 2x for short contexts and by 16 blocks for long ones.
    if n <= 16:
        return 1 << (n - 1).bit_length()
    return -(-n // 16) * 16


class DecodeGraphRunner:
    def __init__(self, engine: "RolloutEngine", *, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_blocks = -(-engine.max_model_len // engine.config.block_size)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None

    def can_run(self, batch: "ScheduledBatch") -> bool:
        return len(batch.seqs) <= self.max_batch and batch.num_decode == len(batch.seqs) and all(batch.samples)

    def capture(self, batch_sizes: list[int], max_len: int) -> int:
        """Capture ahead of time every graph that decode batches of these sizes with contexts up
        to ``max_len`` tokens can need (as a server does at start-up). Returns the graph count."""
        bs = self.engine.config.block_size
        n_max = padded_num_blocks(min(-(-max_len // bs), self.max_blocks))
        widths = sorted({padded_num_blocks(n) for n in range(1, n_max + 1)})
        for b in sorted({padded_batch_size(min(b, self.max_batch)) for b in batch_sizes}):
            for n in widths:
                if (b, n) not in self._graphs:
                    self._capture(b, n)
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None

    def prepare(self, batch: "ScheduledBatch", ids: list[int], ctx: list[int]) -> tuple[_Graph, torch.Tensor, torch.Tensor]:
        """Load a decode batch into its graph's static inputs. Returns the graph and views of its
        token ids and context lengths for the batch's rows (the engine advances them in place
        between replays of a multi-step decode); ``replay`` returns the logits."""
        B = len(batch.seqs)
        n_blocks = batch.max_blocks
        key = (padded_batch_size(B), min(padded_num_blocks(n_blocks), padded_num_blocks(self.max_blocks)))
        g = self._graphs.get(key) or self._capture(*key)
        Bp, Np = key
        # Block tables come from the scheduler's persistent tensor (padded with the scratch block,
        # padding rows all scratch); token ids and context lengths travel as one [2, Bp] copy.
        bt = self.engine.scheduler.block_tables_for(batch.rows, width=Np, batch_size=Bp)
        pad = Bp - B
        inputs = torch.tensor([ids + [0] * pad, ctx + [1] * pad], dtype=torch.long)
        g.ids_ctx_2B.copy_(inputs, non_blocking=True)
        g.bt_BN.copy_(bt, non_blocking=True)
        return g, g.ids_ctx_2B[0, :B], g.ids_ctx_2B[1, :B]

    @staticmethod
    def replay(g: _Graph, B: int) -> torch.Tensor:
        g.graph.replay()
        # No copy: the logits are consumed (sampled) before the next replay overwrites them.
        return g.logits_BV[:B]

    def run(self, batch: "ScheduledBatch", ids: list[int], pos: list[int]) -> torch.Tensor:
        """One decode step: logits [B, V] of the batch (``pos``: each token's position)."""
        g, _, _ = self.prepare(batch, ids, [p + 1 for p in pos])
        return self.replay(g, len(batch.seqs))

    def _forward(self, ids_B: torch.Tensor, ctx_B: torch.Tensor, bt_BN: torch.Tensor) -> torch.Tensor:
        e = self.engine
        attn = PagedAttention.for_decode(e.cache, bt_BN, ctx_B, e.sliding_window)
        # Rows run past their end (multi-step decode) may pass the RoPE table: clamp (their K/V
        # goes to the scratch block and their tokens are discarded).
        hidden_BD = e.model(ids_B, (ctx_B - 1).clamp(max=e.max_position - 1), attn)
        return e._logits(hidden_BD)

    @torch.no_grad()
    def _capture(self, B: int, N: int) -> _Graph:
        dev = self.engine.device
        ids_ctx_2B = torch.ones(2, B, dtype=torch.long, device=dev)
        ids_B, ctx_B = ids_ctx_2B[0], ids_ctx_2B[1]
        bt_BN = torch.full((B, N), self.engine.cache.scratch_block, dtype=torch.long, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up (lazy tables, kernel selection) outside the graph
            for _ in range(2):
                self._forward(ids_B, ctx_B, bt_BN)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine's driver thread captures while, colocated and asynchronous, the
        # trainer's thread keeps launching work on the same GPU; the default (global) mode would
        # let that work invalidate the capture (cudaErrorStreamCaptureInvalidated)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits_BV = self._forward(ids_B, ctx_B, bt_BN)
        g = _Graph(graph=graph, ids_ctx_2B=ids_ctx_2B, bt_BN=bt_BN, logits_BV=logits_BV)
        self._graphs[(B, N)] = g
        return g
