"""The console line of a recipe with a critic (ppo) shows the critic's value loss (``vloss``), which
falls as the value model learns, beside the rollout's reward; a recipe without a critic shows none."""

from __future__ import annotations

import io

import pytest

from areno.api.config import load_config
from areno.observe.metrics import ConsoleSink
from tests.helpers.configs import run_to_end, tiny_run_overrides


def test_the_console_line_shows_a_critics_value_loss():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=None, stream=stream)
    rl = {"rollout/reward_mean": 0.484, "rollout/completion_len_mean": 5.25, "train/policy/loss": -4.66e-10}
    sink.write({**rl, "train/value/loss": 0.25, "train/value/critic/value_loss": 0.125}, step=1)
    sink.write({**rl, "train/critic/critic/value_loss": 0.0625}, step=2)  # a user's recipe names its role otherwise
    sink.write(rl, step=3)  # grpo: no critic
    sink.close()
    assert stream.getvalue().splitlines() == [
        "step 1 | reward 0.484 | len 5.25 | vloss 0.125",
        "step 2 | reward 0.484 | len 5.25 | vloss 0.0625",
        "step 3 | reward 0.484 | len 5.25",
    ]


def test_a_ppo_run_prints_its_value_loss(tmp_path, capsys):
    overrides = [*tiny_run_overrides(tmp_path), "train.algorithm=ppo", "train.steps=1", "train.eval_interval=0"]
    rows = run_to_end(load_config(None, [*overrides, "reward.sandbox=false", "observe.console=true"]))
    (step,) = [r for r in rows if "train/value/critic/value_loss" in r]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step 1/1 |")]
    assert len(lines) == 1 and " | reward " in lines[0]
    shown = float(lines[0].split(" | vloss ")[1].split(" | ")[0])  # three significant digits
    assert shown == pytest.approx(step["train/value/critic/value_loss"], rel=5e-3)


def test_the_console_line_says_a_step_was_skipped():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=None, stream=stream)
    rl = {"rollout/reward_mean": 0.5, "train/policy/skipped_steps": 2.0}
    sink.write({**rl, "train/policy/consecutive_skips": 1.0}, step=1)
    sink.write({**rl, "train/policy/consecutive_skips": 2.0}, step=2)
    sink.write({**rl, "train/policy/consecutive_skips": 0.0}, step=3)  # updated again
    sink.close()
    assert stream.getvalue().splitlines() == [
        "step 1 | reward 0.5 | skipped loss/grad NaN or inf, 1 in a row",
        "step 2 | reward 0.5 | skipped loss/grad NaN or inf, 2 in a row",
        "step 3 | reward 0.5",
    ]
