"""An offline recipe (sft) refuses the rollout settings it never reads when they are set away from their
defaults, while the warm start, an sft stage derived from an RL config that sets them, still runs; rows
whose answer is null are refused at preflight for sft and for an answer-scoring RL reward alike."""

from __future__ import annotations

import json

import pytest

from areno.api.config import load_config
from areno.api.pipeline import warm_start_config
from areno.api.preflight import check_run
from areno.engine.config import offline_unused_rollout_keys
from areno.errors import ConfigError, DataError
from tests.helpers.configs import TINY


def _config(tmp_path, *extra: str):
    """A tiny sft run on the CPU whose model is made at start-up, every rollout key at its default."""
    return load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            TINY,
            "data.task=arithmetic",
            "data.num_eval=4",
            "rollout.batch_size=2",
            "cluster.device=cpu",
            "train.algorithm=sft",
            *extra,
        ],
    )


@pytest.mark.parametrize(
    "setting",
    [
        "rollout.n_samples=16",
        "rollout.temperature=0.5",
        "rollout.top_p=0.9",
        "rollout.max_head_offpolicyness=1",
        "rollout.workflow_kwargs={max_turns: 2}",
        "rollout.max_retries=3",
    ],
)
def test_sft_refuses_rollout_settings_that_do_nothing(tmp_path, setting):
    key = setting.split("=")[0]
    with pytest.raises(ConfigError) as info:
        check_run(_config(tmp_path, setting))
    assert str(info.value).startswith(f"{key}: train.algorithm=sft trains offline on the dataset's rows")
    assert str(info.value).endswith("the setting does nothing here: drop it")
    assert not (tmp_path / "model").exists()  # before the model is made


def test_sft_keeps_the_settings_its_evaluation_samples_with(tmp_path):
    check_run(_config(tmp_path))  # the defaults, and the batch and generation length it reads
    check_run(_config(tmp_path, "rollout.batch_size=4", "rollout.max_new_tokens=8"))
    # sampled evaluations take the rollout's sampling: temperature unless eval_temperature replaces it
    check_run(_config(tmp_path, "train.eval_samples=4", "rollout.temperature=0.5", "rollout.top_p=0.9"))
    check_run(_config(tmp_path, "train.eval_temperature=0.7", "rollout.top_k=5"))
    with pytest.raises(ConfigError, match=r"^rollout.temperature: "):
        check_run(_config(tmp_path, "train.eval_temperature=0.7", "rollout.temperature=0.5"))


def test_an_rl_run_keeps_them():
    cfg = load_config(None, ["model.path=/m", "rollout.n_samples=16", "rollout.temperature=0.5"])
    assert (cfg.rollout.n_samples, cfg.rollout.temperature) == (16, 0.5)  # no refusal at load


def test_the_warm_start_of_an_rl_config_that_sets_them_is_not_refused(tmp_path):
    rl = [
        "train.algorithm=grpo",
        "rollout.n_samples=4",
        "rollout.temperature=0.8",
        "rollout.max_head_offpolicyness=1",
        "rollout.max_retries=3",
        "warm_start.steps=2",
    ]
    cfg = _config(tmp_path, *rl)
    check_run(cfg)  # the main stage: an online recipe reads them
    sft = warm_start_config(cfg)
    assert sft.train.algorithm == "sft"
    assert (sft.rollout.n_samples, sft.rollout.temperature, sft.rollout.max_retries) == (8, 1.0, 1)
    assert sft.rollout.batch_size == cfg.warm_start.batch_size
    check_run(sft)
    # the keys reset are only those an offline run never reads: a sampled evaluation keeps its temperature
    sampled = warm_start_config(_config(tmp_path, *rl, "train.eval_samples=4"))
    assert "temperature" not in offline_unused_rollout_keys(sampled) and sampled.rollout.temperature == 0.8
    check_run(sampled)
    # no held-out rows (num_eval=0): the warm start generates nothing, so no engine setting carries over
    engine = ["rollout.max_new_tokens=16", "rollout.block_size=8"]
    quiet = warm_start_config(_config(tmp_path, *rl, *engine, "data.num_eval=0"))
    assert (quiet.rollout.max_new_tokens, quiet.rollout.block_size) == (32, 16)
    check_run(quiet)
    with pytest.raises(ConfigError, match=r"^rollout.block_size: train.algorithm=sft .* generates nothing"):
        check_run(_config(tmp_path, *engine, "data.num_eval=0"))


@pytest.mark.parametrize(
    "algorithm, extra",
    [("sft", []), ("grpo", ["reward.fn=areno.rewards.tasks:exact_match", "rollout.n_samples=2"])],
)
def test_a_null_answer_is_refused_at_preflight(tmp_path, algorithm, extra):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2=", "answer": None})
    )
    cfg = _config(tmp_path, f"train.algorithm={algorithm}", "data.task=null", f"data.train_path={rows}", *extra)
    with pytest.raises(DataError, match=rf"^{rows} line 2: 'answer' is null: give the row its reference answer"):
        check_run(cfg)
