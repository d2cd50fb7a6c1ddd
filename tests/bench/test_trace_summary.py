"""bench.trace_summary: device busy time, launching threads and idle gaps of a hand-made trace."""

import gzip
import json

from bench.trace_summary import idle_gaps, load_events, main, summarize, union_length


def test_union_length_counts_overlaps_once():
    assert union_length([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert union_length([]) == 0


def test_idle_gaps_longest_first():
    assert idle_gaps([(2, 4), (10, 11)], 0, 12) == [(4, 10), (0, 2), (11, 12)]


def trace() -> list[dict]:
    """A 100 us range; the trainer's thread (tid 1) launches two kernels, the engine's (tid 2) one."""
    x = "X"
    return [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 2, "args": {"name": "engine"}},
        {"ph": x, "cat": "user_annotation", "name": "e2e/train", "ts": 1000, "dur": 100, "pid": 0, "tid": 1},
        {
            "ph": x,
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 1001,
            "dur": 1,
            "pid": 0,
            "tid": 1,
            "args": {"correlation": 7},
        },
        {
            "ph": x,
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 1002,
            "dur": 1,
            "pid": 0,
            "tid": 1,
            "args": {"correlation": 8},
        },
        {
            "ph": x,
            "cat": "cuda_runtime",
            "name": "cudaGraphLaunch",
            "ts": 1003,
            "dur": 1,
            "pid": 0,
            "tid": 2,
            "args": {"correlation": 9},
        },
        {
            "ph": x,
            "cat": "kernel",
            "name": "gemm",
            "ts": 1010,
            "dur": 30,
            "pid": 1,
            "tid": 7,
            "args": {"correlation": 7},
        },
        {
            "ph": x,
            "cat": "kernel",
            "name": "gemm",
            "ts": 1030,
            "dur": 20,
            "pid": 1,
            "tid": 7,
            "args": {"correlation": 8},
        },
        # runs past the range's end: only its 10 us inside count
        {
            "ph": x,
            "cat": "kernel",
            "name": "decode",
            "ts": 1090,
            "dur": 30,
            "pid": 1,
            "tid": 8,
            "args": {"correlation": 9},
        },
    ]


def test_summarize_attributes_device_time_to_launching_threads():
    (row,) = summarize(trace(), ranges=("e2e/train",))["ranges"]
    assert row["wall_ms"] == 0.1
    assert row["device_busy_ms"] == 0.05  # [1010, 1050] and [1090, 1100]
    assert row["device_busy_fraction"] == 0.5
    assert row["device_ms_by_launching_thread"] == {
        "thread 1": {"ms": 0.05, "events": 2},
        "engine": {"ms": 0.01, "events": 1},
    }
    assert row["top_device_events"][0] == {"name": "gemm", "ms": 0.05, "count": 2}
    assert row["longest_idle_ms"][0] == {"at_ms": 0.05, "ms": 0.04}  # [1050, 1090]
    assert row["longest_idle_ms"][1] == {"at_ms": 0.0, "ms": 0.01}


def test_main_reads_gzipped_traces(tmp_path, capsys):
    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": trace()}, f)
    assert len(load_events(path)) == len(trace())
    main([str(path), "--ranges", "e2e/train"])
    out = json.loads(capsys.readouterr().out)
    assert out[str(path)]["ranges"][0]["device_busy_ms"] == 0.05


def test_graph_replays_per_launch_span_busy_and_idle_between():
    """Two graph launches: the first ran kernels 0-10 and 20-30 us, the second 50-60; a plain kernel
    launch is no replay."""
    from bench.trace_summary import graph_replays

    def ev(cat, name, ts, dur, corr):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "ts": ts,
            "dur": dur,
            "pid": 0,
            "tid": 1,
            "args": {"correlation": corr},
        }

    events = [
        ev("cuda_runtime", "cudaGraphLaunch", 0, 4, 1),
        ev("kernel", "a", 0, 10, 1),
        ev("kernel", "b", 20, 10, 1),
        ev("cuda_runtime", "cudaLaunchKernel", 35, 1, 2),
        ev("kernel", "c", 36, 2, 2),
        ev("cuda_runtime", "cudaGraphLaunch", 45, 2, 3),
        ev("kernel", "a", 50, 10, 3),
    ]
    out = graph_replays(events)
    assert out["replays"] == 2
    assert out["total"] == {
        "launch_host_ms": 0.006,
        "device_span_ms": 0.04,
        "device_busy_ms": 0.03,
        "gap_before_ms": 0.02,
    }
    assert out["median"]["gap_before_ms"] == 0.02 and out["kernels_per_replay"] == 2
