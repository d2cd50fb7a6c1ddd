"""Data and model settings a user gets wrong, said at start-up in one line naming the key: a
``model.path`` that is a file, a missing data file (which of data.train_path / data.eval_path),
``model.init_tiny`` keys and types, ``data.task_kwargs`` typos; and what was silent: no held-out rows
(a warning, which a script without logging configured still shows), a ``rollout.batch_size`` larger
than the training file, a ``data.num_eval`` above the held-out file's rows."""

from __future__ import annotations

import json
import logging

import pytest

from areno.api import preflight
from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.data.tasks import TaskSpec
from areno.errors import ConfigError, DataError, ModelDirError
from tests.helpers.configs import tiny_run_overrides


@pytest.fixture(autouse=True)
def _nothing_said_yet(monkeypatch):
    # each notice is said once per process: another test's run with the same settings must not silence it
    monkeypatch.setattr(preflight, "_HELD_OUT_OFF_SAID", set())
    monkeypatch.setattr(preflight, "_ROWS_SAID", set())


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    return path


def _config(tmp_path, *extra: str):
    return load_config(None, [*tiny_run_overrides(tmp_path), "reward.sandbox=false", *extra])


@pytest.mark.parametrize(
    ("extra", "fix"),
    [
        ([], "point model.path at a new directory for the tiny model, or at a Hugging Face checkpoint directory"),
        (["model.init_tiny=null"], "point it at a Hugging Face checkpoint directory (config.json, *.safetensors"),
    ],
    ids=["init_tiny", "load"],
)
def test_model_path_that_is_a_file_says_so(tmp_path, rows, extra, fix):
    with pytest.raises(ModelDirError) as info:
        check_run(_config(tmp_path, f"model.path={rows}", *extra))
    assert str(info.value).startswith(f"model.path: {rows} is a file, not a directory: {fix}"), str(info.value)


@pytest.mark.parametrize("key", ["data.train_path", "data.eval_path"])
def test_a_missing_data_file_names_its_key(tmp_path, rows, key):
    paths = {"data.train_path": rows, "data.eval_path": rows, key: tmp_path / "nope.jsonl"}
    with pytest.raises(DataError) as info:
        check_run(_config(tmp_path, "data.task=null", *(f"{k}={v}" for k, v in paths.items())))
    assert str(info.value) == (
        f"{key}: dataset file {tmp_path / 'nope.jsonl'} does not exist: set {key} to a .jsonl, .json or .parquet file"
    )


@pytest.mark.parametrize(
    ("init_tiny", "message"),
    [
        ("{hidden: 32}", "model.init_tiny: unknown key 'hidden' (did you mean 'hidden_size'?); valid keys: arch, "),
        ("{hidden_size: '32', layers: 1}", "model.init_tiny.hidden_size: must be an integer, got '32'"),
        ("{vocab_size: 300}", "model.init_tiny.vocab_size: the model's vocabulary is the tokenizer's"),
    ],
)
def test_init_tiny_keys_and_types_are_named(tmp_path, init_tiny, message):
    with pytest.raises(ConfigError) as info:
        check_run(_config(tmp_path, f"model.init_tiny={init_tiny}"))
    assert str(info.value).startswith(message), str(info.value)


def test_task_kwargs_list_the_tasks_arguments():
    with pytest.raises(ConfigError) as info:
        TaskSpec(name="sort", kwargs={"min_lenn": 3})
    assert str(info.value) == (
        "data.task_kwargs: task 'sort' takes no argument 'min_lenn' (did you mean 'min_len'?); it takes min_len, max_len"
    )
    with pytest.raises(ConfigError, match=r"^data\.task_kwargs\.max_len: must be an integer, got '6'$"):
        TaskSpec(name="sort", kwargs={"max_len": "6"})
    with pytest.raises(ConfigError, match=r"unknown task 'sorting' \(did you mean 'sort'\?\)"):
        TaskSpec(name="sorting", kwargs={})


def _said(caplog, fragment: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if fragment in r.getMessage()]


def test_a_train_file_without_held_out_rows_is_a_warning(tmp_path, rows, caplog):
    with caplog.at_level(logging.INFO, logger="areno.api.preflight"):
        check_run(_config(tmp_path, "data.task=null", f"data.train_path={rows}"))
    assert _said(caplog, "held-out evaluation is off") == [
        (
            logging.WARNING,
            "held-out evaluation is off (data.task is null and data.eval_path is unset): nothing logs eval/*; "
            "set data.eval_path to a file of held-out rows to turn it on",
        )
    ]


def test_rows_fewer_than_a_batch_or_num_eval_are_said_once(tmp_path, rows, caplog):
    cfg = _config(
        tmp_path,
        "data.task=null",
        f"data.train_path={rows}",
        f"data.eval_path={rows}",
        "data.num_eval=100",
        "rollout.batch_size=12",
    )
    with caplog.at_level(logging.INFO, logger="areno.api.preflight"):
        check_run(cfg)
        check_run(cfg)  # the pipeline's check, then Trainer.init's: one line each
    assert _said(caplog, "rollout.batch_size") == [
        (
            logging.WARNING,
            "rollout.batch_size=12 is larger than data.train_path's 3 rows: every batch holds some rows more than once "
            "(each about 4 times); lower rollout.batch_size to 3 or less, or add rows",
        )
    ]
    assert _said(caplog, "data.num_eval") == [
        (logging.INFO, f"data.num_eval=100 but data.eval_path ({rows}) has 3 rows: all 3 are evaluated")
    ]


def test_rows_enough_for_a_batch_say_nothing(tmp_path, rows, caplog):
    with caplog.at_level(logging.INFO, logger="areno.api.preflight"):
        check_run(
            _config(tmp_path, "data.task=null", f"data.train_path={rows}", f"data.eval_path={rows}", "data.num_eval=3")
        )
    assert _said(caplog, "rollout.batch_size") == _said(caplog, "data.num_eval") == []


def test_a_file_saved_with_a_byte_order_mark_reads(tmp_path):
    """walk31: some editors save UTF-8 with a BOM, which was a JSON error on line 1."""
    from areno.data.datasets import load_rows

    for name, text in (
        ("rows.jsonl", '{"prompt": "1+1=", "answer": "2"}\n'),
        ("rows.json", '[{"prompt": "1+1=", "answer": "2"}]'),
    ):
        path = tmp_path / name
        path.write_text("\ufeff" + text, encoding="utf-8")
        assert load_rows(path, prompt_key="prompt") == [{"prompt": "1+1=", "answer": "2"}]
