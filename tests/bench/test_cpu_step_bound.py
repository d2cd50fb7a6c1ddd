"""``bench/cpu_step_bound.py`` runs end to end on CPU (few prompts and tokens) and its figures add up:
the floor is the sum of its parts, the GEMM part the sum of the step's GEMMs, the ratios follow."""

import json

import pytest

from bench import cpu_step_bound


def test_floor_breakdown_and_ratios(capsys):
    cpu_step_bound.main(
        [
            "--threads",
            "1",
            "--prompts",
            "3",
            "--new-tokens",
            "8",
            "--prompt-len",
            "4",
            "9",
            "--profile-steps",
            "4",
            "--reps",
            "2",
        ]
    )
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(r["gemm_floor_ms"]) == {"qkv", "o_proj", "gate_up", "down_proj", "lm_head"}
    assert all(v > 0 for v in r["gemm_floor_ms"].values())
    assert r["floor_parts_ms"]["gemm"] == pytest.approx(sum(r["gemm_floor_ms"].values()), abs=0.01)
    assert all(v > 0 for v in r["floor_parts_ms"].values())
    assert r["floor_ms"] == pytest.approx(sum(r["floor_parts_ms"].values()), abs=0.02)
    assert r["speedup_at_floor"] == pytest.approx(r["generate_step_ms"] / r["floor_ms"], rel=0.02)
    assert r["gemm_sequence_ms"] > 0
    assert r["sequence_floor_ms"] == pytest.approx(
        r["gemm_sequence_ms"] + r["floor_parts_ms"]["head_sampling"] + r["floor_parts_ms"]["attention_kv_read"],
        abs=0.02,
    )
    assert r["speedup_at_sequence_floor"] == pytest.approx(r["generate_step_ms"] / r["sequence_floor_ms"], rel=0.02)
    assert r["target_ms"] == pytest.approx(r["generate_step_ms"] / 3, abs=0.01)
    prof = r["engine_profile_ms"]
    assert prof["gemm"] > 0 and prof["attention"] > 0 and prof["wall"] > prof["gemm"]
    assert 4 < r["mean_context"] < 9 + 8  # prompts of 4-9 tokens plus half the 8 new ones


def test_too_many_profile_steps_is_one_line(capsys):
    with pytest.raises(SystemExit):
        cpu_step_bound.main(["--prompts", "2", "--new-tokens", "8", "--profile-steps", "6"])
    assert "--profile-steps must be at most --new-tokens - 3 (5), got 6" in capsys.readouterr().err
