"""Where a CPU decode step of the rollout engine goes, and a floor under it: how far issue #3's CPU
target (3x transformers ``generate``; 2 cores, ~20M parameters, 32 prompts x 128 new tokens, greedy)
is from what this machine can do. One process, one run, prints one JSON object:

- ``engine_step_ms``: the engine's median greedy decode step; ``engine_profile_ms``: the same steps
  under ``torch.profiler`` split by op (self CPU time per step): ``gemm`` (the projections: oneDNN
  packed and ``F.linear``), ``attention`` (its batched matmuls and softmax), ``head_sampling``
  (log-softmax, argmax), ``other_ops``, and ``outside_ops`` (the wall time no op covers: Python,
  scheduling; the profiler's own cost inflates it and the total);
- ``generate_step_ms``: ``generate``'s time per new token on the same model, prompts and lengths;
- ``floor_ms``: a lower bound on a step that computes what the engine computes, with every part at
  its best measured speed and nothing else: each GEMM of the step alone (weights warm in cache) at
  the faster of ``F.linear`` and the packed form, the log-softmax + argmax over the vocabulary, and
  reading the attention's K/V once at the copy bandwidth measured here (``floor_parts_ms``).
  Elementwise ops (norms, RoPE, SiLU, residuals), cache writes and Python are left out, so a real
  step is slower than the floor;
- ``gemm_sequence_ms``: the engine model's own GEMMs (its weights, its packed copies and fused groups,
  as the engine set them up) back to back in a step's order, nothing between them. Unlike the floor's
  GEMMs, each weight is read once per pass, as in a step: the step's weights (~64 MB at cpu20m) do not
  fit the cache, so this is what the GEMMs cost inside a step with zero other work.
  ``sequence_floor_ms`` = that + the floor's head and K/V parts, and ``speedup_at_sequence_floor``;
- ``target_ms`` = ``generate_step_ms / 3`` and ``speedup_at_floor`` = ``generate_step_ms / floor_ms``.

    python bench/cpu_step_bound.py --threads 2                # cpu20m, 32 x 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rollout import SHAPES, add_workload_args, build_models, copy_bandwidth, make_prompts, run_hf
from bench.stamp import stamp

GEMM_OPS = {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"}
ATTENTION_OPS = {"aten::bmm", "aten::baddbmm", "aten::_softmax"}
HEAD_OPS = {"aten::_log_softmax", "aten::amax", "aten::argmax"}


def median_ms(fn, reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` calls, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def gemm_floor_ms(cfg, rows: int, reps: int) -> dict[str, float]:
    """Each GEMM of one decode step of ``rows`` rows alone: the faster of ``F.linear`` and oneDNN's
    packed form (``areno.models.cpu_gemm``), times its count per step."""
    from areno.models import cpu_gemm

    h, hd = cfg.hidden_size, cfg.head_dim
    shapes = {  # name: (in, out, per step)
        "qkv": (h, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd, cfg.num_hidden_layers),
        "o_proj": (cfg.num_attention_heads * hd, h, cfg.num_hidden_layers),
        "gate_up": (h, 2 * cfg.intermediate_size, cfg.num_hidden_layers),
        "down_proj": (cfg.intermediate_size, h, cfg.num_hidden_layers),
        "lm_head": (h, cfg.vocab_size, 1),
    }
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (k, n, count) in shapes.items():
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * 0.02
        ms = median_ms(lambda: F.linear(x, w), reps)
        if cpu_gemm.supported():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            ms = min(ms, median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), reps))
        out[name] = round(ms * count, 3)
    return out


def engine_steps(ours, cfg, prompts, new_tokens: int, profile_steps: int):
    """Median greedy decode-step ms of a fresh engine, and the op breakdown of ``profile_steps``
    decode steps of a second pass (ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.types import SamplingParams

    ecfg = RolloutEngineConfig(
        max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + new_tokens + 1, cpu_kv_cache_bytes=1 << 30
    )
    engine = RolloutEngine(ours, cfg, config=ecfg, eos_token_ids=(cfg.eos_token_id,))
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([p[:8] for p in prompts[:8]], [params] * min(8, len(prompts)))  # warm-up
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # the prompts' prefill (one step when they fit its token budget, as 32 x 64 do)
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(3):  # the prefill, then two decode steps before the profiled ones
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(profile_steps):
            engine.step()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    events = prof.events()
    main = [e for e in events if e.cpu_parent is None and e.thread == events[0].thread]
    covered, end = 0.0, float("-inf")  # union of the top-level ops' intervals
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in main):
        covered += max(0.0, stop - max(start, end))
        end = max(end, stop)
    parts = {"gemm": 0.0, "attention": 0.0, "head_sampling": 0.0, "other_ops": 0.0}
    for e in prof.key_averages():
        key = (
            "gemm"
            if e.key in GEMM_OPS
            else "attention"
            if e.key in ATTENTION_OPS
            else "head_sampling"
            if e.key in HEAD_OPS
            else "other_ops"
        )
        parts[key] += e.self_cpu_time_total / 1e3
    parts["outside_ops"] = wall_ms - covered / 1e3
    per_step = {k: round(v / profile_steps, 2) for k, v in parts.items()}
    per_step["wall"] = round(wall_ms / profile_steps, 2)
    return statistics.median(times) * 1e3, per_step


def gemm_sequence_ms(model, rows: int, reps: int) -> float:
    """Median ms of one pass over ``model``'s decode-step GEMMs in layer order (the fused q/k/v and
    gate/up groups where the engine fused them, each through its packed copy where one applies, as
    ``areno.models.cpu_gemm.linear`` runs them), on random inputs of ``rows`` rows."""
    from areno.models import cpu_gemm

    def products(group, linears):  # one GEMM for an intact fused group, else one per projection
        owners = [group] if group is not None and group.intact() else list(linears)
        return [(o.weight, o.bias, o.__dict__.get("cpu_pack")) for o in owners]

    seq = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        seq += products(a.qkv, (a.q_proj, a.k_proj, a.v_proj)) + products(None, [a.o_proj])
        seq += products(m.gate_up, (m.gate_proj, m.up_proj)) + products(None, [m.down_proj])
    seq.append((model.output_weight, None, model.__dict__.get("cpu_pack")))
    g = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w, _, _ in seq}}

    def one_pass():
        for w, b, pack in seq:
            cpu_gemm.linear(inputs[w.shape[1]], w, b, pack)

    with torch.no_grad():
        return median_ms(one_pass, reps)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per GEMM shape")
    ap.add_argument("--profile-steps", type=int, default=16, help="decode steps under the profiler")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_dict, n_default, new_default = SHAPES[args.shape]
    n, new_tokens = args.prompts or n_default, args.new_tokens or new_default
    if args.profile_steps + 3 > new_tokens:
        ap.error(f"--profile-steps must be at most --new-tokens - 3 ({new_tokens - 3}), got {args.profile_steps}")
    ours, cfg, hf = build_models(hf_dict, "cpu", torch.float32, with_hf=True)
    prompts = make_prompts(n, cfg.vocab_size, *args.prompt_len, seed=0)

    engine_ms, profile_ms = engine_steps(ours, cfg, prompts, new_tokens, args.profile_steps)
    hf_s, _ = run_hf(hf, prompts, new_tokens, "cpu")
    generate_ms = 1e3 * hf_s / new_tokens

    gemm = gemm_floor_ms(cfg, n, args.reps)
    sequence_ms = gemm_sequence_ms(ours, n, args.reps)  # the engine fused and packed ``ours`` in place
    from areno.rollout.sampling import argmax_rows

    logits = torch.randn(n, cfg.vocab_size)
    head_ms = median_ms(lambda: torch.log_softmax(logits, -1).gather(1, argmax_rows(logits)[:, None]), args.reps)
    mean_ctx = sum(map(len, prompts)) / n + (new_tokens + 1) / 2
    kv_bytes = 2 * cfg.num_hidden_layers * n * cfg.num_key_value_heads * cfg.head_dim * 4 * mean_ctx
    bw = copy_bandwidth("cpu") / 1e9  # GB/s
    parts = {
        "gemm": round(sum(gemm.values()), 2),
        "head_sampling": round(head_ms, 2),
        "attention_kv_read": round(kv_bytes / bw / 1e6, 2),
    }
    floor = sum(parts.values())
    sequence_floor = sequence_ms + parts["head_sampling"] + parts["attention_kv_read"]
    print(
        json.dumps(
            {
                "bench": "cpu_step_bound",
                "shape": args.shape,
                "prompts": n,
                "new_tokens": new_tokens,
                "threads": torch.get_num_threads(),
                "engine_step_ms": round(engine_ms, 2),
                "engine_profile_ms": profile_ms,
                "generate_step_ms": round(generate_ms, 2),
                "speedup": round(generate_ms / engine_ms, 2),
                "target_ms": round(generate_ms / 3, 2),
                "floor_ms": round(floor, 2),
                "floor_parts_ms": parts,
                "gemm_floor_ms": gemm,
                "copy_GBps": round(bw, 1),
                "mean_context": round(mean_ctx, 1),
                "speedup_at_floor": round(generate_ms / floor, 2),
                "gemm_sequence_ms": round(sequence_ms, 2),
                "sequence_floor_ms": round(sequence_floor, 2),
                "speedup_at_sequence_floor": round(generate_ms / sequence_floor, 2),
                **stamp(),
            }
        )
    )


if __name__ == "__main__":
    main()
