"""Training-backend throughput: tokens/s and MFU of forward + backward + optimizer step.

GPU (default when CUDA is present): random-init models of Qwen2.5-0.5B and 1.5B shape by default (``--models``:
also OLMo 2 1B, Gemma 3 1B, Gemma 2 2B and a 1.3B Granite 3 MoE; HF config dicts in ``bench/_common.py``), packed 4,096-token micro-batches of mixed-length sequences (document-masked
attention), bf16 compute with fp32 master weights, AdamW (fused). MFU is reported against both the
dense bf16 matmul rate measured in the same run (8192^3 GEMMs) and the datasheet peak
(H200: 989 TFLOP/s dense bf16). Peak memory is torch.cuda.max_memory_allocated.

CPU: a tiny model, report only, plus packed vs padded tokens/s on a length-skewed batch (padding
emulated by extending every sequence to the longest one with out-of-loss pad tokens, which costs the
FLOPs a padded batch costs).

Model FLOPs per token: 6 x (matmul parameters incl. the LM head; of a sparse layer, the experts a token
reaches, the shared ones and the router) + causal attention 3 x 4 x layers x Hq x Dh x mean context (mean over
tokens of their position + 1, at most a sliding layer's window). The chunked
log-prob recomputation in backward is not counted (MFU counts model FLOPs only).

Speed levers are compared side by side in one run (``--variants``, each a fresh backend on the
same batches): ``eager`` (the baseline), ``compile`` (torch.compile of each decoder layer plus the
fused log-prob head kernels), ``compilemodel`` (the same with the whole layer stack as one graph), any with
``+varlen`` (flash varlen attention instead of the compiled FlexAttention default on CUDA).
``--compile`` is short for ``--variants eager compile``. ``--profile`` adds the top CUDA kernels of one
step of each variant.

Usage:
    python -m bench.train                       # GPU shapes if CUDA, else the CPU report
    python -m bench.train --device cpu
    python -m bench.train --models qwen2.5-0.5b --steps 10 --backend local
    python -m bench.train --device cuda --variants eager compile eager+varlen compile+varlen --profile

Prints one JSON object. Its headline, on GPU: the first run's model FLOP/s against the bf16 matmul rate
measured in the same run (``ratio`` = MFU against that rate; ``runs`` also give MFU against the datasheet);
on CPU: real tokens/s of the packed batch against the same batch padded (``ratio`` = packed / padded).
"""

from __future__ import annotations

import gc
import os
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from areno.data.tokenizer import build_char_tokenizer
from areno.models.config import ModelConfig
from areno.models.hf_io import init_model_dir, tiny_config
from areno.models.logprobs import packed_logprobs
from areno.train import FSDP2TrainBackend, LocalTrainBackend, TrainBackendConfig
from areno.types import TokenBatch
from bench._common import (
    GEMMA2_2B,
    GEMMA3_1B,
    GRANITEMOE_1B,
    OLMO2_1B,
    QWEN25_05B,
    QWEN25_15B,
    active_params,
    emit,
    headline,
    keys_seen,
    layer_windows,
    parser,
    profile_cuda,
    ratio,
)

H200_PEAK_BF16 = 989e12

SHAPES = {
    "qwen2.5-0.5b": QWEN25_05B,
    "qwen2.5-1.5b": QWEN25_15B,
    "olmo2-1b": OLMO2_1B,
    "gemma3-1b": GEMMA3_1B,
    "gemma2-2b": GEMMA2_2B,
    "granitemoe-1b": GRANITEMOE_1B,
}


# ----------------------------------------------------------------------------- batches and FLOPs
def make_batch(lengths: list[int], vocab: int, seed: int, pad_to: int | None = None) -> TokenBatch:
    """Random tokens; ``pad_to`` extends each sequence with pad (id 0) tokens outside the loss."""
    gen = torch.Generator().manual_seed(seed)
    ids, mask, cu = [], [], [0]
    for n in lengths:
        total = pad_to or n
        seq = torch.randint(3, vocab, (n,), generator=gen)
        ids.append(torch.cat([seq, torch.zeros(total - n, dtype=torch.long)]))
        m = torch.zeros(total, dtype=torch.bool)
        m[1:n] = True
        mask.append(m)
        cu.append(cu[-1] + total)
    T = cu[-1]
    return TokenBatch(
        input_ids_T=torch.cat(ids),
        cu_seqlens_B1=torch.tensor(cu),
        loss_mask_T=torch.cat(mask),
        logprobs_T=torch.zeros(T),
        versions_T=torch.zeros(T, dtype=torch.long),
        advantages_T=torch.zeros(T),
        rewards_B=torch.zeros(len(lengths)),
    )


def packable_lengths(n_mbs: int, mb_tokens: int, rng: random.Random) -> list[int]:
    """Mixed lengths (powers of two from mb_tokens/8 to mb_tokens/2) that fill n_mbs bins exactly."""
    sizes = [mb_tokens // 8, mb_tokens // 4, mb_tokens // 2]
    lengths: list[int] = []
    for _ in range(n_mbs):
        left = mb_tokens
        while left:
            n = rng.choice([s for s in sizes if s <= left])
            lengths.append(n)
            left -= n
    rng.shuffle(lengths)
    return lengths


def flops_per_token(cfg: ModelConfig, batch: TokenBatch) -> float:
    """Model FLOPs a token of ``batch`` costs: its ``active_params`` (of a sparse layer the experts a token reaches,
    the shared ones and the router) and the keys each token sees (``keys_seen``)."""
    windows = layer_windows(cfg)
    seqlens = batch.seqlens_B.tolist()
    keys = sum(keys_seen(windows, p) for n in seqlens for p in range(1, n + 1)) / sum(seqlens)
    return 6 * active_params(cfg)["active_params"] + 3 * 4 * cfg.num_attention_heads * cfg.head_dim * keys


def measured_matmul_tflops(device: str, n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


# ----------------------------------------------------------------------------- one training run
def _nll_forward(model, mb):
    logprobs_T, _ = packed_logprobs(model, mb.input_ids_T, mb.cu_seqlens_B1, chunk_size=4096)
    return {"logprobs_T": logprobs_T}


def _nll_loss(output, mb, reducer):
    return reducer(-output["logprobs_T"], mb.loss_mask_T), {}


def _denominator(mb):
    return float(mb.loss_mask_T.sum())


def build_backend(model_dir: Path, device: str, kind: str, mb_tokens: int, **kw):
    cfg = TrainBackendConfig(lr=1e-5, device=device, max_tokens_per_mb=mb_tokens, **kw)
    if kind == "fsdp2":
        if not dist.is_initialized():  # one rank; the process group outlives each backend
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29517")
            os.environ.setdefault("LOCAL_RANK", "0")
            dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
        backend = FSDP2TrainBackend(cfg)
    else:
        backend = LocalTrainBackend(cfg)
    backend.initialize(model_dir)
    return backend


def time_steps(backend, batches: list[TokenBatch], warmup: int, device: str) -> tuple[float, list[dict]]:
    """Seconds for the timed steps (after ``warmup`` untimed ones) and their metrics."""

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    metrics = []
    for i, batch in enumerate(batches):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        metrics.append(
            backend.train_step(batch, forward_fn=_nll_forward, loss_fn=_nll_loss, denominator_fn=_denominator)
        )
    sync()
    return time.perf_counter() - t0, metrics[warmup:]


VARIANT_BASES = ("eager", "compile", "compilemodel")
VARIANT_ATTN = ("flex", "varlen")


def parse_variant(name: str) -> tuple[bool, str, str]:
    """``eager`` / ``compile`` (each decoder layer) / ``compilemodel`` (the layer stack as one graph)
    with an optional ``+flex`` / ``+varlen``: (compile, CUDA attention, compile scope)."""
    base, *extra = name.split("+")
    attn = extra[0] if len(extra) == 1 else "flex" if not extra else ""
    if base not in VARIANT_BASES or attn not in VARIANT_ATTN:
        raise ValueError(
            f"--variants: {name!r} is not one of {VARIANT_BASES} with an optional +{'/+'.join(VARIANT_ATTN)}"
        )
    return base != "eager", attn, "model" if base == "compilemodel" else "layers"


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def profile_step(backend, batch: TokenBatch) -> dict:
    """Where one training step's time goes."""
    return profile_cuda(
        lambda: backend.train_step(batch, forward_fn=_nll_forward, loss_fn=_nll_loss, denominator_fn=_denominator)
    )


def gpu_run(name: str, hf: dict, args, workdir: Path, matmul_tflops: float) -> list[dict]:
    """One result per variant, each on a fresh backend and the same batches."""
    config = ModelConfig.from_hf(hf)
    tok = build_char_tokenizer()
    model_dir = init_model_dir(workdir / name, config, tok, seed=0)
    rng = random.Random(0)
    batches = [
        make_batch(packable_lengths(args.mbs_per_step, args.mb_tokens, rng), config.vocab_size, s)
        for s in range(args.warmup + args.steps)
    ]
    results = []
    for variant in args.variants:
        # A failing variant (e.g. a compiler error) is recorded and the run goes on to the next one.
        try:
            results.append(
                gpu_variant_run(name, variant, model_dir, config, batches, args, matmul_tflops, profile=args.profile)
            )
        except Exception as e:  # noqa: BLE001
            results.append({"model": name, "variant": variant, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            gc.collect()
            torch.cuda.empty_cache()
    if "tokens_per_s" in results[0]:
        for r in results:
            if "tokens_per_s" in r:
                r["speedup_vs_first_variant"] = round(r["tokens_per_s"] / results[0]["tokens_per_s"], 3)
    return results


def gpu_variant_run(name, variant, model_dir, config, batches, args, matmul_tflops, *, profile: bool) -> dict:
    compile_, attn, scope = parse_variant(variant)
    torch._dynamo.reset()  # each variant compiles for itself: first_step_s and dynamo_graphs are its own
    torch.cuda.reset_peak_memory_stats()
    graphs_before = dynamo_graphs()
    backend = build_backend(
        model_dir,
        "cuda",
        args.backend,
        args.mb_tokens,
        activation_checkpointing=args.ac,
        compile=compile_,
        compile_scope=scope,
        attention=attn,
    )
    t0 = time.perf_counter()
    backend.train_step(batches[0], forward_fn=_nll_forward, loss_fn=_nll_loss, denominator_fn=_denominator)
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t0  # includes compilation for the compiled variants
    seconds, metrics = time_steps(backend, batches[1:], args.warmup - 1, "cuda")
    timed = batches[args.warmup :]
    tokens = sum(b.num_tokens for b in timed)
    fpt = sum(flops_per_token(config, b) * b.num_tokens for b in timed) / tokens
    achieved = fpt * tokens / seconds
    result = {
        "model": name,
        "variant": variant,
        "attention": attn,
        "backend": args.backend,
        "params_M": round(sum(p.numel() for p in backend.model.parameters()) / 1e6, 1),
        "mb_tokens": args.mb_tokens,
        "mbs_per_step": int(metrics[-1]["mbs"]),
        "steps": args.steps,
        "tokens_per_s": round(tokens / seconds),
        "step_s": round(seconds / args.steps, 4),
        "model_tflops_per_s": round(achieved / 1e12, 1),
        "mfu_vs_datasheet": round(achieved / H200_PEAK_BF16, 4),
        "mfu_vs_measured_matmul": round(achieved / (matmul_tflops * 1e12), 4),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "activation_checkpointing": args.ac,
        "compile": compile_,
        "compile_scope": scope if compile_ else None,
        "first_step_s": round(first_step_s, 2),
        "dynamo_graphs": dynamo_graphs() - graphs_before,
        "final_loss": round(metrics[-1]["loss"], 4),
    }
    if profile:
        result["profile"] = profile_step(backend, batches[-1])
    # sleep/wake bytes on the real shape
    freed = backend.sleep()
    result["sleep_freed_GiB"] = round(freed / 2**30, 2)
    result["wake_restored_GiB"] = round(backend.wake() / 2**30, 2)
    backend.shutdown()
    del backend
    torch.cuda.empty_cache()
    return result


def cpu_run(args, workdir: Path) -> dict:
    tok = build_char_tokenizer()
    config = tiny_config(len(tok), hidden_size=64, layers=2)
    model_dir = init_model_dir(workdir / "tiny", config, tok, seed=0)
    rng = random.Random(0)
    out: dict = {"model": "tiny qwen2 (hidden 64, 2 layers)", "threads": torch.get_num_threads()}
    # plain throughput on packed 512-token micro-batches
    backend = build_backend(model_dir, "cpu", "local", 512)
    batches = [make_batch(packable_lengths(4, 512, rng), config.vocab_size, s) for s in range(args.warmup + args.steps)]
    seconds, _ = time_steps(backend, batches, args.warmup, "cpu")
    out["packed_512_tokens_per_s"] = round(sum(b.num_tokens for b in batches[args.warmup :]) / seconds)
    # length-skewed batch: most sequences short, a few long
    skew = [rng.choice([24, 32, 48, 64]) for _ in range(60)] + [512, 480, 400, 300]
    real_tokens = sum(skew)
    packed = [make_batch(skew, config.vocab_size, s) for s in range(args.warmup + args.steps)]
    padded = [make_batch(skew, config.vocab_size, s, pad_to=max(skew)) for s in range(args.warmup + args.steps)]
    res = {}
    for label, data, budget in (("packed", packed, 1024), ("padded", padded, 1024)):
        backend = build_backend(model_dir, "cpu", "local", budget)
        seconds, metrics = time_steps(backend, data, args.warmup, "cpu")
        res[label] = {
            "real_tokens_per_s": round(real_tokens * args.steps / seconds),
            "computed_tokens_per_step": data[0].num_tokens,
            "mbs": int(metrics[-1]["mbs"]),
            "loss": round(metrics[-1]["loss"], 4),
        }
    out["skewed_batch"] = {
        "lengths": f"60 of 24-64 + [512, 480, 400, 300] ({real_tokens} real tokens)",
        **res,
        "packed_speedup": round(res["packed"]["real_tokens_per_s"] / res["padded"]["real_tokens_per_s"], 2),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser("train", __doc__)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=list(SHAPES))
    p.add_argument("--backend", choices=("fsdp2", "local"), default="fsdp2")
    p.add_argument("--mb-tokens", type=int, default=4096)
    p.add_argument("--mbs-per-step", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ac", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="short for --variants eager compile")
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="eager | compile | compilemodel, optionally +flex / +varlen (CUDA attention); default: eager",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile one step of every variant (wall vs kernel time, top kernels, host ops)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="CPU intra-op threads (1: on a shared machine more threads contend)"
    )
    args = p.parse_args(argv)
    if args.variants is None:
        args.variants = ["eager", "compile"] if args.compile else ["eager"]
    for v in args.variants:
        try:
            parse_variant(v)
        except ValueError as e:
            p.error(str(e))
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step is timed separately: it compiles)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cpu":
        torch.set_num_threads(args.threads)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        if device == "cuda":
            report["matmul_bf16_tflops_measured"] = round(measured_matmul_tflops("cuda"), 1)
            report["datasheet_bf16_tflops"] = H200_PEAK_BF16 / 1e12
            report["runs"] = [
                r
                for m in args.models
                for r in gpu_run(m, SHAPES[m], args, Path(tmp), report["matmul_bf16_tflops_measured"])
            ]
        else:
            report["cpu"] = cpu_run(args, Path(tmp))
    emit("train", train_headline(report), report)
    return 0


def train_headline(report: dict) -> dict:
    """GPU: the first run's model FLOP/s against the matmul rate measured in the same run; CPU: the packed
    batch's real tokens/s against the same batch padded."""
    if "cpu" in report:
        skew = report["cpu"]["skewed_batch"]
        packed, padded = skew["packed"]["real_tokens_per_s"], skew["padded"]["real_tokens_per_s"]
        return headline(
            f"real tokens/s of a length-skewed batch, packed ({report['cpu']['model']}, CPU)",
            packed,
            "the same batch padded to its longest sequence",
            padded,
            ratio(packed, padded, 2),
            "packed / padded tokens/s",
        )
    run = next((r for r in report["runs"] if "tokens_per_s" in r), None)
    matmul = report["matmul_bf16_tflops_measured"]
    figure = run["model_tflops_per_s"] if run else None
    return headline(
        f"model TFLOP/s of fwd + bwd + AdamW ({run['model']}, {run['variant']}, {run['backend']}; "
        f"{run['tokens_per_s']} tokens/s)"
        if run
        else "model TFLOP/s (every variant failed)",
        figure,
        "dense bf16 matmul TFLOP/s (8192^3 GEMMs) measured in the same run",
        matmul,
        ratio(figure, matmul, 4),
        "MFU against the measured matmul rate (runs[].mfu_vs_datasheet: against the datasheet)",
    )


if __name__ == "__main__":
    raise SystemExit(main())
