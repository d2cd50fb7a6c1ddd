"""Frozen scalar-head scorers. ``ScalarScorerSpecialization``: per-token scores, a teacher's action value Q
for AggreVaTe (``q_source=reward_model`` or ``value_head``). ``SequenceScorerSpecialization``: a reward
model's score of each whole sequence, which ``reward.model`` adds to the rewards.

Which position scores which action. Log-probs score token ``x_t`` as the action ``a_t`` taken in the
state ``s_t = x_<t`` (``logprobs_T[t] = log pi(x_t | x_<t)``). The scorer's head reads the final
hidden state ``h_t``, which has seen ``x_<=t``, i.e. the state after the action, so

    q_T[t] = Q(s_t, a_t) = head(h_t)

aligned with ``logprobs_T``. For a reward model (transformers' sequence-classification layout) the
pooled score of a sequence is ``q_T`` at its last token, the value of its final action; for an
areno critic, whose ``values_T[t] = head(h_{t-1}) = V(s_t)``, ``head(h_t) = V(s_{t+1})``, which is
``Q(s_t, a_t)`` for deterministic token transitions without intermediate rewards.

Legend: T = packed tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from areno.errors import ConfigError
from areno.models.hf_io import read_score_head
from areno.specializations.base import ModelSpecialization, check_arguments
from areno.specializations.forward import ScalarHeadModel, last_token_scores_B
from areno.train import checkpoint
from areno.types import TokenBatch

SCORER_HEADS = ("reward_model", "value_head")
"""Where the head comes from: ``reward_model``, the ``score.weight`` of a Hugging Face
``*ForSequenceClassification`` checkpoint (the role's model directory); ``value_head``, an areno
critic's checkpoint (``checkpoints/step_N/<critic role>``: the decoder and ``score`` of its
``ScalarHeadModel``)."""


class ScalarScorerSpecialization(ModelSpecialization):
    """Frozen role: ``q_T`` = the scalar head over every position's hidden state (float32), read
    from ``head_path`` as ``head`` names (``SCORER_HEADS``). It never trains."""

    output_keys = ("q_T",)

    def __init__(self, *, head: str = "reward_model", head_path: str | None = None) -> None:
        check_arguments(ScalarScorerSpecialization, locals())
        if head not in SCORER_HEADS:
            raise ValueError(f"ScalarScorerSpecialization head: must be one of {SCORER_HEADS}, got {head!r}")
        self.head = head
        self.head_path = head_path

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if self.head_path is None:
            raise ConfigError(f"scorer ({self.head}): no checkpoint to read its head from; set its path")
        scorer = ScalarHeadModel(model)
        if self.head == "reward_model":
            _load_sequence_classifier_head(scorer, Path(self.head_path))
        else:
            _load_critic(scorer, Path(self.head_path))
        return scorer

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return {"q_T": model.scores_T(batch)}

    def compute_loss(self, model_output, batch, reducer):
        raise ValueError("ScalarScorerSpecialization is for frozen scorer roles: set trainable=False")


class SequenceScorerSpecialization(ModelSpecialization):
    """Frozen role: ``scores_B`` = a reward model's score of each sequence, its head at the sequence's last
    token (transformers' ``*ForSequenceClassification`` pools that position), read from ``head_path``, a
    sequence-classification checkpoint with one label. ``reward.model`` builds it as the role
    ``reward_model``, whose scores a ``RewardSync`` adds to the rewards. It never trains."""

    output_keys = ("scores_B",)

    def __init__(self, *, head_path: str | None = None) -> None:
        check_arguments(SequenceScorerSpecialization, locals())
        self.head_path = head_path

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if self.head_path is None:
            raise ConfigError("reward model: no checkpoint to read its score head from; set reward.model")
        scorer = ScalarHeadModel(model)
        _load_sequence_classifier_head(scorer, Path(self.head_path))
        return scorer

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return {"scores_B": last_token_scores_B(model, batch)}

    def compute_loss(self, model_output, batch, reducer):
        raise ValueError("SequenceScorerSpecialization is for frozen scorer roles: set trainable=False")


def _load_sequence_classifier_head(scorer: ScalarHeadModel, path: Path) -> None:
    head = read_score_head(path)
    if "score.weight" not in head:
        raise ConfigError(
            f"{path} has no score head: save it with transformers' AutoModelForSequenceClassification "
            "or set q_source=workflow"
        )
    weight = head["score.weight"]
    if weight.shape != scorer.score.weight.shape:
        raise ConfigError(
            f"{path}: score head of shape {tuple(weight.shape)}; a Q estimate needs num_labels=1 "
            f"(shape {tuple(scorer.score.weight.shape)}): save the reward model with num_labels=1"
        )
    with torch.no_grad():
        scorer.score.weight.copy_(weight.float())
        if "score.bias" in head:  # transformers' Llama/Qwen classifiers have none: the bias stays 0
            scorer.score.bias.copy_(head["score.bias"].float())


def _load_critic(scorer: ScalarHeadModel, path: Path) -> None:
    # checkpoint.load also restores the critic run's RNG state: keep this run's
    rng = checkpoint.rng_state()
    checkpoint.load(path, scorer, None)
    checkpoint.set_rng_state(rng)
