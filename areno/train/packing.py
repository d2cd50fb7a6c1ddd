"""Token-budget micro-batching of packed batches.

A global ``TokenBatch`` of B sequences is split in two stages, the same way on every rank (each
rank computes the whole plan from the whole batch, so no communication is needed):

1. sequences go to data-parallel ranks longest-first, each to the rank with the fewest tokens so
   far (LPT), which balances tokens (the work) across ranks;
2. each rank's sequences are packed first-fit-decreasing into micro-batches of at most
   ``max_tokens_per_mb`` tokens.

Where the model computes a group's common prompt once (``models.prefix_sharing``), a group split
over ranks or micro-batches computes it once in each. The planner is then also given what each
sequence shares with the one before it (``shared_B``) and weighs plans by the rows the shared
forwards run. Besides the two stages above it tries contiguous plans (whole groups where they fit,
else consecutive sequences), balanced by a binary search of their largest part: the ranks take the
split whose busiest rank runs the fewest rows (then the fewest in all), each rank the micro-batches
whose rows and fixed costs (``spec.micro_batch_rows`` each, on a CPU) are least, or on a GPU the fewest
micro-batches (then the fewest rows); then those whose largest is smallest. The budget stays on
tokens, shared or not.

FSDP runs collectives in every forward and backward, so all ranks must run the same number of
micro-batches: ranks with fewer split their fullest micro-batch until the counts agree, and a rank
with fewer sequences than micro-batches runs empty ones (the backend feeds them a one-token dummy
whose loss is multiplied by zero).

Document masking comes from ``PackedCausalAttention(cu_seqlens_B1)``: attention never crosses a
sequence boundary and positions restart at 0, so packing costs no FLOPs on padding and gives the
same result as running each sequence alone.

Legend: B = sequences, T = packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areno.errors import ConfigError
from areno.types import TokenBatch

MICRO_BATCH_ROWS = 256
"""What one more micro-batch costs on a CPU, in rows of a shared-prompt forward, where the planner weighs rows:
each casts the weights and adds their gradients again, besides its host work (170-260 rows' time at the
cpu5m and cpu12m shapes, bench/LOG.md). A plan of one more micro-batch wins where it saves more rows. On an
H200 a 0.5B micro-batch of 1,344 rows cost as much as one of 3,000 (``MicroBatchSpec.micro_batch_rows``)."""


@dataclass(kw_only=True)
class MicroBatchSpec:
    """How a batch is cut into micro-batches."""

    max_tokens_per_mb: int
    """Token budget of one packed micro-batch (> 0); a sequence longer than this is an error (the
    backend truncates such sequences first when ``long_sequences='truncate'``)."""
    dp_size: int = 1
    """Number of data-parallel ranks the batch is balanced over (>= 1)."""
    cp_size: int = 1
    """Context-parallel ranks that share each micro-batch (>= 1): ``max_tokens_per_mb`` is what one
    rank holds, so a micro-batch takes up to ``max_tokens_per_mb * cp_size`` tokens, a multiple of
    cp that its token count, padded to a multiple of cp (``context_parallel.padded_tokens``), never
    exceeds."""
    micro_batch_rows: int | None = MICRO_BATCH_ROWS
    """Where the planner weighs shared prompts' rows: what one more micro-batch costs, in rows (a CPU's);
    None, the fewest micro-batches first (a GPU's, whose micro-batch of a small model costs its launches and
    fixed work more than its rows)."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_mb <= 0:
            raise ValueError(f"max_tokens_per_mb must be > 0, got {self.max_tokens_per_mb}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")

    @property
    def budget(self) -> int:
        """Tokens one micro-batch may hold (over all its context-parallel ranks)."""
        return self.max_tokens_per_mb * self.cp_size


@dataclass(kw_only=True)
class MicroBatchPlan:
    """Sequence indices of every micro-batch of every data-parallel rank.

    ``per_rank[r][m]`` lists the sequences (indices into the global batch, ascending) of
    micro-batch m of rank r; every rank has ``n_mbs`` micro-batches, some possibly empty.
    """

    per_rank: list[list[list[int]]]

    @property
    def n_mbs(self) -> int:
        return len(self.per_rank[0])

    def all_micro_batches(self) -> list[list[int]]:
        """Every non-empty micro-batch of every rank, rank-major."""
        return [mb for rank in self.per_rank for mb in rank if mb]


def _first_fit_decreasing(seq_indices: list[int], seqlens: list[int], budget: int) -> list[list[int]]:
    order = sorted(seq_indices, key=lambda i: (-seqlens[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + seqlens[i] <= budget:
                bins[b].append(i)
                loads[b] += seqlens[i]
                break
        else:
            bins.append([i])
            loads.append(seqlens[i])
    return bins


def _split_to_count(
    bins: list[list[int]], seqlens: list[int], n: int, prompts: _Prompts | None = None
) -> list[list[int]]:
    """Split the fullest multi-sequence bins until there are n bins (empty ones if impossible): into
    two halves balanced longest-first, or with ``prompts`` into two runs of consecutive sequences."""
    bins = [list(b) for b in bins]
    while len(bins) < n:
        splittable = [b for b in bins if len(b) >= 2]
        if not splittable:
            bins.append([])
            continue
        fullest = max(splittable, key=lambda b: sum(seqlens[i] for i in b))
        bins.remove(fullest)
        if prompts is not None:
            bins.extend(prompts.balanced(prompts.items(sorted(fullest), whole_runs=False), 2, by_rows=False))
            continue
        halves: list[list[int]] = [[], []]
        loads = [0, 0]
        for i in sorted(fullest, key=lambda i: (-seqlens[i], i)):
            side = 0 if loads[0] <= loads[1] else 1
            halves[side].append(i)
            loads[side] += seqlens[i]
        bins.extend(halves)
    return bins


@dataclass(frozen=True)
class _Item:
    """Consecutive sequences a contiguous plan keeps together: one sequence, or a stretch of a run."""

    seqs: list[int]
    tokens: int
    rows: int
    """Rows its shared-prompt forward runs on its own."""
    first_run: int
    last_run: int
    join: int
    """Rows saved when it follows a part whose last sequence is of its first sequence's run."""


class _Prompts:
    """What a shared-prompt forward saves on each sequence (``shared_B``), and the costs and contiguous
    plans built on it (``plan_micro_batches``)."""

    def __init__(self, shared_B: list[int], seqlens: list[int]) -> None:
        self.shared, self.seqlens = shared_B, seqlens
        self.run: list[int] = []  # the first sequence of each sequence's run
        for b, s in enumerate(shared_B):
            self.run.append(self.run[-1] if s and b else b)

    def rows(self, seqs: list[int]) -> int:
        """Rows the shared forward of a micro-batch of ``seqs`` (ascending) runs: a sequence after one of
        its run pays only its rest."""
        total, prev = 0, None
        for i in seqs:
            total += self.seqlens[i] - (self.shared[i] if prev is not None and self.run[prev] == self.run[i] else 0)
            prev = i
        return total

    def items(self, seqs: list[int], *, whole_runs: bool) -> list[_Item]:
        """``seqs`` (ascending) as items: each sequence, or each stretch of one run with ``whole_runs``."""
        groups: list[list[int]] = []
        for i in seqs:
            if whole_runs and groups and self.run[groups[-1][-1]] == self.run[i]:
                groups[-1].append(i)
            else:
                groups.append([i])
        return [
            _Item(g, sum(self.seqlens[i] for i in g), self.rows(g), self.run[g[0]], self.run[g[-1]], self.shared[g[0]])
            for g in groups
        ]

    @staticmethod
    def greedy(items: list[_Item], cap: int, *, by_rows: bool) -> list[int]:
        """Where consecutive items' parts of at most ``cap`` tokens (or rows) start, each part as full as it
        goes (an item over ``cap`` alone in its part): the index of each part's first item."""
        starts: list[int] = []
        load, last_run = 0, -1
        for j, it in enumerate(items):
            alone = it.rows if by_rows else it.tokens
            joined = alone - it.join if by_rows and last_run == it.first_run else alone
            if starts and load + joined <= cap:
                load += joined
            else:
                starts.append(j)
                load = alone
            last_run = it.last_run
        return starts

    def balanced(self, items: list[_Item], k: int, *, by_rows: bool, cap: int | None = None) -> list[list[int]]:
        """Consecutive items in at least ``k`` parts (empty ones where there are fewer items), no more
        than the greedy cut at ``cap`` (default: none) needs, with the smallest largest part."""
        weight = (lambda it: it.rows) if by_rows else (lambda it: it.tokens)
        lo, hi = max((weight(it) for it in items), default=0), sum(weight(it) for it in items)
        if cap is not None:
            hi = max(lo, min(hi, cap))
        k = max(k, len(self.greedy(items, hi, by_rows=by_rows)))
        while lo < hi:  # the greedy cut's part count never grows with its cap
            mid = (lo + hi) // 2
            if len(self.greedy(items, mid, by_rows=by_rows)) <= k:
                hi = mid
            else:
                lo = mid + 1
        starts = self.greedy(items, lo, by_rows=by_rows)
        parts = [[i for it in items[a:b] for i in it.seqs] for a, b in zip(starts, [*starts[1:], len(items)])]
        return parts + [[] for _ in range(k - len(parts))]

    def rank_plans(self, lpt: list[list[int]], dp_size: int) -> list[list[list[int]]]:
        """Data-parallel candidates: ``lpt``, and contiguous plans of whole runs and of sequences,
        balanced in rows (one rank: ``lpt`` alone, which holds every sequence)."""
        if dp_size == 1:
            return [lpt]
        every = list(range(len(self.seqlens)))
        return [lpt] + [self.balanced(self.items(every, whole_runs=w), dp_size, by_rows=True) for w in (True, False)]

    def micro_batch_plans(self, seqs: list[int], budget: int) -> list[list[list[int]]]:
        """One rank's candidates: first-fit-decreasing, and contiguous plans within the budget, of whole
        runs where each fits and of sequences, in as few micro-batches as each can, balanced in tokens."""
        plans = [_first_fit_decreasing(seqs, self.seqlens, budget)]
        for whole in (True, False):
            items = self.items(sorted(seqs), whole_runs=whole)
            if items and max(it.tokens for it in items) <= budget:
                plans.append(self.balanced(items, 1, by_rows=False, cap=budget))
        return plans


def plan_micro_batches(
    seqlens_B: list[int] | torch.Tensor, spec: MicroBatchSpec, shared_B: list[int] | None = None
) -> MicroBatchPlan:
    """Balance sequences over ``spec.dp_size`` ranks and pack each rank's share into micro-batches.
    ``shared_B``: the prompt tokens each sequence shares with the one before it, where the model runs
    them once (``prefix_sharing.shared_prompt_tokens``); plans are then weighed in rows, not tokens.

    Raises ValueError when a sequence is longer than the token budget.
    """
    seqlens = [int(n) for n in (seqlens_B.tolist() if isinstance(seqlens_B, torch.Tensor) else seqlens_B)]
    if not seqlens:
        raise ValueError("cannot plan micro-batches for an empty batch")
    longest = max(seqlens)
    if longest > spec.budget:
        cp = f" x cp_size={spec.cp_size}" if spec.cp_size > 1 else ""
        raise ConfigError(
            f"sequence {seqlens.index(longest)} has {longest} tokens, more than "
            f"max_tokens_per_mb={spec.max_tokens_per_mb}{cp}; raise max_tokens_per_mb to at least "
            f"{-(-longest // spec.cp_size)}, shorten the sequences, or set long_sequences='truncate'"
        )
    rank_seqs: list[list[int]] = [[] for _ in range(spec.dp_size)]
    rank_load = [0] * spec.dp_size
    for i in sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i)):
        r = min(range(spec.dp_size), key=lambda r: (rank_load[r], r))
        rank_seqs[r].append(i)
        rank_load[r] += seqlens[i]
    prompts = _Prompts([int(s) for s in shared_B], seqlens) if shared_B is not None and any(shared_B) else None
    if prompts is None:
        rank_bins = [_first_fit_decreasing(s, seqlens, spec.budget) for s in rank_seqs]
    else:

        def rows(bins: list[list[int]]) -> list[int]:
            return [prompts.rows(sorted(b)) for b in bins]

        def tokens(bins: list[list[int]]) -> int:
            return max((sum(seqlens[i] for i in b) for b in bins), default=0)

        # the ranks: the split whose busiest rank runs the fewest rows (then the fewest in all); each rank: the
        # micro-batches of least rows and fixed cost, or the fewest (then the smallest largest one)
        ranks = min(prompts.rank_plans(rank_seqs, spec.dp_size), key=lambda r: (max(rows(r)), sum(rows(r))))
        per_mb = spec.micro_batch_rows

        def cost(p: list[list[int]]) -> tuple[int, ...]:
            if per_mb is None:
                return len(p), sum(rows(p)), tokens(p)
            return sum(rows(p)) + per_mb * len(p), tokens(p)

        rank_bins = [min(prompts.micro_batch_plans(seqs, spec.budget), key=cost) for seqs in ranks]
    n_mbs = max(1, max(len(b) for b in rank_bins))
    per_rank = [[sorted(b) for b in _split_to_count(bins, seqlens, n_mbs, prompts)] for bins in rank_bins]
    return MicroBatchPlan(per_rank=per_rank)


def truncate_long_sequences(batch: TokenBatch, max_len: int) -> tuple[TokenBatch, torch.Tensor | None]:
    """Keep the first ``max_len`` tokens of every sequence (the ``long_sequences='truncate'`` policy).

    Returns the truncated batch and the bool [T] mask of kept tokens in the original batch, or
    ``(batch, None)`` when no sequence is longer. Per-token tensors (and ``extra`` keys ending in
    ``_T``) are cut; per-sequence ones are kept whole.
    """
    seqlens_B = batch.seqlens_B
    if batch.num_seqs == 0 or int(seqlens_B.max()) <= max_len:
        return batch, None
    keep_T = batch.position_ids_T() < max_len
    new_cu = torch.zeros_like(batch.cu_seqlens_B1)
    new_cu[1:] = torch.cumsum(seqlens_B.clamp(max=max_len), 0)
    return batch.gather(keep_T, new_cu), keep_T


def untruncate_outputs(outputs: dict[str, torch.Tensor], keep_T: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token outputs of a truncated batch put back on the original tokens (0 on dropped ones)."""
    full: dict[str, torch.Tensor] = {}
    for key, value in outputs.items():
        if key.endswith("_T"):
            out = value.new_zeros((keep_T.numel(), *value.shape[1:]))
            out[keep_T] = value
            full[key] = out
        else:
            full[key] = value
    return full


def dummy_batch(like: TokenBatch) -> TokenBatch:
    """A one-token batch (its first token, nothing in the loss) for ranks without real work."""
    batch = like.select([0])
    return TokenBatch(
        input_ids_T=batch.input_ids_T[:1],
        cu_seqlens_B1=torch.tensor([0, 1], dtype=torch.long),
        loss_mask_T=torch.zeros(1, dtype=torch.bool),
        logprobs_T=batch.logprobs_T[:1] * 0,
        versions_T=batch.versions_T[:1],
        advantages_T=batch.advantages_T[:1] * 0,
        rewards_B=batch.rewards_B[:1] * 0,
        group_ids=batch.group_ids[:1],
        extra={k: (v[:1] * 0 if v.is_floating_point() else v[:1]) for k, v in batch.extra.items()},
        truncated_B=None if batch.truncated_B is None else torch.zeros(1, dtype=torch.bool),
    )


def activation_bytes_per_token(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    vocab_size: int,
    q_kv_dim: int,
    compute_bytes: int = 2,
    activation_checkpointing: bool = False,
) -> int:
    """Device bytes a micro-batch's activations take per token (coarse, on the safe side).

    Per token and layer the backward keeps the layer's inputs, the attention projections
    (``q_kv_dim`` = (Hq + 2 Hkv) * Dh), attention output and the SwiGLU intermediates (about
    ``8 D + 2 q_kv_dim + 5 I`` elements; flash/varlen attention keeps no T x T scores). With
    activation checkpointing only each layer's input (D) is kept, plus one layer recomputed at a
    time. The LM head adds ``V`` compute-dtype logits plus fp32 log-softmax for the chunk in flight,
    counted for every token to stay on the safe side."""
    per_layer = 8 * hidden_size + 2 * q_kv_dim + 5 * intermediate_size
    if activation_checkpointing:
        per_token = compute_bytes * (num_layers * hidden_size + per_layer)
    else:
        per_token = compute_bytes * num_layers * per_layer
    return per_token + vocab_size * (compute_bytes + 4)


def estimate_max_tokens_per_mb(*, free_bytes: int, safety: float = 0.7, **shape: int | bool) -> int:
    """Largest micro-batch token budget whose activations (``activation_bytes_per_token`` of ``shape``)
    fit in ``safety`` x ``free_bytes``. Rounded down to a multiple of 256, at least 256."""
    tokens = int(free_bytes * safety) // max(activation_bytes_per_token(**shape), 1)
    return max(256, (tokens // 256) * 256)
