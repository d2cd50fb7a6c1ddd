"""Model forward passes shared by the specializations, on packed batches.

Alignment (``areno/types.py``): the value at position ``t`` is about token ``t`` as a target,
so it comes from the hidden state at ``t - 1`` of the same sequence; the first token of every
sequence gets 0. Log-probs are computed in float32 over chunks of tokens so ``[T, V]`` fp32 logits
are never materialised at once.

Legend: B = sequences, T = packed tokens, V = vocabulary, D = hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from areno.errors import DataError
from areno.models import prefix_sharing
from areno.models.attention import PackedCausalAttention
from areno.models.eager_ops import LogitMap
from areno.models.logprobs import (
    argmax_from_hidden,
    auto_chunk_size,
    logprobs_from_hidden,
    position_ids_from_cu_seqlens,
)
from areno.models.vision import ImageInputs
from areno.types import TokenBatch, host_to_device


def hidden_states_TD(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Final-normed hidden states [T, D] of a ``Decoder`` under packed causal attention. A model
    whose ``share_prompts`` is set runs adjacent sequences' common prompt once
    (``models.prefix_sharing``) and returns the same [T, D] rows, expanded."""
    device = model.output_weight.device
    cu_host_B1 = batch.cu_seqlens_B1.cpu()  # bounds are read on the host (no GPU stall)
    check_lengths(model.config, cu_host_B1)
    images = batch_images(batch)
    # the layers' windows, sinks and soft-cap (a wrapper's config is its decoder's)
    windows = dict(
        sliding_window=getattr(model.config, "sliding_window", None),
        window_layers=getattr(model.config, "window_layers", None),
        sinks=getattr(model.config, "attention_sinks", False),
        softcap=getattr(model.config, "attn_logit_softcapping", None),
    )
    if images is None and getattr(model, "share_prompts", False):
        ids_host_T = batch.input_ids_T.cpu()
        sharing = prefix_sharing.plan(ids_host_T, cu_host_B1, batch.loss_mask_T.cpu())
        if sharing is not None:
            pos_T = position_ids_from_cu_seqlens(cu_host_B1, "cpu")
            ids_C = host_to_device(ids_host_T.index_select(0, sharing.source_C), device)
            pos_C = host_to_device(pos_T.index_select(0, sharing.source_C), device)
            hidden_CD = model(ids_C, pos_C, prefix_sharing.SharedPrefixAttention(sharing, **windows))
            return hidden_CD.index_select(0, host_to_device(sharing.expand_T, device))
    attn = PackedCausalAttention(cu_host_B1, **windows)
    ids_T, pos_T = host_to_device(batch.input_ids_T, device), position_ids_from_cu_seqlens(cu_host_B1, device)
    if images is not None:  # a vision-language batch: the vision tower runs inside this forward
        return model(ids_T, pos_T, attn, images=images)
    return model(ids_T, pos_T, attn)


def check_lengths(config, cu_host_B1: torch.Tensor) -> None:
    """A ``DataError`` for a sequence longer than the model computes as transformers does (its RoPE tables
    end there; LongRoPE's long factors past its original context): before the forward, not an index error in
    it nor log-probs of another model."""
    limit = getattr(config, "max_seq_len", None)
    if limit is None or cu_host_B1.numel() < 2:
        return
    longest = int((cu_host_B1[1:] - cu_host_B1[:-1]).max())
    if longest > limit:
        raise DataError(
            f"a training sequence has {longest} tokens (prompt and completion), more than the model's "
            f"{config.positions_source}: shorten or remove the data rows longer than {limit} tokens (SFT, "
            "preference and reward-model files), or lower rollout.max_new_tokens"
        )


def batch_images(batch: TokenBatch) -> ImageInputs | None:
    """The images of a packed batch's sequences, in token order (None for a text-only batch)."""
    parts = [
        None if im is None else ImageInputs(im["pixel_values"], [tuple(g) for g in im["grid_thw"]])
        for im in batch.images_B
    ]
    return ImageInputs.concat(parts)


def _predictor_index_T(batch: TokenBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the hidden state that predicts each token, bool mask of tokens that have one)."""
    T = batch.num_tokens
    cu_B1 = batch.cu_seqlens_B1.cpu()
    is_start_T = torch.zeros(T, dtype=torch.bool)
    is_start_T[cu_B1[:-1][(cu_B1[1:] - cu_B1[:-1]) > 0]] = True
    idx_T = (torch.arange(T) - 1).clamp(min=0)
    return host_to_device(idx_T, device), host_to_device(~is_start_T, device)


def _scored_rows_K(batch: TokenBatch, mask_T: torch.Tensor | None) -> torch.Tensor:
    """Host int64 [K]: the tokens the head scores, those with a predictor (not a sequence's first)
    and inside ``mask_T`` when given. Built on the host so selecting them never waits on the GPU."""
    cu_B1 = batch.cu_seqlens_B1.cpu()
    keep_T = torch.ones(batch.num_tokens, dtype=torch.bool)
    keep_T[cu_B1[:-1][(cu_B1[1:] - cu_B1[:-1]) > 0]] = False
    if mask_T is not None:
        keep_T &= mask_T.cpu().bool()
    return keep_T.nonzero()[:, 0]


def _scatter_T(values_K: torch.Tensor, rows_K: torch.Tensor, T: int) -> torch.Tensor:
    """[T] with ``values_K`` at ``rows_K`` and 0 elsewhere (differentiable w.r.t. the values)."""
    return values_K.new_zeros(T).index_copy(0, rows_K, values_K)


def token_logprobs_T(
    model: nn.Module,
    batch: TokenBatch,
    *,
    hidden_TD: torch.Tensor | None = None,
    targets_T: torch.Tensor | None = None,
    mask_T: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_argmax: bool = False,
    chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token ``logprobs_T`` of ``targets_T`` (default: the batch's own tokens) under the
    temperature-scaled distribution, optionally ``entropy_T`` and the greedy action
    ``argmax_T`` (the token the model would emit at each position, no gradient). 0 at sequence
    starts. The log-probs use ``areno.models.logprobs.logprobs_from_hidden``, which recomputes
    chunk logits in backward instead of keeping [T, V] fp32 logits alive.

    With ``mask_T`` (bool [T]; the specializations pass the batch's loss mask) the LM head runs
    only on those tokens' predictors and every output is 0 elsewhere: prompt tokens, whose
    log-probs no loss reads, cost no [V, D] matmul or log-softmax. The values on the masked
    tokens are the full head's. ``chunk_size`` None: ``auto_chunk_size`` (memory and speed, not values)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    # before the forward: reading a device mask on the host waits for the work queued before it
    rows_host_K = _scored_rows_K(batch, mask_T)
    if hidden_TD is None:
        hidden_TD = hidden_states_TD(model, batch)
    device = hidden_TD.device
    T = batch.num_tokens
    weight_VD = model.output_weight
    targets_T = batch.input_ids_T if targets_T is None else targets_T
    rows_K = host_to_device(rows_host_K, device)
    pred_KD = hidden_TD[host_to_device(rows_host_K - 1, device)]  # hidden[t - 1] predicts token t
    on_host = targets_T.device.type == "cpu"
    targets_K = host_to_device(targets_T[rows_host_K], device) if on_host else targets_T[rows_K]
    if chunk_size is None:
        chunk_size = auto_chunk_size(pred_KD, weight_VD)
    logit_map = LogitMap.of(model.config)  # a wrapper's config is its decoder's
    logp_K, ent_K = logprobs_from_hidden(
        pred_KD, weight_VD, targets_K, temperature, chunk_size, with_entropy=with_entropy, logit_map=logit_map
    )
    out = {"logprobs_T": _scatter_T(logp_K, rows_K, T)}
    if with_entropy:
        out["entropy_T"] = _scatter_T(ent_K, rows_K, T)
    if with_argmax:
        with torch.no_grad():  # a vocab-sharded (TP) head takes the distributed path
            out["argmax_T"] = _scatter_T(argmax_from_hidden(pred_KD, weight_VD, chunk_size), rows_K, T)
    return out


class ScalarHeadModel(nn.Module):
    """A decoder with a scalar linear head on its hidden states (critic value head, reward-model
    score head). ``state_dict`` keys are the decoder's under ``decoder.`` plus ``score.weight``
    and ``score.bias``; the head is zero-initialised so a fresh head predicts 0. An untied
    ``decoder.lm_head`` is kept (checkpoint keys) but frozen: nothing reads it."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        hidden = decoder.output_weight.shape[1]
        self.score = nn.Linear(hidden, 1, device=decoder.output_weight.device, dtype=torch.float32)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)
        if not decoder.config.tie_word_embeddings:
            # no optimizer state, no gradient buffer, no reduction for a [V, D] weight no loss reads
            decoder.lm_head.requires_grad_(False)

    @property
    def config(self):
        return self.decoder.config

    @property
    def share_prompts(self) -> bool:
        """The decoder's ``share_prompts`` (``hidden_states_TD`` reads it from the model it is given)."""
        return self.decoder.share_prompts

    @property
    def output_weight(self) -> torch.Tensor:
        return self.decoder.output_weight

    def float32_modules(self) -> list[nn.Module]:
        """Modules whose parameters stay float32 under mixed precision (FSDP2 gives them a group of
        their own): a value or score is read to more than bf16's 8 bits; the decoder's own (GLM-4.5's routers)."""
        return [self.score, *self.decoder.float32_modules()]

    def forward(self, input_ids_T, position_ids_T, attn=None, **kwargs) -> torch.Tensor:
        """The decoder's hidden states; ``kwargs`` (a vision-language batch's ``images``) go to it."""
        return self.decoder(input_ids_T, position_ids_T, attn, **kwargs)

    def scores_T(self, batch: TokenBatch) -> torch.Tensor:
        """Head output at every position [T] (float32): the score *after* reading token t."""
        hidden_TD = hidden_states_TD(self, batch)
        # float32 whatever the compute dtype: autocast would run the matmul in bf16 (FSDP2 keeps the
        # head's parameters in float32: float32_modules); called as a module so FSDP2 gathers them
        with torch.autocast(hidden_TD.device.type, enabled=False):
            return self.score(hidden_TD.float()).squeeze(-1)


def values_T(model: ScalarHeadModel, batch: TokenBatch) -> torch.Tensor:
    """Critic values aligned like log-probs: ``values_T[t]`` = V(state before token t) = head at
    ``t - 1``; 0 at sequence starts."""
    raw_T = model.scores_T(batch)
    src_T, valid_T = _predictor_index_T(batch, raw_T.device)
    return torch.where(valid_T, raw_T[src_T], torch.zeros((), device=raw_T.device))


def last_token_scores_B(model: ScalarHeadModel, batch: TokenBatch) -> torch.Tensor:
    """Reward-model score of each sequence: the head at its last token [B]."""
    raw_T = model.scores_T(batch)
    return raw_T[(batch.cu_seqlens_B1[1:] - 1).to(raw_T.device)]
