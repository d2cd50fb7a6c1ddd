"""Batched token sampling with per-request parameters, and the stop rules.

Legend: B = sequences sampled this step, V = vocabulary.

Log-prob convention (what the trainer recomputes): the log-prob reported for a sampled token is
``log_softmax(logits / T)[token]`` over the *full* vocabulary, i.e. under the temperature-scaled
distribution *before* top-p / top-k truncation and before ``min_new_tokens`` suppresses EOS. The
trainer recomputes exactly ``log_softmax(logits / T)`` on the packed batch, so behaviour and proximal
log-probs are comparable; truncation is treated as part of the sampler, not of the policy (as in
AReaL/verl). Greedy requests (``temperature == 0``) report ``log_softmax(logits)`` (T = 1).

Randomness: a request with ``seed`` owns a ``torch.Generator``; its noise for every token is drawn
from that generator only, so the same seed and prompt give the same tokens whatever else is in the
batch. Requests without a seed share the engine's generator. Sampling uses the exponential race
(``argmax(p / E)`` with ``E ~ Exp(1)``), which draws from ``p`` exactly like ``multinomial``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areno.api.types import SamplingParams


@dataclass
class SampleRequest:
    """What the sampler needs about one row of the logits."""

    params: SamplingParams
    num_generated: int
    generator: torch.Generator | None
    suppress_ids: tuple[int, ...]
    """Token ids to forbid for this row (EOS/stop ids while ``num_generated < min_new_tokens``)."""


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Sampler:
    """Samples one token per row of ``logits_BV`` under each row's own ``SamplingParams``."""

    def __init__(self, *, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = make_generator(seed, device)

    @torch.no_grad()
    def sample(self, logits_BV: torch.Tensor, requests: list[SampleRequest]) -> tuple[list[int], list[float]]:
        """Returns (token ids, log-probs), one per row."""
        logits_BV = logits_BV.float()
        B, V = logits_BV.shape
        assert len(requests) == B
        temps = [r.params.temperature for r in requests]
        if not any(temps) and not any(r.suppress_ids for r in requests):
            # All greedy, nothing suppressed (the common evaluation / benchmark batch): no scaling
            # (T = 1 leaves the logits unchanged), no copies, one host sync.
            tokens_B = logits_BV.argmax(dim=-1)
            chosen_lp_B = torch.log_softmax(logits_BV, dim=-1).gather(1, tokens_B[:, None]).squeeze(1)
            return _to_lists(tokens_B, chosen_lp_B)
        scale_B = torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits_BV.device)
        scaled_BV = logits_BV / scale_B[:, None]
        logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)

        masked_BV = scaled_BV
        suppress_rows = [i for i, r in enumerate(requests) if r.suppress_ids]
        if suppress_rows:
            masked_BV = masked_BV.clone()
            for i in suppress_rows:
                ids = [t for t in requests[i].suppress_ids if 0 <= t < V]
                masked_BV[i, ids] = float("-inf")

        greedy_rows = [i for i, t in enumerate(temps) if t == 0]
        random_rows = [i for i, t in enumerate(temps) if t > 0]
        tokens_B = torch.empty(B, dtype=torch.long, device=logits_BV.device)
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits_BV.device)
            tokens_B[idx] = masked_BV[idx].argmax(dim=-1)
        if random_rows:
            idx = torch.tensor(random_rows, device=logits_BV.device)
            sub = [requests[i].params for i in random_rows]
            probs_RV = torch.softmax(_truncate(masked_BV[idx], sub), dim=-1)
            noise_RV = self._noise(len(random_rows), V, [requests[i].generator for i in random_rows])
            tokens_B[idx] = (probs_RV / noise_RV).argmax(dim=-1)
        chosen_lp_B = logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
        return _to_lists(tokens_B, chosen_lp_B)

    def _noise(self, R: int, V: int, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise_RV = torch.empty(R, V, device=self.device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            noise_RV[torch.tensor(shared, device=self.device)] = torch.empty(
                len(shared), V, device=self.device
            ).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise_RV[i].exponential_(generator=g)
        # exponential_ can return exactly 0 in float32; keep the division finite.
        return noise_RV.clamp_min_(torch.finfo(noise_RV.dtype).tiny)


def _to_lists(tokens_B: torch.Tensor, logprobs_B: torch.Tensor) -> tuple[list[int], list[float]]:
    """Token ids and log-probs as Python lists with one device-to-host copy (float64 holds both
    the ids, < 2**53, and the float32 log-probs exactly)."""
    both_2B = torch.stack((tokens_B.double(), logprobs_B.double())).tolist()
    return [int(t) for t in both_2B[0]], both_2B[1]


def _truncate(scaled_RV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply top-k then top-p to temperature-scaled logits (rows that disable both are untouched)."""
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return scaled_RV
    R, V = scaled_RV.shape
    sorted_RV, order_RV = scaled_RV.sort(dim=-1, descending=True)
    rank_V = torch.arange(V, device=scaled_RV.device)
    k_R = torch.tensor([k if k > 0 else V for k in top_k], device=scaled_RV.device)
    drop_RV = rank_V[None, :] >= k_R[:, None]
    sorted_RV = sorted_RV.masked_fill(drop_RV, float("-inf"))
    p_R = torch.tensor(top_p, device=scaled_RV.device)
    probs_RV = torch.softmax(sorted_RV, dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (the top token survives).
    mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
    drop_RV = drop_RV | (mass_before_RV >= p_R[:, None])
    sorted_RV = sorted_RV.masked_fill(drop_RV, float("-inf"))
    return torch.full_like(scaled_RV, float("-inf")).scatter(1, order_RV, sorted_RV)


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
