"""What `areno train` runs: an optional supervised warm start, then the configured recipe.

The warm start is the ``sft`` recipe on the task's reference answers, exported as a Hugging Face
checkpoint that the main stage loads; held-out accuracy is printed before and after the main stage
and the curve is drawn to ``run_dir/curve.png``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
from pathlib import Path
from typing import Any

from areno.api.config import ArenoConfig, checked_config, load_config
from areno.api.preflight import check_run, resumes
from areno.api.rundir import RunDirLock
from areno.api.trainer import Trainer
from areno.data.datasets import warm_start_answer_key
from areno.engine.config import (
    ClusterSection,
    RolloutSection,
    field_default,
    has_held_out_rows,
    offline_unused_rollout_keys,
)
from areno.errors import RunStopped, UserError
from areno.observe.metrics import METRICS_FILENAME, REWARD_KEY, read_metrics, step_reward
from areno.train import checkpoint

logger = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
"""The demo's config, shipped in the package (package data), so ``areno demo`` runs from any install."""


def _stage(config: ArenoConfig, **changes) -> ArenoConfig:
    """A copy of ``config`` with nested fields replaced: _stage(cfg, train={"steps": 3})."""
    replaced = {}
    for section, values in changes.items():
        current = getattr(config, section)
        replaced[section] = dataclasses.replace(current, **values) if isinstance(values, dict) else values
    return dataclasses.replace(config, **replaced)


def warm_start_config(config: ArenoConfig) -> ArenoConfig:
    """The supervised stage of ``config``: the ``sft`` recipe on the task's reference answers (a file of
    preference rows: their ``chosen`` completions, ``warm_start_answer_key``), written under
    ``run_dir/warm_start``."""
    ws = config.warm_start
    return _stage(
        config,
        run_dir=str(Path(config.run_dir) / "warm_start"),
        resume=False,
        overwrite=True,  # an unfinished warm start starts over (a finished one is reused)
        data={"answer_key": warm_start_answer_key(config.data)},
        train={
            "algorithm": "sft",
            "algorithm_kwargs": {},
            "steps": ws.steps,
            "epochs": None,  # the main stage's length, not this one's
            "num_train_passes": 1,
            "num_minibatches": 1,
            "eval_interval": 0,
            "save_interval": 0,
            "lora": None,  # the warm start makes the base model (from scratch in the demo): all weights train
            "role_optim": {},  # the main recipe's roles: sft has the policy alone
        },
        optim={
            "lr": ws.lr,
            "schedule": "constant",
            "warmup_steps": 0,
            "min_lr_ratio": 0.0,
            # the main stage's may act only through train.role_optim (a critic's weight decay), dropped here
            "decay_biases_and_norms": config.optim.decay_biases_and_norms and config.optim.weight_decay > 0,
        },
        # the main stage's rollout settings that sft does not read (its n_samples, workflow ...) are reset:
        # preflight refuses them in an offline run, and here the user set them for the main stage
        rollout={
            "batch_size": ws.batch_size,
            **{
                key: field_default(RolloutSection, key)
                for key in offline_unused_rollout_keys(config, generates=has_held_out_rows(config.data))
            },
        },
        # sft has no rollout side: it trains colocated on cluster.device, whatever places the main stage
        cluster={
            "allocation_mode": None,
            "train_devices": None,
            "rollout_devices": None,
            "role_devices": {},
            "scheduler": "local",
            "scheduler_options": {},
            **{
                key: field_default(ClusterSection, key)
                for key in ("sync_commit", "sync_timeout_s", "sync_bucket_bytes")
            },
        },
        observe={"profile_steps": []},  # they name steps of the main stage
        # this stage has no warm start of its own; the main stage, which has, draws its rows in another order
        # (the engine's PromptStream stage), not the rows this one trained on in the same order
        warm_start={"steps": 0},
        test_rollout={"enabled": False},
        # sft scores no training batch: the main stage's reward model stays out, and its held-out rows are
        # scored by reward.fn, or by what a null reward.fn stands for without a model where it names none
        reward={"model": None, "missing_eos_penalty": None, "fn": config.reward.fn if config.reward.paths() else None},
    )


WARM_START_SETTINGS = {
    "model": ("path", "init_tiny", "dtype", "compute_dtype", "freeze_vision"),
    "data": (
        "task",
        "task_kwargs",
        "train_path",
        "prompt_key",
        "answer_key",
        "seed",
        "chat_template",
        "system_prompt",
        "chat_template_kwargs",
    ),
    "optim": ("lr", "weight_decay", "grad_clip", "betas", "eps"),
    "train": ("steps", "seed", "long_sequences"),
    "rollout": ("batch_size",),
    "cluster": ("device",),
}
"""The settings of the warm-start stage its model's weights follow from (the model it starts from, the
rows, the optimizer, the steps and seed, the batch, the device), not those that only change how fast it
trains or what it evaluates."""


def warm_start_settings(sft: ArenoConfig) -> dict:
    """``WARM_START_SETTINGS`` of the warm start ``sft`` (JSON-shaped, as its COMPLETE file keeps them);
    a finished warm start is reused only while they are the same."""
    sections = {
        name: {key: getattr(getattr(sft, name), key) for key in keys} for name, keys in WARM_START_SETTINGS.items()
    }
    if sft.optim.weight_decay:  # which weights decay; recorded only where some do (an older areno decayed all)
        sections["optim"]["decay_biases_and_norms"] = sft.optim.decay_biases_and_norms
    return json.loads(json.dumps(sections, default=str))


def _changed(made: dict, now: dict) -> list[str]:
    """The dotted keys whose values differ between two ``warm_start_settings``."""
    return [  # the keys fingerprinted now: one an older areno recorded and no longer reads is no change
        f"{name}.{key}"
        for name in sorted(now)
        for key in sorted(now[name])
        if made.get(name, {}).get(key) != now[name][key]
    ]


def finished_warm_start(config: ArenoConfig) -> tuple[Path, list[str] | None]:
    """The warm start's export directory, and the settings that changed since it finished (None: not
    finished; empty: it can be reused)."""
    sft = warm_start_config(config)
    export_dir = Path(sft.run_dir) / "final_model"
    if not (export_dir / "COMPLETE").exists():
        return export_dir, None
    made = json.loads((export_dir / "COMPLETE").read_text()).get("settings")
    return export_dir, ["(unrecorded)"] if made is None else _changed(made, warm_start_settings(sft))


def run_warm_start(config: ArenoConfig, *, resuming: bool = False) -> Path:
    """Supervised warm start; returns the exported checkpoint directory: reused when complete and made
    with the same settings (``warm_start_settings``), made again otherwise, except under a resumed run,
    whose checkpoints and reference model came from the one there (reused, the change warned about)."""
    sft = warm_start_config(config)
    export_dir, changed = finished_warm_start(config)
    if changed == []:
        logger.info("warm start: reusing %s", export_dir)
        return export_dir
    if changed and resuming:
        logger.warning(
            "warm start: %s was made with other settings (%s); the resumed run keeps it",
            export_dir,
            ", ".join(changed[:4]),
        )
        return export_dir
    if changed:
        print(f"warm start: {export_dir} was made with other settings ({', '.join(changed[:4])}): training it again")
        (export_dir / "COMPLETE").unlink()
    trainer = Trainer.init(sft, stage="warm start", warm_start_by_caller=True)
    trainer.save_on_stop = False  # a stopped warm start starts over: it is the stage's one run
    try:
        metrics = trainer.run()
        trainer.backend.export_policy(export_dir)
    finally:
        trainer.shutdown()
    (export_dir / "COMPLETE").write_text(json.dumps({**metrics, "settings": warm_start_settings(sft)}))
    if trainer.stopped_by is not None:  # a signal during its last step: finished, but the main stage waits
        raise RunStopped(
            f"stopped by {signal.Signals(trainer.stopped_by).name} at the end of the warm start ({export_dir}); "
            "the main stage starts when the run is started again",
            trainer.stopped_by,
        )
    accuracy = metrics.get("eval/accuracy", float("nan"))
    print(f"warm start ({sft.train.steps} sft steps): held-out accuracy {accuracy:.3f}")
    return export_dir


def run_pipeline(config: ArenoConfig) -> dict[str, Any]:
    """Warm start (if configured), then the main recipe; returns before/after metrics (and
    ``best_checkpoint`` with ``train.best_metric``). ``config`` is
    checked again as at construction, its paths made absolute (``config.checked_config``); both stages
    are checked (``preflight.check_run``) before the first one starts, with the run directory
    locked (``rundir.RunDirLock``) for the whole pipeline."""
    config = checked_config(config, caller="run_pipeline")
    with RunDirLock(config.run_dir):
        return _run_stages(config)


def check_pipeline(config: ArenoConfig) -> ArenoConfig:
    """What ``run_pipeline`` checks before it trains, and nothing more: the config as the run would resolve it
    (``checked_config``: paths made absolute, ``train.epochs`` counted), then ``preflight.check_run`` for
    each stage (the recipe, reward, data, model directory and tokenizer, placement, run directory). Builds no
    model and writes nothing (``areno train --check``). Returns the resolved config."""
    config = checked_config(config, caller="areno train --check")
    _check_stages(config)
    return config


def _check_stages(config: ArenoConfig) -> None:
    """``preflight.check_run`` of the main stage (with the model.path the warm start starts from) and of the
    warm start, where there is one."""
    check_run(config)
    if config.warm_start.steps > 0:
        check_run(warm_start_config(config))


def _run_stages(config: ArenoConfig) -> dict[str, Any]:
    _check_stages(config)
    if config.warm_start.steps > 0:
        # a finished warm start is reused (a resumed run keeps it even where its settings changed)
        config = _stage(config, model={"path": str(run_warm_start(config, resuming=resumes(config)))})
    trainer = Trainer.init(config, warm_start_by_caller=True)
    try:
        before = trainer.evaluate_now() if trainer.start_rollout_id == 0 else _evaluation_at_start(config.run_dir)
        after = trainer.run()
    finally:
        trainer.shutdown()
    summary = {"accuracy_before": before.get("eval/accuracy"), "accuracy_after": after.get("eval/accuracy")}
    best = checkpoint.read_best(Path(config.run_dir) / "checkpoints") if config.train.best_metric else None
    if best is not None:  # train.best_metric's pick, which `areno eval --checkpoint best` scores again
        summary["best_checkpoint"] = {"step": best["step"], best["metric"]: best["value"], "path": best["path"]}
    curve = plot_curve(Path(config.run_dir))
    print(
        json.dumps(
            {
                "algorithm": config.train.algorithm,
                **summary,
                "run_dir": config.run_dir,
                "curve": str(curve) if curve else None,
            }
        )
    )
    return summary


def _evaluation_at_start(run_dir: str) -> dict[str, float]:
    """The held-out evaluation a resumed run logged before its first step (step 0), or {} if none."""
    rows = [r for r in read_metrics(Path(run_dir)) if r.get("step") == 0 and "eval/accuracy" in r]
    return rows[0] if rows else {}


def plot_curve(run_dir: Path) -> Path | None:
    """Reward and held-out accuracy over steps, from metrics.jsonl, as run_dir/curve.png."""
    if not (run_dir / METRICS_FILENAME).exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = []
    for key, label in ((REWARD_KEY, "train reward"), ("eval/accuracy", "held-out accuracy")):
        pts = [(r["step"], step_reward(r) if key == REWARD_KEY else r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key.startswith("eval") else None, label=label)
            values += [v for _, v in pts]
    ax.set_xlabel("step")
    if all(0 <= v <= 1 for v in values):  # a 0/1 reward's scale; any other reward sets its own
        ax.set_ylim(-0.02, 1.02)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:  # an offline run without held-out rows: matplotlib would warn of a legend with nothing in it
        ax.text(0.5, 0.5, "no rollout reward or held-out accuracy logged", ha="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = run_dir / "curve.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run_demo(*, run_dir: str = "runs/demo", overrides: list[str] = ()) -> dict[str, float]:
    """The CPU demo: ``areno/configs/demo.yaml`` (a tiny model learns to sort digits with GRPO)."""
    if not DEMO_CONFIG.exists():
        raise UserError(f"{DEMO_CONFIG} not found: this areno install is incomplete; reinstall it (pip install areno)")
    # each `areno demo` starts over in its run directory, unless an override asks to resume it
    resuming = any(
        k.strip() == "resume" and v.strip().lower() != "false" for k, _, v in (o.partition("=") for o in overrides)
    )
    base = [f"run_dir={run_dir}", *([] if resuming else ["overwrite=true"])]
    config = load_config(DEMO_CONFIG, [*base, *overrides])
    if not any(o.split("=", 1)[0].strip() == "model.path" for o in overrides):
        # the tiny initial model goes inside the run directory, wherever an override put it
        config = load_config(DEMO_CONFIG, [*base, f"model.path={Path(config.run_dir) / 'init_model'}", *overrides])
    summary = run_pipeline(config)
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    curve = Path(config.run_dir) / "curve.png"
    steps = f"{config.train.steps} {config.train.algorithm} steps"  # the recipe an override chose
    if config.reward.several():  # eval/accuracy is the weighted sum's mean, not a fraction solved
        shown = "n/a" if after is None else f"{after:.3f}"
        start = "" if before is None else f"{before:.3f} -> "
        print(
            f"demo: held-out mean reward (reward.fn's weighted sum) {start}{shown} after {steps}; each function's "
            f"mean is eval/reward/<name>_mean in {Path(config.run_dir) / 'metrics.jsonl'}; curve: {curve}"
        )
    elif before is None or after is None:  # a resumed demo evaluated only after its steps (or none were left)
        held = "n/a" if after is None else f"{after:.1%}"
        print(f"demo (resumed): held-out accuracy {held} after {steps}; curve: {curve}")
    else:
        print(
            f"demo: held-out accuracy {before:.1%} -> {after:.1%} ({(after - before) * 100:+.1f} points) "
            f"after {steps}; curve: {curve}"
        )
    return summary
