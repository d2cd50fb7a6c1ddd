"""bench/train.py's variant names: each part selects one lever, an unknown name is refused."""

import pytest

from bench.train import parse_variant, train_headline


def test_variant_parts_select_levers():
    assert parse_variant("eager") == (False, "flex", "layers")
    assert parse_variant("compile+varlen") == (True, "varlen", "layers")
    assert parse_variant("compilemodel+varlen") == (True, "varlen", "model")


@pytest.mark.parametrize("name", ["fast", "compile+sdpa", "compile+varlen+flex", "compile+nohostopts"])
def test_unknown_variant_is_refused(name):
    with pytest.raises(ValueError, match="--variants"):
        parse_variant(name)


def test_gpu_headline_is_mfu_against_the_matmul_rate_measured_in_the_run():
    runs = [
        {"model": "m", "variant": "compile", "error": "boom"},
        {"model": "m", "variant": "eager", "backend": "fsdp2", "tokens_per_s": 100, "model_tflops_per_s": 200.0},
    ]
    head = train_headline({"matmul_bf16_tflops_measured": 800.0, "runs": runs})
    assert head["figure"] == 200.0 and head["baseline"] == 800.0 and head["ratio"] == 0.25
    assert "eager" in head["metric"]
