"""Learning under staleness: does the decoupled loss let η = 4 learn as fast (in steps) as η = 0?

Arms, one run each on the same machine, from ONE shared sft warm start, same data, seed, optimizer
and eval schedule (the demo's task unless overridden):
  - ``grpo_async`` (decoupled PPO, π_prox recomputed) with η = 0 — the synchronous reference;
  - ``grpo_async`` with η = 4;
  - ``grpo`` (naive PPO: the clipped ratio against the behaviour policy) with η = 4.
Reported per arm: the held-out accuracy curve, steps to reach the η = 0 arm's final accuracy
(target: η = 4 decoupled within 10% more steps than η = 0), wall time, staleness. Prints one JSON object;
its headline is the second arm's steps to the reference accuracy, the first arm's (η = 0) as the baseline,
``ratio`` = their quotient (over the mean curves when several seeds ran; None when never reached).

One seed's final accuracy moves by a few points between evaluations, so a verdict needs several
seeds: ``--seeds 0 1 2 3 --jobs 12`` runs every (seed, arm) pair in its own process (each repeats
its seed's deterministic warm start) and adds ``aggregate``: each arm's accuracy curve averaged
over the seeds, and the steps each mean curve needs to reach the η = 0 mean curve's final accuracy.

    python -m bench.async_learning                     # areno/configs/demo.yaml, CPU, ~10-15 min on 2 cores
    python -m bench.async_learning --steps 60 --eval-interval 10 -- rollout.batch_size=16
    python -m bench.async_learning --seeds 0 1 2 3 4 --jobs 15   # 15 processes, one core each
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from areno.api.config import load_config
from areno.api.pipeline import DEMO_CONFIG, run_warm_start
from areno.api.trainer import Trainer
from areno.observe.metrics import read_jsonl_records
from bench._common import emit, headline, parser, work_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
"""Where ``python -m bench.async_learning`` runs from in the per-(seed, arm) processes of ``--jobs``."""

ARMS = (("grpo_async", 0), ("grpo_async", 4), ("grpo", 4))


def parse_arm(text: str) -> tuple[str, int]:
    algorithm, _, eta = text.partition(":")
    if not eta.isdigit():
        raise argparse.ArgumentTypeError(f"--arms: {text!r} is not ALGORITHM:ETA (e.g. grpo_async:4)")
    return algorithm, int(eta)


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """First evaluated step whose accuracy is at least ``target`` (None if never)."""
    return next((step for step, acc in curve if step > 0 and acc >= target - 1e-9), None)


def total_steps(args) -> int:
    """Steps every arm runs: the budget plus ``--slack`` of it (the same schedule for all arms)."""
    return math.ceil(args.steps * (1 + args.slack))


def run_arm(config_path: Path, work: Path, algorithm: str, eta: int, warm_model: Path, args) -> dict:
    run_dir = work / f"{algorithm}_eta{eta}"
    cfg = load_config(
        config_path,
        [
            f"run_dir={run_dir}",
            "overwrite=true",  # each arm starts over, also in a reused work directory
            f"model.path={warm_model}",
            "warm_start.steps=0",
            f"train.algorithm={algorithm}",
            f"rollout.max_head_offpolicyness={eta}",
            f"train.steps={total_steps(args)}",
            f"train.eval_interval={args.eval_interval}",
            "observe.console=false",
            *args.overrides,
        ],
    )
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
    return {
        "algorithm": algorithm,
        "eta": eta,
        "wall_s": round(wall, 1),
        "curve": curve,
        "final_accuracy": curve[-1][1],
        "best_accuracy": max(a for _, a in curve),
        "staleness_mean": round(sum(stale) / len(stale), 3) if stale else 0.0,
    }


def with_ratios(arms: list[dict], budget: int | None = None) -> None:
    """Steps of each arm to the first arm's (η = 0) accuracy at ``budget`` steps (None: its final
    one), and the ratio to the first arm's steps. With ``--slack`` every arm runs past ``budget``,
    so the others can show whether they reach it within that many more steps."""
    ref_curve = [(s, a) for s, a in arms[0]["curve"] if budget is None or s <= budget]
    target = ref_curve[-1][1]
    ref_steps = steps_to_reach(ref_curve, target)
    arms[0]["reference_accuracy"] = target
    for arm in arms:
        s = arm["steps_to_reference_final"] = steps_to_reach(arm["curve"], target)
        arm["steps_ratio_vs_eta0"] = round(s / ref_steps, 3) if s is not None and ref_steps else None


def aggregate(per_seed: dict[int, list[dict]], budget: int | None = None) -> dict:
    """Mean accuracy curve of each arm over the seeds (steps every seed evaluated), and steps ratios
    of the mean curves; plus each arm's per-seed ratios and mean final accuracy."""
    n_arms = len(next(iter(per_seed.values())))
    arms = []
    for i in range(n_arms):
        runs = [arms_[i] for arms_ in per_seed.values()]
        steps = sorted(set.intersection(*(set(step for step, _ in r["curve"]) for r in runs)))
        curve = [(step, round(sum(dict(r["curve"])[step] for r in runs) / len(runs), 4)) for step in steps]
        arms.append(
            {
                "algorithm": runs[0]["algorithm"],
                "eta": runs[0]["eta"],
                "seeds": len(runs),
                "curve": curve,
                "final_accuracy": curve[-1][1],
                "per_seed_steps_ratio": [r.get("steps_ratio_vs_eta0") for r in runs],
            }
        )
    with_ratios(arms, budget)
    return {
        "arms": arms,
        "reference_final_accuracy": arms[0]["final_accuracy"],
        "reference_accuracy": arms[0]["reference_accuracy"],
    }


def run_seed(args, seed: int, arms_spec: list[tuple[str, int]]) -> tuple[list[dict], float]:
    work = Path(args.workdir) / f"seed{seed}"
    overrides = [*args.overrides, f"train.seed={seed}"] if seed is not None else list(args.overrides)
    base = load_config(
        args.config,
        [
            f"run_dir={work / 'shared'}",
            "overwrite=true",
            f"model.path={work / 'init_model'}",
            "observe.console=false",
            *overrides,
        ],
    )
    if base.warm_start.steps <= 0:
        raise SystemExit(f"{args.config}: warm_start.steps must be > 0 (the arms share one warm start)")
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # it prints its accuracy; stdout carries only the JSON
        warm_model = run_warm_start(base)
    warm_s = time.perf_counter() - t0
    args_seed = argparse.Namespace(**{**vars(args), "overrides": overrides})
    return [run_arm(Path(args.config), work, algo, eta, warm_model, args_seed) for algo, eta in arms_spec], warm_s


def run_parallel(args) -> dict[int, list[dict]]:
    """Every (seed, arm) in its own process, ``--jobs`` at a time; {seed: [arm results in --arms order]}."""
    work = Path(args.workdir)
    jobs = [(seed, arm) for seed in args.seeds for arm in args.arms]

    def one(job) -> tuple[int, int, dict]:
        seed, (algo, eta) = job
        out = work / f"seed{seed}-{algo}-eta{eta}.json"
        cmd = [
            sys.executable,
            "-m",
            "bench.async_learning",
            "--config",
            args.config,
            "--steps",
            str(args.steps),
            "--slack",
            str(args.slack),
            "--eval-interval",
            str(args.eval_interval),
            "--workdir",
            str(work / f"{algo}-eta{eta}"),
            "--seeds",
            str(seed),
            "--arms",
            f"{algo}:{eta}",
            "--out",
            str(out),
            *args.overrides,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"seed {seed} arm {algo}:{eta} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        result = json.loads(out.read_text())
        return seed, args.arms.index((algo, eta)), result["per_seed"][str(seed)][0]

    per_seed: dict[int, list] = {seed: [None] * len(args.arms) for seed in args.seeds}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for seed, i, arm in pool.map(one, jobs):
            per_seed[seed][i] = arm
    return per_seed


def plot(result: dict, path: Path) -> None:
    """Held-out accuracy against training step: each arm's mean over seeds (thick) and each seed
    (thin), with each arm's mean wall time per run and staleness in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    per_seed = result["per_seed"]
    for i, spec in enumerate(result["arms_spec"]):
        runs = [arms[i] for arms in per_seed.values() if arms[i] is not None]
        color = f"C{i}"
        for run in runs:
            steps, acc = zip(*run["curve"])
            ax.plot(steps, acc, color=color, alpha=0.25, linewidth=1)
        curve = (result.get("aggregate") or {}).get("arms", [{}] * len(result["arms_spec"]))[i].get("curve")
        if curve is None:
            curve = runs[0]["curve"]
        steps, acc = zip(*curve)
        wall = statistics.mean(r["wall_s"] for r in runs)
        stale = statistics.mean(r.get("staleness_mean", 0.0) for r in runs)
        ax.plot(
            steps,
            acc,
            color=color,
            linewidth=2.2,
            label=f"{spec} (mean of {len(runs)}; staleness {stale:.1f}; {wall:.0f} s/run)",
        )
    if result.get("slack"):
        ax.axvline(result["steps"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"async_learning: {' '.join(result.get('overrides', []))}"[:110], fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = parser("async_learning", __doc__)
    p.add_argument("--config", default=str(DEMO_CONFIG))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument(
        "--slack",
        type=float,
        default=0.0,
        help="every arm runs this fraction more steps than --steps (the same schedule), and the "
        "target is the reference arm's accuracy at --steps: 0.1 tests 'within 10%% more steps'",
    )
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument(
        "--workdir",
        default=None,
        help="where the runs go (default: a temporary directory, removed when the bench ends well)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="train.seed values (default: the config's); several give the aggregate",
    )
    p.add_argument(
        "--arms",
        type=parse_arm,
        nargs="+",
        default=list(ARMS),
        help="ALGORITHM:ETA each; the first is the reference (default: grpo_async:0 grpo_async:4 grpo:4)",
    )
    p.add_argument("--jobs", type=int, default=1, help="(seed, arm) runs in parallel processes (1: one process)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot the held-out accuracy curves here")
    p.add_argument(
        "--from-json", default=None, metavar="JSON", help="run nothing: plot (--plot) a result this script wrote before"
    )
    p.add_argument("overrides", nargs="*", help="dotted config overrides applied to every arm")
    args = p.parse_args(argv)
    if args.from_json:
        if not args.plot:
            raise SystemExit("--from-json needs --plot PNG")
        plot(json.loads(Path(args.from_json).read_text()), Path(args.plot))
        return 0
    seeds = args.seeds or [None]
    parallel = args.jobs > 1 and len(seeds) * len(args.arms) > 1
    if parallel and args.seeds is None:
        raise SystemExit("--jobs > 1 needs --seeds")
    t0 = time.perf_counter()
    warm = {}
    with work_dir(args.workdir, "areno-bench-async-learning-") as work:
        args.workdir = str(work)
        if parallel:
            per_seed = run_parallel(args)
        else:
            per_seed = {}
            for seed in seeds:
                per_seed[seed], warm[seed] = run_seed(args, seed, args.arms)
    budget = args.steps if args.slack > 0 else None
    for arms in per_seed.values():
        with_ratios(arms, budget)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "slack": args.slack,
        "steps_run": total_steps(args),
        "arms_spec": [f"{a}:{e}" for a, e in args.arms],
        "wall_s": round(time.perf_counter() - t0, 1),
        "warm_start_s": {str(k): round(v, 1) for k, v in warm.items()},
        "target": "decoupled eta=4 steps_ratio_vs_eta0 <= 1.10",
        "per_seed": {str(k): v for k, v in per_seed.items()},
    }
    if len(per_seed) > 1:
        result["aggregate"] = aggregate(per_seed, budget)
    if args.plot:
        plot(result, Path(args.plot))
    record = emit("async_learning", learning_headline(result), result)
    if args.out:
        Path(args.out).write_text(json.dumps(record))
    return 0


def learning_headline(result: dict) -> dict:
    """The second arm's steps to the reference accuracy against the first arm's (η = 0), over the mean
    curves when several seeds ran."""
    arms = result["aggregate"]["arms"] if "aggregate" in result else next(iter(result["per_seed"].values()))
    ref, other = arms[0], arms[1] if len(arms) > 1 else None
    name = f"{other['algorithm']}:{other['eta']}" if other else "no second arm"
    return headline(
        f"steps to the reference's held-out accuracy ({ref['reference_accuracy']}), {name}",
        other["steps_to_reference_final"] if other else None,
        f"{ref['algorithm']}:{ref['eta']}, same warm start, data and seeds",
        ref["steps_to_reference_final"],
        other["steps_ratio_vs_eta0"] if other else None,
        "arm steps / reference steps (target <= 1.1; None: the arm never reached it)",
    )


if __name__ == "__main__":
    raise SystemExit(main())
