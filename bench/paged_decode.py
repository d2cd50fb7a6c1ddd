"""The paged decode attention kernel alone (``paged_decode_rotary``, the pure-decode path of the rollout
engine on CUDA): microseconds per layer at a model's head layout, for each batch size and context, with
the engine's launch settings (``auto_num_splits``, ``NUM_STAGES``) and with the split rule and pipelining
stages it used before (split count rounded up, three stages) side by side in one process. Each case
replays a CUDA graph of ``--layers`` launches over separate K/V pools (as a decode step does: one pool
per layer, so L2 holds none of them from the previous launch), median of 5 timings of 20 replays.

    python -m bench.paged_decode                                  # 0.5B heads (14 q, 2 KV, dim 64)
    python -m bench.paged_decode --heads 12 2 128 --rows 64 256   # 1.5B heads
    python -m bench.paged_decode --sweep-splits 1 2 3 4 6 8 --sweep-stages 2 3   # every split count too

Prints one JSON object: ``figure`` the mean over cases of the engine's setting (us per layer),
``baseline`` the old rule's mean, ``ratio`` = baseline / figure (> 1: the engine's setting faster), then per
case both times and, with ``--sweep-*``, every split count x stages. CUDA only.
"""

from __future__ import annotations

import itertools
import statistics
import sys

import torch

from areno.rollout import paged_decode as pd
from areno.rollout.engine import RolloutEngineConfig
from bench._common import emit, graphed_us, headline, parser, ratio

BLOCK_SIZE = RolloutEngineConfig.block_size  # the engine's default KV block


def old_num_splits(num_seqs: int, num_kv_heads: int, max_keys: int, tile: int, sms: int) -> int:
    """The split rule before 6c2acc8: programs per SM rounded up to ``SPLIT_TARGET_PROGRAMS_PER_SM``."""
    want = -(-pd.SPLIT_TARGET_PROGRAMS_PER_SM * sms // (num_seqs * num_kv_heads))
    return max(1, min(pd.MAX_SPLITS, -(-max_keys // tile), want))


def make_case(rows: int, ctx: int, width: int, heads: tuple[int, int, int], layers: int, seed: int = 0) -> dict:
    """Random pools for ``layers`` layers, a shuffled block table ``width`` blocks wide, contexts ``ctx`` to
    ``ctx + 15``, and one step's fused q/k/v product (bf16)."""
    hq, hkv, dh = heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    slots = rows * width * BLOCK_SIZE
    pools = [
        (
            torch.randn(slots, hkv, dh, device=dev, dtype=dt, generator=g),
            torch.randn(slots, hkv, dh, device=dev, dtype=dt, generator=g),
        )
        for _ in range(layers)
    ]
    table = torch.randperm(rows * width, device=dev, generator=g).to(torch.int32).view(rows, width)
    ctx_B = torch.randint(ctx, ctx + 16, (rows,), device=dev, dtype=torch.int32, generator=g)
    pos = ctx_B.long() - 1
    slot_B = table.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1).long() * BLOCK_SIZE + pos % BLOCK_SIZE
    return {
        "pools": pools,
        "table": table,
        "ctx": ctx_B,
        "slot": slot_B,
        "qkv": torch.randn(rows, (hq + 2 * hkv) * dh, device=dev, dtype=dt, generator=g),
        "cos": torch.randn(rows, dh // 2, device=dev, dtype=dt, generator=g),
        "sin": torch.randn(rows, dh // 2, device=dev, dtype=dt, generator=g),
        "heads": heads,
    }


def time_per_layer(case: dict, splits: int, stages: int, tile: int) -> float:
    """Microseconds per layer: a CUDA graph of one launch per layer, median of 5 x 20 replays."""
    hq, hkv, _ = case["heads"]

    def step() -> None:
        for k_S, v_S in case["pools"]:
            pd.paged_decode_rotary(
                case["qkv"], hq, hkv, case["cos"], case["sin"], k_S, v_S, case["slot"], case["table"], case["ctx"],
                BLOCK_SIZE, tile=tile, num_splits=splits, num_stages=stages,
            )  # fmt: skip

    return graphed_us(step, len(case["pools"]))


def main(argv: list[str] | None = None) -> dict:
    p = parser("paged_decode", __doc__)
    p.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("HQ", "HKV", "DH"))
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="sequences per decode step")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 320, 560], help="keys per sequence (+0-15)")
    p.add_argument("--width", type=int, default=40, help="block-table width in blocks of 16 (>= the contexts)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--tile", type=int, default=64, help="keys per loop iteration (the engine's default: 64)")
    p.add_argument("--sweep-splits", type=int, nargs="*", default=[], help="also time these split counts")
    p.add_argument("--sweep-stages", type=int, nargs="*", default=[], help="... at these stages (default: both)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not pd.triton_available():
        p.error("the paged decode kernel runs on CUDA with triton: run this on a GPU machine")
    if max(args.contexts) + 16 > args.width * BLOCK_SIZE:
        p.error(f"--width {args.width} blocks hold {args.width * BLOCK_SIZE} keys: raise it above the contexts")
    heads = tuple(args.heads)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_keys = args.width * BLOCK_SIZE
    cases = []
    for rows, ctx in itertools.product(args.rows, args.contexts):
        case = make_case(rows, ctx, args.width, heads, args.layers)
        new_splits = pd.auto_num_splits(rows, heads[1], max_keys, args.tile, torch.device("cuda"))
        old_splits = old_num_splits(rows, heads[1], max_keys, args.tile, sms)
        row = {
            "rows": rows,
            "ctx": ctx,
            "splits": new_splits,
            "stages": pd.NUM_STAGES,
            "us": time_per_layer(case, new_splits, pd.NUM_STAGES, args.tile),
            "old_splits": old_splits,
            "old_stages": 3,
            "old_us": time_per_layer(case, old_splits, 3, args.tile),
        }
        if args.sweep_splits:
            stages = args.sweep_stages or [2, 3]
            sweep = {
                f"s{s}_st{st}": time_per_layer(case, s, st, args.tile)
                for s, st in itertools.product(args.sweep_splits, stages)
            }
            row["sweep"] = sweep
            row["best"] = min(sweep, key=sweep.get)
        print(f"rows {rows} ctx {ctx}: {row['us']} us ({row['old_us']} before)", file=sys.stderr, flush=True)
        cases.append(row)
        del case
        torch.cuda.empty_cache()
    figure = statistics.mean(c["us"] for c in cases)
    baseline = statistics.mean(c["old_us"] for c in cases)
    head = headline(
        f"paged decode attention, us per layer (heads {heads}, mean over cases)",
        round(figure, 2),
        "split count rounded up, 3 stages (the engine's launch before 6c2acc8), same process",
        round(baseline, 2),
        ratio(baseline, figure),
        "baseline us / engine us (>1: the engine's launch faster)",
    )
    details = {
        "heads": list(heads),
        "sms": sms,
        "layers": args.layers,
        "tile": args.tile,
        "kv_mb_per_layer": {
            f"{c['rows']}x{c['ctx']}": round(c["rows"] * (c["ctx"] + 8) * heads[1] * heads[2] * 4 / 1e6, 2)
            for c in cases
        },
        "cases": cases,
        "device": torch.cuda.get_device_name(0),
    }
    return emit("paged_decode", head, details)


if __name__ == "__main__":
    main()
