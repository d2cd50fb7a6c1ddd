"""walk6 C13: examples/aggrevate_rm.yaml runs as written once the reward model it names is trained by the
command its header gives (examples/sort_reward_model.yaml on the shipped sort preference pairs), and the
shipped examples and recipe docs speak to users (no "seed 004's ..." of the design documents)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.api.pipeline import run_pipeline

ROOT = Path(__file__).resolve().parents[2]
TINY = "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}"


def test_aggrevate_rm_reads_the_checkpoint_the_reward_model_example_writes(monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name their data files from the repository root
    rm = load_config(ROOT / "examples/sort_reward_model.yaml")
    agg = load_config(ROOT / "examples/aggrevate_rm.yaml")
    written = Path(rm.run_dir) / "checkpoints" / f"step_{rm.train.steps:08d}" / "hf"
    assert Path(agg.train.algorithm_kwargs["reward_model_path"]) == written
    header = (ROOT / "examples/aggrevate_rm.yaml").read_text()
    assert "#   python -m areno.cli train examples/sort_reward_model.yaml" in header
    for path in (rm.data.train_path, rm.data.eval_path):
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        assert rows and all(set(r) == {"prompt", "chosen", "rejected"} and r["chosen"] != r["rejected"] for r in rows)
        assert all(r["chosen"] == "".join(sorted(r["prompt"][5:-1])) for r in rows)  # "sort 314:" -> "134"


def test_the_reward_model_example_then_aggrevate_rm_train(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name their data files from the repository root
    rm = load_config(
        ROOT / "examples/sort_reward_model.yaml",
        [
            f"run_dir={tmp_path / 'rm'}",
            f"model.path={tmp_path / 'rm_model'}",
            TINY,
            "train.steps=2",
            "rollout.batch_size=4",
            "data.num_eval=4",
            "observe.console=false",
        ],
    )
    summary = run_pipeline(rm)
    assert summary["accuracy_after"] is not None
    checkpoint = tmp_path / "rm" / "checkpoints" / "step_00000002" / "hf"
    assert (checkpoint / "config.json").is_file()
    agg = load_config(
        ROOT / "examples/aggrevate_rm.yaml",
        [
            f"run_dir={tmp_path / 'agg'}",
            f"model.path={tmp_path / 'student'}",
            TINY,
            "train.steps=1",
            "rollout.batch_size=2",
            "rollout.n_samples=2",
            "data.num_eval=2",
            "observe.console=false",
            f"train.algorithm_kwargs.reward_model_path={checkpoint}",
        ],
    )
    run_pipeline(agg)
    rows = [json.loads(line) for line in (tmp_path / "agg" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/policy/aggrevate/pg_loss" in r for r in rows)


@pytest.mark.parametrize("path", [*sorted((ROOT / "examples").glob("*.yaml")), ROOT / "docs/recipes.md"])
def test_user_facing_text_has_no_design_document_jargon(path):
    assert "seed 00" not in path.read_text(), path
