"""bench.stamp: the commit and host every bench JSON records."""

import platform

from bench.stamp import COMMIT_ENV, git_commit, stamp


def test_stamp_names_this_checkout_and_host(monkeypatch):
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    commit = git_commit()
    assert commit == "unknown" or (4 <= len(commit) <= 12 and all(c in "0123456789abcdef" for c in commit))
    assert stamp() == {"commit": commit, "host": platform.node()}


def test_exported_tree_stamps_the_commit_it_was_given(monkeypatch):
    monkeypatch.setenv(COMMIT_ENV, "abc1234")
    assert stamp()["commit"] == "abc1234"
