"""A user's reward and the rows it meets, checked at preflight: a reward that takes ``answer`` without
a default on rows without ``data.answer_key`` is refused as the shipped ``exact_match`` is (it used to
get ``answer=None`` silently and score 0 on every call); a row field that collides with one of the
reward's arguments names the field and the ``data.*_key`` to set (the error used to suggest the
signature the reward already had); a misspelled reward name gets the closest one; a Python callable
as ``reward.fn`` says why a path is needed."""

from __future__ import annotations

import json

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.errors import DataError, RewardImportError
from areno.rewards.loader import check_reward_signature, reward_function, takes_answer
from tests.helpers.configs import tiny_run_overrides

REWARDS = """
def needs(prompt, completion, answer, **row):
    return 1.0


def optional(prompt, completion, answer=None, **row):
    return 1.0
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    for name, rows in {
        "noanswer": [{"prompt": "2+2=", "ans": "4"}, {"prompt": "1+1=", "ans": "2"}],
        "rows": [{"prompt": "2+2=", "answer": "4"}, {"prompt": "1+1=", "answer": "2"}],
        "both": [{"question": "2+2=", "prompt": "p", "answer": "4"}],
        "trl": [{"prompt": "2+2=", "completion": "4"}],
    }.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _config(path, rows: str, reward: str, *extra: str):
    return load_config(
        None,
        [
            *tiny_run_overrides(path),
            "data.task=null",
            f"data.train_path={path / rows}.jsonl",
            f"reward.fn={path / 'rw.py'}:{reward}",
            "reward.sandbox=false",
            *extra,
        ],
    )


def test_a_reward_that_needs_the_answer_refuses_rows_without_one(files):
    with pytest.raises(DataError) as info:
        check_run(_config(files, "noanswer", "needs"))
    message = str(info.value)
    assert message.startswith(f"{files / 'noanswer.jsonl'} line 1: no field 'answer': the reference answer"), message
    assert "a reward.fn whose answer argument has no default" in message and "set data.answer_key" in message
    check_run(_config(files, "noanswer", "optional"))  # answer=None: it scores without one


def test_takes_answer_reads_the_third_positional_parameter():
    assert takes_answer(lambda prompt, completion, answer, **row: 0.0)
    assert takes_answer(lambda p, c, ref: 0.0)
    assert not takes_answer(lambda prompt, completion, answer=None, **row: 0.0)
    assert not takes_answer(lambda *args, **kwargs: 0.0)
    assert not takes_answer(lambda prompt, completion, **row: 0.0)


@pytest.mark.parametrize(
    ("rows", "extra", "fragment"),
    [
        (
            "rows",
            ["data.answer_key=answr"],
            "the row field 'answer' collides with the reward's argument 'answer', which the workflows fill from the "
            "row's data.answer_key field (data.answer_key='answr', not a field of the rows, whose fields are prompt, "
            "answer): the row's own 'answer' would be a second value for it; set data.answer_key=answer, or rename "
            "the row field",
        ),
        (
            "both",
            ["data.prompt_key=question"],
            "the row field 'prompt' collides with the reward's argument 'prompt', which the workflows fill from the "
            "row's data.prompt_key field (data.prompt_key='question'): the row's own 'prompt' would be a second value "
            "for it; set data.prompt_key=prompt, or rename the row field",
        ),
        ("trl", [], "to score against it, set data.answer_key=completion"),
    ],
)
def test_a_row_field_that_collides_with_an_argument_names_the_data_key(files, rows, extra, fragment):
    with pytest.raises(RewardImportError) as info:
        check_run(_config(files, rows, "optional", *extra))
    message = str(info.value)
    assert message.startswith(f"reward.fn: {files / 'rw.py'}:optional: the row field ") and fragment in message, message
    assert "make it take" not in message and "\n" not in message


def test_a_renamed_parameter_still_gets_the_signature_advice():
    def renamed(p, c, a, **row):
        return 1.0

    with pytest.raises(RewardImportError, match=r"make it take \(prompt, completion, answer, \*\*row\)"):
        check_reward_signature(renamed, "m:f", ["p"])


def test_a_misspelled_reward_gets_the_closest_name(files):
    with pytest.raises(RewardImportError, match=rf"has no attribute 'neds' \(did you mean {files / 'rw.py'}:needs\?\)"):
        reward_function(f"{files / 'rw.py'}:neds")


def test_a_callable_as_reward_fn_says_why_a_path_is_needed():
    def score(prompt, completion, answer, **row):
        return 1.0

    with pytest.raises(RewardImportError) as info:
        reward_function(score)
    message = str(info.value)
    assert message.startswith("reward.fn: must be a 'module:function' or './file.py:function' path, got <function")
    assert "sandbox processes, which import it by path" in message
