"""Where a profiled step's time went: a Chrome trace from ``observe.profile_steps`` / ``bench.e2e --profile-steps``.

For each named range of the trace (``record_function`` annotations such as ``e2e/rollout``, ``e2e/train``,
``e2e/sync``): its wall time, the device's busy time inside it (the union of kernel, copy and memset
intervals), the device time launched from each host thread (a kernel's launch is found through its
correlation id, so the rollout engine's thread and the trainer's show apart, CUDA-graph replays included),
the kernels that took the most time, and the longest gaps with the device idle. A trace of a CPU-only run
has no device events: the figures are then host operator time by thread.

    python -m bench.trace_summary runs/x/profile/step_00000004.json.gz
    python -m bench.trace_summary TRACE --ranges e2e/train --top 20
    python -m bench.trace_summary TRACE --replays     # also per CUDA-graph replay (the engine's round trips)

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEFAULT_RANGES = ("e2e/rollout", "e2e/train", "e2e/sync")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def idle_gaps(intervals: list[tuple[float, float]], start: float, stop: float) -> list[tuple[float, float]]:
    """The stretches of [start, stop] that no interval covers, longest first."""
    gaps, cursor = [], start
    for a, b in sorted(intervals):
        if a > cursor:
            gaps.append((cursor, min(a, stop)))
        cursor = max(cursor, b)
        if cursor >= stop:
            break
    if cursor < stop:
        gaps.append((cursor, stop))
    return sorted(((a, b) for a, b in gaps if b > a), key=lambda g: g[0] - g[1])


def clip(events: list[dict], start: float, stop: float) -> list[tuple[float, float, dict]]:
    out = []
    for e in events:
        a, b = e["ts"], e["ts"] + e.get("dur", 0.0)
        if b > start and a < stop:
            out.append((max(a, start), min(b, stop), e))
    return out


def summarize(events: list[dict], ranges: tuple[str, ...] = DEFAULT_RANGES, top: int = 10, gaps: int = 5) -> dict:
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    thread_names = {
        (e.get("pid"), e.get("tid")): e.get("args", {}).get("name")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    device = [e for e in complete if e.get("cat") in DEVICE_CATEGORIES]
    launches = {
        e["args"]["correlation"]: (e.get("pid"), e.get("tid"))
        for e in complete
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    host_ops = [e for e in complete if e.get("cat") == "cpu_op"]

    def thread_label(key) -> str:
        return thread_names.get(key) or f"thread {key[1]}"

    out: dict = {"device_events": len(device), "ranges": []}
    # the host's ranges (the device timeline repeats each as a gpu_user_annotation)
    for r in (e for e in complete if e.get("name") in ranges and e.get("cat") != "gpu_user_annotation"):
        start, stop = r["ts"], r["ts"] + r["dur"]
        row: dict = {"name": r["name"], "wall_ms": round(r["dur"] / 1e3, 3)}
        inside = clip(device, start, stop)
        if inside:
            spans = [(a, b) for a, b, _ in inside]
            busy = union_length(spans)
            by_thread: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for a, b, e in inside:
                key = launches.get(e.get("args", {}).get("correlation"))
                slot = by_thread[thread_label(key) if key else "unknown"]
                slot[0] += b - a
                slot[1] += 1
                k = by_kernel[e.get("name", "?")[:80]]
                k[0] += b - a
                k[1] += 1
            row.update(
                device_busy_ms=round(busy / 1e3, 3),
                device_busy_fraction=round(busy / r["dur"], 3) if r["dur"] else None,
                device_events=len(inside),
                device_ms_by_launching_thread={
                    t: {"ms": round(v[0] / 1e3, 3), "events": v[1]}
                    for t, v in sorted(by_thread.items(), key=lambda kv: -kv[1][0])
                },
                top_device_events=[
                    {"name": n, "ms": round(v[0] / 1e3, 3), "count": v[1]}
                    for n, v in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
                ],
                longest_idle_ms=[
                    {"at_ms": round((a - start) / 1e3, 3), "ms": round((b - a) / 1e3, 3)}
                    for a, b in idle_gaps(spans, start, stop)[:gaps]
                ],
            )
        else:
            spans_by_thread: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for a, b, e in clip(host_ops, start, stop):  # nested operators counted once
                spans_by_thread[thread_label((e.get("pid"), e.get("tid")))].append((a, b))
            row["host_op_ms_by_thread"] = {
                t: round(union_length(v) / 1e3, 3) for t, v in sorted(spans_by_thread.items())
            }
        out["ranges"].append(row)
    return out


def graph_replays(events: list[dict]) -> dict:
    """Per CUDA-graph launch (``cudaGraphLaunch``, e.g. a rollout engine's k-step decode loop): the host
    call's time, the device span and busy time of the kernels it ran (found through the launch's
    correlation id), and the gap from the previous replay's last kernel to this one's first (the host's
    work between round trips: bookkeeping, copies, the next launch; eager kernels in it count as gap).
    Medians and totals."""
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    launches = sorted(
        (e for e in complete if e.get("cat") in LAUNCH_CATEGORIES and "GraphLaunch" in e.get("name", "")),
        key=lambda e: e["ts"],
    )
    by_corr: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in complete:
        if e.get("cat") in DEVICE_CATEGORIES and "correlation" in e.get("args", {}):
            by_corr[e["args"]["correlation"]].append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    rows = []
    prev_end = None
    for launch in launches:
        spans = by_corr.get(launch.get("args", {}).get("correlation"), [])
        if not spans:
            continue
        first, last = min(a for a, _ in spans), max(b for _, b in spans)
        rows.append(
            {
                "launch_host_ms": launch.get("dur", 0.0) / 1e3,
                "device_span_ms": (last - first) / 1e3,
                "device_busy_ms": union_length(spans) / 1e3,
                "kernels": len(spans),
                "gap_before_ms": None if prev_end is None else max(0.0, first - prev_end) / 1e3,
            }
        )
        prev_end = last

    def median(key: str) -> float | None:
        values = sorted(r[key] for r in rows if r[key] is not None)
        return round(values[len(values) // 2], 3) if values else None

    def total(key: str) -> float:
        return round(sum(r[key] for r in rows if r[key] is not None), 3)

    keys = ("launch_host_ms", "device_span_ms", "device_busy_ms", "gap_before_ms")
    return {
        "replays": len(rows),
        "kernels_per_replay": median("kernels"),
        "median": {k: median(k) for k in keys},
        "total": {k: total(k) for k in keys},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces (.json or .json.gz)")
    p.add_argument("--ranges", default=",".join(DEFAULT_RANGES), help="comma list of range names to summarize")
    p.add_argument("--top", type=int, default=10, help="device events listed per range")
    p.add_argument("--gaps", type=int, default=5, help="idle gaps listed per range")
    p.add_argument(
        "--replays", action="store_true", help="also summarise the CUDA-graph replays (graph_replays: per round trip)"
    )
    args = p.parse_args(argv)
    ranges = tuple(r for r in args.ranges.split(",") if r)
    result = {}
    for t in args.traces:
        events = load_events(t)
        result[str(t)] = summarize(events, ranges, args.top, args.gaps)
        if args.replays:
            result[str(t)]["graph_replays"] = graph_replays(events)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
