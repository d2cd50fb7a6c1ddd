"""CUDA graphs for pure-decode steps.

A decode step of B sequences is replayed from a graph captured for ``(B_pad, N_pad)``: the batch size
padded to 1, 2, 4, then multiples of 8 up to 64, of 32 up to 256 and of 64 beyond
(``padded_batch_size``); the block-table width, under the gather attention, padded to a power of two
up to 16 blocks and to a multiple of 16 beyond (so it gathers keys for about the longest context of
the batch, not for ``max_model_len``), and under the paged kernel (which reads only each row's real
context) a power of two of at least 64 blocks (``graph_num_blocks``). An asynchronous run with
long-tailed lengths sweeps through most batch sizes and context widths, so these steps bound how
many graphs it captures (``captures`` / ``capture_s``, in ``RolloutEngine.stats``).
Graphs are captured lazily at first use (a tensor-parallel engine's at its warm-up only: its ranks must launch
the same collectives) and share one memory pool and, for the one-step graphs, one logits buffer; ``hold_captures``
(a policy sync on a rollout worker) defers captures, and a step whose graph is missing meanwhile runs eagerly. The graph's inputs are three
static tensors — token ids, context lengths, block tables — and everything else (positions, cache
slots, masks, the forward pass and the logits) is computed inside the graph.

A multi-step decode (``RolloutEngineConfig.decode_steps`` = k) is one replay of a loop graph keyed
``(B_pad, N_pad, k, S, mode)`` (S: stop ids per row; mode: ``sampling.SampleMode``): k forwards,
each followed by the sampler (``Sampler.sample_static``), the stop-id / ``min_new_tokens`` / length
checks, and feeding the tokens back — no host round trip until the k steps are done. Its per-row
sampling state is one more static input, the packed table of ``RowParams`` (temperature, top-k,
top-p, seed, min/max new tokens, tokens generated, stop ids), decoded inside the graph; the step
counter advances inside the graph, so ``min_new_tokens`` suppression and the seeded rows' hashed uniforms
(a function of seed and tokens generated) follow each step. Greedy rows inside a sampling batch are a
per-row ``where``; the mode only decides which kernels exist at all: all greedy (an argmax), and for
sampling batches whether some row truncates (top-k/top-p sort), has a seed (a hashed uniform) or has none
(noise from the engine's generator, registered with the graph so each replay advances it) — at most
7 loop variants per shape, 1-2 for a given workload. The k - 1 decode steps that follow a mixed step
in its round trip (``RolloutEngineConfig.mixed_decode_min_rows``) replay a (k - 1)-step loop of the
same kind, its input tokens copied on the device from the mixed step's samples. Tokens and log-probs
equal the one-step path's for greedy and seeded rows. Padding rows use the KV cache's scratch block, so they never touch a live
sequence's K/V, and a padding sampling column (greedy, done after one token). Batches the loop cannot
serve (tensor-parallel sampling, a k cut short by waiting requests) replay the one-step graph k times
with eager sampling between replays.

Weights are updated in place (same addresses), so graphs survive ``update_weights``; ``sleep()``
frees the KV tensors and therefore drops every graph (they are re-captured after ``wake()``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from areno.rollout import fused_loop
from areno.rollout.attention import PagedAttention
from areno.rollout.graph_shapes import PAGED_MIN_BLOCKS, graph_num_blocks, padded_batch_size, padded_num_blocks
from areno.rollout.kv_cache import KVCache
from areno.rollout.sampling import GREEDY, RowParams, RowTensors, SampleMode, Sampler
from areno.rollout.scheduler import ScheduledBatch, Scheduler
from areno.types import SamplingParams

__all__ = [  # the padded shapes (graph_shapes.py) stay importable from here
    "PAGED_MIN_BLOCKS",
    "DecodeGraphRunner",
    "GraphHost",
    "graph_num_blocks",
    "padded_batch_size",
    "padded_num_blocks",
]

log = logging.getLogger(__name__)
_CAPTURE_LOCK = threading.Lock()
"""Held by every capture of the process (each engine's driver thread captures lazily)."""


class GraphHost(Protocol):
    """What the graph runner reads of its engine (``RolloutEngine`` is one)."""

    LOCAL_SAMPLING: bool
    """Sampling is the engine's own (no collective), so the k-step loop graphs may sample inside."""
    config: Any
    """The engine's ``RolloutEngineConfig`` (``block_size``, ``decode_attention``, ``mixed_decode_min_rows``)."""
    device: torch.device
    model: torch.nn.Module
    cache: KVCache
    scheduler: Scheduler
    sampler: Sampler
    max_model_len: int
    max_position: int
    vocab_size: int
    sliding_window: int | None
    window_layers: tuple[int, ...] | None
    eos_token_ids: tuple[int, ...]
    decode_steps: int
    loop_steps: tuple[int, ...]

    def _logits(self, hidden_BD: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _Graph:
    graph: Any
    """A ``torch.cuda.CUDAGraph`` (anything with ``replay()``)."""
    ids_ctx_2B: torch.Tensor
    """Static input: row 0 the token ids, row 1 the context lengths."""
    bt_BN: torch.Tensor
    logits_BV: torch.Tensor


@dataclass
class _LoopGraph:
    """k decode steps, sampling included, in one graph."""

    graph: Any
    ids_ctx_2B: torch.Tensor
    bt_BN: torch.Tensor
    rows_FB: torch.Tensor
    """Static input: the rows' packed sampling table (``RowParams.table_FB``), padding columns after."""
    pad_FB: torch.Tensor
    """Padding columns (``RowTensors.padding_table``) copied over the unused columns of ``rows_FB``."""
    tokens_KB: torch.Tensor
    logprobs_KB: torch.Tensor
    keep_B: torch.Tensor
    """Outputs: each step's tokens and log-probs, and how many of each row's tokens are real."""


class DecodeGraphRunner:
    """The decode CUDA graphs of one engine: captured lazily (or by ``capture``), replayed by its steps."""

    def __init__(self, engine: GraphHost, *, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_blocks = -(-engine.max_model_len // engine.config.block_size)
        self.paged = engine.config.decode_attention == "paged"
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._loops: dict[tuple[int, int, int, int, SampleMode], _LoopGraph] = {}
        self._pool = None
        self._side: torch.cuda.Stream | None = None
        self._logits_out: torch.Tensor | None = None
        """The one-step graphs' shared output [rows, V] (``_logits_buffer``)."""
        self._warned = False
        self._uncapturable: set[tuple[str, tuple]] = set()
        """Captures that failed (by capture function and key): their steps run eagerly."""
        self.tp_eager = 0
        """Steps of a tensor-parallel engine run eagerly because the warm-up had not captured their graph."""
        self.capture_lock = threading.Lock()
        """Held while a graph is captured; ``hold_captures`` takes it (e.g. for a policy sync) so no
        capture runs beside it: a decode step that would need a new graph meanwhile runs eagerly."""
        self.captures = 0
        """Graphs captured so far (one-step and loops, counting re-captures after ``clear``)."""
        self.deferred = 0
        """Decode steps run eagerly because their graph was missing while captures were held."""
        self.capture_s = 0.0
        """Seconds spent capturing them (warm-up runs included)."""

    @contextlib.contextmanager
    def hold_captures(self) -> Iterator[None]:
        """No graph is captured inside this block (an ongoing capture finishes first); decode steps
        whose graph exists still replay it, the others run eagerly."""
        with self.capture_lock:
            yield

    def try_capture(self, capture: Callable[..., Any], *key: Any) -> Any:
        """``capture(*key)`` unless captures are held, this capture failed before, or the engine is
        tensor-parallel (then None: the caller runs eagerly). A capture that fails (out of memory: the KV pool was sized before the
        graphs) is warned about once and its steps run eagerly from then on, rather than failing every
        request of the step and trying again at the next."""
        name = (getattr(capture, "__qualname__", repr(capture)), key)
        if name in self._uncapturable:
            return None
        if getattr(self.engine, "tp_size", 1) > 1:
            # A capture runs two warm-up forwards with their collectives; a rank whose captures are
            # held (its own policy sync) or failed runs one: the ranks' collectives would diverge
            # (a hang). A tensor-parallel engine's graphs come from the warm-up alone.
            self.tp_eager += 1
            return None
        if not self.capture_lock.acquire(blocking=False):
            self.deferred += 1
            return None
        device = self.engine.device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        try:
            return capture(*key)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if stream is not None:  # torch's graph context does not restore the stream when ending the capture raises
                torch.cuda.set_stream(stream)
            self._uncapturable.add(name)
            log.log(
                logging.DEBUG if self._warned else logging.WARNING,
                "rollout engine: capturing a CUDA graph (%s %s) failed, so its steps run eagerly (%s: %s); "
                "more free device memory (a smaller rollout.kv_memory_fraction) lets it capture",
                name[0],
                key,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            self._warned = True  # once a runner: a sleep/wake clears the failed keys and may fail them again
            return None
        finally:
            self.capture_lock.release()

    def width(self, n: int) -> int:
        """Block-table width of the graph serving a longest sequence of ``n`` blocks."""
        return min(graph_num_blocks(n, self.paged), graph_num_blocks(self.max_blocks, self.paged))

    def can_run(self, batch: ScheduledBatch) -> bool:
        return len(batch.seqs) <= self.max_batch and batch.num_decode == len(batch.seqs) and all(batch.samples)

    def capture(self, batch_sizes: list[int], max_len: int, params: list[SamplingParams] | None = None) -> int:
        """Capture ahead of time every graph that decode batches of these sizes with contexts up
        to ``max_len`` tokens can need (as a server does at start-up): the one-step graphs and,
        with ``decode_steps`` > 1, the k-step loops for batches whose rows all use one of
        ``params`` (None: greedy rows whose stop ids are the EOS ids), and for batches of at least
        ``mixed_decode_min_rows`` the (k - 1)-step loops that follow mixed steps. Returns the graph count.
        The caller holds ``capture_lock`` (``RolloutEngine.warmup_cuda_graphs`` does)."""
        bs = self.engine.config.block_size
        n_max = min(-(-max_len // bs), self.max_blocks)
        widths = sorted({self.width(n) for n in range(1, n_max + 1)})
        k = self.engine.decode_steps
        mixed_min = self.engine.config.mixed_decode_min_rows
        eos = self.engine.eos_token_ids
        if params is None:
            variants = {(max(1, len(eos)), GREEDY)}
        else:
            variants = {
                (max(1, len((() if p.ignore_eos else eos) + p.stop_token_ids)), SampleMode.of(p)) for p in params
            }
        for b in sorted({padded_batch_size(min(b, self.max_batch)) for b in batch_sizes}):
            for n in widths:
                if (b, n) not in self._graphs:
                    self._capture(b, n)
                # the k-step loop; and k - 1 steps after a mixed step, for batches that large
                steps = [s for s in self.engine.loop_steps if s == k or (mixed_min is not None and b >= mixed_min)]
                for S, mode in sorted(variants) if k > 1 else ():
                    for s in steps:
                        if (b, n, s, S, mode) not in self._loops and self._mode_capturable(mode):
                            self._capture_loop(b, n, s, S, mode)
        return len(self._graphs) + len(self._loops)

    def clear(self) -> None:
        self._graphs.clear()
        self._loops.clear()
        self._logits_out = None
        self._uncapturable.clear()  # released memory may let them capture now
        self._pool = None

    def can_loop(self, batch: ScheduledBatch, rp: RowParams, k: int) -> bool:
        """Whether ``run_loop`` can do this round trip: one of the engine's ``loop_steps`` (its
        full ``decode_steps``, or one less after a mixed step), its
        own (``LOCAL_SAMPLING``; not tensor parallelism's) sampler, and generator noise only where
        graphs can hold it."""
        e = self.engine
        return (
            k in e.loop_steps and k > 1 and self.can_run(batch) and e.LOCAL_SAMPLING and self._mode_capturable(rp.mode)
        )

    def _mode_capturable(self, mode: SampleMode) -> bool:
        # Generator noise inside a CUDA graph needs the generator registered with it (torch >= 2.4).
        return (
            not mode.rng_noise
            or self.engine.device.type != "cuda"
            or hasattr(torch.cuda.CUDAGraph, "register_generator_state")
        )

    def run_loop(
        self,
        batch: ScheduledBatch,
        ids: list[int],
        ctx: list[int],
        rp: RowParams,
        k: int,
        ids_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...] | None:
        """k decode steps in one replay, sampled under ``rp``. Returns token ids and log-probs
        [k, B] and the number of real tokens per row [B] (views of the graph's outputs: copy them
        before the next replay); None when the graph is missing and captures are held. ``ids_B``:
        the input tokens as a device tensor (then ``ids`` is ignored)."""
        B, S = len(batch.seqs), rp.num_stop_columns
        Bp, Np = self._key(batch)
        key = (Bp, Np, k, S, rp.mode)
        g = self._loops.get(key) or self.try_capture(self._capture_loop, *key)
        if g is None:
            return None
        self._load(g, batch, ids, ctx, Bp, Np, ids_B)
        g.rows_FB[:, :B].copy_(rp.table_FB, non_blocking=True)
        if B < Bp:
            g.rows_FB[:, B:].copy_(g.pad_FB[:, B:])
        g.graph.replay()
        return g.tokens_KB[:, :B], g.logprobs_KB[:, :B], g.keep_B[:B]

    def _key(self, batch: ScheduledBatch) -> tuple[int, int]:
        return padded_batch_size(len(batch.seqs)), self.width(batch.max_blocks)

    def _load(
        self,
        g: _Graph | _LoopGraph,
        batch: ScheduledBatch,
        ids: list[int],
        ctx: list[int],
        Bp: int,
        Np: int,
        ids_B: torch.Tensor | None = None,
    ) -> None:
        # Block tables come from the scheduler's persistent tensor (padded with the scratch block,
        # padding rows all scratch); token ids and context lengths travel as one [2, Bp] copy
        # (token ids already on the device, ``ids_B``, as a device copy after it).
        bt = self.engine.scheduler.block_tables_for(batch.rows, width=Np, batch_size=Bp)
        pad = Bp - len(ids)
        inputs = torch.tensor([ids + [0] * pad, ctx + [1] * pad], dtype=torch.long)
        g.ids_ctx_2B.copy_(inputs, non_blocking=True)
        if ids_B is not None:
            g.ids_ctx_2B[0, : ids_B.shape[0]].copy_(ids_B)
        g.bt_BN.copy_(bt, non_blocking=True)

    def prepare(
        self, batch: ScheduledBatch, ids: list[int], ctx: list[int], ids_B: torch.Tensor | None = None
    ) -> tuple[_Graph, torch.Tensor, torch.Tensor] | None:
        """Load a decode batch into its graph's static inputs. Returns the graph and views of its
        token ids and context lengths for the batch's rows (the engine advances them in place
        between replays of a multi-step decode); ``replay`` returns the logits. None when the graph
        is missing and captures are held."""
        B = len(batch.seqs)
        key = self._key(batch)
        g = self._graphs.get(key) or self.try_capture(self._capture, *key)
        if g is None:
            return None
        self._load(g, batch, ids, ctx, *key, ids_B)
        return g, g.ids_ctx_2B[0, :B], g.ids_ctx_2B[1, :B]

    @staticmethod
    def replay(g: _Graph, B: int) -> torch.Tensor:
        g.graph.replay()
        # No copy: the logits are consumed (sampled) before the next replay overwrites them.
        return g.logits_BV[:B]

    def _forward(self, ids_B: torch.Tensor, ctx_B: torch.Tensor, bt_BN: torch.Tensor) -> torch.Tensor:
        e = self.engine
        # Rows run past their end (multi-step decode) may pass the RoPE table: their position is
        # clamped (their K/V goes to the scratch block and their tokens are discarded).
        bs = e.cache.block_size
        slot_B, pos_B = fused_loop.decode_slots(bt_BN, ctx_B, bs, e.cache.scratch_block * bs, e.max_position)
        attn = PagedAttention.for_decode(
            e.cache,
            bt_BN,
            ctx_B,
            e.sliding_window,
            decode_attention=e.config.decode_attention,
            slot_B=slot_B,
            window_layers=e.window_layers,
        )
        hidden_BD = e.model(ids_B, pos_B, attn)
        return e._logits(hidden_BD)

    def record(self, fn: Callable[[], Any], generator: torch.Generator | None = None) -> tuple[Any, Any]:
        """Capture ``fn`` (reading and writing static tensors only) as a CUDA graph in the shared
        pool, after two warm-up runs (lazy tables, kernel selection). ``generator``: a generator
        ``fn`` draws from (registered with the graph: each replay advances it). Returns (graph, outputs)."""
        t0 = time.perf_counter()
        dev = self.engine.device
        # one warm-up stream for the runner's life: cuBLAS keeps a workspace per stream it ran on,
        # so a new stream per capture (re-captured after every wake) would pile up workspaces
        if self._side is None:
            self._side = torch.cuda.Stream(dev)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        # thread_local: the engine's driver thread captures while, colocated and asynchronous, the
        # trainer's thread keeps launching work on the same GPU; the default (global) mode would
        # let that work invalidate the capture (cudaErrorStreamCaptureInvalidated). The runner's own
        # stream and one capture at a time in the process: torch's default capture stream is one per
        # process (on the first capture's device), and a second engine here (the test rollout's, a
        # teacher's) capturing on it at once failed and left its thread on that stream
        with _CAPTURE_LOCK, torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            out = fn()
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return graph, out

    def _static_inputs(self, B: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.engine.device
        ids_ctx_2B = torch.ones(2, B, dtype=torch.long, device=dev)
        bt_BN = torch.full((B, N), self.engine.cache.scratch_block, dtype=torch.long, device=dev)
        return ids_ctx_2B, bt_BN

    @torch.no_grad()
    def _capture(self, B: int, N: int) -> _Graph:
        ids_ctx_2B, bt_BN = self._static_inputs(B, N)
        before = self._logits_out
        out_BV = self._logits_buffer(B, ids_ctx_2B, bt_BN)[:B]

        def step() -> torch.Tensor:
            # the logits computed inside the graph are freed at its end, for the next capture to reuse;
            # only the shared buffer outlives it (one per graph was GiBs at 150k vocabularies)
            out_BV.copy_(self._forward(ids_ctx_2B[0], ids_ctx_2B[1], bt_BN))
            return out_BV

        try:
            graph, logits_BV = self.record(step)
        except BaseException:
            self._logits_out = before  # a buffer grown for a graph that failed: no graph writes it
            raise
        g = _Graph(graph=graph, ids_ctx_2B=ids_ctx_2B, bt_BN=bt_BN, logits_BV=logits_BV)
        self._graphs[(B, N)] = g
        return g

    def _logits_buffer(self, B: int, ids_ctx_2B: torch.Tensor, bt_BN: torch.Tensor) -> torch.Tensor:
        """The one-step graphs' shared logits output, of at least ``B`` rows, allocated outside any
        capture (a graph's own output stays allocated for the graph's life). Every replay's logits are
        sampled before the next replay on the same stream, so one buffer serves every graph. It grows
        geometrically up to the padded ``max_batch``; a graph captured earlier keeps the buffer it writes."""
        buf = self._logits_out
        if buf is None or buf.shape[0] < B:
            probe_BV = self._forward(ids_ctx_2B[0], ids_ctx_2B[1], bt_BN)  # the logits' width and dtype
            cap = padded_batch_size(self.max_batch)
            rows = max(B, min(cap, 2 * buf.shape[0])) if buf is not None else B
            buf = self._logits_out = probe_BV.new_empty(rows, probe_BV.shape[1])
        return buf

    @torch.no_grad()
    def _capture_loop(self, B: int, N: int, k: int, S: int, mode: SampleMode) -> _LoopGraph:
        e = self.engine
        dev = e.device
        ids_ctx_2B, bt_BN = self._static_inputs(B, N)
        # padding rows mark their tokens in the scratch slot's row of the presence table (a penalising mode)
        pad_FB = RowTensors.padding_table(S, B, e.vocab_size, dev, slot=e.scheduler.scratch_row)
        rows_FB = pad_FB.clone()
        sampler, max_len = e.sampler, e.max_model_len
        if mode.penalize:  # the graph reads the table at its address: allocated before the capture
            assert sampler.presence is not None
            sampler.presence.allocate()

        def loop() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            ids_B, ctx_B = ids_ctx_2B[0], ids_ctx_2B[1]
            rows = RowTensors.from_table(rows_FB, max_len)
            keep_B = torch.full((B,), k, dtype=torch.long, device=dev)
            alive_B = torch.ones(B, dtype=torch.bool, device=dev)
            tokens, logprobs = [], []
            for j in range(k):
                logits_BV = self._forward(ids_B, ctx_B, bt_BN)
                n_gen_B = rows.n_gen_B + j  # as ``RowParams.advance`` counts between one-step samples
                tokens_B, logprobs_B = sampler.sample_static(logits_BV, rows, n_gen_B, mode)
                tokens.append(tokens_B)
                logprobs.append(logprobs_B)
                more = (ids_B, ctx_B) if j + 1 < k else ()
                fused_loop.advance_rows(
                    tokens_B, rows.stop_ids_BS, rows.stop_valid_BS, n_gen_B, rows.min_new_B, rows.room_B, j,
                    keep_B, alive_B, *more,
                )  # fmt: skip
            return torch.stack(tokens), torch.stack(logprobs), keep_B

        graph, (tokens_KB, logprobs_KB, keep_B) = (
            self.record(loop, generator=sampler.generator) if mode.rng_noise else self.record(loop)
        )
        g = _LoopGraph(
            graph=graph,
            ids_ctx_2B=ids_ctx_2B,
            bt_BN=bt_BN,
            rows_FB=rows_FB,
            pad_FB=pad_FB,
            tokens_KB=tokens_KB,
            logprobs_KB=logprobs_KB,
            keep_B=keep_B,
        )
        self._loops[(B, N, k, S, mode)] = g
        return g
