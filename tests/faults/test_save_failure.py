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


def test_a_metrics_file_that_cannot_be_written_stops_the_run_in_one_line(tmp_path, capsys, monkeypatch):
    """walk31: a full disk under metrics.jsonl was three chained OSError tracebacks, and the trained steps
    were lost; now one line, and the step trained is saved where the disk allows."""
    from areno.observe import metrics

    init = metrics.JsonlSink.__init__

    class FullAfterTwoRows:
        def __init__(self, file):
            self.file, self.rows = file, 0

        def write(self, text):
            self.rows += 1
            if self.rows > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(text)

        def flush(self):
            self.file.flush()

        def close(self):
            self.file.close()

    def wrapped(self, run_dir):
        init(self, run_dir)
        self._file = FullAfterTwoRows(self._file)

    monkeypatch.setattr(metrics.JsonlSink, "__init__", wrapped)
    assert main(train_args(tmp_path, "train.steps=4", "train.save_interval=0", "train.eval_interval=0")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("areno: error: writing ") and "metrics.jsonl failed at step" in err[-1]
    assert "(No space left on device): free space on its disk" in err[-1]
    assert "saved an emergency checkpoint of step" in err[-1]
    assert not any(line.startswith("Traceback") for line in err)
