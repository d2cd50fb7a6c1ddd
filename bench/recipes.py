"""Learning check (issue 5): held-out accuracy before and after each RL recipe, same step budget.

On the shipped task (``areno/configs/demo.yaml``: digit sorting, a tiny character-level model):

1. one supervised warm start (the ``sft`` recipe) gives the common starting checkpoint;
2. for ``opd``, a stronger teacher: the same warm start run ``--teacher-steps`` steps;
3. every recipe in ``--algorithms`` trains ``--steps`` steps from the start checkpoint with the
   demo's rollout and optimizer settings; greedy held-out accuracy is measured before and after.

A recipe passes when its accuracy after is above its accuracy before. Prints one JSON object:
``{"config", "steps", "start_accuracy", "teacher_accuracy", "results": {name: {"before", "after",
"improved", "wall_s"} | {"error"}}, "all_improved"}``.

Usage:
    python bench/recipes.py                                   # the 7 recipes of the issue, CPU
    python bench/recipes.py --algorithms grpo,rloo --steps 20 --num-eval 100 --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areno.api.config import load_config  # noqa: E402
from areno.api.pipeline import run_warm_start  # noqa: E402
from areno.api.trainer import Trainer  # noqa: E402

DEFAULT_ALGORITHMS = "grpo,dr_grpo,dapo,rloo,reinforce_pp,ppo,opd"


def _warm_start(config_path: str, run_dir: Path, steps: int, common: list[str]) -> tuple[Path, float]:
    cfg = load_config(config_path, [f"run_dir={run_dir}", f"warm_start.steps={steps}", *common])
    export_dir = run_warm_start(cfg)
    metrics = json.loads((export_dir / "COMPLETE").read_text())
    return export_dir, float(metrics.get("eval/accuracy", float("nan")))


def _accuracy(config_path: str, run_dir: Path, model_dir: Path, common: list[str]) -> float:
    """Greedy held-out accuracy of the checkpoint in ``model_dir`` (a fresh engine, no training)."""
    cfg = load_config(
        config_path,
        [
            f"run_dir={run_dir}",
            f"model.path={model_dir}",
            "warm_start.steps=0",
            "train.algorithm=sft",
            "train.steps=0",
            *common,
        ],
    )
    trainer = Trainer.init(cfg)
    try:
        return trainer.evaluate_now()["eval/accuracy"]
    finally:
        trainer.shutdown()


def _run_recipe(
    config_path: str, run_dir: Path, start: Path, name: str, steps: int, extra: list[str], common: list[str]
) -> dict:
    """Train ``steps`` steps of ``name`` from ``start``; accuracy after is measured on the exported
    policy by a fresh engine. (The steps are driven here rather than by ``Trainer.run`` because, at
    this commit, ``ArenoEngine.evaluate`` after online rollouts started never returns: see the
    report of issue 5.)"""
    overrides = [
        f"run_dir={run_dir}",
        f"model.path={start}",
        "warm_start.steps=0",
        f"train.algorithm={name}",
        f"train.steps={steps}",
        "train.eval_interval=0",
        "train.save_interval=0",
        *extra,
    ]
    trainer = Trainer.init(load_config(config_path, overrides))
    t0 = time.perf_counter()
    rewards = []
    try:
        for rollout_id in range(steps):
            rollout = trainer.rollout_token_batch(rollout_id)
            rewards.append(rollout.metrics.get("rollout/reward_mean"))
            trainer.train(rollout_id, rollout)
            trainer.backend.update_weights()
        trainer.backend.engine.export_policy(run_dir / "final_model")
    finally:
        trainer.shutdown()
    wall = time.perf_counter() - t0
    after = _accuracy(config_path, run_dir / "eval", run_dir / "final_model", common)
    first, last = rewards[: max(1, steps // 4)], rewards[-max(1, steps // 4) :]
    return {
        "after": after,
        "train_reward_first_quarter": sum(first) / len(first),
        "train_reward_last_quarter": sum(last) / len(last),
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "areno" / "configs" / "demo.yaml"))
    parser.add_argument("--algorithms", default=DEFAULT_ALGORITHMS, help="comma-separated recipe names")
    parser.add_argument("--steps", type=int, default=40, help="RL steps per recipe (the same budget for all)")
    parser.add_argument("--warm-start-steps", type=int, default=60)
    parser.add_argument("--teacher-steps", type=int, default=240, help="sft steps of the opd teacher")
    parser.add_argument("--num-eval", type=int, default=200, help="held-out prompts")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--run-root", default=str(ROOT / "runs" / "bench_recipes"))
    parser.add_argument("--fresh", action="store_true", help="delete --run-root first (no reuse of warm starts)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every stage (e.g. warm_start.lr=1e-3)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (1 is ~50x faster for this tiny model on a loaded CPU)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    root = Path(args.run_root)
    if args.fresh and root.exists():
        shutil.rmtree(root)
    common = [f"data.num_eval={args.num_eval}", f"cluster.device={args.device}", "observe.console=false", *args.set]
    algorithms = [a for a in args.algorithms.split(",") if a]
    start, _ = _warm_start(args.config, root / "start", args.warm_start_steps, common)
    start_acc = _accuracy(args.config, root / "start_eval", start, common)
    teacher, teacher_acc = None, None
    if "opd" in algorithms:
        teacher, teacher_acc = _warm_start(args.config, root / "teacher", args.teacher_steps, common)
    results = {}
    for name in algorithms:
        extra = list(common)
        if teacher is not None and name in ("opd", "dagger", "aggrevate", "mixed_loss_dagger_opd"):
            extra.append(f"train.algorithm_kwargs.teacher_path={teacher}")
        run_dir = root / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        try:
            results[name] = _run_recipe(args.config, run_dir, start, name, args.steps, extra, common)
            results[name]["before"] = start_acc
            results[name]["improved"] = results[name]["after"] > start_acc
        except (ValueError, RuntimeError, AttributeError, KeyError) as err:  # reported, not hidden
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "config": args.config,
                "steps": args.steps,
                "warm_start_steps": args.warm_start_steps,
                "start_accuracy": start_acc,
                "teacher_accuracy": teacher_acc,
                "results": results,
                "all_improved": all(r.get("improved", False) for r in results.values()),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
