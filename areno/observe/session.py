"""Session traces for agent episodes: turns, tool calls, timings and rewards, one JSON line each.

Workflows record an episode with::

    from areno.observe.session import session

    with session(sample_id=sample["id"], group_id=group_id, policy_version=v) as s:
        s.turn("user", prompt)
        s.turn("assistant", text, num_tokens=len(ids), duration_s=gen_s)
        with s.tool_call("calculator", {"expr": "2+3"}) as call:
            call.result = calculator("2+3")          # an exception is recorded, then re-raised
        s.set_reward(1.0, correct=True)

Recording is off until ``configure_sessions(run_dir, True)``; then ``session`` returns a recorder
that appends the finished episode to ``run_dir/sessions.jsonl`` when the ``with`` block ends (an
exception in the block is recorded as ``status: error`` and propagates). Each episode is written
with a single ``O_APPEND`` write, so threads and processes can share the file. Browse with
``areno sessions RUN_DIR`` (``main`` here) or in the HTML of ``areno report``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from areno.errors import DataError, UserError
from areno.observe.metrics import read_jsonl_records

SESSIONS_FILENAME = "sessions.jsonl"
ENV_VAR = "ARENO_SESSIONS_DIR"


def _truncate(text: Any, max_chars: int) -> Any:
    if isinstance(text, str) and len(text) > max_chars:
        return text[:max_chars] + f"… [{len(text) - max_chars} more chars]"
    return text


class ToolCall:
    """One tool call being timed; set ``result`` (or ``error``) inside the ``with`` block."""

    __slots__ = ("name", "arguments", "result", "error", "_session", "_t0")

    def __init__(self, session: Session, name: str, arguments: Any) -> None:
        self.name = name
        self.arguments = arguments
        self.result: Any = None
        self.error: str | None = None
        self._session = session
        self._t0 = 0.0

    def __enter__(self) -> ToolCall:
        self._t0 = time.monotonic()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self.error is None:
            self.error = f"{exc_type.__name__}: {exc}"
        self._session.add_tool_call(
            self.name,
            self.arguments,
            result=self.result,
            error=self.error,
            duration_s=time.monotonic() - self._t0,
            started_s=self._t0 - self._session._t0,
        )


class Session:
    """The record of one episode. Use as a context manager; methods may be called from the
    episode's coroutine or thread only (one session is one episode)."""

    def __init__(self, recorder: SessionRecorder, session_id: str, meta: dict[str, Any]) -> None:
        self.recorder = recorder
        self.session_id = session_id
        self.meta = meta
        self.events: list[dict[str, Any]] = []
        self.reward: float | None = None
        self.reward_info: dict[str, Any] = {}
        self._start_time = time.time()
        self._t0 = time.monotonic()
        self._written = False

    def _offset(self) -> float:
        return round(time.monotonic() - self._t0, 6)

    def turn(
        self, role: str, content: str, *, num_tokens: int | None = None, duration_s: float | None = None, **info: Any
    ) -> None:
        """A message: ``user``/``system`` prompts, ``assistant`` outputs, ``tool``/env feedback."""
        event: dict[str, Any] = {
            "kind": "turn",
            "t_s": self._offset(),
            "role": role,
            "content": _truncate(content, self.recorder.max_text_chars),
        }
        if num_tokens is not None:
            event["num_tokens"] = int(num_tokens)
        if duration_s is not None:
            event["duration_s"] = float(duration_s)
        if info:
            event["info"] = info
        self.events.append(event)

    def tool_call(self, name: str, arguments: Any) -> ToolCall:
        """Time a tool call: ``with s.tool_call(name, args) as call: call.result = …``."""
        return ToolCall(self, name, arguments)

    def add_tool_call(
        self,
        name: str,
        arguments: Any,
        *,
        result: Any = None,
        error: str | None = None,
        duration_s: float | None = None,
        started_s: float | None = None,
    ) -> None:
        """Record a tool call that was timed elsewhere."""
        limit = self.recorder.max_text_chars
        event: dict[str, Any] = {
            "kind": "tool_call",
            "t_s": round(started_s, 6) if started_s is not None else self._offset(),
            "name": name,
            "arguments": _truncate(arguments, limit),
            "result": _truncate(result, limit),
        }
        if error is not None:
            event["error"] = _truncate(error, limit)
        if duration_s is not None:
            event["duration_s"] = float(duration_s)
        self.events.append(event)

    def event(self, kind: str, **fields: Any) -> None:
        """Any other step (an environment step, an observation stored by reference…)."""
        self.events.append({"kind": kind, "t_s": self._offset(), **fields})

    def set_reward(self, reward: float, **info: Any) -> None:
        self.reward = float(reward)
        self.reward_info.update(info)

    def finish(self, status: str = "ok", error: str | None = None) -> dict[str, Any]:
        """Write the episode (once) and return its record."""
        record: dict[str, Any] = {
            "session_id": self.session_id,
            "start_time": self._start_time,
            "duration_s": round(time.monotonic() - self._t0, 6),
            "status": status,
            "reward": self.reward,
            "num_turns": sum(e["kind"] == "turn" for e in self.events),
            "num_tool_calls": sum(e["kind"] == "tool_call" for e in self.events),
            "meta": self.meta,
            "events": self.events,
        }
        if self.reward_info:
            record["reward_info"] = self.reward_info
        if error is not None:
            record["error"] = error
        if not self._written:
            self._written = True
            self.recorder.write(record)
        return record

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.finish("error", f"{exc_type.__name__}: {exc}")


class _NullSession:
    """What ``session`` returns while recording is off: every method does nothing."""

    session_id = ""

    def turn(self, *a: Any, **k: Any) -> None: ...
    def add_tool_call(self, *a: Any, **k: Any) -> None: ...
    def event(self, *a: Any, **k: Any) -> None: ...
    def set_reward(self, *a: Any, **k: Any) -> None: ...
    def finish(self, *a: Any, **k: Any) -> None: ...

    def tool_call(self, name: str, arguments: Any) -> _NullToolCall:
        return _NullToolCall()

    def __enter__(self) -> _NullSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _NullToolCall:
    result: Any = None
    error: str | None = None

    def __enter__(self) -> _NullToolCall:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_SESSION = _NullSession()


class SessionRecorder:
    """Appends finished sessions to ``run_dir/sessions.jsonl``.

    ``keep_every`` keeps one session in N (1 keeps all) to bound the file on long runs;
    ``max_text_chars`` truncates long messages and tool results.
    """

    def __init__(self, run_dir: Path, *, keep_every: int = 1, max_text_chars: int = 4000) -> None:
        if keep_every < 1:
            raise ValueError(f"keep_every must be >= 1, got {keep_every}")
        if max_text_chars < 1:
            raise ValueError(f"max_text_chars must be >= 1, got {max_text_chars}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / SESSIONS_FILENAME
        self.keep_every = keep_every
        self.max_text_chars = max_text_chars
        self._count = 0
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def session(self, *, session_id: str | None = None, **meta: Any) -> Session | _NullSession:
        """A new session with free-form ``meta`` (sample id, group id, policy version, step…)."""
        with self._lock:
            self._count += 1
            keep = (self._count - 1) % self.keep_every == 0
        if not keep:
            return _NULL_SESSION
        return Session(self, session_id or uuid.uuid4().hex[:16], meta)

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, default=str) + "\n").encode("utf-8")
        with self._lock:
            if self._fd < 0:
                raise RuntimeError(f"session recorder for {self.path} is closed")
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


_RECORDER: SessionRecorder | None = None


def configure_sessions(
    run_dir: Path | None, enabled: bool, *, keep_every: int = 1, max_text_chars: int = 4000, propagate: bool = True
) -> SessionRecorder | None:
    """Turn session recording on (to ``run_dir/sessions.jsonl``) or off for this process; with
    ``propagate``, child processes that import this module follow (``ARENO_SESSIONS_DIR``)."""
    global _RECORDER
    if _RECORDER is not None:
        _RECORDER.close()
        _RECORDER = None
    if enabled:
        if run_dir is None:
            raise ValueError("configure_sessions(enabled=True) needs a run_dir")
        _RECORDER = SessionRecorder(Path(run_dir), keep_every=keep_every, max_text_chars=max_text_chars)
        if propagate:
            os.environ[ENV_VAR] = str(Path(run_dir).resolve())
    elif propagate:
        os.environ.pop(ENV_VAR, None)
    return _RECORDER


def session(*, session_id: str | None = None, **meta: Any) -> Session | _NullSession:
    """Record one episode if recording is on; otherwise a session that records nothing."""
    recorder = _RECORDER
    if recorder is None:
        return _NULL_SESSION
    return recorder.session(session_id=session_id, **meta)


def load_sessions(run_dir: Path) -> list[dict[str, Any]]:
    """All recorded sessions of a run, in the order they finished ([] if none)."""
    path = Path(run_dir) / SESSIONS_FILENAME
    if not path.is_file():
        return []
    return read_jsonl_records(path, what="a session record")


def filter_sessions(
    records: Iterable[dict[str, Any]],
    *,
    min_reward: float | None = None,
    max_reward: float | None = None,
    status: str | None = None,
    tool: str | None = None,
    **meta: str,
) -> list[dict[str, Any]]:
    """Sessions matching every given condition (meta values compared as strings)."""
    out = []
    for r in records:
        reward = r.get("reward")
        if min_reward is not None and (reward is None or reward < min_reward):
            continue
        if max_reward is not None and (reward is None or reward > max_reward):
            continue
        if status is not None and r.get("status") != status:
            continue
        if tool is not None and not any(e.get("name") == tool for e in r["events"] if e["kind"] == "tool_call"):
            continue
        if any(str(r["meta"].get(k)) != v for k, v in meta.items()):
            continue
        out.append(r)
    return out


def format_session(record: dict[str, Any]) -> str:
    """A readable transcript of one session."""
    meta = " ".join(f"{k}={v}" for k, v in record["meta"].items())
    reward = record.get("reward")
    head = (
        f"session {record['session_id']}  status={record['status']}  "
        f"reward={'-' if reward is None else f'{reward:g}'}  turns={record['num_turns']}  "
        f"tool_calls={record['num_tool_calls']}  {record['duration_s']:.3f}s  {meta}"
    ).rstrip()
    lines = [head]
    for e in record["events"]:
        t = f"[{e['t_s']:8.3f}s]"
        if e["kind"] == "turn":
            extra = []
            if "num_tokens" in e:
                extra.append(f"{e['num_tokens']} tok")
            if "duration_s" in e:
                extra.append(f"{e['duration_s']:.3f}s")
            suffix = f" ({', '.join(extra)})" if extra else ""
            lines.append(f"{t} {e['role']}{suffix}:")
            lines.extend("    " + line for line in str(e["content"]).splitlines() or [""])
        elif e["kind"] == "tool_call":
            dur = f" ({e['duration_s']:.3f}s)" if "duration_s" in e else ""
            lines.append(f"{t} tool {e['name']}({json.dumps(e['arguments'], default=str)}){dur}")
            if "error" in e:
                lines.append(f"    error: {e['error']}")
            else:
                lines.append(f"    -> {e['result']}")
        else:
            fields = {k: v for k, v in e.items() if k not in ("kind", "t_s")}
            lines.append(f"{t} {e['kind']} {json.dumps(fields, default=str)}")
    if "error" in record:
        lines.append(f"error: {record['error']}")
    if record.get("reward_info"):
        lines.append(f"reward info: {json.dumps(record['reward_info'], default=str)}")
    return "\n".join(lines)


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``areno sessions RUN_DIR``: list or show recorded agent sessions."""
    parser = argparse.ArgumentParser(prog="areno sessions", description=main.__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--id", help="show the session with this id (or id prefix)")
    parser.add_argument("--last", type=_count, default=20, help="how many of the newest to show (>= 1)")
    parser.add_argument("--min-reward", type=float)
    parser.add_argument("--max-reward", type=float)
    parser.add_argument("--status", choices=["ok", "error"])
    parser.add_argument("--tool", help="only sessions that called this tool")
    parser.add_argument("--full", action="store_true", help="print transcripts, not one line each")
    ns = parser.parse_args(argv)
    records = load_sessions(ns.run_dir)
    if not records:
        raise DataError(
            f"no sessions in {ns.run_dir / SESSIONS_FILENAME}: pass the run's directory, or train with "
            "observe.sessions=true (in the config or as an override) to record them; only workflows that "
            "record sessions write any (the agent and environment workflows, or your own through "
            "areno.observe.session.session)"
        )
    if ns.id:
        matches = [r for r in records if r["session_id"].startswith(ns.id)]
        if not matches:
            raise UserError(f"no session id starts with {ns.id!r} in {ns.run_dir}")
        print("\n\n".join(format_session(r) for r in matches))
        return 0
    recorded = len(records)
    records = filter_sessions(
        records, min_reward=ns.min_reward, max_reward=ns.max_reward, status=ns.status, tool=ns.tool
    )[-ns.last :]
    if not records:  # a filter that matched nothing, said (it printed nothing at all)
        given = {"--min-reward": ns.min_reward, "--max-reward": ns.max_reward, "--status": ns.status, "--tool": ns.tool}
        filters = " ".join(f"{flag} {value}" for flag, value in given.items() if value is not None)
        print(f"no session matches {filters} ({recorded} recorded in {ns.run_dir})", file=sys.stderr)
        return 0
    for r in records:
        print(format_session(r) if ns.full else format_session(r).splitlines()[0])
        if ns.full:
            print()
    return 0


if os.environ.get(ENV_VAR):
    configure_sessions(Path(os.environ[ENV_VAR]), True, propagate=False)


if __name__ == "__main__":
    sys.exit(main())
