"""`areno train` on a damaged model directory or a data file that is not UTF-8: one line naming the
file, exit 2, before any model is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def _train(tmp_path: Path, model_dir: Path, data: Path, capsys) -> tuple[int, list[str]]:
    from areno.cli import main

    rc = main(
        [
            "train",
            f"run_dir={tmp_path / 'run'}",
            f"model.path={model_dir}",
            "model.init_tiny=null",
            "data.task=null",
            f"data.train_path={data}",
            "cluster.device=cpu",
            "observe.console=false",
        ]
    )
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


@pytest.mark.parametrize("text", ["{not json", "", '{"model_type": "no_such_model"}'])
def test_corrupt_model_config_is_one_line(tiny_model_dir, tmp_path, data, capsys, text):
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    (model_dir / "config.json").write_text(text)
    rc, err = _train(tmp_path, model_dir, data, capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("areno: error: ") and str(model_dir) in err[0], err


def test_model_without_tokenizer_is_one_line(tiny_model_dir, tmp_path, data, capsys):
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "special_tokens_map.json"):
        (model_dir / name).unlink(missing_ok=True)
    rc, err = _train(tmp_path, model_dir, data, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "has no tokenizer" in err[0] and str(model_dir) in err[0], err


def test_non_utf8_data_file_is_named(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + b'{"prompt": "\xff\xfe", "answer": "1"}\n')
    rc, err = _train(tmp_path, tiny_model_dir, path, capsys)
    assert rc == 2 and len(err) == 1, err
    assert str(path) in err[0] and "UTF-8" in err[0], err
