"""Supervised and distillation specializations: SFT, frozen log-prob scorers (reference, teacher),
on-policy distillation (reverse KL), DAgger, AggreVaTe and the mixed DAgger/OPD loss.

Legend: B = sequences, T = packed tokens. All token losses use token-level aggregation: the sum
over loss tokens divided by the global number of loss tokens.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from areno.algo import KL_ESTIMATORS, LOSS_KL_ESTIMATORS, kl_estimate_T, masked_whiten_T, nll_loss_T
from areno.errors import ConfigError, DataError
from areno.specializations.base import POLICY_VERSION_KEY, Metrics, ModelSpecialization, check_arguments, reduce_stats
from areno.specializations.forward import token_logprobs_T
from areno.types import TokenBatch


def _mask(batch: TokenBatch, device: torch.device) -> torch.Tensor:
    return batch.loss_mask_T.to(device)


class LogProbSpecialization(ModelSpecialization):
    """A frozen scorer (reference or teacher role): reports ``logprobs_T`` of the batch's tokens
    and ``argmax_T``, the token it would emit at each position (the teacher's action label).
    It never trains; ``compute_loss`` raises."""

    output_keys = ("logprobs_T", "argmax_T")

    def __init__(self, *, temperature: float = 1.0, logprob_chunk_size: int | None = None) -> None:
        check_arguments(LogProbSpecialization, locals())
        if temperature <= 0:
            raise ValueError(f"LogProbSpecialization temperature: must be > 0, got {temperature}")
        self.temperature = temperature
        self.logprob_chunk_size = logprob_chunk_size

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return token_logprobs_T(
            model,
            batch,
            mask_T=batch.loss_mask_T,
            temperature=self.temperature,
            with_argmax=True,
            chunk_size=self.logprob_chunk_size,
        )

    def compute_loss(self, model_output, batch, reducer):
        raise ValueError("LogProbSpecialization is for frozen roles (reference, teacher): set trainable=False")


class SFTSpecialization(ModelSpecialization):
    """Supervised fine-tuning: ``loss = sum_t -log p(x_t) / #loss tokens`` over completion tokens."""

    output_keys = ("logprobs_T",)

    def __init__(self, *, logprob_chunk_size: int | None = None) -> None:
        check_arguments(SFTSpecialization, locals())
        self.logprob_chunk_size = logprob_chunk_size

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return token_logprobs_T(model, batch, mask_T=batch.loss_mask_T, chunk_size=self.logprob_chunk_size)

    def compute_loss(self, model_output, batch, reducer) -> tuple[torch.Tensor, Metrics]:
        logp_T = model_output["logprobs_T"]
        mask_T = _mask(batch, logp_T.device)
        loss_T = nll_loss_T(logp_T, mask_T)
        return reducer(loss_T, mask_T), reduce_stats({"nll": loss_T}, mask_T, reducer, "sft")


class DistillSpecialization(ModelSpecialization):
    """On-policy distillation (Agarwal et al. 2024 GKD with a reverse KL; Thinking Machines' OPD):
    the student samples, a frozen teacher scores the same tokens (``teacher_logprobs_T``), and

        loss_t = k2_t = 0.5 (s - t)^2

    with ``s, t`` the student and teacher log-probs of the sampled token. Its gradient
    ``(s - t) grad s`` is, in expectation over the student's samples, that of the per-token reverse
    KL(student || teacher): the policy gradient with the reward ``t - s`` that OPD uses. The logged
    ``distill/reverse_kl`` is the k3 estimate of that KL (unbiased, >= 0). ``kl_estimator=k3`` makes
    the loss k3, whose gradient ``(1 - exp(t - s)) grad s`` follows the forward KL(teacher ||
    student) (mode-covering) instead; k1 is refused: its expected gradient is 0."""

    output_keys = ("logprobs_T",)
    required_extra_keys = ("teacher_logprobs_T",)

    def __init__(
        self, *, kl_estimator: str = "k2", temperature: float = 1.0, logprob_chunk_size: int | None = None
    ) -> None:
        check_arguments(DistillSpecialization, locals())
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"DistillSpecialization kl_estimator: must be one of {KL_ESTIMATORS}, got {kl_estimator!r}"
            )
        if kl_estimator not in LOSS_KL_ESTIMATORS:
            raise ValueError(
                f"DistillSpecialization kl_estimator: {kl_estimator!r} as the loss has an expected gradient of 0 on "
                "the student's samples (E[grad log pi] = 0), so it would train on noise: use k2 (the default: the "
                "reverse KL's gradient) or k3 (the forward KL's)"
            )
        self.kl_estimator = kl_estimator
        self.temperature = temperature
        self.logprob_chunk_size = logprob_chunk_size

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return token_logprobs_T(
            model, batch, mask_T=batch.loss_mask_T, temperature=self.temperature, chunk_size=self.logprob_chunk_size
        )

    def compute_loss(self, model_output, batch, reducer) -> tuple[torch.Tensor, Metrics]:
        logp_T = model_output["logprobs_T"]
        mask_T = _mask(batch, logp_T.device)
        teacher_T = batch.extra["teacher_logprobs_T"].to(logp_T.device)
        loss_T = kl_estimate_T(logp_T, teacher_T, mask_T, estimator=self.kl_estimator)
        kl_T = (
            loss_T if self.kl_estimator == "k3" else kl_estimate_T(logp_T.detach(), teacher_T, mask_T, estimator="k3")
        )
        return reducer(loss_T, mask_T), reduce_stats({"reverse_kl": kl_T}, mask_T, reducer, "distill")


class DaggerSpecialization(ModelSpecialization):
    """DAgger (Ross et al. 2011) at token level: at every state the student visited, the teacher
    labels the action it would take (``teacher_action_T``, its greedy token) and the student is
    trained by cross-entropy toward that label:

        loss_t = -log pi_student(a*_t | s_t)

    The β-mixture of the paper (executing the teacher with probability β) belongs to the rollout
    workflow; this loss is the aggregated-dataset classification step."""

    output_keys = ("logprobs_T",)
    required_extra_keys = ("teacher_action_T",)

    def __init__(self, *, temperature: float = 1.0, logprob_chunk_size: int | None = None) -> None:
        check_arguments(DaggerSpecialization, locals())
        self.temperature = temperature
        self.logprob_chunk_size = logprob_chunk_size

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        targets_T = batch.extra["teacher_action_T"].long()
        out = token_logprobs_T(
            model,
            batch,
            mask_T=batch.loss_mask_T,
            targets_T=targets_T,
            temperature=self.temperature,
            with_argmax=True,
            chunk_size=self.logprob_chunk_size,
        )
        return {"label_logprobs_T": out["logprobs_T"], "argmax_T": out["argmax_T"]}

    def compute_loss(self, model_output, batch, reducer) -> tuple[torch.Tensor, Metrics]:
        logp_T = model_output["label_logprobs_T"]
        mask_T = _mask(batch, logp_T.device)
        loss_T = nll_loss_T(logp_T, mask_T)
        agree_T = (model_output["argmax_T"] == batch.extra["teacher_action_T"].to(logp_T.device)).float()
        return reducer(loss_T, mask_T), reduce_stats({"ce": loss_T, "agree": agree_T}, mask_T, reducer, "dagger")


AGGREVATE_Q_SOURCES = ("teacher_logprob", "workflow", "reward_model", "value_head")
"""Where AggreVaTe's action value comes from: the teacher's log-prob of the action (a proxy);
``teacher_q_T`` measured by the rollout workflow (``Trajectory.extra_T``, e.g. teacher roll-outs);
or ``teacher_q_T`` from a frozen scalar-head scorer role (a reward model's score head or an areno
critic's value head, ``areno.specializations.scorer``) through a DataSync."""

SCORER_Q_SOURCES = ("reward_model", "value_head")
"""The Q sources that a frozen scorer role provides, per token, through a DataSync."""


class AggrevateSpecialization(ModelSpecialization):
    """AggreVaTe (Ross & Bagnell 2014) at token level: instead of imitating the teacher's action,
    weight the student's own action by the teacher's cost-to-go estimate of it. ``q_source``
    names the action value: ``teacher_logprob`` (default) uses the teacher's log-prob of the action
    (``teacher_logprobs_T``) as a proxy (a departure: no roll-outs); ``workflow`` uses
    ``teacher_q_T``, which the rollout workflow measured and put in each trajectory's ``extra_T``
    (``areno.workflows.teacher:TeacherQWorkflow``: teacher roll-outs after the student's action; a
    missing one is an error, never a silent fallback), and where ``teacher_q_mask_T`` marks the
    measured tokens only those are trained on; ``reward_model`` / ``value_head`` use ``teacher_q_T``
    injected by a frozen scorer role, ``Q(s_t, a_t) = head(h_t)`` at every token (the head over the
    hidden state that has read ``a_t``; ``areno.specializations.scorer``). With ``A_t`` that value
    whitened over the batch's loss tokens:

        loss_t = -A_t log pi_student(a_t | s_t)
    """

    output_keys = ("logprobs_T",)

    def __init__(
        self, *, q_source: str = "teacher_logprob", temperature: float = 1.0, logprob_chunk_size: int | None = None
    ) -> None:
        check_arguments(AggrevateSpecialization, locals())
        if q_source not in AGGREVATE_Q_SOURCES:
            raise ConfigError(
                f"aggrevate q_source={q_source!r} is not supported; supported: {', '.join(AGGREVATE_Q_SOURCES)}"
            )
        self.q_source = q_source
        self.required_extra_keys = ("teacher_q_T",) if q_source in SCORER_Q_SOURCES else ("teacher_logprobs_T",)
        self.temperature = temperature
        self.logprob_chunk_size = logprob_chunk_size

    def prepare_batch(self, rollout_data: TokenBatch) -> TokenBatch:
        b = rollout_data
        self._check_extra(b)
        if self.q_source == "workflow":
            if "teacher_q_T" not in b.extra:
                raise DataError(
                    "aggrevate q_source=workflow: the rollout workflow put no teacher_q_T in its trajectories' "
                    "extra_T; use q_source=teacher_logprob or a workflow that measures Q"
                )
            q_T = b.extra["teacher_q_T"]
            if "teacher_q_mask_T" in b.extra:  # Q measured at some tokens only: train on those
                b = dataclasses.replace(b, loss_mask_T=b.loss_mask_T & b.extra["teacher_q_mask_T"].bool())
        elif self.q_source in SCORER_Q_SOURCES:
            q_T = b.extra["teacher_q_T"]
        else:
            q_T = b.extra["teacher_logprobs_T"]
        return dataclasses.replace(b, advantages_T=masked_whiten_T(q_T.float(), b.loss_mask_T))

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return token_logprobs_T(
            model, batch, mask_T=batch.loss_mask_T, temperature=self.temperature, chunk_size=self.logprob_chunk_size
        )

    def compute_loss(self, model_output, batch, reducer) -> tuple[torch.Tensor, Metrics]:
        logp_T = model_output["logprobs_T"]
        mask_T = _mask(batch, logp_T.device)
        loss_T = torch.where(mask_T, -batch.advantages_T.to(logp_T.device) * logp_T, torch.zeros_like(logp_T))
        return reducer(loss_T, mask_T), reduce_stats({"pg_loss": loss_T}, mask_T, reducer, "aggrevate")


class MixedLossDaggerOPDSpecialization(ModelSpecialization):
    """Per-token mix of DAgger and on-policy distillation on trajectories where some tokens were
    executed by the teacher (``teacher_executed_T`` True) and the rest by the student:

        loss_t = beta * CE_t * [teacher-executed] + (1 - beta) * k2_t * [student-executed]
        CE_t = -log pi_student(x_t),   k2_t = 0.5 (s - t)^2

    β=1 is pure cross-entropy on teacher tokens, β=0 pure on-policy distillation on student tokens
    (k2: the reverse KL(student || teacher)'s gradient in expectation, as ``DistillSpecialization``;
    the logged ``mixed/k3`` is the k3 estimate of that KL). β
    follows a linear schedule from ``beta_start`` to ``beta_end`` over ``beta_decay_steps`` policy
    versions (read from the batch's ``policy_version_B``). Without ``teacher_executed_T`` every
    token counts as student-executed."""

    output_keys = ("logprobs_T",)
    required_extra_keys = ("teacher_logprobs_T",)

    def __init__(
        self,
        *,
        beta_start: float = 1.0,
        beta_end: float = 0.0,
        beta_decay_steps: int = 100,
        temperature: float = 1.0,
        logprob_chunk_size: int | None = None,
    ) -> None:
        check_arguments(MixedLossDaggerOPDSpecialization, locals())
        if not (0 <= beta_start <= 1 and 0 <= beta_end <= 1):
            raise ValueError("MixedLossDaggerOPDSpecialization beta_start/beta_end: must be in [0, 1]")
        if beta_decay_steps < 0:
            raise ValueError(f"MixedLossDaggerOPDSpecialization beta_decay_steps: must be >= 0, got {beta_decay_steps}")
        self.beta_start = beta_start
        self.beta_end = beta_end
        self.beta_decay_steps = beta_decay_steps
        self.temperature = temperature
        self.logprob_chunk_size = logprob_chunk_size

    def beta(self, step: int) -> float:
        """β at policy version ``step`` (linear, then constant)."""
        if self.beta_decay_steps == 0:
            return self.beta_end
        frac = min(max(step, 0) / self.beta_decay_steps, 1.0)
        return self.beta_start + frac * (self.beta_end - self.beta_start)

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return token_logprobs_T(
            model, batch, mask_T=batch.loss_mask_T, temperature=self.temperature, chunk_size=self.logprob_chunk_size
        )

    def compute_loss(self, model_output, batch, reducer) -> tuple[torch.Tensor, Metrics]:
        logp_T = model_output["logprobs_T"]
        dev = logp_T.device
        mask_T = _mask(batch, dev)
        teacher_T = batch.extra.get("teacher_executed_T", torch.zeros_like(batch.loss_mask_T)).to(dev).bool()
        step = int(batch.extra[POLICY_VERSION_KEY][0]) if POLICY_VERSION_KEY in batch.extra else 0
        beta = self.beta(step)
        ce_T = nll_loss_T(logp_T, mask_T & teacher_T)
        student_T = mask_T & ~teacher_T
        teacher_logp_T = batch.extra["teacher_logprobs_T"].to(dev)
        k2_T = kl_estimate_T(logp_T, teacher_logp_T, student_T, estimator="k2")
        k3_T = kl_estimate_T(logp_T.detach(), teacher_logp_T, student_T, estimator="k3")
        loss_T = beta * ce_T + (1 - beta) * k2_T
        metrics = reduce_stats({"ce": ce_T, "k3": k3_T}, mask_T, reducer, "mixed")
        metrics["mixed/beta"] = torch.tensor(beta) * reducer(torch.ones_like(logp_T), mask_T).detach()
        return reducer(loss_T, mask_T), metrics
