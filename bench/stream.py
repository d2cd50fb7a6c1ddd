"""Streamed against unstreamed answers of ``areno serve``: what ``stream=true`` costs and what it gives.

One server (areno's OpenAI-compatible app on uvicorn, in this process) over a random-init model;
``--concurrent`` ``/v1/completions`` requests of ``--max-tokens`` sampled tokens each (fixed length,
seeded), sent all at once, unstreamed and streamed in turn (each first in every other round), ``--rounds``
times. Reported
per arm: the wall time of the whole burst (medians over the rounds) and, streamed, the time to each
request's first chunk with text. ``ratio``: unstreamed wall over streamed wall (1.0: streaming costs
nothing); ``first_chunk_vs_answer``: the streamed median time to first text over the unstreamed median
time to the whole answer.

    python -m bench.stream --hidden 256 --layers 4 --concurrent 16 --max-tokens 128 --rounds 5
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench._common import emit, headline, parser, ratio


async def _one(client: httpx.AsyncClient, base: str, body: dict, t0: float) -> tuple[float, float | None]:
    """``(seconds to the whole answer, seconds to the first chunk with text or None)``, from ``t0``."""
    if not body.get("stream"):
        r = await client.post(f"{base}/v1/completions", json=body)
        r.raise_for_status()
        return time.perf_counter() - t0, None
    first = None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0]["text"]:
                    first = time.perf_counter() - t0
    return time.perf_counter() - t0, first


async def _burst(base: str, args, stream: bool, seed: int) -> dict:
    bodies = [
        {
            "prompt": "hello",
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "seed": seed + i,
            "ignore_eos": True,
            "stream": stream,
        }
        for i in range(args.concurrent)
    ]
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, base, b, t0) for b in bodies))
        wall = time.perf_counter() - t0
    firsts = [f for _, f in results if f is not None]
    return {
        "wall_s": wall,
        "answer_median_s": statistics.median(a for a, _ in results),
        "first_text_median_s": statistics.median(firsts) if firsts else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser("stream", __doc__)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-steps", type=int, default=0, help="rollout engine decode_steps (0: its default)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.concurrent < 1 or args.max_tokens < 1:
        p.error("--rounds, --concurrent and --max-tokens must be at least 1")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)


def _run(args) -> int:
    """One measured run (see the module docstring)."""
    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.hf_io import init_model_dir, tiny_config
    from areno.rollout.server import ServerThread, build_engine, create_app

    tokenizer = build_char_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        config = tiny_config(len(tokenizer), hidden_size=args.hidden, layers=args.layers)
        init_model_dir(model_dir, config, tokenizer, seed=0)
        engine, tok = build_engine(
            str(model_dir), device="cpu", max_model_len=args.max_tokens + 64, decode_steps=args.decode_steps
        )
        app = create_app(engine, tokenizer=tok, model_name="bench")
        server = ServerThread(app, log_level="error", name="bench-server").start()
        base = server.base_url
        try:
            asyncio.run(_burst(base, args, False, 0))  # warm-up, both paths
            asyncio.run(_burst(base, args, True, 0))
            arms: dict[str, list[dict]] = {"unstreamed": [], "streamed": []}
            for r in range(args.rounds):
                order = (
                    ("unstreamed", "streamed") if r % 2 == 0 else ("streamed", "unstreamed")
                )  # neither always second
                for name in order:
                    arms[name].append(asyncio.run(_burst(base, args, name == "streamed", 1000 * (r + 1))))
                    print(f"round {r}: {name} {arms[name][-1]}", file=sys.stderr)
        finally:
            server.stop()
            app.state.client.close()

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in arms[name])

    streamed, unstreamed = med("streamed", "wall_s"), med("unstreamed", "wall_s")
    first = med("streamed", "first_text_median_s")
    head = headline(
        f"seconds for {args.concurrent} concurrent completions of {args.max_tokens} tokens, streamed",
        round(streamed, 3),
        "the same requests unstreamed, same server",
        round(unstreamed, 3),
        ratio(unstreamed, streamed),
        "unstreamed / streamed wall time (1.0: streaming costs nothing)",
    )
    emit(
        "stream",
        head,
        {
            "first_text_median_s": round(first, 4),
            "unstreamed_answer_median_s": round(med("unstreamed", "answer_median_s"), 4),
            "first_chunk_vs_answer": ratio(first, med("unstreamed", "answer_median_s")),
            "rounds": arms,
            "shape": {"hidden": args.hidden, "layers": args.layers, "vocab": len(tokenizer)},
            "decode_steps": engine.decode_steps,
            "threads": args.threads,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
