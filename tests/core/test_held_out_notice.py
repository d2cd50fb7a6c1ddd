"""A run with no held-out rows says at start, in one line, that nothing is evaluated and how to turn
evaluation on (it used to show only as ``accuracy_before: null``)."""

from __future__ import annotations

import json
import logging

import pytest

from areno.api import preflight
from areno.api.config import load_config
from areno.api.preflight import check_run
from tests.helpers.configs import tiny_run_overrides


@pytest.fixture(autouse=True)
def _nothing_said_yet(monkeypatch):
    # said once per process: another test's run with the same data settings must not silence it here
    monkeypatch.setattr(preflight, "_HELD_OUT_OFF_SAID", set())


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "held-out evaluation is off" in r.getMessage()]


def test_no_eval_file_says_evaluation_is_off_once(tmp_path, caplog):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), "data.task=null", f"data.train_path={rows}"])
    with caplog.at_level(logging.INFO, logger="areno.api.preflight"):
        check_run(cfg)
        check_run(cfg)  # the pipeline's check, then Trainer.init's: one line
    assert _said(caplog) == [
        "held-out evaluation is off (data.task is null and data.eval_path is unset): nothing logs eval/*; "
        "set data.eval_path to a file of held-out rows to turn it on"
    ]


def test_num_eval_zero_says_so_and_held_out_rows_say_nothing(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="areno.api.preflight"):
        check_run(load_config(None, [*tiny_run_overrides(tmp_path, num_eval=4)]))
        assert _said(caplog) == []
        check_run(load_config(None, [*tiny_run_overrides(tmp_path, num_eval=0)]))
    assert _said(caplog) == [
        "held-out evaluation is off (data.num_eval=0): nothing logs eval/*; set data.num_eval > 0 to turn it on"
    ]
