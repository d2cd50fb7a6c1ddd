"""What a resumed run does with the settings it was given: a new ``optim`` section takes effect at the
schedule's position of the checkpoint's step; ``config.yaml`` keeps the previous one aside only when a
setting changed; a run with no step left to train says so (or, asked to stop before its checkpoint,
refuses); TensorBoard shows each step once; a run with no checkpoint yet says it starts over."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer, truncate_metrics
from areno.engine.config import build_train_backend_config
from areno.errors import ConfigError
from areno.observe.metrics import read_metrics
from areno.train.optim import lr_factor
from tests.helpers.configs import run_to_end, tiny_run_overrides
from tests.helpers.tensorboard import read_tensorboard

COSINE = ["optim.schedule=cosine", "optim.warmup_steps=2", "optim.min_lr_ratio=0.1"]


def _config(tmp_path: Path, *extra: str):
    overrides = tiny_run_overrides(tmp_path, num_eval=0)
    return load_config(
        None, [*overrides, "reward.sandbox=false", "train.eval_interval=0", "train.save_interval=2", *COSINE, *extra]
    )


def _lrs(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/policy/lr"] for r in read_metrics(run_dir) if "train/policy/lr" in r}


def test_a_resumed_run_trains_at_its_new_lr_on_the_same_schedule(tmp_path):
    first = run_to_end(_config(tmp_path, "train.steps=3", "observe.tensorboard=true"))
    assert [r["step"] for r in first if "train/policy/lr" in r] == [1, 2, 3]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000003")  # as if killed before its checkpoint
    # resumed from step 2 (step 3 runs again) with a new peak lr, AdamW settings and a longer run
    changed = ["optim.lr=0.005", "optim.weight_decay=0.1", "optim.betas=[0.8, 0.99]", "optim.eps=1e-6"]
    resumed = _config(tmp_path, "train.steps=5", "resume=auto", "observe.tensorboard=true", *changed)
    run_to_end(resumed)
    backend = build_train_backend_config(resumed, role_name="policy", trainable=True)
    lrs = _lrs(Path(resumed.run_dir))
    assert sorted(lrs) == [1, 2, 3, 4, 5]
    # the schedule's shape kept (cosine of 5 steps, warm-up done at step 2), its peak the new lr
    for step in (3, 4, 5):
        assert lrs[step] == pytest.approx(0.005 * lr_factor(step - 1, backend), rel=1e-12), (step, lrs)
    assert lrs[3] != pytest.approx(0.01 * lr_factor(2, backend))  # not the checkpoint's lr
    assert (Path(resumed.run_dir) / "config.until_step_00000002.yaml").is_file()  # settings changed: kept
    # TensorBoard: step 3 of the first run is hidden, the resumed run's is shown, each step once
    seen = read_tensorboard(Path(resumed.run_dir) / "tensorboard")["train/policy/lr"]
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5]
    assert seen[2][1] == pytest.approx(lrs[3])


def test_the_optimizer_takes_the_resumed_runs_settings(tmp_path):
    run_to_end(_config(tmp_path, "train.steps=2"))
    resumed = _config(tmp_path, "train.steps=4", "resume=auto", "optim.lr=0.002", "optim.weight_decay=0.05",
                      "optim.betas=[0.5, 0.9]", "optim.eps=1e-5")  # fmt: skip
    trainer = Trainer.init(resumed)
    try:
        training = trainer.backend.engine.training
        backend = training.runner.backends[training.policy]
        matrices, vectors = backend.optimizer.param_groups  # biases and norm scales: no weight decay
        factor = lr_factor(2, backend.cfg)  # the schedule at the checkpoint's step, over the new run's length
        for group, decay in ((matrices, 0.05), (vectors, 0.0)):
            assert group["lr"] == pytest.approx(0.002 * factor, rel=1e-12)
            assert (group["initial_lr"], group["weight_decay"], tuple(group["betas"]), group["eps"]) == (
                0.002, decay, (0.5, 0.9), 1e-5,
            )  # fmt: skip
        assert backend.scheduler.base_lrs == [0.002] * 2
        assert backend.scheduler.get_last_lr() == [matrices["lr"]] * 2
    finally:
        trainer.shutdown()


def test_unchanged_settings_resume_at_the_checkpoints_lr_exactly(tmp_path):
    run_to_end(_config(tmp_path, "train.steps=4"))
    logged = _lrs(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000004")  # as if killed before its checkpoint
    trainer = Trainer.init(_config(tmp_path, "train.steps=4", "resume=auto"))
    try:
        training = trainer.backend.engine.training
        groups = training.runner.backends[training.policy].optimizer.param_groups
        assert [g["lr"] for g in groups] == [
            logged[3]
        ] * 2  # bit for bit: the lr step 3 trained at in the uninterrupted run
    finally:
        trainer.shutdown()


def test_a_resume_that_changes_nothing_keeps_no_copy_of_config_yaml(tmp_path):
    run_to_end(_config(tmp_path, "train.steps=2"))
    run_dir = Path(_config(tmp_path).run_dir)
    written = (run_dir / "config.yaml").read_text()
    run_to_end(_config(tmp_path, "train.steps=2", "resume=auto"))  # resume false -> auto: not a new setting
    assert sorted(p.name for p in run_dir.glob("config*.yaml")) == ["config.yaml"]
    assert (run_dir / "config.yaml").read_text() == written.replace("resume: false", "resume: auto")


def test_a_resumed_run_with_no_step_left_says_so_or_refuses(tmp_path, capsys):
    run_to_end(_config(tmp_path, "train.steps=3"))
    run_dir = Path(_config(tmp_path).run_dir)
    written = (run_dir / "config.yaml").read_text()
    rows = read_metrics(run_dir)
    capsys.readouterr()
    run_to_end(_config(tmp_path, "train.steps=3", "resume=auto"))  # the run had finished: nothing to do
    out = capsys.readouterr().out
    assert f"areno: {run_dir} already reached train.steps=3" in out and "nothing to train" in out, out
    assert [r["step"] for r in read_metrics(run_dir)] == [r["step"] for r in rows]
    with pytest.raises(ConfigError, match=r"train.steps=2 but the run in .* resumes from step 3 .*above 3"):
        Trainer.init(_config(tmp_path, "train.steps=2", "resume=auto"))
    assert (run_dir / "config.yaml").read_text().replace("resume: auto", "resume: false") == written
    assert not (run_dir / "areno.lock").exists()
    # the step-3 checkpoint lost: a refused resume from step 2 cuts no row of metrics.jsonl
    shutil.rmtree(run_dir / "checkpoints" / "step_00000003")
    with pytest.raises(ConfigError, match=r"train.steps=1 but the run in .* resumes from step 2"):
        Trainer.init(_config(tmp_path, "train.steps=1", "optim.warmup_steps=0", "resume=auto"))
    assert [r["step"] for r in read_metrics(run_dir)] == [r["step"] for r in rows]


def test_resuming_a_run_with_no_checkpoint_says_it_starts_over(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "a": 1}\n')
    with caplog.at_level(logging.INFO, logger="areno.api.trainer"):
        assert truncate_metrics(path, after_step=-1) == 2
    assert "no complete checkpoint: starting over (dropped the 2 rows of" in caplog.text
    assert "after step -1" not in caplog.text


def test_a_lora_resume_that_changes_nothing_warns_of_nothing(tmp_path, caplog):
    lora = ["train.lora.rank=4", "train.lora.target_modules=[q_proj,v_proj]"]
    run_to_end(_config(tmp_path, "train.steps=2", *lora))
    with caplog.at_level(logging.WARNING):
        run_to_end(_config(tmp_path, "train.steps=3", "resume=auto", *lora))
    changed = [r.getMessage() for r in caplog.records if "settings changed" in r.getMessage()]
    assert changed == ["resume: settings changed since the run was saved: train.steps: 2 -> 3"]  # not target_modules


@pytest.mark.slow
def test_a_ppo_run_resumes_with_its_critics_biases_and_norms_decayed_now(tmp_path):
    """The critic's optimizer saved in two groups (matrices, vectors) resumes into one
    (``train.role_optim.critic.decay_biases_and_norms``): the run goes on (it crashed in LambdaLR's
    load_state_dict), the critic's one group at its weight decay."""
    ppo = ["train.algorithm=ppo", "optim.weight_decay=0.1"]
    run_to_end(_config(tmp_path, "train.steps=2", *ppo))
    resumed = _config(
        tmp_path, "train.steps=3", "resume=auto", *ppo, "train.role_optim={critic: {decay_biases_and_norms: true}}"
    )
    rows = run_to_end(resumed)
    assert [r["step"] for r in rows if "train/value/lr" in r] == [1, 2, 3]
    trainer = Trainer.init(_config(tmp_path, "train.steps=4", "resume=auto", *ppo,
                                   "train.role_optim={critic: {decay_biases_and_norms: true}}"))  # fmt: skip
    try:
        training = trainer.backend.engine.training
        (group,) = training.runner.backends["value"].optimizer.param_groups
        assert group["weight_decay"] == 0.1
        assert len(training.runner.backends[training.policy].optimizer.param_groups) == 2
    finally:
        trainer.shutdown()
