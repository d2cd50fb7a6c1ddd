"""A GRPO group per HTTP request vs a request per sample, against one served rollout engine.

``areno serve``'s app on a real port with a tiny random model; ``HTTPRolloutClient`` sends
``--prompts`` x ``--samples`` completions (temperature 1, per-sample seeds) either one request per
sample (``agenerate``) or one per group (``agenerate_many`` -> ``POST /generate_many``), the two
ways interleaved ``--rounds`` times in one process. Prints one JSON object: wall seconds, engine
steps and prefix hit rate per round.

    python bench/served_groups.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from areno.launch.scheduler import free_port
    from areno.models.decoder import Decoder
    from areno.models.hf_io import tiny_config
    from areno.rollout.client import HTTPRolloutClient
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.rollout.server import create_app
    from areno.types import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = tiny_config(64, hidden_size=args.hidden, layers=args.layers, heads=4, kv_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    engine = RolloutEngine(
        Decoder(cfg).eval(), cfg, config=RolloutEngineConfig(num_blocks=4096, block_size=16), eos_token_ids=(2,)
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)

    prompts = [[5 + (i % 50)] * 20 for i in range(args.prompts)]

    def group(i: int) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=1.0, max_new_tokens=args.tokens, min_new_tokens=args.tokens, seed=args.samples * i + j
            )
            for j in range(args.samples)
        ]

    async def run() -> dict:
        client = HTTPRolloutClient(f"http://127.0.0.1:{port}")
        ways = {
            "per_sample": lambda: asyncio.gather(
                *[client.agenerate(pr, sp) for i, pr in enumerate(prompts) for sp in group(i)]
            ),
            "per_group": lambda: asyncio.gather(*[client.agenerate_many(pr, group(i)) for i, pr in enumerate(prompts)]),
        }
        for way in ways.values():  # warm-up
            await way()
        out: dict[str, list] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                s0, t0 = engine.stats(), time.perf_counter()
                await way()
                wall, s1 = time.perf_counter() - t0, engine.stats()
                out[name].append(
                    {
                        "wall_s": round(wall, 3),
                        "engine_steps": s1["steps"] - s0["steps"],
                        "prefix_hit_rate": round(s1["prefix_hit_rate"], 3),
                    }
                )
        await client.aclose()
        return out

    rounds = asyncio.run(run())
    server.should_exit = True
    ratio = [a["wall_s"] / b["wall_s"] for a, b in zip(rounds["per_sample"], rounds["per_group"])]
    print(
        json.dumps(
            {
                "bench": "served_groups",
                "config": vars(args),
                "torch": torch.__version__,
                "rounds": rounds,
                "per_sample_over_per_group_wall": [round(r, 2) for r in ratio],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
