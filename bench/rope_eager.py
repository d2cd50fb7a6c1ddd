"""Eager RoPE of a fused q/k/v product (CPU): two ``eager_rope`` calls (q heads, then k heads) against
one call over the adjacent q and k columns (``Attention.forward``), in one process, alternating;
checks both give the same tensors bit for bit. Prints one JSON object (median microseconds per layer).

    python bench/rope_eager.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areno.models.decoder import eager_rope
from bench.stamp import stamp

SHAPES = {  # rows, q heads, k heads, head dim
    "demo-like 64 rows": (64, 4, 2, 8),
    "demo-like 256 rows": (256, 4, 2, 8),
    "cpu20m 32 rows": (32, 8, 4, 32),
    "qwen0.5b 32 rows": (32, 14, 2, 64),
}


def two_calls(qkv, T, hq, hk, D, cos, sin):
    q, k = qkv[:, : hq * D].view(T, hq, D), qkv[:, hq * D : (hq + hk) * D].view(T, hk, D)
    return eager_rope(q, cos, sin), eager_rope(k, cos, sin)


def one_call(qkv, T, hq, hk, D, cos, sin):
    qk = eager_rope(qkv[:, : (hq + hk) * D].view(T, hq + hk, D), cos, sin)
    return qk[:, :hq], qk[:, hq:]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=2000, help="calls per timing")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {}
    for name, (T, hq, hk, D) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        qkv = torch.randn(T, (hq + 2 * hk) * D, generator=g)
        cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
        a, b = two_calls(qkv, T, hq, hk, D, cos, sin), one_call(qkv, T, hq, hk, D, cos, sin)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        us = {"two_calls": [], "one_call": []}
        for _ in range(args.rounds):
            for label, fn in (("two_calls", two_calls), ("one_call", one_call)):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn(qkv, T, hq, hk, D, cos, sin)
                us[label].append(1e6 * (time.perf_counter() - t0) / args.calls)
        med = {k: round(statistics.median(v), 1) for k, v in us.items()}
        out[name] = {**med, "speedup": round(med["two_calls"] / med["one_call"], 2), "bit_identical": same}
    print(json.dumps({"bench": "rope_eager", "threads": torch.get_num_threads(), "us_per_layer": out, **stamp()}))


if __name__ == "__main__":
    main()
