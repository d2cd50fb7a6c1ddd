"""``bench/rollout.py`` runs end to end on CPU with its A/B options (few prompts and tokens) and
reports what it measured: every engine run token-identical to the first, ratios to ``generate``."""

import json

from bench import rollout


def test_cpu_ab_options_and_rounds(capsys):
    rollout.main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--prompts",
            "3",
            "--new-tokens",
            "3",
            "--prompt-len",
            "4",
            "9",
            "--compare-cpu-packed-gemm",
            "1",
            "--compare-decode-carry",
            "1",
            "--compare-overlap-round-trips",
            "1",
            "--rounds",
            "2",
        ]
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    labels = list(result["by_run"])
    assert labels == [
        "auto",
        "auto linear-gemm #1",
        "auto packed-gemm #1",
        "auto gather #1",
        "auto carry #1",
        "auto serial #1",  # overlap_round_trips is ignored on CPU: the A/B runs, the same tokens
        "auto overlapped #1",
    ]
    assert all(r["identical_to"] == {"auto": "3/3"} for r in result["by_run"].values())
    assert result["identical_sequences"] == "3/3"  # greedy: the same tokens as generate
    assert len(result["speedup_rounds"]) == 2 and result["speedup_median"] > 0
    assert result["bench"] == "rollout" and result["ratio"] == result["speedup_median"]
    assert result["figure"] == result["engine_tok_s"] and result["baseline"] == result["hf_generate_tok_s"]
