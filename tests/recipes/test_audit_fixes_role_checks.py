"""Roles with checkpoints of their own, checked at preflight in one line before any model is made: a
scorer role (a user's recipe) without the ``head_path`` its head is read from; a teacher whose
vocabulary cannot be the policy's (it scores the policy's token ids with the policy's tokenizer, so
its directory needs no tokenizer, but then its vocab_size must match)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.data.tokenizer import build_char_tokenizer
from areno.errors import ConfigError
from areno.models.hf_io import init_model_dir, tiny_config
from areno.recipes import DataSync, ModelRole, TrainingConfig, recipe
from areno.specializations import AggrevateSpecialization, ScalarScorerSpecialization
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.recipes import user_code_dir

TINY = {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    with user_code_dir(tmp_path, monkeypatch) as path:
        yield path


@pytest.mark.parametrize(
    "head, what",
    [
        ("value_head", "an areno critic checkpoint, a PPO run's checkpoints/step_N/<critic role>"),
        ("reward_model", "a transformers sequence-classification directory (AutoModelForSequenceClassification"),
    ],
)
def test_a_users_scorer_role_without_head_path_is_one_line_at_preflight(user_dir, head, what):
    @recipe("my_scorer")
    def my_scorer() -> TrainingConfig:
        """AggreVaTe with Q from a scorer whose head_path the user forgot."""
        policy = ModelRole(
            name="policy",
            specialization_cls=AggrevateSpecialization,
            sync_to_rollout=True,
            init_kwargs={"q_source": head},
        )
        scorer = ModelRole(
            name="value", specialization_cls=ScalarScorerSpecialization, trainable=False, init_kwargs={"head": head}
        )
        sync = DataSync(source="value", target="policy", keys=("q_T",), target_keys=("teacher_q_T",))
        return TrainingConfig(name="my_scorer", roles=(policy, scorer), syncs=(sync,))

    with pytest.raises(ConfigError) as info:  # before: a raw TypeError (value_head) or an error after the model
        check_run(load_config(None, [*tiny_run_overrides(user_dir), "train.algorithm=my_scorer"]))
    said = str(info.value)
    assert said.startswith(
        f"role 'value' (ScalarScorerSpecialization, head={head}) has no head_path, the checkpoint its head is read "
        f"from: set the role's init_kwargs.head_path to {what}"
    )
    assert "\n" not in said
    assert not (user_dir / "model").exists()


def _teacher(root: Path, name: str, *, vocab_size: int | None = None, keep: tuple[str, ...] = (), tokenizer=None):
    """A tiny teacher checkpoint of the character tokenizer (``vocab_size`` rows of embeddings), with only
    the tokenizer files in ``keep``."""
    tok = tokenizer or build_char_tokenizer()
    path = init_model_dir(root / name, tiny_config(vocab_size or len(tok), **TINY), tok, seed=7)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if file not in keep:
            (path / file).unlink(missing_ok=True)
    return path


def _opd(tmp_path: Path, teacher: Path) -> list[str]:
    return [*tiny_run_overrides(tmp_path), "train.algorithm=opd", f"train.algorithm_kwargs={{teacher_path: {teacher}}}"]


def test_a_teacher_without_tokenizer_files_needs_the_policys_vocab_size(tmp_path, caplog):
    vocab = len(build_char_tokenizer())
    bigger = _teacher(tmp_path, "bigger", vocab_size=vocab + 64)
    with pytest.raises(ConfigError) as info:  # before: accepted here, refused once the models were made
        check_run(load_config(None, _opd(tmp_path, bigger)))
    assert str(info.value) == (
        f"train.algorithm_kwargs.teacher_path: {bigger} has no tokenizer and its vocab_size {vocab + 64} differs "
        f"from the policy's {vocab}; role 'teacher' scores the policy's token ids: copy its model's tokenizer files "
        "there (its vocabulary is then compared with the policy's), or give it a checkpoint with the policy's "
        "vocabulary"
    )
    assert not (tmp_path / "model").exists()
    json_only = _teacher(tmp_path, "json_only", vocab_size=vocab + 64, keep=("tokenizer.json",))
    with pytest.raises(ConfigError, match=f"{json_only} has no tokenizer_config.json and its vocab_size"):
        check_run(load_config(None, _opd(tmp_path, json_only)))
    # the policy's tokenizer is the teacher's by design: a directory without one, of the policy's vocab_size,
    # is accepted and said once
    same = _teacher(tmp_path, "same")
    with caplog.at_level(logging.INFO, logger="areno.api.preflight"):
        check_run(load_config(None, _opd(tmp_path, same)))
        check_run(load_config(None, _opd(tmp_path, same)))
    said = [r.getMessage() for r in caplog.records if "has no tokenizer" in r.getMessage()]
    assert said == [f"role 'teacher': {same} has no tokenizer; it scores the policy's token ids (vocab_size {vocab}, "
                    "as the policy's)"]  # fmt: skip


def test_a_teacher_with_another_tokenizer_is_refused_at_preflight(tmp_path):
    other = build_char_tokenizer(extra_tokens=("<x>",), vocab_padding=0)
    teacher = _teacher(tmp_path, "other", tokenizer=other, keep=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ConfigError) as info:
        check_run(load_config(None, _opd(tmp_path, teacher)))
    assert str(info.value).startswith(
        f"train.algorithm_kwargs.teacher_path: the tokenizer of {teacher} differs from the policy's "
        f"({tmp_path / 'model'}); role 'teacher' scores the policy's token ids"
    )
    assert not (tmp_path / "model").exists()
