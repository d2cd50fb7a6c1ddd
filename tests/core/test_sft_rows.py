"""Rows that cannot give the answer a supervised recipe trains on, or an answer-scoring reward scores
against, are refused at load with one line naming the file, the line, the field and the fix: a null or
empty answer, TRL's ``completion`` field under another ``data.answer_key``, TRL's ``messages`` rows."""

from __future__ import annotations

import json

import pytest

from areno.api.config import DataSection
from areno.data.datasets import build_splits, load_rows
from areno.errors import DataError


def _file(tmp_path, rows: list[dict]):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "answer, said",
    [
        (None, "'answer' is null: give the row its reference answer, or remove the row"),
        ("", "'answer' is empty"),
        ("  ", "'answer' is empty"),
        ([{"role": "assistant", "content": ""}], "'answer' is empty"),
    ],
)
def test_a_null_or_empty_answer_is_refused_where_one_is_needed(tmp_path, answer, said):
    path = _file(tmp_path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": answer}])
    with pytest.raises(DataError) as info:
        load_rows(path, prompt_key="prompt", answer_key="answer")
    assert str(info.value).startswith(f"{path} line 2: {said}")
    assert "\n" not in str(info.value)
    assert len(load_rows(path, prompt_key="prompt")) == 2  # an RL reward may not read the answer


def test_numbers_and_conversational_answers_are_answers(tmp_path):
    rows = [{"prompt": "0+0=", "answer": 0}, {"prompt": "3+4=", "answer": [{"role": "assistant", "content": "7"}]}]
    assert load_rows(_file(tmp_path, rows), prompt_key="prompt", answer_key="answer") == rows


def test_trl_completion_rows_name_the_answer_key_to_set(tmp_path):
    path = _file(tmp_path, [{"prompt": "1+1=", "completion": "2"}])
    with pytest.raises(
        DataError, match=r"line 1: no field 'answer' but a 'completion' .*set data.answer_key=completion$"
    ):
        build_splits(DataSection(task=None, train_path=str(path)), need_answers=True)
    train, _ = build_splits(DataSection(task=None, train_path=str(path), answer_key="completion"), need_answers=True)
    assert train == [{"prompt": "1+1=", "completion": "2"}]
