"""Mixture-of-experts: the expert layer alone (default), or a whole Qwen3-MoE-layout model (``--model``).

Expert layer: for each shape, random expert weights and uniformly random top-k routing of ``--tokens``
tokens; times (median of ``--repeats``) of

- ``grouped`` (``areno.models.moe.grouped_experts``, what the decoder runs): the (token, expert)
  pairs sorted by expert, one GEMM per expert over its rows, one scatter-add back;
- ``naive`` (``moe.naive_experts``): every expert over every token, masked by its routing weight;
- ``grouped_mm`` (``moe.grouped_mm_experts``, what GPU inference runs), where it applies (bf16 on a
  Hopper-or-newer GPU: ``--device cuda --dtype bfloat16``), forward only;

forward only (``--backward`` adds the backward of a sum). Outputs are checked equal first.
GPU: ``python -m bench.moe --device cuda --dtype bfloat16 --tokens 4096``.
``ratio``: naive time over grouped time on the last shape.

Whole model (``--model``), in one run:

1. transformers' own ``Qwen3MoeForCausalLM`` writes a random-init checkpoint to a temporary directory
   (Qwen3-MoE's layout at ~1B parameters: 16 layers of width 1024, 16 experts of width 768, top-2,
   Qwen's 151,936-token vocabulary, untied head; bf16 on CUDA, fp32 on CPU; balance loss on);
2. rollout: areno's ``RolloutEngine`` (as ``bench.rollout`` runs it) against transformers ``generate``
   on that checkpoint, the same 64 prompts of 64 tokens, greedy, both to exactly 256 new tokens;
   tokens/s, their ratio, and the share of prompts whose first token / first ``--agree-tokens``
   tokens agree (bf16 near-ties part greedy runs later on);
3. training: steps of areno's training backend (``bench.train``'s; FSDP2 on one rank on CUDA) on
   packed 4,096-token micro-batches, the NLL loss plus the router's balance loss: seconds/step,
   tokens/s, MFU = 6 x active params x tokens/s / peak, where active params are the matmul weights
   one token uses (attention projections, router, its top-k experts and any shared ones, the LM head; not the input
   embedding, a lookup, nor norm weights; ``mfu_no_lm_head`` leaves the head out too) and the peak
   the H200's dense bf16 datasheet figure (``peak_flops_used``; no MFU on CPU).

GPU: ``python -m bench.moe --model --device cuda``. CPU check: ``python -m bench.moe --model --tiny``.
Headline: engine tokens/s against ``generate``'s (``ratio`` = engine / generate); MFU under ``train``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from areno.models import moe
from areno.models.config import ModelConfig
from areno.models.hf_io import load_model, read_config
from bench._common import active_params, emit, headline, parser, ratio
from bench.rollout import make_prompts, mean_common_prefix, run_engine, run_hf
from bench.train import build_backend, make_batch, packable_lengths, time_steps

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


# ----------------------------------------------------------------------------- --model: a whole MoE model

H200_PEAK_BF16 = 989e12
"""NVIDIA H200 SXM datasheet dense bf16 tensor-core FLOP/s (no 2:4 sparsity): the MFU denominator on CUDA."""

MODEL_SHAPES = {
    "1b": dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        num_experts=16, num_experts_per_tok=2, max_position_embeddings=4096, rope_theta=1e6,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024, rope_theta=1e6,
    ),
}  # fmt: skip
"""``1b``: Qwen3-MoE's layout (its vocabulary, head_dim 128, GQA, every layer sparse, top-k renormalised,
untied head) at about 1B parameters, 16 experts top-2; ``tiny``: the CPU check (``--tiny``)."""

WORKLOADS = {
    "1b": dict(prompts=64, prompt_len=64, new_tokens=256, mb_tokens=4096, mbs_per_step=4, warmup=2, steps=3),
    "tiny": dict(prompts=4, prompt_len=16, new_tokens=16, mb_tokens=256, mbs_per_step=2, warmup=1, steps=1),
}


def write_checkpoint(shape: str, out_dir: Path, device: str, dtype: torch.dtype) -> dict:
    """A random-init checkpoint saved by transformers' own ``Qwen3MoeForCausalLM`` (its init, its disk
    names); the router's balance loss on (``output_router_logits``), as a training run would set it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # seconds to import: --model only

    hf_cfg = Qwen3MoeConfig(
        **MODEL_SHAPES[shape],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=0.001,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialising ~1B parameters on the GPU takes a fraction of the CPU's time
        model = Qwen3MoeForCausalLM(hf_cfg).to(dtype)
    model.save_pretrained(out_dir)
    total = sum(p.numel() for p in model.parameters())
    del model
    return {"total_params": total}


def engine_options(args) -> argparse.Namespace:
    """``bench.rollout.run_engine``'s engine settings, at its defaults."""
    return argparse.Namespace(
        block_size=16, max_tokens_per_step=8192, prefill_chunk_size=2048, kv_memory_fraction=0.3,
        no_cuda_graphs=args.no_cuda_graphs, cpu_kv_gb=1, decode_steps=None, fused_kernels=True, profile=False,
        repetition_penalty=1.0, min_p=0.0,  # request_params' sampling settings, off
    )  # fmt: skip


def free(device: str) -> None:
    gc.collect()  # an engine (KV pool, graphs) holds a reference cycle
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mem(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def rollout_run(model_dir: Path, w: dict, device: str, dtype: torch.dtype, args) -> dict:
    """The engine and transformers ``generate`` on the same checkpoint and prompts, greedy, both to
    exactly ``new_tokens`` tokens; then how far their tokens agree."""
    from transformers import AutoModelForCausalLM

    n, new = w["prompts"], w["new_tokens"]
    ours, cfg = load_model(model_dir, dtype=dtype, device=device)
    ours.eval()
    prompts = make_prompts(n, cfg.vocab_size, w["prompt_len"], w["prompt_len"], seed=0)
    free(device)
    out: dict = {}
    try:
        eng_s, eng_out, stats = run_engine(ours, cfg, prompts, new, device, engine_options(args))
    except RuntimeError as e:  # a capture failure must not cost the whole run: record it, decode without graphs
        if device != "cuda" or args.no_cuda_graphs:
            raise
        out["cuda_graphs_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        args.no_cuda_graphs = True
        free(device)
        eng_s, eng_out, stats = run_engine(ours, cfg, prompts, new, device, engine_options(args))
    out |= {
        "engine_s": round(eng_s, 3),
        "engine_tok_s": round(n * new / eng_s, 1),
        "engine_steps": stats["steps"],
        "engine_peak_mem_GiB": peak_mem(device),
        "cuda_graphs": device == "cuda" and not args.no_cuda_graphs,
    }
    del ours, stats
    free(device)
    # the balance loss is a training term: generate need not compute router logits for it
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, output_router_logits=False).to(device).eval()
    hf_s, hf_out = run_hf(hf, prompts, new, device)
    k = min(args.agree_tokens, new)
    out.update(
        hf_generate_s=round(hf_s, 3),
        hf_generate_tok_s=round(n * new / hf_s, 1),
        hf_peak_mem_GiB=peak_mem(device),
        hf_attn=getattr(hf.config, "_attn_implementation", None),
        hf_experts=getattr(hf.config, "_experts_implementation", None),
        speedup=round(hf_s / eng_s, 3),
        agree_first_token=round(sum(a[0] == b[0] for a, b in zip(eng_out, hf_out)) / n, 3),
        agree_tokens=k,
        agree_first_k_tokens=round(sum(a[:k] == b[:k] for a, b in zip(eng_out, hf_out)) / n, 3),
        identical_sequences=round(sum(a == b for a, b in zip(eng_out, hf_out)) / n, 3),
        mean_common_prefix_tokens=mean_common_prefix(eng_out, hf_out),
    )
    del hf
    free(device)
    return out


def train_run(model_dir: Path, cfg: ModelConfig, w: dict, device: str, args) -> dict:
    """Steps of areno's training backend (the NLL loss of ``bench.train``, plus the router's balance loss
    the checkpoint turns on): seconds/step, tokens/s and MFU against 6 x active params per token."""
    backend = build_backend(model_dir, device, args.backend, w["mb_tokens"], compile=args.train_compile)
    rng = random.Random(0)
    batches = [
        make_batch(packable_lengths(w["mbs_per_step"], w["mb_tokens"], rng), cfg.vocab_size, s)
        for s in range(w["warmup"] + w["steps"])
    ]
    seconds, metrics = time_steps(backend, batches, w["warmup"], device)
    tokens = sum(b.num_tokens for b in batches[w["warmup"] :])
    tok_s = tokens / seconds
    act = active_params(cfg)
    peak = H200_PEAK_BF16 if device == "cuda" else None
    out = {
        "backend": args.backend,
        "compile": args.train_compile,
        "param_dtype": backend.cfg.resolved_param_dtype(device),
        "tokens_per_step": batches[-1].num_tokens,
        "mb_tokens": w["mb_tokens"],
        "steps": w["steps"],
        "step_s": round(seconds / w["steps"], 4),
        "tokens_per_s": round(tok_s, 1),
        "model_tflops_per_s": round(6 * act["active_params"] * tok_s / 1e12, 3),
        "peak_flops_used": peak,
        "peak_flops_is": "H200 SXM datasheet, dense bf16" if peak else None,
        "mfu": round(6 * act["active_params"] * tok_s / peak, 4) if peak else None,
        "mfu_no_lm_head": round(6 * act["active_params_no_lm_head"] * tok_s / peak, 4) if peak else None,
        "loss": round(float(metrics[-1]["loss"]), 4),
        "router_aux_loss": round(float(metrics[-1]["router_aux_loss"]), 5)
        if "router_aux_loss" in metrics[-1]
        else None,
        "train_peak_mem_GiB": peak_mem(device),
    }
    backend.shutdown()
    del backend
    free(device)
    return out


def model_main(args) -> int:
    shape = "tiny" if args.tiny else "1b"
    w = WORKLOADS[shape]
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    args.backend = args.backend or ("fsdp2" if device == "cuda" else "local")
    t0 = time.perf_counter()
    report: dict = {
        "mode": "model",
        "shape": shape,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "workload": w,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / f"qwen3moe-{shape}"
        report.update(write_checkpoint(shape, model_dir, device, dtype))
        cfg = read_config(model_dir)
        report["config"] = {**MODEL_SHAPES[shape], "architecture": cfg.architecture}
        report.update(active_params(cfg))
        report["active_fraction"] = round(report["active_params"] / report["total_params"], 4)
        report["rollout"] = rollout_run(model_dir, w, device, dtype, args)
        report["train"] = train_run(model_dir, cfg, w, device, args)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    r = report["rollout"]
    head = headline(
        f"generated tokens/s, engine (qwen3-moe {shape}, {w['prompts']} x {w['new_tokens']} tokens, greedy, {device})",
        r["engine_tok_s"],
        "transformers generate, same checkpoint, prompts and lengths",
        r["hf_generate_tok_s"],
        ratio(r["engine_tok_s"], r["hf_generate_tok_s"]),
        "engine / generate tokens/s (>1: engine faster); train MFU under train.mfu",
    )
    t = report["train"]
    print(
        f"bench.moe --model: {report['device']} {report['dtype']}, {report['total_params'] / 1e9:.3f}B total, "
        f"{report['active_params'] / 1e6:.1f}M active per token; engine {r['engine_tok_s']} tok/s vs generate "
        f"{r['hf_generate_tok_s']} (first {r['agree_tokens']} tokens agree on {r['agree_first_k_tokens']:.0%}); "
        f"train {t['step_s']} s/step, {t['tokens_per_s']} tok/s, MFU {t['mfu']} (peak {t['peak_flops_used']})",
        file=sys.stderr,
    )
    emit("moe", head, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser("moe", __doc__)
    p.add_argument("--model", action="store_true", help="the whole-model run (rollout and training) instead")
    p.add_argument("--tiny", action="store_true", help="--model: a tiny shape and workload (the CPU check)")
    p.add_argument("--backend", choices=("fsdp2", "local"), default=None, help="--model: default fsdp2 on cuda")
    p.add_argument("--train-compile", action="store_true", help="--model: torch.compile the training step")
    p.add_argument("--no-cuda-graphs", action="store_true", help="--model: the engine decodes without graphs")
    p.add_argument("--agree-tokens", type=int, default=4, help="--model: leading tokens compared")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--backward", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16"), help="default float32; --model: bf16 on cuda"
    )
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.model:
        return model_main(args)
    args.dtype = args.dtype or "float32"
    dtype = getattr(torch, args.dtype)
    rows = [run_shape(n, args.tokens, args.repeats, args.backward, args.device, dtype) for n in args.shapes.split(",")]
    last = rows[-1]
    head = headline(
        "grouped experts ms", last["grouped_ms"], "naive masked loop ms", last["naive_ms"],
        ratio(last["naive_ms"], last["grouped_ms"]), "naive / grouped (higher is better)",
    )  # fmt: skip
    details = {"device": args.device, "dtype": args.dtype, "backward": args.backward, "threads": args.threads}
    emit("moe", head, {**details, "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
