"""Errors the rollout engine raises (re-exported by ``engine.py``, where callers import them)."""

from __future__ import annotations


class UnknownRequestError(KeyError):
    """``abort`` got a request id the engine does not hold (never added, or already finished)."""

    def __str__(self) -> str:
        return str(self.args[0])


class TornWeightsError(RuntimeError):
    """An in-place policy sync failed midway: the live weights are half-written (``mark_torn``)."""


class WeightUpdateError(ValueError):
    """A weight update was rejected as a whole; the engine still serves the previous version."""


class RequestRejected(ValueError):
    """A generation request the engine cannot take (an empty prompt, one longer than the context or the
    KV pool, a token outside the vocabulary): the request's own problem, raised when it is added."""
