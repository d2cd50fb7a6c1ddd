"""``train.keep_checkpoints``: after each save only the newest K checkpoints stay, and the full
checkpoints that a kept incremental one overlays."""

from __future__ import annotations

import json

import pytest

from areno.api.config import load_config
from areno.errors import ConfigError
from areno.models.checkpoint_dirs import COMPLETE_MARKER
from areno.train import checkpoint
from tests.helpers.resume import overrides, run_areno


def _step(root, step: int, *, base: int | None = None, complete: bool = True):
    path = root / f"step_{step:08d}"
    (path / "policy").mkdir(parents=True)
    if base is not None:  # an incremental checkpoint, as checkpoint.save records its base
        record = {"base": f"../../step_{base:08d}/policy"}
        (path / "policy" / checkpoint.INCREMENTAL).write_text(json.dumps(record))
    if complete:
        (path / COMPLETE_MARKER).write_text("ok")
    return path


def _names(root):
    return sorted(p.name for p in root.iterdir())


def test_prune_keeps_the_newest_and_the_bases_they_overlay(tmp_path):
    root = tmp_path / "checkpoints"
    _step(root, 1)
    _step(root, 2, base=1)
    _step(root, 3)
    _step(root, 4, base=3)
    _step(root, 5, base=3)
    assert checkpoint.incremental_base(root / "step_00000005" / "policy") == (root / "step_00000003" / "policy")
    assert checkpoint.prune(root, 0) == [] and len(_names(root)) == 5  # 0 keeps every one
    removed = checkpoint.prune(root, 2)
    assert [p.name for p in removed] == ["step_00000001", "step_00000002"]
    assert _names(root) == ["step_00000003", "step_00000004", "step_00000005"]  # 3: the base of 4 and 5
    _step(root, 6)
    checkpoint.prune(root, 1)
    assert _names(root) == ["step_00000006"]


def test_prune_leaves_what_is_not_a_completed_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    _step(root, 1)
    _step(root, 2)
    _step(root, 3, complete=False)  # a write in progress is not counted, nor removed here
    (root / "notes.txt").write_text("mine")
    checkpoint.prune(root, 1)
    assert _names(root) == ["notes.txt", "step_00000002", "step_00000003"]


def test_a_negative_keep_is_refused():
    with pytest.raises(ConfigError, match=r"^train.keep_checkpoints: must be >= 0 \(0 keeps all\), got -1"):
        load_config(None, ["model.path=/m", "train.keep_checkpoints=-1"])


def test_a_run_keeps_its_newest_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_areno(overrides(tmp_path, run_dir, "train.keep_checkpoints=2", steps=3, save_interval=1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _names(run_dir / "checkpoints") == ["step_00000002", "step_00000003"]
