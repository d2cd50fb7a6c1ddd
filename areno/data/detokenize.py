"""Token ids back to text, many sequences at a time: the rollout engine's finished requests, a GRPO
group's completions.

``decode_texts(tokenizer, ids_B)`` equals ``[tokenizer.decode(ids, skip_special_tokens=True) for ids
in ids_B]``. For a Hugging Face fast tokenizer whose ``decode`` is the ``tokenizers`` library's
own (no clean-up of tokenization spaces, no subclass override) and whose decoder concatenates
per-token pieces (``Fuse``, or ``ByteLevel`` as in Qwen's and Llama 3's tokenizers), each text is a
join over a table of the tokens' pieces built once (``_PieceTable``), 2-3x faster than the
``tokenizers`` batch call; with another decoder it is that one ``decode_batch`` call, in Rust over
threads, without the GIL. A 0.5B rollout's 64 completions of 512 random tokens took ~0.5 ms each one
by one, on the path from the engine's last step to the trainer. Any other tokenizer decodes one
sequence at a time, exactly as before.

``adecode_texts`` is the same for a workflow's coroutine: where the ``tokenizers`` batch call runs,
it runs in a worker thread, so the groups of a rollout that finish in the same engine step decode side
by side instead of one after another on the event loop.

``TextTail`` follows that decoded text as a request's tokens arrive one at a time (the rollout
engine's stop strings), keeping only its end: the same table, one token's piece per call.
"""

from __future__ import annotations

import asyncio
import codecs
import operator
import weakref
from typing import Any

from transformers import PreTrainedTokenizerFast


def decode_texts(tokenizer: Any, ids_B: list[list[int]]) -> list[str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` of each sequence of ``ids_B``, in order."""
    backend = _batch_decoder(tokenizer)
    if backend is None:
        return _decode_each(tokenizer, ids_B)
    table = _piece_table(tokenizer, backend)
    if table is not None:
        return [table.decode(ids) for ids in ids_B]
    return backend.decode_batch(ids_B, skip_special_tokens=True)


async def adecode_texts(tokenizer: Any, ids_B: list[list[int]]) -> list[str]:
    """``decode_texts`` from a coroutine: in a worker thread where the decode releases the GIL (the
    ``tokenizers`` batch path), inline otherwise (Python decoding would only contend for the GIL,
    and a ``_PieceTable`` join is faster than a thread's hand-over)."""
    backend = _batch_decoder(tokenizer)
    if backend is None or _piece_table(tokenizer, backend) is not None:
        return decode_texts(tokenizer, ids_B)
    return await asyncio.to_thread(backend.decode_batch, ids_B, skip_special_tokens=True)


# GPT-2's byte-level alphabet: the character each byte is written as inside a ByteLevel token
_PRINTED = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
_CHAR_BYTE = {chr(b): b for b in _PRINTED} | {
    chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _PRINTED)
}


class _PieceTable:
    """Each token id's share of a decoded text, for the decoders whose output is the concatenation
    of per-token pieces: ``Fuse`` (the token strings joined) and ``ByteLevel`` (each token's bytes
    joined, then one lossy UTF-8 decode, as ``tokenizers`` does). A special token's piece is empty
    (``skip_special_tokens``), and so is an id the tokenizer does not know (``tokenizers`` drops
    it). One list lookup per token, where ``tokenizers`` took ~0.4 us a token."""

    def __init__(self, backend: Any, size: int, byte_level: bool) -> None:
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        empty: str | bytes = b"" if byte_level else ""
        pieces: list[str | bytes] = []
        for i in range(size):
            token = backend.id_to_token(i)
            if token is None or token in special:
                pieces.append(empty)
            elif byte_level:
                try:  # a token of byte characters; any other one (an added token's text) is its UTF-8
                    pieces.append(bytes([_CHAR_BYTE[c] for c in token]))
                except KeyError:
                    pieces.append(token.encode())
            else:
                pieces.append(token)
        self.backend, self.size, self.byte_level, self.pieces, self.empty = backend, size, byte_level, pieces, empty

    def decode(self, ids: list[int]) -> str:
        if min(ids, default=0) < 0:  # a negative index would read from the table's end
            return self.backend.decode(ids, skip_special_tokens=True)  # which refuses it
        pieces = self.pieces
        try:  # one C-level gather (a tuple) where there are two ids or more
            parts = operator.itemgetter(*ids)(pieces) if len(ids) > 1 else [pieces[i] for i in ids]
        except IndexError:  # ids past the vocabulary (a model's padded rows): dropped, as tokenizers does
            parts = [pieces[i] if i < self.size else self.empty for i in ids]
        if self.byte_level:
            return b"".join(parts).decode("utf-8", errors="replace")  # type: ignore[arg-type]
        return "".join(parts)  # type: ignore[arg-type]


class TextTail:
    """The end of ``tokenizer.decode(ids, skip_special_tokens=True)`` of a list of ids that grows one
    token at a time, through a ``_PieceTable``: each token adds its piece (a ByteLevel one's bytes go
    through an incremental UTF-8 decoder, which gives what one lossy decode of all the bytes gives),
    so a token costs the same at any length. ``text_tail(tokenizer, keep)`` makes one.

    A search of the text for strings of at most ``keep + 1`` characters after every token looks at
    ``tail()``: the text since the last ``mark()``, with the ``keep`` characters settled before it.
    Settled characters never change; only the decode of a character's incomplete bytes at the end
    (U+FFFD until its last byte arrives, as in the whole decode) can."""

    def __init__(self, table: _PieceTable, keep: int) -> None:
        self.table, self.keep = table, keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if table.byte_level else None
        self.settled = 0
        """Characters of the text that later tokens cannot change."""
        self.searched = 0
        """``settled`` at the last ``mark()``."""
        self._before = ""  # up to ``keep`` settled characters before ``searched``
        self._since: list[str] = []  # settled text after ``searched``
        self._pending = ""  # the decode of the incomplete character's bytes at the end

    def add(self, token_id: int) -> None:
        table = self.table
        if 0 <= token_id < table.size:
            piece = table.pieces[token_id]
        elif token_id >= table.size:  # past the vocabulary: dropped, as tokenizers does
            piece = table.empty
        else:  # a negative id: the backend's own error
            table.backend.decode([token_id], skip_special_tokens=True)
            piece = table.empty
        if self._utf8 is not None:
            new = self._utf8.decode(piece)  # type: ignore[arg-type]
            buffered = self._utf8.getstate()[0]
            self._pending = buffered.decode("utf-8", errors="replace") if buffered else ""
        else:
            new = piece  # type: ignore[assignment]
        if new:
            self._since.append(new)
            self.settled += len(new)

    def tail(self) -> tuple[str, int]:
        """(the text from character ``offset`` on, ``offset``): ``searched - keep`` or 0."""
        text = "".join([self._before, *self._since]) + self._pending
        return text, self.searched - len(self._before)

    def mark(self) -> None:
        """The text so far has been searched: ``tail()`` starts ``keep`` characters before its end."""
        if self._since:
            joined = "".join([self._before, *self._since])
            self._before = joined[max(len(joined) - self.keep, 0) :]
            self._since = []
        self.searched = self.settled


def text_tail(tokenizer: Any, keep: int) -> TextTail | None:
    """A ``TextTail`` of ``tokenizer``'s decode; None where that decode is not a concatenation of
    per-token pieces (another decoder, clean-up of spaces, a Python tokenizer): its text can change
    anywhere as tokens arrive (a ByteFallback run's bytes, a space the clean-up removes later), so
    only decoding all the ids again gives it."""
    backend = _batch_decoder(tokenizer)
    table = _piece_table(tokenizer, backend) if backend is not None else None
    return TextTail(table, keep) if table is not None else None


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per tokenizer object: its ``_PieceTable``, rebuilt when its vocabulary grows."""


def _piece_table(tokenizer: Any, backend: Any) -> _PieceTable | None:
    """The tokenizer's ``_PieceTable``, built on first use; None for other decoders."""
    kind = type(getattr(backend, "decoder", None)).__name__
    if kind not in ("Fuse", "ByteLevel"):
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    cached = _TABLES.get(tokenizer)
    if cached is None or cached.size != size:
        cached = _TABLES[tokenizer] = _PieceTable(backend, size, kind == "ByteLevel")
    return cached


def _decode_each(tokenizer: Any, ids_B: list[list[int]]) -> list[str]:
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in ids_B]


def _batch_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` whose ``decode`` gives what ``tokenizer.decode`` does, or None.

    ``PreTrainedTokenizerFast.decode`` (transformers 4 and 5) returns the backend's decode of the
    ids, then ``clean_up_tokenization`` of it when ``clean_up_tokenization_spaces`` is set; a
    subclass may override either method. Only the plain case maps onto the backend."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or tokenizer.clean_up_tokenization_spaces:
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return tokenizer.backend_tokenizer
