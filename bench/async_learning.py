"""Learning under staleness: does the decoupled loss let η = 4 learn as fast (in steps) as η = 0?

Arms, one run each on the same machine, from ONE shared sft warm start, same data, seed, optimizer
and eval schedule (the demo's task unless overridden):
  - ``grpo_async`` (decoupled PPO, π_prox recomputed) with η = 0 — the synchronous reference;
  - ``grpo_async`` with η = 4;
  - ``grpo`` (naive PPO: the clipped ratio against the behaviour policy) with η = 4.
Reported per arm: the held-out accuracy curve, steps to reach the η = 0 arm's final accuracy
(target: η = 4 decoupled within 10% more steps than η = 0), wall time, staleness. Prints one JSON object.

    python bench/async_learning.py                     # examples/demo.yaml, CPU, ~10-15 min on 2 cores
    python bench/async_learning.py --steps 60 --eval-interval 10 -- rollout.batch_size=16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = (("grpo_async", 0), ("grpo_async", 4), ("grpo", 4))


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """First evaluated step whose accuracy is at least ``target`` (None if never)."""
    return next((step for step, acc in curve if step > 0 and acc >= target - 1e-9), None)


def run_arm(config_path: Path, work: Path, algorithm: str, eta: int, warm_model: Path, args) -> dict:
    from areno.api.config import load_config
    from areno.api.trainer import Trainer
    from areno.observe.metrics import read_jsonl_records

    run_dir = work / f"{algorithm}_eta{eta}"
    cfg = load_config(config_path, [
        f"run_dir={run_dir}", f"model.path={warm_model}", "warm_start.steps=0",
        f"train.algorithm={algorithm}", f"rollout.max_head_offpolicyness={eta}",
        f"train.steps={args.steps}", f"train.eval_interval={args.eval_interval}", "observe.console=false",
        *args.overrides,
    ])
    t0 = time.perf_counter()
    trainer = Trainer.init(cfg)
    try:
        trainer.evaluate_now()
        trainer.run()
    finally:
        trainer.shutdown()
    wall = time.perf_counter() - t0
    rows = read_jsonl_records(run_dir / "metrics.jsonl", what="metrics")
    curve = [(int(r["step"]), float(r["eval/accuracy"])) for r in rows if "eval/accuracy" in r]
    stale = [r["rollout/staleness_mean"] for r in rows if "rollout/staleness_mean" in r]
    return {"algorithm": algorithm, "eta": eta, "wall_s": round(wall, 1), "curve": curve,
            "final_accuracy": curve[-1][1], "best_accuracy": max(a for _, a in curve),
            "staleness_mean": round(sum(stale) / len(stale), 3) if stale else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "examples" / "demo.yaml"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--workdir", default=None)
    p.add_argument("overrides", nargs="*", help="dotted config overrides applied to every arm")
    args = p.parse_args(argv)
    from areno.api.config import load_config
    from areno.api.pipeline import run_warm_start

    work = Path(args.workdir or tempfile.mkdtemp(prefix="areno-bench-async-learning-"))
    base = load_config(args.config, [f"run_dir={work / 'shared'}", f"model.path={work / 'init_model'}",
                                     "observe.console=false", *args.overrides])
    if base.warm_start.steps <= 0:
        raise SystemExit(f"{args.config}: warm_start.steps must be > 0 (the arms share one warm start)")
    t0 = time.perf_counter()
    warm_model = run_warm_start(base)
    warm_s = time.perf_counter() - t0
    arms = [run_arm(Path(args.config), work, algo, eta, warm_model, args) for algo, eta in ARMS]
    target = arms[0]["final_accuracy"]
    ref_steps = steps_to_reach(arms[0]["curve"], target)
    for arm in arms:
        arm["steps_to_reference_final"] = steps_to_reach(arm["curve"], target)
        s = arm["steps_to_reference_final"]
        arm["steps_ratio_vs_eta0"] = round(s / ref_steps, 3) if s is not None and ref_steps else None
    result = {"bench": "async_learning", "config": args.config, "overrides": args.overrides, "steps": args.steps,
              "warm_start_s": round(warm_s, 1), "reference_final_accuracy": target,
              "target": "decoupled eta=4 steps_ratio_vs_eta0 <= 1.10", "arms": arms}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
