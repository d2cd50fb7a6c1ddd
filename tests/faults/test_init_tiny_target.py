"""``model.init_tiny`` makes its model only where nothing can be lost: a directory that does not exist,
an empty one, or a tiny model areno made. A run directory, a checkpoint or a user's files at
``model.path`` are refused in one line naming the fix, and left exactly as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.cli import main
from areno.engine.api import INIT_TINY_MARKER, prepare_model_dir
from areno.errors import ModelDirError
from tests.helpers.configs import TINY, train_args


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (or ``root`` itself) with its bytes."""
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _run_dir(root: Path) -> Path:
    """A finished run's directory as areno leaves it: config, metrics and a complete checkpoint."""
    step = root / "checkpoints" / "step_00000002"
    (step / "hf").mkdir(parents=True)
    (step / "policy").mkdir()
    (step / "hf" / "config.json").write_text('{"model_type": "qwen2"}')
    (step / "policy" / "__0_0.distcp").write_bytes(b"weights")
    (step / "MANIFEST.json").write_text("{}")
    (step / "COMPLETE").write_text("ok")
    (root / "config.yaml").write_text("run_dir: x\n")
    (root / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    return root


def _user_dir(root: Path) -> Path:
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    return root


def _user_file(root: Path) -> Path:
    root.write_text("mine")
    return root


EXPORT = "checkpoints/step_00000002/hf"
NEW_DIR = "point model.path at a new directory for the tiny model"


@pytest.mark.parametrize(
    "make, model_path, fix",
    [
        (_run_dir, lambda d: d, EXPORT),
        (_run_dir, lambda d: d / "checkpoints", EXPORT),
        (_run_dir, lambda d: d / "checkpoints" / "step_00000002", EXPORT),
        (_user_dir, lambda d: d, NEW_DIR),
        (_user_file, lambda d: d, NEW_DIR),
    ],
    ids=["run_dir", "checkpoints", "checkpoint", "user_dir", "user_file"],
)
def test_init_tiny_refuses_a_directory_it_did_not_make_and_keeps_it(tmp_path, capsys, make, model_path, fix):
    given = make(tmp_path / "mine")
    path = model_path(given)
    before = _files(given)
    fix = str(given / fix) if fix == EXPORT else fix
    rc = main(train_args(tmp_path, f"model.path={path}"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"areno: error: model.path: {path} ") and fix in err[0], err
    assert _files(given) == before  # nothing renamed, replaced or deleted
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "run") == ["mine"]  # no .old- or .making-
    # what the engine checks itself before it makes the model (`areno eval` makes it too)
    with pytest.raises(ModelDirError) as refused:
        prepare_model_dir(load_config(None, [f"model.path={path}", TINY]))
    assert str(refused.value).startswith(f"model.path: {path} ") and "model.init_tiny would replace it" in str(
        refused.value
    )
    wanted = f"model.path={fix} model.init_tiny=null" if fix != NEW_DIR else NEW_DIR
    assert wanted in str(refused.value)
    assert _files(given) == before


def test_init_tiny_fills_a_new_or_empty_directory_and_remakes_its_own_model(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (tmp_path / "new", empty):
        made = prepare_model_dir(load_config(None, [f"model.path={path}", TINY]))
        assert (made / "config.json").is_file() and (made / INIT_TINY_MARKER).is_file()
    # the demo's remake of its own model when its arguments or seed changed (a stale marker)
    prepare_model_dir(load_config(None, [f"model.path={empty}", TINY, "train.seed=7"]))
    assert json.loads((empty / INIT_TINY_MARKER).read_text())["seed"] == 7
    # a Hugging Face model without the marker is used as it is, never replaced
    (empty / INIT_TINY_MARKER).unlink()
    before = _files(empty)
    assert prepare_model_dir(load_config(None, [f"model.path={empty}", TINY, "train.seed=8"])) == empty
    assert _files(empty) == before


def test_the_demo_remakes_its_stale_tiny_model_through_the_cli(tmp_path, capsys):
    """The demo's model.path (run_dir/init_model) made from other arguments: made again, the run trains."""
    args = [*train_args(tmp_path, "data.num_eval=0"), f"model.path={tmp_path / 'run' / 'init_model'}"]
    assert main(args) == 0
    marker = tmp_path / "run" / "init_model" / INIT_TINY_MARKER
    assert main([*args, "overwrite=true", "train.seed=5"]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads(marker.read_text())["seed"] == 5
