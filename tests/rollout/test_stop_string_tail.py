"""Stop strings decoded token by token (walk37 #2): the engine follows each output's text through a
``TextTail`` (one token's piece a step) and searches only its new end, where it decoded the whole
output after every token and searched it from ``stop_from``. The outputs (stop position, text, finish
reason) must be exactly the old ones, for the char tokenizer, a ByteLevel BPE whose multi-byte
characters are split across tokens, and tokenizers whose text only a whole decode gives."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from areno.data.detokenize import text_tail
from areno.data.tokenizer import build_char_tokenizer
from tests.helpers.stop_strings import (
    CORPUS,
    checked_tail,
    free_run_stop_outcomes,
    scripted_stop_reasons,
    tok_model_fixture,
    tokens_decoded_for_a_long_request,
)


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A small ByteLevel BPE (Qwen's decoder kind): most multi-byte characters are two or more tokens,
    some merged tokens hold part of a character (U+FFFD alone, the character in context)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<pad>", "<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece's decoder: a word's leading "▁" is a space, except at the start of the text,
    so a token decodes differently at the start and in context (only a whole decode gives the text)."""
    words = ["<pad>", "<s>", "</s>"] + [f"▁{w}" for w in "ab cd e fg h".split()] + list("abcdefgh.,!?")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def clean_up_chars() -> PreTrainedTokenizerFast:
    """The char tokenizer with ``clean_up_tokenization_spaces``: " ." becomes "." once the "." comes."""
    tok = build_char_tokenizer("ab .,!?'nt")
    tok.clean_up_tokenization_spaces = True
    return tok


TOKENIZERS = {"char": build_char_tokenizer, "bpe": byte_level_bpe, "metaspace": metaspace, "clean_up": clean_up_chars}


tok_model = tok_model_fixture(TOKENIZERS)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_stop_strings_end_requests_as_the_whole_output_decode_did(tok_model, decode_steps):
    name, tok, model, cfg = tok_model
    assert (text_tail(tok, 0) is not None) == (name in ("char", "bpe", "metaspace"))  # clean_up decodes whole
    outcomes = free_run_stop_outcomes(tok, model, cfg, decode_steps)
    assert "" in [o[2] for o in outcomes]  # a cut at the very start too


def chars(tok, text: str) -> list[int]:
    return tok.convert_tokens_to_ids(list(text))


SCRIPTS = {
    # multi-byte characters split across tokens, some tokens a character's first bytes only
    "bpe": (
        lambda tok: tok.encode(CORPUS[0], add_special_tokens=False),
        [("字",), ("漢字と",), ("🙃",), ("é d",), ("\ufffd",), ("na",), (" vu", "ünï", "🙂"), ("é",), ("»", "∑ ∞")],
    ),
    "char": (
        lambda tok: chars(tok, "the quick brown fox jumps over the lazy dog."),
        [("fox",), ("lazy", "o", "he q"), ("th",), ("e",)],
    ),
    # "▁ab" is "ab" at the start and " ab" after another word
    "metaspace": (
        lambda tok: tok.convert_tokens_to_ids(["▁ab", "▁cd", ".", "▁e", "!", "a", "▁h", "▁ab", "?"]),
        [("ab",), (" ab",), ("d. e",), ("!a h",), (" cd", "h ab")],
    ),
    # " ." is in the text only until the "." arrives
    "clean_up": (lambda tok: chars(tok, "a b . an't ! b ,a"), [(" .",), ("b.",), (" n't", "t!"), ("a",), ("!",)]),
}


@pytest.mark.parametrize("min_new_tokens", [0, 5])
def test_scripted_outputs_stop_as_the_whole_output_decode_did(tok_model, min_new_tokens):
    """Chosen outputs (one greedy token each step): stop strings inside split characters, across token
    boundaries, at the very start, removed from the text by a later token; with min_new_tokens."""
    name, tok, model, cfg = tok_model
    make_script, stops = SCRIPTS[name]
    reasons = scripted_stop_reasons(tok, model, cfg, make_script(tok), stops, min_new_tokens)
    assert reasons.count("stop") >= len(stops) // 2


def test_tail_is_the_whole_decode_end_after_every_token():
    """``TextTail`` against the whole decode, for random ids (special ones, ids past the vocabulary,
    bytes of characters split anywhere): its tail is the whole text's end, settled characters stay."""
    for tok in (build_char_tokenizer(), byte_level_bpe()):
        size = len(tok)
        rng = random.Random(0)
        for _ in range(30):
            keep = rng.randrange(0, 6)
            tail = text_tail(tok, keep)
            ids: list[int] = []
            settled_text = ""
            # real text (characters split across tokens) and random ids, past the vocabulary too
            real = tok.encode(rng.choice(CORPUS), add_special_tokens=False)
            at = rng.randrange(0, len(real))
            for t in real[at : at + rng.randrange(1, 30)] + [
                rng.randrange(0, size + 4) for _ in range(rng.randrange(0, 50))
            ]:
                ids.append(t)
                tail.add(t)
                whole = checked_tail(tok, tail, ids, keep, settled_text)
                assert len(whole) - tail.settled <= 3  # a character's bytes at most
                settled_text = whole[: tail.settled]
                if rng.random() < 0.7:
                    tail.mark()


def test_stop_string_decode_is_linear_in_the_output_length(tok_model):
    """A long request with a stop string that never matches passes each token to the tokenizer's decode
    a bounded number of times (it was the whole output after every token: L^2 / 2)."""
    name, tok, model, cfg = tok_model
    if name not in ("char", "bpe", "metaspace"):
        pytest.skip("a tokenizer only a whole decode gives the text of decodes the whole output per token")
    # the whole output once at the end (the old path: 180,300)
    assert tokens_decoded_for_a_long_request(tok, model, cfg, 600) <= 2 * 600
