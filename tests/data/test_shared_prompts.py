"""Held-out prompts that are also training prompts are named once at start-up."""

from __future__ import annotations

import json
import logging

from areno.data.datasets import build_splits
from areno.engine.config import DataSection


def _write(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in prompts))
    return str(path)


def test_shared_held_out_prompts_are_one_warning_naming_both_files_and_the_count(tmp_path, caplog):
    train = _write(tmp_path / "train.jsonl", [f"q{i}" for i in range(10)])
    held = _write(tmp_path / "held.jsonl", ["q3", "q7", "new", "q9"])
    data = DataSection(task=None, train_path=train, eval_path=held, num_eval=3)  # q9 is not evaluated
    with caplog.at_level(logging.WARNING, logger="areno.data.datasets"):
        build_splits(data)
        build_splits(data)  # preflight and the engine both read the files: told once
    said = [r.getMessage() for r in caplog.records if "held-out prompts" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0]
    assert f"data.eval_path {held}: 2 of its 3 held-out prompts" in said[0] and train in said[0]


def test_disjoint_files_say_nothing(tmp_path, caplog):
    train = _write(tmp_path / "train.jsonl", ["a", "b"])
    held = _write(tmp_path / "held.jsonl", ["c"])
    with caplog.at_level(logging.WARNING, logger="areno.data.datasets"):
        build_splits(DataSection(task=None, train_path=train, eval_path=held))
    assert not [r for r in caplog.records if "held-out prompts" in r.getMessage()]


def test_preference_rows_are_shared_only_as_whole_pairs(tmp_path, caplog):
    """walk40: one prompt with other completions is another pair; it was told as trained on (the shipped
    reward-model example warned about two such pairs)."""

    def pairs(path, rows):
        path.write_text("".join(json.dumps(dict(zip(("prompt", "chosen", "rejected"), r))) + "\n" for r in rows))
        return str(path)

    train = pairs(tmp_path / "train.jsonl", [("1+2=", "3", "4"), ("5+4=", "9", "54")])
    held = pairs(tmp_path / "held.jsonl", [("1+2=", "3", "12"), ("5+4=", "9", "54")])
    with caplog.at_level(logging.WARNING, logger="areno.data.datasets"):
        build_splits(DataSection(task=None, train_path=train, eval_path=held), pairs=True)
    said = [r.getMessage() for r in caplog.records if "held-out pairs" in r.getMessage()]
    assert len(said) == 1 and f"data.eval_path {held}: 1 of its 2 held-out pairs are also training pairs" in said[0]
