"""`areno` command line: train, demo, recipes, launch, serve, report, doctor, trace, sessions.

The error policy (``areno.errors``): a user mistake (config, data, model directory, reward import) is
printed as one line and exits with 2; a run that failed while running is printed as one line naming
the failing worker and its log and exits with 1; anything else is a bug, and its traceback goes through.
"""

from __future__ import annotations

import argparse
import logging
import sys

import areno
from areno.errors import RunFailure, UserError

USAGE_ERROR = 2
"""Exit code of a :class:`~areno.errors.UserError`: the command was wrong, nothing ran."""
RUN_FAILED = 1
"""Exit code of a :class:`~areno.errors.RunFailure` (and of a bug, with its traceback)."""


def _train(args: argparse.Namespace) -> int:
    from areno.api.config import load_config
    from areno.api.pipeline import run_pipeline

    overrides = list(args.overrides)
    config_path = args.config
    if config_path is not None and "=" in config_path:  # no YAML file, overrides only
        overrides.insert(0, config_path)
        config_path = None
    if args.algorithm:
        overrides.append(f"train.algorithm={args.algorithm}")
    config = load_config(config_path, overrides)
    run_pipeline(config)
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

    demo = sub.add_parser("demo", help="the CPU demo: a tiny model learns to sort digits with RL (GRPO)")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("overrides", nargs="*", help="dotted overrides key=value")
    demo.set_defaults(func=_demo)

    for name, (module, help_text) in DELEGATED.items():  # listed in --help; main() hands them their arguments
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_delegate(module))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per rollout request otherwise
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:  # argparse's REMAINDER would refuse a leading option (doctor --json)
        args = argparse.Namespace(func=_delegate(DELEGATED[argv[0]][0]), rest=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:  # the message names the thing and the fix
        print(f"areno: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except RunFailure as exc:  # the log above (and the worker's log it names) has the details
        logging.getLogger("areno").debug("run failed", exc_info=exc)
        print(f"areno: error: {exc}", file=sys.stderr)
        return RUN_FAILED
    except KeyboardInterrupt:
        print("areno: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
