"""What a compiled decoder layer runs eagerly, behind a graph break: the reads a graph would specialise on, once per
layer (a sparse block's ``layer_idx`` and routing record, the CPU experts' host-read counts). ``call`` is
``torch.compiler.disable`` of a trampoline, made on first use: by then dynamo is tracing, so loaded, while at
import it would load dynamo before a start-up's first rollout token, which does without it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name != "call":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    call = globals()["call"] = torch.compiler.disable(_call)
    return call
