"""``areno recipes grpo | head`` (or any reader that leaves early) ends the command quietly, as a shell tool
does: it printed a BrokenPipeError traceback and exited 1 (walk39b)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["recipes", "grpo"], ["doctor", "--json"]])
def test_a_reader_that_leaves_early_gets_no_traceback(args):
    proc = subprocess.Popen([sys.executable, "-m", "areno", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err[-2000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]


def test_a_broken_pipe_elsewhere_is_not_taken_for_a_reader_that_left(monkeypatch):
    """walk40: any BrokenPipeError (a socket's, another pipe's) ended the command silently with 141."""
    import areno.recipes
    from areno.cli import main

    def broken(argv):
        raise BrokenPipeError("a worker's pipe")

    monkeypatch.setattr(areno.recipes, "main", broken)
    with pytest.raises(BrokenPipeError, match="a worker's pipe"):
        main(["recipes"])
