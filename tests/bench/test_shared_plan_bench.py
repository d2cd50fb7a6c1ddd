import pytest

from bench import shared_plan


def test_the_rows_plan_keeps_groups_whole_and_runs_fewer_rows():
    rec = shared_plan.main(
        ["--device", "cpu", "--shape", "cpu5m", "--groups", "3", "--samples", "4", "--prompt-len", "8"]
        + ["--completion-len", "40", "--min-completion-len", "4", "--max-tokens-per-mb", "120"]
        + ["--rounds", "1", "--reps", "1"]
    )
    assert rec["figure"] > 0 and rec["baseline"] > 0 and rec["ratio"] == round(rec["baseline"] / rec["figure"], 3)
    rows, tokens = rec["arms"]["rows"], rec["arms"]["tokens"]
    # 3 groups of 4 x 8 + 4 + 16 + 28 + 40 = 120 tokens: one whole group a micro-batch, where by length
    # first-fit-decreasing mixes the groups (each prompt in more than one micro-batch)
    assert rows["micro_batch_tokens"] == [120, 120, 120] and rows["rows"] == rec["ideal_rows"] == 3 * (8 + 88)
    assert sum(tokens["micro_batch_tokens"]) == rec["tokens"] == 360 and tokens["rows"] > rows["rows"]
    assert all(n <= 120 for n in tokens["micro_batch_tokens"])
    assert rec["batch"] == "3 x 4 x (8 + 4-40)"


def test_a_min_completion_length_beyond_the_length_is_refused(capsys):
    with pytest.raises(SystemExit):
        shared_plan.main(["--completion-len", "8", "--min-completion-len", "9"])
    assert "--min-completion-len must be between 1 and --completion-len" in capsys.readouterr().err
