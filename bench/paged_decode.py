"""Decode attention alone: ``decode_attention="gather"`` vs ``"paged"`` on one layer, side by side.

    python bench/paged_decode.py                         # CPU, Qwen2.5-0.5B heads, 64 and 256 sequences
    python bench/paged_decode.py --device cuda           # GPU: SDPA over the gathered copy vs the Triton kernel

Each sequence has a random context in ``--ctx MIN MAX`` stored in distinct random blocks of a pool;
block tables are padded to the longest context as the CUDA-graph runner pads them (power of two up
to 16 blocks, then multiples of 16). One call = ``PagedAttention.for_decode(...)(layer, q, k, v)``:
the new K/V write plus attention, as the engine runs it per layer per decode step. Reports ms per
call (median of ``--reps``), the max abs difference between the two paths, and the K/V bytes per
call over the time (``kv_GBs``: the bytes of the real contexts, read once). On CUDA the calls run
inside a captured CUDA graph (as in the engine), and ``paged_ms_by_splits`` times the Triton kernel alone
(no K/V write) for each ``--splits`` value (split-K programs per sequence and KV head; the engine uses
the automatic choice, reported as ``auto_splits``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areno.rollout.attention import PagedAttention
from areno.rollout.cuda_graph import padded_num_blocks
from areno.rollout.kv_cache import KVCache
from bench.stamp import stamp


def setup(B: int, args, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(B)
    bs = args.block_size
    ctx = torch.randint(args.ctx[0], args.ctx[1] + 1, (B,), generator=g)
    need = (-(-ctx // bs)).tolist()
    N = padded_num_blocks(max(need))
    cache = KVCache(
        num_layers=1,
        num_blocks=sum(need) + 1,
        block_size=bs,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=dtype,
        device=torch.device(device),
    )
    cache.k_S[0].normal_()
    cache.v_S[0].normal_()
    perm = torch.randperm(sum(need), generator=g).tolist()
    rows = []
    for n in need:
        rows.append(perm[:n] + [cache.scratch_block] * (N - n))
        perm = perm[n:]
    bt_BN = torch.tensor(rows, device=device)
    ctx_B = ctx.to(device)
    q = torch.randn(B, args.heads, args.head_dim, generator=g).to(device, dtype)
    kv = torch.randn(B, args.kv_heads, args.head_dim, generator=g).to(device, dtype)
    return cache, bt_BN, ctx_B, q, kv, int(ctx.sum())


def time_calls(fn, device: str, reps: int) -> float:
    if device.startswith("cuda"):
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        torch.cuda.synchronize()
    else:
        run = fn
        run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument(
        "--ctx",
        type=int,
        nargs=2,
        default=(272, 576),
        metavar=("MIN", "MAX"),
        help="context lengths (default: bench/rollout.py qwen0.5b prompts 16-64 + 256-512 generated)",
    )
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=None, help="default 200 on cuda, 10 on cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8], help="CUDA: split-K values to time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    reps = args.reps or (200 if device.startswith("cuda") else 10)
    result: dict = {
        "bench": "paged_decode",
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "ctx": list(args.ctx),
        "threads": torch.get_num_threads(),
        "runs": [],
    }
    itemsize = torch.empty((), dtype=dtype).element_size()
    for B in args.batch:
        cache, bt_BN, ctx_B, q, kv, total_ctx = setup(B, args, device, dtype)
        outs, ms = {}, {}
        for mode in ("gather", "paged"):
            fn = lambda m=mode: PagedAttention.for_decode(cache, bt_BN, ctx_B, None, decode_attention=m)(0, q, kv, kv)
            outs[mode] = fn().float()
            ms[mode] = 1e3 * time_calls(fn, device, reps)
        kv_bytes = 2 * total_ctx * args.kv_heads * args.head_dim * itemsize
        extra = {}
        if device.startswith("cuda"):
            from areno.rollout import paged_decode as pd

            k_S, v_S, bs = cache.k_S[0], cache.v_S[0], args.block_size
            by = {}
            for sp in args.splits:
                fn = lambda sp=sp: pd.paged_decode_triton(q, k_S, v_S, bt_BN, ctx_B, bs, num_splits=sp)
                diff = float((fn().float() - outs["gather"]).abs().max())
                by[sp] = {"ms": round(1e3 * time_calls(fn, device, reps), 4), "max_abs_diff": diff}
            extra = {
                "paged_ms_by_splits": by,
                "auto_splits": pd.auto_num_splits(B, args.kv_heads, bt_BN.shape[1] * bs, 64, q.device),
            }
        result["runs"].append(
            {
                **extra,
                "batch": B,
                "table_blocks": bt_BN.shape[1],
                "mean_ctx": round(total_ctx / B, 1),
                "gather_ms": round(ms["gather"], 3),
                "paged_ms": round(ms["paged"], 3),
                "speedup": round(ms["gather"] / ms["paged"], 2),
                "max_abs_diff": float((outs["gather"] - outs["paged"]).abs().max()),
                "gather_kv_GBs": round(kv_bytes / ms["gather"] / 1e6, 1),
                "paged_kv_GBs": round(kv_bytes / ms["paged"] / 1e6, 1),
            }
        )
    if device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    result.update(stamp())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
