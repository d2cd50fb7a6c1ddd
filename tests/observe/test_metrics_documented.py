"""Every metric a short CPU run logs is documented in docs/metrics.md, so a new metric cannot ship
without its line (what it is, its unit and aggregation)."""

from __future__ import annotations

import pytest

from areno.api.config import load_config
from tests.helpers.configs import run_to_end, tiny_run_overrides
from tests.helpers.metrics_doc import DOC, undocumented


def test_the_matcher_reads_placeholders_and_rejects_others():
    assert undocumented({"train/value/critic/value_loss", "eval/pass@8", "policy_sync_phase_device_sync_s"}) == []
    assert undocumented({"train/policy/actor/made_up", "rollout/nope", "train/a/b/loss"}) == [
        "rollout/nope",
        "train/a/b/loss",
        "train/policy/actor/made_up",
    ]


def test_the_figures_of_several_reward_functions_are_documented():
    # reward.fn as a list: each function's score under its name, its own figures under <name>/<figure>
    for prefix in ("rollout", "eval", "test"):
        assert undocumented({f"{prefix}/reward/correct_mean", f"{prefix}/reward/correct/parsed_mean"}) == []


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        # the reward sandbox's counters, the reference KL (its reference following the policy), the entropy of
        # the actor and its entropy mask
        (
            "grpo",
            [
                "reward.sandbox=true",
                "train.algorithm_kwargs={kl_coef: 0.01, entropy_coef: 0.01, top_entropy_quantile: 0.5, ref_sync_steps: 1}",
            ],
        ),
        ("ppo", []),
        ("ppo_kl", []),
    ],
)
def test_every_metric_a_short_run_logs_is_documented(tmp_path, algorithm, extra):
    overrides = [
        *tiny_run_overrides(tmp_path),
        f"train.algorithm={algorithm}",
        "train.steps=2",
        "train.eval_interval=1",
    ]
    rows = run_to_end(load_config(None, [*overrides, "reward.sandbox=false", *extra]))
    keys = {k for row in rows for k in row}
    assert {"train/policy/loss", "eval/accuracy", "policy_sync_time_s"} <= keys  # the run logged steps and evals
    assert undocumented(keys) == [], f"add these to {DOC} (what, unit, aggregation)"
