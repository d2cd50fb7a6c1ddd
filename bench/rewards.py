"""Reward throughput: in-process vs the reward sandbox (worker subprocesses), side by side. Prints one JSON
object: the headline (the first reward's sandbox calls/s, in-process as the baseline, ``ratio`` = sandbox /
in-process), then ``results`` (one per reward).

    python -m bench.rewards                      # CPU, any machine: no model, no GPU
    python -m bench.rewards --calls 2048 --workers 8 --concurrency 256

For each shipped reward (exact_match, math_verify, code_execution) the same ``--calls`` rewards are
scored through the workflows' ``acall_reward`` with ``--concurrency`` calls in flight (as the rollout
pool issues them): once with the function in-process (a synchronous reward runs on the event loop,
so in process the calls go one at a time whatever ``--concurrency`` says), once through a
``RewardSandbox`` of ``--workers`` processes. The sandbox's start-up (spawning workers, importing the reward) is timed
separately (``sandbox_startup_s``) and excluded from its throughput; its one warm-up call per
worker is not counted either. ``overhead_us_per_call`` = (sandbox time - in-process time) / calls.
The in-process code_execution still runs every candidate program in its own confined subprocess
(that is its point); only the reward wrapper moves into a worker.
"""

from __future__ import annotations

import asyncio
import os
import platform
import time

from areno.rewards.loader import import_object
from areno.rewards.sandbox import RewardSandbox
from areno.workflows.common import acall_reward
from bench._common import emit, headline, parser, ratio

CASES = {
    "exact_match": ("areno.rewards.tasks:exact_match", lambda i: ("q", f"{i % 7}\n", str(i % 5), {})),
    "math_verify": (
        "areno.rewards.math:math_verify",
        lambda i: ("q", f"so the answer is \\boxed{{\\frac{{{i % 9}}}{{2}}}}", str((i % 9) / 2), {}),
    ),
    "code_execution": (
        "areno.rewards.code:code_execution",
        lambda i: (
            "q",
            "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
            None,
            {"tests": [{"input": f"{i} 1", "output": str(i + 1 - (i % 3 == 0))}]},
        ),
    ),
}


async def ascore_all(reward_fn, make, calls: int, concurrency: int) -> tuple[float, list[float], int]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int):
        prompt, completion, answer, fields = make(i)
        async with gate:
            return await acall_reward(reward_fn, prompt, completion, answer, fields)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(calls)))
    return time.perf_counter() - t0, [r for r, _ in results], sum(e is not None for _, e in results)


def bench_case(name: str, args) -> dict:
    path, make = CASES[name]
    calls = args.calls if name == "exact_match" else args.heavy_calls
    fn = import_object(path, what="reward.fn")
    fn(*make(0)[:3], **make(0)[3])  # imports (sympy…) outside the timing, as a warm run would
    in_s, in_rewards, in_errors = asyncio.run(ascore_all(fn, make, calls, args.concurrency))
    t0 = time.perf_counter()
    with RewardSandbox(path, workers=args.workers, timeout_s=60.0) as sandbox:

        async def warm():
            await asyncio.gather(*(sandbox(*make(i)[:3], **make(i)[3]) for i in range(args.workers)))

        asyncio.run(warm())
        startup_s = time.perf_counter() - t0
        sb_s, sb_rewards, sb_errors = asyncio.run(ascore_all(sandbox, make, calls, args.concurrency))
        metrics = sandbox.metrics()
    assert sb_rewards == in_rewards, f"{name}: the sandbox scored differently from the in-process function"
    return {
        "reward": name,
        "calls": calls,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "in_process_calls_per_s": calls / in_s,
        "sandbox_calls_per_s": calls / sb_s,
        "sandbox_over_in_process": in_s / sb_s,
        "overhead_us_per_call": (sb_s - in_s) / calls * 1e6,
        "sandbox_startup_s": startup_s,
        "mean_reward": sum(in_rewards) / calls,
        "errors_in_process": in_errors,
        "errors_sandbox": sb_errors,
        "sandbox_failures": sum(v for k, v in metrics.items() if k.startswith("rollout/reward_failures_")),
    }


def main(argv: list[str] | None = None) -> int:
    p = parser("rewards", __doc__)
    p.add_argument("--calls", type=int, default=2000, help="exact_match calls per side")
    p.add_argument("--heavy-calls", type=int, default=64, help="math_verify / code_execution calls per side")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64, help="reward calls in flight (the rollout pool's)")
    p.add_argument("--rewards", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    args = p.parse_args(argv)
    names = args.rewards.split(",")
    for name in names:
        if name not in CASES:
            p.error(f"--rewards: unknown reward {name!r}; choose from {', '.join(CASES)}")
    rows = [bench_case(name, args) for name in names]
    first = rows[0]
    head = headline(
        f"{first['reward']} calls/s through the sandbox ({args.workers} workers, {args.concurrency} in flight)",
        round(first["sandbox_calls_per_s"], 1),
        "the same reward called in-process, same calls (a synchronous reward runs on the event loop: one at a time)",
        round(first["in_process_calls_per_s"], 1),
        ratio(first["sandbox_calls_per_s"], first["in_process_calls_per_s"]),
        "sandbox / in-process calls/s (>1: the sandbox is faster)",
    )
    details = {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(), "results": rows}
    emit("rewards", head, details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
