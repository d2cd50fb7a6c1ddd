"""``python -m bench.moe``: the expert-layer run and the whole-model run (``--model --tiny`` on CPU):
a checkpoint transformers saved, the engine's greedy tokens equal ``generate``'s, a training step with
the router's balance loss, and the active-parameter count the MFU divides by."""

import json

from areno.models.hf_io import tiny_config
from bench import moe
from bench._common import HEADLINE_KEYS


def _result(capsys) -> dict:
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    assert result["bench"] == "moe" and all(key in result for key in HEADLINE_KEYS)
    return result


def test_expert_layer_grouped_against_naive(capsys):
    assert moe.main(["--shapes", "tiny", "--tokens", "64", "--repeats", "1"]) == 0
    result = _result(capsys)
    assert result["figure"] == result["runs"][0]["grouped_ms"] and result["ratio"] > 0


def test_tiny_model_rollout_against_generate_and_a_training_step(capsys):
    assert moe.main(["--model", "--tiny", "--device", "cpu"]) == 0
    result = _result(capsys)
    rollout, train, w = result["rollout"], result["train"], result["workload"]
    assert result["config"]["architecture"] == "Qwen3MoeForCausalLM" and result["dtype"] == "float32"
    # fp32 on CPU: greedy tokens equal transformers' all the way
    assert rollout["identical_sequences"] == 1.0 and rollout["agree_first_k_tokens"] == 1.0
    assert result["figure"] == rollout["engine_tok_s"] and result["baseline"] == rollout["hf_generate_tok_s"]
    assert result["ratio"] == round(rollout["engine_tok_s"] / rollout["hf_generate_tok_s"], 3)
    assert train["tokens_per_step"] == w["mb_tokens"] * w["mbs_per_step"] and train["tokens_per_s"] > 0
    assert train["router_aux_loss"] > 0 and train["loss"] > 0
    assert train["mfu"] is None and train["peak_flops_used"] is None  # no datasheet peak on CPU
    # per layer: q, o 64x64; k, v 64x32; router 64x8; top-2 experts of 3 matrices 64x64 (embedding not counted)
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 64 * 8 + 2 * 3 * 64 * 64
    assert result["active_params_no_lm_head"] == 2 * per_layer
    assert result["active_params"] == 2 * per_layer + 512 * 64 < result["total_params"]


def test_active_params_of_the_1b_shape():
    cfg = moe.ModelConfig.from_hf(
        {**moe.MODEL_SHAPES["1b"], "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    )
    assert 0.95e9 < cfg.num_params() < 1.05e9
    act = moe.active_params(cfg)
    assert act["active_params"] == act["active_params_no_lm_head"] + 151936 * 1024
    assert 0.25 < act["active_params"] / cfg.num_params() < 0.35  # top-2 of 16 experts plus the head


def test_active_params_count_the_shared_experts_and_dense_layers():
    """Per layer q, o 32 x 32 and k, v 32 x 16; the router a row of 32 per expert; 3 matrices per expert."""
    attn = 2 * 32 * 32 + 2 * 32 * 16
    # Qwen2-MoE: both layers sparse, 4 experts of 32 top 2, a shared expert of 32 and its gate's row
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2, arch="qwen2_moe")
    layer = attn + 4 * 32 + 2 * 3 * 32 * 32 + 3 * 32 * 32 + 32
    assert moe.active_params(cfg) == {
        "active_params": 2 * layer + 100 * 32,
        "active_params_no_lm_head": 2 * layer,
        "lm_head_params": 100 * 32,
    }
    # GLM-4.5: layer 0 a dense MLP of 64, layer 1 8 experts of 16 top 2 beside one shared expert of 16
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2, arch="glm4_moe")
    dense, sparse = attn + 3 * 32 * 64, attn + 8 * 32 + (2 + 1) * 3 * 32 * 16
    assert moe.active_params(cfg)["active_params_no_lm_head"] == dense + sparse
