"""``bench/rollout.py`` runs end to end on CPU with its A/B options (few prompts and tokens) and
reports what it measured: every engine run token-identical to the first, ratios to ``generate``."""

import json

import pytest

from areno.models.hf_io import tiny_config
from bench import rollout

KV = 2 * 3 * 2 * 2 * 2 * 8 * 2  # 2 rows x 3 keys (2 and 4 a step) x 2 layers x (K, V) x 2 kv heads x 8 x 2 bytes


def test_decode_roofline_reads_every_weight_but_the_input_embedding():
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2)
    assert not cfg.tie_word_embeddings and cfg.num_params() == 25120
    roof = rollout.decode_roofline(cfg, rows=2, contexts=[2, 4], elt=2, bw=1e6)
    assert roof == {"decode_roofline_tok_s": pytest.approx(2 * 1e6 / ((25120 - 100 * 32) * 2 + KV))}


def test_decode_roofline_of_experts_reads_the_top_k_and_reports_uniform_routing():
    """4 experts of 3 x 32 x 32 a layer, top 2, both layers sparse: the bound reads 2 experts a layer; 2 rows
    routed uniformly reach 4 x (1 - (1 - 2/4)^2) = 3 of them."""
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2, arch="qwen3_moe")
    read = cfg.num_params() - 100 * 32
    expert = 3 * 32 * 32
    roof = rollout.decode_roofline(cfg, rows=2, contexts=[2, 4], elt=2, bw=1e6)
    assert roof["decode_roofline_tok_s"] == pytest.approx(2 * 1e6 / ((read - 2 * 2 * expert) * 2 + KV))
    assert roof["experts_reached_uniform"] == pytest.approx(3)
    assert roof["decode_roofline_uniform_routing_tok_s"] == pytest.approx(2 * 1e6 / ((read - 2 * expert) * 2 + KV))


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


def test_decode_roofline_reads_a_sliding_layers_window():
    """Layer 0 slides over 3 keys (2 cached), layer 1 sees all: contexts of 2 and 4 cached keys read 2 + 2 and 2 + 4."""
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2, arch="gemma3", sliding_window=3)
    assert [cfg.layer_window(i) for i in range(2)] == [3, None]
    kv = 2 * (2 + 3) * 2 * 2 * 8 * 2  # 2 rows x (2 + 3 keys on average) x (K, V) x 2 kv heads x 8 x 2 bytes
    weights = rollout.step_weight_params(cfg) * 2
    roof = rollout.decode_roofline(cfg, rows=2, contexts=[2, 4], elt=2, bw=1e6)
    assert roof["decode_roofline_tok_s"] == pytest.approx(2 * 1e6 / (weights + kv))
