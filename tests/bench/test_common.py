"""bench/_common.py: the stamp, the headline every bench's JSON starts with, and one JSON line per run."""

import datetime
import json
import platform

from bench._common import COMMIT_ENV, HEADLINE_KEYS, emit, git_commit, headline, ratio, stamp


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
