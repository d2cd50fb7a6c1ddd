"""bench/reward_model.py: its help, and a tiny CPU run of both arms on one batch."""

from __future__ import annotations

import pytest

from bench import reward_model
from bench._common import HEADLINE_KEYS


def test_help_names_the_module_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        reward_model.main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m bench.reward_model")


def test_a_tiny_cpu_run_times_both_arms_on_one_batch(capsys):
    result = reward_model.main(
        [
            "--hidden",
            "32",
            "--layers",
            "1",
            "--prompts",
            "2",
            "--samples",
            "2",
            "--max-new-tokens",
            "4",
            "--rounds",
            "2",
        ]
    )
    assert set(HEADLINE_KEYS) <= set(result)
    assert len(result["times_s"]["with"]) == len(result["times_s"]["without"]) == 2
    assert result["figure"] > 0 and result["baseline"] > 0 and result["seqs"] == 4
    assert result["ratio"] == pytest.approx(result["figure"] / result["baseline"], rel=1e-2)
