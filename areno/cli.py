"""`areno` command line: train, demo, recipes, launch, serve, report, doctor, trace, sessions.

User mistakes (config, paths, data) are printed as one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

import areno

USAGE_ERROR = 2
RUN_FAILED = 1

# Failures of a running job that carry a complete one-line message (what broke, and the fix): the
# CLI prints them as one line; the log above has the details. Checked only in modules already
# imported, so the check itself imports nothing.
_RUN_FAILURES = {
    "areno.engine.executor": ("RolloutPoolBroken",),
    "areno.rollout.client": ("NoHealthyServerError", "RolloutServersLost"),
    "areno.engine.partitioned": ("WorkerLostError",),
    "areno.sync.base": ("PolicySyncError",),
    "areno.launch.scheduler": ("WorkerError",),
}


def is_run_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the run failures the CLI reports in one line."""
    for module_name, names in _RUN_FAILURES.items():
        module = sys.modules.get(module_name)
        if module is not None and isinstance(exc, tuple(getattr(module, n) for n in names)):
            return True
    return False


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
    train.add_argument("--algorithm", help="recipe name (same as train.algorithm=NAME)")
    train.set_defaults(func=_train)

    demo = sub.add_parser("demo", help="the CPU demo: a tiny model learns to sort digits with RL (GRPO)")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("overrides", nargs="*", help="dotted overrides key=value")
    demo.set_defaults(func=_demo)

    for name, module, help_text in (
        ("recipes", "areno.recipes", "list the registered recipes (NAME: its formula, roles and syncs)"),
        ("launch", "areno.launch", "check an allocation_mode string or shared storage paths"),
        ("serve", "areno.rollout.server", "serve a model with the rollout engine (OpenAI-compatible HTTP)"),
        ("report", "areno.observe.report", "HTML report with plots of one or more run directories"),
        ("doctor", "areno.observe.doctor", "versions, devices and optional components"),
        ("trace", "areno.observe.trace", "merge a run's per-process traces into trace.json"),
        ("sessions", "areno.observe.session", "browse recorded agent sessions"),
    ):
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_delegate(module))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per rollout request otherwise
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # user mistakes (ConfigError is a ValueError): one line, exit 2
        print(f"areno: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except FileNotFoundError as exc:
        print(f"areno: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except RuntimeError as exc:
        if not is_run_failure(exc):
            raise
        logging.getLogger("areno").debug("run failed", exc_info=exc)
        print(f"areno: error: {exc}", file=sys.stderr)
        return RUN_FAILED
    except KeyboardInterrupt:
        print("areno: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
