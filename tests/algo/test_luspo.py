"""LUSPO's aggregation, ``loss_aggregation=seq_mean_token_sum``: each sequence's token losses summed, the
sums averaged over the sequences with loss tokens. Hand-computed values, micro-batch splits, and the
``luspo`` recipe end to end (TRL's own loss code: tests/algo/test_trl_parity.py)."""

import math

import pytest
import torch

from areno.algo import aggregation_denominator, aggregation_weights_T, statistics_weights_T
from areno.api.config import load_config
from areno.recipes import get_recipe
from tests.helpers.configs import run_to_end, tiny_run_overrides

CU = torch.tensor([0, 3, 7, 9, 11])
MASK = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1, 0, 0], dtype=torch.bool)  # 2, 3, 1 and 0 loss tokens
VALUES = torch.tensor([9.0, 1.0, 3.0, 9.0, 2.0, 2.0, 8.0, 9.0, 5.0, 9.0, 9.0])  # 9 off the mask: never read


def _reduce(weights, mode):
    return (VALUES * weights).sum().item() / aggregation_denominator(MASK, CU, mode)


def test_the_loss_is_the_mean_over_sequences_of_their_sums():
    # sums 4, 12 and 5 over the three sequences with loss tokens (the fourth has none: not counted)
    assert aggregation_denominator(MASK, CU, "seq_mean_token_sum") == 3.0
    assert _reduce(aggregation_weights_T(MASK, CU, "seq_mean_token_sum"), "seq_mean_token_sum") == pytest.approx(
        (4 + 12 + 5) / 3
    )
    # its logged statistics are the per-sequence token means averaged: (2 + 4 + 5) / 3, not the sums
    stats = statistics_weights_T(MASK, CU, "seq_mean_token_sum")
    assert _reduce(stats, "seq_mean_token_sum") == pytest.approx((2 + 4 + 5) / 3)


def test_micro_batches_add_up_to_the_whole_step():
    """The backend sums each micro-batch's sum(loss * w) and divides by the step's denominator."""
    whole = _reduce(aggregation_weights_T(MASK, CU, "seq_mean_token_sum"), "seq_mean_token_sum")
    parts = 0.0
    for lo, hi in ((0, 1), (1, 4)):
        cu, mask = CU[lo : hi + 1] - CU[lo], MASK[CU[lo] : CU[hi]]
        parts += (VALUES[CU[lo] : CU[hi]] * aggregation_weights_T(mask, cu, "seq_mean_token_sum")).sum().item()
    denominators = aggregation_denominator(MASK[:3], CU[:2], "seq_mean_token_sum") + aggregation_denominator(
        MASK[3:], CU[1:] - 3, "seq_mean_token_sum"
    )
    assert denominators == 3.0 and parts / denominators == pytest.approx(whole)


def test_the_luspo_recipe_is_gspo_summed_over_tokens():
    spec = get_recipe("luspo").roles[0].build()
    c = spec.config
    assert (c.policy_loss, c.loss_aggregation, c.clip_eps, c.clip_eps_high) == (
        "gspo",
        "seq_mean_token_sum",
        3e-4,
        4e-4,
    )


def test_a_short_luspo_run_trains(tmp_path):
    cfg = load_config(
        None,
        [*tiny_run_overrides(tmp_path), "reward.sandbox=false", "train.algorithm=luspo", "train.steps=2",
         "train.eval_interval=0", "data.num_eval=0"],
    )  # fmt: skip
    rows = [r for r in run_to_end(cfg) if "train/policy/loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["train/policy/loss"])
        # on-policy, one pass: the sequence ratio is 1, a mean over sequences of token means
        assert row["train/policy/actor/ratio"] == pytest.approx(1.0, abs=1e-3), row
