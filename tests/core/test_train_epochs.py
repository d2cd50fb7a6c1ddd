"""``train.epochs``: a run's length in passes over its training rows, counted into ``train.steps`` when the run
reads its data, refused beside ``train.steps``; and ``rollout/epoch``, the passes drawn."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from areno.api.config import checked_config, load_config
from areno.engine.config import DEFAULT_TRAIN_STEPS, ArenoConfig, ModelSection, TrainSection, total_optimizer_steps
from areno.errors import ConfigError
from tests.helpers.configs import run_to_end, tiny_run_overrides


def _rows(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


def _file_config(tmp_path: Path, train: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {tmp_path / 'model'}}}\nrollout: {{batch_size: 4}}\ntrain: {train}\n")
    return path


def test_epochs_count_the_steps_from_the_rows_the_run_reads(tmp_path, caplog):
    rows = _rows(tmp_path, 10)
    cfg = load_config(
        None,
        [
            f"model.path={tmp_path}",
            "data.task=null",
            f"data.train_path={rows}",
            "rollout.batch_size=4",
            "train.epochs=2",
        ],
    )
    assert (cfg.train.steps, cfg.train.epochs) == (None, 2)
    with pytest.raises(ValueError, match="checked_config counts the steps"):
        total_optimizer_steps(cfg)
    with caplog.at_level(logging.INFO, logger="areno.api.config"):
        checked_config(cfg, caller="test")
    assert (cfg.train.steps, cfg.train.epochs) == (5, None)  # ceil(2 x 10 / 4); the config.yaml loads as it is
    assert "train.epochs=2: 10 training rows at rollout.batch_size=4 a step: train.steps=5" in caplog.text
    # a part of an epoch rounds up to a whole step; a shipped task counts the rows it generates
    cfg = load_config(
        None, [f"model.path={tmp_path}", "data.task=arithmetic", "rollout.batch_size=64", "train.epochs=0.5"]
    )
    assert checked_config(cfg, caller="test").train.steps == math.ceil(0.5 * 8963 / 64)


def test_unset_steps_are_the_default_and_python_sections_count_alike(tmp_path):
    assert load_config(None, [f"model.path={tmp_path}"]).train.steps == DEFAULT_TRAIN_STEPS == 100
    assert TrainSection().steps == 100
    assert TrainSection(epochs=1.5).steps is None
    rows = _rows(tmp_path, 6)
    cfg = ArenoConfig(model=ModelSection(path=str(tmp_path)), train=TrainSection(epochs=1))
    cfg.data.task, cfg.data.train_path, cfg.rollout.batch_size = None, str(rows), 4
    assert checked_config(cfg, caller="test").train.steps == 2


def test_steps_and_epochs_together_are_refused_and_an_override_replaces_the_files_length(tmp_path):
    both = "train.steps: 5 while train.epochs=2 also sets the run's length: set one of them"
    with pytest.raises(ConfigError, match=both):
        load_config(None, [f"model.path={tmp_path}", "train.epochs=2", "train.steps=5"])
    with pytest.raises(ConfigError, match=both):
        load_config(_file_config(tmp_path, "{steps: 5, epochs: 2}"))
    with pytest.raises(ConfigError, match=both):
        TrainSection(steps=5, epochs=2)
    # the command line's length replaces the file's, whichever key each uses
    assert load_config(_file_config(tmp_path, "{steps: 5}"), ["train.epochs=3"]).train.epochs == 3
    cfg = load_config(_file_config(tmp_path, "{epochs: 3}"), ["train.steps=7"])
    assert (cfg.train.steps, cfg.train.epochs) == (7, None)
    assert load_config(_file_config(tmp_path, "{epochs: 3}"), ["train.epochs=null"]).train.steps == 100
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=rf"^train.epochs: must be > 0 \(or null: train.steps\), got {bad}$"):
            load_config(None, [f"model.path={tmp_path}", f"train.epochs={bad}"])
    # a notebook that sets epochs on a loaded config is told how to let the steps go
    cfg = load_config(None, [f"model.path={tmp_path}"])
    cfg.train.epochs = 2
    with pytest.raises(ConfigError, match=r"train.steps: 100 while .* \(train.steps=null counts the steps"):
        checked_config(cfg, caller="test")


def test_what_depends_on_the_steps_is_checked_once_they_are_counted(tmp_path):
    rows = _rows(tmp_path, 8)
    base = [
        f"model.path={tmp_path}",
        "data.task=null",
        f"data.train_path={rows}",
        "rollout.batch_size=4",
        "train.epochs=1",
    ]
    cfg = load_config(None, [*base, "observe.profile_steps=[3]"])  # unknown until the rows are read
    with pytest.raises(ConfigError, match=r"observe.profile_steps: steps \[3\] are outside this run's 1..2"):
        checked_config(cfg, caller="test")
    cfg = load_config(None, [*base, "optim.warmup_steps=3", "optim.schedule=cosine"])
    with pytest.raises(ConfigError, match="optim.warmup_steps: 3 is more than the run's 2 optimizer steps"):
        checked_config(cfg, caller="test")


def test_a_run_of_one_epoch_draws_each_row_once_and_logs_the_passes(tmp_path):
    rows = _rows(tmp_path, 4)
    overrides = [
        *tiny_run_overrides(tmp_path, num_eval=0),
        "data.task=null",
        f"data.train_path={rows}",
        "reward.sandbox=false",
        "train.epochs=1",
        "train.eval_interval=0",
    ]
    metrics = [r for r in run_to_end(load_config(None, overrides)) if "rollout/epoch" in r]
    assert [r["rollout/epoch"] for r in metrics] == [0.5, 1.0]  # 4 rows, 2 a step: 2 steps
    written = load_config(tmp_path / "run" / "config.yaml")  # the counted steps, the epochs unset
    assert (written.train.steps, written.train.epochs) == (2, None)
