"""Continuous-batching scheduler: which tokens of which sequences run in the next step.

Policy (first come, first served, by arrival):
1. Running sequences, oldest first, each get their next chunk: one token when decoding, up to
   ``prefill_chunk_size`` prompt tokens when still prefilling, all within the step's token budget.
   When the KV pool has no block for a sequence, the *youngest* running sequence is preempted
   (recompute: its blocks are released and it goes back to the waiting queue with every token it
   has; it is prefilled again later, through the prefix cache when its blocks survived). The oldest
   sequence is never preempted for a younger one, so generation always progresses.
2. Waiting sequences are admitted, oldest first, while the budget, ``max_num_seqs`` and free blocks
   allow; on admission the longest cached prefix is reused (``BlockAllocator.match_prefix``).

Full blocks are registered in the prefix cache at scheduling time (see ``kv_cache``), so the n
samples of one prompt admitted in the same step already share its blocks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from areno.rollout.attention import SeqChunk
from areno.rollout.graph_shapes import graph_num_blocks
from areno.rollout.kv_cache import ROOT_KEY, BlockAllocator
from areno.types import SamplingParams


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by every generated token."""
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Leading tokens whose K/V is in the cache."""
    num_registered_blocks: int = 0
    """Leading full blocks registered in the prefix cache (or passed over, when not ``cache_ok``)."""
    last_key: int = ROOT_KEY
    cache_ok: bool = True
    """Whether this sequence's K/V may enter the prefix cache: false once a weight update left it
    encoded by the previous policy (until it is released and recomputed)."""
    num_preemptions: int = 0
    text: str | None = None
    stop_from: int | None = None
    """Characters of the output's text made before its ``min_new_tokens``-th token: a stop string
    must end past them (set when that token is generated; ``sampling.check_stop``)."""
    limit: int = 0
    """Tokens (prompt + output) at which the request ends by length: ``min(prompt + max_new_tokens,
    max_model_len)`` (set by the engine)."""
    sample_row: tuple | None = None
    """``RowParams.row_of(params)``, computed once at admission."""
    row: int | None = None
    """Row of ``Scheduler.block_tables_RN`` mirroring ``block_table`` while the sequence runs."""
    images: Any = None
    """A vision-language request's ``ImageInputs`` (``models/vision.py``); None for text."""
    mrope_3P: torch.Tensor | None = None
    """With images: the prompt's M-RoPE positions [3, prompt]; generated token i sits at
    ``i + position_delta`` on all three axes."""
    position_delta: int = 0
    image_token_id: int = -1
    """The image-pad token id of the model (with images)."""
    image_embeds: torch.Tensor | None = None
    """The vision tower's output for ``images``, computed at the first prefill chunk that needs it
    (never, when the prefix cache already holds every image token's K/V)."""
    prefix_root: int = ROOT_KEY
    """Root of this sequence's prefix-cache key chain (``ImageInputs.key`` with images)."""
    routes: list[tuple[int, torch.Tensor]] | None = None
    """An engine recording expert routes (``RolloutEngineConfig.record_routes``): (first position,
    [n, L, K] expert ids on the device) of each forward over this sequence's tokens, in step order."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.last_key = self.prefix_root

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)


def _arrival(seq: Sequence) -> int:
    return seq.arrival


@dataclass
class ScheduledBatch:
    """The work of one step: decode chunks (one token) first, then prefill chunks.

    Plain per-sequence lists (no per-sequence objects), so a large decode batch costs little to
    build; ``chunks`` materialises ``SeqChunk``s for the eager attention builder."""

    seqs: list[Sequence]
    starts: list[int]
    """Tokens of each sequence already in the cache (the chunk's first position)."""
    num_new: list[int]
    """Tokens of each sequence computed this step."""
    samples: list[bool]
    """Whether the sequence's last known token is computed this step (so a new token is sampled)."""
    rows: list[int]
    """Each sequence's row of ``Scheduler.block_tables_RN`` (its block table as a tensor)."""
    num_decode: int
    """Leading sequences with exactly one new token."""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def chunks(self) -> list[SeqChunk]:
        return self.chunks_from(0)

    def chunks_from(self, i: int) -> list[SeqChunk]:
        """``chunks[i:]`` (without building the first i)."""
        # The chunks alias the sequences' block tables: a batch is consumed within its step.
        return [
            SeqChunk(block_table=s.block_table, start=c, num_new=n)
            for s, c, n in zip(self.seqs[i:], self.starts[i:], self.num_new[i:])
        ]

    @property
    def max_blocks(self) -> int:
        """Longest block table of the batch."""
        return max([len(s.block_table) for s in self.seqs])


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int,
        max_tokens_per_step: int,
        prefill_chunk_size: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.prefill_chunk_size = prefill_chunk_size
        self.max_blocks_per_seq = max_blocks_per_seq
        # Block tables of the running sequences as one CPU tensor, updated incrementally (a row is
        # written on admission, one entry per new block), so a step gathers its rows instead of
        # rebuilding [B, N] from Python lists. Unused entries hold the scratch block (the pool's
        # extra block, id ``num_blocks``); the last row is all scratch (padding rows of a batch).
        self.scratch_block = allocator.num_blocks
        # Wide enough for every CUDA-graph block-table width (``graph_shapes.graph_num_blocks``).
        width = max(graph_num_blocks(max_blocks_per_seq, paged) for paged in (False, True))
        self.block_tables_RN = torch.full((max_num_seqs + 1, width), self.scratch_block, dtype=torch.long)
        self.scratch_row = max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._pending: dict[int, list[tuple[int, int]]] = {}
        """Block-table entries (column, block) of running rows that ``schedule`` writes at its end."""
        self.waiting: list[Sequence] = []
        """Sorted by arrival (preempted sequences keep their place)."""
        self.running: list[Sequence] = []
        """Sorted by arrival."""
        self.num_preemptions = 0

    # ---- queue management ----
    def add(self, seq: Sequence) -> None:
        if self.waiting and self.waiting[-1].arrival > seq.arrival:
            bisect.insort(self.waiting, seq, key=_arrival)
        else:  # a new arrival: the latest
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def remove_finished(self, seqs: list[Sequence]) -> None:
        """``remove`` for running sequences that finished in one step: one pass over ``running``
        and one write resetting their block-table rows."""
        gone = set(seqs)
        self.running[:] = [s for s in self.running if s not in gone]
        rows, cols = [], []
        for seq in seqs:
            if seq.row is not None:
                n = len(seq.block_table)
                rows += [seq.row] * n
                cols += range(n)
            self._release(seq, reset_row=False)
        if rows:
            self.block_tables_RN[torch.tensor(rows), torch.tensor(cols)] = self.scratch_block

    def preempt_all(self) -> None:
        """Send every running sequence back to waiting (its K/V will be recomputed)."""
        for seq in list(self.running):
            self._preempt(seq)

    # ---- one step ----
    def schedule(self) -> ScheduledBatch:
        budget = self.max_tokens_per_step
        decode: list[Sequence] = []
        chunks: list[tuple[Sequence, int]] = []
        # (sequence, tokens) of the step's chunks of more than one token
        preempted = False
        i = 0
        bs = self.allocator.block_size
        running = self.running
        while i < len(running) and budget > 0:
            seq = running[i]
            c = seq.num_computed
            if len(seq.token_ids) - c == 1 and c < len(seq.block_table) * bs:
                # Decoding into a block it owns: nothing to allocate. The blocks its generated tokens
                # fill are registered in the prefix cache when it is released (``_release``), not
                # during decoding (one hash per block per sequence on the host's critical path).
                decode.append(seq)
                budget -= 1
                i += 1
                continue
            n = min(self._chunk_len(seq), budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if n == 1:
                    decode.append(seq)
                else:
                    chunks.append((seq, n))
                budget -= n
                i += 1
        # After a preemption the pool is full: admitting now would only evict again next step.
        last = self.running[-1].arrival if self.running else -1
        unsorted = False
        admitted: list[Sequence] = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self._match_prefix(seq)
            n = min(self._chunk_len(seq), budget)
            if not self._reserve(seq, seq.num_computed + n):
                self._release(seq)
                break
            self.waiting.pop(0)
            self.running.append(seq)
            unsorted |= seq.arrival < last
            seq.row = self._free_rows.pop()
            admitted.append(seq)
            if n == 1:
                decode.append(seq)
            else:
                chunks.append((seq, n))
            budget -= n
        if self._pending:
            self._flush_pending()
        if admitted:
            self._write_rows(admitted)
        if unsorted:  # a preempted sequence (an earlier arrival) came back: keep ``running`` in arrival order
            self.running.sort(key=_arrival)
        # Decode chunks (one token) first: the attention backend batches them separately.
        nd = len(decode)
        seqs = decode + [s for s, _ in chunks]
        num_new = [1] * nd + [n for _, n in chunks]
        starts = [s.num_computed for s in seqs]
        # (a one-token chunk samples unless the budget cut a prompt's chunk to one token)
        samples = [s.num_computed + 1 == len(s.token_ids) for s in decode] + [
            s.num_computed + n == len(s.token_ids) for s, n in chunks
        ]
        return ScheduledBatch(
            seqs=seqs, starts=starts, num_new=num_new, samples=samples, rows=[s.row for s in seqs], num_decode=nd
        )

    def _chunk_len(self, seq: Sequence) -> int:
        remaining = len(seq.token_ids) - seq.num_computed
        assert remaining >= 1
        return 1 if remaining == 1 else min(remaining, self.prefill_chunk_size)

    def _match_prefix(self, seq: Sequence) -> None:
        # The last known token is always computed: its logits give the next token.
        blocks, key = self.allocator.match_prefix(seq.token_ids, len(seq.token_ids) - 1, seq.prefix_root)
        seq.block_table = blocks
        seq.num_computed = len(blocks) * self.allocator.block_size
        seq.num_registered_blocks = len(blocks)
        seq.last_key = key

    def _reserve(self, seq: Sequence, upto: int) -> bool:
        """Give ``seq`` blocks for its first ``upto`` tokens and register the ones that become full."""
        bs = self.allocator.block_size
        needed = -(-upto // bs) - len(seq.block_table)
        if needed > self.allocator.num_available:
            return False
        table = seq.block_table
        for _ in range(needed):
            table.append(self.allocator.allocate())
            if seq.row is not None:  # written into ``block_tables_RN`` at the end of ``schedule``
                self._pending.setdefault(seq.row, []).append((len(table) - 1, table[-1]))
        self._register_full_blocks(seq, upto)
        return True

    def _flush_pending(self) -> None:
        """Write the block-table entries ``_reserve`` gave running rows, in one indexed write."""
        rows, cols, blocks = [], [], []
        for row, entries in self._pending.items():
            for col, block in entries:
                rows.append(row)
                cols.append(col)
                blocks.append(block)
        self._pending.clear()
        self.block_tables_RN[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(blocks)

    def _register_full_blocks(self, seq: Sequence, upto: int) -> None:
        """Register ``seq``'s full blocks among its first ``upto`` tokens in the prefix cache (a
        sequence whose K/V predates a weight update only advances its count)."""
        bs = self.allocator.block_size
        while seq.num_registered_blocks < upto // bs:
            b = seq.num_registered_blocks
            if seq.cache_ok:
                tokens = tuple(seq.token_ids[b * bs : (b + 1) * bs])
                seq.last_key = self.allocator.register(seq.block_table[b], seq.last_key, tokens)
            seq.num_registered_blocks += 1

    def mark_stale(self) -> None:
        """A weight update kept the running sequences' K/V: keep it out of the prefix cache."""
        for seq in self.running:
            seq.cache_ok = False

    def reserve_ahead(self, seqs: list[Sequence], upto: list[int]) -> bool:
        """Give each sequence blocks for its first ``upto`` tokens (tokens not sampled yet: nothing
        is registered in the prefix cache) — all of them or, when the pool is short, none."""
        bs = self.allocator.block_size
        needed = [-(-u // bs) - len(s.block_table) for s, u in zip(seqs, upto)]
        total = sum(n for n in needed if n > 0)
        if total > self.allocator.num_available:
            return False
        blocks = self.allocator.allocate_many(total)
        rows, cols = [], []
        i = 0
        for seq, n in zip(seqs, needed):
            if n > 0:
                table = seq.block_table
                rows += [seq.row] * n
                cols += range(len(table), len(table) + n)
                table += blocks[i : i + n]
                i += n
        if blocks:  # one indexed write instead of one per block
            self.block_tables_RN[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def block_tables_for(self, rows: list[int], width: int, batch_size: int | None = None) -> torch.Tensor:
        """long [B, width] block tables of a batch's rows, padded with the scratch block;
        ``batch_size`` > B appends all-scratch padding rows."""
        if width > self.block_tables_RN.shape[1]:
            raise ValueError(f"block-table width {width} exceeds the scheduler's {self.block_tables_RN.shape[1]}")
        if batch_size is not None and batch_size > len(rows):
            rows = rows + [self.scratch_row] * (batch_size - len(rows))
        return self.block_tables_RN[:, :width].index_select(0, torch.tensor(rows, dtype=torch.long))

    def _write_rows(self, seqs: list[Sequence]) -> None:
        """Write the block tables of sequences that just took their rows, in one indexed write."""
        rows, cols, blocks = [], [], []
        for seq in seqs:
            n = len(seq.block_table)
            rows += [seq.row] * n
            cols += range(n)
            blocks += seq.block_table
        if blocks:
            self.block_tables_RN[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(blocks)

    def _release(self, seq: Sequence, reset_row: bool = True) -> None:
        """Release ``seq``'s blocks and row. ``reset_row`` False: the caller resets the row's
        block-table entries to the scratch block (``remove_finished``, one write for many rows)."""
        # Publish the full blocks of computed tokens (a finished turn's continuation, a preempted
        # request's recompute find them); positions past the known tokens hold discarded K/V.
        self._register_full_blocks(seq, min(seq.num_computed, len(seq.token_ids)))
        if seq.row is not None:
            self._pending.pop(seq.row, None)  # entries not written yet (preempted within ``schedule``)
            if reset_row:
                self.block_tables_RN[seq.row, : len(seq.block_table)] = self.scratch_block
            self._free_rows.append(seq.row)
            seq.row = None
        self.allocator.free_all(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered_blocks = 0
        seq.last_key = seq.prefix_root
        seq.cache_ok = True

    def after_step(self, batch: ScheduledBatch, decode_steps: int = 1) -> None:
        """Count the computed tokens; ``decode_steps`` > 1: a pure-decode batch ran that many
        decode steps (one token each)."""
        if decode_steps > 1:
            for seq in batch.seqs:
                seq.num_computed += decode_steps
            return
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
