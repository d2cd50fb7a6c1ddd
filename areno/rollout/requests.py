"""``RequestTable``: the rollout engine's requests by id, from arrival to their output.

``add`` validates a request and puts it in the inbox under a lock of its own (a request arriving from a
server's event loop never waits for a running step); ``admit``, called under the step lock, moves the
inbox into the scheduler in arrival order. ``outputs`` builds finished (or aborted) requests'
``GenerationOutput``s.
"""

from __future__ import annotations

import base64
import numbers
import threading
import uuid
from collections.abc import Iterable
from typing import Any

import torch

from areno.data.detokenize import decode_texts
from areno.rollout.errors import RequestRejected
from areno.rollout.sampling import RowParams
from areno.rollout.scheduler import Scheduler, Sequence
from areno.types import GenerationOutput, SamplingParams


class CheckedPrompt(list):
    """Prompt token ids converted to ints and checked against a vocabulary (``of``). ``RequestTable.add``
    takes one as it is: the samples of a group share their prompt, which is then converted and
    scanned once (per sample it cost 29 ms a group of 8 at 32k tokens, on the caller's event loop).
    The sequences made from it share the list; nothing writes to a sequence's ``prompt_ids``."""

    __slots__ = ("vocab_size",)

    def __init__(self, ids: Iterable[int], vocab_size: int) -> None:
        super().__init__(ids)
        self.vocab_size = vocab_size

    @classmethod
    def of(cls, prompt_ids: Any, vocab_size: int) -> CheckedPrompt:
        """``prompt_ids`` as ints, or the error ``RequestTable.add`` raises for them."""
        try:
            ids = cls(map(int, prompt_ids), vocab_size)
        except (TypeError, ValueError):  # an element that is not a token id: named, not int()'s message
            bad = next((t for t in prompt_ids if not isinstance(t, numbers.Integral)), None)
            raise TypeError(
                f"prompt_ids must be a list of token ids (ints), but holds {bad!r}: pass tokenizer.encode(text)"
            ) from None
        if not ids:
            raise RequestRejected("prompt_ids is empty: a request needs at least one prompt token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            raise RequestRejected(f"prompt_ids holds token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        return ids


class RequestTable:
    def __init__(
        self,
        scheduler: Scheduler,
        *,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        tokenizer: Any = None,
    ) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.live: dict[str, Sequence] = {}
        """Unfinished requests the scheduler holds (running or waiting)."""
        self.inbox: dict[str, Sequence] = {}
        """Requests added since the last step (``add`` takes only ``_inbox_lock``)."""
        self._inbox_lock = threading.Lock()
        self._arrivals = 0

    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        multimodal: dict[str, Any] | None = None,
    ) -> str:
        """Validate a request and queue it for the next ``admit``. Returns its id. ``multimodal``:
        the ``Sequence`` fields of a request with images (``RolloutEngine.add_request`` makes them)."""
        if not (type(prompt_ids) is CheckedPrompt and prompt_ids.vocab_size == self.vocab_size):
            prompt_ids = CheckedPrompt.of(prompt_ids, self.vocab_size)
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:  # the sampler indexes the logits by them: one would fail every request in the step
            raise RequestRejected(
                f"stop_token_ids holds token id {bad_stop[0]} outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_ids) >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {len(prompt_ids)} tokens but the context is max_model_len="
                f"{self.max_model_len}: shorten the prompt"
            )
        longest = min(len(prompt_ids) + params.max_new_tokens, self.max_model_len)
        allocator = self.scheduler.allocator
        if -(-longest // allocator.block_size) > allocator.num_blocks:
            raise RequestRejected(
                f"prompt + max_new_tokens = {longest} tokens exceeds the KV pool of "
                f"{allocator.num_blocks * allocator.block_size} tokens: lower max_new_tokens "
                "or give the engine more KV memory"
            )
        sample_row = RowParams.row_of(params, self.eos_token_ids, self.vocab_size)
        # Only the inbox lock: a request arriving from a server's event loop must not wait for a
        # running step (the step lock is held through a whole decode round trip).
        with self._inbox_lock:
            request_id = request_id or uuid.uuid4().hex
            if request_id in self.live or request_id in self.inbox:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.inbox[request_id] = Sequence(
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                arrival=0,
                sample_row=sample_row,
                limit=longest,
                **(multimodal or {}),
            )
        return request_id

    def admit(self) -> None:
        """Move the inbox's requests, in arrival order, into the scheduler. Call holding the step lock."""
        if not self.inbox:
            return
        with self._inbox_lock:
            arrived, self.inbox = self.inbox, {}
        for request_id, seq in arrived.items():
            seq.arrival = self._arrivals
            self._arrivals += 1
            self.live[request_id] = seq
            self.scheduler.add(seq)

    def decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def output(self, seq: Sequence, reason: str) -> GenerationOutput:
        return self.outputs([(seq, reason)])[0]

    def outputs(self, finished: list[tuple[Sequence, str]]) -> list[GenerationOutput]:
        """The ``GenerationOutput`` of each (sequence, finish reason), in order. Their texts are
        decoded in one call (``decode_texts``): a fixed-length batch ends all its requests in the
        same step, and one by one their texts kept the step (and the rollout) waiting. Requests
        with ``detokenize=False`` get none (their callers decode the tokens themselves)."""
        # a request a stop string ended has its text already, cut before the string
        cut = [reason == "stop" and seq.text is not None for seq, reason in finished]
        to_decode = [not has_text and seq.params.detokenize for (seq, _), has_text in zip(finished, cut)]
        uncut = [seq.output_ids for (seq, _), d in zip(finished, to_decode) if d]
        decoded = iter(decode_texts(self.tokenizer, uncut) if self.tokenizer is not None else [""] * len(uncut))
        return [
            GenerationOutput(
                request_id=seq.request_id,
                prompt_ids=list(seq.prompt_ids),
                output_ids=seq.output_ids,  # a new list (a slice of token_ids)
                output_logprobs=list(seq.output_logprobs),
                output_versions=list(seq.output_versions),
                finish_reason=reason,
                text=seq.text if has_text else next(decoded) if d else "",
                routes_TLK=None if seq.routes is None else assemble_routes(seq.routes, len(seq.token_ids)),
            )
            for (seq, reason), has_text, d in zip(finished, cut, to_decode)
        ]


def assemble_routes(chunks: list[tuple[int, torch.Tensor]], num_tokens: int) -> torch.Tensor:
    """int16 [num_tokens, L, K] on the host from a sequence's recorded chunks (``Sequence.routes``):
    a later forward over a position (a recompute) overrides an earlier one; rows past the end (a
    decode loop's discarded tokens) are dropped, and positions no forward ran for stay -1. So does
    the last token's: its forward, when a decode loop ran one, sampled nothing that was kept. A
    normal tensor although the engine's steps run in inference mode: the caller may write to it or
    train with it."""
    _, L, K = chunks[0][1].shape
    with torch.inference_mode(False):
        routes_TLK = torch.full((num_tokens, L, K), -1, dtype=torch.int16, device=chunks[0][1].device)
        for start, part_nLK in chunks:
            n = min(part_nLK.shape[0], num_tokens - start)
            if n > 0:
                routes_TLK[start : start + n] = part_nLK[:n]
        routes_TLK[-1] = -1
        return routes_TLK.cpu()


def routes_to_json(routes_TLK: torch.Tensor | None) -> dict | None:
    """``GenerationOutput.routes_TLK`` as JSON: its shape and its int16 bytes in base64 (a list of
    lists would cost one Python object per id)."""
    if routes_TLK is None:
        return None
    return {"shape": list(routes_TLK.shape), "int16": base64.b64encode(routes_TLK.numpy().tobytes()).decode()}


def routes_from_json(data: dict | None) -> torch.Tensor | None:
    """The inverse of ``routes_to_json``."""
    if data is None:
        return None
    raw = bytearray(base64.b64decode(data["int16"]))
    return torch.frombuffer(raw, dtype=torch.int16).reshape(data["shape"])
