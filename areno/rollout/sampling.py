"""Batched token sampling with per-row parameters, on-device stop checks, and the stop rules.

Legend: B = sequences sampled this step, V = vocabulary, S = stop ids per row (padded).

Log-prob convention (what the trainer recomputes): the log-prob reported for a sampled token is
``log_softmax(logits / T)[token]`` over the *full* vocabulary, i.e. under the temperature-scaled
distribution *before* top-p / top-k truncation and before ``min_new_tokens`` suppresses EOS. The
trainer recomputes exactly ``log_softmax(logits / T)`` on the packed batch, so behaviour and proximal
log-probs are comparable; truncation is treated as part of the sampler, not of the policy (as in
AReaL/verl). Greedy requests (``temperature == 0``) report ``log_softmax(logits)`` (T = 1).

Everything is vectorised over rows and stays on the device: ``RowParams`` holds each row's
temperature, top-k, top-p, seed, stop ids and token limits as tensors (built with one host-to-device
copy per engine step), ``Sampler.sample_rows`` returns token ids and log-probs as device tensors,
and ``RowParams.advance`` marks the rows that just finished (stop id or length), so the engine can
run several decode steps and copy one small tensor to the host at the end.

Randomness: sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws
from ``p`` exactly like ``multinomial``. A request with ``seed`` draws its noise from a counter-based
hash of (seed, number of tokens generated so far, vocabulary index), so the same seed and prompt
give the same tokens whatever else is in the batch and however the engine groups its decode steps;
rows without a seed share the engine's ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areno.api.types import SamplingParams


@dataclass
class SampleRequest:
    """What the sampler needs about one row of the logits (the list form of ``RowParams``)."""

    params: SamplingParams
    num_generated: int
    generator: object = None
    """Unused (kept for call compatibility): seeded rows draw hash noise from ``params.seed``."""
    suppress_ids: tuple[int, ...] = ()
    """Token ids to forbid for this row (EOS/stop ids while ``num_generated < min_new_tokens``)."""


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


def hash_exponential(seed_R: torch.Tensor, counter_R: torch.Tensor, V: int) -> torch.Tensor:
    """float32 [R, V] Exp(1) noise, a pure function of (seed, counter, vocabulary index)."""
    key_R = _mix32((seed_R & _MASK32) ^ _mix32(((seed_R >> 32) & _MASK32) ^ _mix32(counter_R & _MASK32)))
    idx_V = torch.arange(V, device=seed_R.device, dtype=torch.long)
    h_RV = _mix32((key_R[:, None] + idx_V[None, :] * 0x9E3779B1) & _MASK32)
    # 23 random bits, centred: u in (0, 1) exactly representable in float32, so E = -log(u) > 0.
    u_RV = ((h_RV >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)
    return -torch.log(u_RV)


@dataclass
class RowParams:
    """Per-row sampling parameters and counters of one engine step, as device tensors.

    ``n_gen_B`` (tokens generated before the one being sampled) and ``len_B`` (tokens known,
    prompt included) advance with every sampled token (``advance``)."""

    scale_B: torch.Tensor
    """float32 temperature (1 for greedy rows)."""
    greedy_B: torch.Tensor
    top_k_B: torch.Tensor
    """long; V where disabled."""
    top_p_B: torch.Tensor
    seed_B: torch.Tensor
    """long; meaningful where ``seeded_idx`` points."""
    stop_ids_BS: torch.Tensor
    """long stop/EOS ids per row, padded by repeating the row's first id (0 in rows without any)."""
    stop_valid_BS: torch.Tensor
    min_new_B: torch.Tensor
    max_new_B: torch.Tensor
    n_gen_B: torch.Tensor
    len_B: torch.Tensor
    max_len: int
    all_greedy: bool
    any_greedy: bool
    any_truncate: bool
    any_min_new: bool
    seeded_idx: torch.Tensor | None
    """Rows with their own seed (None: none)."""
    unseeded_idx: torch.Tensor | None
    """Random rows without a seed, when only some rows are (None otherwise)."""
    all_unseeded: bool
    """Every row is random without a seed (noise for the whole batch in one draw)."""

    @classmethod
    def build(
        cls, params: list[SamplingParams], n_gen: list[int], lengths: list[int], eos_token_ids: tuple[int, ...],
        vocab_size: int, max_len: int, device: torch.device,
    ) -> "RowParams":
        B = len(params)
        stops = [((() if p.ignore_eos else eos_token_ids) + p.stop_token_ids) for p in params]
        S = max(1, max(map(len, stops), default=1))
        # One float64 [9 + 2S, B] host tensor -> one copy (float64 holds every id and seed below 2**53).
        rows = [
            [p.temperature if p.temperature > 0 else 1.0 for p in params],
            [float(p.temperature == 0) for p in params],
            [float(p.top_k if p.top_k > 0 else vocab_size) for p in params],
            [p.top_p for p in params],
            [float(p.seed if p.seed is not None else 0) for p in params],
            [float(p.min_new_tokens) for p in params],
            [float(p.max_new_tokens) for p in params],
            [float(n) for n in n_gen],
            [float(n) for n in lengths],
        ]
        for s in range(S):
            rows.append([float(st[s] if s < len(st) else (st[0] if st else 0)) for st in stops])
        for s in range(S):
            rows.append([float(s < len(st)) for st in stops])
        host = torch.tensor(rows, dtype=torch.float64)
        dev = host.to(device, non_blocking=True) if device.type != "cpu" else host
        long_ = dev[[2, 4, 5, 6, 7, 8]].long()
        ids = dev[9:].long()
        greedy = [p.temperature == 0 for p in params]
        seeded = [i for i, p in enumerate(params) if p.seed is not None and p.temperature > 0]
        unseeded = [i for i, p in enumerate(params) if p.seed is None and p.temperature > 0]
        to_idx = lambda ix: torch.tensor(ix, dtype=torch.long).to(device) if ix else None  # noqa: E731
        return cls(
            scale_B=dev[0].float(), greedy_B=dev[1] > 0, top_k_B=long_[0], top_p_B=dev[3].float(), seed_B=long_[1],
            stop_ids_BS=ids[:S].T.contiguous(), stop_valid_BS=(ids[S:] > 0).T.contiguous(),
            min_new_B=long_[2], max_new_B=long_[3], n_gen_B=long_[4].clone(), len_B=long_[5].clone(),
            max_len=max_len, all_greedy=all(greedy), any_greedy=any(greedy),
            any_truncate=any((p.top_k > 0 or p.top_p < 1.0) and p.temperature > 0 for p in params),
            any_min_new=any(p.min_new_tokens > n for p, n in zip(params, n_gen)) and B > 0,
            seeded_idx=to_idx(seeded), unseeded_idx=to_idx(unseeded) if len(unseeded) < B else None,
            all_unseeded=len(unseeded) == B,
        )

    def advance(self, tokens_B: torch.Tensor) -> torch.Tensor:
        """Count the sampled tokens; returns bool [B]: the row just finished (a stop/EOS id once
        ``min_new_tokens`` are reached, ``max_new_tokens``, or the context limit)."""
        self.n_gen_B += 1
        self.len_B += 1
        hit_BS = (tokens_B[:, None] == self.stop_ids_BS) & self.stop_valid_BS
        stop_B = hit_BS.any(dim=1) & (self.n_gen_B >= self.min_new_B)
        return stop_B | (self.n_gen_B >= self.max_new_B) | (self.len_B >= self.max_len)


class Sampler:
    """Samples one token per row of ``logits_BV`` under each row's own parameters."""

    def __init__(self, *, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = make_generator(seed, device)

    @torch.no_grad()
    def sample_rows(self, logits_BV: torch.Tensor, rp: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids long [B], log-probs float32 [B]) as device tensors; no host synchronisation."""
        logits_BV = logits_BV.float()
        B, V = logits_BV.shape
        if rp.all_greedy:
            scaled_BV = logits_BV  # T = 1 leaves the logits unchanged: no copy
        else:
            scaled_BV = logits_BV / rp.scale_B[:, None]
        masked_BV = scaled_BV
        if rp.any_min_new:
            # Rows below min_new_tokens get their stop/EOS ids set to -inf (padding ids repeat a
            # real id of the row, or are invalid and keep the original value).
            # A row's entries are all suppressed or all kept, so duplicate padding ids agree.
            suppress_BS = (rp.stop_valid_BS[:, :1] & (rp.n_gen_B < rp.min_new_B)[:, None]).expand_as(rp.stop_ids_BS)
            kept_BS = scaled_BV.gather(1, rp.stop_ids_BS)
            masked_BV = scaled_BV.scatter(1, rp.stop_ids_BS, kept_BS.masked_fill(suppress_BS, float("-inf")))
        if rp.all_greedy:
            tokens_B = masked_BV.argmax(dim=-1)
        else:
            race_BV = _truncate_rows(masked_BV, rp.top_k_B, rp.top_p_B) if rp.any_truncate else masked_BV
            # Exponential race in log space: argmax(log p - log E) = argmax(p / E).
            if rp.all_unseeded:
                noise_BV = torch.empty_like(race_BV).exponential_(generator=self.generator)
            else:
                noise_BV = torch.ones_like(race_BV)
            if rp.unseeded_idx is not None:
                noise_BV[rp.unseeded_idx] = torch.empty(
                    rp.unseeded_idx.numel(), V, device=race_BV.device).exponential_(generator=self.generator)
            if rp.seeded_idx is not None:
                noise_BV[rp.seeded_idx] = hash_exponential(rp.seed_B[rp.seeded_idx], rp.n_gen_B[rp.seeded_idx], V)
            # exponential_ can return exactly 0 in float32; keep the log finite.
            sampled_B = (race_BV - noise_BV.clamp_min_(torch.finfo(torch.float32).tiny).log_()).argmax(dim=-1)
            tokens_B = torch.where(rp.greedy_B, masked_BV.argmax(dim=-1), sampled_B) if rp.any_greedy else sampled_B
        # log_softmax rather than gather - logsumexp: the same rounding as the trainer's recompute.
        chosen_lp_B = torch.log_softmax(scaled_BV, dim=-1).gather(1, tokens_B[:, None]).squeeze(1)
        return tokens_B, chosen_lp_B

    @torch.no_grad()
    def sample(self, logits_BV: torch.Tensor, requests: list[SampleRequest],
               eos_token_ids: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
        """List form of ``sample_rows``: (token ids, log-probs), one per request. A request's
        ``suppress_ids`` are forbidden for its row."""
        B, V = logits_BV.shape
        params = []
        for r in requests:
            p = r.params
            if r.suppress_ids:  # express the suppression as min_new_tokens over these ids
                p = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                   min_new_tokens=max(p.min_new_tokens, r.num_generated + 1),
                                   max_new_tokens=max(p.max_new_tokens, r.num_generated + 1),
                                   stop_token_ids=tuple(t for t in r.suppress_ids if 0 <= t < V), ignore_eos=True,
                                   seed=p.seed)
            params.append(p)
        rp = RowParams.build(params, [r.num_generated for r in requests], [0] * B, eos_token_ids, V,
                             1 << 62, logits_BV.device)
        return _to_lists(*self.sample_rows(logits_BV, rp))


def _to_lists(tokens_B: torch.Tensor, logprobs_B: torch.Tensor) -> tuple[list[int], list[float]]:
    """Token ids and log-probs as Python lists with one device-to-host copy (float64 holds both
    the ids, < 2**53, and the float32 log-probs exactly)."""
    both_2B = torch.stack((tokens_B.double(), logprobs_B.double())).tolist()
    return [int(t) for t in both_2B[0]], both_2B[1]


def _truncate_rows(scaled_RV: torch.Tensor, k_R: torch.Tensor, p_R: torch.Tensor) -> torch.Tensor:
    """Apply top-k (``k_R``, V = off) then top-p (``p_R``, 1 = off) to temperature-scaled logits."""
    R, V = scaled_RV.shape
    sorted_RV, order_RV = scaled_RV.sort(dim=-1, descending=True)
    rank_V = torch.arange(V, device=scaled_RV.device)
    drop_RV = rank_V[None, :] >= k_R[:, None]
    sorted_RV = sorted_RV.masked_fill(drop_RV, float("-inf"))
    probs_RV = torch.softmax(sorted_RV, dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (the top token survives).
    mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
    drop_RV = drop_RV | (mass_before_RV >= p_R[:, None])
    sorted_RV = sorted_RV.masked_fill(drop_RV, float("-inf"))
    return torch.full_like(scaled_RV, float("-inf")).scatter(1, order_RV, sorted_RV)


def _truncate(scaled_RV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``_truncate_rows`` with the rows' parameters given as ``SamplingParams``."""
    R, V = scaled_RV.shape
    k_R = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=scaled_RV.device)
    p_R = torch.tensor([p.top_p for p in params], device=scaled_RV.device, dtype=scaled_RV.dtype)
    return _truncate_rows(scaled_RV, k_R, p_R)


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
) -> tuple[str | None, str | None]:
    """Decide whether a request ends after its newest token.

    Returns ``(finish_reason, text)``: reason ``stop``/``length``/None, and the output text cut
    before the first stop string when one matched (the token ids are kept whole, so the trainer
    sees exactly what was sampled).
    """
    n = len(output_ids)
    token = output_ids[-1]
    if n >= params.min_new_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return "stop", text
        if params.stop and text is not None:
            cut = min((text.find(s) for s in params.stop if s in text), default=-1)
            if cut >= 0:
                return "stop", text[:cut]
    if n >= params.max_new_tokens:
        return "length", text
    return None, text
