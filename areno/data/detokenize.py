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
engine's stop strings), keeping only its end: the same table, one token's piece per call. It also
follows SentencePiece-style decoders (Llama 2's, Mistral's, Gemma's: ``Replace("▁", " ")``,
``ByteFallback``, ``Fuse``, ``Strip``), whose text is per-token pieces too except for a run of byte
tokens (one UTF-8 decode of the run) and the strip at the text's start; and the ``Metaspace`` decoder
(T5's, XLNet's, ALBERT's), whose first token's "▁"s are dropped (prepend_scheme "first", "always")
where every other one is a space.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import operator
import string
import weakref
from collections.abc import Callable
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

    def __init__(self, backend: Any, size: int, byte_level: bool, state: Any = None) -> None:
        special = _special_contents(backend)
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
        self.state = state  # the decoder it was built for (a changed decoder rebuilds it)

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


_HEX = frozenset(string.hexdigits)


def _fallback_piece(token: str, replaces: tuple[tuple[str, str], ...], byte_fallback: bool) -> str | bytes:
    """A token's share of a SentencePiece-style decode: its text after the ``Replace`` steps, or its
    byte where ``ByteFallback`` reads it as ``<0xNN>``: 6 UTF-8 bytes, whose two middle ones are what
    Rust's ``u8::from_str_radix(_, 16)`` accepts (hex digits, a leading "+" allowed: "<0x+A>" is 10)."""
    for old, new in replaces:
        token = token.replace(old, new)
    if byte_fallback and token.startswith("<0x") and token.endswith(">") and len(token.encode()) == 6:
        digits = token[3:-1]
        digits = digits[1:] if digits[:1] == "+" else digits
        if digits and all(c in _HEX for c in digits):
            return bytes([int(digits, 16)])
    return token


class _FallbackTable:
    """Each token id's piece for a SentencePiece-style decoder (``_fallback_spec``): the token's text
    after the ``Replace`` steps, its byte (``bytes``) for a ``ByteFallback`` token, or None for an id
    that ``tokenizers`` drops before the decoder sees it (a special token, an unknown id), so that it
    neither adds text nor ends a run of byte tokens. ``strip``: (character, how many of the text's
    first characters a final ``Strip`` may remove)."""

    byte_level = False

    def __init__(self, backend: Any, tokens: list[str | None], spec: tuple[Any, bool, tuple[str, int]], state: Any):
        replaces, byte_fallback, self.strip = spec
        self.pieces = [None if t is None else _fallback_piece(t, replaces, byte_fallback) for t in tokens]
        self.backend, self.size, self.state = backend, len(tokens), state


class _MetaspaceTable:
    """Each token id's piece for a ``Metaspace`` decoder: the token with its replacement character as
    " " (``pieces``), or, for the first token the decoder is given, with it dropped (``first``; the
    same where prepend_scheme is "never"). None for an id ``tokenizers`` drops before the decoder (a
    special token, an unknown id): the next token is then still the first."""

    byte_level = False

    def __init__(self, backend: Any, tokens: list[str | None], spec: tuple[str, bool], state: Any):
        replacement, drop_first = spec
        self.pieces = [None if t is None else t.replace(replacement, " ") for t in tokens]
        self.first = [None if t is None else t.replace(replacement, "") for t in tokens] if drop_first else self.pieces
        self.backend, self.size, self.state = backend, len(tokens), state


class TextTail:
    """The end of ``tokenizer.decode(ids, skip_special_tokens=True)`` of a list of ids that grows one
    token at a time, through a ``_PieceTable``: each token adds its piece (a ByteLevel one's bytes go
    through an incremental UTF-8 decoder, which gives what one lossy decode of all the bytes gives),
    so a token costs the same at any length. ``text_tail(tokenizer, keep)`` makes one.

    Through a ``_FallbackTable`` (SentencePiece-style decoders), text pieces are added as they come;
    a run of byte tokens is one UTF-8 decode of its bytes when they are valid UTF-8, else one U+FFFD
    per byte token, as ``ByteFallback`` does; and the decode's ``Strip`` removes characters at the
    text's start only. Through a ``_MetaspaceTable``, each token adds its piece, its ``first`` one
    for the first token that reaches the decoder; every character is settled at once.

    A search of the text for strings of at most ``keep + 1`` characters after every token looks at
    ``tail()``: the text since the last ``mark()``, with the ``keep`` characters settled before it.
    Settled characters never change; only the text of the bytes at the end can: a character's
    incomplete bytes (U+FFFD until its last byte arrives, as in the whole decode), or a byte run that
    is valid UTF-8 so far (a later byte can still turn all of it into U+FFFDs)."""

    def __init__(self, table: _PieceTable | _FallbackTable | _MetaspaceTable, keep: int) -> None:
        self.table, self.keep = table, keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if table.byte_level else None
        self.settled = 0
        """Characters of the text that later tokens cannot change."""
        self.searched = 0
        """``settled`` at the last ``mark()``."""
        self._before = ""  # up to ``keep`` settled characters before ``searched``
        self._since: list[str] = []  # settled text after ``searched``
        self._pending = ""  # the text of the bytes at the end that later tokens can change
        self._fallback = isinstance(table, _FallbackTable)
        self._metaspace = isinstance(table, _MetaspaceTable)
        self._first = True  # no token has reached a Metaspace decoder yet
        if self._fallback:
            self._strip_char, self._strip_left = table.strip  # type: ignore[union-attr]
            self._run = 0  # byte tokens in the run at the end
            self._run_bad = False  # its bytes are not valid UTF-8, whatever follows
            self._run_text: list[str] = []  # its characters decoded so far (while valid)
            self._run_utf8 = codecs.getincrementaldecoder("utf-8")("strict")

    def add(self, token_id: int) -> None:
        if self._fallback:
            self._add_fallback(token_id)
            return
        if self._metaspace:
            self._add_metaspace(token_id)
            return
        table = self.table
        if 0 <= token_id < table.size:
            piece = table.pieces[token_id]
        elif token_id >= table.size:  # past the vocabulary: dropped, as tokenizers does
            piece = table.empty  # type: ignore[union-attr]
        else:  # a negative id: the backend's own error
            table.backend.decode([token_id], skip_special_tokens=True)
            piece = table.empty  # type: ignore[union-attr]
        if self._utf8 is not None:
            new = self._utf8.decode(piece)  # type: ignore[arg-type]
            buffered = self._utf8.getstate()[0]
            self._pending = buffered.decode("utf-8", errors="replace") if buffered else ""
        else:
            new = piece  # type: ignore[assignment]
        if new:
            self._since.append(new)
            self.settled += len(new)

    def _piece(self, pieces: list, token_id: int) -> Any:
        """``pieces[token_id]``; None for an id the decoder never sees (special, or past the vocabulary);
        a negative id raises the backend's own error."""
        if 0 <= token_id < self.table.size:
            return pieces[token_id]
        if token_id < 0:
            self.table.backend.decode([token_id], skip_special_tokens=True)
        return None

    def _add_fallback(self, token_id: int) -> None:
        piece = self._piece(self.table.pieces, token_id)
        if piece is None:  # skipped before the decoder: a byte run goes on through it
            return
        if type(piece) is bytes:
            self._run += 1
            if self._run_bad:  # an invalid run stays so: one more U+FFFD, final
                self._settle("\ufffd")
                return
            try:
                new = self._run_utf8.decode(piece)
            except UnicodeDecodeError:  # no later byte makes the run valid: its U+FFFDs are final
                self._run_bad, self._run_text, self._pending = True, [], ""
                self._settle("\ufffd" * self._run)
                return
            if new:
                self._run_text.append(new)
            self._pending = self._shown(self._run_text_now())
            return
        if self._run:  # a text token ends the run: its text is final
            if not self._run_bad:
                self._settle(self._run_text_now())
            self._run, self._run_bad, self._run_text, self._pending = 0, False, [], ""
            self._run_utf8.reset()
        self._settle(piece)  # type: ignore[arg-type]

    def _add_metaspace(self, token_id: int) -> None:
        table = self.table
        piece = self._piece(table.first if self._first else table.pieces, token_id)  # type: ignore[union-attr]
        if piece is None:  # skipped before the decoder: the first token is still to come
            return
        self._first = False  # even a token that decodes to "" was the decoder's first
        if piece:
            self._since.append(piece)
            self.settled += len(piece)

    def _run_text_now(self) -> str:
        """The text of the (valid so far) byte run if it ended here: a character cut short makes
        the run invalid UTF-8."""
        return "\ufffd" * self._run if self._run_utf8.getstate()[0] else "".join(self._run_text)

    def _settle(self, text: str) -> None:
        if self._strip_left and text:  # the decode's Strip: characters at the text's very start only
            cut = _leading(text, self._strip_char, self._strip_left)
            self._strip_left = self._strip_left - cut if cut == len(text) else 0
            text = text[cut:]
        if text:
            self._since.append(text)
            self.settled += len(text)

    def _shown(self, text: str) -> str:
        """Unsettled ``text`` at the end as the decode shows it now (stripped while at the start)."""
        return text[_leading(text, self._strip_char, self._strip_left) :] if self._strip_left else text

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


def _leading(text: str, char: str, most: int) -> int:
    """How many of ``text``'s first ``most`` characters are ``char``, counted from its start."""
    n = 0
    while n < most and n < len(text) and text[n] == char:
        n += 1
    return n


def text_tail(tokenizer: Any, keep: int) -> TextTail | None:
    """A ``TextTail`` of ``tokenizer``'s decode; None where this module does not follow that decode
    (another decoder, a Metaspace one over a byte-fallback model included; clean-up of spaces, which
    removes a space once a later token arrives; a Python tokenizer): only decoding all the ids again
    gives its text."""
    backend = _batch_decoder(tokenizer)
    table = _piece_table(tokenizer, backend, fallback=True) if backend is not None else None
    return TextTail(table, keep) if table is not None else None


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per tokenizer object: its ``_PieceTable`` (or ``_FallbackTable``), rebuilt when its vocabulary
grows or its decoder changes."""


def _piece_table(tokenizer: Any, backend: Any, fallback: bool = False) -> Any:
    """The tokenizer's ``_PieceTable``, built on first use; None for other decoders. ``fallback``:
    also a ``_FallbackTable`` for a SentencePiece-style decoder or a ``_MetaspaceTable`` (``TextTail``
    only: a whole decode through them is the ``tokenizers`` batch call)."""
    decoder = getattr(backend, "decoder", None)
    kind = type(decoder).__name__
    if kind in ("Fuse", "ByteLevel"):
        state: Any = kind
    elif fallback and kind in ("Sequence", "Metaspace"):
        state = decoder.__getstate__()  # the steps and their settings (~1 us)
    else:
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    cached = _TABLES.get(tokenizer)
    if cached is not None and cached.size == size and cached.state == state:
        return None if isinstance(cached, _Declined) else cached
    if kind == "Metaspace":
        spec = _metaspace_spec(state)
        if spec is None or not _metaspace_as_assumed(decoder, spec) or _byte_fallback(backend):
            # the model's state is serialized to see its byte fallback: not again for this decoder
            _TABLES[tokenizer] = _Declined(size, state)
            return None
        special = _special_contents(backend)
        tokens = [backend.id_to_token(i) for i in range(size)]
        cached = _MetaspaceTable(backend, [None if t in special else t for t in tokens], spec, state)
    elif kind == "Sequence":
        spec = _fallback_spec(state)
        if spec is None or not _decodes_as_assumed(decoder, spec):
            return None
        special = _special_contents(backend)
        tokens = [backend.id_to_token(i) for i in range(size)]
        cached = _FallbackTable(backend, [None if t in special else t for t in tokens], spec, state)
    else:
        cached = _PieceTable(backend, size, kind == "ByteLevel", state)
    _TABLES[tokenizer] = cached
    return cached


class _Declined:
    """A decoder this module does not follow, for the vocabulary size and decoder state it was seen at."""

    def __init__(self, size: int, state: Any) -> None:
        self.size, self.state = size, state


def _metaspace_spec(state: bytes) -> tuple[str, bool] | None:
    """(replacement character, whether the first token's ones are dropped) of a ``Metaspace``
    decoder with the settings known here (``split`` only splits when encoding); None otherwise."""
    try:
        step = json.loads(state)
        if set(step) != {"type", "replacement", "prepend_scheme", "split"} or step["type"] != "Metaspace":
            return None
        replacement, scheme = step["replacement"], step["prepend_scheme"]
        if not isinstance(replacement, str) or len(replacement) != 1 or scheme not in ("first", "always", "never"):
            return None
        return replacement, scheme != "never"
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


_METASPACE_PROBES = (
    ["a▁b", "▁", "▁▁c", "x▁", "▁<0x41>", "<0x20>", " d", "▁"],
    ["▁", "▁", "a"],
    ["▁▁", "b▁▁c", "_", "▁"],
    ["e", "▁f▁"],
)
"""Token lists whose decode shows what ``TextTail`` assumes of a Metaspace decoder ("▁" stands for its
replacement character): every one in the first token dropped or kept, every later one a space."""


def _metaspace_as_assumed(decoder: Any, spec: tuple[str, bool]) -> bool:
    """``TextTail``'s text equals the decoder's own after every token of each of ``_METASPACE_PROBES``."""
    probes = [[t.replace("▁", spec[0]) for t in probe] for probe in _METASPACE_PROBES]
    return _tail_follows(decoder, probes, lambda tokens: _MetaspaceTable(None, tokens, spec, None))


def _byte_fallback(backend: Any) -> bool:
    """The model writes unknown characters as ``<0xNN>`` tokens: a bare Metaspace decoder shows them
    as that text, a decoder that does not match its model, left to the whole decode."""
    try:
        return bool(json.loads(backend.model.__getstate__()).get("byte_fallback"))
    except (TypeError, ValueError, AttributeError):
        return True


def _special_contents(backend: Any) -> set[str]:
    """The special tokens' texts: ``tokenizers`` skips any token with one of them (a model token too)."""
    return {t.content for t in backend.get_added_tokens_decoder().values() if t.special}


_STEP_KEYS = {
    "Replace": {"type", "pattern", "content"},
    "ByteFallback": {"type"},
    "Fuse": {"type"},
    "Strip": {"type", "content", "start", "stop"},
}


def _fallback_spec(state: bytes) -> tuple[tuple[tuple[str, str], ...], bool, tuple[str, int]] | None:
    """(replacements, ByteFallback or not, (character, count) of the final Strip) of a decoder
    ``Sequence`` of ``Replace`` steps of plain strings, ``ByteFallback`` (optional), ``Fuse`` and
    optionally ``Strip`` of the text's start only (Llama 2's, Mistral's, Gemma's); None for any other
    (a step with settings not known here too: its text may not be what this module assumes)."""
    try:
        steps = json.loads(state)["decoders"]
        if any(set(step) != _STEP_KEYS.get(step["type"]) for step in steps):
            return None
        at, replaces = 0, []
        while at < len(steps) and steps[at]["type"] == "Replace":
            pattern, content = steps[at]["pattern"], steps[at]["content"]
            if set(pattern) != {"String"} or not isinstance(pattern["String"], str) or not pattern["String"]:
                return None  # a regex: its matches are not a plain replace
            if not isinstance(content, str):
                return None
            replaces.append((pattern["String"], content))
            at += 1
        byte_fallback = at < len(steps) and steps[at]["type"] == "ByteFallback"
        at += byte_fallback
        if at == len(steps) or steps[at]["type"] != "Fuse":
            return None
        at += 1
        strip = (" ", 0)
        if at < len(steps) and steps[at]["type"] == "Strip":
            step = steps[at]
            if step["stop"] != 0 or not isinstance(step["start"], int) or len(step["content"]) != 1:
                return None  # a strip at the end changes the text's last characters as tokens come
            strip, at = (step["content"], step["start"]), at + 1
        return (tuple(replaces), byte_fallback, strip) if at == len(steps) else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


_PROBES = (
    ["▁a", "<0x20>", "<0xE6>", "<0xBC>", "<0xA2>", "▁▁b", "<0x41>", "<0xE6>", "c", "<0xFF>", "<0x41>"],
    ["<0x20>", "<0x20>", "▁", "<0xC3>", "<0xA9>", "<0xC3>", "<0x+1>", "▁x", "<0xED>", "<0xA0>", "<0x80>"],
    ["▁", "▁▁y", "<0x4G>", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "z▁", "<0xa9>", "<0xc3>", "<0x0a>", "▁"],
)
"""Token lists whose decode shows what ``TextTail`` assumes of a SentencePiece-style decoder: byte
runs valid, invalid and cut short, spaces at the start, strings that look like bytes and are not."""


def _decodes_as_assumed(decoder: Any, spec: tuple[Any, bool, tuple[str, int]]) -> bool:
    """``TextTail``'s text equals the decoder's own after every token of each of ``_PROBES``: the
    installed ``tokenizers`` decodes as this module assumes (else the decode is left whole)."""
    return _tail_follows(
        decoder, [list(tokens) for tokens in _PROBES], lambda tokens: _FallbackTable(None, tokens, spec, None)
    )


def _tail_follows(decoder: Any, probes: list[list[str]], table: Callable[[list[str]], Any]) -> bool:
    """Whether a ``TextTail`` over ``table(tokens)`` (token id k = ``tokens[k]``) gives ``decoder``'s text
    after every token of each probe."""
    for tokens in probes:
        tail = TextTail(table(tokens), 0)
        for k in range(len(tokens)):
            tail.add(k)
            if tail.tail()[0] != decoder.decode(tokens[: k + 1]):
                return False
    return True


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
