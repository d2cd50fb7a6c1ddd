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
