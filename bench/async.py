"""Synchronous (η = 0) vs asynchronous (η = 2, 4) RL on long-tailed completion lengths.

One run, same hardware, same model, data and recipe (``grpo_async``: decoupled PPO) for every arm;
only ``max_head_offpolicyness`` changes. Rollout: the embedded ``RolloutEngine`` driven by
``InProcessRolloutClient`` (its own thread) and the everlasting ``WorkflowExecutor``. Training: a
``LocalTrainBackend`` under ``RecipeRunner`` in the main thread. After each optimizer step the new
weights are copied into the engine inside ``pause()``/``resume()``; in-flight requests continue
under the new version. η = 0 admits exactly one batch per policy version: the synchronous
algorithm, with rollout idle while the trainer trains and the trainer idle while the slowest
group finishes.

Completion lengths are long-tailed per prompt (a fraction ``--long-frac`` of prompts generate
``--long-len`` tokens, the rest ``--short-len``; ``ignore_eos``), so a synchronous step waits for
its slowest group.

Reported per arm: trained tokens/s (prompt + completion tokens of the batches trained on, over the
wall time of the measured steps), the trainer's idle fraction (time blocked in ``wait_batch``) and
the rollout engine's idle fraction (wall time not inside ``engine.step``), staleness and drops.

    python bench/async.py                              # CPU: tiny model, 2 threads (rollout, train)
    python bench/async.py --device cuda --hidden 896 --layers 24 --heads 14 --kv-heads 2 \
        --batch-size 16 --n-samples 8 --short-len 256 --long-len 4096 --steps 12   # one GPU, overlapping
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areno.engine.executor import WorkflowExecutor
from areno.engine.staleness import StalenessManager
from areno.types import SamplingParams, TokenBatch
from bench.longtail import LongTailWorkflow, long_tail_rows, parity_reward


def make_model_dir(args, tokenizer) -> Path:
    from areno.models.hf_io import init_model_dir, tiny_config

    out = Path(tempfile.mkdtemp(prefix="areno-bench-async-"))
    cfg = tiny_config(
        len(tokenizer), hidden_size=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads
    )
    return init_model_dir(out, cfg, tokenizer, seed=0)


def run_arm(eta: int, args, model_dir: Path, tokenizer) -> dict:
    from areno.models.hf_io import load_model
    from areno.recipes import get_recipe
    from areno.recipes.runner import RecipeRunner
    from areno.rollout.client import InProcessRolloutClient
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.train import LocalTrainBackend, TrainBackendConfig

    torch.manual_seed(0)
    dev = args.device
    rollout_dtype = "bfloat16" if dev == "cuda" else "float32"
    model, model_cfg = load_model(model_dir, dtype=getattr(torch, rollout_dtype), device=dev)
    engine_cfg = RolloutEngineConfig(
        device=dev, dtype=rollout_dtype, **({"kv_memory_fraction": 0.3} if dev == "cuda" else {"num_blocks": 2048})
    )
    engine = RolloutEngine(
        model, model_cfg, config=engine_cfg, eos_token_ids=[tokenizer.eos_token_id], tokenizer=tokenizer
    )
    busy = {"s": 0.0}
    step_fn = engine.step

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step_fn()
        finally:
            busy["s"] += time.perf_counter() - t0

    engine.step = timed_step  # the client's driver thread calls engine.step(): count its busy time
    client = InProcessRolloutClient(engine)

    backend = LocalTrainBackend(
        TrainBackendConfig(
            lr=1e-5,
            device=dev,
            dtype="bfloat16" if dev == "cuda" else "float32",
            max_tokens_per_mb=args.max_tokens_per_mb,
            seed=0,
        )
    )
    backend.initialize(model_dir)
    recipe = get_recipe(args.recipe)
    runner = RecipeRunner(recipe, {recipe.roles[0].name: backend})

    params = SamplingParams(temperature=1.0, max_new_tokens=args.long_len)
    workflow = LongTailWorkflow(tokenizer, parity_reward, args.n_samples, params)
    staleness = StalenessManager(
        max_head_offpolicyness=eta, batch_size=args.batch_size, max_concurrent=args.max_concurrent
    )
    ex = WorkflowExecutor(
        client,
        workflow,
        long_tail_rows(short_len=args.short_len, long_len=args.long_len, long_frac=args.long_frac, seed=1),
        staleness,
    )

    trained_tokens = long_trained = 0
    wait_s = 0.0
    t_start = busy_start = None
    staleness_means = []
    for step in range(args.steps + 1):  # step 0 warms up (allocation, kernels) and is not timed
        t0 = time.perf_counter()
        groups = ex.wait_batch(args.batch_size, timeout=3600)
        t1 = time.perf_counter()
        batch = TokenBatch.from_trajectories([t for g in groups for t in g])
        runner.step(batch)
        ex.pause()
        engine.pause()
        engine.update_weights(backend.named_weights(), version=step + 1)
        ex.set_version(step + 1)
        engine.resume()
        client.wake()
        ex.resume()
        if step == 0:
            t_start, busy_start = time.perf_counter(), busy["s"]
            continue
        wait_s += t1 - t0
        trained_tokens += batch.num_tokens
        long_trained += sum(len(t.completion_ids) == args.long_len for g in groups for t in g)
        staleness_means.append(ex.metrics()["rollout/staleness_mean"])
    wall = time.perf_counter() - t_start
    m = ex.metrics()
    ex.stop()
    client.close()
    backend.shutdown()
    return {
        "eta": eta,
        "steps": args.steps,
        "wall_s": round(wall, 3),
        "trained_tokens": trained_tokens,
        "trained_tokens_per_s": round(trained_tokens / wall, 1),
        "trainer_idle_frac": round(wait_s / wall, 3),
        # +- one engine step at the window edges; clamped at 0
        "rollout_idle_frac": round(max(0.0, 1 - (busy["s"] - busy_start) / wall), 3),
        "long_seqs_trained": long_trained,
        "staleness_mean": round(sum(staleness_means) / len(staleness_means), 3),
        "dropped_stale_groups": int(m["rollout/dropped_stale"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--etas", default="0,2,4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--short-len", type=int, default=16)
    p.add_argument("--long-len", type=int, default=192)
    p.add_argument("--long-frac", type=float, default=0.15)
    p.add_argument("--max-concurrent", type=int, default=64, help="samples (prompts) in flight")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-tokens-per-mb", type=int, default=None)
    p.add_argument("--recipe", default="grpo_async")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (rollout and train run in 2 threads)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    from areno.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model_dir = make_model_dir(args, tokenizer)
    arms = [run_arm(int(e), args, model_dir, tokenizer) for e in args.etas.split(",")]
    base = arms[0]["trained_tokens_per_s"]
    for arm in arms:
        arm["speedup_vs_first"] = round(arm["trained_tokens_per_s"] / base, 3)
    hw = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{torch.get_num_threads()} threads/op"
    print(json.dumps({"bench": "async", "hardware": hw, "config": vars(args), "arms": arms}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
