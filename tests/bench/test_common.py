"""bench/_common.py: the stamp, the headline every bench's JSON starts with, and one JSON line per run."""

import datetime
import json
import platform
import tempfile

import pytest

from bench._common import COMMIT_ENV, HEADLINE_KEYS, emit, git_commit, headline, keep_work_dir, ratio, stamp, work_dir


def test_stamp_names_this_checkout_host_and_day(monkeypatch):
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    commit = git_commit()
    assert commit == "unknown" or (4 <= len(commit) <= 12 and all(c in "0123456789abcdef" for c in commit))
    before = datetime.datetime.now(datetime.UTC).date().isoformat()
    got = stamp()
    after = datetime.datetime.now(datetime.UTC).date().isoformat()  # (the git call may cross midnight, UTC)
    assert got in [{"commit": commit, "host": platform.node(), "date": day} for day in (before, after)]


def test_exported_tree_stamps_the_commit_it_was_given(monkeypatch):
    monkeypatch.setenv(COMMIT_ENV, "abc1234")
    assert stamp()["commit"] == "abc1234"


def test_ratio_is_none_without_a_baseline():
    assert ratio(3.0, 2.0) == 1.5 and ratio(1.0, 3.0, 2) == 0.33
    assert ratio(None, 2.0) is None and ratio(2.0, None) is None and ratio(2.0, 0.0) is None


def test_emit_prints_one_line_that_starts_with_the_headline(capsys, monkeypatch):
    monkeypatch.setenv(COMMIT_ENV, "abc1234")
    head = headline("tok/s", 30.0, "generate", 10.0, 3.0, "ours / theirs")
    record = emit("demo", head, {"detail": [1, 2]})
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line) == record
    assert list(record)[: len(HEADLINE_KEYS) + 1] == ["bench", *HEADLINE_KEYS]
    assert record["figure"] == 30.0 and record["baseline"] == 10.0 and record["ratio"] == 3.0
    assert record["detail"] == [1, 2] and record["commit"] == "abc1234"


def test_a_temporary_work_dir_goes_when_the_bench_ends_well(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with work_dir(None, "areno-bench-x-") as work:
        assert work.parent == tmp_path and work.name.startswith("areno-bench-x-")
        (work / "model").mkdir()
        (work / "model" / "weights.bin").write_bytes(b"0" * 1024)
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().err == ""


def test_a_failed_bench_keeps_its_temporary_work_dir_and_names_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match="arm failed"), work_dir(None, "areno-bench-x-") as work:
        (work / "run.log").write_text("the arm's output")
        raise RuntimeError("arm failed")
    assert (work / "run.log").read_text() == "the arm's output"
    assert capsys.readouterr().err == f"kept {work} (the failed bench's models, runs and logs): remove it when done\n"


def test_a_given_work_dir_is_made_and_kept(tmp_path):
    given = tmp_path / "a" / "b"
    with work_dir(str(given), "areno-bench-x-") as work:
        assert work == given and work.is_dir()
        (work / "metrics.jsonl").write_text("{}")
    assert (given / "metrics.jsonl").read_text() == "{}"


def test_a_bench_keeps_a_work_dir_it_asks_to_keep(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with work_dir(None, "areno-bench-x-") as work:
        (work / "trace.json").write_text("{}")
        keep_work_dir(work, "the profiles")
    assert (work / "trace.json").is_file()
    assert capsys.readouterr().err == f"kept {work} (the profiles): remove it when done\n"
    with work_dir(None, "areno-bench-x-") as again:  # asked for that directory only
        pass
    assert not again.exists()
