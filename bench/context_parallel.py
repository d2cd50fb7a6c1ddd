"""Long-context training with and without context parallelism (``train.cp_size``, Ulysses).

GPU: a random-init model of Qwen2.5-0.5B's shape (positions extended so RoPE covers the longest
length tried), one sequence per step, bf16 compute with fp32 master weights, AdamW, activation
checkpointing on (``--no-ac`` turns it off). For each context-parallel size (``--cp``, default
1 and 2) the lengths are tried in increasing order, each in a fresh ``torchrun`` of cp processes
(an out-of-memory rank would leave its peers waiting in a collective), until one does not fit:
the longest that trains is the headline. ``--tps-length`` (default 32768) is also timed for
tokens/s under each cp.

Usage (2 GPUs):
    python -m bench.context_parallel                        # cp 1 and 2, lengths 16k .. 512k
    python -m bench.context_parallel --cp 2 --lengths 8192 32768 --steps 2   # quick check

Prints one JSON object: the longest trained length with CP 2 against CP 1 (``ratio`` = cp2 / cp1),
and per cp and length: fits, seconds per step, tokens/s, peak memory (GiB, the max over ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from areno.data.tokenizer import build_char_tokenizer
from areno.models.config import ModelConfig
from areno.models.hf_io import init_model_dir
from areno.models.logprobs import packed_logprobs
from areno.train import FSDP2TrainBackend, TrainBackendConfig
from areno.types import TokenBatch
from bench._common import QWEN25_05B, emit, headline, parser, ratio

DEFAULT_LENGTHS = [16384, 32768, 65536, 131072, 262144, 524288]
RESULT_PREFIX = "CP_RESULT "


def one_sequence(length: int, vocab: int, seed: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(length, dtype=torch.bool)
    mask[0] = False
    return TokenBatch(
        input_ids_T=torch.randint(3, vocab, (length,), generator=gen),
        cu_seqlens_B1=torch.tensor([0, length]),
        loss_mask_T=mask,
        logprobs_T=torch.zeros(length),
        versions_T=torch.zeros(length, dtype=torch.long),
        advantages_T=torch.zeros(length),
        rewards_B=torch.zeros(1),
    )


def _nll_forward(model, mb):
    logprobs_T, _ = packed_logprobs(model, mb.input_ids_T, mb.cu_seqlens_B1)
    return {"logprobs_T": logprobs_T}


def _nll_loss(output, mb, reducer):
    return reducer(-output["logprobs_T"], mb.loss_mask_T), {}


def worker(args) -> None:
    """One (cp, length) trial inside torchrun: initialize, ``--steps`` steps, print the result."""
    cp = int(os.environ["WORLD_SIZE"])
    cfg = TrainBackendConfig(
        lr=1e-5,
        device=args.device,
        cp_size=cp,
        activation_checkpointing=not args.no_ac,
        max_tokens_per_mb=-(-args.length // cp),
    )
    backend = FSDP2TrainBackend(cfg)
    backend.initialize(args.model_dir)
    vocab = backend.model_config.vocab_size
    result = {"cp": cp, "length": args.length, "fits": False}
    try:
        times, losses = [], []
        for s in range(args.steps):
            batch = one_sequence(args.length, vocab, s)
            _sync(args.device)
            t0 = time.perf_counter()
            metrics = backend.train_step(
                batch, forward_fn=_nll_forward, loss_fn=_nll_loss, denominator_fn=lambda mb: float(mb.loss_mask_T.sum())
            )
            _sync(args.device)
            times.append(time.perf_counter() - t0)
            losses.append(metrics["loss"])
        step_s = min(times[1:] or times)  # the first step compiles
        cuda = args.device == "cuda"
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=args.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result.update(
            losses=losses,
            fits=True,
            step_s=round(step_s, 3),
            tokens_per_s=round(args.length / step_s),
            peak_gib=round(float(peak), 2),
        )
    except torch.OutOfMemoryError:
        pass
    if dist.get_rank() == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    backend.shutdown()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def trial(model_dir: Path, cp: int, length: int, args) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
        "-m", "bench.context_parallel", "--worker", "--model-dir", str(model_dir),
        "--length", str(length), "--steps", str(args.steps), "--device", args.device,
    ] + (["--no-ac"] if args.no_ac else [])  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.trial_timeout_s)
    except subprocess.TimeoutExpired:  # a trial past its time is a result, not the end of the others
        return {"cp": cp, "length": length, "fits": False, "error": f"timed out after {args.trial_timeout_s:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = (proc.stderr or proc.stdout)[-400:]
    oom = "OutOfMemory" in proc.stderr or "out of memory" in proc.stderr
    return {"cp": cp, "length": length, "fits": False, "error": None if oom else tail}


def main() -> None:
    p = parser("context_parallel", __doc__)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    p.add_argument("--tps-length", type=int, default=32768)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run under gloo")
    p.add_argument("--tiny", action="store_true", help="a 2-layer width-64 model instead of 0.5B (smoke runs)")
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    p.add_argument("--trial-timeout-s", type=float, default=300.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one trial, inside torchrun
    p.add_argument("--model-dir")
    p.add_argument("--length", type=int)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.device == "cuda" and torch.cuda.device_count() < max(args.cp):
        raise SystemExit(f"needs {max(args.cp)} GPUs, {torch.cuda.device_count()} visible")
    lengths = sorted(set(args.lengths) | {args.tps_length})
    hf = {**QWEN25_05B, "max_position_embeddings": max(lengths)}
    if args.tiny:
        hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)
    runs: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cuda = args.device == "cuda"  # drawn on the GPU in bf16: seconds instead of a minute on the host
        model_dir = init_model_dir(
            Path(tmp) / "m",
            ModelConfig.from_hf(hf),
            build_char_tokenizer(),
            seed=0,
            device=args.device,
            dtype=torch.bfloat16 if cuda else None,
        )
        for cp in args.cp:
            runs[cp] = []
            for length in lengths:
                runs[cp].append(trial(model_dir, cp, length, args))
                print(json.dumps({"progress": runs[cp][-1]}), file=sys.stderr, flush=True)
                if not runs[cp][-1]["fits"] and length >= args.tps_length:
                    break  # longer ones do not fit either
    longest = {cp: max((r["length"] for r in rs if r["fits"]), default=0) for cp, rs in runs.items()}
    tps = {
        cp: next((r.get("tokens_per_s") for r in rs if r["length"] == args.tps_length), None) for cp, rs in runs.items()
    }
    hi, lo = max(args.cp), min(args.cp)
    shape = "tiny" if args.tiny else "Qwen2.5-0.5B shape"
    head = headline(
        f"longest trained sequence, {shape}, cp {hi}", longest[hi], f"cp {lo}", longest[lo],
        ratio(longest[hi], longest[lo]), f"cp {hi} / cp {lo}",
    )  # fmt: skip
    emit("context_parallel", head, {"tokens_per_s_at_tps_length": tps, "tps_length": args.tps_length, "runs": runs,
                                    "activation_checkpointing": not args.no_ac})  # fmt: skip


if __name__ == "__main__":
    main()
