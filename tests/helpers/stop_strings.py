"""Stop strings in the rollout engine against the rule they replaced (a whole decode of the output after
every token): a tiny engine, the old rule, and stop-string requests cut from a free run's text."""

from __future__ import annotations

import pytest
import torch

from areno.data.detokenize import text_tail
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams

EOS = 2
CORPUS = [
    "naïve café déjà vu, 漢字と仮名 🙂🙃 ünïcödé — «quotes» ½ ∑ ∞",
    "the quick brown fox jumps over the lazy dog. Ça va? Grüße aus Köln!",
    "def f(x):\n    return x * 2  # 函数 😀 ok",
]


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


def tiny_model_for(tok) -> tuple[torch.nn.Module, object]:
    """A one-layer random model over ``tok``'s vocabulary and a few ids past it (a model's padded rows,
    decoded as nothing)."""
    from areno.models.decoder import Decoder
    from areno.models.hf_io import tiny_config

    cfg = tiny_config(len(tok) + 3, hidden_size=32, layers=1, heads=4, kv_heads=2, max_position_embeddings=1024)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Decoder(cfg).eval()
    return model, cfg


def cut_stop_outcomes(tok, model, cfg, decode_steps: int) -> list[tuple[int, str, str]]:
    """Stop strings cut from four seeded free runs' text (``stop_cases``): each request's (tokens, finish
    reason, text) is asserted equal to the whole-decode rule's; returns them."""
    eng = make_engine(model, cfg, tok, decode_steps)
    base = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True)
    prompts = [[5 + i, 6 + i, 7] for i in range(4)]
    seeded = [SamplingParams(**{**base.__dict__, "seed": 100 + i}) for i in range(len(prompts))]
    params, ps = [], []
    for prompt, p, out in zip(prompts, seeded, eng.generate(prompts, seeded)):
        assert out.text == decode(tok, out.output_ids)
        for case in stop_cases(out.text, p):
            params.append(case)
            ps.append(prompt)
    outcomes = []
    for p, out in zip(params, eng.generate(ps, params)):
        want = old_outcome(tok, p, out.output_ids)
        assert want is not None
        assert (len(out.output_ids), out.finish_reason, out.text) == want, p.stop
        outcomes.append(want)
    return outcomes


def scripted_stop_reasons(tok, model, cfg, script: list[int], stops, min_new_tokens: int) -> list[str]:
    """``script`` generated greedily once per stop-string set of ``stops``: each outcome asserted equal to the
    whole-decode rule's; returns the finish reasons."""
    reasons = []
    for stop in stops:
        eng = make_engine(model, cfg, tok, decode_steps=1)
        scripted(eng, script)
        p = SamplingParams(temperature=0.0, max_new_tokens=len(script), min_new_tokens=min_new_tokens, stop=stop)
        out = eng.generate([[5, 6, 7]], p)[0]
        assert out.output_ids == script[: len(out.output_ids)]
        want = old_outcome(tok, p, script)
        assert (len(out.output_ids), out.finish_reason, out.text) == want, stop
        reasons.append(want[1])
    return reasons


def tokens_decoded_for_a_long_request(tok, model, cfg, length: int = 600) -> int:
    """Tokens passed to ``tok.decode`` while one request of ``length`` tokens with a never-matching stop
    string runs (its text asserted to be the whole decode's)."""
    eng = make_engine(model, cfg, tok, decode_steps=1)
    decoded = []
    real = tok.decode
    tok.decode = lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw)
    try:
        p = SamplingParams(temperature=1.0, max_new_tokens=length, ignore_eos=True, seed=3, stop=("\x00never\x00",))
        out = eng.generate([[5, 6, 7]], p)[0]
    finally:
        del tok.decode
    assert len(out.output_ids) == length and out.finish_reason == "length"
    assert out.text == decode(tok, out.output_ids)
    return sum(decoded)


def tok_model_fixture(tokenizers: dict, names: list[str] | None = None):
    """A module-scoped ``tok_model`` fixture over ``names`` (default: all) of ``tokenizers`` (name -> builder):
    (name, tokenizer, tiny model, its config)."""

    @pytest.fixture(scope="module", params=list(tokenizers) if names is None else names)
    def tok_model(request):
        tok = tokenizers[request.param]()
        return (request.param, tok, *tiny_model_for(tok))

    return tok_model


def free_run_stop_outcomes(tok, model, cfg, decode_steps: int) -> list[tuple[int, str, str]]:
    """``cut_stop_outcomes``, asserted to hold stops (at least half) and a length end."""
    outcomes = cut_stop_outcomes(tok, model, cfg, decode_steps)
    reasons = [o[1] for o in outcomes]
    assert reasons.count("stop") >= len(outcomes) // 2 and "length" in reasons
    return outcomes


def checked_tail(tok, tail, ids: list[int], keep: int, settled_text: str) -> str:
    """After ``tail`` followed ``ids``: the whole decode extends the text settled before, the tail settled no
    more than it, and (text, offset) is its end from ``keep`` characters before the search point. The whole
    decode."""
    whole = decode(tok, ids)
    assert whole.startswith(settled_text)
    assert tail.settled <= len(whole)
    text, offset = tail.tail()
    assert text == whole[offset:] and offset == max(tail.searched - keep, 0), ids
    return whole


def check_every_prefix_of_triples(tok, ids: list[int], keep: int = 2) -> None:
    """For each triple (a, b, c) of ``ids``, the tail after every prefix of a, b, c, a is the whole decode's."""
    for a in ids:
        for b in ids:
            for c in ids:
                tail = text_tail(tok, keep)
                for k, t in enumerate((a, b, c, a)):
                    tail.add(t)
                    assert tail.tail()[0] == decode(tok, [a, b, c, a][: k + 1]), [a, b, c, a][: k + 1]
