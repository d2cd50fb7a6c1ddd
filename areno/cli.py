"""`areno` command line: train, eval, demo, recipes, launch, serve, report, doctor, trace, sessions.

The error policy (``areno.errors``): a user mistake (config, data, model directory, reward import) is
printed as one line and exits with 2; a run that failed while running is printed as one line naming
the failing worker and its log and exits with 1; anything else is a bug, and its traceback goes through.
"""

from __future__ import annotations

import argparse
import logging
import sys

import areno
from areno.errors import RunFailure, RunStopped, UserError

USAGE_ERROR = 2
"""Exit code of a :class:`~areno.errors.UserError`: the command was wrong, nothing ran."""
RUN_FAILED = 1
"""Exit code of a :class:`~areno.errors.RunFailure` (and of a bug, with its traceback)."""


def _load(args: argparse.Namespace, *extra: str):
    """The run's config from the command's YAML file (optional) and dotted overrides."""
    from areno.api.config import load_config

    overrides = list(args.overrides)
    config_path = args.config
    if config_path is not None and "=" in config_path:  # no YAML file, overrides only
        overrides.insert(0, config_path)
        config_path = None
    return load_config(config_path, [*overrides, *extra])


def _train(args: argparse.Namespace) -> int:
    from areno.api.pipeline import run_pipeline

    run_pipeline(_load(args, *([f"train.algorithm={args.algorithm}"] if args.algorithm else [])))
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    from areno.engine.evaluation import EvalOptions, run_eval

    options = EvalOptions(  # its checks before the config's: a wrong option is named first
        checkpoint=args.checkpoint,
        samples=args.samples,
        temperature=args.temperature,
        split=args.split,
        num_prompts=args.num_prompts,
        pass_threshold=args.pass_threshold,
        seed=args.seed,
        out=args.out,
    )
    summary = run_eval(_load(args), options)
    metrics = summary["metrics"]
    passes = " ".join(f"{k[5:]} {v:.4f}" for k, v in metrics.items() if k.startswith("eval/pass@"))
    logging.getLogger("areno.eval").info(
        "%s: accuracy %.4f, %s (%d rows x %d samples, %d reward errors); rows in %s",
        summary["model"],
        metrics["eval/accuracy"],
        passes,
        metrics["eval/num_prompts"],
        summary["samples"],
        metrics["eval/reward_errors"],
        summary["rows_file"],
    )
    print(json.dumps(summary))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from areno.api.pipeline import run_demo

    run_demo(run_dir=args.run_dir, overrides=list(args.overrides))
    return 0


DELEGATED = {
    "recipes": ("areno.recipes", "list the registered recipes (NAME: its formula, roles and syncs)"),
    "launch": ("areno.launch", "check an allocation_mode string or shared storage paths"),
    "serve": ("areno.rollout.server", "serve a model with the rollout engine (OpenAI-compatible HTTP)"),
    "report": ("areno.observe.report", "HTML report with plots of one or more run directories"),
    "doctor": ("areno.observe.doctor", "versions, devices and optional components"),
    "trace": ("areno.observe.trace", "merge a run's per-process traces into trace.json"),
    "sessions": ("areno.observe.session", "browse recorded agent sessions"),
}
"""Subcommands whose module parses its own arguments (everything after the name): ``name -> (module, help)``."""


def _delegate(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).main(list(args.rest)) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areno", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"areno {areno.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train with a YAML config and dotted overrides (optim.lr=1e-5)")
    train.add_argument("config", nargs="?", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted overrides key=value")
    train.add_argument(
        "--algorithm", help="recipe name, or module:name for a user @recipe module (same as train.algorithm=...)"
    )
    train.set_defaults(func=_train)

    ev = sub.add_parser(
        "eval",
        help="score a model or a run's checkpoint on held-out rows with the run's reward (accuracy, pass@k)",
        description="Score a model on the config's held-out rows (data.eval_path / data.num_eval) with its "
        "reward, as training's evaluation does; rows go to a JSON-lines file, the summary to stdout.",
    )
    ev.add_argument("config", nargs="?", help="YAML config file (the run's)")
    ev.add_argument("overrides", nargs="*", help="dotted overrides key=value")
    ev.add_argument(
        "--checkpoint",
        help="a Hugging Face model directory, a checkpoint directory, a step of run_dir (step_120 or 120), "
        "a run directory (its newest complete checkpoint) or 'latest' (run_dir's); default: model.path",
    )
    ev.add_argument("--samples", type=int, help="completions per row (default: train.eval_samples, 1: greedy)")
    ev.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature (default: train.eval_temperature: greedy for 1 sample, else rollout.temperature)",
    )
    ev.add_argument("--split", default="eval", help="eval (held-out rows, the default) or train")
    ev.add_argument(
        "--num-prompts",
        type=int,
        default=0,
        help="score the first N rows of the split, more than data.num_eval if data.eval_path or the task has them "
        "(default 0: the held-out rows the run evaluates, data.num_eval of them; --split train: every row)",
    )
    ev.add_argument(
        "--pass-threshold",
        type=float,
        help="a sample solves its row at this reward or above (pass@k; default: train.eval_pass_threshold)",
    )
    ev.add_argument("--seed", type=int, help="base seed of sampled requests (default: train.seed)")
    ev.add_argument("--out", help="the per-row JSON-lines file (default: run_dir/eval/<model>.jsonl)")
    ev.set_defaults(func=_eval)

    demo = sub.add_parser("demo", help="the CPU demo: a tiny model learns to sort digits with RL (GRPO)")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("overrides", nargs="*", help="dotted overrides key=value")
    demo.set_defaults(func=_demo)

    for name, (module, help_text) in DELEGATED.items():  # listed in --help; main() hands them their arguments
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_delegate(module))
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The parsed command line; ``key=value`` overrides may also follow the options (argparse alone
    takes a positional list in one run: ``train cfg.yaml --algorithm ppo run_dir=x`` would refuse ``run_dir=x``)."""
    args, extra = parser.parse_known_args(argv)
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if late and hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *late]
        extra = [a for a in extra if a not in late]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per rollout request otherwise
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:  # argparse's REMAINDER would refuse a leading option (doctor --json)
        args = argparse.Namespace(func=_delegate(DELEGATED[argv[0]][0]), rest=argv[1:])
    else:
        args = _parse(build_parser(), argv)
    try:
        return args.func(args)
    except UserError as exc:  # the message names the thing and the fix
        print(f"areno: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except RunFailure as exc:  # the log above (and the worker's log it names) has the details
        logging.getLogger("areno").debug("run failed", exc_info=exc)
        print(f"areno: error: {exc}", file=sys.stderr)
        return RUN_FAILED
    except RunStopped as exc:  # after the step's checkpoint: the message says where and how to go on
        print(f"areno: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("areno: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
