"""bench/train.py's variant names: each part selects one lever, an unknown name is refused; its model FLOPs a token."""

import pytest

from areno.models import tiny_config
from areno.models.config import ModelConfig
from bench.train import flops_per_token, make_batch, parse_variant, train_headline


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


@pytest.mark.parametrize("moe", [False, True])
def test_model_flops_count_the_experts_a_token_reaches(moe):
    hf = {
        "architectures": ["GraniteMoeForCausalLM" if moe else "Qwen2ForCausalLM"],
        "model_type": "granitemoe" if moe else "qwen2",
        "hidden_size": 16,
        "intermediate_size": 6 if moe else 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "vocab_size": 10,
        **({"num_local_experts": 4, "num_experts_per_tok": 2} if moe else {}),
    }
    # per layer: attention 16 x (2 + 2) x 8 + 2 x 8 x 16 = 768; MLP 3 x 16 x 24 = 1,152, or 2 experts of width 6
    # (3 x 16 x 12 = 576) and the router (16 x 4); the head 10 x 16; causal attention 12 x 2 layers x 2 x 8 x mean
    # context (1 + 2 + 3) / 3 = 768
    mlp = 576 + 64 if moe else 1152
    expected = 6 * (2 * 768 + 2 * mlp + 160) + 768
    assert flops_per_token(ModelConfig.from_hf(hf), make_batch([3], 10, 0)) == expected


def test_model_flops_count_a_sliding_layers_window():
    def flops(window):
        cfg = tiny_config(10, hidden_size=16, layers=2, heads=2, kv_heads=1, arch="gemma3", sliding_window=window)
        assert [cfg.layer_window(i) for i in range(2)] == [window, None]
        return flops_per_token(cfg, make_batch([3], 10, 0)), cfg.head_dim

    # layer 0's tokens see 1, 2, 2 keys in a 2-key window against 1, 2, 3: a third of a key fewer on average
    (windowed, dh), (unbounded, _) = flops(2), flops(16)
    assert unbounded - windowed == pytest.approx(3 * 4 * 2 * dh / 3)
