"""``areno train --check``: what a run checks before training (config, data, reward, model, run directory),
the resolved config printed (``train.epochs`` counted), nothing trained or written."""

from __future__ import annotations

import yaml

from areno.cli import main as areno_main
from tests.helpers.configs import train_args


def test_a_check_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys):
    args = train_args(tmp_path, "train.steps=null", "train.epochs=0.001", "warm_start.steps=2")
    assert areno_main([args[0], "--check", *args[1:]]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    assert resolved["train"]["steps"] == 5 and resolved["train"]["epochs"] is None  # ceil(0.001 x 8,963 / 2)
    assert resolved["run_dir"] == str(tmp_path / "run")
    *_, model, context, last = out.strip().splitlines()
    assert last.startswith("# areno train --check: config, data, reward and model check out: 5 grpo steps after 2 ")
    assert model.startswith("# model: Qwen2ForCausalLM, 0.") and model.endswith("M parameters")  # init_tiny's
    assert context == "# context: 2048 tokens a sequence (the model's max_position_embeddings=2048)"
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()  # init_tiny's model not made


def test_a_check_fails_in_one_line_as_the_run_would(tmp_path, capsys):
    args = train_args(tmp_path, "data.task=null", f"data.train_path={tmp_path / 'missing.jsonl'}")
    assert areno_main([args[0], "--check", *args[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.train_path: dataset file" in err[0] and "does not exist" in err[0], err
