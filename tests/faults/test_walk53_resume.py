"""A resume that cannot go on leaves the run as it was: a LoRA run resumed with other adapters is refused naming the
keys before any model loads, and a resume that fails while it starts keeps the run's config.yaml (walk53)."""

from __future__ import annotations

from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.errors import ConfigError
from tests.helpers.configs import run_to_end, tiny_run_overrides

LORA = ["train.lora.rank=4", "train.lora.target_modules=[q_proj,v_proj]"]


def _config(tmp_path: Path, *extra: str):
    overrides = [*tiny_run_overrides(tmp_path, num_eval=0), "reward.sandbox=false", "train.eval_interval=0"]
    return load_config(None, [*overrides, "train.steps=1", *extra])


def test_a_lora_run_resumed_with_other_adapters_or_none_is_refused_naming_them(tmp_path):
    """Before, the checkpoint's adapters met a model of another shape after it had loaded ("tensor ... has shape
    (4, 32) but the model's is (8, 32)", "no tensor ... (or with/without LoRA)"), config.yaml already rewritten."""
    run_to_end(_config(tmp_path, *LORA))
    saved = (tmp_path / "run" / "config.yaml").read_text()
    for changed, said in [
        (["train.lora.rank=8", LORA[1]], "train.lora.rank=4"),
        ([LORA[0], "train.lora.target_modules=[q_proj]"], "train.lora.target_modules=['q_proj', 'v_proj']"),
        ([], "train.lora.rank=4, train.lora.target_modules=['q_proj', 'v_proj']"),  # LoRA left out
    ]:
        with pytest.raises(ConfigError) as info:
            Trainer.init(_config(tmp_path, "train.steps=2", "resume=auto", *changed))
        assert str(info.value) == (
            f"resume: {tmp_path / 'run'} holds a run made with {said}, which a resumed run cannot change: resume "
            "with those, or start over (resume=false overwrite=true) or in another run_dir"
        )
    assert (tmp_path / "run" / "config.yaml").read_text() == saved
    assert not list((tmp_path / "run").glob("config.until_*"))


def test_a_resume_that_fails_while_it_starts_keeps_the_runs_config(tmp_path, monkeypatch):
    """config.yaml was rewritten with the resume's settings before its checkpoint loaded: a resume that then failed
    left the run described by settings it never ran with (the next resume compared against those)."""
    run_to_end(_config(tmp_path))
    saved = (tmp_path / "run" / "config.yaml").read_text()

    def fails(self, path):
        raise OSError(f"cannot read {path}")

    monkeypatch.setattr(Trainer, "_resume", fails)
    with pytest.raises(OSError, match="cannot read"):
        Trainer.init(_config(tmp_path, "train.steps=2", "resume=auto", "optim.lr=0.02"))
    assert (tmp_path / "run" / "config.yaml").read_text() == saved
    assert not list((tmp_path / "run").glob("config.until_*"))
    monkeypatch.undo()  # the same resume, now able to load, goes on and keeps the old settings beside it
    run_to_end(_config(tmp_path, "train.steps=2", "resume=auto", "optim.lr=0.02"))
    assert (tmp_path / "run" / "config.until_step_00000001.yaml").read_text() == saved
