"""The ``sapo`` and ``vespo`` recipes end to end: a short CPU run of each trains and logs its loss's figure."""

from __future__ import annotations

import math

import pytest

from areno.api.config import load_config
from tests.helpers.configs import run_to_end, tiny_run_overrides


@pytest.mark.parametrize(("recipe", "figure"), [("sapo", "soft_gate"), ("vespo", "vespo_weight")])
def test_a_short_run_trains_and_logs_the_losss_weight(tmp_path, recipe, figure):
    cfg = load_config(
        None,
        [*tiny_run_overrides(tmp_path), "reward.sandbox=false", f"train.algorithm={recipe}", "train.steps=2",
         "train.eval_interval=0", "data.num_eval=0"],
    )  # fmt: skip
    rows = [r for r in run_to_end(cfg) if f"train/policy/actor/{figure}" in r]
    assert len(rows) == 2
    for row in rows:
        # on-policy (one pass, ratio 1): the gate and the weight are 1 up to rounding
        assert math.isclose(row[f"train/policy/actor/{figure}"], 1.0, rel_tol=1e-3), row
        assert math.isfinite(row["train/policy/loss"])
