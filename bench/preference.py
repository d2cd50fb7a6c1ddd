"""Preference training (``dpo``, ``reward_model``): device memory and step time of ``areno train``.

``areno train`` runs as a user runs it (a fresh process, the command line) on a random-init ``bench.e2e``
shape with random ``{prompt, chosen, rejected}`` rows (``--prompt-len`` and ``--completion-len`` tokens),
``--pairs`` a step, held-out pairs scored at the end. From the run's ``metrics.jsonl``: the peak device
memory (``system/peak_memory_gib``, CUDA) and the median training phase after ``--warmup`` steps; also the
process's wall time to its exit.

The baseline is another areno tree run the same way in the same call (``--baseline-tree``: a directory
holding an ``areno`` package, e.g. a ``git archive`` of an earlier commit), each tree in its own process
with ``PYTHONPATH`` set to it, the two alternated ``--rounds`` times.

    python -m bench.preference --baseline-tree /tmp/old              # CUDA: 0.5b, dpo
    python -m bench.preference --shape tiny --device cpu --algorithm reward_model --baseline-tree /tmp/old

Headline: ``figure`` = this tree's peak device memory in GiB (on a CPU: the process's wall time),
``baseline`` = the baseline tree's, ``ratio`` = baseline / figure.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from areno.observe.metrics import read_metrics
from bench import e2e
from bench._common import emit, headline, parser, ratio, work_dir


def write_pairs(path: Path, tokenizer, num: int, prompt_len: int, completion_len: int, seed: int) -> None:
    """``num`` random preference rows: a prompt of ``prompt_len`` tokens, two completions of ``completion_len``."""
    rng = random.Random(seed)
    prompts = e2e.make_prompts(tokenizer, num, prompt_len, seed=seed)
    completions = e2e.make_prompts(tokenizer, 2 * num, completion_len, seed=seed + 1)
    rows = [
        {"prompt": p, "chosen": completions[2 * i], "rejected": completions[2 * i + 1]} for i, p in enumerate(prompts)
    ]
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_tree(tree: Path, overrides: list[str], log: Path) -> dict:
    """One ``areno train`` process importing areno from ``tree``; its memory and timing figures."""
    run_dir = Path(next(o for o in overrides if o.startswith("run_dir=")).split("=", 1)[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "areno.cli", "train", *overrides]
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tree)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise RuntimeError(f"areno train ({tree}) exited {proc.returncode}; the end of its output ({log}):\n{tail}")
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "timing/train_s" in r]
    peaks = [r["system/peak_memory_gib"] for r in rows if "system/peak_memory_gib" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return {
        "peak_gib": max(peaks) if peaks else None,
        "train_s": [round(r["timing/train_s"], 4) for r in steps],
        "process_wall_s": round(wall_s, 2),
        "final_eval": {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser("preference", __doc__)
    p.add_argument("--shape", default=None, help=f"one of {','.join(e2e.SHAPES)} (default: 0.5b on CUDA, tiny)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--algorithm", default="dpo", choices=("dpo", "reward_model"))
    p.add_argument("--baseline-tree", default=None, help="a directory holding the areno package to compare with")
    p.add_argument("--pairs", type=int, default=16, help="preference rows a step (rollout.batch_size)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the training phase's median")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--param-dtype", default=None, help="model.dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    p.add_argument(
        "--workdir",
        default=None,
        help="where the model, data and runs go (default: a temporary one, removed when the bench ends well)",
    )
    p.add_argument("--areno-set", action="append", default=[], metavar="KEY=VALUE", help="one more config override")
    args = p.parse_args(argv)
    shape = args.shape or ("0.5b" if args.device == "cuda" else "tiny")
    if shape not in e2e.SHAPES:
        p.error(f"--shape: unknown shape {shape!r}; choose from {sorted(e2e.SHAPES)}")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be at least 0 and below --steps")
    with work_dir(args.workdir, "areno-bench-preference-") as workdir:
        model_dir, _, tokenizer = e2e.make_model_dir(shape, workdir)
        train, held_out = workdir / "pairs.jsonl", workdir / "held_out.jsonl"
        write_pairs(train, tokenizer, args.pairs * args.steps, args.prompt_len, args.completion_len, seed=0)
        write_pairs(held_out, tokenizer, args.pairs, args.prompt_len, args.completion_len, seed=7)

        trees = {"areno": Path(__file__).resolve().parent.parent}
        if args.baseline_tree:
            trees["baseline"] = Path(args.baseline_tree).resolve()
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                run_dir = workdir / f"run-{name}-{r}"
                overrides = [
                    f"run_dir={run_dir}",
                    "overwrite=true",
                    f"model.path={model_dir}",
                    f"model.dtype={e2e.default_param_dtype(args)}",
                    f"train.algorithm={args.algorithm}",
                    "data.task=null",
                    f"data.train_path={train}",
                    f"data.eval_path={held_out}",
                    f"rollout.batch_size={args.pairs}",
                    f"train.steps={args.steps}",
                    f"train.eval_interval={args.steps}",
                    "train.save_interval=0",
                    f"cluster.device={args.device}",
                    "observe.console=false",
                    *args.areno_set,
                ]
                res = run_tree(tree, overrides, workdir / f"{name}-{r}.log")
                runs[name].append(res)
                print(json.dumps({"progress": {name: res}}), file=sys.stderr, flush=True)

        def summary(rs: list[dict]) -> dict:
            peaks = [x["peak_gib"] for x in rs if x["peak_gib"] is not None]
            timed = [t for x in rs for t in x["train_s"][args.warmup :]]
            return {
                "peak_gib": max(peaks) if peaks else None,
                "train_s_median": round(statistics.median(timed), 4) if timed else None,
                "process_wall_s": [x["process_wall_s"] for x in rs],
            }

        ours = summary(runs["areno"])
        base = summary(runs["baseline"]) if "baseline" in runs else None
        if args.device == "cuda":
            metric = f"{args.algorithm}: peak device memory, GiB ({shape})"
            fig, base_fig = ours["peak_gib"], base["peak_gib"] if base else None
        else:
            metric = f"{args.algorithm}: process wall time, s ({shape})"
            fig = statistics.median(ours["process_wall_s"])
            base_fig = statistics.median(base["process_wall_s"]) if base else None
        head = headline(metric, fig, "baseline tree, same run", base_fig, ratio(base_fig, fig), "baseline / areno")
        hw = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
        emit(
            "preference",
            head,
            {"shape": shape, "summary": {"areno": ours, "baseline": base}, "runs": runs, "hardware": hw},
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
