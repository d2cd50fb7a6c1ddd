"""Token-level results as base64 arrays on the HTTP wire (``POST /generate`` and ``/generate_many``
with ``token_encoding="base64"``, which areno's own HTTP client asks for).

JSON lists cost about a microsecond per value to write and to read (a float's 17-digit text): a
partitioned run's every rollout crosses this wire, ~25 ms a group of 8 x 4,096 tokens on the server's
event loop, beside the engine's driver thread. Arrays of little-endian int64 / float64 are exact for
any value the lists held and take well under a millisecond."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

TOKEN_ENCODINGS = ("list", "base64")
"""``list``: plain JSON lists (the default, for any HTTP client); ``base64``: ``ARRAY_FIELDS`` as arrays."""
ARRAY_FIELDS = {"prompt_ids": "<i8", "output_ids": "<i8", "output_versions": "<i8", "output_logprobs": "<f8"}
"""The ``GenerationOutput`` fields sent as arrays, with their dtypes."""


def encode_arrays(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with each of ``ARRAY_FIELDS`` as ``{"dtype": ..., "b64": ...}``."""
    out = dict(fields)
    for name, dtype in ARRAY_FIELDS.items():
        raw = np.asarray(fields[name], dtype=dtype).tobytes()
        out[name] = {"dtype": dtype, "b64": base64.b64encode(raw).decode("ascii")}
    return out


def decode_arrays(fields: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``encode_arrays`` (Python lists of ints and floats); fields sent as lists pass as they are."""
    out = dict(fields)
    for name in ARRAY_FIELDS:
        value = fields.get(name)
        if isinstance(value, dict):
            out[name] = np.frombuffer(base64.b64decode(value["b64"]), dtype=value["dtype"]).tolist()
    return out
