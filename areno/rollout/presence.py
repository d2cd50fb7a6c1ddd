"""Which token ids each running sequence has seen, for the repetition penalty.

Legend: R = engine slots (``Sequence.row``, plus the scratch slot of padding rows), V = vocabulary,
B = rows sampled this step.

``PresenceTable.seen_RV`` is one bool [R, V] tensor on the engine's device (allocated at the first
request with a ``repetition_penalty``: R x V bytes, e.g. 257 x 151,936 = 39 MB). A slot's row holds
the ids of its sequence's prompt and every token it sampled since (a set: a repeated id counts once).
It stays correct under continuous batching without a host read per step:

- a sequence that takes a slot (admitted, re-admitted after a preemption or ``sleep()``, a sample of
  a GRPO group sharing its prompt's K/V with its siblings: each has its own slot) has the row rebuilt
  from its ``token_ids`` (prompt and output so far) in one host-to-device copy, the next time it samples
  in a batch with a penalty (``sync``: a slot remembers the sequence that last claimed it);
- each sampled token is marked on the device right after the draw (``note``: an ``index_put_``, inside
  the decode-loop CUDA graph too), so the k steps of a round trip see each other's tokens. Tokens a
  row samples past its end (a multi-step loop runs finished rows on) land only in rows of sequences
  that finished, rebuilt before their slot's next owner samples.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class PresenceTable:
    """The seen-token rows of an engine's slots (see the module docstring)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, device
        self.seen_RV: torch.Tensor | None = None
        """bool [R, V]; None until ``allocate`` (no request has asked for a penalty yet)."""
        self._owners: list[weakref.ref | None] = [None] * num_slots
        """The sequence whose tokens each row holds (or that claimed it without a penalty: its row is
        never read, and is rebuilt before a penalised sequence reads it)."""
        self._true: torch.Tensor | None = None
        self.rebuilt_rows = 0
        """Rows rebuilt from a sequence's tokens so far (tests and stats)."""

    def allocate(self) -> torch.Tensor:
        """``seen_RV``, allocated once (a decode-loop graph captures its address)."""
        if self.seen_RV is None:
            self.seen_RV = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.bool, device=self.device)
            self._true = torch.ones((), dtype=torch.bool, device=self.device)
        return self.seen_RV

    def sync(self, slots: list[int], seqs: list[Any]) -> None:
        """Before a step that penalises some row: claim each slot for its sequence (``token_ids``,
        ``params.repetition_penalty``) and rebuild the rows of penalised sequences new to their slot."""
        seen_RV = self.allocate()
        owners = self._owners
        rows: list[int] = []
        ids: list[int] = []
        fresh: list[int] = []
        for slot, seq in zip(slots, seqs):
            ref = owners[slot]
            if ref is not None and ref() is seq:
                continue
            owners[slot] = weakref.ref(seq)
            if seq.params.repetition_penalty != 1.0:
                fresh.append(slot)
                rows += [slot] * len(seq.token_ids)
                ids += seq.token_ids
        if not fresh:
            return
        self.rebuilt_rows += len(fresh)
        n = len(fresh)
        packed = torch.tensor(fresh + rows + ids, dtype=torch.long).to(self.device, non_blocking=True)
        seen_RV[packed[:n]] = False
        seen_RV[packed[n : n + len(rows)], packed[n + len(rows) :]] = True

    def note(self, slot_B: torch.Tensor, tokens_B: torch.Tensor) -> None:
        """Mark each row's sampled token as seen (on the device; capture-safe)."""
        assert self.seen_RV is not None and self._true is not None
        self.seen_RV.index_put_((slot_B, tokens_B), self._true.expand(tokens_B.shape[0]))

    def rows(self, slot_B: torch.Tensor) -> torch.Tensor:
        """bool [B, V]: the seen rows of these slots."""
        assert self.seen_RV is not None
        return self.seen_RV.index_select(0, slot_B)


def apply_repetition_penalty(logits_BV: torch.Tensor, seen_BV: torch.Tensor, penalty_B: torch.Tensor) -> torch.Tensor:
    """float32 [B, V]: the logits of seen tokens divided by the row's penalty where positive,
    multiplied by it otherwise (Hugging Face's ``RepetitionPenaltyLogitsProcessor``, vLLM's
    ``apply_penalties``); a row of penalty 1 keeps its values exactly (x / 1 and x * 1 are x). On CPU
    only the seen entries are touched (``_penalize_seen``; the same values)."""
    if logits_BV.device.type == "cpu":
        return _penalize_seen(logits_BV.float(), seen_BV, penalty_B)
    return _penalize_dense(logits_BV.float(), seen_BV, penalty_B)


def _penalize_dense(x_BV: torch.Tensor, seen_BV: torch.Tensor, penalty_B: torch.Tensor) -> torch.Tensor:
    """Capture-safe: element-wise over [B, V], no data-dependent shape."""
    p_B1 = penalty_B[:, None].to(x_BV.dtype)
    return torch.where(seen_BV, torch.where(x_BV > 0, x_BV / p_B1, x_BV * p_B1), x_BV)


def _penalize_seen(x_BV: torch.Tensor, seen_BV: torch.Tensor, penalty_B: torch.Tensor) -> torch.Tensor:
    """The seen entries only (a few hundred of a row's V; ``nonzero`` is no device sync on the host):
    the dense form's five [B, V] passes were ~40% of a greedy CPU decode step of a 20M model."""
    b_N, v_N = seen_BV.nonzero(as_tuple=True)
    x_N, p_N = x_BV[b_N, v_N], penalty_B[b_N].to(x_BV.dtype)
    return x_BV.clone().index_put_((b_N, v_N), torch.where(x_N > 0, x_N / p_N, x_N * p_N))
