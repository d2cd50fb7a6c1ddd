"""``train.best_metric`` / ``best_mode`` (TRL's metric_for_best_model / greater_is_better): the checkpoint whose
evaluation figure is the best so far, named in ``checkpoints/best.json``, kept by ``keep_checkpoints``, scored
by ``areno eval --checkpoint best``; refused in one line where it could compare nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.api.trainer import Trainer
from areno.engine.config import TrainSection
from areno.engine.evaluation import EvalOptions, resolve_checkpoint, run_eval
from areno.errors import ConfigError, ModelDirError
from areno.models.checkpoint_dirs import COMPLETE_MARKER
from areno.observe.metrics import read_metrics
from areno.train import checkpoint
from tests.helpers.configs import tiny_run_overrides


def test_the_settings_are_checked_in_one_line(tmp_path):
    assert TrainSection(best_metric="pass@2", eval_interval=2, save_interval=4).best_metric == "eval/pass@2"
    with pytest.raises(ConfigError, match=r"^train.best_mode: must be max or min, got 'up'$"):
        TrainSection(best_mode="up")
    for intervals in ({"eval_interval": 0, "save_interval": 4}, {"eval_interval": 3, "save_interval": 4}, {}):
        with pytest.raises(ConfigError, match=r"^train.best_metric: compares the evaluations of saved steps"):
            TrainSection(best_metric="accuracy", **intervals)
    no_held_out = [
        *tiny_run_overrides(tmp_path, num_eval=0),
        "train.best_metric=accuracy",
        "train.eval_interval=1",
        "train.save_interval=1",
    ]
    with pytest.raises(ConfigError, match=r"^train.best_metric=eval/accuracy: the run has no held-out rows"):
        check_run(load_config(None, no_held_out))


def _fake_checkpoints(root: Path, steps: list[int]) -> list[Path]:
    paths = []
    for step in steps:
        path = root / f"step_{step:08d}"
        path.mkdir(parents=True)
        (path / COMPLETE_MARKER).write_text("")
        paths.append(path)
    return paths


def test_pruning_keeps_the_best_and_a_record_of_a_removed_one_names_none(tmp_path):
    paths = _fake_checkpoints(tmp_path, [1, 2, 3, 4])
    record = {"step": 2, "path": str(paths[1]), "metric": "eval/accuracy", "value": 0.5, "mode": "max"}
    checkpoint.write_best(tmp_path, record)
    assert checkpoint.read_best(tmp_path) == record
    assert checkpoint.prune(tmp_path, 1) == [paths[0].resolve(), paths[2].resolve()]
    assert [p.exists() for p in paths] == [False, True, False, True]
    checkpoint.write_best(tmp_path, {**record, "step": 3, "path": str(paths[2])})  # a step no longer there
    assert checkpoint.read_best(tmp_path) is None
    (tmp_path / checkpoint.BEST_FILE).write_text("{not json")
    assert checkpoint.read_best(tmp_path) is None


def _run(tmp_path: Path, *extra: str):
    overrides = [
        *tiny_run_overrides(tmp_path),
        "reward.sandbox=false",
        "train.steps=4",
        "train.eval_interval=1",
        "train.save_interval=1",
        "train.keep_checkpoints=1",
        *extra,
    ]
    return load_config(None, overrides)


def test_a_run_keeps_its_best_checkpoint_which_areno_eval_scores_again(tmp_path):
    cfg = _run(tmp_path, "train.best_metric=eval/completion_tokens_mean", "train.best_mode=min")
    trainer = Trainer.init(cfg)
    try:
        trainer.evaluate_now()
        trainer.run()
        best = trainer.best_checkpoint
    finally:
        trainer.shutdown()
    logged = {
        r["step"]: r["eval/completion_tokens_mean"] for r in read_metrics(Path(cfg.run_dir)) if "eval/time_s" in r
    }
    assert sorted(logged) == [0, 1, 2, 3, 4]  # step 0 has no checkpoint: not a candidate
    expected = min((1, 2, 3, 4), key=lambda s: (logged[s], s))  # the first of the lowest: a tie is not better
    assert (best["step"], best["metric"], best["mode"]) == (expected, "eval/completion_tokens_mean", "min")
    assert best["value"] == logged[expected]
    assert json.loads((tmp_path / "run" / "checkpoints" / "best.json").read_text()) == best
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{expected:08d}", "step_00000004"})  # keep_checkpoints=1 and the best
    path, name = resolve_checkpoint("best", cfg)
    assert (path, name) == (Path(best["path"]) / "hf", f"step_{expected:08d}")
    again = run_eval(cfg, EvalOptions(checkpoint="best"))["metrics"]
    assert again["eval/completion_tokens_mean"] == pytest.approx(best["value"])


def test_a_figure_the_evaluation_does_not_log_is_named_before_training(tmp_path):
    trainer = Trainer.init(_run(tmp_path, "train.best_metric=eval/acuracy"))
    try:
        with pytest.raises(ConfigError, match=r"^train.best_metric=eval/acuracy: .* it logs eval/accuracy, "):
            trainer.evaluate_now()
    finally:
        trainer.shutdown()
    with pytest.raises(ModelDirError, match=r"^--checkpoint best: .* names no best checkpoint"):
        resolve_checkpoint("best", _run(tmp_path, "train.best_metric=accuracy"))
