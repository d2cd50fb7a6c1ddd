"""The reward worker's replies: JSON data of a few fixed shapes, never pickles (see
:mod:`areno.rewards._worker` for the protocol). Standard library only."""

from __future__ import annotations

import json
import math

MAX_REPLY_BYTES = 64 << 10
"""A longer reply is malformed (the parent stops reading it and replaces the worker)."""
MAX_MESSAGE_CHARS = 2000
"""Error messages are cut to this length so a reply always fits."""
REPLY_KINDS = ("memory", "error")


class MalformedReply(ValueError):
    """What came back on the reply pipe is not one of the protocol's JSON shapes."""


def encode_reply(reply: list) -> bytes:
    return json.dumps(reply, allow_nan=True).encode()


def _figures(value: object) -> bool:
    """Whether ``value`` is the named figures a reward returned beside its score, as the worker sends them
    (``reward_parts``): a few identifier names, each to a finite number."""
    return (
        isinstance(value, dict)
        and 0 < len(value) <= 32
        and all(
            isinstance(k, str) and k.isidentifier() and k != "score" and type(v) is float and math.isfinite(v)
            for k, v in value.items()
        )
    )


def decode_reply(data: bytes) -> list:
    """The reply as a list of plain values; MalformedReply unless it is exactly one of the shapes
    in the module docstring. JSON cannot build objects, so nothing the worker writes runs here."""
    try:
        # every number as a float: an int past float's range is inf (non-finite), never an OverflowError
        reply = json.loads(data.decode("utf-8"), parse_int=float)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedReply(f"not JSON ({exc})") from None
    if not isinstance(reply, list) or not reply or not isinstance(reply[0], str):
        raise MalformedReply(f"not a [status, ...] list: {data[:80]!r}")
    status, rest = reply[0], reply[1:]
    if status == "ok" and len(rest) == 1 and type(rest[0]) is float:
        return ["ok", rest[0]]
    if status == "ok" and len(rest) == 2 and type(rest[0]) is float and _figures(rest[1]):
        return ["ok", {"score": rest[0], **rest[1]}]
    if status == "error" and len(rest) == 2 and rest[0] in REPLY_KINDS and isinstance(rest[1], str):
        return reply
    if status == "fatal" and len(rest) == 1 and isinstance(rest[0], str):
        return reply
    if status == "ready" and len(rest) == 1 and isinstance(rest[0], dict):
        if all(isinstance(k, str) and isinstance(v, str) for k, v in rest[0].items()):
            return reply
    raise MalformedReply(f"unexpected reply shape: {data[:80]!r}")
