"""Pairwise-preference specializations: DPO and the Bradley–Terry reward model.

Batch layout: a preference pair is two sequences sharing a ``group_id``; the one with the larger
``rewards_B`` is chosen (e.g. 1 vs 0). Pairs may sit anywhere in the batch (reshuffles keep them).

Micro-batch independence. A pairwise loss couples two sequences that the backend may put in
different micro-batches, so these specializations use an exact first-order surrogate: a no-grad
forward of the current weights at the start of the step (``self_forward_keys``) gives every
pair's loss ``L_p`` and its derivatives ``c_b = dL_p / d s_b`` with respect to each sequence's
score ``s_b`` (the summed completion log-prob for DPO, the head's score for the reward model).
Per sequence the micro-batch then computes

    loss_b = L_p / 2 + c_b * (s_b - sg[s_b])

whose value is the pair loss and whose gradient is exactly dL/dθ at the current weights, wherever
the two sequences land. The step takes one optimizer update, so this is the DPO / BT gradient.

Held-out pairs: ``pair_metrics`` reads the same prepared batch (the current weights' no-grad
forwards, no update) for an offline recipe's evaluation: the pair loss, the fraction of pairs whose
chosen sequence scores higher (``eval/accuracy``) and the mean score margin.

Legend: B = sequences, P = pairs, T = packed tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from areno.algo import bradley_terry_loss_B, dpo_loss_B, sequence_sum_B
from areno.models import moe
from areno.models.config import SEQUENCE_CLASSIFIER_SUFFIX, ModelConfig
from areno.models.hf_io import build_model, save_model
from areno.specializations.base import Metrics, ModelSpecialization, Reducer, check_arguments
from areno.specializations.forward import ScalarHeadModel, last_token_scores_B, token_logprobs_T
from areno.types import TokenBatch

logger = logging.getLogger("areno.specializations")


def preference_pairs(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_idx_P, rejected_idx_P) from ``group_ids`` and ``rewards_B``; ValueError unless every
    group holds exactly two sequences with different rewards."""
    groups: dict[str, list[int]] = {}
    for i, gid in enumerate(batch.group_ids):
        groups.setdefault(gid, []).append(i)
    if not batch.group_ids or any(len(v) != 2 for v in groups.values()):
        raise ValueError(
            "preference batch: every group_id must hold exactly 2 sequences (chosen, rejected); "
            f"got group sizes {sorted({len(v) for v in groups.values()}) if groups else 'no group_ids'}"
        )
    chosen, rejected = [], []
    for gid, (i, j) in groups.items():
        ri, rj = float(batch.rewards_B[i]), float(batch.rewards_B[j])
        if ri == rj:
            raise ValueError(
                f"preference pair {gid!r}: both sequences have reward {ri}; the chosen one needs the larger"
            )
        chosen.append(i if ri > rj else j)
        rejected.append(j if ri > rj else i)
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


def _pair_surrogate_extra(
    batch: TokenBatch,
    loss_P: torch.Tensor,
    score_grad_chosen_P: torch.Tensor,
    chosen_P: torch.Tensor,
    rejected_P: torch.Tensor,
    margin_P: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Per sequence, half of its pair's value of: the loss, the score margin (chosen - rejected) and
    whether that margin is > 0; and the score coefficient dL/ds_b. Halves: a reducer over the pairs'
    sequences divided by the number of pairs gives the mean over pairs."""

    def halves(value_P: torch.Tensor) -> torch.Tensor:
        out_B = torch.zeros(batch.num_seqs)
        out_B[chosen_P] = value_P.detach().float().cpu() / 2
        out_B[rejected_P] = value_P.detach().float().cpu() / 2
        return out_B

    coef_B = torch.zeros(batch.num_seqs)
    coef_B[chosen_P] = score_grad_chosen_P.detach().float().cpu()
    coef_B[rejected_P] = -score_grad_chosen_P.detach().float().cpu()
    return {
        "pair_half_loss_B": halves(loss_P),
        "pair_coef_B": coef_B,
        "pair_margin_B": halves(margin_P),
        "pair_correct_B": halves((margin_P > 0).float()),
    }


def pair_metrics(prepared: TokenBatch) -> dict[str, float]:
    """Means over the pairs of a pairwise role's prepared batch (``prepare_batch``): ``loss`` (the
    pair loss), ``accuracy`` (the fraction whose chosen sequence scores higher: DPO's implicit reward
    ``beta (log pi - log ref)``, the reward model's score; a tie counts as wrong, as in TRL's
    ``rewards/accuracies``) and ``margin`` (chosen minus rejected score)."""
    pairs = prepared.num_seqs / 2
    return {
        "loss": float(prepared.extra["pair_half_loss_B"].sum()) / pairs,
        "accuracy": float(prepared.extra["pair_correct_B"].sum()) / pairs,
        "margin": float(prepared.extra["pair_margin_B"].sum()) / pairs,
    }


def _surrogate_loss(score_B: torch.Tensor, batch: TokenBatch, reducer: Reducer) -> torch.Tensor:
    dev = score_B.device
    loss_B = batch.extra["pair_half_loss_B"].to(dev) + batch.extra["pair_coef_B"].to(dev) * (score_B - score_B.detach())
    return reducer(loss_B)


class DPOSpecialization(ModelSpecialization):
    """DPO (Rafailov et al. 2023): ``L = -log sigmoid(beta ((s_c - r_c) - (s_r - r_r)))`` with
    ``s`` the policy's and ``r`` the reference's summed completion log-probs. ``ref_key`` names
    the batch tensor of reference log-probs: ``ref_logprobs_T`` (from a reference role through a
    DataSync) or ``logprobs_T`` (log-probs recorded with the data, TRL's precomputed reference).
    ``label_smoothing`` > 0 is cDPO. The denominator is the number of pairs."""

    output_keys = ("logprobs_T",)

    def __init__(
        self,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        ref_key: str = "ref_logprobs_T",
        logprob_chunk_size: int | None = None,
    ) -> None:
        check_arguments(DPOSpecialization, locals())
        if beta <= 0:
            raise ValueError(f"DPOSpecialization beta: must be > 0, got {beta}")
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"DPOSpecialization label_smoothing: must be in [0, 0.5), got {label_smoothing}")
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.ref_key = ref_key
        self.logprob_chunk_size = logprob_chunk_size
        # another role's log-probs: a recipe without the DataSync that brings them is refused when built
        self.required_extra_keys = () if ref_key == "logprobs_T" else (ref_key,)

    @property
    def self_forward_keys(self) -> dict[str, str]:
        return {"logprobs_T": "current_logprobs_T"}

    def prepare_batch(self, rollout_data: TokenBatch) -> TokenBatch:
        b = rollout_data
        ref_T = b.logprobs_T if self.ref_key == "logprobs_T" else b.extra.get(self.ref_key)
        if ref_T is None:
            raise ValueError(
                f"DPOSpecialization needs batch.extra[{self.ref_key!r}]: add a DataSync from a reference role"
            )
        chosen_P, rejected_P = preference_pairs(b)
        pol_B = sequence_sum_B(b.extra["current_logprobs_T"].float(), b.cu_seqlens_B1, b.loss_mask_T)
        ref_B = sequence_sum_B(ref_T.float(), b.cu_seqlens_B1, b.loss_mask_T)
        pc = pol_B[chosen_P].clone().requires_grad_(True)
        loss_P, stats = dpo_loss_B(
            pc,
            pol_B[rejected_P],
            ref_B[chosen_P],
            ref_B[rejected_P],
            beta=self.beta,
            label_smoothing=self.label_smoothing,
        )
        (grad_P,) = torch.autograd.grad(loss_P.sum(), pc)
        margin_P = stats["chosen_reward"] - stats["rejected_reward"]  # > 0 exactly where reward_accuracy is 1
        extra = _pair_surrogate_extra(b, loss_P, grad_P, chosen_P, rejected_P, margin_P)
        return dataclasses.replace(b, extra={**b.extra, **extra})

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return token_logprobs_T(model, batch, mask_T=batch.loss_mask_T, chunk_size=self.logprob_chunk_size)

    def compute_loss(self, model_output, batch, reducer) -> tuple[torch.Tensor, Metrics]:
        logp_T = model_output["logprobs_T"]
        score_B = sequence_sum_B(logp_T, batch.cu_seqlens_B1.to(logp_T.device), batch.loss_mask_T.to(logp_T.device))
        metrics = {
            "dpo/accuracy": reducer(batch.extra["pair_correct_B"]).detach(),
            "dpo/reward_margin": reducer(batch.extra["pair_margin_B"]).detach(),
        }
        return _surrogate_loss(score_B, batch, reducer), metrics

    def denominator(self, batch: TokenBatch) -> float:
        return batch.num_seqs / 2


class RewardModelSpecialization(ModelSpecialization):
    """Bradley–Terry reward model (Ouyang et al. 2022): a scalar head on the last token of each
    sequence, ``L = -log sigmoid(s_c - s_r - margin)`` per pair; the denominator is the number of
    pairs."""

    output_keys = ("scores_B",)

    def __init__(self, *, margin: float = 0.0) -> None:
        check_arguments(RewardModelSpecialization, locals())
        self.margin = margin

    @property
    def self_forward_keys(self) -> dict[str, str]:
        return {"scores_B": "current_scores_B"}

    def wrap_model(self, model: nn.Module) -> nn.Module:
        scorer = ScalarHeadModel(model)
        # No bias, as in transformers' sequence classifiers (the export): Bradley–Terry sees only score
        # differences, so a bias has no gradient but its rounding noise, which Adam would follow.
        scorer.score.bias = None
        return scorer

    def prepare_batch(self, rollout_data: TokenBatch) -> TokenBatch:
        b = rollout_data
        chosen_P, rejected_P = preference_pairs(b)
        s_B = b.extra["current_scores_B"].float()
        sc = s_B[chosen_P].clone().requires_grad_(True)
        loss_P, stats = bradley_terry_loss_B(sc, s_B[rejected_P], margin=self.margin)
        (grad_P,) = torch.autograd.grad(loss_P.sum(), sc)
        extra = _pair_surrogate_extra(b, loss_P, grad_P, chosen_P, rejected_P, stats["score_margin"])
        return dataclasses.replace(b, extra={**b.extra, **extra})

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return {"scores_B": last_token_scores_B(model, batch)}

    def compute_loss(self, model_output, batch, reducer) -> tuple[torch.Tensor, Metrics]:
        loss = _surrogate_loss(model_output["scores_B"], batch, reducer)
        return loss, {"reward_model/accuracy": reducer(batch.extra["pair_correct_B"]).detach()}

    def denominator(self, batch: TokenBatch) -> float:
        return batch.num_seqs / 2


def save_reward_model(state: dict[str, torch.Tensor], config: ModelConfig, out_dir: str | Path) -> Path:
    """Write a reward model's weights (``state``: its ``ScalarHeadModel``'s, ``decoder.*`` and
    ``score.*``) as transformers' sequence classifier (``<Model>ForSequenceClassification``,
    ``num_labels=1``): the decoder under its Hugging Face names without the LM head, and
    ``score.weight`` [1, hidden] (the head has no bias: ``RewardModelSpecialization.wrap_model``).
    ``AutoModelForSequenceClassification`` and areno's scorer (``q_source=reward_model``) load it; a
    sequence's reward is the head at its last token, as trained. A vision-language checkpoint's text model
    (``vl_text``) is written as a text model's classifier, without the vision tower."""
    assert "score.bias" not in state, "a reward model's head has no bias"
    # a vision-language checkpoint's text model scores text: its classifier is the text model's alone
    config = config.replace(container=None)
    decoder_state = {name.removeprefix("decoder."): t for name, t in state.items() if name.startswith("decoder.")}
    dtype = next(iter(decoder_state.values())).dtype
    with torch.device("meta"):
        decoder = build_model(config).to(dtype)
        moe.keep_routers_float32(decoder)  # GLM-4.5's, trained in float32: saved unrounded, as hf_io saves them
    decoder.to_empty(device="cpu")
    decoder.load_state_dict(decoder_state, strict=True)
    out = save_model(decoder, config, out_dir)
    weights = out / "model.safetensors"
    tensors = {name: t for name, t in load_file(weights).items() if name != "lm_head.weight"}
    tensors["score.weight"] = state["score.weight"].detach().to("cpu", dtype).contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    hf = json.loads((out / "config.json").read_text(encoding="utf-8"))
    hf["architectures"] = [config.architecture.removesuffix("ForCausalLM") + SEQUENCE_CLASSIFIER_SUFFIX]
    hf.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})  # num_labels=1: one scalar score
    eos = hf.get("eos_token_id")
    if hf.get("pad_token_id") is not None and hf["pad_token_id"] in (eos if isinstance(eos, list) else [eos]):
        # transformers' classifier scores the last token that is not the pad id: with pad = EOS the token
        # before the EOS training scored. Without a pad id it scores the last token (and refuses a padded
        # batch rather than reading the wrong token)
        hf["pad_token_id"] = None
        logger.warning(
            "reward model export %s: its pad id is its EOS id, which transformers' sequence classifier would "
            "skip as padding and score the token before it; the export has no pad id (score sequences one at a "
            "time, or give the tokenizer a pad token of its own before batching)",
            out,
        )
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


PAIRWISE_SPECIALIZATIONS = (DPOSpecialization, RewardModelSpecialization)
"""The specializations that learn from preference pairs: an offline recipe with such a trainable role
trains on preference rows (``prompt``, ``chosen``, ``rejected``), each row two sequences of one group."""
