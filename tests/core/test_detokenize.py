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
    through its table of pieces (a ``Fuse`` decoder): special tokens are skipped, ids past the
    vocabulary (a model's padded rows) are dropped, empty sequences give ''."""
    tok = build_char_tokenizer(vocab_padding=vocab_padding)
    ids_B = _sequences(len(tok) + 20)
    assert decode_texts(tok, ids_B) == [tok.decode(ids, skip_special_tokens=True) for ids in ids_B]
    assert decode_texts(tok, []) == []
    assert detokenize._TABLES[tok].size == len(tok)
    tok.add_tokens(["<new>"])  # a grown vocabulary rebuilds the table
    assert decode_texts(tok, [[len(tok) - 1, 50]]) == [tok.decode([len(tok) - 1, 50], skip_special_tokens=True)]


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (as Qwen's and Llama 3's) trained here on a few multilingual lines,
    with special tokens and a non-special added token holding a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [
        "The sum of 12 and 30 is 42.\n",
        "Größe, naïve café — ∑ x² ≤ 10",
        "数学很有趣。答案是四十二。",
        "🙂 emoji 🚀!",
    ]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text * 20, trainer=trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think about>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def test_byte_level_pieces_equal_the_tokenizers_decode():
    """A byte-level tokenizer decodes through its table of bytes (one lossy UTF-8 decode of the
    joined bytes): random ids split multi-byte characters anywhere, and each text equals
    ``tokenizer.decode`` (replacement characters included); specials skipped, unknown ids dropped."""
    tok = _byte_level_tokenizer()
    ids_B = _sequences(len(tok) + 5) + [tok.encode("数学 🙂 <think about> x²", add_special_tokens=False)]
    expected = [tok.decode(ids, skip_special_tokens=True) for ids in ids_B]
    assert any("\ufffd" in text for text in expected) and "数学 🙂 <think about> x²" in expected
    assert decode_texts(tok, ids_B) == expected
    assert detokenize._TABLES[tok].byte_level
    assert asyncio.run(adecode_texts(tok, ids_B)) == expected


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
    """Groups finishing in the same engine step decode side by side: where the decoder has no table
    of pieces (a stand-in backend here), the batch decode of each runs in a worker thread (the loop's
    thread stays free), with decode_texts' result; a tokenizer without the batch path decodes
    inline, as decode_texts does."""
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
