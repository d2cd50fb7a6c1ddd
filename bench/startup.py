"""Start-up: ``areno train`` from its process start to the first generated token, cold and warm compile cache.

``areno train`` runs as a user runs it (a fresh process, the command line) on a random-init ``bench.e2e``
shape with ``bench.e2e``'s GRPO config at default settings, for two steps, twice: first with an empty
inductor cache (``TORCHINDUCTOR_CACHE_DIR``: the first compile, ``cold``), then with the cache the first
run left (``warm``). From the run's ``metrics.jsonl``: ``system/startup_to_first_token_s`` (the process's
age when the rollout engine sampled its first token), the first step's training phase (where the training
compile happens) and the second step's (compiled). Also the process's wall time to its exit.

    python -m bench.startup                       # CUDA: 0.5b
    python -m bench.startup --shape tiny --device cpu
    python -m bench.startup --shape demo --device cpu  # the CPU demo's model and config, its warm start skipped

``--shape demo`` runs ``areno/configs/demo.yaml`` (the demo's tiny model, created at the first run: ``cold``
includes that, and CPU runs compile nothing by default) with ``warm_start.steps=0``: the first token of the
GRPO stage, which ``areno demo`` reaches after its 40-step supervised warm start.

Headline: ``figure`` = warm start-up to the first token, ``baseline`` = cold, ``ratio`` = cold / warm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from areno.api.pipeline import DEMO_CONFIG
from areno.observe.metrics import read_metrics
from bench import e2e
from bench._common import emit, headline, parser, ratio, work_dir


def run_train(overrides: list[str], cache_dir: Path, log: Path) -> dict:
    """One ``areno train`` process with ``cache_dir`` as its inductor and Triton caches (the rollout engine's
    own Triton kernels compile into Triton's, ``~/.triton`` otherwise); its start-up figures."""
    run_dir = Path(next(o for o in overrides if o.startswith("run_dir=")).split("=", 1)[1])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton")}
    cmd = [sys.executable, "-m", "areno.cli", "train", *overrides]
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"areno train exited {proc.returncode}; its output: {log}")
    steps = [r for r in read_metrics(run_dir) if "timing/train_s" in r]
    return {
        "startup_to_first_token_s": steps[0].get("system/startup_to_first_token_s"),
        "first_train_s": steps[0]["timing/train_s"],
        "second_train_s": steps[1]["timing/train_s"] if len(steps) > 1 else None,
        "first_rollout_s": steps[0]["timing/rollout_s"],
        "process_wall_s": wall_s,
    }


def demo_overrides(args, workdir: Path, run_dir: Path) -> list[str]:
    """``areno train areno/configs/demo.yaml`` without its warm start, two GRPO steps."""
    return [
        str(DEMO_CONFIG),
        f"run_dir={run_dir}",
        f"model.path={workdir / 'init_model'}",  # created by the cold run (the config's init_tiny)
        "warm_start.steps=0",
        "train.steps=2",
        "train.eval_interval=0",
        f"cluster.device={args.device}",
        *args.areno_set,
    ]


def shape_overrides(args, shape: str, workdir: Path, run_dir: Path) -> list[str]:
    """``bench.e2e``'s GRPO run of ``shape`` (its random-init model and prompts made once in ``workdir``)."""
    e2e_args = e2e.build_parser().parse_args(["--device", args.device, "--warmup", "1", "--steps", "1"])
    e2e_args.areno_set = args.areno_set
    _, prompt_len, completion_len = e2e.SHAPES[shape]
    model_dir = workdir / shape
    if not model_dir.exists():
        model_dir, _, tokenizer = e2e.make_model_dir(shape, workdir)
        prompts = e2e.make_prompts(tokenizer, e2e_args.prompts * 4, prompt_len)
        (workdir / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": ""}) + "\n" for q in prompts))
    return e2e.areno_overrides(
        e2e_args,
        model_dir,
        workdir / "prompts.jsonl",
        run_dir,
        eta=0,
        param_dtype=e2e.default_param_dtype(e2e_args),
        prompt_len=prompt_len,
        completion_len=completion_len,
    )


def main(argv: list[str] | None = None) -> int:
    p = parser("startup", __doc__)
    p.add_argument("--shape", default=None, help=f"one of {','.join(e2e.SHAPES)},demo (default: 0.5b on CUDA, tiny)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--workdir",
        default=None,
        help="where the model, runs and caches go (default: a temporary one, removed when the bench ends well)",
    )
    p.add_argument("--areno-set", action="append", default=[], metavar="KEY=VALUE", help="one more config override")
    args = p.parse_args(argv)
    shape = args.shape or ("0.5b" if args.device == "cuda" else "tiny")
    if shape not in (*e2e.SHAPES, "demo"):
        raise ValueError(f"--shape: unknown shape {shape!r}; choose from {sorted(e2e.SHAPES)} or demo")
    with work_dir(args.workdir, "areno-bench-startup-") as workdir:
        cache_dir = workdir / "inductor-cache"  # empty before the cold run
        runs = {}
        for name in ("cold", "warm"):
            if shape == "demo":
                overrides = demo_overrides(args, workdir, workdir / f"run-{name}")
            else:
                overrides = shape_overrides(args, shape, workdir, workdir / f"run-{name}")
            runs[name] = run_train(overrides, cache_dir, workdir / f"{name}.log")
            print(json.dumps({"progress": {name: runs[name]}}), file=sys.stderr, flush=True)

        warm, cold = runs["warm"]["startup_to_first_token_s"], runs["cold"]["startup_to_first_token_s"]
        head = headline(
            f"areno train: process start to the first generated token, s ({shape}, warm compile cache)",
            warm,
            "the same with an empty compile cache",
            cold,
            ratio(cold, warm),
            "cold / warm",
        )
        hw = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
        emit("startup", head, {"shape": shape, "runs": runs, "hardware": hw})
        return 0


if __name__ == "__main__":
    sys.exit(main())
