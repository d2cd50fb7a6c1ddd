"""Process start-up: seconds to import what each kind of areno process imports, in fresh interpreters,
against ``import torch`` (the floor any PyTorch tool pays) measured interleaved in the same run.
Prints one JSON object.

    python bench/startup.py                          # this checkout, 5 rounds
    python bench/startup.py --baseline-tree /tmp/old # also an exported older tree, interleaved

Entry points: ``cli`` is a colocated ``areno train`` / ``areno demo`` process (the trainer, the
colocated engine, the tokenizer class); ``worker`` is a partitioned run's scheduler worker (the
partitioned engine, the rollout server, the tokenizer class). Each figure is the median wall time of
``python -c "<imports>"`` over the rounds; ``ratio_to_torch`` divides it by ``import torch``'s median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stamp import stamp

ENTRY_POINTS = {
    "torch": "import torch",
    "cli": "import areno.cli, areno.api.trainer, areno.engine.api; from transformers import AutoTokenizer",
    "worker": "import areno.launch.worker, areno.engine.partitioned, areno.rollout.server; "
    "from transformers import AutoTokenizer",
}


def time_import(code: str, tree: Path) -> float:
    """Wall seconds of a fresh ``python -c code`` with ``tree`` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"python -c {code!r} failed in {tree}: {last}")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="an exported checkout (git archive) timed interleaved with this one",
    )
    args = ap.parse_args(argv)
    trees = {"this": Path(__file__).resolve().parents[1]}
    if args.baseline_tree is not None:
        if not (args.baseline_tree / "areno" / "__init__.py").exists():
            raise SystemExit(
                f"--baseline-tree {args.baseline_tree}: no areno/__init__.py there; "
                "export a checkout with `git archive REV | tar -x -C DIR`"
            )
        trees["baseline"] = args.baseline_tree.resolve()
    times: dict[str, dict[str, list[float]]] = {t: {e: [] for e in ENTRY_POINTS} for t in trees}
    for _ in range(args.rounds):  # interleaved: a noisy machine slows every entry of a round alike
        for entry, code in ENTRY_POINTS.items():
            for tree_name, tree in trees.items():
                times[tree_name][entry].append(time_import(code, tree))
    result: dict = {"bench": "startup", "rounds": args.rounds, "cpus": os.cpu_count(), **stamp()}
    for tree_name in trees:
        med = {e: statistics.median(v) for e, v in times[tree_name].items()}
        result[tree_name] = {
            e: {
                "median_s": round(m, 3),
                "ratio_to_torch": round(m / med["torch"], 2),
                "runs_s": [round(x, 3) for x in times[tree_name][e]],
            }
            for e, m in med.items()
        }
    if "baseline" in trees:
        result["speedup_vs_baseline"] = {
            e: round(result["baseline"][e]["median_s"] / result["this"][e]["median_s"], 2) for e in ENTRY_POINTS
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
