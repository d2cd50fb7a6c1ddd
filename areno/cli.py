"""`areno` command line: train, eval, demo, recipes, launch, serve, report, doctor, trace, sessions.

The error policy (``areno.errors``): a user mistake (config, data, model directory, reward import) is
printed as one line and exits with 2; a run that failed while running is printed as one line naming
the failing worker and its log and exits with 1; anything else is a bug, and its traceback goes through.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import stat
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

    if args.algorithm:
        overrides = [*([args.config] if args.config and "=" in args.config else []), *args.overrides]
        given = [o.split("=", 1)[1] for o in overrides if o.startswith("train.algorithm=")]
        if any(value != args.algorithm for value in given):
            raise UserError(
                f"--algorithm {args.algorithm} and the override train.algorithm={given[-1]} disagree: give one of them"
            )
    config = _load(args, *([f"train.algorithm={args.algorithm}"] if args.algorithm else []))
    if args.check:
        from areno.api.config import to_yaml
        from areno.api.pipeline import check_pipeline
        from areno.api.preflight import describe_model, run_model_config

        config = check_pipeline(config)
        print(to_yaml(config), end="")
        model = run_model_config(config)
        print(f"# model: {describe_model(model)}")
        context = config.rollout.max_model_len or model.max_seq_len
        source = "rollout.max_model_len" if config.rollout.max_model_len else f"the model's {model.positions_source}"
        print(f"# context: {context} tokens a sequence ({source})")
        warm = f" after {config.warm_start.steps} warm-start steps" if config.warm_start.steps > 0 else ""
        print(
            f"# areno train --check: config, data, reward and model check out: {config.train.steps} "
            f"{config.train.algorithm} steps{warm} into {config.run_dir}; nothing was trained or written",
        )
        return 0
    run_pipeline(config)
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
    # several held-out files: each one's accuracy too (eval/<file>/accuracy)
    files = "".join(f", {k[5:-9]} {v:.4f}" for k, v in metrics.items() if k.count("/") == 2 and k.endswith("/accuracy"))
    logging.getLogger("areno.eval").info(
        "%s: accuracy %.4f%s, %s (%d rows x %d samples, %d reward errors); rows in %s",
        summary["model"],
        metrics["eval/accuracy"],
        files,
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


def _check_allocation(mode: str, *, devices: int | None, algorithm: str) -> dict:
    """What ``areno train`` checks of an allocation string before anything starts, by the run's own
    functions: the cluster section (``ClusterSection``: grammar, supported backends, a colocated
    group on one device), the recipe's roles (``check_placement``, ``role_allocation`` or, on
    ``devices`` GPUs, the ``build_gpu_allocations`` it calls, ``check_partitioned_roles``) and a
    partitioned layout (``layout_from_config``: TP, expert and context sizes against the training
    devices, routing); on ``devices`` GPUs when given, else as processes on CPU. Returns the
    device lists (and a partitioned string's layout)."""
    from areno.api.config import load_config
    from areno.api.preflight import check_placement
    from areno.engine.api import resolve_recipe
    from areno.engine.cluster import layout_from_config
    from areno.engine.roles import check_partitioned_roles, role_allocation
    from areno.errors import ConfigError
    from areno.launch.allocation import build_gpu_allocations, parse_allocation_mode

    quoted = mode.replace("'", "''")  # a YAML single-quoted string: the override holds it verbatim
    overrides = [f"cluster.allocation_mode='{quoted}'", "model.path=unused", "cluster.device=cpu"]
    config = load_config(None, [*overrides, f"train.algorithm={algorithm}"])
    recipe = resolve_recipe(config)
    try:
        check_placement(config, recipe)
        if devices is None:  # a colocated string's role placements: on this machine's devices (CPU: its cores)
            role_allocation(config, recipe)
        elif (placements := config.cluster.string_role_devices()) is not None:  # on `devices` GPUs
            build_gpu_allocations(
                placements,
                [r.name for r in recipe.roles],
                policy_role=next((r.name for r in recipe.roles if r.sync_to_rollout), recipe.roles[0].name),
                num_devices=devices,
                key="cluster.allocation_mode",
            )
        check_partitioned_roles(config, recipe)
    except ConfigError as exc:
        if "recipe" not in str(exc):
            raise
        raise ConfigError(f"{exc} (checked against --algorithm {algorithm}: name the run's recipe)") from None
    alloc = parse_allocation_mode(mode)
    out = {"allocation_mode": str(alloc), "world_size": alloc.world_size, "colocated": alloc.colocated}
    if config.cluster.asks_partitioned():
        cuda = devices is not None
        layout = layout_from_config(
            config.cluster,
            num_devices=devices or 0,
            cuda=cuda,
            device_ids=tuple(str(i) for i in range(devices or 0)),
        )
        layout.relays()  # a training row with no rollout rank on another device to send to
        out["layout"] = layout.describe()
    out["device_lists"] = alloc.device_lists(devices if devices is not None else alloc.world_size)
    return out


def _slurm_script(config) -> tuple[str, list[str]]:
    """The sbatch script a partitioned run of ``config`` submits with ``cluster.scheduler=slurm``
    from this host and directory, and notes on it (nothing is submitted)."""
    import socket
    from pathlib import Path

    from areno.engine.partitioned import PartitionedCluster, is_partitioned
    from areno.errors import ConfigError
    from areno.launch.scheduler import RoleSpec, scheduler_config
    from areno.launch.slurm import sbatch_preview, time_limit_note

    if not is_partitioned(config):
        raise ConfigError(
            "cluster.allocation_mode: this run is colocated (one process) and starts no workers, so SLURM submits "
            "nothing: give rollout and training devices of their own ('areno:d1+fsdp:d1', or "
            "cluster.train_devices/rollout_devices)"
        )
    layout = PartitionedCluster(config, Path(config.run_dir)).layout  # the run's layout checks; starts nothing
    options = {"log_dir": str(Path(config.run_dir) / "workers"), **dict(config.cluster.scheduler_options or {})}
    cfg = scheduler_config("slurm", options)
    specs = [  # as PartitionedCluster.launch creates them
        RoleSpec(
            role=role,
            worker_cls=f"areno.engine.workers:{cls}",
            n=len(devices),
            devices=list(devices) if layout.cuda else None,
            world="areno",
        )
        for role, cls, devices in (
            ("train", "TrainWorker", layout.train_devices),
            ("rollout", "RolloutWorker", layout.rollout_devices),
        )
    ]
    notes = [
        f"not submitted; `areno train` submits it from here as {cfg.log_dir}/job-train-rollout.sbatch, "
        f"with the controller's port and MASTER_PORT picked at launch",
        f"the driver runs here ({socket.gethostname()}) and the workers dial back to "
        f"{cfg.slurm_controller_addr or socket.gethostname()}:<port> (cluster.scheduler_options.slurm_controller_addr)",
        time_limit_note(cfg),
    ]
    if config.cluster.scheduler != "slurm":
        notes.append(
            f"this config has cluster.scheduler={config.cluster.scheduler}: add cluster.scheduler=slurm to use it"
        )
    return sbatch_preview(specs, cfg), notes


def launch_parser() -> argparse.ArgumentParser:
    """The arguments of ``areno launch``."""
    parser = argparse.ArgumentParser(
        prog="areno launch",
        description="Check an allocation_mode string as `areno train` does, check shared storage paths, or print "
        "a SLURM run's sbatch script without submitting it (docs/launch.md).",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_alloc = sub.add_parser(
        "allocation",
        help="check a cluster.allocation_mode string as `areno train` does and print its device lists",
        description="Check a cluster.allocation_mode string with the checks `areno train` makes of it before "
        "anything starts (grammar, backends, colocated groups, the recipe's roles, a partitioned layout) and print "
        "its device lists as JSON. Checks that need the model (TP against its heads) or the run's host run at "
        "`areno train`.",
    )
    p_alloc.add_argument("allocation_mode")
    p_alloc.add_argument(
        "--devices", type=_positive_int, default=None, help="GPUs available (default: what it needs; CPU processes)"
    )
    p_alloc.add_argument("--algorithm", default="grpo", help="the recipe whose roles it places (default grpo)")
    p_store = sub.add_parser(
        "storage",
        help="check that existing directories are writable and readable from this node (creates nothing)",
        description="Check that each directory exists and is writable and readable from this node: a probe file "
        "is written under a temporary .areno-storage-probe/ directory and removed. A missing path is an error.",
    )
    p_store.add_argument("paths", nargs="+")
    p_slurm = sub.add_parser(
        "slurm-script",
        help="print the sbatch script `areno train CONFIG` would submit with cluster.scheduler=slurm (dry run)",
        description="Print the sbatch script a partitioned run submits with cluster.scheduler=slurm, "
        "without submitting it (notes on stderr).",
    )
    p_slurm.add_argument("config", nargs="?", help="YAML config file")
    p_slurm.add_argument("overrides", nargs="*", help="dotted overrides key=value")
    return parser


def launch_main(argv: list[str] | None = None) -> int:
    """``areno launch``: check an allocation_mode string as ``areno train`` does, check shared storage
    paths, or print the sbatch script of a SLURM run without submitting it."""
    import json

    ns = launch_parser().parse_args(argv)
    if ns.cmd == "allocation":
        print(json.dumps(_check_allocation(ns.allocation_mode, devices=ns.devices, algorithm=ns.algorithm)))
    elif ns.cmd == "storage":
        from areno.launch.storage import check_shared_storage

        check_shared_storage(ns.paths, must_exist=True)
        print(json.dumps({"ok": ns.paths}))
    else:
        script, notes = _slurm_script(_load(ns))
        print(script, end="")
        for note in notes:
            print(f"areno launch slurm-script: {note}", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


DELEGATED = {
    "recipes": (
        "areno.recipes",
        "list the registered recipes: online or offline, stale-rollout handling, extra roles (NAME: its formula, "
        "roles and syncs)",
    ),
    "launch": (
        "areno.cli:launch_main",
        "check an allocation_mode string or shared storage paths; print a SLURM run's sbatch script",
    ),
    "serve": ("areno.rollout.server", "serve a model with the rollout engine (OpenAI-compatible HTTP)"),
    "report": ("areno.observe.report", "HTML report with plots of one or more run directories"),
    "doctor": ("areno.observe.doctor", "versions, devices and optional components"),
    "trace": ("areno.observe.trace", "merge a run's per-process traces into trace.json"),
    "sessions": ("areno.observe.session", "browse recorded agent sessions"),
}
"""Subcommands that parse their own arguments (everything after the name): ``name -> (module, help)``;
the module's ``main``, or ``module:function``."""


def _delegate(target: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        module, _, function = target.partition(":")
        return int(getattr(importlib.import_module(module), function or "main")(list(args.rest)) or 0)

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
    train.add_argument(
        "--check",
        action="store_true",
        help="check the config, data, reward and model as a run would before training, print the resolved config "
        "(train.epochs counted into train.steps) and exit: nothing is trained or written",
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
        "a run directory (its newest complete checkpoint), 'latest' (run_dir's) or 'best' (run_dir's best by "
        "train.best_metric); default: model.path",
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
    demo.add_argument("--run-dir", default="runs/demo", help="where the demo's run goes (default: runs/demo)")
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


OUT_OF_MEMORY_FIX = (
    "lower train.max_tokens_per_mb (smaller micro-batches), rollout.kv_memory_fraction or rollout.kv_blocks (a "
    "smaller KV pool), set cluster.offload=sleep (the sides take turns on the device) or train.activation_checkpointing"
    "=true, or use a smaller model or more devices"
)


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (POLLERR on a pipe's write end)."""
    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


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
    except BrokenPipeError:  # `areno recipes | head`: the reader left; what it did not read is not an error
        if not _stdout_reader_gone():
            raise  # another pipe or socket: a failure to show
        # the interpreter flushes stdout again at exit: into /dev/null, not another BrokenPipeError
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE: what a process the signal ended returns
    except Exception as exc:
        torch = sys.modules.get("torch")  # not imported for it: a command that never loaded torch cannot raise it
        if torch is None or not isinstance(exc, torch.OutOfMemoryError):
            raise
        logging.getLogger("areno").debug("out of device memory", exc_info=exc)
        first = next(iter(str(exc).strip().splitlines()), "")
        print(f"areno: error: out of device memory ({first}): {OUT_OF_MEMORY_FIX}", file=sys.stderr)
        return RUN_FAILED


if __name__ == "__main__":
    sys.exit(main())
