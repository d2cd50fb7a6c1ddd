"""Shared pieces of the kill -9 / resume tests: a tiny run driven through the real CLI.

Run as a module (``python -m tests.helpers.resume key=value ...``) it is ``areno train`` plus one
recorder: every trainer step appends the prompts it trained on to ``run_dir/trained_prompts.jsonl``
(flushed per step, so a SIGKILL loses nothing already trained). ``ARENO_FAULT`` in the
environment kills it at a phase of a step (``areno.faults``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINED_PROMPTS = "trained_prompts.jsonl"


def digit_reward(prompt: str, completion: str, answer, **row) -> float:
    """A reward that varies inside almost every group of a random model: a hash of the characters."""
    return (sum(map(ord, completion)) % 7) / 6


def overrides(tmp: Path, run_dir: Path, *extra: str, steps: int = 4, save_interval: int = 2) -> list[str]:
    """A tiny GRPO run (hidden 32, 2 layers, one CPU thread) checkpointing every ``save_interval``."""
    return [
        f"run_dir={run_dir}",
        f"model.path={tmp / 'model'}",
        "model.init_tiny={hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64}",
        "data.task=arithmetic",
        "data.num_eval=2",
        "rollout.batch_size=2",
        "rollout.n_samples=4",
        "rollout.max_new_tokens=4",
        "reward.fn=tests.helpers.resume:digit_reward",
        "reward.sandbox=false",
        "cluster.device=cpu",
        "cluster.cpu_threads=1",
        "observe.console=false",
        "optim.lr=0.01",
        f"train.steps={steps}",
        f"train.save_interval={save_interval}",
        "train.eval_interval=0",
        "train.seed=3",
        "resume=auto",
        *extra,
    ]


def _env(fault: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ARENO_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    if fault is not None:
        env["ARENO_FAULT"] = fault
    return env


def start_areno(args: list[str]) -> subprocess.Popen:
    """This module as a script in a fresh process, not waited for (the caller kills it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.resume", *args],
        env=_env(None),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run_areno(args: list[str], *, fault: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """This module as a script in a fresh process (ARENO_FAULT=fault when given)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.resume", *args],
        env=_env(fault),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def resumed_step(proc: subprocess.CompletedProcess) -> int | None:
    """The checkpoint step a run resumed from (from its ``resumed_from`` line), None if it started fresh."""
    for line in proc.stdout.splitlines():
        if line.startswith('{"resumed_from"'):
            return int(Path(json.loads(line)["resumed_from"]).name.removeprefix("step_"))
    return None


def train_rows(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl rows that carry training figures, by step (a step logged twice is an error)."""
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/policy/loss" in row:
            assert row["step"] not in rows, f"step {row['step']} logged twice in {run_dir}/metrics.jsonl"
            rows[row["step"]] = row
    return rows


def losses(rows: dict[int, dict]) -> dict[int, tuple[float, float, float]]:
    """Per step: loss, grad norm and rollout reward — the figures that must match bit for bit."""
    return {s: (r["train/policy/loss"], r["train/policy/grad_norm"], r["rollout/reward_mean"]) for s, r in rows.items()}


def trained_prompts(run_dir: Path) -> list[tuple[int, str]]:
    """(step, prompt) of every trained group, as the run's data history reads after resumes: a
    process that resumed at step N+1 replaces what earlier processes trained at steps > N (as
    metrics.jsonl is cut back). Each row names the process that wrote it."""
    out: list[tuple[int, str]] = []
    path = run_dir / TRAINED_PROMPTS
    last_pid = None
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # torn by a kill while being written; its step runs again
            continue
        if row["pid"] != last_pid:  # a new process: it redoes the steps from its first one
            out = [r for r in out if r[0] < row["step"]]
            last_pid = row["pid"]
        out.extend((row["step"], p) for p in row["prompts"])
    return out


def _install_recorder() -> None:
    from areno.api import trainer as trainer_mod

    train = trainer_mod.Trainer.train

    def recording_train(self, rollout_id, rollout):
        metrics = train(self, rollout_id, rollout)
        groups = {}  # one entry per group, in batch order
        for traj in rollout.trajectories:
            groups.setdefault(traj.group_id, traj.info["prompt"])
        with open(self.run_dir / TRAINED_PROMPTS, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "step": rollout_id + 1, "prompts": list(groups.values())}) + "\n")
        return metrics

    trainer_mod.Trainer.train = recording_train


if __name__ == "__main__":
    _install_recorder()
    from areno.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
