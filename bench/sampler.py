"""Seeded sampling cost: inverse transform sampling (the engine's sampler) vs the exponential race
with per-token hash noise it replaced, side by side in one run on the same logits.

Both draw exactly from softmax(logits / T). The race (``baseline``, reproduced here from the
engine before 2026-11-30) hashes (seed, counter, vocabulary index) into Exp(1) noise for every
token, ~25 element-wise passes over [B, V]; the engine now draws one uniform per row from the
(seed, counter) hash and searches the cumulative distribution (softmax, cumsum, search).
Prints one JSON line per (rows, vocabulary): ms per call of each and the ratio.

    python bench/sampler.py                       # CPU, one thread
    python bench/sampler.py --device cuda --rows 64 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from areno.rollout.sampling import _MASK32, _MULS, _mix32, hash_uniform, inverse_cdf_draw  # noqa: E402
from bench.stamp import stamp  # noqa: E402


def _mix32_i32(h: torch.Tensor) -> torch.Tensor:
    for i, m in enumerate(_MULS):
        s = 16 if i % 2 == 0 else 15
        h = h ^ ((h >> s) & ((1 << (32 - s)) - 1))
        h = h * m
    return h ^ ((h >> 16) & 0xFFFF)


def baseline_draw(race_BV: torch.Tensor, seed_B: torch.Tensor, counter_B: torch.Tensor) -> torch.Tensor:
    """The replaced sampler: argmax(race - log E), E = Exp(1) noise hashed per token (int32 form)."""
    V = race_BV.shape[1]
    key_B = _mix32((seed_B & _MASK32) ^ _mix32(((seed_B >> 32) & _MASK32) ^ _mix32(counter_B & _MASK32)))
    key_B = torch.where(key_B >= 1 << 31, key_B - (1 << 32), key_B).to(torch.int32)
    idx_V = torch.arange(V, device=race_BV.device, dtype=torch.int32)
    h_BV = _mix32_i32(key_B[:, None] + idx_V[None, :] * (0x9E3779B1 - (1 << 32)))
    u_BV = (((h_BV >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (2.0**-23)
    noise_BV = -torch.log(u_BV)
    return (race_BV - noise_BV.clamp_min_(torch.finfo(torch.float32).tiny).log_()).argmax(dim=-1)


def engine_draw(race_BV: torch.Tensor, seed_B: torch.Tensor, counter_B: torch.Tensor) -> torch.Tensor:
    return inverse_cdf_draw(race_BV, hash_uniform(seed_B, counter_B))


def time_ms(fn, device: str, iters: int) -> float:
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, nargs="+", default=[64])
    p.add_argument("--vocab", type=int, nargs="+", default=[151_936])
    p.add_argument("--iters", type=int, default=None, help="calls timed (default: 3 on CPU, 50 on CUDA)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    iters = args.iters or (50 if args.device == "cuda" else 3)
    for B in args.rows:
        for V in args.vocab:
            g = torch.Generator().manual_seed(0)
            race = torch.randn(B, V, generator=g).mul_(3).to(args.device)
            seed = torch.arange(B, device=args.device)
            counter = torch.full((B,), 7, device=args.device)
            base = time_ms(lambda: baseline_draw(race, seed, counter), args.device, iters)
            new = time_ms(lambda: engine_draw(race, seed, counter), args.device, iters)
            print(
                json.dumps(
                    {
                        "bench": "sampler",
                        "device": args.device,
                        "rows": B,
                        "vocab": V,
                        "baseline_race_ms": round(base, 3),
                        "inverse_cdf_ms": round(new, 3),
                        "speedup": round(base / new, 2),
                        **stamp(),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
