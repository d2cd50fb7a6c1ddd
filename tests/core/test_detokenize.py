"""``decode_texts``: many sequences to text in one call, equal to decoding each one by itself;
``adecode_texts``: the same from a coroutine, the batch decode in a worker thread."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from transformers import PreTrainedTokenizerFast

from areno.data import detokenize
from areno.data.detokenize import adecode_texts, decode_texts
from areno.data.tokenizer import build_char_tokenizer


def _sequences(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(12)] + [[], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("vocab_padding", [0, 500])
def test_equals_decoding_each_sequence(vocab_padding):
    """The char tokenizer (with bench.e2e's padding tokens, which decode to long strings) decodes
    through its backend's batch call: special tokens are skipped, empty sequences give ''."""
    tok = build_char_tokenizer(vocab_padding=vocab_padding)
    ids_B = _sequences(len(tok))
    assert decode_texts(tok, ids_B) == [tok.decode(ids, skip_special_tokens=True) for ids in ids_B]
    assert decode_texts(tok, []) == []


class _Shouting(PreTrainedTokenizerFast):
    def decode(self, token_ids, skip_special_tokens=False, **kwargs):
        return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()


class _Plain:
    def decode(self, token_ids, skip_special_tokens=False):
        return ",".join(map(str, token_ids))


def test_tokenizers_whose_decode_differs_from_the_backends_decode_each_sequence():
    tok = build_char_tokenizer()
    ids_B = [tok.encode("a . b ,", add_special_tokens=False), tok.encode("x", add_special_tokens=False)]
    tok.clean_up_tokenization_spaces = True  # decode() then rewrites " ." as "."
    assert decode_texts(tok, ids_B) == [tok.decode(ids, skip_special_tokens=True) for ids in ids_B] == ["a. b,", "x"]
    shouting = _Shouting(tokenizer_object=tok.backend_tokenizer, clean_up_tokenization_spaces=False)
    assert decode_texts(shouting, ids_B) == ["A . B ,", "X"]
    assert decode_texts(_Plain(), [[1, 2], []]) == ["1,2", ""]


def test_async_decode_runs_the_batch_decode_off_the_event_loop(monkeypatch):
    """Groups finishing in the same engine step decode side by side: the batch decode of each
    runs in a worker thread (the loop's thread stays free), with decode_texts' result; a
    tokenizer without the batch path decodes inline, as decode_texts does."""
    tok = build_char_tokenizer(vocab_padding=100)
    ids_B = _sequences(len(tok))
    backend = tok.backend_tokenizer
    threads = []

    class _Recording:
        def decode_batch(self, ids, skip_special_tokens):
            threads.append(threading.get_ident())
            return backend.decode_batch(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(detokenize, "_batch_decoder", lambda t: _Recording() if t is tok else None)

    async def main():
        texts = await asyncio.gather(adecode_texts(tok, ids_B), adecode_texts(tok, ids_B[:3]))
        return texts, threading.get_ident(), await adecode_texts(_Plain(), [[1, 2], []])

    (full, part), loop_thread, plain = asyncio.run(main())
    assert full == [tok.decode(ids, skip_special_tokens=True) for ids in ids_B] and part == full[:3]
    assert len(threads) == 2 and loop_thread not in threads
    assert plain == ["1,2", ""]
