"""A reward that fails on every call stops the run after ``REWARD_FAILED_BATCHES`` such rollout batches,
instead of training on zero rewards; one that fails now and then does not. Either is warned about in
full once, then once per batch with a count, not once per call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging

import pytest

from areno.cli import main
from areno.engine.api import REWARD_FAILED_BATCHES
from areno.types import Trajectory
from areno.workflows import common
from tests.helpers.configs import train_args


@pytest.fixture(autouse=True)
def no_reward_failed_yet(monkeypatch):
    """Each test's reward functions fail for the first time in it (their first failure is warned in full)."""
    monkeypatch.setattr(common, "_failed_rewards", {})


def test_a_reward_failing_every_call_stops_the_run(tmp_path, capsys, caplog):
    args = train_args(
        tmp_path,
        "train.steps=10",
        "reward.fn=tests.helpers.rewards:exploding",
        "reward.sandbox=false",
        "rollout.batch_size=4",
        "rollout.n_samples=4",
    )
    with caplog.at_level(logging.WARNING):
        assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"areno: error: every reward call of the last {REWARD_FAILED_BATCHES} rollout batches")
    assert "RuntimeError: reward bug" in err[-1] and "fix reward.fn (tests.helpers.rewards:exploding)" in err[-1]
    steps = [json.loads(line).get("step") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == REWARD_FAILED_BATCHES - 1  # the third batch stopped it
    # walk31: the steps trained before were lost (train.save_interval=0); now saved, and the error says so
    assert (tmp_path / "run" / "checkpoints" / f"step_{REWARD_FAILED_BATCHES - 1:08d}" / "COMPLETE").is_file()
    assert f"saved an emergency checkpoint of step {REWARD_FAILED_BATCHES - 1}" in err[-1]
    # 4 held-out rows and 3 batches of 16 completions failed: the first call warned in full, then one
    # line for the evaluation and one per batch, instead of 52
    warnings = [r.getMessage() for r in caplog.records if r.name == "areno.workflows"]
    assert len(warnings) == 2 + REWARD_FAILED_BATCHES, warnings
    assert warnings[0].startswith("reward function failed for prompt ") and "RuntimeError: reward bug" in warnings[0]
    assert warnings[1].startswith("reward function failed on 4 of 4 completions of the held-out rows")
    assert warnings[2:] == [
        f"reward function failed on 16 of 16 completions of step {step}'s rollout batch (each scored 0); "
        "last error: RuntimeError: reward bug"
        for step in range(1, REWARD_FAILED_BATCHES + 1)
    ]


def _call(reward_fn, completion: str = "c") -> tuple[float, str | None]:
    return asyncio.run(common.acall_reward(reward_fn, "p", completion, "a", {"id": 7}))


def test_a_reward_function_is_warned_about_in_full_once(caplog):
    def broken(prompt, completion, answer, **row):
        raise KeyError(completion)

    def other(prompt, completion, answer, **row):
        return float("nan")

    with caplog.at_level(logging.DEBUG, logger="areno.workflows"):
        results = [_call(broken, "x"), _call(broken, "y"), _call(other, "z"), _call(broken, "w"), _call(other, "v")]
    assert [r for r, _ in results] == [0.0] * 5
    assert [e for _, e in results][:2] == ["KeyError: 'x'", "KeyError: 'y'"]
    levels = [(r.levelno, r.getMessage().split(", fields")[0]) for r in caplog.records]
    assert levels == [
        (logging.WARNING, "reward function failed for prompt 'p', completion 'x'"),  # each function's first: in full
        (logging.DEBUG, "reward function failed for prompt 'p', completion 'y'"),  # the later ones: counted
        (logging.WARNING, "reward function failed for prompt 'p', completion 'z'"),
        (logging.DEBUG, "reward function failed for prompt 'p', completion 'w'"),
        (logging.DEBUG, "reward function failed for prompt 'p', completion 'v'"),
    ]
    assert "later failures are counted" in caplog.records[0].getMessage()


def test_a_batch_of_reward_errors_is_one_warning(caplog):
    def traj(error: str | None) -> Trajectory:
        info = {} if error is None else {"reward_error": error}
        return Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], reward=0.0, info=info)

    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        common.warn_reward_errors([traj(None), traj(None)], "step 1's rollout batch")
        common.warn_reward_errors(
            [traj("ValueError: a"), traj(None), traj("Traceback:\nline 2")], "step 2's rollout batch"
        )
    assert [r.getMessage() for r in caplog.records] == [
        "reward function failed on 2 of 3 completions of step 2's rollout batch (each scored 0); last error: Traceback:"
    ]


def test_a_reward_failing_on_some_rows_trains_on(tmp_path):
    args = train_args(
        tmp_path, "train.steps=4", "reward.fn=tests.helpers.rewards:every_other_raises", "reward.sandbox=false"
    )
    assert main(args) == 0


def test_an_in_process_reward_that_exits_is_a_reward_error():
    """walk31: sys.exit() or a KeyboardInterrupt raised in a reward (reward.sandbox=false) escaped the reward
    wrapper, ended the rollout loop's task and hung the run."""

    def exits(prompt, completion, answer, **row):
        raise SystemExit(0)

    def interrupts(prompt, completion, answer, **row):
        raise KeyboardInterrupt

    assert _call(exits) == (0.0, "SystemExit: 0")
    with concurrent.futures.ThreadPoolExecutor(1) as loop_thread:  # the rollout loop's (a Ctrl-C on the main one)
        assert loop_thread.submit(_call, interrupts).result(timeout=30) == (0.0, "KeyboardInterrupt: ")


def _reads_a_relative_file(tmp_path):
    """A reward module that opens lookup.json relative to the working directory at import: it imports in
    the trainer (run from tmp_path) but not in a sandbox worker, whose working directory is its own."""
    (tmp_path / "lookup.json").write_text("{}")
    module = tmp_path / "rw_relative.py"
    module.write_text(
        "import json\nTABLE = json.load(open('lookup.json'))\n\ndef score(p, c, a, **row):\n    return 1.0\n"
    )
    return module


def test_a_reward_that_imports_only_in_the_trainer_stops_the_run_before_its_first_step(tmp_path, monkeypatch, capsys):
    """Every sandboxed call failed with a crash, scored 0, and the run stopped after the step-0 evaluation and
    three rollout batches; now the first worker, started while the models load, is waited for before any
    rollout, and its import error is the run's one line."""
    module = _reads_a_relative_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = train_args(tmp_path, "train.steps=10", f"reward.fn={module}:score", "reward.sandbox=true")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"areno: error: reward.fn={module}:score: the reward sandbox's worker cannot start: ")
    assert "FileNotFoundError" in err[-1] and "private temporary directory" in err[-1]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not any("step" in json.loads(line) for line in metrics.read_text().splitlines())


def test_the_sandbox_start_check_passes_a_reward_that_imports_and_keeps_its_worker(tmp_path):
    from areno.rewards.sandbox import RewardSandbox

    module = tmp_path / "rw_ok.py"
    module.write_text("def score(p, c, a, **row):\n    return 0.5\n")
    with RewardSandbox(f"{module}:score", workers=2) as pool:
        pool.start_early()
        pool.check_started()
        (pid,) = pool.worker_pids()  # one worker started early, and it scores the first call
        assert pool.score("p", "c", "a") == 0.5 and pool.worker_pids() == [pid]
