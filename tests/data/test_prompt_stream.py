"""The order ``PromptStream`` hands training rows out in: seeds, versions of the ordering rule, resume."""

from __future__ import annotations

import pytest

from areno.data.tasks import PromptStream
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
