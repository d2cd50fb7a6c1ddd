"""Resolving user code named by a dotted path (`pkg.module:attr` or `pkg.module.attr`)."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str, *, what: str) -> Any:
    """Import ``path``; a bad path is a one-line ValueError naming ``what`` (the config key)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what}: {path!r} is not a dotted path like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what}: cannot import module {module_name!r} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what}: module {module_name!r} has no attribute {attr!r}") from None
