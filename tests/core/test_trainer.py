"""The SDK topology and the outer loop, end to end on a tiny CPU model."""

import json
import os

import pytest
import torch

from areno.api.backend.base import BACKENDS, RolloutBatch, register_backend, resolve_backend
from areno.api.config import load_config
from areno.api.pipeline import run_pipeline
from areno.api.trainer import PASS_SEED_STRIDE, Trainer, pass_seed, reshuffle
from areno.observe import session
from areno.observe.trace import CLOCK_ENV_VAR, ENV_VAR, tracing_enabled
from areno.types import TokenBatch, Trajectory
from tests.helpers.configs import run_to_end, tiny_grpo_overrides


def test_backend_registry():
    from areno.api.backend.areno.backend import ArenoBackend

    assert resolve_backend("areno") is ArenoBackend
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; registered backends: \['areno'"):
        resolve_backend("nope")

    @register_backend("test-dummy")
    class Dummy(ArenoBackend):
        pass

    try:
        assert resolve_backend("test-dummy") is Dummy
        with pytest.raises(ValueError, match="already registered"):
            register_backend("test-dummy")(ArenoBackend)
    finally:
        BACKENDS.pop("test-dummy")


def test_pass_seed_formula():
    assert PASS_SEED_STRIDE == 100003
    assert pass_seed(7, 5, 0) == 12
    assert pass_seed(7, 5, 2) == 7 + 5 + 2 * 100003


def test_reshuffle_is_a_seeded_permutation():
    trajs = [
        Trajectory(
            prompt_ids=[1, i],
            completion_ids=[i + 2] * (i + 1),
            logprobs=[0.0] * (i + 1),
            versions=[0] * (i + 1),
            reward=float(i),
        )
        for i in range(6)
    ]
    rollout = RolloutBatch(trajectories=trajs, batch=TokenBatch.from_trajectories(trajs))
    a, b = reshuffle(rollout, 123), reshuffle(rollout, 123)
    assert [t.reward for t in a.trajectories] == [t.reward for t in b.trajectories]
    assert sorted(t.reward for t in a.trajectories) == list(range(6))
    assert a.batch.rewards_B.tolist() == [t.reward for t in a.trajectories]
    assert [t.reward for t in reshuffle(rollout, 124).trajectories] != [t.reward for t in a.trajectories]
    torch.testing.assert_close(a.batch.input_ids_T, TokenBatch.from_trajectories(a.trajectories).input_ids_T)
    # a later pass names its order relative to the rollout as generated (composed when reshuffled again)
    assert rollout.pass_order is None
    assert [trajs[i].reward for i in a.pass_order] == [t.reward for t in a.trajectories]
    c = reshuffle(a, 5)
    assert [trajs[i].reward for i in c.pass_order] == [t.reward for t in c.trajectories]


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            *tiny_grpo_overrides(tmp_path),
            *extra,
        ],
    )


def test_grpo_reward_goes_up(tmp_path):
    cfg = _config(
        tmp_path,
        "reward.fn=tests.helpers.rewards:sevens",
        "reward.sandbox=false",
        "optim.lr=0.02",
        "train.steps=12",
        "train.eval_interval=0",
        "train.seed=1",
        "observe.trace=true",
        "observe.sessions=true",
    )
    rows = run_to_end(cfg)
    # the run's tracing and session recording ended with it: nothing started afterwards writes into its directory
    assert not tracing_enabled() and ENV_VAR not in os.environ and CLOCK_ENV_VAR not in os.environ
    assert session.session() is session._NULL_SESSION and session.ENV_VAR not in os.environ
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    # run directory: resolved config, metrics with the documented keys, an HF checkpoint at the end
    assert (tmp_path / "run" / "config.yaml").exists()
    step_rows = [r for r in rows if "rollout/reward_mean" in r]
    for key in (
        "train/policy/loss",
        "train/policy/actor/clip_frac",
        "train/policy/actor/approx_kl",
        "timing/rollout_s",
        "timing/train_s",
        "timing/sync_s",
        "rollout/num_tokens",
    ):
        assert key in step_rows[-1], key
    assert any("policy_sync_time_s" in r for r in rows)
    assert (tmp_path / "run" / "checkpoints" / "step_00000012" / "COMPLETE").exists()
    assert (tmp_path / "run" / "checkpoints" / "step_00000012" / "hf" / "model.safetensors").exists()
    # performance trace: spans from the loop, the rollout engine and the training backend
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    names = {e["name"] for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)}
    assert {
        "rollout",
        "train",
        "policy_sync",
        "checkpoint",
        "rollout_request",
        "engine_step",
        "micro_batch",
        "backward",
        "optimizer_step",
    } <= names


def test_pipeline_warm_start_and_export_loads_in_transformers(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    cfg = _config(tmp_path, "warm_start.steps=2", "warm_start.batch_size=8", "train.steps=2", "observe.console=true")
    summary = run_pipeline(cfg)
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None
    # the console names the warm start's steps and shows each step's loss (GRPO's: reward and length)
    steps = [line.split(" | ") for line in capsys.readouterr().err.splitlines() if " | " in line]
    assert [fields[0] for fields in steps] == ["warm start step 1/2", "warm start step 2/2", "step 1/2", "step 2/2"]
    assert all(fields[1].startswith("loss ") for fields in steps[:2]), steps
    assert all(fields[1].startswith("reward ") and fields[2].startswith("len ") for fields in steps[2:]), steps
    assert [fields[-1] for fields in steps if fields[-1].startswith("eta")] == ["eta 00:00", "eta 00:00"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "warm_start" / "final_model")
    assert model.config.num_hidden_layers == 1
    assert (tmp_path / "run" / "curve.png").stat().st_size > 1000


def test_reward_that_raises_is_counted_not_fatal(tmp_path, caplog):
    cfg = _config(
        tmp_path,
        "reward.fn=tests.helpers.rewards:exploding",
        "reward.workers=1",
        "train.steps=1",
        "train.eval_interval=0",
    )
    trainer = Trainer.init(cfg)
    try:
        rollout = trainer.rollout_token_batch(0)
        evaluation = trainer.backend.evaluate()  # the same policy holds for held-out evaluation
    finally:
        trainer.shutdown()
    assert evaluation["eval/accuracy"] == 0.0
    assert rollout.metrics["rollout/reward_errors"] == 32
    assert rollout.metrics["rollout/reward_failures_error"] == 32  # counted by the run's own reward sandbox
    assert rollout.metrics["rollout/reward_mean"] == 0.0
    assert "reward bug" in caplog.text


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.init_tiny=null", "model.path: directory"),
        ("train.algorithm=grpoo", "grpo"),
        ("reward.fn=areno.rewards.tasks:nope", "reward.fn"),
    ],
)
def test_bad_input_is_one_line(tmp_path, override, message):
    cfg = _config(tmp_path, override)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")) as info:
        Trainer.init(cfg)
    assert "\n" not in str(info.value)


def test_cli_exit_codes(tmp_path, capsys):
    from areno.cli import main

    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "grpo" in out and "sft" in out
    assert main(["recipes", "ppo"]) == 0
    out = capsys.readouterr().out
    assert "  options (train.algorithm_kwargs.KEY): gamma=1.0, gae_lambda=0.95, value_clip_eps=0.2" in out
    assert main(["recipes", "opd"]) == 0
    assert "teacher_path=<path>" in capsys.readouterr().out


def test_demo_config_first_step_runs(tmp_path):
    """areno/configs/demo.yaml as shipped, cut to one warm-start and one GRPO step."""
    from areno.api.pipeline import DEMO_CONFIG

    cfg = load_config(
        DEMO_CONFIG,
        [
            f"run_dir={tmp_path / 'demo'}",
            f"model.path={tmp_path / 'demo' / 'init'}",
            "warm_start.steps=1",
            "train.steps=1",
            "data.num_eval=4",
            "observe.console=false",
        ],
    )
    summary = run_pipeline(cfg)
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-2]["rollout/num_seqs"] == cfg.rollout.batch_size * cfg.rollout.n_samples


def test_unknown_workflow_kwarg_is_one_line(tmp_path):
    cfg = _config(tmp_path, "rollout.workflow_kwargs={max_turnz: 3}")
    with pytest.raises(
        ValueError, match=r"^rollout.workflow_kwargs.max_turnz: workflow 'areno.workflows.rlvr:RLVRWorkflow' takes no"
    ) as info:
        Trainer.init(cfg)
    assert "\n" not in str(info.value)


def test_areno_train_algorithm_flag_selects_the_algorithm(tmp_path, capsys):
    """In this process: ``python -m areno``'s exit code from a fresh interpreter is
    tests/core/test_errors.py's test_unknown_recipe_fails_before_the_warm_start."""
    from areno.cli import main

    assert main(["train", "--algorithm", "grpoo", f"model.path={tmp_path}"]) == 2
    assert "unknown recipe 'grpoo': did you mean grpo" in capsys.readouterr().err


def test_long_sequences_error_or_truncate_from_config(tmp_path):
    """train.long_sequences reaches the training backend: `error` names both lengths, `truncate`
    trains and counts the dropped tokens."""
    overrides = ("train.max_tokens_per_mb=6", "train.steps=1", "train.eval_interval=0")
    trainer = Trainer.init(_config(tmp_path, *overrides))
    try:
        rollout = trainer.rollout_token_batch(0)
        with pytest.raises(ValueError, match=r"max_tokens_per_mb=6.*raise max_tokens_per_mb"):
            trainer.train(0, rollout)
    finally:
        trainer.shutdown()
    trainer = Trainer.init(
        _config(tmp_path, *overrides, "train.long_sequences=truncate", "run_dir=" + str(tmp_path / "t"))
    )
    try:
        metrics = trainer.train(0, trainer.rollout_token_batch(0))
    finally:
        trainer.shutdown()
    truncated = [v for k, v in metrics.items() if k.endswith("truncated_tokens")]
    assert truncated and truncated[0] > 0, metrics


def test_workflow_store_is_the_engines_and_trained_observations_are_freed(tmp_path):
    cfg = _config(
        tmp_path, "rollout.workflow=tests.helpers.workflows:StoringWorkflow", "train.steps=1", "train.eval_interval=0"
    )
    trainer = Trainer.init(cfg)
    try:
        engine = trainer.backend.engine
        rollout = trainer.rollout_token_batch(0)
        assert rollout.trajectories[0].info["observation"].fetch(engine.store).shape == (16, 1024)
        assert len(engine.store) == 4  # one per prompt, shared by its group
        trainer.train(0, rollout)
        assert len(engine.store) == 0
    finally:
        trainer.shutdown()


def test_two_passes_decoupled_clip_acts(tmp_path):
    """train.num_train_passes=2 with grpo_async: one pi_prox forward per rollout, and the second
    pass's ratio pi_theta / pi_prox moves off 1 (the clip can act), as in PPO's epochs."""
    cfg = _config(
        tmp_path,
        "reward.fn=tests.helpers.rewards:first_char",
        "reward.sandbox=false",
        "optim.lr=0.05",
        "train.steps=2",
        "train.eval_interval=0",
        "train.algorithm=grpo_async",
        "train.num_train_passes=2",
        "rollout.temperature=1.5",
    )
    trainer = Trainer.init(cfg)
    engine = trainer.backend.engine
    backend = engine.training.runner.backends["policy"]
    calls = []
    real = backend.forward_only
    backend.forward_only = lambda batch, **kw: calls.append(batch.num_seqs) or real(batch, **kw)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    assert len(calls) == 2  # one per rollout, not per pass
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "train/policy/loss" in r]
    assert len(step_rows) == 2
    # logged metrics are the last (second) pass's: its importance ratio is no longer exactly 1
    assert any(r["train/policy/actor/approx_kl"] != 0.0 and r["train/policy/actor/clip_frac"] > 0 for r in step_rows), (
        step_rows
    )
    # walk18: the policy sync's figures ride with the next step's first pass; keeping only the last pass's
    # metrics dropped them from every row of a run with several passes
    assert "policy_sync_time_s" in step_rows[1] and "policy_sync_bytes" in step_rows[1]


def test_an_offline_recipe_syncs_the_policy_before_each_evaluation_only(tmp_path):
    """SFT trains on a dataset: the rollout side only evaluates, so the policy goes there before an
    evaluation instead of after every step, and that evaluation sees the weights trained so far."""
    overrides = [
        *tiny_grpo_overrides(tmp_path),
        "train.algorithm=sft",
        "train.steps=5",
        "train.eval_interval=2",
        "train.save_interval=0",
    ]
    trainer = Trainer.init(load_config(None, overrides))
    try:
        engine = trainer.backend.engine
        synced = []
        real = engine.rollout.update_weights
        engine.rollout.update_weights = lambda update: synced.append(update.version) or real(update)
        trainer.run()
        assert synced == [2, 4, 5]  # evaluations after steps 2, 4 and the last
        assert engine.version == 5 == engine.rollout.version
        trained = dict(engine.training.runner.backends["policy"].model.named_parameters())
        served = dict(engine.rollout.engine.model.named_parameters())
        name = next(n for n in served if n.endswith("mlp.down_proj.weight"))
        torch.testing.assert_close(served[name], trained[name].detach().to(served[name].dtype))
        engine.update_weights()  # a sixth update: behind again until an evaluation
        assert synced == [2, 4, 5] and engine.version == 6
        trainer.evaluate_now()
        assert synced == [2, 4, 5, 6]
    finally:
        trainer.shutdown()
