"""bench/async_learning.py's verdict: steps to the reference arm's accuracy, with and without slack."""

from __future__ import annotations

from bench.async_learning import aggregate, learning_headline, plot, with_ratios


def arm(eta, curve):
    return {"algorithm": "grpo_async", "eta": eta, "curve": curve, "final_accuracy": curve[-1][1]}


def test_ratios_against_the_final_or_the_budget():
    ref = arm(0, [(0, 0.3), (10, 0.4), (20, 0.5), (30, 0.5), (40, 0.6)])
    late = arm(4, [(0, 0.3), (10, 0.35), (20, 0.45), (30, 0.5), (40, 0.55)])
    arms = [dict(ref), dict(late)]
    with_ratios(arms)  # target: the reference's final .6, never reached by eta 4
    assert arms[0]["steps_to_reference_final"] == 40 and arms[1]["steps_to_reference_final"] is None
    arms = [dict(ref), dict(late)]
    with_ratios(arms, budget=30)  # target: the reference at step 30 (.5, first at 20); eta 4 at 30
    assert arms[0]["reference_accuracy"] == 0.5
    assert arms[1]["steps_to_reference_final"] == 30 and arms[1]["steps_ratio_vs_eta0"] == 1.5


def test_aggregate_means_seeds_then_compares_mean_curves():
    per_seed = {
        0: [arm(0, [(0, 0.2), (10, 0.4), (20, 0.6)]), arm(4, [(0, 0.2), (10, 0.3), (20, 0.6)])],
        1: [arm(0, [(0, 0.4), (10, 0.6), (20, 0.6)]), arm(4, [(0, 0.4), (10, 0.5), (20, 0.6)])],
    }
    for arms in per_seed.values():
        with_ratios(arms, budget=10)
    agg = aggregate(per_seed, budget=10)
    ref, other = agg["arms"]
    assert ref["curve"] == [(0, 0.3), (10, 0.5), (20, 0.6)] and agg["reference_accuracy"] == 0.5
    assert other["steps_to_reference_final"] == 20 and other["steps_ratio_vs_eta0"] == 2.0
    assert other["per_seed_steps_ratio"] == [2.0, 2.0]


def test_plot_writes_a_png_of_every_arm(tmp_path):
    per_seed = {
        "0": [
            dict(arm(0, [(0, 0.2), (10, 0.4)]), wall_s=3.0, staleness_mean=0.0),
            dict(arm(4, [(0, 0.2), (10, 0.3)]), wall_s=2.0, staleness_mean=3.5),
        ]
    }
    result = {
        "arms_spec": ["grpo_async:0", "grpo_async:4"],
        "per_seed": per_seed,
        "steps": 10,
        "slack": 0.0,
        "overrides": ["cluster.device=cpu"],
    }
    plot(result, tmp_path / "curves.png")
    data = (tmp_path / "curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_headline_is_the_second_arm_against_the_reference_over_the_mean_curves():
    per_seed = {
        0: [arm(0, [(0, 0.2), (10, 0.4), (20, 0.6)]), arm(4, [(0, 0.2), (10, 0.3), (20, 0.6)])],
        1: [arm(0, [(0, 0.4), (10, 0.6), (20, 0.6)]), arm(4, [(0, 0.4), (10, 0.5), (20, 0.6)])],
    }
    for arms in per_seed.values():
        with_ratios(arms, budget=10)
    head = learning_headline({"per_seed": per_seed, "aggregate": aggregate(per_seed, budget=10)})
    assert head["figure"] == 20 and head["baseline"] == 10 and head["ratio"] == 2.0
    one_seed = learning_headline({"per_seed": {0: per_seed[0]}})
    assert one_seed["figure"] == 20 and one_seed["baseline"] == 10 and one_seed["ratio"] == 2.0
