"""Stop strings over SentencePiece-style decoders (Llama 2's, Mistral's, TinyLlama's, Gemma's:
``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``, ``Strip(" ", 1, 0)``) followed token by token
(``TextTail`` through a ``_FallbackTable``): a run of ``<0xNN>`` tokens is one UTF-8 decode of its
bytes, or one U+FFFD per byte token where they are not valid UTF-8, so its text changes until a text
token ends it; the strip removes a space at the text's very start only. Its text must be the whole
decode's after every token, and the engine's outputs the whole-decode path's, exactly."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, trainers
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

SPECIAL = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# look like byte tokens: "<0x+A>" is one to ByteFallback (Rust's from_str_radix takes a "+"), the others not
ODD = ["<0x+A>", "<0x4G>", "<0x 1>", "<0xé>", "▁<0x41>", "▁▁", "▁"]
TEXT = CORPUS + ["  two spaces first, é split: café 漢字 🙂\n\ttabs ▁ and a literal ▁ sign"]
ASCII = [line.encode("ascii", "ignore").decode() for line in TEXT]  # learned pieces: the rest is bytes


def llama_decoder(strip: bool = True) -> decoders.Decoder:
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if strip else []))


def llama_bpe(decoder: decoders.Decoder | None = None) -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral / TinyLlama's tokenizer.json shape: a BPE with byte fallback (<0x00>..<0xFF>
    after the special tokens), the "▁" normalizer (prepend, spaces), the decoder Sequence with its
    Strip. Trained here on ASCII text, so every other character is bytes."""
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.train_from_iterator(ASCII * 10, trainer)
    spec = json.loads(base.to_str())
    learned = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    vocab = SPECIAL + BYTES + [t for t in learned + ODD if t not in SPECIAL and t not in BYTES]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(dict.fromkeys(vocab))}
    spec["model"].update(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoder if decoder is not None else llama_decoder()
    tok.add_special_tokens(SPECIAL + ["<|eot|>"])
    tok.add_tokens(["<think>", "▁hey▁", "<0x42>"])  # added, not special: through the decoder like any token
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def gemma_unigram() -> PreTrainedTokenizerFast:
    """Gemma's shape: a Unigram with byte fallback, spaces as "▁", the decoder without the Strip."""
    words = sorted({w for line in ASCII for w in line.split()} | {"▁" + w for line in ASCII for w in line.split()})
    pieces = SPECIAL + BYTES + ODD + list("abcdefghijklmnopqrstuvwxyz.,!?é") + words
    vocab = [(p, 0.0 if p in SPECIAL + BYTES else -1.0 - len(p) / 10) for p in dict.fromkeys(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIAL + ["<start_of_turn>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"llama": llama_bpe, "gemma": gemma_unigram}


def random_ids(tok: PreTrainedTokenizerFast, rng: random.Random, n: int) -> list[int]:
    """Ids that make byte runs of every kind: real text (characters split across byte tokens), valid
    and invalid UTF-8, "▁" tokens, special tokens inside runs, ids past the vocabulary."""
    size = len(tok)
    byte_id = tok.convert_tokens_to_ids(BYTES)
    spaces = tok.convert_tokens_to_ids([t for t in tok.get_vocab() if t.startswith("▁")])
    special = tok.all_special_ids
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.2:
            text = rng.choice(TEXT)
            at = rng.randrange(len(text))
            ids += tok.encode(text[at : at + rng.randrange(1, 12)], add_special_tokens=False)
        elif r < 0.4:  # a character's bytes, maybe cut short
            raw = rng.choice("é漢🙂½∑ünï").encode()
            ids += [byte_id[b] for b in raw[: rng.randrange(1, len(raw) + 1)]]
        elif r < 0.55:
            ids.append(byte_id[rng.randrange(256)])
        elif r < 0.7:
            ids.append(rng.choice(spaces))
        elif r < 0.8:
            ids.append(rng.choice(special))
        elif r < 0.85:
            ids.append(rng.randrange(size, size + 4))
        else:
            ids.append(rng.randrange(size))
    return ids[:n]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_tail_is_the_whole_decode_after_every_token(name):
    """For random ids, after every token: the text (tail and offset) is the end of
    ``tokenizer.decode(ids, skip_special_tokens=True)``, the settled text never changes, and only a
    byte run that is valid UTF-8 so far is unsettled."""
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    seen_fffd = seen_long_run = 0
    for _ in range(60):
        keep = rng.randrange(0, 6)
        tail = text_tail(tok, keep)
        assert isinstance(tail, TextTail)
        ids: list[int] = []
        settled_text = ""
        for t in random_ids(tok, rng, rng.randrange(1, 80)):
            ids.append(t)
            tail.add(t)
            whole = checked_tail(tok, tail, ids, keep, settled_text)
            settled_text = whole[: tail.settled]
            seen_fffd += "\ufffd" in whole
            seen_long_run += len(whole) - tail.settled >= 2
            if rng.random() < 0.7:
                tail.mark()
    assert seen_fffd and seen_long_run  # invalid runs, and valid multi-byte runs not yet settled


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_every_prefix_of_every_token_pair(name):
    """Each text prefix of short sequences, exhaustively over a set of tokens: the start's strip of
    a byte " ", "▁" tokens, byte runs ended by a special token (which does not end them) or a text one."""
    tok = TOKENIZERS[name]()
    picks = ["<0x20>", "<0xC3>", "<0xA9>", "<0x41>", "<0xFF>", "<0x+A>", "▁", "▁▁", "▁<0x41>", "a", "<s>"]
    check_every_prefix_of_triples(tok, tok.convert_tokens_to_ids(picks) + [len(tok) + 1])


tok_model = tok_model_fixture(TOKENIZERS)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_stop_strings_end_requests_as_the_whole_output_decode_did(tok_model, decode_steps):
    """The engine's outputs (tokens, finish reason, text) with stop strings cut from free runs equal
    the whole-decode rule's (``old_outcome``): most sampled tokens of these vocabularies are bytes."""
    name, tok, model, cfg = tok_model
    free_run_stop_outcomes(tok, model, cfg, decode_steps)


SCRIPT = "  café 漢字🙂 ok, naïve\n½ end"
STOPS = [("漢",), ("\ufffd",), ("caf",), (" caf",), ("字🙂 o", "é"), ("🙂",), ("ï",), ("\n½",), ("end", "naï"), (" ",)]


@pytest.mark.parametrize("min_new_tokens", [0, 5])
def test_scripted_outputs_stop_as_the_whole_output_decode_did(tok_model, min_new_tokens):
    """Chosen outputs: characters as byte runs (their U+FFFDs before their last byte), a space at the
    start that the strip removes, special tokens inside byte runs; with min_new_tokens."""
    name, tok, model, cfg = tok_model
    script = tok.encode(SCRIPT, add_special_tokens=False)
    byte_ids = set(tok.convert_tokens_to_ids(BYTES))
    assert len(set(script) & byte_ids) >= 10
    inside = next(i for i in range(1, len(script)) if script[i - 1] in byte_ids and script[i] in byte_ids)
    script = script[:inside] + [tok.convert_tokens_to_ids("<s>")] + script[inside:]  # a special token in a run
    reasons = scripted_stop_reasons(tok, model, cfg, script, STOPS, min_new_tokens)
    assert reasons.count("stop") >= len(STOPS) // 2


def test_stop_string_decode_is_linear_in_the_output_length(tok_model):
    """A long request with a never-matching stop string decodes its whole output once, not per token."""
    name, tok, model, cfg = tok_model
    assert tokens_decoded_for_a_long_request(tok, model, cfg, 600) <= 2 * 600


def slow_ones() -> dict[str, PreTrainedTokenizerFast]:
    """Tokenizers that still decode whole: decoders this module does not follow exactly."""
    metaspace = llama_bpe(decoders.Metaspace(prepend_scheme="first"))
    clean_up = llama_bpe()
    clean_up.clean_up_tokenization_spaces = True
    regex = decoders.Sequence([decoders.Replace(Regex("▁+"), " "), decoders.ByteFallback(), decoders.Fuse()])
    tail_strip = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 1)])
    # Replace after ByteFallback also rewrites the bytes' text ("▁" from E2 96 81)
    reordered = decoders.Sequence([decoders.ByteFallback(), decoders.Replace("▁", " "), decoders.Fuse()])
    no_fuse = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Strip(" ", 1, 0)])
    out = {"metaspace": metaspace, "clean_up": clean_up}
    for name, dec in {"regex": regex, "tail_strip": tail_strip, "reordered": reordered, "no_fuse": no_fuse}.items():
        out[name] = llama_bpe(dec)
    return out


def test_which_tokenizers_take_the_token_by_token_path():
    """The SentencePiece-style decoders (with and without the Strip) follow the text token by token;
    decoders not shown exact here still return None (their requests decode the whole output)."""
    for make in (llama_bpe, gemma_unigram, lambda: llama_bpe(llama_decoder(strip=False))):
        tok = make()
        assert isinstance(text_tail(tok, 3), TextTail)
        assert detokenize.decode_texts(tok, [[5, 6]]) == [decode(tok, [5, 6])]  # still the tokenizers call
        assert not isinstance(detokenize._TABLES[tok], detokenize._PieceTable)
    for name, tok in slow_ones().items():
        assert text_tail(tok, 3) is None, name


def test_a_changed_decoder_rebuilds_the_table():
    """The table belongs to the decoder it was built for: another decoder on the same tokenizer object
    is looked at again (here one that is not followed)."""
    tok = llama_bpe()
    assert text_tail(tok, 1) is not None
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", "_"), decoders.Fuse()])
    tail = text_tail(tok, 1)
    ids = tok.encode(" a b", add_special_tokens=False)
    for t in ids:
        tail.add(t)
    assert tail.tail()[0] == decode(tok, ids)
    tok.backend_tokenizer.decoder = decoders.Metaspace()
    assert text_tail(tok, 1) is None
