"""The Trainer from Python: run() again goes on from the step reached, the Trainer's life cycle
(Trainer(cfg), shutdown twice, a call after shutdown), one live Trainer per run directory, the warm
start that only run_pipeline runs, and a config built in Python with relative paths."""

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from areno.api.config import (
    ArenoConfig,
    ClusterSection,
    DataSection,
    ModelSection,
    ObserveSection,
    OptimConfig,
    RewardSection,
    RolloutSection,
    TrainSection,
    WarmStartSection,
    load_config,
)
from areno.api.pipeline import run_pipeline
from areno.api.trainer import Trainer
from areno.errors import ConfigError
from areno.observe.metrics import read_metrics
from tests.helpers.recipes import user_code_dir
from tests.helpers.resume import losses, train_rows

TINY = {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}


def _config(tmp_path: Path, name: str = "run", **sections) -> ArenoConfig:
    """A one-layer model made at start-up, the arithmetic task, 2 prompts x 4 samples, on the CPU, built in Python."""
    kw = {
        "run_dir": str(tmp_path / name),
        "model": ModelSection(path=str(tmp_path / "model"), init_tiny=TINY),
        "data": DataSection(task="arithmetic", num_eval=4),
        "reward": RewardSection(fn="tests.helpers.rewards:sevens_and_length", sandbox=False),
        "rollout": RolloutSection(batch_size=2, n_samples=4, max_new_tokens=4),
        "optim": OptimConfig(lr=0.01),
        "train": TrainSection(steps=2, eval_interval=0, seed=3),
        "cluster": ClusterSection(device="cpu", cpu_threads=1),
        "observe": ObserveSection(console=False),
    }
    return ArenoConfig(**{**kw, **sections})


def _checkpoints(run_dir: str) -> list[str]:
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())


def test_run_again_after_raising_steps_is_one_longer_run(tmp_path, capsys):
    """2 steps, train.steps raised to 4, run() again: the step numbers, losses, grad norms and rewards of
    one 4-step run; each step logged once; the checkpoints labelled with the steps they hold."""
    straight = _config(tmp_path, "straight", train=TrainSection(steps=4, eval_interval=0, seed=3))
    trainer = Trainer.init(straight)
    try:
        trainer.run()
    finally:
        trainer.shutdown()

    cfg = _config(tmp_path, "twice")
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
        assert trainer.start_rollout_id == 2 and _checkpoints(cfg.run_dir) == ["step_00000002"]
        trainer.config.train.steps = 4  # a notebook's "train 2 more"
        trainer.run()
        assert trainer.start_rollout_id == 4
        evaluated = trainer.evaluate_now()  # logged at the step reached, not at 0
    finally:
        trainer.shutdown()

    twice, once = train_rows(Path(cfg.run_dir)), train_rows(Path(straight.run_dir))  # a step twice is an error
    assert sorted(twice) == sorted(once) == [1, 2, 3, 4]
    assert losses(twice) == losses(once)
    assert len({loss for loss, _, _ in losses(once).values()}) == 4  # rewards that vary: losses that say something
    assert [twice[s]["train/policy/step"] for s in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 4.0]
    assert _checkpoints(cfg.run_dir) == ["step_00000002", "step_00000004"]
    # the same weights at step 4
    w_twice = load_file(Path(cfg.run_dir) / "checkpoints" / "step_00000004" / "hf" / "model.safetensors")
    w_once = load_file(Path(straight.run_dir) / "checkpoints" / "step_00000004" / "hf" / "model.safetensors")
    assert w_twice.keys() == w_once.keys() and all(torch.equal(w_twice[k], w_once[k]) for k in w_twice)
    # the run's record says what ran: train.steps=4, and the 2-step config kept beside it
    assert yaml.safe_load((Path(cfg.run_dir) / "config.yaml").read_text())["train"]["steps"] == 4
    kept = Path(cfg.run_dir) / "config.until_step_00000002.yaml"
    assert yaml.safe_load(kept.read_text())["train"]["steps"] == 2
    eval_steps = [r["step"] for r in read_metrics(Path(cfg.run_dir)) if "eval/accuracy" in r]
    assert eval_steps == [2, 4, 4] and evaluated  # each run()'s last step, then evaluate_now at 4


def test_run_again_refuses_what_it_cannot_continue(tmp_path, capsys):
    cfg = _config(tmp_path, train=TrainSection(steps=1, eval_interval=0, seed=3))
    trainer = Trainer(cfg)  # the same as Trainer.init
    try:
        assert trainer.run() is not None
        capsys.readouterr()
        assert trainer.run() == {}  # nothing left to train: said in one line, nothing logged
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and "already trained" in out[0] and "raise config.train.steps" in out[0], out
        assert sorted(train_rows(Path(cfg.run_dir))) == [1]

        cfg.train.steps = 0
        with pytest.raises(ConfigError, match=r"^train\.steps=0 but this Trainer already trained .* to step 1: "):
            trainer.run()
        cfg.train.steps = 2
        cfg.rollout.temperature = 0.5  # the engine's sampling was built with 1.0: refused, not half taken
        with pytest.raises(ConfigError, match=r"^rollout\.temperature: changed to 0\.5 since Trainer\.init \(1\.0\)"):
            trainer.run()
        cfg.rollout.temperature = 1.0
        cfg.rollout.batch_size = "2"  # the construction's check and message
        with pytest.raises(ConfigError, match=r"^rollout\.batch_size: must be an integer, got '2'$"):
            trainer.run()
        cfg.rollout.batch_size = 2
    finally:
        trainer.shutdown()
    trainer.shutdown()  # a second shutdown does nothing
    for call in (trainer.run, trainer.evaluate_now):
        with pytest.raises(RuntimeError, match=r"this Trainer of .* was shut down: make a new one with Trainer\.init"):
            call()


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_run_again_refuses_lengthening_a_decaying_schedule(tmp_path, schedule):
    cfg = _config(tmp_path, train=TrainSection(steps=1, eval_interval=0), optim=OptimConfig(lr=0.01, schedule=schedule))
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
        cfg.train.steps = 3
        with pytest.raises(ConfigError, match=rf"^train\.steps: 1 -> 3, but optim\.schedule={schedule} decays over"):
            trainer.run()
    finally:
        trainer.shutdown()


def test_one_live_trainer_per_run_dir(tmp_path):
    cfg = _config(tmp_path)
    first = Trainer.init(cfg)
    try:
        with pytest.raises(ConfigError, match=r"^run_dir .* in use by another Trainer of this process .*shutdown\(\)"):
            Trainer.init(_config(tmp_path))
    finally:
        first.shutdown()
    second = Trainer.init(dataclasses.replace(_config(tmp_path), resume="auto"))  # free again once shut down
    second.shutdown()


def test_warm_start_is_warned_about_by_trainer_and_run_by_run_pipeline(tmp_path, caplog):
    warm = WarmStartSection(steps=1, batch_size=4)
    with caplog.at_level(logging.WARNING, logger="areno.api.trainer"):
        trainer = Trainer.init(_config(tmp_path, "alone", warm_start=warm))
        trainer.shutdown()
    said = [r.getMessage() for r in caplog.records if "warm_start.steps" in r.getMessage()]
    assert len(said) == 1 and "run_pipeline(config)" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="areno.api.trainer"):
        run_pipeline(_config(tmp_path, "pipeline", warm_start=warm, train=TrainSection(steps=1, eval_interval=0)))
    assert not [r for r in caplog.records if "warm_start.steps" in r.getMessage()]
    assert (tmp_path / "pipeline" / "warm_start" / "final_model" / "COMPLETE").is_file()


def test_trainer_takes_an_arenoconfig(tmp_path):
    for given in ("areno/configs/demo.yaml", Path("areno/configs/demo.yaml"), {"model": {"path": "x"}}):
        with pytest.raises(
            TypeError,
            match=r"^Trainer\.init takes an ArenoConfig, got (the path 'areno/configs/demo\.yaml'|a dict): .*load_config\(path",
        ):
            Trainer.init(given)
    with pytest.raises(TypeError, match=r"^run_pipeline takes an ArenoConfig"):
        run_pipeline("areno/configs/demo.yaml")


RECIPE = """from areno.recipes import get_recipe, recipe


@recipe("python_api_relative")
def grpo_again():
    return get_recipe("grpo")
"""


def test_relative_paths_of_a_python_config_are_saved_absolute(tmp_path, monkeypatch):
    """Relative paths (data, model, run_dir, reward, workflow, recipe) are written absolute in config.yaml,
    so a resume from another directory, which holds files of the same names, trains with the same ones."""
    with user_code_dir(tmp_path, monkeypatch):  # the recipe module imported from here is forgotten after
        here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
        for d, value in ((here, 1.0), (elsewhere, 0.0)):
            d.mkdir()
            (d / "rows.jsonl").write_text(
                "".join(json.dumps({"prompt": f"{i}+1=", "answer": "x"}) + "\n" for i in range(8))
            )
            (d / "my_reward.py").write_text(f"def score(prompt, completion, answer, **row):\n    return {value}\n")
            (d / "my_recipe.py").write_text(RECIPE)
        monkeypatch.chdir(here)
        cfg = _config(
            tmp_path,
            run_dir="runs/rel",
            model=ModelSection(path="model", init_tiny=TINY),
            data=DataSection(task=None, train_path="rows.jsonl", eval_path="./rows.jsonl", num_eval=2),
            reward=RewardSection(fn="my_reward.py:score", sandbox=False),
            rollout=RolloutSection(
                batch_size=2, n_samples=2, max_new_tokens=2, workflow="areno.workflows.rlvr:RLVRWorkflow"
            ),
            train=TrainSection(algorithm="./my_recipe.py:python_api_relative", steps=1, eval_interval=0),
        )
        trainer = Trainer.init(cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
        saved = yaml.safe_load((here / "runs" / "rel" / "config.yaml").read_text())
        assert saved["run_dir"] == str(here / "runs" / "rel") and saved["model"]["path"] == str(here / "model")
        assert saved["data"]["train_path"] == saved["data"]["eval_path"] == str(here / "rows.jsonl")
        assert saved["reward"]["fn"] == f"{here / 'my_reward.py'}:score"
        assert saved["train"]["algorithm"] == f"{here / 'my_recipe.py'}:python_api_relative"
        assert saved["rollout"]["workflow"] == "areno.workflows.rlvr:RLVRWorkflow"  # a module path stays one

        monkeypatch.chdir(elsewhere)
        resumed = load_config(here / "runs" / "rel" / "config.yaml", ["resume=auto", "train.steps=2"])
        trainer = Trainer.init(resumed)
        try:
            assert trainer.start_rollout_id == 1
            trainer.run()
        finally:
            trainer.shutdown()
        rewards = [r["rollout/reward_mean"] for r in train_rows(here / "runs" / "rel").values()]
        assert rewards == [1.0, 1.0]  # here's reward both times, not elsewhere's
        assert not (elsewhere / "runs").exists()


def test_run_again_after_a_run_that_raised_mid_step_is_refused(tmp_path, monkeypatch):
    trainer = Trainer.init(_config(tmp_path))
    try:

        def broken(rollout_id, rollout):
            raise RuntimeError("boom")

        monkeypatch.setattr(trainer.backend, "train", broken)
        with pytest.raises(RuntimeError, match="^boom$"):
            trainer.run()
        with pytest.raises(
            RuntimeError, match=r"^run\(\): this Trainer's last run\(\) stopped with RuntimeError in step 1"
        ):
            trainer.run()
    finally:
        trainer.shutdown()
