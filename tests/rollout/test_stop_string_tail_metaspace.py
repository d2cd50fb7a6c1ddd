"""Stop strings over the ``Metaspace`` decoder (T5's, XLNet's, ALBERT's) followed token by token
(``TextTail`` through a ``_MetaspaceTable``): each token's replacement character ("▁") is a space,
except in the first token that reaches the decoder (special tokens and unknown ids are dropped before
it), where prepend_scheme "first" and "always" drop every one of them and "never" keeps them as spaces.
Its text must be the whole decode's after every token, and the engine's outputs the whole-decode
path's, exactly."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from areno.data import detokenize
from areno.data.detokenize import TextTail, text_tail
from tests.helpers.stop_strings import (
    CORPUS,
    check_every_prefix_of_triples,
    checked_tail,
    decode,
    free_run_stop_outcomes,
    scripted_stop_reasons,
    tok_model_fixture,
    tokens_decoded_for_a_long_request,
)

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
# "▁" alone, several of them, inside and at the end of a token: the first token drops all of them
ODD = ["▁", "▁▁", "▁▁▁", "a▁b", "x▁", "▁y▁", "▁▁z", "<0x41>", "▁<0x20>"]
TEXT = CORPUS + ["  two spaces first, é: café 漢字 🙂\n\ttabs ▁ and a literal ▁ sign  "]
SCHEMES = ("first", "always", "never")


def unigram(scheme: str, split: bool = True, replacement: str = "▁") -> PreTrainedTokenizerFast:
    """T5's shape: a Unigram over words and characters, the Metaspace pre-tokenizer and decoder."""
    words = sorted({w for line in TEXT for w in line.split()})
    pieces = SPECIAL + [p.replace("▁", replacement) for p in ODD] + sorted(set("".join(TEXT)) - {" "})
    pieces += [replacement + w for w in words] + words
    vocab = [(p, 0.0 if p in SPECIAL else -1.0 - len(p) / 10) for p in dict.fromkeys(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=replacement, prepend_scheme=scheme, split=split)
    tok.decoder = decoders.Metaspace(replacement=replacement, prepend_scheme=scheme, split=split)
    return finish(tok)


def bpe(scheme: str) -> PreTrainedTokenizerFast:
    """A BPE trained through the Metaspace pre-tokenizer (merged pieces with "▁" first)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(prepend_scheme=scheme)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(TEXT * 10, trainer)
    tok.add_tokens(ODD)
    return finish(tok)


def finish(tok: Tokenizer) -> PreTrainedTokenizerFast:
    tok.add_special_tokens(SPECIAL + ["<|eot|>"])
    tok.add_tokens(["<think>", "▁hey▁", "▁"])  # added, not special: through the decoder like any token
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


TOKENIZERS = {f"unigram_{s}": (lambda s=s: unigram(s)) for s in SCHEMES}
TOKENIZERS |= {f"bpe_{s}": (lambda s=s: bpe(s)) for s in SCHEMES}
TOKENIZERS |= {
    "unigram_first_nosplit": lambda: unigram("first", split=False),
    "unigram_always_nosplit": lambda: unigram("always", split=False),
    "unigram_underscore": lambda: unigram("always", replacement="_"),
}


def random_ids(tok: PreTrainedTokenizerFast, rng: random.Random, n: int) -> list[int]:
    """Real text, "▁" tokens of every kind, special tokens (at the start too), ids past the vocabulary."""
    size = len(tok)
    odd = tok.convert_tokens_to_ids([t for t in tok.get_vocab() if "▁" in t or "_" in t])
    special = tok.all_special_ids
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.3:
            text = rng.choice(TEXT)
            at = rng.randrange(len(text))
            ids += tok.encode(text[at : at + rng.randrange(1, 12)], add_special_tokens=False)
        elif r < 0.55:
            ids.append(rng.choice(odd))
        elif r < 0.75:
            ids.append(rng.choice(special))
        elif r < 0.82:
            ids.append(rng.randrange(size, size + 4))
        else:
            ids.append(rng.randrange(size))
    return ids[:n]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_tail_is_the_whole_decode_after_every_token(name):
    """For random ids, after every token: the text (tail and offset) is the end of
    ``tokenizer.decode(ids, skip_special_tokens=True)`` and every character is settled at once."""
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    dropped = 0
    for _ in range(80):
        keep = rng.randrange(0, 6)
        tail = text_tail(tok, keep)
        assert isinstance(tail, TextTail)
        ids: list[int] = []
        settled_text = ""
        for t in random_ids(tok, rng, rng.randrange(1, 60)):
            ids.append(t)
            tail.add(t)
            settled_text = checked_tail(tok, tail, ids, keep, settled_text)
            assert tail.settled == len(settled_text)  # every character settled at once
            if rng.random() < 0.7:
                tail.mark()
        if not name.endswith("never") and not name.endswith("underscore"):
            first = next((t for t in ids if t < len(tok) and t not in tok.all_special_ids), None)
            dropped += first is not None and "▁" in tok.convert_ids_to_tokens(first)
    assert name.endswith(("never", "underscore")) or dropped  # a first token lost its "▁"s


@pytest.mark.parametrize("name", ["unigram_first", "unigram_always", "unigram_never", "unigram_underscore"])
def test_every_prefix_of_every_token_triple(name):
    """Each prefix of short sequences, exhaustively over a set of tokens: "▁" tokens first or after a
    special token or an unknown id (which leave the next token the first), "▁" inside a token."""
    tok = TOKENIZERS[name]()
    r = "_" if name.endswith("underscore") else "▁"
    picks = [p.replace("▁", r) for p in ["▁", "▁▁", "a▁b", "x▁", "▁▁z"]] + ["<s>", "<think>", "▁hey▁", "a"]
    ids = tok.convert_tokens_to_ids(picks) + [len(tok) + 1]
    assert tok.unk_token_id not in ids[:-1]
    check_every_prefix_of_triples(tok, ids)


tok_model = tok_model_fixture(TOKENIZERS, ["unigram_first", "unigram_always", "unigram_never", "bpe_always"])


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_stop_strings_end_requests_as_the_whole_output_decode_did(tok_model, decode_steps):
    """The engine's outputs (tokens, finish reason, text) with stop strings cut from free runs equal
    the whole-decode rule's (``old_outcome``)."""
    name, tok, model, cfg = tok_model
    assert isinstance(text_tail(tok, 0), TextTail)
    free_run_stop_outcomes(tok, model, cfg, decode_steps)


# "▁ab"-like first tokens after special tokens: the text starts without (or, "never", with) the space
STOPS = [(" two",), ("two",), ("  ",), ("caf",), (" café", "漢"), ("y ",), (" a b",), ("ab",), ("sign",), (" ",)]


@pytest.mark.parametrize("min_new_tokens", [0, 5])
def test_scripted_outputs_stop_as_the_whole_output_decode_did(tok_model, min_new_tokens):
    """Chosen outputs: special tokens and an unknown id before the first text token, "▁"-only and
    "▁"-inside tokens; with min_new_tokens."""
    name, tok, model, cfg = tok_model
    ids = tok.convert_tokens_to_ids
    text = tok.encode(TEXT[-1], add_special_tokens=False)
    script = ids(["<s>", "<|eot|>"]) + [len(tok) + 1] + ids(["▁▁", "▁y▁"]) + text + ids(["a▁b", "<s>", "▁", "x▁"])
    reasons = scripted_stop_reasons(tok, model, cfg, script, STOPS, min_new_tokens)
    assert reasons.count("stop") >= len(STOPS) // 2


def test_stop_string_decode_is_linear_in_the_output_length(tok_model):
    """A long request with a never-matching stop string decodes its whole output once, not per token."""
    name, tok, model, cfg = tok_model
    assert tokens_decoded_for_a_long_request(tok, model, cfg, 600) <= 2 * 600


def test_which_metaspace_tokenizers_stay_on_the_whole_decode():
    """Clean-up of spaces, a byte-fallback model under a bare Metaspace decoder, and a Metaspace step
    inside a Sequence still decode whole (None); the whole-decode helpers are unchanged."""
    clean_up = unigram("always")
    clean_up.clean_up_tokenization_spaces = True
    assert text_tail(clean_up, 3) is None
    byte_fb = unigram("first")
    vocab = json.loads(byte_fb.backend_tokenizer.model.__getstate__())["vocab"]
    byte_fb.backend_tokenizer.model = models.Unigram([tuple(v) for v in vocab], unk_id=3, byte_fallback=True)
    assert text_tail(byte_fb, 3) is None and text_tail(byte_fb, 3) is None  # declined, and remembered
    seq = unigram("first")
    seq.backend_tokenizer.decoder = decoders.Sequence([decoders.Metaspace(), decoders.Fuse()])
    assert text_tail(seq, 3) is None
    tok = unigram("first")
    assert isinstance(text_tail(tok, 3), TextTail)
    assert detokenize.decode_texts(tok, [[5, 6, 7]]) == [decode(tok, [5, 6, 7])]
    tok.backend_tokenizer.decoder = decoders.Metaspace(prepend_scheme="never")  # a changed decoder rebuilds
    tail = text_tail(tok, 3)
    first = tok.convert_tokens_to_ids(["▁▁z"])
    tail.add(first[0])
    assert tail.tail()[0] == decode(tok, first) == "  z"
