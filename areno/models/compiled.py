"""What keeps compiled decoder code compiled. Dynamo specialises a graph on every Python value it reads and keeps at
most ``recompile_limit`` graphs per code object (8 by default), past which a call runs eagerly (flex attention then
materialises every score). So a compiled layer runs behind a graph break (``call``) what differs per layer or batch
(a sparse block's ``layer_idx`` and routing record, the CPU experts' host-read counts), and ``allow_kinds`` raises
the limit to the kinds a step does multiply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

RECOMPILE_LIMIT = 64
"""Graphs per code object ``allow_kinds`` allows: the layers share graphs by kind, and the kinds multiply: sliding or
not, sparse or dense, grad or no-grad (the proximal and reference forwards), trainable or frozen (the reference
model's layers run the same code), a routing record or none, static then dynamic token counts."""


def allow_kinds() -> None:
    """Raise dynamo's recompile limit (process-wide) to ``RECOMPILE_LIMIT``, where a smaller one is set."""
    import torch._dynamo.config as dynamo_config  # loads dynamo: called where something compiles

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)


def _call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def __getattr__(name: str) -> Any:
    # ``call``: ``fn(*args, **kwargs)`` run eagerly inside a compiled graph; made on first use (while dynamo traces,
    # so loaded), since ``torch.compiler.disable`` at import would load dynamo before a start-up's first token
    if name != "call":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    call = globals()["call"] = torch.compiler.disable(_call)
    return call
