"""Mixture-of-experts experts: the grouped path against the naive masked loop, on CPU or one GPU.

For each shape, random expert weights and uniformly random top-k routing of ``--tokens`` tokens;
times (median of ``--repeats``) of

- ``grouped`` (``areno.models.moe.grouped_experts``, what the decoder runs): the (token, expert)
  pairs sorted by expert, one GEMM per expert over its rows, one scatter-add back;
- ``naive`` (``moe.naive_experts``): every expert over every token, masked by its routing weight;
- ``grouped_mm`` (``moe.grouped_mm_experts``, what GPU inference runs), where it applies (bf16 on a
  Hopper-or-newer GPU: ``--device cuda --dtype bfloat16``), forward only;

forward only (``--backward`` adds the backward of a sum). Outputs are checked equal first.
GPU: ``python -m bench.moe --device cuda --dtype bfloat16 --tokens 4096``.
``ratio``: naive time over grouped time on the last shape.
"""

from __future__ import annotations

import statistics
import time

import torch

from areno.models import moe
from bench._common import emit, headline, parser, ratio

SHAPES = {
    "tiny": dict(hidden=64, experts=4, top_k=2, width=64),
    "small": dict(hidden=256, experts=16, top_k=2, width=256),
    "qwen3moe_like": dict(hidden=512, experts=64, top_k=8, width=128),
}
"""``tiny``: the tests' model; ``small``: 16 experts top-2; ``qwen3moe_like``: Qwen3-MoE's expert ratio
(E = 64, top-8, narrow experts) at a CPU-sized width."""


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_shape(name: str, tokens: int, repeats: int, backward: bool, device: str, dtype: torch.dtype) -> dict:
    s = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    e, d, i, k = s["experts"], s["hidden"], s["width"], s["top_k"]
    x = torch.randn(tokens, d, generator=g).to(device, dtype)
    gate_up = (torch.randn(e, 2 * i, d, generator=g) * d**-0.5).to(device, dtype)
    down = (torch.randn(e, d, i, generator=g) * i**-0.5).to(device, dtype)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(device)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(device, dtype)
    for t in (x, gate_up, down):
        t.requires_grad_(backward)
    args = (x, experts, weights, gate_up, down)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(moe.grouped_experts(*args), moe.naive_experts(*args), rtol=tol, atol=tol)

    def make(fn):
        def call():
            with torch.set_grad_enabled(backward):
                out = fn(*args)
                if backward:
                    out.sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()

        return call

    grouped = _time(make(moe.grouped_experts), repeats)
    naive = _time(make(moe.naive_experts), repeats)
    row = dict(shape=name, **s, tokens=tokens, grouped_ms=grouped * 1e3, naive_ms=naive * 1e3, speedup=naive / grouped)
    if not backward and moe._grouped_mm_fits(x, down):
        row["grouped_mm_ms"] = _time(make(moe.grouped_mm_experts), repeats) * 1e3
    return row


def main() -> None:
    p = parser("moe", __doc__)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--backward", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = [run_shape(n, args.tokens, args.repeats, args.backward, args.device, dtype) for n in args.shapes.split(",")]
    last = rows[-1]
    head = headline(
        "grouped experts ms", last["grouped_ms"], "naive masked loop ms", last["naive_ms"],
        ratio(last["naive_ms"], last["grouped_ms"]), "naive / grouped (higher is better)",
    )  # fmt: skip
    details = {"device": args.device, "dtype": args.dtype, "backward": args.backward, "threads": args.threads}
    emit("moe", head, {**details, "runs": rows})


if __name__ == "__main__":
    main()
