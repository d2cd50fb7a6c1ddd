import pytest

from areno.models import attention
from bench import cpu_padding
from bench.e2e import CPU5M

DEFAULT, BLOCK = attention.PAD_CALL_ENTRIES, attention.QUERY_BLOCK


SHAPE = ["--shape", "cpu5m", "--groups", "2", "--samples", "4", "--prompt-len", "4"]
LENGTHS = ["--completion-len", "200", "--min-completion-len", "2"]


def test_the_arms_pad_differently_and_the_setting_comes_back():
    """The arms' layouts, without timing them (a CPU without native bf16 runs the bench's bf16 micro-batch
    ~100x slower than float32: the timed run is the slow test below)."""
    args, model, batch = cpu_padding.setup("cpu_padding", "", SHAPE + LENGTHS)
    attn, qkv = cpu_padding.layer_inputs(model, batch)
    _check_batches(cpu_padding.arm_batches(attn.sharing, qkv[0]))
    assert (attention.QUERY_BLOCK, attention.PAD_CALL_ENTRIES) == (BLOCK, DEFAULT)


@pytest.mark.slow  # about a minute where bf16 GEMMs are emulated (AVX2)
def test_the_bench_times_each_arm_and_the_setting_comes_back():
    rec = cpu_padding.main(SHAPE + LENGTHS + ["--rounds", "1", "--reps", "1"])
    # the other arms' settings are undone
    assert (attention.QUERY_BLOCK, attention.PAD_CALL_ENTRIES) == (BLOCK, DEFAULT)
    assert rec["figure"] > 0 and rec["baseline"] > 0 and rec["ratio"] == round(rec["baseline"] / rec["figure"], 3)
    _check_batches(rec["padded_batches"])
    assert set(rec["blocks_ratio"]) == {"layer_ms", "micro_batch_ms"}
    # the same attention either way: bf16 rounding against float64
    assert all(0 < e < 0.05 for e in rec["grad_error_vs_float64"].values())
    assert "2-200" in rec["metric"]


def _check_batches(batches: dict) -> None:
    # one batch holds all 10 query sequences (2 prompts, 8 rests); by length, several batches hold them,
    # and in the default arm whole or in blocks of QUERY_BLOCK rows, whichever costs less
    assert len(batches["one_batch"]) == 1 and batches["one_batch"][0][0] == 10
    assert len(batches["whole"]) > 1 and sum(b[0] for b in batches["whole"]) == 10
    default_pieces = sum(b[0] for b in batches["default"])
    assert default_pieces == 10 or (default_pieces > 10 and max(b[1] for b in batches["default"]) <= BLOCK)
    # each arm's choice costs no more than the next's (score entries over the heads, and a call a batch)
    heads = CPU5M["num_attention_heads"]
    cost = {arm: sum(n * q * k * heads + DEFAULT for n, q, k in b) for arm, b in batches.items()}
    assert cost["default"] <= cost["whole"] * attention.BLOCKED_ENTRY_COST and cost["whole"] < cost["one_batch"]


def test_a_min_completion_length_beyond_the_length_is_refused(capsys):
    with pytest.raises(SystemExit):
        cpu_padding.main(["--completion-len", "8", "--min-completion-len", "9"])
    assert "--min-completion-len must be between 1 and --completion-len" in capsys.readouterr().err
