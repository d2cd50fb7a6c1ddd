"""``bench.vlm`` at the tiny shape on the CPU: one JSON object whose headline is the engine's tokens/s
against ``generate`` on the same VLM weights and images, greedy tokens identical in float32, the
vision tower run once per group and the group's image prefill reused, and a GRPO step with images."""

import importlib
import json

import pytest

from bench._common import HEADLINE_KEYS


def test_help_names_the_module_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module("bench.vlm").main(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m bench.vlm")


def test_tiny_vlm_rollout_against_generate_and_a_grpo_step(capsys):
    argv = ["--device", "cpu", "--shape", "tiny", "--groups", "2", "--group-size", "3", "--backend", "local"]
    assert importlib.import_module("bench.vlm").main([*argv, "--train-steps", "1"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    assert result["bench"] == "vlm" and all(key in result for key in HEADLINE_KEYS)
    assert result["figure"] > 0 and result["baseline"] > 0 and result["ratio"] > 0
    assert result["greedy_identical_frac"] == 1.0  # same weights, same pixels, float32
    engine = result["engine"]
    assert engine["vision_runs"] == 2  # once per group, not per sample
    # the later samples of a group reuse the first one's prefill (image tokens included)
    assert engine["prefill_tokens"] < engine["prompt_tokens"] / 2
    train = result["train"]
    # every sequence carries its image: 4 patches per merged image token (spatial merge 2)
    assert (
        train["tokens"] > 0
        and train["image_patches"] == 6 * 4 * result["image_tokens_per_prompt"]
        and train["tokens_per_s"] > 0
    )
