from areno.models import attention
from bench import cpu_attention


def test_both_arms_measure_the_same_batch_and_the_bound_comes_back():
    before = attention.CPU_EXPLICIT_MAX_SCORES
    rec = cpu_attention.main(
        ["--shape", "cpu5m", "--groups", "2", "--samples", "2", "--prompt-len", "4", "--completion-len", "8"]
        + ["--rounds", "1", "--reps", "1"]
    )
    assert attention.CPU_EXPLICIT_MAX_SCORES == before  # the flash arm's bound is undone
    assert rec["figure"] > 0 and rec["baseline"] > 0 and rec["ratio"] == round(rec["baseline"] / rec["figure"], 3)
    assert rec["tokens"] == 2 * 2 * (4 + 8)
    assert set(rec["layer_ms"]) == {"explicit", "flash"} and all(v > 0 for v in rec["layer_ms"].values())
    # each arm against float64 within bf16 rounding (bf16 inputs and outputs; the explicit arm's P and dS
    # too), and the arms are two computations
    errors = rec["grad_error_vs_float64"]
    assert 0 < errors["flash"] < 0.02 and 0 < errors["explicit"] < 0.02 and errors["flash"] != errors["explicit"]


def test_a_bad_round_count_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        cpu_attention.main(["--rounds", "0"])
    assert "--rounds and --reps must be at least 1" in capsys.readouterr().err
