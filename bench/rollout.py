"""Rollout throughput: areno's RolloutEngine vs transformers ``generate`` on the same model, prompts
and lengths, measured side by side in one run. Prints one JSON object: the headline (engine tokens/s,
``generate``'s as the baseline, ``ratio`` = engine / ``generate``; with ``--rounds``, the median of the
rounds' ratios), then the details.

    python -m bench.rollout --shape cpu20m                       # CPU: ~20M params, 32 x 128
    python -m bench.rollout --shape qwen0.5b                     # GPU: Qwen2.5-0.5B shape, 64 x 512
    python -m bench.rollout --shape qwen0.5b --prompts 256 --skip-hf   # GPU: 256 concurrent sequences
    python -m bench.rollout --shape qwen1.5b --prompts 256 --skip-hf --profile --profile-tokens 512
    python -m bench.rollout --shape qwen0.5b --prompts 256 --skip-hf --decode-attention gather paged

``--decode-attention`` takes one or more of ``gather`` / ``paged`` (``RolloutEngineConfig.decode_attention``):
with several, the engine runs once per value on the same model and prompts, one after the other in this
process; the top-level figures are the first value's, ``by_run`` holds each one's, and
``identical_to`` counts the sequences equal to the first run's at the same temperature. A value given twice runs
twice and keeps its last run: the first engine run of a process is slower on CPU (measured: ~1.8x,
whichever value goes first), so ``--decode-attention gather paged gather`` compares warm runs.

Sampling: ``--temperature`` takes one or more values (0 = greedy, the default), each run side by side
like the decode-attention values (one engine run per attention value x temperature); sampled runs use
``--top-p`` / ``--top-k`` / ``--min-p``, every run ``--repetition-penalty`` (greedy rows too), and, as RL rollouts do (the ledger seeds every request), per-request seeds
``--seed + i`` (``--unseeded``: the engine's generator instead). Several runs: ``by_run`` holds each one's
figures under a label such as ``paged T=1.0``; the top-level figures are the first run's. ``transformers``
generate uses the first temperature's sampling (do_sample when > 0).

Projections: ``--fused-projections`` (default) / ``--no-fused-projections`` sets
``RolloutEngineConfig.fused_projections`` (one GEMM for each layer's q/k/v and one for gate/up);
``--compare-fused-projections`` adds, after each run, one with the other setting on the same model and
prompts (label suffix `` unfused-proj`` / `` fused-proj``; ``identical_to`` the run it follows): the
A/B of the kernel count of a decode step in one process.

    python -m bench.rollout --shape qwen0.5b --skip-hf --compare-fused-projections --profile

A/B in one process: ``--compare-cpu-packed-gemm N`` and ``--compare-decode-carry N`` (CPU) and
``--compare-overlap-round-trips N`` add N pairs of the first run with ``RolloutEngineConfig.cpu_packed_gemm`` /
``cpu_decode_carry`` / ``overlap_round_trips`` flipped, then as set (labels `` linear-gemm #i`` /
`` packed-gemm #i``, `` gather #i`` / `` carry #i``, `` serial #i`` / `` overlapped #i``); ``--rounds R``
times the first run's setting and ``generate`` R times, alternating (``speedup_rounds``,
``speedup_median``): on a shared CPU host one run each is not a ratio to trust.

    python -m bench.rollout --shape cpu20m --threads 2 --rounds 5 --compare-cpu-packed-gemm 2 --compare-decode-carry 2

Both sides decode to exactly ``--new-tokens`` tokens (EOS ignored). Process CPU time is
reported next to wall time (``speedup_cpu_time``): on a shared CPU machine it is the steadier figure. On CUDA it also reports
the fraction of the decode roofline: a decode step must read every weight once (but an untied input embedding, a
lookup; of a sparse layer's routed experts, the top k) plus the K/V of every running sequence, so at copy bandwidth
``bw`` (measured here with a device-to-device copy) the step takes at least ``(weight_bytes + kv_bytes) / bw``;
``roofline_fraction`` = measured decode tokens/s over that bound, over the run's contexts (a sliding layer's capped)
(``decode_roofline``; expert models also get ``roofline_fraction_uniform_routing``, against the experts uniformly
routed rows reach on average: nearer the work, not a bound). Peak GPU memory is reported too.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from areno.models import gpt_oss, packed_projections
from areno.models.config import ModelConfig
from areno.models.decoder import Decoder
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams
from bench._common import (
    GEMMA3_1B,
    GLM4_9B,
    GPT_OSS_20B,
    OLMO2_1B,
    PHI3_MINI,
    PHI4_MINI,
    QWEN25_05B,
    QWEN25_15B,
    emit,
    headline,
    keys_seen,
    layer_windows,
    parser,
    profile_cuda,
    step_weight_params,
    uniform_experts_reached,
)

# Qwen2.5-0.5B's config.json (shape only; weights are random).
# ~20M parameters: 8 layers of width 256 and a 32k vocabulary (untied).
CPU_20M = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# A gpt-oss of ~22M parameters (4 layers of width 256, 8 experts of width 512 a layer, top 2; sinks, a 128-token
# window in layers 0 and 2, YaRN over 128 original positions): the sink and biased-expert paths on CPU.
CPU_GPT_OSS = {
    **{k: v for k, v in GPT_OSS_20B.items() if k not in ("layer_types", "torch_dtype", "experts_per_token")},
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_scaling": {**GPT_OSS_20B["rope_scaling"], "original_max_position_embeddings": 128},
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# OLMoE-1B-7B-0924's config.json (shape only; weights are random): 6.9B parameters, 1.3B of them active a token
# (16 layers of width 2048, 64 experts of width 1024 a layer, top 8, q/k norms over the whole projections).
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "clip_qkv": None,
    "attention_bias": False,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 50304,
    "hidden_act": "silu",
    "pad_token_id": 1,
    "eos_token_id": 50279,
}
# A smoke-test size (the bench's own tests): seconds, not a figure.
TINY = {
    **CPU_20M,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
SHAPES = {
    "cpu20m": (CPU_20M, 32, 128),
    "qwen0.5b": (QWEN25_05B, 64, 512),
    "qwen1.5b": (QWEN25_15B, 64, 512),
    "olmo2-1b": (OLMO2_1B, 64, 512),
    "phi3-mini": (PHI3_MINI, 64, 512),
    "phi4-mini": (PHI4_MINI, 64, 512),
    "glm4-9b": (GLM4_9B, 64, 512),
    "gemma3-1b": (GEMMA3_1B, 64, 512),
    "gpt-oss-20b": (GPT_OSS_20B, 64, 512),
    "olmoe-1b-7b": (OLMOE_1B_7B, 64, 512),
    "cpu-gpt-oss": (CPU_GPT_OSS, 32, 128),
    "tiny": (TINY, 4, 8),
}


LARGE_PARAMS = 8e9
"""Models above this many parameters are initialised on the device in their dtype (gpt-oss-20b)."""


def build_models(hf_dict: dict, device: str, dtype: torch.dtype, with_hf: bool):
    import transformers  # only runs with the generate baseline need it (seconds to import)

    cfg = ModelConfig.from_hf(hf_dict)
    torch.manual_seed(0)
    if cfg.num_params() > LARGE_PARAMS:  # built where it runs, in its dtype: an fp32 copy on the host would not fit
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                ours = Decoder(cfg).eval()
        finally:
            torch.set_default_dtype(default)
    else:
        ours = Decoder(cfg).to(dtype=dtype, device=device).eval()
    hf = None
    if with_hf:
        hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf_dict.items() if k != "architectures"})
        hf_cfg.pad_token_id = 0
        # built where it runs: transformers' initialisation of a 3.8B model on the host outlasted 200 s
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
        # the checkpoint's names: Phi-3's q/k/v and gate/up packed as transformers holds them
        state = packed_projections.to_disk_state(cfg, ours.state_dict())
        if cfg.expert_bias:  # gpt-oss: the router's name, gate/up interleaved, as transformers holds them
            state = gpt_oss.to_disk_state(state)
        missing, unexpected = hf.load_state_dict(state, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
        hf.tie_weights()
    return ours, cfg, hf


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def run_hf(
    hf, prompts: list[list[int]], new_tokens: int, device: str, sampling: dict | None = None
) -> tuple[float, list[list[int]]]:
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as generate expects
        ids[i, L - len(p) :] = torch.tensor(p)
        mask[i, L - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    # Batched, same dtype and device, KV cache on (transformers' default dynamic cache).
    kw = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        use_cache=True,
    )
    if sampling and sampling.get("repetition_penalty", 1.0) != 1.0:  # greedy rows too
        kw.update(repetition_penalty=sampling["repetition_penalty"])
    if sampling and sampling["temperature"] > 0:
        kw.update(
            do_sample=True,
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            top_k=max(sampling["top_k"], 0),
        )  # 0: no top-k (the generation config's default is 50)
        if sampling.get("min_p", 0.0) > 0:
            kw.update(min_p=sampling["min_p"])
    hf.generate(input_ids=ids[:, -8:], attention_mask=mask[:, -8:], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
    sync(device)
    cpu0, t0 = time.process_time(), time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=mask, **kw)
    sync(device)
    run_hf.cpu_s = time.process_time() - cpu0
    return time.perf_counter() - t0, out[:, L:].tolist()


def request_params(args, temperature: float, new_tokens: int, n: int) -> list:
    """One ``SamplingParams`` per prompt: greedy at temperature 0, else ``--top-p`` / ``--top-k`` /
    ``--min-p`` and the per-request seed ``--seed + i`` (none with ``--unseeded``); both with
    ``--repetition-penalty``."""
    if temperature <= 0:
        greedy = SamplingParams(
            temperature=0, max_new_tokens=new_tokens, ignore_eos=True, repetition_penalty=args.repetition_penalty
        )
        return [greedy] * n
    return [
        SamplingParams(
            temperature=temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            max_new_tokens=new_tokens,
            ignore_eos=True,
            seed=None if args.unseeded else args.seed + i,
        )
        for i in range(n)
    ]


def run_engine(
    ours,
    cfg,
    prompts,
    new_tokens: int,
    device: str,
    args,
    decode_attention: str = "gather",
    temperature: float = 0.0,
    fused_projections: bool = True,
) -> tuple[float, list[list[int]], dict]:
    ecfg = RolloutEngineConfig(
        block_size=args.block_size,
        max_num_seqs=max(len(prompts), 1),
        max_tokens_per_step=args.max_tokens_per_step,
        prefill_chunk_size=args.prefill_chunk_size,
        max_model_len=max(len(p) for p in prompts) + new_tokens + 1,
        kv_memory_fraction=args.kv_memory_fraction,
        cuda_graphs=not args.no_cuda_graphs,
        cpu_kv_cache_bytes=args.cpu_kv_gb << 30,
        decode_steps=args.decode_steps,
        decode_attention=decode_attention,
        fused_kernels=args.fused_kernels,
        fused_projections=fused_projections,
        cpu_packed_gemm=getattr(args, "cpu_packed_gemm", True),
        cpu_decode_carry=getattr(args, "decode_carry", True),
        overlap_round_trips=getattr(args, "overlap_round_trips", True),
    )
    engine = RolloutEngine(ours, cfg, config=ecfg, eos_token_ids=(cfg.eos_token_id,))
    params = request_params(args, temperature, new_tokens, len(prompts))
    engine.generate(
        [p[:8] for p in prompts[: min(8, len(prompts))]], [dataclasses.replace(q, max_new_tokens=4) for q in params[:8]]
    )
    # Like a server at start-up: capture the decode graphs this run needs outside the timed region.
    engine.warmup_cuda_graphs([len(prompts)], max(len(p) for p in prompts) + new_tokens, params=[params[0]])
    sync(device)
    before = engine.stats()  # the counters are running totals: the warm-up's steps are not the run's
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(device)
    elapsed = time.perf_counter() - t0
    stats = engine.stats()
    for key in ("steps", "sampling_round_trips", "num_preemptions"):
        stats[key] -= before[key]
    if getattr(args, "profile", False) and device.startswith("cuda"):
        stats["profile"] = profile_decode(
            engine,
            prompts,
            min(new_tokens, getattr(args, "profile_tokens", 64)),
            params,
            trace=getattr(args, "profile_trace", None),
        )
    stats["cpu_s"] = time.process_time() - cpu0
    c = engine.cache
    stats["kv_pool_GiB"] = round(
        2
        * c.num_layers
        * c.num_slots
        * c.num_kv_heads
        * c.head_dim
        * torch.empty((), dtype=c.dtype).element_size()
        / 2**30,
        2,
    )
    return elapsed, [o.output_ids for o in outs], stats


def profile_decode(engine, prompts, new_tokens: int, params: list, trace: str | None = None) -> dict:
    """Where the GPU time of a generate call goes (after the timed run, same engine, prompts and
    sampling, ``new_tokens`` tokens); ``trace``: write its Chrome trace there too."""
    params = [dataclasses.replace(p, max_new_tokens=new_tokens) for p in params]
    return {"new_tokens": new_tokens, **profile_cuda(lambda: engine.generate(prompts, params), top=20, trace=trace)}


def mean_common_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean number of leading tokens two runs' outputs share (bf16 near-ties make greedy runs part
    ways somewhere; how far they agree first separates rounding from a bug)."""

    def common(x: list[int], y: list[int]) -> int:
        return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))

    return round(sum(common(x, y) for x, y in zip(a, b)) / max(len(a), 1), 1)


def decode_roofline(cfg: ModelConfig, rows: int, contexts: list[int], elt: int, bw: float) -> dict:
    """Upper bound of decode tokens/s at copy bandwidth ``bw`` (bytes/s): ``rows`` rows a step, each row-step over
    one of ``contexts`` cached keys (a sliding layer reads at most its window), weights and K/V of ``elt`` bytes. A step reads the weights of ``step_weight_params`` (of a
    sparse layer's routed experts the top k, which rows that all pick the same experts read) and every row's K/V.
    Expert models also get ``decode_roofline_uniform_routing_tok_s``: the experts rows picking their top k
    uniformly at random reach on average (``uniform_experts_reached``); near every expert at 64 rows, so nearer
    the work, yet not a bound."""
    windows = layer_windows(cfg)
    keys = sum(keys_seen(windows, c + 1, cached=True) for c in contexts) / len(contexts)  # c cached: position c + 1
    kv_bytes = rows * keys * 2 * cfg.num_key_value_heads * cfg.head_dim * elt
    out = {"decode_roofline_tok_s": rows * bw / (step_weight_params(cfg) * elt + kv_bytes)}
    if cfg.num_experts:
        reached = uniform_experts_reached(cfg, rows)
        out["experts_reached_uniform"] = reached
        out["decode_roofline_uniform_routing_tok_s"] = rows * bw / (step_weight_params(cfg, reached) * elt + kv_bytes)
    return out


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    x = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 4 * reps / (time.perf_counter() - t0)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The model shape and the prompts: ``--shape``, ``--prompts``, ``--new-tokens``, ``--prompt-len``."""
    ap.add_argument("--shape", choices=sorted(SHAPES), default="cpu20m")
    ap.add_argument("--prompts", type=int, default=None, help="number of prompts (default: per shape)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens per prompt (default: per shape)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))


def main(argv: list[str] | None = None) -> int:
    ap = parser("rollout", __doc__)
    add_workload_args(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--skip-hf", action="store_true", help="engine only (e.g. the 256-concurrency run)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens-per-step", type=int, default=8192)
    ap.add_argument("--prefill-chunk-size", type=int, default=2048)
    ap.add_argument("--kv-memory-fraction", type=float, default=0.5)
    ap.add_argument("--cpu-kv-gb", type=int, default=1)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--decode-attention",
        nargs="+",
        choices=["auto", "gather", "paged"],
        default=["auto"],
        help="engine decode attention; several values: one engine run each, side by side",
    )
    ap.add_argument(
        "--fused-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: fused RMSNorm/RoPE/SiLU-mul Triton kernels (RolloutEngineConfig.fused_kernels)",
    )
    ap.add_argument(
        "--fused-projections",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one GEMM for q/k/v and one for gate/up per layer (RolloutEngineConfig.fused_projections)",
    )
    ap.add_argument(
        "--compare-fused-projections",
        action="store_true",
        help="each run also runs with the other --fused-projections setting, side by side",
    )
    ap.add_argument(
        "--overlap-round-trips",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: launch the next decode round trip before reading this one's tokens "
        "(RolloutEngineConfig.overlap_round_trips)",
    )
    ap.add_argument(
        "--compare-overlap-round-trips",
        type=int,
        default=0,
        metavar="N",
        help="N pairs of the first run with --overlap-round-trips flipped, then as set (labels serial / overlapped)",
    )
    ap.add_argument(
        "--cpu-packed-gemm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU fp32: the large GEMMs through oneDNN-packed weights (RolloutEngineConfig.cpu_packed_gemm)",
    )
    ap.add_argument(
        "--compare-cpu-packed-gemm",
        type=int,
        default=0,
        metavar="N",
        help="CPU: after the runs, N pairs of the first run with packed GEMMs off, then on",
    )
    ap.add_argument(
        "--decode-carry",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: keep the gathered decode K/V across steps (RolloutEngineConfig.cpu_decode_carry)",
    )
    ap.add_argument(
        "--compare-decode-carry",
        type=int,
        default=0,
        metavar="N",
        help="CPU: after the runs, N pairs of the first run with the decode carry off, then on",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="with generate: R alternating (engine, generate) timings of the first run's setting; "
        "speedup_rounds lists each round's ratio, speedup_median their median (noisy hosts)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: after each timed run, profile a generate of the same prompts (top kernels), --profile-tokens long",
    )
    ap.add_argument(
        "--profile-trace",
        metavar="PATH",
        help="with --profile: write the profiled generate's Chrome trace to PATH (the last run's, with several)",
    )
    ap.add_argument(
        "--profile-tokens",
        type=int,
        default=64,
        help="new tokens of the profiled generate (default 64; its prompts hit the prefix cache, so it is "
        "mostly decode steps)",
    )
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="engine decode steps per host round trip (default: 8 on CUDA, 1 on CPU)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[0.0],
        help="0 = greedy; several values: one engine run each, side by side",
    )
    ap.add_argument("--top-p", type=float, default=1.0, help="sampled runs: nucleus mass")
    ap.add_argument("--top-k", type=int, default=-1, help="sampled runs: top-k (-1: off)")
    ap.add_argument("--min-p", type=float, default=0.0, help="sampled runs: min-p (0: off)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="every run: repetition penalty (1: off)")
    ap.add_argument("--seed", type=int, default=0, help="sampled runs: request i has seed SEED + i")
    ap.add_argument("--unseeded", action="store_true", help="sampled runs: no per-request seeds (engine generator)")
    args = ap.parse_args(argv)
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_dict, n_default, new_default = SHAPES[args.shape]
    n = args.prompts or n_default
    new_tokens = args.new_tokens or new_default
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))

    ours, cfg, hf = build_models(hf_dict, device, dtype, with_hf=not args.skip_hf)
    prompts = make_prompts(n, cfg.vocab_size, *args.prompt_len, seed=0)
    n_params = sum(p.numel() for p in ours.parameters())
    runs = {}  # label -> (seconds, outputs, stats, label of the run to compare tokens with)
    fp = args.fused_projections
    plan = [(mode, t, fp) for mode in args.decode_attention for t in args.temperature]
    if args.compare_fused_projections:
        plan = [r for m, t, f in plan for r in ((m, t, f), (m, t, not f))]
    many_t = len(args.temperature) > 1 or args.temperature[0] > 0
    other_proj = " unfused-proj" if fp else " fused-proj"
    first, first_at = None, {}  # the first run, and the first run of each temperature
    for mode, temperature, fused_proj in plan:
        base = mode + (f" T={temperature:g}" if many_t else "")
        label = base + ("" if fused_proj == fp else other_proj)
        gc.collect()  # the previous engine (KV pool, graphs) holds a reference cycle
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        s_, out_, st_ = run_engine(ours, cfg, prompts, new_tokens, device, args, mode, temperature, fused_proj)
        if device.startswith("cuda"):
            st_["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        st_["fused_projections"] = fused_proj
        first = first or label
        first_at.setdefault(temperature, label)
        # the other projection setting against the run it follows; others against the first at their temperature
        ref = base if fused_proj != fp else first_at[temperature]
        runs.pop(label, None)  # a value given twice keeps its last run, listed last
        runs[label] = (s_, out_, st_, ref)
    for option, pairs, names, cpu_only in (
        ("cpu_packed_gemm", args.compare_cpu_packed_gemm, ("linear-gemm", "packed-gemm"), True),
        ("decode_carry", args.compare_decode_carry, ("gather", "carry"), True),
        ("overlap_round_trips", args.compare_overlap_round_trips, ("serial", "overlapped"), False),
    ):
        if not pairs or (cpu_only and device != "cpu"):
            continue
        # The first run with the option flipped, then as set: other / set / other / set ... in one process.
        mode, temperature, fused_proj = plan[0]
        for rep in range(pairs):
            for flag in (not getattr(args, option), getattr(args, option)):
                s_, out_, st_ = run_engine(
                    ours,
                    cfg,
                    prompts,
                    new_tokens,
                    device,
                    argparse.Namespace(**{**vars(args), option: flag}),
                    mode,
                    temperature,
                    fused_proj,
                )
                st_["fused_projections"] = fused_proj
                runs[f"{first} {names[flag]} #{rep + 1}"] = (s_, out_, st_, first)
    eng_s, eng_out, stats, _ = runs[first]
    result: dict = {
        "shape": args.shape,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "decode_attention": args.decode_attention[0],
        "decode_attention_runs": args.decode_attention,
        "temperature": args.temperature[0],
        "temperature_runs": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seeded": not args.unseeded,
        "fused_projections": args.fused_projections,
        "compare_fused_projections": args.compare_fused_projections,
        "fused_kernels": args.fused_kernels,
        "params_M": round(n_params / 1e6, 2),
        "prompts": n,
        "new_tokens": new_tokens,
        "prompt_len": list(args.prompt_len),
        "threads": torch.get_num_threads(),
        "engine_s": round(eng_s, 3),
        "engine_tok_s": round(n * new_tokens / eng_s, 1),
        "engine_steps": stats["steps"],
        "engine_ms_per_step": round(1e3 * eng_s / max(stats["steps"], 1), 2),
        "engine_preemptions": stats["num_preemptions"],
        "engine_decode_steps": args.decode_steps,
        "engine_round_trips": stats["sampling_round_trips"],
        "engine_cpu_s": round(stats["cpu_s"], 3),
    }
    if "profile" in stats:
        result["profile"] = stats["profile"]
    if len(runs) > 1:
        result["by_run"] = {
            label: {
                "engine_s": round(s_, 3),
                "engine_tok_s": round(n * new_tokens / s_, 1),
                "engine_ms_per_step": round(1e3 * s_ / max(st_["steps"], 1), 2),
                "engine_steps": st_["steps"],
                "engine_round_trips": st_["sampling_round_trips"],
                "engine_cpu_s": round(st_["cpu_s"], 3),
                "fused_projections": st_["fused_projections"],
                "identical_to": {ref: f"{sum(a == b for a, b in zip(out_, runs[ref][1]))}/{n}"},
                "mean_common_prefix_with_it": mean_common_prefix(out_, runs[ref][1]),
                **({"profile": st_["profile"]} if "profile" in st_ else {}),
                **({"engine_peak_mem_GiB": st_["peak_mem_GiB"]} if "peak_mem_GiB" in st_ else {}),
            }
            for label, (s_, out_, st_, ref) in runs.items()
        }
    if device.startswith("cuda"):
        result["engine_peak_mem_GiB"] = stats["peak_mem_GiB"]
        result["engine_kv_pool_GiB"] = stats["kv_pool_GiB"]  # reserved up front, part of the peak
        bw = copy_bandwidth(device)
        contexts = [len(p) + i for p in prompts for i in range(new_tokens)]  # each row-step's cached keys
        roof = decode_roofline(cfg, n, contexts, torch.empty((), dtype=dtype).element_size(), bw)
        result.update(
            copy_bw_GBs=round(bw / 1e9, 1),
            **{key: round(value, 1) for key, value in roof.items()},
            roofline_fraction=round(n * new_tokens / eng_s / roof["decode_roofline_tok_s"], 3),
            gpu=torch.cuda.get_device_name(),
        )
        if "decode_roofline_uniform_routing_tok_s" in roof:
            result["roofline_fraction_uniform_routing"] = round(
                n * new_tokens / eng_s / roof["decode_roofline_uniform_routing_tok_s"], 3
            )
    if hf is not None:
        ours_again = ours if args.rounds > 1 else None  # more rounds run the engine again
        del ours
        gc.collect()  # the engine (KV pool, graphs) holds a reference cycle
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        sampling = {
            "temperature": args.temperature[0],
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
        }
        hf_s, hf_out = run_hf(hf, prompts, new_tokens, device, sampling)
        same = sum(a == b for a, b in zip(eng_out, hf_out))
        first_tok = sum(a[0] == b[0] for a, b in zip(eng_out, hf_out))
        result.update(hf_attn=getattr(hf.config, "_attn_implementation", None), hf_cache="dynamic")
        result.update(
            hf_generate_s=round(hf_s, 3),
            hf_generate_tok_s=round(n * new_tokens / hf_s, 1),
            speedup=round(hf_s / eng_s, 2),
            hf_generate_cpu_s=round(run_hf.cpu_s, 3),
            speedup_cpu_time=round(run_hf.cpu_s / stats["cpu_s"], 2),
            identical_sequences=f"{same}/{n}",
            identical_first_token=f"{first_tok}/{n}",
            mean_common_prefix_tokens=mean_common_prefix(eng_out, hf_out),
        )
        if device.startswith("cuda"):
            result["hf_peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if args.rounds > 1:
            # More (engine, generate) pairs of the first run's setting, alternating, so that a slow
            # spell of a shared host falls on both sides; the first pair is the one above.
            mode, temperature, fused_proj = plan[0]
            ratios = [hf_s / eng_s]
            for _ in range(args.rounds - 1):
                gc.collect()
                s_, _, _ = run_engine(ours_again, cfg, prompts, new_tokens, device, args, mode, temperature, fused_proj)
                h_, _ = run_hf(hf, prompts, new_tokens, device, sampling)
                ratios.append(h_ / s_)
            result.update(
                speedup_rounds=[round(r, 2) for r in ratios], speedup_median=round(sorted(ratios)[len(ratios) // 2], 2)
            )
    engine_tok_s, hf_tok_s = result["engine_tok_s"], result.get("hf_generate_tok_s")
    speedup = result.get("speedup_median", result.get("speedup"))
    head = headline(
        f"generated tokens/s, engine ({args.shape}, {n} prompts x {new_tokens} tokens, {device})",
        engine_tok_s,
        "transformers generate, same model, prompts and lengths",
        hf_tok_s,
        speedup,
        "generate s / engine s (>1: engine faster); the median of --rounds when given",
    )
    emit("rollout", head, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
