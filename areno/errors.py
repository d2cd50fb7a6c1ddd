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


class UserError(ValueError):
    """A mistake the user fixes; the message names the thing and the fix (exit 2, one line)."""


class ConfigError(UserError):
    """A bad configuration key, type, value or combination."""


def check_config(cond: bool, key: str, message: str) -> None:
    """Raise ``ConfigError("<key>: <message>")`` unless ``cond``: the validation of config dataclasses."""
    if not cond:
        raise ConfigError(f"{key}: {message}")


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
