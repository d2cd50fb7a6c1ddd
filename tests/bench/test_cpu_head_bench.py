import pytest

from areno.models import logprobs
from bench import cpu_head


def test_both_arms_measure_the_same_head_and_the_switch_comes_back():
    rec = cpu_head.main(
        ["--shape", "cpu5m", "--groups", "2", "--samples", "2", "--prompt-len", "4", "--completion-len", "8"]
        + ["--rounds", "1", "--reps", "1"]
    )
    assert logprobs.CPU_SOFTMAX_FORM is True  # the log-softmax arm's switch is undone
    assert rec["figure"] > 0 and rec["baseline"] > 0 and rec["ratio"] == round(rec["baseline"] / rec["figure"], 3)
    assert rec["tokens"] == 2 * 2 * (4 + 8) and rec["head_tokens"] == 2 * 2 * 8
    assert set(rec["micro_batch_ms"]) == {"softmax", "log_softmax"}
    assert all(v > 0 for v in rec["micro_batch_ms"].values())
    # both forms at fp32 precision against float64
    errors = rec["logprob_error_vs_float64"]
    assert 0 < errors["softmax"] < 1e-5 and 0 < errors["log_softmax"] < 1e-5


def test_a_bad_round_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        cpu_head.main(["--rounds", "0"])
    assert "--rounds and --reps must be at least 1" in capsys.readouterr().err
