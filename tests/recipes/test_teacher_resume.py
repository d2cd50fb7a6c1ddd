"""A teacher workflow's own random draws (which completions the teacher generates, which action it
measures) come from the episode's seed, the sample's place in the data order: a resumed run draws
what the uninterrupted one drew. They came from a count of how often the workflow had seen the
prompt, which a new process starts at 0, so a run past one epoch trained differently after a resume."""

from __future__ import annotations

import json

import pytest

from areno.api.config import load_config
from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config
from tests.helpers.configs import run_to_end, tiny_run_overrides

ROWS = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+4=", "answer": "7"}]
SHAPE = {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}
CASES = {
    "mixed_loss_dagger_opd": [
        "rollout.workflow=areno.workflows.teacher:TeacherMixtureWorkflow",
        "rollout.workflow_kwargs={beta: 0.5}",
        "train.algorithm_kwargs.beta_decay_steps=4",
    ],
    "aggrevate": [
        "rollout.workflow=areno.workflows.teacher:TeacherQWorkflow",
        "train.algorithm_kwargs.q_source=workflow",
    ],
}


def _losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["train/policy/loss"] for r in rows if "train/policy/loss" in r}


@pytest.mark.parametrize("name", ["mixed_loss_dagger_opd", pytest.param("aggrevate", marks=pytest.mark.slow)])
def test_a_teacher_recipe_resumed_past_an_epoch_trains_like_the_uninterrupted_run(tmp_path, name):
    tok = build_char_tokenizer()
    teacher = init_model_dir(tmp_path / "teacher", tiny_config(len(tok), **SHAPE), tok, seed=7)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))  # 3 prompts: every step after the first repeats
    base = [
        *tiny_run_overrides(tmp_path, num_eval=0),
        f"train.algorithm={name}",
        f"train.algorithm_kwargs.teacher_path={teacher}",
        *CASES[name],
        "data.task=null",
        f"data.train_path={data}",
        "reward.sandbox=false",
        "train.eval_interval=0",
        "train.save_interval=2",
        "resume=auto",
    ]

    def run(run_name: str, steps: int) -> dict[int, float]:
        return _losses(run_to_end(load_config(None, [*base, f"run_dir={tmp_path / run_name}", f"train.steps={steps}"])))

    straight = run("straight", 4)
    run("resumed", 2)
    resumed = run("resumed", 4)  # a new Trainer from step 2's checkpoint
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4]
    assert resumed == straight
