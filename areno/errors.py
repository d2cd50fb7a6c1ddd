"""The error policy of areno, in one place (the ground layer: imports nothing of areno).

- :class:`UserError` and its kinds are mistakes a user fixes (a config key, a data row, a model
  directory, a reward's import path): the CLI prints the message as one line and exits with 2.
  Every message names the thing and the fix. They are raised before expensive work where possible.
- :class:`RunFailure` is a run that failed while running (a worker died, a policy sync broke):
  the CLI prints one line naming the failing worker and its log, and exits with 1.
- :class:`RunStopped` is a run stopped by a signal after saving its step's checkpoint: the CLI says
  where and exits with 128 + the signal's number, as a shell reports a process the signal ended.
- Anything else is a bug in areno: the CLI lets its traceback through.

``UserError`` subclasses ``ValueError`` so that callers that catch the built-in kind keep working.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
import os
import types
import typing
from typing import Any


class UserError(ValueError):
    """A mistake the user fixes; the message names the thing and the fix (exit 2, one line)."""


class ConfigError(UserError):
    """A bad configuration key, type, value or combination."""


def check_config(cond: bool, key: str, message: str) -> None:
    """Raise ``ConfigError("<key>: <message>")`` unless ``cond``: the validation of config dataclasses."""
    if not cond:
        raise ConfigError(f"{key}: {message}")


class UnknownSettingError(ConfigError, AttributeError):
    """An attribute set on a config section that is not one of its settings (``cfg.train.stpes = 1``):
    a ConfigError for the CLI's one line, an AttributeError for Python's idiom."""


def unknown_setting(prefix: str, name: str, settings: list[str]) -> UnknownSettingError:
    """``UnknownSettingError("<prefix>.<name>: not a setting; did you mean <prefix>.<closest>?")`` (the
    settings listed when none is close)."""
    key, dot = (f"{prefix}.{name}", f"{prefix}.") if prefix else (name, "")
    close = difflib.get_close_matches(name, settings, n=1)
    if close:
        return UnknownSettingError(f"{key}: not a setting; did you mean {dot}{close[0]}?")
    return UnknownSettingError(f"{key}: not a setting; they are {', '.join(dot + s for s in settings)}")


def check_types(section: object, prefix: str, schema: type) -> None:
    """Raise ``wrong_type`` for the first field of dataclass ``schema`` (``section``'s class or one of
    its bases) whose value in ``section`` is not of the field's annotated type, its key
    ``<prefix>.<field>``: a section built in Python is checked as a YAML file's is. Run first in
    ``__post_init__``, before value checks that would compare a string with a number. An int passes
    for a float (as in Python), a tuple for a list and a list for a tuple; a path (``os.PathLike``)
    where a string goes becomes that string (``model.path=Path(...)``); nothing else is converted."""
    for name, hint in _field_types(schema).items():
        value = getattr(section, name)
        if isinstance(value, os.PathLike) and is_of_type(os.fspath(value), hint):
            setattr(section, name, os.fspath(value))
        elif not is_of_type(value, hint):
            raise wrong_type(f"{prefix}.{name}" if prefix else name, hint, value)


def wrong_type(key: str, hint: Any, value: Any) -> ConfigError:
    """``ConfigError("<key>: must be <hint, in words>, got <value>")``: the message of a config value
    of the wrong type, from Python (``check_types``) or from a YAML file or override."""
    return ConfigError(f"{key}: must be {describe_type(hint)}, got {'null' if value is None else repr(value)}")


@functools.cache
def _field_types(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def is_of_type(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type ``hint`` (of those config fields use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if _is_union(hint):
        return any(is_of_type(value, a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin in (list, tuple):
        item = args[0] if args else Any  # list[X] and tuple[X, ...]
        return isinstance(value, (list, tuple)) and all(is_of_type(v, item) for v in value)
    if origin is dict:
        key, item = args or (Any, Any)
        return isinstance(value, dict) and all(is_of_type(k, key) and is_of_type(v, item) for k, v in value.items())
    return isinstance(value, origin or hint)


_WORDS = {
    bool: ("true or false", "true or false values"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def describe_type(hint: Any, plural: bool = False) -> str:
    """``hint`` in a config's words: ``an integer or null``, ``a list of numbers``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _WORDS:
        return _WORDS[hint][plural]
    if hint is Any:
        return "values" if plural else "any value"
    if _is_union(hint):
        words: list[str] = []
        for a in args:
            if a is bool:
                words += ["true", "false"]
            elif a is not type(None):
                words.append(describe_type(a, plural))
        words += ["null"] if type(None) in args else []
        return ", ".join(words[:-1]) + f" or {words[-1]}"
    if origin in (list, tuple):
        of = describe_type(args[0] if args else Any, plural=True)
        return f"lists of {of}" if plural else f"a list of {of}"
    if origin is dict:
        key, item = args or (Any, Any)
        of = f"{describe_type(key, plural=True)} to {describe_type(item, plural=True)}"
        return f"mappings of {of}" if plural else f"a mapping of {of}"
    name = getattr(hint, "__name__", str(hint))
    return f"{name} objects" if plural else f"a {name}"


class DataError(UserError):
    """A dataset file or row that cannot be used (missing field, bad format, empty split)."""


class ModelDirError(UserError):
    """A model directory that is missing, incomplete or unreadable."""


class RewardImportError(UserError):
    """A reward, workflow or other dotted path that cannot be imported or called."""


class RunFailure(RuntimeError):
    """A run that failed while running: the message names the failing worker and its log (exit 1)."""


class RunStopped(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM at a step's end, its checkpoint saved (exit 128 + signum)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
