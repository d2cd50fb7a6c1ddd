"""What the benchmarks share: the headline every result starts with (the figure, the baseline measured in
the same run, their ratio), the stamp of the code and machine it measured, and a summary of a CUDA profile."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# Hugging Face configs of the Qwen2.5 shapes the GPU benchmarks build (random weights, nothing downloaded).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "torch_dtype": "bfloat16",
}
QWEN25_15B = {
    **QWEN25_05B,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
}

# OLMo-2-0425-1B's shape (q/k norms over the projections, post-block norms; untied 100k vocabulary)
OLMO2_1B = {
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 100352,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "eos_token_id": 100257,
    "pad_token_id": 100277,
    "torch_dtype": "bfloat16",
}

# Phi-3-mini-4k's shape (packed q/k/v and gate/up on disk, a 2,047-token window in every layer)
PHI3_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "max_position_embeddings": 4096,
    "sliding_window": 2047,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 32000,
    "pad_token_id": 32000,
    "torch_dtype": "bfloat16",
}

# Phi-4-mini-instruct's shape: 24 heads of 128 over 8 K/V heads, three quarters of each head turned by LongRoPE
# (its short factors here a ramp: the weights are random, and the factors' values do not change the work), a
# 200k vocabulary tied to the embeddings
PHI4_MINI = {
    **PHI3_MINI,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 200064,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.02 * i for i in range(48)],
        "long_factor": [1.0 + 0.5 * i for i in range(48)],
    },
    "sliding_window": 262144,
    "tie_word_embeddings": True,
    "bos_token_id": 199999,
    "eos_token_id": 199999,
    "pad_token_id": 199999,
}

# GLM-4-9B-0414's shape: 32 heads of 128 over 2 K/V heads, half of each head turned (adjacent pairs), q/k/v biases,
# a norm before and after each block, gate/up packed on disk; 9.4B parameters
GLM4_9B = {
    "architectures": ["Glm4ForCausalLM"],
    "model_type": "glm4",
    "hidden_size": 4096,
    "intermediate_size": 13696,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "vocab_size": 151552,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "eos_token_id": 151329,
    "pad_token_id": 151329,
    "torch_dtype": "bfloat16",
}

# gpt-oss-20b's shape (its config.json less the MXFP4 quantization: bf16 experts): 24 layers of width 2,880, 32
# experts of width 2,880 a layer (top 4), sinks, a 128-token window in every other layer; 20.9B parameters
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "torch_dtype": "bfloat16",
}  # fmt: skip

# Gemma 3 1B's shape (norms around each block, GeGLU, a 512-token window in five layers of six with their own
# RoPE base; a tied 262k vocabulary)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 13,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}
"""gemma-2-2b's shape."""
GRANITEMOE_1B = {
    "architectures": ["GraniteMoeForCausalLM"],
    "model_type": "granitemoe",
    "hidden_size": 1024,
    "intermediate_size": 512,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "num_experts_per_tok": 8,
    "vocab_size": 49155,
    "max_position_embeddings": 4096,
    "embedding_multiplier": 12.0,
    "attention_multiplier": 0.015625,
    "residual_multiplier": 0.22,
    "logits_scaling": 6.0,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}
"""A 1.3B expert model in granite-3.0-1b-a400m's layout (24 layers, 32 experts of width 512 a layer, 8 a token):
a mixture of experts that one GPU trains in full."""

COMMIT_ENV = "ARENO_COMMIT"
"""Overrides the commit read from git: a run from an exported tree (``git archive``, no ``.git``)
sets it to the commit it exported."""

HEADLINE_KEYS = ("metric", "figure", "baseline_name", "baseline", "ratio", "ratio_is")
"""The keys every bench's JSON starts with (after ``bench``): one row of ``bench/RESULTS.md``."""


_KEEP: dict[Path, str] = {}
"""Temporary work directories a bench asked to keep (``keep_work_dir``), and why."""


def keep_work_dir(path: Path, why: str) -> None:
    """Keep ``work_dir``'s temporary ``path`` at the end, named on stderr with ``why`` (what in it a reader
    wants: profiles, a failed arm's logs)."""
    _KEEP[path] = why


@contextlib.contextmanager
def work_dir(given: str | None, prefix: str) -> Iterator[Path]:
    """``given`` (made if missing, always kept), else a new temporary directory, removed when the bench
    ends well and kept, named on stderr, when it fails or asked to keep it (``keep_work_dir``): its models
    and runs weigh up to gigabytes, and its logs are where a failure is read."""
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"kept {path} (the failed bench's models, runs and logs): remove it when done", file=sys.stderr)
        raise
    finally:
        why = _KEEP.pop(path, None)
    if why is not None:
        print(f"kept {path} ({why}): remove it when done", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)


def git_commit() -> str:
    """The short commit of this checkout (``ARENO_COMMIT`` when set), or ``unknown`` outside git."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "unknown"


def stamp() -> dict[str, str]:
    """``{"commit", "host", "date"}`` for a bench's JSON (the date in UTC)."""
    return {
        "commit": git_commit(),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
    }


def expert_params(cfg) -> int:
    """Parameters of one routed expert: its gate, up and down projections (and, with ``expert_bias``, their biases)."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 3 * d * i + ((2 * i + d) if cfg.expert_bias else 0)


def step_weight_params(cfg, experts_read: float | None = None) -> float:
    """Parameters a forward step over a batch of rows must read once: all of ``cfg.num_params()`` but an untied
    input embedding (a lookup reads only the rows' own rows of it) and, of each sparse layer's routed experts, all
    but ``experts_read`` (default the top k: the fewest any routing of the rows reaches; the shared experts and the
    router are read by every row)."""
    k = cfg.num_experts_per_tok if experts_read is None else experts_read
    sparse = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.num_params() - embed - sparse * (cfg.num_experts - k) * expert_params(cfg)


def uniform_experts_reached(cfg, rows: int) -> float:
    """Routed experts of a sparse layer that ``rows`` rows reach on average when each row picks its top k uniformly
    at random: each expert is missed by a row with probability 1 - k/E. A model of routing, not a bound."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** rows) if e else 0.0


def active_params(cfg) -> dict:
    """Matmul weights one token multiplies by: per layer the attention projections, the router, its
    top-k experts and the shared ones (Qwen2-MoE's shared expert and its gate's row, GLM-4.5's
    ``n_shared_experts``), or the dense MLP; plus the LM head. The input embedding (a lookup), the norm
    weights (elementwise) and biases (gpt-oss's experts': additions) are not counted; ``no_lm_head`` leaves the
    head out too."""
    d, hq, hkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = d * hq * dh + 2 * d * hkv * dh + hq * dh * d
    width = (cfg.num_experts_per_tok + cfg.n_shared_experts) * cfg.moe_intermediate_size
    width += cfg.shared_expert_intermediate_size
    shared_gate = d if cfg.shared_expert_intermediate_size else 0
    sparse = cfg.num_experts * d + shared_gate + 3 * d * width
    dense = 3 * d * cfg.intermediate_size
    layers = sum(attn + (sparse if cfg.is_moe_layer(i) else dense) for i in range(cfg.num_hidden_layers))
    head = cfg.vocab_size * d
    return {"active_params": layers + head, "active_params_no_lm_head": layers, "lm_head_params": head}


def layer_windows(cfg) -> Counter:
    """The decoder's layers counted by attention window (None: every earlier key)."""
    return Counter(cfg.layer_window(i) for i in range(cfg.num_hidden_layers))


def keys_seen(windows: Counter, context: int, cached: bool = False) -> int:
    """Keys a token at 1-based position ``context`` sees, summed over the layers of ``windows`` (``layer_windows``):
    a sliding layer's query sees its last ``window`` keys, itself one. ``cached``: only those before it, which
    decoding reads from the cache."""
    return sum(
        count * ((context if window is None else min(context, window)) - cached) for window, count in windows.items()
    )


def ratio(numerator: float | None, denominator: float | None, digits: int = 3) -> float | None:
    """``numerator / denominator`` rounded, or None when either is missing (no baseline ran) or zero."""
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, digits)


def headline(
    metric: str, figure: float | None, baseline_name: str, baseline: float | None, ratio: float | None, ratio_is: str
) -> dict:
    """The fields a results-table row is made of: ``figure`` (what areno measured, in ``metric``), ``baseline``
    (``baseline_name``, measured in the same run; None when it did not run), and their ``ratio`` (``ratio_is``
    says which way round)."""
    return dict(zip(HEADLINE_KEYS, (metric, figure, baseline_name, baseline, ratio, ratio_is)))


def emit(bench: str, head: dict, details: dict) -> dict:
    """Print one run's result as one JSON line on stdout: ``bench``, the headline, the details, the stamp."""
    record = {"bench": bench, **head, **details, **stamp()}
    print(json.dumps(record), flush=True)
    return record


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m bench.<name>``, its help the module's docstring."""
    return argparse.ArgumentParser(
        prog=f"python -m bench.{name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def check_rounds_and_lengths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` (exit 2 with the usage) unless ``--rounds`` and ``--reps`` are at least 1 and
    ``--min-completion-len`` (where given) lies in [1, ``--completion-len``]."""
    if args.rounds < 1 or args.reps < 1:
        p.error("--rounds and --reps must be at least 1")
    if args.min_completion_len is not None and not 1 <= args.min_completion_len <= args.completion_len:
        p.error("--min-completion-len must be between 1 and --completion-len")


def synced_s(fn: Callable[[], object], device: str | torch.device) -> float:
    """Seconds ``fn()`` takes, the CUDA queue drained before and after it on a CUDA ``device``."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def graphed_us(step: Callable[[], object], per_step: int, trials: int = 5, replays: int = 20) -> float:
    """Microseconds per item of a CUDA graph of ``step`` (``per_step`` items, e.g. layers, per call): run
    once eagerly on a side stream (kernels compile outside the capture), captured, replayed; the median
    of ``trials`` timings of ``replays`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end) / replays / per_step)
    return round(sorted(times)[len(times) // 2], 2)


def profile_cuda(fn: Callable[[], object], top: int = 25, trace: str | None = None) -> dict:
    """Run ``fn`` once under the profiler: wall time against the summed time of the kernels and copies
    (``gpu_busy`` well below 1 means the GPU waits on the host), the top kernels by device time and the
    host-side ops by self CPU time (syncs such as ``cudaStreamSynchronize`` show up there). CUDA-graph
    replays are included: the profiler records the kernels inside them. ``trace``: also write the
    Chrome trace there (``python -m bench.trace_summary`` reads it)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    kernel_ms = sum(device_us(e) for e in kernels) / 1e3
    host = [e for e in events if e.device_type == DeviceType.CPU]
    return {
        "wall_ms": round(wall_ms, 1),
        "kernel_ms": round(kernel_ms, 1),
        "gpu_busy": round(kernel_ms / wall_ms, 3),
        "kernel_launches": int(sum(e.count for e in kernels)),
        "top_kernels": [
            {
                "kernel": e.key[:90],
                "calls": e.count,
                "ms": round(device_us(e) / 1e3, 2),
                "share": round(device_us(e) / 1e3 / max(kernel_ms, 1e-9), 3),
            }
            for e in sorted(kernels, key=device_us, reverse=True)[:top]
        ],
        "top_ops_by_device_time": [
            {"op": e.key[:60], "calls": e.count, "device_ms": round(device_us(e) / 1e3, 2)}
            for e in sorted(host, key=device_us, reverse=True)[:top]
        ],
        "top_host_ops": [
            {"op": e.key[:60], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
            for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        ],
    }
