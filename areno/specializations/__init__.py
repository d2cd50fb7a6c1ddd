"""Model specializations: what each model role computes (see ``base.py`` for the contract)."""

from areno.specializations.actor import ActorConfig, ActorSpecialization
from areno.specializations.base import ModelSpecialization
from areno.specializations.critic import CriticSpecialization
from areno.specializations.forward import ScalarHeadModel, token_logprobs_T
from areno.specializations.preference import DPOSpecialization, RewardModelSpecialization, preference_pairs
from areno.specializations.scorer import ScalarScorerSpecialization, SequenceScorerSpecialization
from areno.specializations.supervised import (
    AggrevateSpecialization,
    DaggerSpecialization,
    DistillSpecialization,
    LogProbSpecialization,
    MixedLossDaggerOPDSpecialization,
    SFTSpecialization,
)

__all__ = [
    "ActorConfig",
    "ActorSpecialization",
    "AggrevateSpecialization",
    "CriticSpecialization",
    "DPOSpecialization",
    "DaggerSpecialization",
    "DistillSpecialization",
    "LogProbSpecialization",
    "MixedLossDaggerOPDSpecialization",
    "ModelSpecialization",
    "RewardModelSpecialization",
    "SFTSpecialization",
    "ScalarScorerSpecialization",
    "ScalarHeadModel",
    "SequenceScorerSpecialization",
    "preference_pairs",
    "token_logprobs_T",
]
