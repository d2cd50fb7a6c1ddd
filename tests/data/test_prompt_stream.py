"""The order ``PromptStream`` hands training rows out in: seeds, versions of the ordering rule, resume."""

from __future__ import annotations

import pytest

from areno.data.tasks import PromptStream
from areno.engine.ledger import SampleLedger
from areno.errors import DataError

ROWS = [{"prompt": f"q{i}"} for i in range(10)]


def _prompts(stream: PromptStream, n: int) -> list[str]:
    return [r["prompt"] for r in stream.take(n)]


@pytest.mark.parametrize("seed", [1, 2, 7])
def test_a_negative_data_seed_has_an_order_of_its_own(seed):
    # an int seeds random.Random by its absolute value: -s shuffled the first epoch as s did
    assert _prompts(PromptStream(ROWS, seed=seed), 10) != _prompts(PromptStream(ROWS, seed=-seed), 10)
    assert _prompts(PromptStream(ROWS, seed=-seed), 30) == _prompts(PromptStream(ROWS, seed=-seed), 30)


def test_a_checkpoint_without_a_version_resumes_in_its_own_order():
    """A cursor saved by an older areno (no ``version``) goes on in the order it was drawing: the
    old rule, ``Random(seed * 1_000_003 + epoch)``, through later epochs too."""
    import random

    old_state = {"epoch": 1, "position": 3, "rows": len(ROWS), "fingerprint": PromptStream(ROWS, seed=5).fingerprint}
    stream = PromptStream(ROWS, seed=5)
    stream.load_state_dict(old_state)
    epochs = []
    for epoch in (1, 2):
        order = list(range(len(ROWS)))
        random.Random(5 * 1_000_003 + epoch).shuffle(order)
        epochs += [ROWS[i]["prompt"] for i in order]
    assert _prompts(stream, 17) == epochs[3:20]
    assert stream.state_dict()["version"] == 1  # its next checkpoint keeps the old rule


def test_a_cursor_resumes_exactly_and_an_unknown_version_is_one_line():
    a = PromptStream(ROWS, seed=3)
    a.take(13)
    state = a.state_dict()
    b = PromptStream(ROWS, seed=3)
    b.load_state_dict(state)
    assert _prompts(a, 25) == _prompts(b, 25)
    with pytest.raises(DataError, match="rule 99") as err:
        PromptStream(ROWS, seed=3).load_state_dict({**state, "version": 99})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("rows", "batch_size"), [(10, 4), (10, 7), (10, 10), (7, 3), (1000, 64), (5, 5)])
def test_no_batch_holds_a_row_twice_and_every_epoch_holds_each_row_once(rows, batch_size):
    data = [{"prompt": i} for i in range(rows)]
    for seed in range(20):
        stream = PromptStream(data, seed=seed, batch_size=batch_size)
        drawn = [r["prompt"] for r in stream.take(batch_size * (3 * rows // batch_size + 2))]
        batches = [drawn[i : i + batch_size] for i in range(0, len(drawn), batch_size)]
        assert all(len(set(b)) == len(b) for b in batches), (seed, batches)
        epochs = [drawn[i : i + rows] for i in range(0, len(drawn) - rows + 1, rows)]
        assert all(sorted(e) == list(range(rows)) for e in epochs)


def test_rows_drawn_one_by_one_follow_the_same_batches():
    """The rollout ledger takes one row at a time: the batches are counted from the stream's start."""
    whole = PromptStream(ROWS, seed=4, batch_size=4)
    single = PromptStream(ROWS, seed=4, batch_size=4)
    assert _prompts(whole, 4 * 9) == [p for _ in range(4 * 9) for p in _prompts(single, 1)]


@pytest.mark.parametrize("stop", [7, 9, 10, 11, 12, 21])
def test_a_resumed_stream_keeps_the_batches_of_an_uninterrupted_one(stop):
    """Stopped anywhere (inside a straddling batch, at an epoch's end, just after one), a stream restored
    from its state hands out what the uninterrupted one does, its deferred rows included."""
    whole = PromptStream(ROWS, seed=2, batch_size=4)
    expected = _prompts(whole, 40)
    first = PromptStream(ROWS, seed=2, batch_size=4)
    head = _prompts(first, stop)
    resumed = PromptStream(ROWS, seed=2, batch_size=4)
    resumed.load_state_dict(first.state_dict())
    assert head + _prompts(resumed, 40 - stop) == expected


def test_each_stage_has_its_own_order_and_a_resume_keeps_the_checkpoints():
    rows = [{"prompt": i} for i in range(1000)]
    warm, main = PromptStream(rows, seed=0), PromptStream(rows, seed=0, stage="after_warm_start")
    assert len(set(_prompts(warm, 64)) & set(_prompts(main, 64))) < 16  # independent draws: ~4 shared
    state = main.state_dict()
    resumed = PromptStream(rows, seed=0)  # a run whose warm_start.steps changed on resume
    resumed.load_state_dict(state)
    assert _prompts(resumed, 2000) == _prompts(main, 2000)


def _steps(stream: PromptStream, rounds: list[list[int]]) -> list[list[int]]:
    """The rows of synchronous steps of several rounds each (dynamic sampling's), ``rounds[i]`` step i's."""
    steps = []
    for sizes in rounds:
        stream.begin_batch()
        steps.append([r["prompt"] for n in sizes for r in stream.take(n)])
    return steps


STEP_ROUNDS = [[2, 1], [2, 2], [2, 3], [2], [2, 2, 1], [2, 1]]
"""Steps of batch_size 2 that dynamic sampling made 1-5 rows long: their epochs straddle anywhere."""


def test_a_step_of_several_rounds_holds_no_row_twice_and_every_epoch_each_row_once():
    data = [{"prompt": i} for i in range(5)]
    for seed in range(30):
        stream = PromptStream(data, seed=seed, batch_size=2)
        steps = _steps(stream, STEP_ROUNDS)
        assert all(len(set(s)) == len(s) for s in steps), (seed, steps)
        drawn = [r for s in steps for r in s]
        assert all(sorted(drawn[i : i + 5]) == list(range(5)) for i in range(0, len(drawn) - 4, 5)), (seed, drawn)
    # a step longer than the rows holds one twice: the rows allow no better
    longer = PromptStream(data[:3], seed=0, batch_size=2)
    (step,) = _steps(longer, [[2, 2, 1]])
    assert len(step) == 5 and set(step) == {0, 1, 2}


def test_the_ledger_marks_a_synchronous_steps_rows_as_one_batch():
    data = [{"prompt": i} for i in range(5)]
    for seed in range(30):
        stream = PromptStream(data, seed=seed, batch_size=2)
        ledger = SampleLedger(stream)
        for sizes in STEP_ROUNDS:
            ledger.begin_step()
            step = [s["prompt"] for n in sizes for s in ledger.take(n)]
            assert len(set(step)) == len(step), (seed, step)


def test_a_rule_2_cursor_keeps_its_order_under_marked_batches():
    """A checkpoint of rule 2 resumes in the order that rule gives, which counts batches of batch_size rows
    from the stream's start: a longer step may hold a row twice there."""
    data = [{"prompt": i} for i in range(5)]
    repeats = 0
    for seed in range(30):
        old = PromptStream(data, seed=seed, batch_size=2)
        old.load_state_dict({**old.state_dict(), "version": 2})
        unmarked = PromptStream(data, seed=seed, batch_size=2)
        unmarked.load_state_dict({**unmarked.state_dict(), "version": 2})
        steps = _steps(old, STEP_ROUNDS)
        assert [r for s in steps for r in s] == _prompts(unmarked, sum(map(sum, STEP_ROUNDS)))
        repeats += sum(len(set(s)) < len(s) for s in steps)
        assert old.state_dict()["version"] == 2
    assert repeats > 0  # what rule 3 fixes


def test_a_stream_resumed_between_marked_steps_goes_on_as_the_uninterrupted_one():
    data = [{"prompt": i} for i in range(5)]
    whole = _steps(PromptStream(data, seed=3, batch_size=2), STEP_ROUNDS)
    for stop in range(1, len(STEP_ROUNDS)):
        first = PromptStream(data, seed=3, batch_size=2)
        head = _steps(first, STEP_ROUNDS[:stop])
        resumed = PromptStream(data, seed=3, batch_size=2)
        resumed.load_state_dict(first.state_dict())
        assert head + _steps(resumed, STEP_ROUNDS[stop:]) == whole, stop
