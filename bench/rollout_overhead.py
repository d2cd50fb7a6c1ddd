"""Per-decode-step host overhead of the rollout engine, against transformers ``generate`` in the same run.

A model with almost no compute (hidden 32, 2 layers, small vocabulary) makes a decode step's cost the
engine's own bookkeeping: scheduling, block tables, sampling, stop checks, host<->device copies.
Each concurrency level runs ``--new-tokens`` fixed-length completions for N prompts; the JSON reports
ms per engine step, generated tokens/s, and the same for ``generate`` on the same model and prompts.

    python bench/rollout_overhead.py                                    # CPU, 64 and 256 sequences, greedy
    python bench/rollout_overhead.py --mode sampled                     # temperature/top-p/top-k, per-request seeds
    python bench/rollout_overhead.py --profile 20                       # + cProfile top 20 (by tottime), 256 seqs
    python bench/rollout_overhead.py --fake-graph                       # graph decode path, no-op replay: host cost only
    python bench/rollout_overhead.py --device cuda --seqs 64 256 --skip-hf   # GPU: tiny model, graph decode steps

With ``--decode-steps K`` the engine runs K decode steps per host round trip (``RolloutEngineConfig.
decode_steps``); ``--decode-steps 1`` is the one-step-at-a-time engine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import rollout as rollout_bench
from bench.stamp import stamp

TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 512,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


sync = rollout_bench.sync


def params_for(mode: str, n: int, new_tokens: int):
    from areno.types import SamplingParams

    if mode == "greedy":
        return [SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)] * n
    # Mixed per-row parameters, half the rows with their own seed.
    return [
        SamplingParams(
            temperature=(0.7, 1.0)[i % 2],
            top_p=(1.0, 0.9)[i % 2],
            top_k=(-1, 50)[i % 3 == 0],
            max_new_tokens=new_tokens,
            ignore_eos=True,
            seed=i if i % 2 else None,
        )
        for i in range(n)
    ]


def run_engine(model, cfg, prompts, params, device: str, args, profile: int = 0) -> dict:
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    new_tokens = params[0].max_new_tokens
    kw = {} if args.decode_steps is None else {"decode_steps": args.decode_steps}
    ecfg = RolloutEngineConfig(
        block_size=16,
        num_blocks=len(prompts) * (-(-(64 + new_tokens + 8) // 16) + 1),
        max_num_seqs=len(prompts),
        max_tokens_per_step=8192,
        prefill_chunk_size=2048,
        max_model_len=64 + new_tokens + 8,
        **kw,
    )
    engine = RolloutEngine(model, cfg, config=ecfg, eos_token_ids=(cfg.eos_token_id,))
    if args.fake_graph:
        engine._graphs = _fake_graph_runner(engine, len(prompts))
    engine.generate([p[:4] for p in prompts[:8]], params[:8])  # warm-up (lazy tables, kernels)
    engine.warmup_cuda_graphs([len(prompts)], 64 + new_tokens)
    steps0 = engine.stats()["steps"]
    prof = cProfile.Profile() if profile else None
    sync(device)
    cpu0, t0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {o.request_id: o for o in engine.step()}  # the prefill of every prompt (one step)
    sync(device)
    cpu1, t1, steps1 = time.process_time(), time.perf_counter(), engine.stats()["steps"]
    while len(done) < len(ids):
        done.update({o.request_id: o for o in engine.step()})
    if prof:
        prof.disable()
    sync(device)
    t2, cpu2 = time.perf_counter(), time.process_time()
    outs = [done[i] for i in ids]
    wall, cpu = t2 - t0, cpu2 - cpu0
    steps = engine.stats()["steps"] - steps0
    dec_steps = engine.stats()["steps"] - steps1
    n_tok = sum(len(o.output_ids) for o in outs)
    out = {
        "engine_s": round(wall, 4),
        "engine_cpu_s": round(cpu, 4),
        "engine_tok_s": round(n_tok / wall, 1),
        "engine_steps": steps,
        "engine_ms_per_step": round(1e3 * wall / steps, 3),
        "engine_cpu_ms_per_step": round(1e3 * cpu / steps, 3),
        "engine_ms_per_token_step": round(1e3 * wall / new_tokens, 3),
        "decode_ms_per_step": round(1e3 * (t2 - t1) / dec_steps, 3),
        "decode_cpu_ms_per_step": round(1e3 * (cpu2 - cpu1) / dec_steps, 3),
    }
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(profile)
        out["profile_top"] = [line.strip() for line in s.getvalue().splitlines() if line.strip()][-profile - 1 :]
    out["_outputs"] = [o.output_ids for o in outs]
    return out


def _fake_graph_runner(engine, max_batch: int):
    """The CUDA-graph decode path with a replay that does no work (fixed logits): what is left of a
    decode step is the engine's host work — scheduling, block tables, input copies, sampling and
    stop checks on [B, V] logits, output bookkeeping."""
    from areno.rollout.cuda_graph import DecodeGraphRunner, _Graph

    class _NoReplay:
        def replay(self) -> None:
            pass

    class FakeRunner(DecodeGraphRunner):
        def can_loop(self, *args) -> bool:
            return False  # the greedy k-step loop graph would also hide the per-step sampling launches

        def _record(self, fn):
            return _NoReplay(), fn()

        def _capture(self, B: int, N: int) -> _Graph:
            e = self.engine
            logits_BV = torch.randn(B, e.vocab_size, generator=torch.Generator().manual_seed(B)).to(e.device)
            g = _Graph(
                graph=_NoReplay(),
                ids_ctx_2B=torch.ones(2, B, dtype=torch.long, device=e.device),
                bt_BN=torch.zeros(B, N, dtype=torch.long, device=e.device),
                logits_BV=logits_BV,
            )
            self._graphs[(B, N)] = g
            return g

    return FakeRunner(engine, max_batch=max_batch)


def run_hf(hf, prompts, new_tokens: int, device: str) -> dict:
    """``transformers.generate`` on the same prompts (bench/rollout.py's harness), as this bench's fields."""
    wall, outputs = rollout_bench.run_hf(hf, prompts, new_tokens, device)
    return {
        "hf_s": round(wall, 4),
        "hf_cpu_s": round(rollout_bench.run_hf.cpu_s, 4),
        "hf_tok_s": round(len(prompts) * new_tokens / wall, 1),
        "hf_ms_per_token_step": round(1e3 * wall / new_tokens, 3),
        "_outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256], help="concurrent sequences (one run each)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mode", choices=["greedy", "sampled"], default="greedy")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=None, help="engine decode steps per host round trip")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--fake-graph",
        action="store_true",
        help="decode through the CUDA-graph runner with a no-op replay: host cost only (implies --skip-hf)",
    )
    ap.add_argument("--profile", type=int, default=0, help="cProfile the largest run, print the top N functions")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    from areno.models.config import ModelConfig
    from areno.models.decoder import Decoder

    cfg = ModelConfig.from_hf(TINY)
    torch.manual_seed(0)
    model = Decoder(cfg).to(args.device).eval()
    hf = None
    if not (args.skip_hf or args.fake_graph):
        hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in TINY.items() if k != "architectures"})
        hf_cfg.pad_token_id = 0
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(args.device).eval()
        hf.load_state_dict(model.state_dict(), strict=True)
    runs = []
    for n in args.seqs:
        g = torch.Generator().manual_seed(n)
        lens = torch.randint(16, 65, (n,), generator=g).tolist()
        prompts = [torch.randint(3, cfg.vocab_size, (L,), generator=g).tolist() for L in lens]
        params = params_for(args.mode, n, args.new_tokens)
        eng = run_engine(
            model, cfg, prompts, params, args.device, args, profile=args.profile if n == max(args.seqs) else 0
        )
        row = {"seqs": n, **{k: v for k, v in eng.items() if not k.startswith("_")}}
        if hf is not None:
            ref = run_hf(hf, prompts, args.new_tokens, args.device)
            row.update({k: v for k, v in ref.items() if not k.startswith("_")})
            row["speedup_vs_generate"] = round(ref["hf_s"] / eng["engine_s"], 2)
            row["speedup_cpu_time"] = round(ref["hf_cpu_s"] / eng["engine_cpu_s"], 2)
            if args.mode == "greedy":
                row["identical_sequences"] = f"{sum(a == b for a, b in zip(eng['_outputs'], ref['_outputs']))}/{n}"
        runs.append(row)
    print(
        json.dumps(
            {
                "bench": "rollout_overhead",
                "device": args.device,
                "mode": args.mode,
                "threads": torch.get_num_threads(),
                "new_tokens": args.new_tokens,
                "decode_steps": args.decode_steps,
                "fake_graph": args.fake_graph,
                "runs": runs,
                **stamp(),
                "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            }
        )
    )


if __name__ == "__main__":
    main()
