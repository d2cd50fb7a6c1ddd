"""Stop strings decoded token by token (walk37 #2): the engine follows each output's text through a
``TextTail`` (one token's piece a step) and searches only its new end, where it decoded the whole
output after every token and searched it from ``stop_from``. The outputs (stop position, text, finish
reason) must be exactly the old ones, for the char tokenizer, a ByteLevel BPE whose multi-byte
characters are split across tokens, and tokenizers whose text only a whole decode gives."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from areno.data.detokenize import text_tail
from areno.data.tokenizer import build_char_tokenizer
from areno.models.decoder import Decoder
from areno.models.hf_io import tiny_config
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams

EOS = 2
CORPUS = [
    "naïve café déjà vu, 漢字と仮名 🙂🙃 ünïcödé — «quotes» ½ ∑ ∞",
    "the quick brown fox jumps over the lazy dog. Ça va? Grüße aus Köln!",
    "def f(x):\n    return x * 2  # 函数 😀 ok",
]


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


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok_model(request):
    tok = TOKENIZERS[request.param]()
    # a few ids past the tokenizer's vocabulary, as a model's padded rows (decoded as nothing)
    cfg = tiny_config(len(tok) + 3, hidden_size=32, layers=1, heads=4, kv_heads=2, max_position_embeddings=1024)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Decoder(cfg).eval()
    return request.param, tok, model, cfg


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def old_outcome(tok, params: SamplingParams, output_ids: list[int]) -> tuple[int, str, str] | None:
    """The engine's stop rule as it was: after every token the whole output decoded, ``stop_from``
    once at ``min_new_tokens``, each stop string searched for from ``stop_from - len(s) + 1``.
    (tokens, finish reason, text) of the first prefix of ``output_ids`` that ends the request."""
    stop_from = None
    for n in range(1, len(output_ids) + 1):
        out = output_ids[:n]
        if stop_from is None and n >= params.min_new_tokens:
            stop_from = len(decode(tok, out[: max(params.min_new_tokens - 1, 0)]))
        text = decode(tok, out)
        if n >= params.min_new_tokens:
            if out[-1] in params.stop_token_ids or (not params.ignore_eos and out[-1] == EOS):
                return n, "stop", text
            found = [text.find(s, max((stop_from or 0) - len(s) + 1, 0)) for s in params.stop]
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                return n, "stop", text[:cut]
        if n >= params.max_new_tokens:
            return n, "length", text
    return None


def make_engine(model, cfg, tok, decode_steps: int) -> RolloutEngine:
    config = RolloutEngineConfig(block_size=8, num_blocks=512, max_num_seqs=16, decode_steps=decode_steps)
    return RolloutEngine(model, cfg, config=config, eos_token_ids=(EOS,), tokenizer=tok)


def stop_cases(text: str, base: SamplingParams) -> list[SamplingParams]:
    """Stop-string requests cut from a free run's ``text`` (seeded: the same tokens up to a stop)."""
    n = len(text)
    mid, late = n // 3, (2 * n) // 3
    rep = lambda **kw: SamplingParams(**{**base.__dict__, **kw})
    return [
        rep(stop=(text[mid : mid + 3],)),  # spans token boundaries
        rep(stop=(text[late : late + 6], text[mid + 1 : mid + 2], text[late - 2 : late])),  # lengths 6, 1, 2
        rep(stop=(text[:2],)),  # matches at the very start: the text is cut to ""
        rep(stop=(text[:1], "\x00never\x00")),
        rep(stop=(text[mid : mid + 2],), min_new_tokens=mid // 2 + 2),  # stop_from: an early one does not count
        rep(stop=(text[1:3], text[mid : mid + 4]), min_new_tokens=3),  # straddles stop_from
        rep(stop=("\x00never\x00",)),  # runs to its length
        rep(stop=(text[late : late + 2],), ignore_eos=False, min_new_tokens=4),
        rep(stop=("\ufffd",)),  # the U+FFFD of a character's first bytes, as the whole decode had it
    ]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_stop_strings_end_requests_as_the_whole_output_decode_did(tok_model, decode_steps):
    name, tok, model, cfg = tok_model
    assert (text_tail(tok, 0) is not None) == (name in ("char", "bpe", "metaspace"))  # clean_up decodes whole
    eng = make_engine(model, cfg, tok, decode_steps)
    base = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True)
    prompts = [[5 + i, 6 + i, 7] for i in range(4)]
    seeded = [SamplingParams(**{**base.__dict__, "seed": 100 + i}) for i in range(len(prompts))]
    free = eng.generate(prompts, seeded)
    params, ps = [], []
    for prompt, p, out in zip(prompts, seeded, free):
        assert out.text == decode(tok, out.output_ids)
        for case in stop_cases(out.text, p):
            params.append(case)
            ps.append(prompt)
    outs = eng.generate(ps, params)
    reasons, texts = [], []
    for p, out in zip(params, outs):
        want = old_outcome(tok, p, out.output_ids)
        assert want is not None
        n, reason, text = want
        assert (len(out.output_ids), out.finish_reason, out.text) == (n, reason, text), p.stop
        reasons.append(reason)
        texts.append(text)
    # the cases did what they are there for: stops, a cut at the very start, length
    assert reasons.count("stop") >= len(outs) // 2 and "length" in reasons and "" in texts


def scripted(eng: RolloutEngine, script: list[int]) -> None:
    """The engine's next greedy token is the script's next one (one request at a time)."""
    it = iter(script)
    vocab = eng._stepper.vocab_size

    def logits(hidden_BD: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(hidden_BD.shape[0], vocab)
        for b in range(hidden_BD.shape[0]):
            out[b, next(it, 0)] = 50.0
        return out

    eng._stepper.logits = logits


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
    script = make_script(tok)
    reasons = []
    for stop in stops:
        eng = make_engine(model, cfg, tok, decode_steps=1)
        scripted(eng, script)
        p = SamplingParams(temperature=0.0, max_new_tokens=len(script), min_new_tokens=min_new_tokens, stop=stop)
        out = eng.generate([[5, 6, 7]], p)[0]
        assert out.output_ids == script[: len(out.output_ids)]
        n, reason, text = old_outcome(tok, p, script)
        assert (len(out.output_ids), out.finish_reason, out.text) == (n, reason, text), stop
        reasons.append(reason)
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
                whole = decode(tok, ids)
                assert whole.startswith(settled_text)
                assert tail.settled <= len(whole) and len(whole) - tail.settled <= 3  # a character's bytes at most
                text, offset = tail.tail()
                assert text == whole[offset:] and offset == max(tail.searched - keep, 0)
                settled_text = whole[: tail.settled]
                if rng.random() < 0.7:
                    tail.mark()


def test_stop_string_decode_is_linear_in_the_output_length(tok_model):
    """A long request with a stop string that never matches passes each token to the tokenizer's decode
    a bounded number of times (it was the whole output after every token: L^2 / 2)."""
    name, tok, model, cfg = tok_model
    if name not in ("char", "bpe", "metaspace"):
        pytest.skip("a tokenizer only a whole decode gives the text of decodes the whole output per token")
    eng = make_engine(model, cfg, tok, decode_steps=1)
    decoded = []
    real = tok.decode
    tok.decode = lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw)
    try:
        L = 600
        p = SamplingParams(temperature=1.0, max_new_tokens=L, ignore_eos=True, seed=3, stop=("\x00never\x00",))
        out = eng.generate([[5, 6, 7]], p)[0]
    finally:
        del tok.decode
    assert len(out.output_ids) == L and out.finish_reason == "length"
    assert out.text == decode(tok, out.output_ids)
    assert sum(decoded) <= 2 * L, decoded  # the whole output once at the end (the old path: 180,300)
