"""Agent session traces: recorded, filtered, formatted, browsable from the CLI."""

from __future__ import annotations

import asyncio
import json

import pytest

from areno.errors import DataError
from areno.observe import session as sessions
from areno.observe.session import (
    SessionRecorder,
    configure_sessions,
    filter_sessions,
    format_session,
    load_sessions,
    session,
)


@pytest.fixture
def recording(tmp_path):
    configure_sessions(tmp_path, True)
    yield tmp_path
    configure_sessions(None, False)


async def _episode(i: int) -> None:
    with session(sample_id=i, group_id=f"g{i % 2}") as s:
        s.turn("user", f"what is {i} + 2?")
        await asyncio.sleep(0.001)
        s.turn("assistant", "<tool_call>add</tool_call>", num_tokens=7, duration_s=0.01)
        with s.tool_call("add", {"a": i, "b": 2}) as call:
            await asyncio.sleep(0.002)
            call.result = i + 2
        s.turn("tool", str(i + 2))
        s.turn("assistant", f"{i + 2}", num_tokens=2)
        s.set_reward(1.0 if i % 2 == 0 else 0.0, correct=i % 2 == 0)


def test_concurrent_episodes_are_recorded_with_turns_tools_and_rewards(recording):
    async def run():
        await asyncio.gather(*(_episode(i) for i in range(6)))

    asyncio.run(run())
    records = load_sessions(recording)
    assert sorted(r["meta"]["sample_id"] for r in records) == list(range(6))
    r = next(r for r in records if r["meta"]["sample_id"] == 4)
    assert r["status"] == "ok" and r["reward"] == 1.0 and r["reward_info"] == {"correct": True}
    assert r["num_turns"] == 4 and r["num_tool_calls"] == 1
    assert [e["kind"] for e in r["events"]] == ["turn", "turn", "tool_call", "turn", "turn"]
    tool = r["events"][2]
    assert tool["name"] == "add" and tool["arguments"] == {"a": 4, "b": 2} and tool["result"] == 6
    assert tool["duration_s"] >= 0.002 and r["duration_s"] >= tool["t_s"] + tool["duration_s"]
    assert [e["t_s"] for e in r["events"]] == sorted(e["t_s"] for e in r["events"])
    assert r["events"][1]["num_tokens"] == 7

    assert len(filter_sessions(records, min_reward=0.5)) == 3
    assert len(filter_sessions(records, group_id="g1")) == 3
    assert len(filter_sessions(records, tool="search")) == 0

    text = format_session(r)
    assert text.splitlines()[0].startswith(f"session {r['session_id']}  status=ok  reward=1  turns=4")
    assert 'tool add({"a": 4, "b": 2})' in text and "    -> 6" in text


def test_an_exception_in_the_episode_is_recorded_and_reraised(recording):
    with pytest.raises(RuntimeError, match="env crashed"):
        with session(sample_id="worse") as s:
            s.turn("user", "go")
            raise RuntimeError("env crashed")
    (r,) = load_sessions(recording)
    assert r["status"] == "error" and r["error"] == "RuntimeError: env crashed"
    assert r["num_turns"] == 1


def test_error_status_and_tool_errors(recording):
    with pytest.raises(TimeoutError):
        with session(sample_id="bad") as s:
            with s.tool_call("browser", {"url": "x"}):
                raise TimeoutError("tool timed out")
    (r,) = load_sessions(recording)
    assert r["status"] == "error" and r["error"] == "TimeoutError: tool timed out"
    assert r["events"][0]["error"] == "TimeoutError: tool timed out" and r["reward"] is None


def test_disabled_recording_writes_nothing(tmp_path):
    configure_sessions(None, False)
    with session(sample_id=1) as s:
        s.turn("user", "hi")
        with s.tool_call("t", {}) as call:
            call.result = 1
        s.set_reward(1.0)
    assert not (tmp_path / "sessions.jsonl").exists()


def test_keep_every_and_truncation(tmp_path):
    recorder = SessionRecorder(tmp_path, keep_every=3, max_text_chars=10)
    for i in range(7):
        with recorder.session(i=i) as s:
            s.turn("assistant", "x" * 25)
    recorder.close()
    records = load_sessions(tmp_path)
    assert [r["meta"]["i"] for r in records] == [0, 3, 6]
    assert records[0]["events"][0]["content"] == "x" * 10 + "… [15 more chars]"
    with pytest.raises(ValueError, match="keep_every"):
        SessionRecorder(tmp_path, keep_every=0)


def test_cli_lists_and_shows_sessions(recording, capsys):
    asyncio.run(_episode(0))
    asyncio.run(_episode(1))
    assert sessions.main([str(recording), "--min-reward", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "reward=1" in out[0]
    sid = load_sessions(recording)[1]["session_id"]
    assert sessions.main([str(recording), "--id", sid[:6]]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"session {sid}") and "assistant (2 tok):" in out
    with pytest.raises(ValueError, match="no session id"):
        sessions.main([str(recording), "--id", "zzzz"])


def test_cli_without_sessions_is_a_clear_error(tmp_path):
    with pytest.raises(DataError) as exc:
        sessions.main([str(tmp_path)])
    assert str(exc.value) == (  # the config key to set, not the Python call behind it
        f"no sessions in {tmp_path / 'sessions.jsonl'}: pass the run's directory, or train with "
        "observe.sessions=true (in the config or as an override) to record them; only workflows that "
        "record sessions write any (the agent and environment workflows, or your own through "
        "areno.observe.session.session)"
    )
    assert json.loads(json.dumps(load_sessions(tmp_path))) == []


def test_a_filter_that_matches_nothing_says_so(recording, capsys):
    """It printed nothing and exited 0, as if the filter had not run (walk39b)."""

    async def run():
        await asyncio.gather(*(_episode(i) for i in range(3)))

    asyncio.run(run())
    assert sessions.main([str(recording), "--tool", "calc", "--status", "ok"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"no session matches --status ok --tool calc (3 recorded in {recording})"
    assert sessions.main([str(recording), "--tool", "add"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
