"""Host (CPU-side) cost of one training step, measured where the model's compute is negligible.

The real ``FSDP2TrainBackend.train_step`` path (one gloo rank, FSDP2, fp32 master weights,
forward + backward + AdamW + grad-norm clipping) on a model of the 0.5B *depth* but tiny width
(24 layers, hidden 64, 4 / 2 heads, vocabulary 2,048, tied head) and micro-batches of a few short
packed sequences: what remains of a step's time is Python, the dispatcher, FSDP2's hooks, DTensor
dispatch and our own code — the per-kernel host cost that leaves the H200 idle on the real 0.5B
step (bench/RESULTS.md "Training (issue #4)").

Time is *process CPU time* (``time.process_time``: steadier than wall time on a shared, loaded
machine), with one intra-op thread; on CUDA read ``wall_ms_per_step_rounds`` (synchronisation
spins on the CPU). ``--arms`` picks which host-side optimisations of the backend run
(``areno.train.backend.HOST_OPTIMIZATIONS``, ``none``, ``all`` or names joined by ``+``); the
default compares ``none`` (before) against ``all`` side by side in one process, arms alternating
within each round, each on its own backend from the same checkpoint and the same batches, and
checks that every arm ends with identical losses, grad norms and weights.

Usage:
    python bench/train_host.py                          # none vs all, 24 layers, 4 micro-batches
    python bench/train_host.py --arms none one_fsdp_group local_shards+fsdp_flags all --floor
    python bench/train_host.py --layers 12 --mbs 8 --count-ops
    python bench/train_host.py --profile all            # top host ops (torch.profiler, self CPU)
    python bench/train_host.py --cprofile none          # top Python functions (cProfile, tottime)
    python bench/train_host.py --device cuda --floor    # the same on a GPU host (bf16 compute)
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config
from areno.models.logprobs import packed_logprobs
from areno.train import FSDP2TrainBackend, TrainBackendConfig
from areno.train import backend as backend_module
from areno.types import TokenBatch
from bench.stamp import stamp


def make_batch(lengths: list[int], vocab: int, seed: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    T = cu[-1]
    loss_mask_T = torch.ones(T, dtype=torch.bool)
    loss_mask_T[torch.tensor(cu[:-1])] = False
    return TokenBatch(
        input_ids_T=torch.randint(3, vocab, (T,), generator=gen),
        cu_seqlens_B1=torch.tensor(cu),
        loss_mask_T=loss_mask_T,
        logprobs_T=torch.zeros(T),
        versions_T=torch.zeros(T, dtype=torch.long),
        advantages_T=torch.randn(T, generator=gen),
        rewards_B=torch.zeros(len(lengths)),
    )


def make_forward(chunk_size: int):
    def forward(model, mb):
        logprobs_T, _ = packed_logprobs(model, mb.input_ids_T, mb.cu_seqlens_B1, chunk_size=chunk_size)
        return {"logprobs_T": logprobs_T}

    return forward


def loss_fn(output, mb, reducer):
    """Token-mean policy-gradient-like loss with two metrics (what a recipe's loss returns)."""
    logprobs_T = output["logprobs_T"]
    loss = reducer(-logprobs_T * mb.advantages_T, mb.loss_mask_T)
    return loss, {
        "nll_sum": reducer(-logprobs_T.detach(), mb.loss_mask_T),
        "adv_sum": reducer(mb.advantages_T, mb.loss_mask_T),
    }


def denominator_fn(mb):
    return mb.loss_mask_T.sum()


def init_world(device: str) -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + random.Random().randrange(2000)))
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def parse_arm(name: str) -> frozenset[str]:
    known = backend_module.HOST_OPTIMIZATIONS
    if name == "all":
        return frozenset(known)
    if name == "none":
        return frozenset()
    parts = frozenset(name.split("+"))
    if not parts <= known:
        raise ValueError(f"--arms: {name!r}: each '+'-joined part must be one of {sorted(known)}, 'all' or 'none'")
    return parts


def build(model_dir: Path, args, opts: frozenset[str]) -> FSDP2TrainBackend:
    cfg = TrainBackendConfig(
        lr=1e-3,
        device=args.device,
        max_tokens_per_mb=args.seqs_per_mb * args.seq_len,
        param_dtype=args.param_dtype,
        grad_clip=args.grad_clip,
        compile=args.compile,
        logprob_chunk_size=args.chunk,
    )
    backend = FSDP2TrainBackend(cfg)
    backend.host_optimizations = opts
    backend.initialize(model_dir)
    return backend


def run_steps(backend, batches, forward, sync) -> tuple[float, float, list[dict]]:
    sync()
    c0, w0 = time.process_time(), time.perf_counter()
    metrics = [
        backend.train_step(b, forward_fn=forward, loss_fn=loss_fn, denominator_fn=denominator_fn) for b in batches
    ]
    sync()
    return time.process_time() - c0, time.perf_counter() - w0, metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=4, help="micro-batches per step")
    p.add_argument("--seqs-per-mb", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4096, help="log-prob chunk size (bench/train.py uses 4096)")
    p.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (slow to start on CPU)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before each arm's timed ones, every round")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds over the arms (median kept)")
    p.add_argument(
        "--arms",
        nargs="+",
        default=["none", "all"],
        help="'none', 'all' or '+'-joined names of areno.train.backend.HOST_OPTIMIZATIONS",
    )
    p.add_argument("--profile", metavar="ARM", help="torch.profiler (CPU) of one step of ARM: top ops by self CPU time")
    p.add_argument("--cprofile", metavar="ARM", help="cProfile of the timed steps of ARM: top functions by tottime")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time LocalTrainBackend (no FSDP, no DTensor) on the same steps: what the model's "
        "own ops cost on the host",
    )
    p.add_argument(
        "--count-ops",
        action="store_true",
        help="count the aten ops of one step per arm (torch.profiler): a proxy for kernel launches",
    )
    p.add_argument(
        "--named-weights",
        action="store_true",
        help="also time a policy sync's read of the weights (named_weights) against full_tensor per tensor",
    )
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    try:
        arms = {name: parse_arm(name) for name in args.arms}
        for extra in (args.profile, args.cprofile):
            if extra:
                arms.setdefault(extra, parse_arm(extra))
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(args.threads)
    init_world(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    tok = build_char_tokenizer()
    config = tiny_config(
        args.vocab, hidden_size=args.hidden, layers=args.layers, heads=4, kv_heads=2, tie_word_embeddings=True
    )
    lengths = [args.seq_len] * (args.seqs_per_mb * args.mbs)
    n_batches = args.warmup + args.steps
    batches = [make_batch(lengths, args.vocab, s) for s in range(n_batches)]
    forward = make_forward(args.chunk)
    report: dict = {
        "bench": "train_host",
        **stamp(),
        "device": args.device,
        "torch": torch.__version__,
        "threads": args.threads,
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "time": "process CPU ms per train_step (median over rounds; arms alternate within each round)",
        "model": f"qwen2-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, tied",
        "step": f"{args.mbs} micro-batches x {args.seqs_per_mb} seqs x {args.seq_len} tokens, FSDP2 one rank",
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model_dir(Path(tmp) / "m", config, tok, seed=0)
        backends = {name: build(model_dir, args, opts) for name, opts in arms.items()}
        cpu_ms: dict[str, list[float]] = {name: [] for name in args.arms}
        wall_ms: dict[str, list[float]] = {name: [] for name in args.arms}
        losses: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        for r in range(args.rounds):
            for name in args.arms:
                backend = backends[name]
                # each arm keeps training on the same batch sequence: its losses compare step by step
                _, _, warm = run_steps(backend, batches[: args.warmup], forward, sync)
                c, w, metrics = run_steps(backend, batches[args.warmup :], forward, sync)
                cpu_ms[name].append(1e3 * c / args.steps)
                wall_ms[name].append(1e3 * w / args.steps)
                losses[name] += [(m["loss"], m["grad_norm"]) for m in warm + metrics]
        arms_out = {}
        for name in args.arms:
            med = sorted(cpu_ms[name])[len(cpu_ms[name]) // 2]
            arms_out[name] = {
                "optimizations": sorted(arms[name]),
                "host_ms_per_step": round(med, 2),
                "host_ms_per_step_min": round(min(cpu_ms[name]), 2),
                "host_ms_per_micro_batch": round(med / args.mbs, 2),
                "host_ms_per_step_rounds": [round(x, 2) for x in cpu_ms[name]],
                "wall_ms_per_step_rounds": [round(x, 2) for x in wall_ms[name]],
            }
        report["arms"] = arms_out
        first = args.arms[0]
        report["speedup_vs_" + first] = {
            n: round(arms_out[first]["host_ms_per_step"] / a["host_ms_per_step"], 3) for n, a in arms_out.items()
        }
        # the steadier figure on a shared machine: the ratio within each round (arms run back to back)
        report["paired_speedup_vs_" + first] = {
            n: round(sorted(f / x for f, x in zip(cpu_ms[first], cpu_ms[n]))[args.rounds // 2], 3) for n in args.arms
        }
        # every arm ran the same steps on the same batches: losses, grad norms and weights must agree
        report["identical_losses_and_grad_norms"] = {n: losses[n] == losses[first] for n in args.arms}
        ref_weights = dict(backends[first].named_weights())
        report["identical_weights"] = {
            n: all(torch.equal(w, ref_weights[k]) for k, w in backends[n].named_weights()) for n in args.arms
        }
        if args.count_ops:  # deterministic, unlike time on a shared machine
            for name in args.arms:
                arms_out[name]["aten_ops_per_step"] = profile_step(backends[name], batches[0], forward, 0)["op_calls"]
        if args.floor:
            report["floor_local_backend"] = local_floor(model_dir, args, batches, forward)
        if args.named_weights:
            report["named_weights"] = time_named_weights(backends[args.arms[-1]], args.rounds)
        if args.profile:
            report["profile"] = {
                "arm": args.profile,
                **profile_step(backends[args.profile], batches[0], forward, args.top),
            }
        if args.cprofile:
            report["cprofile"] = {
                "arm": args.cprofile,
                **cprofile_steps(backends[args.cprofile], batches, forward, args.top),
            }
        for backend in backends.values():
            backend.shutdown()
    report["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def time_named_weights(backend, rounds: int) -> dict:
    """A policy sync's read of the trained weights (``named_weights``, what the transport iterates)
    against the same read through ``DTensor.full_tensor`` for every tensor (the path before a one-rank
    mesh used its local tensors), side by side; values must agree exactly."""
    from torch.distributed.tensor import DTensor

    from areno.train.lora import merged_named_weights

    def gathered():
        return list(merged_named_weights(backend.model, lambda t: t.full_tensor() if isinstance(t, DTensor) else t))

    def current():
        return list(backend.named_weights())

    ms = {"full_tensor": [], "named_weights": []}
    for _ in range(rounds):
        for name, fn in (("full_tensor", gathered), ("named_weights", current)):
            c0 = time.process_time()
            fn()
            ms[name].append(1e3 * (time.process_time() - c0))
    med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
    same = all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(gathered(), current()))
    return {
        "tensors": len(current()),
        "host_ms_full_tensor": round(med["full_tensor"], 2),
        "host_ms_named_weights": round(med["named_weights"], 2),
        "speedup": round(med["full_tensor"] / max(med["named_weights"], 1e-6), 2),
        "identical": same,
    }


def local_floor(model_dir: Path, args, batches, forward) -> dict:
    from areno.train import LocalTrainBackend

    cfg = TrainBackendConfig(
        lr=1e-3,
        device=args.device,
        max_tokens_per_mb=args.seqs_per_mb * args.seq_len,
        param_dtype=args.param_dtype,
        grad_clip=args.grad_clip,
        compile=args.compile,
        logprob_chunk_size=args.chunk,
    )
    backend = LocalTrainBackend(cfg)
    backend.initialize(model_dir)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = []
    for _ in range(max(args.rounds // 2, 1)):
        run_steps(backend, batches[: args.warmup], forward, sync)
        times.append(1e3 * run_steps(backend, batches[args.warmup :], forward, sync)[0] / args.steps)
    backend.shutdown()
    return {
        "host_ms_per_step": round(sorted(times)[len(times) // 2], 2),
        "note": "no FSDP / DTensor; under bf16 compute it runs autocast, so only its time compares",
    }


def profile_step(backend, batch, forward, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    # a warm step first: a fresh backend's first step pays one-off costs (lazy optimizer state, caches)
    backend.train_step(batch, forward_fn=forward, loss_fn=loss_fn, denominator_fn=denominator_fn)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        backend.train_step(batch, forward_fn=forward, loss_fn=loss_fn, denominator_fn=denominator_fn)
    events = [e for e in prof.key_averages()]
    total_ms = sum(e.self_cpu_time_total for e in events) / 1e3
    return {
        "self_cpu_ms_total": round(total_ms, 1),
        "op_calls": int(sum(e.count for e in events if e.key.startswith("aten::"))),
        "top_ops_by_self_cpu": [
            {"op": e.key[:70], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
            for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        ],
    }


def cprofile_steps(backend, batches, forward, top: int) -> dict:
    backend.train_step(batches[0], forward_fn=forward, loss_fn=loss_fn, denominator_fn=denominator_fn)  # warm
    prof = cProfile.Profile()
    prof.enable()
    for b in batches:
        backend.train_step(b, forward_fn=forward, loss_fn=loss_fn, denominator_fn=denominator_fn)
    prof.disable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[
        :top
    ]:
        rows.append(
            {
                "fn": f"{Path(file).name}:{line}:{fn}",
                "calls_per_step": round(nc / len(batches), 1),
                "tottime_ms_per_step": round(1e3 * tt / len(batches), 3),
                "cumtime_ms_per_step": round(1e3 * ct / len(batches), 3),
            }
        )
    return {"top_by_tottime": rows}


if __name__ == "__main__":
    raise SystemExit(main())
