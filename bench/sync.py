"""Policy sync against a raw collective moving the same bytes, measured in the same run. Prints one JSON
object: the headline (the sync's median seconds, the raw transfer's as the baseline, ``ratio`` = raw / sync;
the target is >= 0.8), then the details.

--mode cpu (default): 4 processes over gloo, train DP 2 -> rollout TP 2. Effective GB/s of a full
  policy sync (StreamTransport: plan, bounded buckets, relay + fan-out, slicing, staging, commit)
  against a raw collective moving the same bytes over the same route as one message per row,
  measured in the same run on the same process groups. ``generation_paused_s`` is the time the
  engine must stop generating: for a staged receiver only the commit (``--commit swap``: a storage
  swap, as an eager engine allows; ``--commit copy``: staged -> live copy, as under CUDA graphs;
  receiving happens while it keeps generating), for ``--commit inplace`` the whole sync (received
  straight into the paused engine's tensors: no staging, no commit copy). ``--commit all`` runs one
  transport per commit, interleaved with the raw baseline (rotating which goes first), and reports
  each under ``by_commit`` (the headline is the first: copy). Over ``--repeats`` blocks of ``--iters``
  rounds the JSON gives the ratio of medians over all rounds, per block (and their median), best-of,
  and per-phase times of the slowest rank. ``vote_backend``: the commit vote's group (nccl on distinct
  GPUs, else gloo).

--mode gpu-stream: the same, NCCL data plane, bf16 Qwen2.5 shape (--shapes 1.5b), train DP on the first
  GPUs -> rollout TP on the remaining GPUs, or --overlap: rollout TP 2 on the two training GPUs too.
  Default: all three commits side by side (--commit copy|swap|inplace for one).

--mode gpu-colocated: one GPU, InPlaceTransport from fp32 trained tensors into a bf16 engine for
  Qwen2.5 0.5B / 1.5B shapes (a cast copy), and the aliased case (engine reads the trained bf16
  tensors: nothing moves). Baseline: one flat device copy of the same bytes. Target: < 50 ms 1.5B.
  ``--device cpu --shapes tiny`` runs it anywhere in a second.

    python -m bench.sync --mode cpu                      # ~15-20 s on 2 cores; add --profile-rank 2 for cProfile
    python -m bench.sync --mode gpu-colocated --shapes 0.5b,1.5b
    python -m bench.sync --mode gpu-stream --gpus 4 --shapes 1.5b --bucket-mb 256
    python -m bench.sync --mode gpu-stream --gpus 2 --train-dp 1 --shapes 1.5b --bucket-mb 256  # GPU 0 -> GPU 1
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from areno.sync.base import NamedTensorSource, TensorEngine, engine_receiver
from areno.sync.inplace import InPlaceTransport
from areno.sync.plan import shard_specs_from_tp_plan
from areno.sync.stream import StreamSyncConfig, StreamTopology, StreamTransport
from bench._common import emit, headline, parser, ratio, synced_s

TP_PLAN = {
    "model.layers.*.self_attn.[qkv]_proj.*": "colwise",
    "model.layers.*.self_attn.o_proj.weight": "rowwise",
    "model.layers.*.mlp.gate_proj.weight": "colwise",
    "model.layers.*.mlp.up_proj.weight": "colwise",
    "model.layers.*.mlp.down_proj.weight": "rowwise",
    "lm_head.weight": "colwise",
}

SHAPES = {  # Qwen2.5 shapes (tied embeddings)
    "0.5b": dict(hidden=896, layers=24, inter=4864, heads=14, kv_heads=2, vocab=151936, tied=True),
    "1.5b": dict(hidden=1536, layers=28, inter=8960, heads=12, kv_heads=2, vocab=151936, tied=True),
    "cpu": dict(hidden=512, layers=4, inter=1408, heads=8, kv_heads=4, vocab=16000, tied=False),
    "tiny": dict(hidden=64, layers=2, inter=128, heads=4, kv_heads=2, vocab=512, tied=False),  # smoke runs
}
MODE_SHAPES = {"cpu": "cpu", "gpu-stream": "1.5b", "gpu-colocated": "0.5b,1.5b"}
"""Default ``--shapes`` of each mode (the stream modes use the last shape listed)."""


def qwen2_shapes(hidden, layers, inter, heads, kv_heads, vocab, tied) -> dict[str, tuple[int, ...]]:
    hd = hidden // heads
    s = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s |= {
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.q_proj.bias": (heads * hd,),
            p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.k_proj.bias": (kv_heads * hd,),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.v_proj.bias": (kv_heads * hd,),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    s["model.norm.weight"] = (hidden,)
    if not tied:
        s["lm_head.weight"] = (vocab, hidden)
    return s


# ------------------------------------------------------------------------- stream (CPU or GPUs)
COMMITS = {"copy": "staged", "swap": "swap", "inplace": "inplace"}
"""Bench name of a receiver's commit -> ``engine_receiver(commit=)``."""


def raw_transfer(transport: StreamTransport, buffers: list[torch.Tensor]) -> float:
    """The baseline: each row's bytes (``buffers[row]``, one tensor of that row's size) as one message over
    the transport's own route (sender -> relay on the row's pair group, then the relay's broadcast to the
    rollout group), with no plan, packing, slicing or commit. Call on every rank; returns seconds on this rank."""
    t0 = time.perf_counter()
    for row, (sender, relay) in enumerate(zip(transport.topology.sender_ranks, transport.relays)):
        if transport.rank in (sender, relay):
            dist.broadcast(buffers[row], src=sender, group=transport.pair_groups[row])
        if transport.is_rollout and transport.rollout_group is not None:
            dist.broadcast(buffers[row], src=relay, group=transport.rollout_group)
    if transport.device.type == "cuda":
        torch.cuda.synchronize(transport.device)
    return time.perf_counter() - t0


def _stream_worker(rank: int, world: int, port: int, out: str, opts: dict) -> None:
    """One rank of train DP ``train_dp`` -> rollout TP (world - train_dp). The world is gloo
    (barriers, timing reductions); on GPU the transport's data plane is NCCL. One transport per
    commit in ``opts["commits"]`` (same source, each receiver its own live tensors), measured
    interleaved with the raw baseline."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    gpu = opts["gpu"]
    n_train = opts["train_dp"]
    commits = opts["commits"]
    train, rollout = tuple(range(n_train)), tuple(range(n_train, world))
    # Overlap: rollout rank i shares GPU i with training rank i (relays then cross GPUs).
    gpu_of = {r: (r if r < n_train else (r - n_train if opts["overlap"] else r)) for r in range(world)}
    device = torch.device(f"cuda:{gpu_of[rank]}") if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if gpu else torch.float32
    shapes = qwen2_shapes(**SHAPES[opts["shape"]])
    topo = StreamTopology(
        train_ranks=train,
        sender_ranks=train,
        rollout_ranks=rollout,
        devices={r: f"gpu{gpu_of[r]}" if gpu else f"cpu{r}" for r in range(world)},
    )
    source = None
    receivers = dict.fromkeys(commits)
    if rank in train:
        g = torch.Generator(device=device).manual_seed(0)
        weights = {n: torch.randn(s, generator=g, device=device).to(dtype) for n, s in shapes.items()}
        source = NamedTensorSource(lambda: weights.items())
    else:
        meta = [(n, s, dtype) for n, s in shapes.items()]
        specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=rank - n_train, tp_size=len(rollout))
        for commit in commits:
            engine = TensorEngine(
                {n: torch.zeros(sp.local_shape, dtype=dtype, device=device) for n, sp in specs.items()}
            )
            receivers[commit] = engine_receiver(engine, specs, commit=COMMITS[commit])
    cfg = StreamSyncConfig(
        bucket_bytes=opts["bucket_bytes"],
        timeout_s=300,
        direct_bytes=opts["direct_bytes"],
        fanout_all=opts["fanout_all"],
    )
    transports = {
        c: StreamTransport(
            topology=topo,
            config=cfg,
            source=source,
            receiver=receivers[c],
            device=device,
            backend="nccl" if gpu else None,
            tag=f"bench-{c}",
        )
        for c in commits
    }
    transport = transports[commits[0]]  # raw baseline: the same process groups as the first

    def slowest(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    phase_names = ("pack", "post", "wait", "stage", "vote", "commit")
    for t in transports.values():
        t.sync(0)  # warm-up: allocates buffers (and staging), creates communicators
    raw_buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in transport.plan.row_bytes]
    raw_transfer(transport, raw_buffers)
    raw_s: list[float] = []
    per = {
        c: {
            "sync_s": [],
            "paused_s": [],
            "transfer_s": [],
            "ratios": [],
            "phases": {f"{role}_{p}": [] for role in ("train", "rollout") for p in phase_names},
        }
        for c in commits
    }
    version = 0
    profiler = None
    if opts.get("profile_rank") == rank:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    arms = ["raw", *commits]
    for rep in range(opts["repeats"]):
        block_raw: list[float] = []
        block_sync: dict[str, list[float]] = {c: [] for c in commits}
        for it in range(opts["iters"]):
            # Interleaved, rotating which goes first, so load on a shared machine hits all alike.
            shift = (rep * opts["iters"] + it) % len(arms)
            for which in arms[shift:] + arms[:shift]:
                dist.barrier()
                if which == "raw":
                    block_raw.append(slowest([raw_transfer(transport, raw_buffers)])[0])
                    continue
                version += 1
                stats = transports[which].sync(version)
                ph = [transports[which].last_phases[p] for p in phase_names]
                role = [ph if rank in train else [0.0] * len(ph), ph if rank in rollout else [0.0] * len(ph)]
                total, transfer, paused, *per_role = slowest(
                    [
                        stats.total_time_s,
                        stats.transfer_time_s,
                        stats.as_metrics()["policy_sync_generation_paused_s"] if rank in rollout else 0.0,
                        *role[0],
                        *role[1],
                    ]
                )
                block_sync[which].append(total)
                per[which]["transfer_s"].append(transfer)
                per[which]["paused_s"].append(paused)
                for i, key in enumerate(per[which]["phases"]):
                    per[which]["phases"][key].append(per_role[i])
        raw_s += block_raw
        for c in commits:
            per[c]["sync_s"] += block_sync[c]
            per[c]["ratios"].append(statistics.median(block_raw) / statistics.median(block_sync[c]))
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(15)
        print(
            f"--- cProfile of rank {rank} (syncs and raw transfers), by own time ---\n{text.getvalue()}",
            file=sys.stderr,
        )
        # Python-level copy calls per sync (the raw transfers make none): each is one dispatch
        # (and, on GPU, at least one kernel launch) the host issues.
        calls: dict[str, int] = {}
        for (_, _, func), (_, ncalls, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
            for key in ("copy_", "_foreach_copy_", "write_rows", "view", "narrow"):
                if func in (
                    key,
                    f"<method '{key}' of 'torch._C.TensorBase' objects>",
                    f"<built-in method torch.{key}>",
                ):
                    calls[key] = calls.get(key, 0) + ncalls
        n_syncs = opts["repeats"] * opts["iters"] * len(commits)
        Path(out, "profile.json").write_text(
            json.dumps(
                {"rank": rank, "syncs": n_syncs, "calls_per_sync": {k: v / n_syncs for k, v in sorted(calls.items())}}
            )
        )
    dist.barrier()  # the profiled rank has written its counts
    if rank == 0:
        nbytes = transport.plan.total_bytes
        raw_med = statistics.median(raw_s)
        by_commit = {}
        for c in commits:
            sync_s = per[c]["sync_s"]
            sync_med = statistics.median(sync_s)
            by_commit[c] = {
                "sync_s_median": sync_med,
                "sync_gbps": nbytes / sync_med / 1e9,
                "ratio_sync_over_raw": raw_med / sync_med,
                "ratio_best_of": min(raw_s) / min(sync_s),
                "ratio_per_repeat": per[c]["ratios"],
                "ratio_median_of_repeats": statistics.median(per[c]["ratios"]),
                "transfer_s_median": statistics.median(per[c]["transfer_s"]),
                "generation_paused_s_median": statistics.median(per[c]["paused_s"]),
                "phases_s_median_slowest_rank": {k: statistics.median(v) for k, v in per[c]["phases"].items()},
                "sync_s_all": sync_s,
            }
        result = {
            "mode": "gpu-stream" if gpu else "cpu",
            "topology": f"train DP {n_train} -> rollout TP {len(rollout)} ({'nccl' if gpu else 'gloo'}, {world} processes"
            + (", overlapping GPUs" if gpu and opts["overlap"] else "")
            + ")",
            "shape": opts["shape"],
            "dtype": str(dtype).removeprefix("torch."),
            "bytes": nbytes,
            "sync_wire_bytes": transport.wire_bytes,
            "raw_wire_bytes": nbytes * (2 if len(rollout) > 1 else 1),
            "tensors": transport.plan.num_tensors,
            "buckets": len(transport.plan.buckets),
            "bucket_bytes": opts["bucket_bytes"],
            "direct_bytes": opts["direct_bytes"] or opts["bucket_bytes"] // 4,
            "vote_backend": transport.vote_backend,
            "fanout_all": opts["fanout_all"],
            "iters": opts["iters"],
            "repeats": opts["repeats"],
            "raw_s_median": raw_med,
            "raw_gbps": nbytes / raw_med / 1e9,
            "ratio_sync_over_raw_by_commit": {c: by_commit[c]["ratio_sync_over_raw"] for c in commits},
            "generation_paused_s_median_by_commit": {c: by_commit[c]["generation_paused_s_median"] for c in commits},
            "raw_s_all": raw_s,
            "peak_bucket_buffer_bytes": transport.peak_buffer_bytes,
        }
        if len(commits) == 1:
            result |= {"sync_commit": commits[0], **by_commit[commits[0]]}
        else:
            result["by_commit"] = by_commit
        if Path(out, "profile.json").exists():
            result["profile"] = json.loads(Path(out, "profile.json").read_text())
        Path(out, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def bench_stream(world: int, opts: dict) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_stream_worker, args=(world, port, out, opts), nprocs=world, join=True)
        return json.loads(Path(out, "result.json").read_text())


# ------------------------------------------------------------------------------ GPU colocated
def bench_gpu_colocated(shape_names: list[str], iters: int, device: str) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--mode gpu-colocated needs CUDA (or --device cpu for a smoke run)")
    results = {
        "mode": "gpu-colocated",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "shapes": {name: colocated_shape(name, iters, dev) for name in shape_names},
    }
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return results


def colocated_shape(name: str, iters: int, dev: torch.device) -> dict:
    """One shape's in-place syncs (fp32 -> bf16 cast, and aliased) against one flat copy of the same bytes."""
    shapes = qwen2_shapes(**SHAPES[name])
    trained = {n: torch.randn(s, device=dev) for n, s in shapes.items()}  # fp32 master weights
    engine = {n: torch.empty(s, device=dev, dtype=torch.bfloat16) for n, s in shapes.items()}
    nbytes = sum(t.numel() * 2 for t in engine.values())
    cast = InPlaceTransport(NamedTensorSource(trained.items), engine)
    trained_bf16 = {n: t.to(torch.bfloat16) for n, t in trained.items()}
    alias = InPlaceTransport(NamedTensorSource(trained_bf16.items), trained_bf16)
    flat_src = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
    flat_dst = torch.empty_like(flat_src)
    cast.sync(0), alias.sync(0)

    def raw() -> float:
        return synced_s(lambda: flat_dst.copy_(flat_src), dev)

    raw()
    cast_s = [cast.sync(i + 1).total_time_s for i in range(iters)]
    alias_s = [alias.sync(i + 1).total_time_s for i in range(iters)]
    raw_s = [raw() for _ in range(iters)]
    return {
        "params": sum(t.numel() for t in engine.values()),
        "engine_bytes_bf16": nbytes,
        "inplace_cast_fp32_to_bf16_ms_median": 1e3 * statistics.median(cast_s),
        "inplace_aliased_ms_median": 1e3 * statistics.median(alias_s),
        "raw_flat_copy_same_bytes_ms_median": 1e3 * statistics.median(raw_s),
        "generation_paused_ms_median": 1e3 * statistics.median(cast_s),
        "target_ms": 50.0,
    }


def sync_headline(result: dict) -> dict:
    """Stream modes: the first commit's median sync against the raw transfer; gpu-colocated: the first
    shape's cast sync against one flat copy of the same bytes."""
    if result["mode"] == "gpu-colocated":
        name, shape = next(iter(result["shapes"].items()))
        figure, base = shape["inplace_cast_fp32_to_bf16_ms_median"], shape["raw_flat_copy_same_bytes_ms_median"]
        return headline(
            f"ms per colocated in-place sync, fp32 -> bf16 cast ({name} shape, {result['device']})",
            figure,
            "one flat device copy of the same bytes",
            base,
            ratio(base, figure),
            "copy ms / sync ms (1: the sync costs one copy)",
        )
    commit = result.get("sync_commit") or next(iter(result["by_commit"]))
    figure = result["by_commit"][commit]["sync_s_median"] if "by_commit" in result else result["sync_s_median"]
    return headline(
        f"s per policy sync, {commit} commit ({result['shape']} shape, {result['bytes']} bytes, {result['topology']})",
        figure,
        "raw broadcasts of the same bytes over the same route and process groups",
        result["raw_s_median"],
        ratio(result["raw_s_median"], figure),
        "raw s / sync s (target >= 0.8)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = parser("sync", __doc__)
    ap.add_argument("--mode", choices=list(MODE_SHAPES), default="cpu")
    ap.add_argument("--gpus", type=int, default=4, help="gpu-stream: GPUs used (--train-dp train, the rest rollout TP)")
    ap.add_argument("--train-dp", type=int, default=2, help="stream modes: training (sending) ranks")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="gpu-stream: rollout TP 2 on the two training GPUs (4 processes on 2 GPUs)",
    )
    ap.add_argument("--bucket-mb", type=int, default=32, help="bucket size for the stream modes")
    ap.add_argument("--iters", type=int, default=9, help="stream modes: sync/raw pairs per repeat")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="stream modes: blocks of --iters pairs; the ratio is also reported per block (median)",
    )
    ap.add_argument(
        "--direct-mb",
        type=float,
        default=None,
        help="stream modes: chunks of at least this many MiB travel unpacked (default: a quarter bucket)",
    )
    ap.add_argument(
        "--fanout-all",
        action="store_true",
        help="stream modes: fan out every bucket, even those only the relay keeps (same wire bytes as raw)",
    )
    ap.add_argument(
        "--profile-rank",
        type=int,
        default=None,
        help="stream modes: cProfile this rank's loop and print its top functions to stderr",
    )
    ap.add_argument(
        "--commit",
        choices=["swap", "copy", "inplace", "all"],
        default=None,
        help="stream modes: the receiver's commit: storage swap (an eager engine; cpu default), copy "
        "from staging into live tensors (an engine under CUDA graphs), inplace (received straight "
        "into the paused engine's tensors) or all three side by side (gpu-stream default)",
    )
    ap.add_argument(
        "--shapes",
        default=None,
        help=f"comma list of {','.join(SHAPES)}: gpu-colocated runs each, the stream modes the last "
        f"(default per mode: {MODE_SHAPES})",
    )
    ap.add_argument("--device", default="cuda", help="gpu-colocated device (cpu for a smoke run)")
    args = ap.parse_args(argv)
    shapes = (args.shapes or MODE_SHAPES[args.mode]).split(",")
    for name in shapes:
        if name not in SHAPES:
            ap.error(f"--shapes: unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    commit = args.commit or ("swap" if args.mode == "cpu" else "all")
    commits = ["copy", "swap", "inplace"] if commit == "all" else [commit]
    stream_opts = dict(
        repeats=args.repeats,
        commits=commits,
        profile_rank=args.profile_rank,
        fanout_all=args.fanout_all,
        direct_bytes=int(args.direct_mb * (1 << 20)) if args.direct_mb is not None else None,
    )
    load = os.getloadavg()
    t0 = time.perf_counter()
    if args.mode == "cpu":
        opts = dict(
            gpu=False,
            overlap=False,
            shape=shapes[-1],
            bucket_bytes=args.bucket_mb << 20,
            iters=args.iters,
            train_dp=args.train_dp,
            **stream_opts,
        )
        result = bench_stream(args.train_dp + 2, opts)
    elif args.mode == "gpu-stream":
        n = args.train_dp
        if n < 1 or args.gpus < n or (not args.overlap and args.gpus < n + 1):
            raise SystemExit(
                f"--mode gpu-stream needs --gpus >= {n + 1} ({n} train + rollout), or >= {n} with --overlap"
            )
        world = n + (n if args.overlap else args.gpus - n)
        opts = dict(
            gpu=True,
            overlap=args.overlap,
            shape=shapes[-1],
            bucket_bytes=args.bucket_mb << 20,
            iters=args.iters,
            train_dp=n,
            **stream_opts,
        )
        result = bench_stream(world, opts)
    else:
        result = bench_gpu_colocated(shapes, args.iters, args.device)
    result["torch"] = torch.__version__
    result["cpus"] = os.cpu_count()
    result["load_avg_1m_before_after"] = [round(load[0], 2), round(os.getloadavg()[0], 2)]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit("sync", sync_headline(result), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
