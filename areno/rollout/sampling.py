"""Batched token sampling with per-row parameters, on-device stop checks, and the stop rules.

Legend: B = sequences sampled this step, V = vocabulary, S = stop ids per row (padded).

Order of a row's processing (vLLM's): the repetition penalty on the raw logits (greedy rows too),
the temperature, ``min_new_tokens``' suppression of EOS/stop ids, then min-p, top-k and top-p (min-p
and top-k keep a prefix of the sorted tokens each, so those two commute; top-p then keeps the mass
``top_p`` of what they left, renormalised). Hugging Face and SGLang apply min-p after top-p instead,
which differs only when a row sets both.

Log-prob convention (what the trainer recomputes): the log-prob reported for a sampled token is
``log_softmax(logits / T)[token]`` over the *full* vocabulary, i.e. under the temperature-scaled
distribution *before* the repetition penalty, min-p / top-p / top-k truncation and ``min_new_tokens``'
suppression of EOS. The trainer recomputes exactly ``log_softmax(logits / T)`` on the packed batch, so
behaviour and proximal log-probs are comparable; those are treated as part of the sampler, not of the
policy (as in AReaL/verl). Greedy requests (``temperature == 0``) report ``log_softmax(logits)`` (T = 1).
The repetition penalty reads each row's seen tokens from the engine's ``PresenceTable`` (``presence.py``).

Everything is vectorised over rows and stays on the device: ``RowParams`` holds each row's
temperature, top-k, top-p, seed, stop ids and token limits as tensors (built with one host-to-device
copy per engine step), ``Sampler.sample_rows`` returns token ids and log-probs as device tensors,
and ``RowParams.advance`` marks the rows that just finished (stop id or length), so the engine can
run several decode steps and copy one small tensor to the host at the end.

Randomness: a sampled row draws one uniform u in (0, 1) and takes the token whose interval of the
cumulative distribution holds it (inverse transform sampling: an exact draw, in a softmax and a two-level
search, blocks then one block, where per-token noise took ~25 element-wise passes over the vocabulary).
A request with ``seed`` gets u from a counter-based hash of (seed, number of tokens generated so far),
so the same seed and prompt give the same tokens whatever else is in the batch and however the engine
groups its decode steps; rows without a seed draw u from the engine's ``torch.Generator``.

Capture-safe form (the CUDA-graph decode loop, ``cuda_graph.py``): ``RowParams.table_FB`` is the packed
per-row table (one column per row) that ``RowTensors.from_table`` decodes on the device, and
``Sampler.sample_static`` samples one step from it with no host read and no data-dependent shape:
per-row choices become masks (``where``) instead of row subsets, and the batch-level choices form a
``SampleMode`` (all greedy; truncation; hash and/or generator noise) that keys the graph. For the same
rows it returns exactly the tokens and log-probs of ``Sampler.sample_rows`` (seeded and greedy rows;
unseeded rows draw from the same generator, in another order).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from areno.models import fused_ops
from areno.rollout import fused_sampler
from areno.rollout.presence import PresenceTable, apply_repetition_penalty
from areno.types import SamplingParams


@dataclass
class SampleRequest:
    """What the sampler needs about one row of the logits (the list form of ``RowParams``)."""

    params: SamplingParams
    num_generated: int
    generator: object = None
    """Unused (kept for call compatibility): seeded rows draw their uniform from ``params.seed``."""
    suppress_ids: tuple[int, ...] = ()
    """Token ids to forbid for this row (EOS/stop ids while ``num_generated < min_new_tokens``)."""
    seen_ids: tuple[int, ...] = ()
    """The row's prompt and output so far: the tokens its ``repetition_penalty`` applies to."""


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one of them stays below 2**63 (no int64 overflow).
_MULS = (0x7FEB352D, 0x5BD1E995, 0x27D4EB2F)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2**32."""
    for i, m in enumerate(_MULS):
        h = h ^ (h >> (16 if i % 2 == 0 else 15))
        h = (h * m) & _MASK32
    return h ^ (h >> 16)


def hash_uniform(seed_R: torch.Tensor, counter_R: torch.Tensor) -> torch.Tensor:
    """float32 [R] uniform in (0, 1), a pure function of (seed, counter): 23 bits of the row key,
    centred (largest value 1 - 2**-24, exactly representable). In the rollout engine's steps on CUDA
    one fused kernel (``enable_fused_hash``), elsewhere these element-wise ops."""
    if _FUSED_HASH.on and fused_ops.active(seed_R):
        return fused_ops.hash_uniform(seed_R, counter_R)
    key_R = _mix32((seed_R & _MASK32) ^ _mix32(((seed_R >> 32) & _MASK32) ^ _mix32(counter_R & _MASK32)))
    return (((key_R >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (2.0**-23)


def fused_hash_self_check(device: torch.device | str = "cuda") -> str | None:
    """The fused hash against the element-wise ops on seeds of every sign and size; None when every
    value is equal, else what differs."""
    gen = torch.Generator().manual_seed(0)
    seeds = torch.cat((torch.randint(-(2**62), 2**62, (997,), generator=gen), torch.tensor([0, -1, 2**63 - 1])))
    counters = torch.randint(0, 2**40, (1000,), generator=gen)
    try:
        got = fused_ops.hash_uniform(seeds.to(device), counters.to(device)).cpu()
    except Exception as e:  # noqa: BLE001 - a compiler or driver error leaves the element-wise ops
        return f"{type(e).__name__}: {e}"
    ref = hash_uniform(seeds, counters)
    if not torch.equal(got, ref):
        return f"fused hash differs from the element-wise ops in {int((got != ref).sum())} of {ref.numel()} rows"
    return None


_FUSED_HASH = fused_ops.KernelSwitch(
    "the fused sampling hash (element-wise ops are used)", lambda: fused_hash_self_check()
)


def enable_fused_hash() -> bool:
    """Turn the fused hash on for this process after its self-check (idempotent; the rollout engine
    calls it with its other fused kernels, before any graph is captured)."""
    return _FUSED_HASH.enable()


ARGMAX_CHUNK = 2048
"""CPU ``argmax_rows``: vocabulary entries per chunk of the two-level search."""


def argmax_rows(x_BV: torch.Tensor) -> torch.Tensor:
    """``x_BV.argmax(dim=-1)`` (the first index of each row's maximum; a NaN counts as the maximum).

    On CPU over a large vocabulary as a two-level search: each chunk's ``amax`` (a vectorised
    reduction), the first chunk holding the row's maximum, then ``argmax`` inside that chunk only;
    PyTorch's CPU argmax is not vectorised (measured over [32, 32000] on two cores: 1.3-1.5 ms, this
    ~0.45 ms). Same indices, ties and NaNs included (test). Elsewhere a plain ``argmax``."""
    B, V = x_BV.shape
    C = V // ARGMAX_CHUNK
    if x_BV.device.type != "cpu" or C < 2:
        return x_BV.argmax(dim=-1)
    body_BCK = x_BV[:, : C * ARGMAX_CHUNK].unflatten(1, (C, ARGMAX_CHUNK))
    chunk_max_BC = body_BCK.amax(dim=-1)
    c_B = chunk_max_BC.argmax(dim=-1)  # the first chunk with the maximum (NaN: the first NaN's chunk)
    rows_B = torch.arange(B, device=x_BV.device)
    idx_B = body_BCK[rows_B, c_B].argmax(dim=-1) + c_B * ARGMAX_CHUNK
    if V > C * ARGMAX_CHUNK:  # the remainder after the last whole chunk wins only when strictly larger
        tail_BT = x_BV[:, C * ARGMAX_CHUNK :]
        best_B, tail_best_B = chunk_max_BC[rows_B, c_B], tail_BT.amax(dim=-1)
        tail_wins_B = (tail_best_B > best_B) | (tail_best_B.isnan() & ~best_B.isnan())
        idx_B = torch.where(tail_wins_B, tail_BT.argmax(dim=-1) + C * ARGMAX_CHUNK, idx_B)
    return idx_B


DRAW_BLOCK = 1024
"""``inverse_cdf_draw`` on CUDA: vocabulary entries per block of the two-level search."""


def inverse_cdf_draw(
    race_BV: torch.Tensor, u_B: torch.Tensor, weights_BV: torch.Tensor | None = None, block: int | None = None
) -> torch.Tensor:
    """long [B]: per row the token whose interval of the cumulative distribution ``softmax(race_BV)``
    holds ``u_B`` (uniform in (0, 1)): an exact draw from that distribution (inverse transform
    sampling), where per-token noise took ~25 element-wise passes over the vocabulary. Tokens of zero
    probability (-inf in ``race_BV``) are never drawn: their cumulative value equals their
    predecessor's. ``weights_BV``: non-negative weights proportional to that distribution, used
    (and possibly overwritten) instead of the softmax (the samplers pass ``exp(x - max)`` they
    already have, suppressed ids zeroed: one pass over the vocabulary fewer); the draw scales ``u`` by
    each row's total.

    Over more than two blocks of ``block`` entries (default: ``DRAW_BLOCK`` on CUDA, one block on
    CPU) the search has two levels: the blocks' sums, a cumulative sum over them, then one over the
    chosen block only. On CUDA a cumulative sum over the whole [B, V] is one slow scan per row (a
    quarter of a 0.5B model's decode step on an H200); on CPU it is one fast pass, the same time."""
    weights_BV = torch.softmax(race_BV, dim=-1) if weights_BV is None else weights_BV
    B, V = weights_BV.shape
    if block is None:
        block = DRAW_BLOCK if weights_BV.is_cuda else V
    if V <= 2 * block:
        cdf_BV = weights_BV.cumsum_(dim=-1)
        return _search_cdf(cdf_BV, u_B[:, None] * cdf_BV[:, -1:])
    C = V // block
    sums_BC = weights_BV[:, : C * block].unflatten(1, (C, block)).sum(dim=-1)
    if V > C * block:
        sums_BC = torch.cat((sums_BC, weights_BV[:, C * block :].sum(dim=-1, keepdim=True)), dim=1)
    block_cdf_BC = sums_BC.cumsum_(dim=-1)
    target_B1 = u_B[:, None] * block_cdf_BC[:, -1:]
    c_B1 = _search_cdf(block_cdf_BC, target_B1)[:, None]
    # the mass before the chosen block (0 for the first) leaves the target's share inside it; the
    # target is at least that mass, so the share is >= 0
    before_B1 = torch.where(c_B1 > 0, block_cdf_BC.gather(1, (c_B1 - 1).clamp_(min=0)), 0.0)
    idx_BK = c_B1 * block + torch.arange(block, device=weights_BV.device)
    inside_BK = idx_BK < V
    chosen_BK = weights_BV.gather(1, idx_BK.clamp(max=V - 1)).masked_fill_(~inside_BK, 0.0)
    j_B = _search_cdf(chosen_BK.cumsum_(dim=-1), target_B1 - before_B1)
    return (c_B1.squeeze(1) * block + j_B).clamp_(max=V - 1)


def _search_cdf(cdf_BN: torch.Tensor, target_B1: torch.Tensor) -> torch.Tensor:
    """long [B]: the first index whose cumulative value exceeds ``target_B1``. When rounding puts
    the target at or past the row's total: the last entry of non-zero weight (the first reaching the
    total). A row of NaN still gives an index < N."""
    total_B1 = cdf_BN[:, -1:].contiguous()
    found_B = torch.searchsorted(cdf_BN, target_B1.contiguous(), right=True).squeeze(1)
    last_B = torch.searchsorted(cdf_BN, total_B1, right=False).squeeze(1)
    return torch.minimum(found_B, last_B).clamp_(max=cdf_BN.shape[1] - 1)


class SampleMode(NamedTuple):
    """The batch-level choices of a sampling step (``Sampler.sample_static``; part of a decode-loop
    graph's key). Per-row parameters are tensors; these decide which kernels run at all."""

    sample: bool
    """Some row samples (temperature > 0); False: every row is greedy, a plain argmax."""
    truncate: bool
    """Some sampling row uses top-k, top-p or min-p."""
    hash_noise: bool
    """Some sampling row has its own seed (a uniform hashed from its seed and counter)."""
    rng_noise: bool
    """Some sampling row has no seed (noise from the engine's generator)."""
    penalize: bool = False
    """Some row (greedy or not) has a repetition penalty (its seen tokens read from the presence table)."""
    min_p_only: bool = False
    """The truncating rows use min-p alone (no top-k or top-p): a threshold against each row's maximum
    (``_min_p_rows``) instead of a sort over the vocabulary (at 151,936 tokens the sort added ~2 ms to a 0.5B
    model's 1.2 ms decode step on an H100)."""

    @classmethod
    def of(cls, params: SamplingParams) -> SampleMode:
        """The mode of a batch whose rows all use ``params``."""
        penalize = params.repetition_penalty != 1.0
        if params.temperature <= 0:
            return GREEDY._replace(penalize=penalize)
        sort = params.top_k > 0 or params.top_p < 1.0
        min_p_only = params.min_p > 0 and not sort
        return cls(True, sort or min_p_only, params.seed is not None, params.seed is None, penalize, min_p_only)


GREEDY = SampleMode(False, False, False, False)


# Rows of the packed table (``RowParams.table_FB``; then S stop ids and S validity flags).
(_SCALE, _GREEDY, _TOP_K, _TOP_P, _SEED, _SEEDED, _MIN_NEW, _MAX_NEW, _TRUNCATE, _N_GEN, _LENGTH, _MIN_P, _PENALTY,
 _SLOT) = range(14)  # fmt: skip
_FIXED = 14


@dataclass
class RowTensors:
    """Each row's sampling parameters as device tensors, decoded from the packed float64 table
    ``table_FB`` [14 + 2S, B] (``RowParams.table_FB``; a decode-loop graph holds one as a static
    input and decodes it inside the graph)."""

    scale_B: torch.Tensor
    greedy_B: torch.Tensor
    top_k_B: torch.Tensor
    top_p_B: torch.Tensor
    seed_B: torch.Tensor
    seeded_B: torch.Tensor
    stop_ids_BS: torch.Tensor
    stop_valid_BS: torch.Tensor
    min_new_B: torch.Tensor
    max_new_B: torch.Tensor
    truncate_B: torch.Tensor
    """The row samples with top-k, top-p or min-p (the eager sort; ``fused_sampler`` serves the others)."""
    min_p_B: torch.Tensor
    penalty_B: torch.Tensor
    """Repetition penalty (1: none)."""
    slot_B: torch.Tensor
    """The row's engine slot: its row of the presence table (padding rows: the scratch slot)."""
    n_gen_B: torch.Tensor
    """Tokens generated before the one sampled next (a view of the table: clone before advancing)."""
    room_B: torch.Tensor

    @classmethod
    def from_table(cls, table_FB: torch.Tensor, max_len: int) -> RowTensors:
        S = (table_FB.shape[0] - _FIXED) // 2
        long_FB = table_FB.long()
        return cls(
            scale_B=table_FB[_SCALE].float(),
            greedy_B=table_FB[_GREEDY] > 0,
            top_k_B=long_FB[_TOP_K],
            top_p_B=table_FB[_TOP_P].float(),
            seed_B=long_FB[_SEED],
            seeded_B=table_FB[_SEEDED] > 0,
            stop_ids_BS=long_FB[_FIXED : _FIXED + S].T,
            stop_valid_BS=(table_FB[_FIXED + S :] > 0).T,
            min_new_B=long_FB[_MIN_NEW],
            max_new_B=long_FB[_MAX_NEW],
            truncate_B=table_FB[_TRUNCATE] > 0,
            min_p_B=table_FB[_MIN_P].float(),
            penalty_B=table_FB[_PENALTY].float(),
            slot_B=long_FB[_SLOT],
            n_gen_B=long_FB[_N_GEN],
            room_B=torch.minimum(long_FB[_MAX_NEW] - long_FB[_N_GEN], max_len - long_FB[_LENGTH]),
        )

    @staticmethod
    def padding_table(S: int, B: int, vocab_size: int, device: torch.device, slot: int = 0) -> torch.Tensor:
        """A table of B padding rows: greedy, no stop ids, done after one token, no penalty; ``slot``:
        their presence-table row (the scratch slot: a penalised batch marks their tokens there)."""
        col = [1.0, 1.0, float(vocab_size), 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, float(slot)]
        col += [0.0] * (2 * S)
        return torch.tensor(col, dtype=torch.float64, device=device)[:, None].repeat(1, B)


_ROW_TENSOR_FIELDS = frozenset(f.name for f in dataclasses.fields(RowTensors))


@dataclass
class RowParams:
    """Per-row sampling parameters and counters of one engine step: the packed table on the device,
    batch-level flags, and the per-row tensors of ``RowTensors`` (``scale_B`` float32 temperature, 1
    for greedy rows; ``top_k_B`` V where disabled; ``seed_B`` meaningful where ``seeded_idx`` points;
    ``stop_ids_BS`` padded by repeating the row's first id, 0 in rows without any) read as
    attributes. Those tensors are decoded from ``table_FB`` at first use (``tensors``): a batch that
    the decode-loop graph serves never needs them (the graph decodes its copy of the table).

    ``n_gen_B`` (tokens generated before the one being sampled) advances with every sampled token
    (``advance``); ``room_B`` is how many tokens each row may still sample before its length limit
    (``max_new_tokens`` or the context)."""

    table_FB: torch.Tensor
    """The packed float64 table [14 + 2S, B] on the device (``RowTensors.from_table`` decodes it);
    a decode-loop graph copies it into its static input."""
    host_FB: torch.Tensor
    """The same table on the host (row indices are taken from it without a device read)."""
    max_len: int
    any_stop_ids: bool
    all_greedy: bool
    any_greedy: bool
    any_truncate: bool
    any_min_new: bool
    any_sort: bool
    """Some sampling row uses top-k or top-p (the others of ``any_truncate`` use min-p alone, no sort)."""
    all_unseeded: bool
    """Every row is random without a seed (noise for the whole batch in one draw)."""
    num_seeded: int
    """Random rows with their own seed."""
    num_unseeded: int
    """Random rows without a seed."""
    any_scaled: bool = True
    """Some row's temperature is not 1 (False: the logits are used unscaled, as ``x / 1`` equals ``x``)."""
    any_penalty: bool = False
    """Some row has a repetition penalty: the step reads ``presence`` (synced by the caller)."""
    presence: PresenceTable | None = None
    """The seen tokens of the rows' slots (``slot_B``), with ``any_penalty``."""
    steps_done: int = 0
    """Tokens sampled since ``build`` (``advance`` calls)."""
    _tensors: RowTensors | None = None
    _index: dict | None = None
    _uniforms_KB: torch.Tensor | None = None
    """The seeded rows' uniforms of ``prefetch_uniforms``' steps, from ``steps_done`` ``_uniforms_from``."""
    _uniforms_from: int = 0

    @property
    def tensors(self) -> RowTensors:
        """The per-row tensors, decoded from ``table_FB`` once (``n_gen_B`` is this object's own)."""
        if self._tensors is None:
            t = RowTensors.from_table(self.table_FB, self.max_len)
            t.n_gen_B = t.n_gen_B.clone()
            self._tensors = t
        return self._tensors

    @property
    def num_stop_columns(self) -> int:
        """S: stop-id columns of the table (part of a decode-loop graph's key)."""
        return (self.table_FB.shape[0] - _FIXED) // 2

    def _rows_where(self, name: str, mask_B: torch.Tensor) -> torch.Tensor:
        if self._index is None:
            self._index = {}
        if name not in self._index:
            self._index[name] = mask_B.nonzero().squeeze(1).to(self.table_FB.device)
        return self._index[name]

    @property
    def seeded_idx(self) -> torch.Tensor | None:
        """Rows with their own seed (None: none)."""
        if not self.num_seeded:
            return None
        return self._rows_where("seeded", self.host_FB[_SEEDED] > 0)

    @property
    def unseeded_idx(self) -> torch.Tensor | None:
        """Random rows without a seed, when only some rows are (None otherwise)."""
        if not 0 < self.num_unseeded < self.host_FB.shape[1]:
            return None
        return self._rows_where("unseeded", (self.host_FB[_GREEDY] <= 0) & (self.host_FB[_SEEDED] <= 0))

    @property
    def mode(self) -> SampleMode:
        """The batch-level choices of this batch (``Sampler.sample_static``)."""
        if self.all_greedy:
            return GREEDY._replace(penalize=self.any_penalty)
        min_p_only = self.any_truncate and not self.any_sort
        return SampleMode(
            True, self.any_truncate, self.num_seeded > 0, self.num_unseeded > 0, self.any_penalty, min_p_only
        )

    def __getattr__(self, name: str):
        # The per-row tensors (``RowTensors``' fields) read as attributes; decoded at first use.
        if name in _ROW_TENSOR_FIELDS:
            return getattr(self.tensors, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @staticmethod
    def row_of(params: SamplingParams, eos_token_ids: tuple[int, ...], vocab_size: int) -> tuple:
        """A request's static row (cache it per request): temperature scale, greedy, top-k, top-p,
        seed, seeded, min/max new tokens, truncating, the tuple of its stop/EOS ids, then min-p and
        the repetition penalty."""
        p = params
        random = p.temperature > 0
        return (
            p.temperature if random else 1.0,
            float(not random),
            float(p.top_k if p.top_k > 0 else vocab_size),
            p.top_p,
            float(p.seed if p.seed is not None else 0),
            float(p.seed is not None and random),
            float(p.min_new_tokens),
            float(p.max_new_tokens),
            # 2: top-k / top-p (a sort); 1: min-p alone (a threshold, ``_min_p_rows``); 0: neither
            2.0 if random and (p.top_k > 0 or p.top_p < 1.0) else float(random and p.min_p > 0),
            ((() if p.ignore_eos else tuple(eos_token_ids)) + tuple(p.stop_token_ids)),
            float(p.min_p if random else 0.0),
            float(p.repetition_penalty),
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams] | None,
        n_gen: list[int],
        lengths: list[int],
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        max_len: int,
        device: torch.device,
        rows: list[tuple] | None = None,
        slots: list[int] | None = None,
        presence: PresenceTable | None = None,
    ) -> RowParams:
        """From each row's ``SamplingParams`` (or its cached ``row_of`` tuple in ``rows``), tokens
        generated so far and tokens known; ``slots``: each row's presence-table row (default: its
        index), read from ``presence`` where a row has a repetition penalty. One host-to-device copy."""
        if rows is None:
            rows = [cls.row_of(p, eos_token_ids, vocab_size) for p in params]
        B = len(rows)
        slots = list(range(B)) if slots is None else slots
        S = max(1, max((len(r[9]) for r in rows), default=1))
        # One float64 [B, 14 + 2S] host tensor (float64 holds every id and seed below 2**53).
        table = []
        for r, g, n, slot in zip(rows, n_gen, lengths, slots):
            stops = r[9]
            k = len(stops)
            head = r[:9] + (g, n, r[10], r[11], slot) + stops
            if k == S:
                table.append(head + (1.0,) * S)
            else:
                pad = stops[0] if k else 0
                table.append(head + (pad,) * (S - k) + (1.0,) * k + (0.0,) * (S - k))
        host_BF = torch.tensor(table, dtype=torch.float64).reshape(B, _FIXED + 2 * S)
        return cls._from_host(host_BF.T.contiguous(), any(r[9] for r in rows), max_len, device, presence)

    @classmethod
    def gather(
        cls,
        table: RowTable,
        slots: list[int],
        n_gen: list[int],
        lengths: list[int],
        max_len: int,
        device: torch.device,
        presence: PresenceTable | None = None,
    ) -> RowParams:
        """``build`` from the static rows ``table`` holds for these slots (written when their
        requests took them), with tokens generated so far and tokens known: the same tensors as
        ``build`` from the requests' ``row_of`` tuples, without re-encoding them. One host-to-device copy."""
        ns = table.num_stops
        s_real = max([ns[i] for i in slots], default=0)
        host_FB = table.table_FR.index_select(1, torch.tensor(slots, dtype=torch.long))
        if max(1, s_real) < table.max_stops:
            host_FB = host_FB.index_select(0, table.columns(max(1, s_real)))
        host_FB[_N_GEN : _LENGTH + 1] = torch.tensor([n_gen, lengths], dtype=torch.float64)
        return cls._from_host(host_FB, s_real > 0, max_len, device, presence)

    @classmethod
    def _from_host(
        cls,
        host_FB: torch.Tensor,
        any_stop_ids: bool,
        max_len: int,
        device: torch.device,
        presence: PresenceTable | None = None,
    ) -> RowParams:
        """From the packed host table [14 + 2S, B] (contiguous): its device copy and the batch flags."""
        B = host_FB.shape[1]
        greedy, seeded, truncate = host_FB[_GREEDY] > 0, host_FB[_SEEDED] > 0, host_FB[_TRUNCATE] > 0
        n_greedy, n_seeded = int(greedy.sum()), int(seeded.sum())
        n_unseeded = B - n_greedy - n_seeded  # seeded rows are random rows
        any_min_new = bool((host_FB[_MIN_NEW] > host_FB[_N_GEN]).any())
        any_penalty = bool((host_FB[_PENALTY] != 1).any())
        dev_FB = host_FB
        if device.type != "cpu":
            dev_FB = dev_FB.to(device, non_blocking=True)
        return cls(
            table_FB=dev_FB,
            host_FB=host_FB,
            max_len=max_len,
            any_stop_ids=any_stop_ids,
            all_greedy=n_greedy == B,
            any_greedy=n_greedy > 0,
            any_truncate=bool(truncate.any()),
            any_min_new=any_min_new and B > 0,
            any_sort=bool((host_FB[_TRUNCATE] > 1).any()),
            all_unseeded=n_unseeded == B and B > 0,
            num_seeded=n_seeded,
            num_unseeded=n_unseeded,
            any_scaled=bool((host_FB[_SCALE] != 1).any()),
            any_penalty=any_penalty,
            presence=presence if any_penalty else None,
        )

    def shifted(self, n: int) -> RowParams:
        """These rows' parameters after each sampled ``n`` more tokens (the table's counts of tokens
        generated and known advanced by ``n``; ``steps_done`` 0): for decode steps that follow, in
        the same round trip, the tokens this batch sampled first."""
        table_FB = self.table_FB.clone()
        table_FB[_N_GEN : _LENGTH + 1] += n
        return dataclasses.replace(self, table_FB=table_FB, steps_done=0, _tensors=None, _uniforms_KB=None)

    def prefetch_uniforms(self, k: int) -> None:
        """Hash the seeded rows' uniforms of the next ``k`` steps in one call (``seeded_uniforms``
        reads them): a step's counter is ``n_gen_B`` plus the steps since, so the values are those
        each step would hash, while the hash's ~50 element-wise ops run once per round trip instead
        of once per step (eager CPU decode steps are bound by their op count)."""
        t = self.tensors
        B = t.seed_B.shape[0]
        counters_KB = t.n_gen_B[None, :] + torch.arange(k, device=t.n_gen_B.device)[:, None]
        self._uniforms_KB = hash_uniform(t.seed_B.expand(k, B).reshape(-1), counters_KB.reshape(-1)).view(k, B)
        self._uniforms_from = self.steps_done

    def seeded_uniforms(self) -> torch.Tensor:
        """float32 [B]: ``hash_uniform(seed_B, n_gen_B)`` of this step (``prefetch_uniforms``' row when
        it covers this step)."""
        u_KB, j = self._uniforms_KB, self.steps_done - self._uniforms_from
        if u_KB is not None and 0 <= j < u_KB.shape[0]:
            return u_KB[j]
        return hash_uniform(self.seed_B, self.n_gen_B)

    def advance(self, tokens_B: torch.Tensor) -> torch.Tensor:
        """Count the sampled tokens; returns bool [B]: the row just finished (a stop/EOS id once
        ``min_new_tokens`` are reached, ``max_new_tokens``, or the context limit)."""
        t = self.tensors
        t.n_gen_B += 1
        self.steps_done += 1
        done_B = self.room_B <= self.steps_done
        if self.any_stop_ids:
            hit_B = ((tokens_B[:, None] == self.stop_ids_BS) & self.stop_valid_BS).any(dim=1)
            if self.any_min_new:
                hit_B &= self.n_gen_B >= self.min_new_B
            done_B |= hit_B
        return done_B


class RowTable:
    """The static sampling row (``RowParams.row_of``) of the request in each engine slot
    (``Sequence.row``), kept in one host tensor in ``RowParams.table_FB``'s layout with
    ``max_stops`` stop-id columns (the counts of tokens generated and known left 0). A slot's column
    is written when a request takes it (``sync``), so a step gathers its rows' columns
    (``RowParams.gather``) instead of re-encoding every request's parameters."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.max_stops = 1
        self.table_FR = torch.zeros(_FIXED + 2, num_slots, dtype=torch.float64)
        self.num_stops = [0] * num_slots
        """Stop/EOS ids of each slot's row."""
        self._rows: list[tuple | None] = [None] * num_slots
        """The ``row_of`` tuple each column was written from (identity: one per request)."""
        self._columns: dict[int, torch.Tensor] = {}

    def sync(self, slots: list[int], rows: list[tuple]) -> None:
        """Write the columns of the slots whose request changed since they were written (one
        indexed write)."""
        held = self._rows
        changed = [(slot, row) for slot, row in zip(slots, rows) if held[slot] is not row]
        if changed:
            self._write(changed)

    def _write(self, changed: list[tuple[int, tuple]]) -> None:
        widest = max(len(row[9]) for _, row in changed)
        if widest > self.max_stops:
            self._grow(widest)
        S = self.max_stops
        cols = []
        for slot, row in changed:
            stops = row[9]
            k = len(stops)
            pad = stops[0] if k else 0
            cols.append(
                row[:9] + (0.0, 0.0, row[10], row[11], slot) + stops + (pad,) * (S - k) + (1.0,) * k + (0.0,) * (S - k)
            )
            self.num_stops[slot] = k
            self._rows[slot] = row
        self.table_FR[:, [slot for slot, _ in changed]] = torch.tensor(cols, dtype=torch.float64).T

    def _grow(self, max_stops: int) -> None:
        held = [(slot, row) for slot, row in enumerate(self._rows) if row is not None]
        self.max_stops = max_stops
        self.table_FR = torch.zeros(_FIXED + 2 * max_stops, self.num_slots, dtype=torch.float64)
        self._rows = [None] * self.num_slots
        self._columns.clear()
        if held:
            self._write(held)

    def columns(self, S: int) -> torch.Tensor:
        """Indices of the table's rows (features) that form a table with S stop-id columns."""
        cols = self._columns.get(S)
        if cols is None:
            M = self.max_stops
            cols = self._columns[S] = torch.tensor(
                [*range(_FIXED + S), *range(_FIXED + M, _FIXED + M + S)], dtype=torch.long
            )
        return cols


class Sampler:
    """Samples one token per row of ``logits_BV`` under each row's own parameters."""

    def __init__(self, *, device: torch.device, seed: int, presence: PresenceTable | None = None) -> None:
        """``presence``: the engine's seen tokens per slot, read by decode-loop graphs that penalise
        (``sample_static``); ``sample_rows`` reads the one its ``RowParams`` carries."""
        self.device = device
        self.generator = make_generator(seed, device)
        self.presence = presence

    def _uniform(self, n: int) -> torch.Tensor:
        """float32 [n] uniform in (0, 1) from the engine's generator (unseeded rows). ``rand`` can
        return exactly 0: moved to the smallest positive float (0 would pick the first token of
        non-zero probability, a draw of probability ~2**-24 anyway)."""
        return torch.rand(n, generator=self.generator, device=self.device).clamp_min_(torch.finfo(torch.float32).tiny)

    @torch.no_grad()
    def sample_rows(self, logits_BV: torch.Tensor, rp: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids long [B], log-probs float32 [B]) as device tensors; no host synchronisation.
        Rows with a repetition penalty draw from the penalised logits, report the log-prob under the
        unpenalised ones (the module docstring's convention) and mark their token in ``rp.presence``."""
        if not rp.any_penalty:
            return self._draw_rows(logits_BV, rp)
        assert rp.presence is not None, "a repetition penalty reads the rows' presence table"
        penalized_BV = apply_repetition_penalty(logits_BV, rp.presence.rows(rp.slot_B), rp.penalty_B)
        tokens_B, logprobs_B = self._draw_rows(penalized_BV, rp)
        model_lp_B = _model_logprobs(logits_BV, rp.scale_B if rp.any_scaled else None, tokens_B)
        rp.presence.note(rp.slot_B, tokens_B)
        return tokens_B, torch.where(rp.penalty_B != 1, model_lp_B, logprobs_B)

    def _draw_rows(self, logits_BV: torch.Tensor, rp: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample_rows`` of logits already penalised (the log-probs are of ``logits_BV``)."""
        B, V = logits_BV.shape
        suppress_BS = None
        if rp.any_min_new and rp.any_stop_ids:  # without stop ids there is nothing to suppress
            # Rows below min_new_tokens get their stop/EOS ids set to -inf (padding ids repeat a
            # real id of the row, or are invalid and keep the original value).
            # A row's entries are all suppressed or all kept, so duplicate padding ids agree.
            suppress_BS = (rp.stop_valid_BS[:, :1] & (rp.n_gen_B < rp.min_new_B)[:, None]).expand_as(rp.stop_ids_BS)
        u_B = None
        if not rp.all_greedy:
            # One uniform per row: seeded rows from the (seed, counter) hash, the others from the generator.
            if rp.all_unseeded:
                u_B = self._uniform(B)
            else:
                u_B = rp.seeded_uniforms()
                if rp.unseeded_idx is not None:
                    u_B[rp.unseeded_idx] = self._uniform(rp.unseeded_idx.numel())
        fused = None
        if fused_sampler.serves(logits_BV):
            fused = fused_sampler.draw(
                logits_BV,
                rp.scale_B,
                u_B,
                rp.greedy_B if rp.any_greedy else None,
                rp.stop_ids_BS if suppress_BS is not None else None,
                suppress_BS,
            )
            if not rp.any_truncate:
                return fused
        if not rp.any_scaled:  # greedy rows have scale 1 too
            scaled_BV = logits_BV.float()  # T = 1 leaves the logits unchanged (x / 1 is x exactly)
        else:  # as sample_static: the division computes in fp32
            scaled_BV = logits_BV / rp.scale_B[:, None]
        # the log-probs' normaliser from the unsuppressed weights, before any id is zeroed
        weights_BV, max_B1, log_sum_B1 = _weights_and_norm(scaled_BV)
        masked_BV = scaled_BV
        if suppress_BS is not None:
            kept_BS = scaled_BV.gather(1, rp.stop_ids_BS)
            masked_BV = scaled_BV.scatter(1, rp.stop_ids_BS, kept_BS.masked_fill(suppress_BS, float("-inf")))
        if rp.all_greedy:
            tokens_B = argmax_rows(masked_BV)
        else:
            race_BV = masked_BV
            if rp.any_sort:
                race_BV, weights_BV = _truncate_rows(masked_BV, rp.top_k_B, rp.top_p_B, rp.min_p_B), None
            elif rp.any_truncate:  # min-p alone: the same kept set without the sort (a CPU step's costliest op)
                race_BV, weights_BV = _min_p_rows(masked_BV, rp.min_p_B), None
            elif suppress_BS is not None:
                weights_BV = _zero_suppressed(weights_BV, rp.stop_ids_BS, suppress_BS)
            sampled_B = inverse_cdf_draw(race_BV, u_B, weights_BV)
            tokens_B = torch.where(rp.greedy_B, argmax_rows(masked_BV), sampled_B) if rp.any_greedy else sampled_B
        chosen_lp_B = _chosen_logprobs(scaled_BV, tokens_B, max_B1, log_sum_B1)
        return (tokens_B, chosen_lp_B) if fused is None else _per_row(fused, rp.truncate_B, tokens_B, chosen_lp_B)

    def sample_static(
        self, logits_BV: torch.Tensor, rows: RowTensors, n_gen_B: torch.Tensor, mode: SampleMode
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample_rows`` in capture-safe form: no host read, no data-dependent shape, every step
        of a CUDA graph the same kernels. ``n_gen_B``: tokens generated before this one (the
        table's count plus the loop step); ``mode``: the batch-level choices (``RowParams.mode``).
        Gives the tokens and log-probs of ``sample_rows`` for greedy and seeded rows (unseeded rows
        draw the generator's noise for the whole batch). Float32 ``logits_BV`` of an all-greedy
        batch are overwritten (suppressed ids set to -inf in place, saving a [B, V] copy). A
        penalising ``mode`` reads and marks the sampler's ``presence`` by ``rows.slot_B``."""
        if not mode.penalize:
            return self._draw_static(logits_BV, rows, n_gen_B, mode)
        presence = self.presence
        assert presence is not None and presence.seen_RV is not None, "a penalising graph needs the presence table"
        penalized_BV = apply_repetition_penalty(logits_BV, presence.rows(rows.slot_B), rows.penalty_B)
        tokens_B, logprobs_B = self._draw_static(penalized_BV, rows, n_gen_B, mode)
        model_lp_B = _model_logprobs(logits_BV, rows.scale_B if mode.sample else None, tokens_B)
        presence.note(rows.slot_B, tokens_B)
        return tokens_B, torch.where(rows.penalty_B != 1, model_lp_B, logprobs_B)

    def _draw_static(
        self, logits_BV: torch.Tensor, rows: RowTensors, n_gen_B: torch.Tensor, mode: SampleMode
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample_static`` of logits already penalised (the log-probs are of ``logits_BV``)."""
        pending_BS = (rows.stop_valid_BS[:, :1] & (n_gen_B < rows.min_new_B)[:, None]).expand_as(rows.stop_ids_BS)
        u_B = None
        if mode.sample:
            if mode.rng_noise:
                u_B = self._uniform(logits_BV.shape[0])
                if mode.hash_noise:
                    u_B = torch.where(rows.seeded_B, hash_uniform(rows.seed_B, n_gen_B), u_B)
            else:
                u_B = hash_uniform(rows.seed_B, n_gen_B)
        fused = None
        if fused_sampler.serves(logits_BV):
            fused = fused_sampler.draw(logits_BV, rows.scale_B, u_B, rows.greedy_B, rows.stop_ids_BS, pending_BS)
            if not mode.truncate:
                return fused
        # a bf16 / fp32 division computes in fp32: the cast's values, one pass over [B, V] fewer
        scaled_BV = logits_BV / rows.scale_B[:, None] if mode.sample else logits_BV.float()
        # The log-probs are of the distribution before suppression; taken first, the stop ids can
        # then be suppressed in place (below min_new_tokens: set to -inf, as in sample_rows).
        weights_BV, max_B1, log_sum_B1 = _weights_and_norm(scaled_BV)
        kept_BS = scaled_BV.gather(1, rows.stop_ids_BS)
        masked_BV = scaled_BV.scatter_(1, rows.stop_ids_BS, kept_BS.masked_fill(pending_BS, float("-inf")))
        if not mode.sample:
            tokens_B = masked_BV.argmax(dim=-1)
        else:
            race_BV = masked_BV
            if mode.min_p_only:  # the same kept set without the sort, as in sample_rows
                race_BV, weights_BV = _min_p_rows(masked_BV, rows.min_p_B), None
            elif mode.truncate:
                race_BV, weights_BV = _truncate_rows(masked_BV, rows.top_k_B, rows.top_p_B, rows.min_p_B), None
            else:  # as sample_rows
                weights_BV = _zero_suppressed(weights_BV, rows.stop_ids_BS, pending_BS)
            sampled_B = inverse_cdf_draw(race_BV, u_B, weights_BV)
            # the argmax runs whether or not a row is greedy: a flag for it in the mode would key graphs
            # that the warm-up does not capture (greedy evaluation beside sampled training rows)
            tokens_B = torch.where(rows.greedy_B, masked_BV.argmax(dim=-1), sampled_B)
        # a chosen id is never a suppressed one: its masked value is its scaled value
        chosen_lp_B = _chosen_logprobs(masked_BV, tokens_B, max_B1, log_sum_B1)
        return (tokens_B, chosen_lp_B) if fused is None else _per_row(fused, rows.truncate_B, tokens_B, chosen_lp_B)

    @torch.no_grad()
    def sample(
        self, logits_BV: torch.Tensor, requests: list[SampleRequest], eos_token_ids: tuple[int, ...] = ()
    ) -> tuple[list[int], list[float]]:
        """List form of ``sample_rows``: (token ids, log-probs), one per request. A request's
        ``suppress_ids`` are forbidden for its row."""
        B, V = logits_BV.shape
        params = []
        for r in requests:
            p = r.params
            if r.suppress_ids:  # express the suppression as min_new_tokens over these ids
                p = dataclasses.replace(
                    p,
                    min_new_tokens=max(p.min_new_tokens, r.num_generated + 1),
                    max_new_tokens=max(p.max_new_tokens, r.num_generated + 1),
                    stop_token_ids=tuple(t for t in r.suppress_ids if 0 <= t < V),
                    stop=(),
                    ignore_eos=True,
                )
            params.append(p)
        presence = None
        if any(p.repetition_penalty != 1.0 for p in params):  # row i's seen tokens in row i of a table of its own
            presence = PresenceTable(B, V, logits_BV.device)
            presence.sync(list(range(B)), [_Seen(p, list(r.seen_ids)) for p, r in zip(params, requests)])
        rp = RowParams.build(
            params,
            [r.num_generated for r in requests],
            [0] * B,
            eos_token_ids,
            V,
            1 << 62,
            logits_BV.device,
            presence=presence,
        )
        return _to_lists(*self.sample_rows(logits_BV, rp))


@dataclass(eq=False)
class _Seen:
    """What ``PresenceTable.sync`` reads of a sequence, for ``Sampler.sample``'s requests."""

    params: SamplingParams
    token_ids: list[int]


def _per_row(
    fused: tuple[torch.Tensor, torch.Tensor],
    truncate_B: torch.Tensor,
    tokens_B: torch.Tensor,
    logprobs_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager draw's tokens and log-probs for the rows that truncate (top-k / top-p), the fused
    draw's for the others: a row samples the same way whatever else is in its batch."""
    return torch.where(truncate_B, tokens_B, fused[0]), torch.where(truncate_B, logprobs_B, fused[1])


def _to_lists(tokens_B: torch.Tensor, logprobs_B: torch.Tensor) -> tuple[list[int], list[float]]:
    """Token ids and log-probs as Python lists with one device-to-host copy (float64 holds both
    the ids, < 2**53, and the float32 log-probs exactly)."""
    both_2B = torch.stack((tokens_B.double(), logprobs_B.double())).tolist()
    return [int(t) for t in both_2B[0]], both_2B[1]


def _weights_and_norm(scaled_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``exp(scaled - row max)`` [B, V], the row max [B, 1], the log of the weights' sum [B, 1]): the
    draw's weights and the log-probs' normaliser (``_chosen_logprobs``) in one ``exp`` pass;
    ``log_softmax`` then ``exp`` took two, the costliest ops of a CPU step's sampling."""
    max_B1 = scaled_BV.amax(dim=-1, keepdim=True)
    weights_BV = (scaled_BV - max_B1).exp_()
    return weights_BV, max_B1, weights_BV.sum(dim=-1, keepdim=True).log_()


def _chosen_logprobs(
    scaled_BV: torch.Tensor, tokens_B: torch.Tensor, max_B1: torch.Tensor, log_sum_B1: torch.Tensor
) -> torch.Tensor:
    """float32 [B]: ``log_softmax(scaled_BV)`` at ``tokens_B``, in its order (x - max - log sum): a
    log-prob near 0 keeps its precision, which adding the max to the log-sum first would round away."""
    return (scaled_BV.gather(1, tokens_B[:, None]) - max_B1 - log_sum_B1).squeeze(1)


def _model_logprobs(logits_BV: torch.Tensor, scale_B: torch.Tensor | None, tokens_B: torch.Tensor) -> torch.Tensor:
    """float32 [B]: ``log_softmax(logits_BV / scale_B)`` at ``tokens_B`` (None: unscaled), the
    log-probs the trainer recomputes, for rows that drew from other (penalised) logits."""
    scaled_BV = logits_BV.float() if scale_B is None else logits_BV / scale_B[:, None]
    max_B1 = scaled_BV.amax(dim=-1, keepdim=True)
    log_sum_B1 = (scaled_BV - max_B1).exp_().sum(dim=-1, keepdim=True).log_()
    return _chosen_logprobs(scaled_BV, tokens_B, max_B1, log_sum_B1)


def _zero_suppressed(weights_BV: torch.Tensor, stop_ids_BS: torch.Tensor, suppress_BS: torch.Tensor) -> torch.Tensor:
    """``weights_BV`` with the ids ``suppress_BS`` marks (stop ids below ``min_new_tokens``) set to 0,
    in place: weights proportional to ``softmax`` of the masked logits, for ``inverse_cdf_draw``."""
    return weights_BV.scatter_(1, stop_ids_BS, weights_BV.gather(1, stop_ids_BS).masked_fill(suppress_BS, 0.0))


def _truncate_rows(
    scaled_RV: torch.Tensor, k_R: torch.Tensor, p_R: torch.Tensor, min_p_R: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply min-p (``min_p_R``, 0 = off) and top-k (``k_R``, V = off), then top-p (``p_R``, 1 = off)
    to temperature-scaled logits. Min-p drops a token whose probability is below ``min_p`` times the
    top token's: ``x - x_max < log(min_p)`` (log 0 = -inf drops nothing); the top token always stays."""
    R, V = scaled_RV.shape
    sorted_RV, order_RV = scaled_RV.sort(dim=-1, descending=True)
    rank_V = torch.arange(V, device=scaled_RV.device)
    drop_RV = rank_V[None, :] >= k_R[:, None]
    if min_p_R is not None:
        drop_RV = drop_RV | (sorted_RV - sorted_RV[:, :1] < min_p_R[:, None].to(sorted_RV.dtype).log())
    sorted_RV = sorted_RV.masked_fill(drop_RV, float("-inf"))
    probs_RV = torch.softmax(sorted_RV, dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (the top token survives);
    # top_p = 1 drops none (a rounded mass before the tail can reach 1: ``_min_p_rows`` keeps the tail too)
    mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
    drop_RV = drop_RV | ((mass_before_RV >= p_R[:, None]) & (p_R[:, None] < 1))
    sorted_RV = sorted_RV.masked_fill(drop_RV, float("-inf"))
    return torch.full_like(scaled_RV, float("-inf")).scatter(1, order_RV, sorted_RV)


def _min_p_rows(scaled_RV: torch.Tensor, min_p_R: torch.Tensor) -> torch.Tensor:
    """``_truncate_rows`` of rows without top-k and top-p, without its sort: the same comparison with
    the row's maximum (the sorted row's first value), so the same kept set and values."""
    max_R1 = scaled_RV.amax(dim=-1, keepdim=True)
    return scaled_RV.masked_fill(scaled_RV - max_R1 < min_p_R[:, None].to(scaled_RV.dtype).log(), float("-inf"))


def _truncate(scaled_RV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``_truncate_rows`` with the rows' parameters given as ``SamplingParams``."""
    R, V = scaled_RV.shape
    k_R = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=scaled_RV.device)
    p_R = torch.tensor([p.top_p for p in params], device=scaled_RV.device, dtype=scaled_RV.dtype)
    min_p_R = torch.tensor([p.min_p for p in params], device=scaled_RV.device, dtype=scaled_RV.dtype)
    return _truncate_rows(scaled_RV, k_R, p_R, min_p_R)


def suppressed_ids(params: SamplingParams, num_generated: int, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Ids forbidden for the next token: EOS and stop ids until ``min_new_tokens`` are generated."""
    if num_generated >= params.min_new_tokens:
        return ()
    eos = () if params.ignore_eos else eos_token_ids
    return tuple(eos) + tuple(params.stop_token_ids)


def check_stop(
    params: SamplingParams,
    output_ids: list[int],
    eos_token_ids: tuple[int, ...],
    text: str | None,
    stop_from: int = 0,
) -> tuple[str | None, str | None]:
    """Decide whether a request ends after its newest token.

    Returns ``(finish_reason, text)``: reason ``stop``/``length``/None, and the output text cut
    before the first stop string when one matched (the token ids are kept whole, so the trainer
    sees exactly what was sampled). Only a stop string that ends past character ``stop_from`` of
    ``text`` counts: the text of the tokens before ``min_new_tokens`` was allowed to hold one.
    """
    reason, cut = stop_decision(params, len(output_ids), output_ids[-1], eos_token_ids, text, stop_from)
    return reason, text if cut is None or text is None else text[:cut]


def stop_decision(
    params: SamplingParams,
    num_generated: int,
    token: int,
    eos_token_ids: tuple[int, ...],
    text: str | None,
    stop_from: int = 0,
    searched: int = 0,
    offset: int = 0,
) -> tuple[str | None, int | None]:
    """``check_stop``'s rule for the output's ``num_generated``-th token ``token``, given the output's
    text from character ``offset`` on (``text``): ``(finish_reason, cut)``, where ``cut`` is the
    character of the whole text at which a matched stop string starts (None: no match).

    ``searched``: characters at the start of the text that a search after an earlier token already
    looked through, unchanged since; a string ending within them would have matched then, so only
    one ending past them is looked for (``text`` must begin at least ``len(s) - 1`` characters
    before it). With ``searched = offset = 0`` this is the whole-text search."""
    if num_generated >= params.min_new_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return "stop", None
        if params.stop and text is not None:
            found = [
                text.find(s, max(stop_from - len(s) + 1, searched - len(s) + 1, offset) - offset) for s in params.stop
            ]
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                return "stop", cut + offset
    if num_generated >= params.max_new_tokens:
        return "length", None
    return None, None
