"""Performance tracing: spans from several processes merge into one valid Chrome trace."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areno.errors import DataError
from areno.observe import trace
from areno.observe.trace import async_span, configure_tracing, counter, merge_traces, span

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import time
from areno.observe.trace import span, tracing_enabled
assert tracing_enabled(), "ARENO_TRACE_DIR should enable tracing on import"

@span("forward", "train", micro_batch=0)
def forward():
    time.sleep(0.002)

with span("train_step", "train", step=1):
    forward()
"""


@pytest.fixture
def tracing(tmp_path):
    yield tmp_path
    configure_tracing(None, False)


def validate_chrome_trace(doc: dict) -> list[dict]:
    """The checks chrome://tracing and Perfetto's JSON importer rely on."""
    assert isinstance(doc["traceEvents"], list)
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in {"X", "M", "b", "e", "n", "i", "C"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] != "M":
            assert isinstance(e["ts"], float) and e["ts"] > 1.6e15  # µs since the epoch
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["cat"], str)
        if e["ph"] in "ben":
            assert isinstance(e["id"], str)
    return doc["traceEvents"]


def _forked_child() -> None:
    with span("rollout_request", "rollout", request="r0"):
        time.sleep(0.002)


def test_children_on_this_host_take_the_parents_clock_anchor(tracing):
    """A child started after ``configure_tracing`` uses the parent's epoch offset (one monotonic clock
    per host: a wall-clock step between the two start-ups cannot shift its spans); an anchor handed
    down from another host, or malformed, is not taken."""
    configure_tracing(tracing, True, process_name="trainer")
    assert os.environ[trace.CLOCK_ENV_VAR].split() == [socket.gethostname(), str(trace._STATE.epoch_offset_ns)]
    code = "from areno.observe import trace; print(trace._STATE.epoch_offset_ns)"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(child.stdout) == trace._STATE.epoch_offset_ns
    assert trace._inherited_epoch_offset_ns() == trace._STATE.epoch_offset_ns
    for value in (f"elsewhere {trace._STATE.epoch_offset_ns}", f"{socket.gethostname()} soon"):
        os.environ[trace.CLOCK_ENV_VAR] = value
        assert trace._inherited_epoch_offset_ns() is None
    configure_tracing(None, False)
    assert trace.CLOCK_ENV_VAR not in os.environ


def test_spans_from_several_processes_merge_into_one_trace(tracing):
    run_dir = tracing
    configure_tracing(run_dir, True, process_name="trainer")
    assert os.environ[trace.ENV_VAR] == str(run_dir.resolve())
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with span("policy_sync", "sync", bytes=1024) as s:
        children = [subprocess.Popen([sys.executable, "-c", CHILD], env=env) for _ in range(2)]
        assert [c.wait(timeout=120) for c in children] == [0, 0]
        s.set(tensors=3)
    if "fork" in multiprocessing.get_all_start_methods():
        proc = multiprocessing.get_context("fork").Process(target=_forked_child)
        proc.start()
        proc.join(timeout=60)
        assert proc.exitcode == 0
    with async_span("request", "rollout", span_id=7, prompt_len=5) as req:
        req.set(first_token=True)
    counter("kv_cache", used=3, free=9)

    path = merge_traces(run_dir)
    assert path == run_dir / "trace.json"
    events = validate_chrome_trace(json.loads(path.read_text()))
    spans = [e for e in events if e["ph"] == "X"]
    main_pid = os.getpid()
    by_pid: dict[int, set[str]] = {}
    for e in spans:
        by_pid.setdefault(e["pid"], set()).add(e["name"])
    child_pids = [p for p, names in by_pid.items() if names == {"train_step", "forward"}]
    assert len(child_pids) == 2 and main_pid not in child_pids
    assert "policy_sync" in by_pid[main_pid]
    sync = next(e for e in spans if e["name"] == "policy_sync")
    assert sync["args"] == {"bytes": 1024, "tensors": 3}
    # children ran inside the parent's policy_sync span: one clock for all processes
    for e in spans:
        if e["pid"] in child_pids:
            assert sync["ts"] <= e["ts"] and e["ts"] + e["dur"] <= sync["ts"] + sync["dur"]
            if e["name"] == "forward":
                assert e["args"] == {"micro_batch": 0} and e["dur"] >= 2000
    if "fork" in multiprocessing.get_all_start_methods():
        assert any(names == {"rollout_request"} for names in by_pid.values())
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert "trainer" in names and len(names) >= 3
    assert [e["ph"] for e in events if e.get("id") == "7"] == ["b", "n", "e"]
    assert any(e["ph"] == "C" and e["args"] == {"used": 3, "free": 9} for e in events)
    stats = {(r["cat"], r["name"]): r for r in trace.span_stats(trace.load_trace_events(run_dir))}
    assert stats[("train", "forward")]["count"] == 2 and stats[("train", "forward")]["mean_ms"] >= 2
    assert stats[("sync", "policy_sync")]["total_ms"] == pytest.approx(sync["dur"] / 1000)


def test_decorator_applied_while_disabled_traces_once_enabled(tracing):
    configure_tracing(None, False)

    @span("optimizer_step", "train")
    def step(x):
        return x + 1

    assert step(1) == 2  # disabled: no file, no event
    assert not (tracing / "traces").exists()
    configure_tracing(tracing, True)
    assert step(2) == 3
    with pytest.raises(KeyError):
        with span("ckpt_write", "ckpt"):
            raise KeyError("boom")
    events = json.loads(merge_traces(tracing).read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X"] == ["optimizer_step", "ckpt_write"]
    assert events[-1]["args"] == {"error": "KeyError"}


def test_torn_last_line_is_dropped_and_missing_traces_are_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"traces: pass the run's directory, or train with observe\.trace=true "):
        merge_traces(tmp_path)
    traces = tmp_path / "traces"
    traces.mkdir()
    event = {"name": "x", "cat": "c", "ph": "X", "ts": 1.7e15, "dur": 1.0, "pid": 5, "tid": 5}
    (traces / "a-5.jsonl").write_text(json.dumps(event) + "\n" + '{"name": "y", "ph')
    (traces / "b-5.jsonl").write_text(json.dumps(event) + "\n")  # same pid, other host
    events = json.loads(merge_traces(tmp_path).read_text())["traceEvents"]
    assert len(events) == 2 and len({e["pid"] for e in events}) == 2


def _per_iteration_s(body, n: int) -> float:
    t0 = time.perf_counter()
    body(n)
    return (time.perf_counter() - t0) / n


def test_disabled_spans_are_cheap(tracing):
    """A disabled span costs about as much as the cheapest possible context manager."""

    class Nothing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    def baseline(n):
        for _ in range(n):
            with Nothing():
                pass

    def traced(n):
        for i in range(n):
            with span("decode_step", "rollout", batch=i):
                pass

    configure_tracing(None, False)
    n = 50_000
    base, off = [], []
    for _ in range(5):  # interleaved, best of 5: robust to a loaded machine
        base.append(_per_iteration_s(baseline, n))
        off.append(_per_iteration_s(traced, n))
    configure_tracing(tracing, True)
    on = min(_per_iteration_s(traced, 5_000) for _ in range(3))
    ratio = min(off) / min(base)
    print(
        f"disabled span {min(off) * 1e9:.0f} ns, bare with {min(base) * 1e9:.0f} ns, "
        f"ratio {ratio:.2f}; enabled span {on * 1e9:.0f} ns"
    )
    assert ratio < 6
    assert min(off) < on / 3
