"""Performance tracing: Chrome-trace spans from every process, merged into one Perfetto file.

Instrument code with::

    from areno.observe.trace import span

    with span("decode_step", "rollout", batch=32):
        ...

    @span("optimizer_step", "train")
    def step(self): ...

Tracing is off by default; a disabled span costs one small object and two method calls (a test
bounds it). ``configure_tracing(run_dir, True)`` turns it on for this process and, through the
``ARENO_TRACE_DIR`` environment variable, for child processes that import this module. Each
process appends its events, one JSON object per line, to ``run_dir/traces/<host>-<pid>.jsonl``
(crash-safe: a torn last line is dropped); ``merge_traces(run_dir)`` writes ``run_dir/trace.json``
in the Chrome trace event format, which opens in https://ui.perfetto.dev and chrome://tracing.

Timestamps are wall-clock microseconds: a monotonic clock anchored to the Unix epoch once, by the
process that turned tracing on, and handed to its children on the same host (``ARENO_TRACE_CLOCK``),
so processes on one host line up exactly whatever the wall clock does between their start-ups (a
child that anchored on its own once placed its spans ~0.4 s late); other hosts anchor their own and
line up to their clock skew.

Categories in use: ``rollout`` (requests, prefill, decode), ``train`` (forward, backward,
optimizer), ``sync`` (policy sync, pause/resume), ``ckpt`` (checkpoint writes), ``eval``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import multiprocessing.util
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from areno.errors import DataError, UserError

ENV_VAR = "ARENO_TRACE_DIR"
"""When set, importing this module enables tracing into that run directory."""
CLOCK_ENV_VAR = "ARENO_TRACE_CLOCK"
"""``<host> <ns>``: the offset from the monotonic clock to the epoch that the processes of that host use."""
TRACES_DIRNAME = "traces"
MERGED_FILENAME = "trace.json"
_FLUSH_EVERY_EVENTS = 512
_FLUSH_EVERY_S = 2.0

F = TypeVar("F", bound=Callable[..., Any])


def _inherited_epoch_offset_ns() -> int | None:
    """The anchor a parent on this host handed down (``CLOCK_ENV_VAR``), or None. The monotonic
    clock (``perf_counter_ns``) is one clock for all processes of a host, so its offset carries over."""
    host, _, offset = os.environ.get(CLOCK_ENV_VAR, "").partition(" ")
    if host != socket.gethostname():
        return None
    try:
        return int(offset)
    except ValueError:
        return None


class _TraceState:
    """The process-wide tracer. ``enabled`` is read on every span, so it is a plain attribute."""

    __slots__ = (
        "enabled",
        "run_dir",
        "path",
        "process_name",
        "_file",
        "_buffer",
        "_lock",
        "_epoch_offset_ns",
        "_last_flush",
        "_named_threads",
        "_pid",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.enabled = False
        self.run_dir: Path | None = None
        self.path: Path | None = None
        self.process_name: str | None = None
        self._file = None
        self._buffer: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._epoch_offset_ns = _inherited_epoch_offset_ns()
        if self._epoch_offset_ns is None:
            self._epoch_offset_ns = time.time_ns() - time.perf_counter_ns()
        self._last_flush = time.monotonic()
        self._named_threads: set[int] = set()
        self._pid = os.getpid()

    @property
    def epoch_offset_ns(self) -> int:
        return self._epoch_offset_ns

    def now_us(self) -> float:
        return (time.perf_counter_ns() + self._epoch_offset_ns) / 1000.0

    def open(self, run_dir: Path, process_name: str | None) -> None:
        self.close()
        self.run_dir = Path(run_dir)
        self._pid = os.getpid()
        traces = self.run_dir / TRACES_DIRNAME
        traces.mkdir(parents=True, exist_ok=True)
        self.path = traces / f"{socket.gethostname()}-{self._pid}.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._named_threads = set()
        self.process_name = process_name or f"{_main_name()} ({socket.gethostname()}:{self._pid})"
        self.emit({"ph": "M", "name": "process_name", "pid": self._pid, "tid": 0, "args": {"name": self.process_name}})
        self.enabled = True

    def emit(self, event: dict[str, Any]) -> None:
        """Buffer one event; serialisation happens at flush, off the traced code's path."""
        tid = event.get("tid")
        with self._lock:
            if self._file is None:
                return
            if tid and tid not in self._named_threads:
                self._named_threads.add(tid)
                self._buffer.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": self._pid,
                        "tid": tid,
                        "args": {"name": threading.current_thread().name},
                    }
                )
            self._buffer.append(event)
            if len(self._buffer) >= _FLUSH_EVERY_EVENTS or time.monotonic() - self._last_flush > _FLUSH_EVERY_S:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if self._file is not None and self._buffer:
            dumps = json.JSONEncoder(default=str, separators=(",", ":")).encode
            self._file.write("".join(dumps(e) + "\n" for e in self._buffer))
            self._file.flush()
        self._buffer.clear()
        self._last_flush = time.monotonic()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        with self._lock:
            self.enabled = False
            self._flush_locked()
            if self._file is not None:
                self._file.close()
            self._file = None

    def after_fork_in_child(self) -> None:
        """A forked child must not write into its parent's file or buffer."""
        self._lock = threading.Lock()
        self._buffer = []
        self._file = None
        if self.enabled and self.run_dir is not None:
            self.open(self.run_dir, None)


def _main_name() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return Path(path).stem if path else "python"


_STATE = _TraceState()
atexit.register(_STATE.close)
# multiprocessing children end with os._exit(), which skips atexit; its finalizers still run.
multiprocessing.util.Finalize(None, _STATE.flush, exitpriority=0)
# ... but a forked multiprocessing child clears the finalizer registry; register it again there.
multiprocessing.util.register_after_fork(
    _STATE, lambda state: multiprocessing.util.Finalize(None, state.flush, exitpriority=0)
)
os.register_at_fork(after_in_child=_STATE.after_fork_in_child)


def configure_tracing(
    run_dir: Path | None, enabled: bool, *, process_name: str | None = None, propagate: bool = True
) -> Path | None:
    """Turn tracing on (writing under ``run_dir/traces/``) or off for this process.

    With ``propagate`` the choice is also put in ``ARENO_TRACE_DIR`` so that child processes
    started afterwards trace too. Returns this process's trace file, or None when disabled.
    """
    if enabled:
        if run_dir is None:
            raise ValueError("configure_tracing(enabled=True) needs a run_dir to write traces into")
        _STATE.open(Path(run_dir), process_name)
        if propagate:
            os.environ[ENV_VAR] = str(Path(run_dir).resolve())
            os.environ[CLOCK_ENV_VAR] = f"{socket.gethostname()} {_STATE.epoch_offset_ns}"
        return _STATE.path
    _STATE.close()
    if propagate:
        os.environ.pop(ENV_VAR, None)
        os.environ.pop(CLOCK_ENV_VAR, None)
    return None


def tracing_enabled() -> bool:
    return _STATE.enabled


def flush_tracing() -> None:
    """Write buffered events to this process's trace file (also done at exit)."""
    _STATE.flush()


class _Span:
    """A ``with`` block or decorator that records one complete ("X") event when tracing is on."""

    __slots__ = ("name", "cat", "args", "_t0")

    def __init__(self, name: str, cat: str, args: dict[str, Any]) -> None:
        self.name = name
        self.cat = cat
        self.args = args
        self._t0 = 0.0

    def __enter__(self) -> _Span:
        if _STATE.enabled:
            self._t0 = _STATE.now_us()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if _STATE.enabled and self._t0:
            t1 = _STATE.now_us()
            event = {
                "name": self.name,
                "cat": self.cat,
                "ph": "X",
                "ts": self._t0,
                "dur": t1 - self._t0,
                "pid": _STATE._pid,
                "tid": threading.get_native_id(),
            }
            args = self.args
            if exc_type is not None:
                args = {**args, "error": getattr(exc_type, "__name__", str(exc_type))}
            if args:
                event["args"] = args
            _STATE.emit(event)
        self._t0 = 0.0

    def set(self, **args: Any) -> None:
        """Attach arguments known only inside the span (tokens generated, bytes sent…)."""
        if _STATE.enabled:
            self.args = {**self.args, **args}

    def __call__(self, fn: F) -> F:
        name, cat, args = self.name, self.cat, self.args

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            if not _STATE.enabled:
                return fn(*a, **kw)
            with _Span(name, cat, args):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]


class _DisabledSpan:
    """What ``span`` returns while tracing is off: a ``with`` does nothing, but a function
    decorated now is traced once tracing is turned on."""

    __slots__ = ("name", "cat", "args")

    def __init__(self, name: str, cat: str, args: dict[str, Any]) -> None:
        self.name = name
        self.cat = cat
        self.args = args

    def __enter__(self) -> _DisabledSpan:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        pass

    def set(self, **args: Any) -> None:
        pass

    def __call__(self, fn: F) -> F:
        return _Span(self.name, self.cat, self.args)(fn)


def span(name: str, cat: str = "areno", **args: Any) -> _Span | _DisabledSpan:
    """A span named ``name`` in category ``cat`` with ``args`` shown in the trace viewer.

    Use as ``with span(...):`` or as a decorator ``@span(...)`` (a decorated function checks
    at each call whether tracing is on). Not re-entrant: create one per ``with``.
    """
    if _STATE.enabled:
        return _Span(name, cat, args)
    return _DisabledSpan(name, cat, args)


class _AsyncSpan:
    """A nestable async span ("b"/"e" events keyed by an id): for work that interleaves on one
    thread, such as concurrent rollout requests in an event loop. Perfetto draws one track per id."""

    __slots__ = ("name", "cat", "id", "args")

    def __init__(self, name: str, cat: str, span_id: str, args: dict[str, Any]) -> None:
        self.name, self.cat, self.id, self.args = name, cat, span_id, args

    def _event(self, ph: str, args: dict[str, Any] | None) -> None:
        event = {
            "name": self.name,
            "cat": self.cat,
            "ph": ph,
            "ts": _STATE.now_us(),
            "pid": _STATE._pid,
            "tid": threading.get_native_id(),
            "id": self.id,
        }
        if args:
            event["args"] = args
        _STATE.emit(event)

    def __enter__(self) -> _AsyncSpan:
        if _STATE.enabled:
            self._event("b", self.args)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if _STATE.enabled:
            self._event("e", {"error": exc_type.__name__} if isinstance(exc_type, type) else None)

    def set(self, **args: Any) -> None:
        if _STATE.enabled:
            self._event("n", args)


def async_span(name: str, cat: str, span_id: str | int, **args: Any) -> _AsyncSpan:
    """Like ``span`` but for work that overlaps other work on the same thread (asyncio)."""
    return _AsyncSpan(name, cat, str(span_id), args)


def instant(name: str, cat: str = "areno", **args: Any) -> None:
    """A point-in-time event (a weight version bump, an abort)."""
    if _STATE.enabled:
        _STATE.emit(
            {
                "name": name,
                "cat": cat,
                "ph": "i",
                "s": "p",
                "ts": _STATE.now_us(),
                "pid": _STATE._pid,
                "tid": threading.get_native_id(),
                "args": args,
            }
        )


def counter(name: str, **values: float) -> None:
    """A counter track (KV-cache blocks in use, queue depth): ``counter("kv", used=3, free=9)``."""
    if _STATE.enabled:
        _STATE.emit(
            {
                "name": name,
                "ph": "C",
                "ts": _STATE.now_us(),
                "pid": _STATE._pid,
                "tid": threading.get_native_id(),
                "args": values,
            }
        )


def _read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the process died mid-write
                break
            raise DataError(f"{path}:{i + 1} is not a trace event: {line[:80]!r}") from None
    return events


def merge_traces(run_dir: Path, out: Path | None = None) -> Path:
    """Merge every process's events under ``run_dir/traces/`` into one Chrome-trace JSON.

    Processes from different hosts that share a pid get distinct pids. Returns the written path
    (``run_dir/trace.json`` unless ``out`` is given).
    """
    run_dir = Path(run_dir)
    if _STATE.enabled and _STATE.run_dir is not None and _STATE.run_dir.resolve() == run_dir.resolve():
        _STATE.flush()
    files = sorted((run_dir / TRACES_DIRNAME).glob("*.jsonl"))
    if not files:
        raise DataError(
            f"no trace files under {run_dir / TRACES_DIRNAME}: pass the run's directory, "
            "or train with observe.trace=true (in the config or as an override) to record them"
        )
    merged: list[dict[str, Any]] = []
    used_pids: set[int] = set()
    for path in files:
        events = _read_events(path)
        pids = {e["pid"] for e in events if "pid" in e}
        remap = {}
        for pid in sorted(pids):
            new = pid
            while new in used_pids:
                new += 1 << 22  # beyond Linux's pid_max, so never a real pid
            remap[pid] = new
            used_pids.add(new)
        for event in events:
            if "pid" in event:
                event["pid"] = remap[event["pid"]]
            merged.append(event)
    # metadata first, then by time: viewers do not need it, but it makes the file diffable.
    merged.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0)))
    out = Path(out) if out is not None else run_dir / MERGED_FILENAME
    tmp = out.with_suffix(out.suffix + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}), encoding="utf-8")
        tmp.replace(out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UserError(
            f"cannot write the trace to {out} ({exc.strerror or exc}): pass -o a file in a writable directory"
        ) from exc
    return out


def load_trace_events(run_dir: Path) -> list[dict[str, Any]]:
    """A run's events: the merged ``trace.json`` when present, else every per-process file."""
    run_dir = Path(run_dir)
    merged = run_dir / MERGED_FILENAME
    if merged.is_file():
        return json.loads(merged.read_text(encoding="utf-8"))["traceEvents"]
    events: list[dict[str, Any]] = []
    for path in sorted((run_dir / TRACES_DIRNAME).glob("*.jsonl")):
        events.extend(_read_events(path))
    return events


def span_stats(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Complete spans grouped by (category, name): count, total and mean duration in ms,
    largest total first. Nested spans count in full at every level."""
    groups: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("ph") == "X":
            groups.setdefault((e.get("cat", ""), e["name"]), []).append(float(e["dur"]))
    rows = [
        {
            "cat": cat,
            "name": name,
            "count": len(durs),
            "total_ms": sum(durs) / 1000,
            "mean_ms": sum(durs) / len(durs) / 1000,
            "max_ms": max(durs) / 1000,
        }
        for (cat, name), durs in groups.items()
    ]
    return sorted(rows, key=lambda r: -r["total_ms"])


def main(argv: list[str] | None = None) -> int:
    """``areno trace RUN_DIR [-o out.json]``: merge a run's per-process traces."""
    parser = argparse.ArgumentParser(prog="areno trace", description=main.__doc__)
    parser.add_argument("run_dir", type=Path, help="a run directory whose traces/ hold its processes' events")
    parser.add_argument("-o", "--out", type=Path, default=None, help="the merged file (default: RUN_DIR/trace.json)")
    ns = parser.parse_args(argv)
    path = merge_traces(ns.run_dir, ns.out)
    with path.open(encoding="utf-8") as f:
        n = len(json.load(f)["traceEvents"])
    print(f"wrote {path} ({n} events): open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


if os.environ.get(ENV_VAR):
    configure_tracing(Path(os.environ[ENV_VAR]), True, propagate=False)


if __name__ == "__main__":
    sys.exit(main())
