"""A checkpoint save that fails on the disk (full, a size limit) stops the run with one line naming the
checkpoint and the one ``resume=auto`` goes on from, and leaves no half-written staging directory."""

from __future__ import annotations

import errno

from areno.cli import main
from areno.engine.local import LocalTrainingSide
from tests.helpers.configs import train_args


def test_a_full_disk_during_a_save_is_one_line_naming_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    save = LocalTrainingSide.save

    def full_after_the_first(self, path, extra_state):
        if "step_00000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path / "policy"))
        return save(self, path, extra_state)

    monkeypatch.setattr(LocalTrainingSide, "save", full_after_the_first)
    assert main(train_args(tmp_path, "train.steps=3", "train.save_interval=1", "train.eval_interval=0")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert err[-1].startswith(f"areno: error: saving checkpoint {checkpoints / 'step_00000002'} failed (OSError: ")
    assert (
        "No space left on device" in err[-1] and f"resume=auto goes on from {checkpoints / 'step_00000001'}" in err[-1]
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000001"]  # no step_00000002.tmp left
