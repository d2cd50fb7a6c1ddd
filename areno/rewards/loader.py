"""Resolving user code named by a dotted path (`pkg.module:attr` or `pkg.module.attr`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from areno.errors import RewardImportError
from areno.rewards.sandbox import shared_sandbox


def import_object(path: str, *, what: str) -> Any:
    """Import ``path``; a bad path is a one-line :class:`RewardImportError` naming ``what`` (the config key)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardImportError(f"{what}: {path!r} is not a dotted path like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardImportError(
            f"{what}: cannot import module {module_name!r} ({exc}): check the spelling and that it is on PYTHONPATH"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RewardImportError(f"{what}: module {module_name!r} has no attribute {attr!r}") from None


def wants_sandbox(fn: Any, sandbox: bool | None) -> bool:
    """``reward.sandbox`` resolved: an explicit bool wins; auto (None) sandboxes everything except a
    function marked ``fn.areno_sandbox = False`` (shipped rewards that are cheap, bounded string ops)."""
    if sandbox is not None:
        return sandbox
    return bool(getattr(fn, "areno_sandbox", True))


def reward_function(path: str) -> Callable[..., Any]:
    """The function ``reward.fn`` names, imported here; a :class:`RewardImportError` when the path
    does not import or names something that cannot be called."""
    fn = import_object(path, what="reward.fn")
    if not callable(fn):
        raise RewardImportError(f"reward.fn: {path!r} is a {type(fn).__name__}, not a function")
    return fn


def load_reward(section: Any) -> Any:
    """The reward function of a ``RewardSection``: the imported function itself when it runs
    in-process, else the shared :class:`~areno.rewards.sandbox.RewardSandbox` for it (an async
    callable with the same signature). Either way the workflows call it through ``acall_reward``;
    sandbox failures raise ``RewardFailure`` there and score 0."""
    fn = reward_function(section.fn)
    if not wants_sandbox(fn, section.sandbox):
        return fn
    return shared_sandbox(
        section.fn,
        workers=section.workers,
        timeout_s=section.timeout_s,
        memory_mb=section.memory_mb,
        cpu_s=section.cpu_s,
        allow_network=section.allow_network,
    )
