"""The statistics an actor logs are averages under every loss aggregation (walk6 A3): under Dr. GRPO's
``constant`` aggregation the loss is sum / (B * L), but the ratio, clip fraction, KL and entropy are not
divided by L. Hand-computed values; the loss's own weights and denominators are unchanged."""

import pytest
import torch

from areno.algo import aggregation_denominator, aggregation_weights_T, statistics_weights_T
from areno.specializations import ActorConfig, ActorSpecialization
from areno.types import TokenBatch
from tests.helpers.recipes import PlainReducer, group_batch_of, make_decoder, naive_logprobs

CU = torch.tensor([0, 3, 7, 9])
MASK = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)  # sequences of 2, 3 and 1 loss tokens
VALUES = torch.tensor([9.0, 1.0, 3.0, 9.0, 2.0, 2.0, 8.0, 9.0, 5.0])  # 9 off the mask: never read


def _average(mode: str, constant: float = 10.0) -> float:
    """A statistic as the backend reduces it: sum(v * w) / the loss's denominator."""
    w = statistics_weights_T(MASK, CU, mode, constant=constant)
    return (VALUES * w).sum().item() / aggregation_denominator(MASK, CU, mode, constant=constant)


def test_statistics_are_averages_under_every_aggregation():
    # per-sequence token means: (1 + 3) / 2 = 2, (2 + 2 + 8) / 3 = 4, 5 / 1 = 5
    assert _average("token") == pytest.approx((1 + 3 + 2 + 2 + 8 + 5) / 6)
    assert _average("seq_mean_token_mean") == pytest.approx((2 + 4 + 5) / 3)
    # constant: not sum / (B * L) = 21 / 30 = 0.7, but the per-sequence means averaged over B
    assert _average("constant", 10.0) == pytest.approx((2 + 4 + 5) / 3)
    assert _average("constant", 1024.0) == pytest.approx((2 + 4 + 5) / 3)
    w = statistics_weights_T(MASK, CU, "constant", constant=10.0)
    assert w.tolist() == pytest.approx([0, 5, 5, 0, 10 / 3, 10 / 3, 10 / 3, 0, 10])
    assert w.dtype == torch.float32
    # the statistics of token and seq_mean_token_mean are the loss's own weights, bit for bit
    for mode in ("token", "seq_mean_token_mean"):
        assert torch.equal(statistics_weights_T(MASK, CU, mode), aggregation_weights_T(MASK, CU, mode))
    # the loss keeps Dr. GRPO's constant: 21 / (3 * 10)
    loss_w = aggregation_weights_T(MASK, CU, "constant")
    assert (VALUES * loss_w).sum().item() / aggregation_denominator(MASK, CU, "constant", constant=10) == (
        pytest.approx(21 / 30)
    )
    with pytest.raises(ValueError, match="loss_aggregation"):
        statistics_weights_T(MASK, CU, "sum")


def test_a_constant_of_ones_averages_to_one_across_micro_batches():
    """A ratio of 1 on every token is 1 whatever L and however the sequences are split: each micro-batch's
    share sum(w) / (B_all * L) adds up to 1 (the backend sums the micro-batches' metrics)."""
    ones = torch.ones(9)
    shares = []
    for lo, hi in ((0, 1), (1, 3)):  # micro-batches of sequence 0 and of sequences 1-2
        cu = CU[lo : hi + 1] - CU[lo]
        mask = MASK[CU[lo] : CU[hi]]
        w = statistics_weights_T(mask, cu, "constant", constant=1024.0)
        shares.append(
            (ones[: len(mask)] * w).sum().item() / aggregation_denominator(MASK, CU, "constant", constant=1024)
        )
    assert sum(shares) == pytest.approx(1.0, abs=1e-6)


def _batch() -> TokenBatch:
    specs = [("a", 1.0, 3, 4), ("a", 0.0, 2, 2), ("b", 0.0, 2, 3), ("b", 1.0, 3, 1)]
    return group_batch_of(specs, seed=5, vocab=24, version=0)


@pytest.mark.parametrize("constant", [4.0, 1024.0])
def test_dr_grpo_actor_ratio_is_one_on_policy_and_the_loss_keeps_its_constant(constant):
    """On-policy data (behaviour log-probs = the model's): actor/ratio is 1 and clip_frac 0 whatever L,
    while the loss is sum_{i,t} -A_i / (B * L) (ratio 1, nothing clipped)."""
    model = make_decoder(0)
    batch = _batch()
    batch.logprobs_T = torch.where(batch.loss_mask_T, naive_logprobs(model, batch), torch.zeros(()))
    spec = ActorSpecialization(
        ActorConfig(
            advantage_estimator="dr_grpo", clip_eps=0.2, loss_aggregation="constant", loss_agg_constant=constant
        )
    )
    prepared = spec.prepare_batch(batch)
    reducer = PlainReducer(spec.denominator(prepared))
    assert reducer.denominator == 4 * constant
    loss, metrics = spec.compute_loss(spec.extract_model_output(model, prepared), prepared, reducer)
    assert metrics["actor/ratio"].item() == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/clip_frac"].item() == 0.0
    # A = R - mean_G R: a: +0.5, -0.5; b: -0.5, +0.5; completions of 4, 2, 3, 1 tokens
    expected = -(0.5 * 4 - 0.5 * 2 - 0.5 * 3 + 0.5 * 1) / (4 * constant)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
