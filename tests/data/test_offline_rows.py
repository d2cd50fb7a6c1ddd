"""walk37 #5: an offline recipe tokenizes each dataset row once per run (the same rows come back every epoch),
and a templated reference answer is not encoded a second time on its own. Same ids, same warnings."""

import logging
import types

import pytest

from areno.data import prompts
from areno.data.offline import RenderedRows
from areno.data.prompts import render_completion, render_prompt
from areno.data.tasks import PromptStream
from areno.data.tokenizer import build_char_tokenizer
from areno.engine.api import ArenoEngine, preference_trajectories, sft_trajectories
from areno.engine.config import DataSection
from tests.helpers.templates import r1_tokenizer

ROWS = [{"q": f"{a}+{b}=", "a": f"the sum is {a + b}"} for a, b in [(1, 2), (30, 4), (5, 67), (8, 9)]]
PAIRS = [{"q": "2+2=", "chosen": "4", "rejected": "5"}, {"q": "3+4=", "chosen": "7", "rejected": "seven"}]


def _counting(tok, monkeypatch):
    """``tok`` with its ``encode`` and ``apply_chat_template`` calls counted (the two ways a row is tokenized)."""
    calls = {"encode": 0, "template": 0}
    encode, template = tok.encode, tok.apply_chat_template

    def counted_encode(*args, **kwargs):
        calls["encode"] += 1
        return encode(*args, **kwargs)

    def counted_template(*args, **kwargs):
        calls["template"] += 1
        return template(*args, **kwargs)

    monkeypatch.setattr(tok, "encode", counted_encode)
    monkeypatch.setattr(tok, "apply_chat_template", counted_template)
    return calls


def _offline_engine(tok, rows, *, batch_size, chat_template, pairs=False):
    """Only what ``generate_rollout``'s offline branch reads: no model, no rollout side."""
    engine = object.__new__(ArenoEngine)
    data = DataSection(chat_template=chat_template, prompt_key="q", answer_key="a")
    engine.config = types.SimpleNamespace(rollout=types.SimpleNamespace(batch_size=batch_size), data=data)
    engine.recipe = types.SimpleNamespace(online=False, roles=())
    engine.asynchronous, engine.pairs, engine.reward_fn, engine.rollout, engine.store = False, pairs, None, None, None
    engine.tokenizer = tok
    engine.train_stream = PromptStream(rows, seed=0)
    return engine


def _ids(trajectories):
    return [(t.prompt_ids, t.completion_ids, t.info, t.reward, t.group_id) for t in trajectories]


@pytest.mark.parametrize("chat_template", ["never", "always"])
def test_each_sft_row_is_tokenized_once_over_two_epochs_with_the_same_ids(chat_template, monkeypatch):
    tok = build_char_tokenizer()
    # the reference first, uncounted: each step's rows in the stream's order, rendered afresh
    stream = PromptStream(ROWS, seed=0)
    expected = [sft_trajectories(stream.take(4), tok, "q", "a", chat_template=chat_template) for _ in range(2)]
    engine = _offline_engine(tok, ROWS, batch_size=4, chat_template=chat_template)
    calls = _counting(tok, monkeypatch)
    steps = [engine.generate_rollout(step) for step in range(2)]  # batch = dataset: two epochs
    if chat_template == "never":  # the prompt and the answer once per row (was both again every step)
        assert calls == {"encode": 2 * len(ROWS), "template": 0}
    else:  # the prompt's render and prompt + answer's, once per row; the answer alone never (was once per step)
        assert calls == {"encode": 0, "template": 2 * len(ROWS)}
    for step, want in zip(steps, expected):
        assert _ids(step.trajectories) == _ids(want)
        assert step.metrics["rollout/num_tokens"] == sum(t.num_tokens for t in want)
    if chat_template == "never":  # untemplated: the answer's text and EOS, as before
        for t in steps[1].trajectories:
            answer = next(r["a"] for r in ROWS if r["q"] == t.info["prompt"])
            assert t.completion_ids == tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    # every call hands out lists of its own: a trajectory that changes its ids changes no later step's
    steps[0].trajectories[0].completion_ids.append(-1)
    again = engine.generate_rollout(2).trajectories
    assert _ids(again) == _ids(
        sft_trajectories(PromptStream(ROWS, seed=0).take(12)[8:], tok, "q", "a", chat_template=chat_template)
    )


def test_a_templated_answer_is_not_encoded_on_its_own(monkeypatch):
    tok = build_char_tokenizer()
    prompt_ids = render_prompt(tok, "1+1=", chat_template="always")
    want = render_completion(tok, "1+1=", "2", prompt_ids, chat_template="always")
    calls = _counting(tok, monkeypatch)
    assert render_completion(tok, "1+1=", "2", prompt_ids, chat_template="always") == want
    assert calls == {"encode": 0, "template": 1}  # was one encode of the answer, unused, besides the template


def test_a_template_that_drops_the_answers_text_warns_once_and_trains_the_text_cached(monkeypatch, caplog):
    """The fallback (render_completion's plain ids) still encodes the answer: once per row over the epochs."""
    tok = r1_tokenizer()
    rows = [{"q": f"{i}+1=", "a": f"<think>\n{i}+1\n</think>\n{i + 1}"} for i in range(3)]
    engine = _offline_engine(tok, rows, batch_size=3, chat_template="always")
    prompts._WARNED.discard("render_completion")
    calls = _counting(tok, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="areno.data.prompts"):
        steps = [engine.generate_rollout(step).trajectories for step in range(2)]
    assert caplog.text.count("leaves out some of the answer's text") == 1
    assert calls == {"encode": len(rows), "template": 2 * len(rows)}
    for t in steps[0] + steps[1]:
        answer = next(r["a"] for r in rows if r["q"] == t.info["prompt"])
        assert t.completion_ids == tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]


def test_preference_rows_are_rendered_once_and_paired_by_place_in_the_batch(monkeypatch):
    tok = build_char_tokenizer()
    stream = PromptStream(PAIRS, seed=0)
    expected = [preference_trajectories(stream.take(3), tok, "q", chat_template="always") for _ in range(2)]
    engine = _offline_engine(tok, PAIRS, batch_size=3, chat_template="always", pairs=True)
    calls = _counting(tok, monkeypatch)
    steps = [engine.generate_rollout(step).trajectories for step in range(2)]  # a row drawn twice in a batch
    assert calls == {"encode": 0, "template": 3 * len(PAIRS)}  # the prompt, prompt + chosen, prompt + rejected
    for got, want in zip(steps, expected):
        assert _ids(got) == _ids(want)
        assert [t.group_id for t in got] == ["pair0", "pair0", "pair1", "pair1", "pair2", "pair2"]


def test_a_split_replaced_by_other_rows_is_rendered_anew():
    tok = build_char_tokenizer()
    engine = _offline_engine(tok, ROWS, batch_size=2, chat_template="never")
    first = engine._offline_trajectories("eval", ROWS[:2], [0, 1])
    other = [dict(r, a=r["a"] + "!") for r in ROWS[:2]]
    second = engine._offline_trajectories("eval", other, [0, 1])
    assert _ids(first) == _ids(sft_trajectories(ROWS[:2], tok, "q", "a", chat_template="never"))
    assert _ids(second) == _ids(sft_trajectories(other, tok, "q", "a", chat_template="never"))


def test_rendered_rows_keep_ids_exactly_and_forget_a_failed_render():
    rows = [{"x": 0}, {"x": 1}]
    odd = ([1, 2**40], [[3, None]])  # past int32, a tokenizer's None EOS: kept as given
    assert RenderedRows(rows).ids(0, lambda row: odd) == odd
    cache, renders = RenderedRows(rows), []

    def render(row):
        renders.append(row["x"])
        if len(renders) == 1:
            raise ValueError("a bad row")
        return [row["x"], 5], [[6, 70000]]

    with pytest.raises(ValueError):
        cache.ids(1, render)
    assert len(cache) == 0
    assert cache.ids(1, render) == cache.ids(1, render) == ([1, 5], [[6, 70000]])
    assert renders == [1, 1] and len(cache) == 1
    got = cache.ids(1, render)
    assert all(type(i) is int for i in got[0] + got[1][0])


def test_take_indices_follows_the_same_order_as_take():
    rows = [{"q": str(i)} for i in range(5)]
    a, b = PromptStream(rows, seed=3), PromptStream(rows, seed=3)
    for n in (2, 4, 7):  # across epochs
        assert [b.rows[i] for i in b.take_indices(n)] == a.take(n)
    assert a.state_dict() == b.state_dict()
