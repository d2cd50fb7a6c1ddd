"""A run that dapo's dynamic sampling stops (``RolloutPoolBroken``: every group of a step's rounds flat) saves an
emergency checkpoint of the steps trained; the step that stopped it is not one of them, so its samples, filtered
ones included, stay pending there and a resume after the fix trains what a run without the fault trains. So do
the samples of a streak dropped after all their attempts (a broken workflow, engine or server) that stops it."""

from __future__ import annotations

import json

import pytest
import torch

from areno.algo.filters import dynamic_sampling_kept
from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.engine.executor import RolloutPoolBroken, WorkflowExecutor
from areno.engine.staleness import StalenessManager
from areno.observe.metrics import read_metrics
from tests.helpers.configs import run_to_end, tiny_run_overrides
from tests.helpers.groups import GroupWorkflow, Released, engine, flat, varied
from tests.helpers.rewards import FLAT_ENV
from tests.helpers.workflows import BROKEN_ENV, BrokenWhenToldWorkflow

FIGURES = ("train/policy/loss", "train/policy/grad_norm", "rollout/reward_mean", "rollout/sampling_rounds")


def _config(tmp_path, name, *extra):
    overrides = tiny_run_overrides(tmp_path, run_name=name, reward="tests.helpers.rewards:flat_when_told")
    return load_config(
        None,
        [
            *overrides,
            "train.algorithm=dapo",
            "train.algorithm_kwargs={dynamic_sampling_max_rounds: 2}",
            "reward.sandbox=false",
            "train.eval_interval=0",
            "train.steps=3",
            "rollout.batch_size=4",
            *extra,
        ],
    )


def _figures(rows):
    return {r["step"]: tuple(r[k] for k in FIGURES) for r in rows if "train/policy/loss" in r}


def test_a_resume_after_dapos_stop_trains_the_stopped_steps_samples_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.delenv(FLAT_ENV, raising=False)
    reference = _figures(run_to_end(_config(tmp_path, "reference")))
    train = Trainer.train

    def train_then_flatten(self, rollout_id, rollout):  # step 1 as it should be, then every group flat
        metrics = train(self, rollout_id, rollout)
        monkeypatch.setenv(FLAT_ENV, "1")
        return metrics

    monkeypatch.setattr(Trainer, "train", train_then_flatten)
    with pytest.raises(RolloutPoolBroken, match=r"dynamic sampling kept no group of this step's 8 samples"):
        run_to_end(_config(tmp_path, "stopped"))
    assert (tmp_path / "stopped" / "checkpoints" / "step_00000001" / "COMPLETE").is_file()  # the emergency one
    monkeypatch.setattr(Trainer, "train", train)
    monkeypatch.delenv(FLAT_ENV)  # the reward fixed, the run resumed
    run_to_end(_config(tmp_path, "stopped", "resume=auto"))
    assert _figures(read_metrics(tmp_path / "stopped")) == reference


def test_the_pools_filtered_streak_that_breaks_it_stays_pending():
    """The asynchronous pool lets a filtered sample go once a group follows it; the streak that stops the run
    is kept (pending in the ledger, so the emergency checkpoint's resume generates it again)."""
    source = Released([flat(0), varied(1)] + [flat(i) for i in range(2, 100)])
    staleness = StalenessManager(max_head_offpolicyness=50, batch_size=1, max_concurrent=1)
    with WorkflowExecutor(
        engine(), GroupWorkflow(), source, staleness, group_filter=dynamic_sampling_kept, max_filtered_batches=3
    ) as ex:
        taken = []
        with pytest.raises(RolloutPoolBroken, match=r"kept no group of the last 3 samples"):
            while True:  # the group of 1, if the trainer comes before the pool breaks, then the break
                taken += [g[0].info["id"] for g in ex.wait_batch(1, timeout=20)]
    assert taken in ([], [1])
    assert source.released == [0]  # let go when 1's group came; 2, 3 and 4 are the streak's


def _recording(train, run_dir, monkeypatch, *, then_break):
    """``train`` (``Trainer.train``) appending each step's prompts (one per group) to ``run_dir/trained.jsonl``;
    with ``then_break``, every episode after the first step raises."""

    def recording_train(self, rollout_id, rollout):
        metrics = train(self, rollout_id, rollout)
        prompts = list({t.group_id: t.info["prompt"] for t in rollout.trajectories}.values())
        with open(run_dir / "trained.jsonl", "a") as f:
            f.write(json.dumps({"step": rollout_id + 1, "prompts": prompts}) + "\n")
        if then_break:
            monkeypatch.setenv(BROKEN_ENV, "1")
        return metrics

    return recording_train


def _trained_prompts(run_dir):
    """The prompts of the groups each step trained (``_recording``'s), by step: a resumed run's replace."""
    rows = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    return {row["step"]: row["prompts"] for row in rows}


@pytest.mark.parametrize("eta", [0, 1], ids=["synchronous", "asynchronous"])
def test_a_resume_after_a_broken_workflows_stop_trains_the_streaks_samples(tmp_path, monkeypatch, eta):
    """walk46 P2: the streak of samples dropped after all their attempts that stops the run (a broken workflow,
    engine or server) was let go sample by sample in the asynchronous pool: the emergency checkpoint did not hold
    them and the resume after the fix skipped them. Now they stay pending until a group follows, as a synchronous
    step's do until its batch is taken."""
    monkeypatch.delenv(BROKEN_ENV, raising=False)
    monkeypatch.setattr(BrokenWhenToldWorkflow, "failed", [])
    run_dir, train = tmp_path / "run", Trainer.train
    cfg = [
        *tiny_run_overrides(tmp_path),
        "reward.sandbox=false",
        "train.eval_interval=0",
        "train.steps=4",
        "rollout.workflow=tests.helpers.workflows:BrokenWhenToldWorkflow",
        f"rollout.max_head_offpolicyness={eta}",
        "rollout.max_retries=0",
        "rollout.max_consecutive_dropped=2",
    ]
    monkeypatch.setattr(Trainer, "train", _recording(train, run_dir, monkeypatch, then_break=True))
    with pytest.raises(RolloutPoolBroken, match=r"environment unreachable"):
        run_to_end(load_config(None, cfg))
    failed = set(BrokenWhenToldWorkflow.failed)
    assert failed
    (saved,) = (run_dir / "checkpoints").glob("step_*")  # the emergency checkpoint, of the steps trained
    state = torch.load(saved / "policy" / "trainer_state.pt", weights_only=True)["extra"]["data"]
    assert failed <= {p["row"]["prompt"] for p in state["pending"]}
    stopped = _trained_prompts(run_dir)

    monkeypatch.delenv(BROKEN_ENV)  # the workflow fixed, the run resumed
    monkeypatch.setattr(Trainer, "train", _recording(train, run_dir, monkeypatch, then_break=False))
    run_to_end(load_config(None, [*cfg, "resume=auto"]))
    resumed = {p for step, prompts in _trained_prompts(run_dir).items() if step not in stopped for p in prompts}
    assert failed <= resumed
