"""Every benchmark of bench/README.md answers ``--help`` and prints one JSON object whose headline holds the
figure, the baseline measured in the same run and their ratio. Tiny CPU runs: seconds each; those that
start worker processes or train are ``slow``."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench._common import HEADLINE_KEYS

ROOT = Path(__file__).resolve().parents[2]
BENCHES = (
    "e2e",
    "rollout",
    "train",
    "sync",
    "async_learning",
    "partitioned",
    "rewards",
    "checkpoint",
    "startup",
    "stream",
    "preference",
    "hostcost",
    "logit_precision",
)


def run(name: str, argv: list[str], capsys) -> dict:
    """``python -m bench.<name> argv`` in this process; its stdout must be one JSON object with the headline."""
    assert importlib.import_module(f"bench.{name}").main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    assert result["bench"] == name and all(key in result for key in HEADLINE_KEYS)
    assert {"commit", "host", "date"} <= set(result)
    return result


@pytest.mark.parametrize("name", BENCHES)
def test_help_names_the_module_command(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"bench.{name}").main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench.{name}")


def test_runs_as_a_module_from_the_repo_root():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.rewards", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m bench.rewards")


def test_rewards_sandbox_against_in_process(capsys):
    result = run(
        "rewards", ["--calls", "20", "--heavy-calls", "2", "--workers", "1", "--rewards", "exact_match"], capsys
    )
    (row,) = result["results"]
    assert result["figure"] == round(row["sandbox_calls_per_s"], 1)
    assert result["baseline"] == round(row["in_process_calls_per_s"], 1) and result["ratio"] > 0


def test_checkpoint_save_against_torch_save(capsys):
    result = run("checkpoint", ["--hidden", "32", "--layers", "1", "--vocab", "128", "--repeats", "1"], capsys)
    best = result["best_of_repeats"]
    assert result["figure"] == round(best["areno_save_s"], 4) and result["baseline"] == round(
        best["baseline_save_s"], 4
    )
    assert result["ratio"] > 0 and best["areno_resume_load_s"] > 0


def test_colocated_sync_against_a_flat_copy(capsys):
    result = run("sync", ["--mode", "gpu-colocated", "--device", "cpu", "--shapes", "tiny", "--iters", "2"], capsys)
    shape = result["shapes"]["tiny"]
    assert result["figure"] == shape["inplace_cast_fp32_to_bf16_ms_median"]
    assert result["baseline"] == shape["raw_flat_copy_same_bytes_ms_median"] and result["ratio"] > 0


@pytest.mark.slow
def test_stream_sync_against_raw_broadcasts(capsys):
    argv = ["--mode", "cpu", "--shapes", "tiny", "--iters", "2", "--repeats", "1", "--bucket-mb", "1"]
    result = run("sync", argv, capsys)
    assert result["figure"] == result["sync_s_median"] and result["baseline"] == result["raw_s_median"]
    assert result["ratio"] == round(result["raw_s_median"] / result["sync_s_median"], 3)


@pytest.mark.slow
def test_train_packed_against_padded(capsys):
    result = run("train", ["--device", "cpu", "--steps", "1", "--warmup", "1"], capsys)
    skew = result["cpu"]["skewed_batch"]
    assert result["figure"] == skew["packed"]["real_tokens_per_s"]
    assert result["baseline"] == skew["padded"]["real_tokens_per_s"] and result["ratio"] == skew["packed_speedup"]


@pytest.mark.slow
def test_async_learning_eta_against_eta0(tmp_path, capsys):
    argv = ["--steps", "2", "--eval-interval", "1", "--arms", "grpo_async:0", "grpo_async:1"]
    argv += ["--workdir", str(tmp_path), "warm_start.steps=2", "warm_start.batch_size=4", "data.num_eval=4"]
    argv += ["rollout.batch_size=2", "rollout.n_samples=2", "model.init_tiny={hidden_size: 32, layers: 1, heads: 2}"]
    result = run("async_learning", argv, capsys)
    ref, other = result["per_seed"]["None"]
    assert result["baseline"] == ref["steps_to_reference_final"]
    assert result["figure"] == other["steps_to_reference_final"] and result["ratio"] == other["steps_ratio_vs_eta0"]


@pytest.mark.slow
def test_partitioned_eta_against_eta0(tmp_path, capsys):
    result = run("partitioned", ["--etas", "0,1", "--steps", "2", "--work-dir", str(tmp_path)], capsys)
    first, last = result["summary"]["0"], result["summary"]["1"]
    assert result["figure"] == last["trained_tokens_per_s_median"] > 0
    assert (
        result["baseline"] == first["trained_tokens_per_s_median"] and result["ratio"] == last["ratio_to_eta0_median"]
    )


@pytest.mark.slow
def test_startup_warm_against_cold(tmp_path, capsys):
    result = run("startup", ["--shape", "tiny", "--device", "cpu", "--workdir", str(tmp_path)], capsys)
    cold, warm = result["runs"]["cold"], result["runs"]["warm"]
    assert result["figure"] == warm["startup_to_first_token_s"] > 0
    assert result["baseline"] == cold["startup_to_first_token_s"] > 0
    assert warm["second_train_s"] > 0 and warm["process_wall_s"] > warm["startup_to_first_token_s"]


@pytest.mark.slow
def test_startup_of_the_demo_config(tmp_path, capsys):
    """``--shape demo``: the demo's config without its warm start; the cold run creates the tiny model."""
    result = run("startup", ["--shape", "demo", "--device", "cpu", "--workdir", str(tmp_path)], capsys)
    warm = result["runs"]["warm"]
    assert result["figure"] == warm["startup_to_first_token_s"] > 0 and warm["second_train_s"] > 0
    assert (tmp_path / "init_model" / "config.json").exists()
    assert not (tmp_path / "run-warm" / "warm_start").exists()


@pytest.mark.slow
def test_preference_against_a_baseline_tree(tmp_path, capsys):
    """The tree against itself as the baseline: both runs train and score their held-out pairs."""
    argv = ["--shape", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--pairs", "4"]
    argv += ["--prompt-len", "8", "--completion-len", "8", "--workdir", str(tmp_path), "--baseline-tree", str(ROOT)]
    result = run("preference", [*argv, "--areno-set", "cluster.cpu_threads=1"], capsys)
    for name in ("areno", "baseline"):
        (one,) = result["runs"][name]
        assert len(one["train_s"]) == 2 and one["final_eval"]["eval/num_pairs"] == 4
    assert result["figure"] > 0 and result["baseline"] > 0 and result["ratio"] > 0


def test_stream_against_unstreamed(capsys):
    result = run("stream", ["--hidden", "32", "--layers", "1", "--concurrent", "3", "--max-tokens", "8",
                            "--rounds", "1", "--threads", "1"], capsys)  # fmt: skip
    assert result["figure"] > 0 and result["baseline"] > 0 and result["ratio"] > 0
    assert 0 < result["first_text_median_s"] and len(result["rounds"]["streamed"]) == 1


def test_host_costs_per_unit_at_two_sizes(capsys):
    result = run("hostcost", ["--cases", "render_prompt,wire", "--repeats", "1"], capsys)
    rows = result["results"]
    assert set(rows) == {"render_prompt", "wire"}
    for row in rows.values():
        assert row["ratio"] == pytest.approx(row["us_per_unit_large"] / row["us_per_unit_small"], rel=0.02)
    worst = max(rows.values(), key=lambda r: r["ratio"])
    assert (result["figure"], result["baseline"], result["ratio"]) == (
        worst["us_per_unit_large"],
        worst["us_per_unit_small"],
        worst["ratio"],
    )


def test_logit_precision_against_bf16_logits(capsys):
    result = run("logit_precision", ["--shape", "tiny", "--device", "cpu", "--prompts", "2", "--prompt-len", "8",
                                     "--completion-len", "6", "--rounds", "1"], capsys)  # fmt: skip
    rounds = result["rounds"]
    assert set(rounds) == {"bf16", "fp32"} and all(len(v) == 1 for v in rounds.values())
    assert (
        result["figure"] == rounds["fp32"][0]["abs_diff_mean"]
        and result["baseline"] == rounds["bf16"][0]["abs_diff_mean"]
    )
    assert result["tokens_per_round"] == 12
