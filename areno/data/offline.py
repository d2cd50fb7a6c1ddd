"""An offline recipe's rows as token ids, each row rendered once per run.

An offline (SFT, preference) run draws the same rows every epoch, and rendering one (the prompt, the chat
template over prompt and answer, ``render_completion``'s checks) costs milliseconds with a real
tokenizer: seconds for every 1024-row step, before training starts. :class:`RenderedRows` keeps each row's
ids from its first draw on, by the row's place in its split, so later epochs (and held-out evaluations)
read them back.

Memory: a split's ids are at most one copy of the rows the split already holds as text. They are kept as
int32 arrays, 4 bytes a token: about the size of the row's text for a BPE tokenizer (about 4 characters a
token), 4 times it for a character tokenizer. As lists of Python ints they would take 36 bytes a token (an
int above 256 is its own 28-byte object). Ids an int32 cannot hold (a tokenizer's None EOS) are kept as
given.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

Rendered = tuple[list[int], list[list[int]]]
"""A row's prompt ids and its completions' ids (one for SFT, chosen and rejected for a preference row)."""


class RenderedRows:
    """One split's rows (``rows``, which it indexes) and the ids of those rendered so far. One cache per split
    and rendering (tokenizer, keys, template settings): the ids are whatever ``render`` gave first."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        self._ids: dict[int, tuple[Sequence[int], tuple[Sequence[int], ...]]] = {}

    def __len__(self) -> int:
        """How many rows have been rendered."""
        return len(self._ids)

    def ids(self, index: int, render: Callable[[dict], Rendered]) -> Rendered:
        """Row ``index``'s ids: ``render(rows[index])`` on its first call, kept; fresh lists on every call (a
        trajectory owns its lists). A render that raises keeps nothing, so it raises again on the next draw."""
        packed = self._ids.get(index)
        if packed is None:
            prompt_ids, completions = render(self.rows[index])
            packed = self._ids[index] = (_pack(prompt_ids), tuple(_pack(c) for c in completions))
        return _unpack(packed[0]), [_unpack(c) for c in packed[1]]


def _pack(ids: list[int]) -> Sequence[int]:
    try:
        return array("i", ids)
    except (TypeError, OverflowError):  # a None EOS, an id past int32: kept exactly as rendered
        return tuple(ids)


def _unpack(ids: Sequence[int]) -> list[int]:
    return ids.tolist() if isinstance(ids, array) else list(ids)
