"""The data types every layer shares: sampling requests, generation outputs, trajectories and the
packed training batch.

Legend for tensor names (STYLE.md 5):
    B = sequences in a batch, T = packed tokens (all sequences concatenated, no padding),
    V = vocabulary, D = hidden size.

Alignment convention for per-token tensors of a packed batch: the value at position ``t`` is about
token ``input_ids_T[t]`` *as a prediction target*, i.e. ``logprobs_T[t] = log p(input_ids_T[t] |
tokens before t in the same sequence)``. The first token of every sequence is never a target, so
its ``loss_mask_T`` entry is always False and its log-prob is 0.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np
import torch


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device`` without stalling the host: a CUDA copy from pageable host memory
    first waits for the stream's queued work, so a host tensor bound for CUDA is pinned and sent
    asynchronously (the copy is ordered on the stream before any kernel that reads it)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


MIN_TEMPERATURE = 1e-3
"""The smallest positive temperature sampled with: near 1e-38 ``logits / T`` overflows float32 (garbage
tokens, null log-probs); this floor keeps far from it. Send 0 for greedy."""
MAX_SEED = 2**53 - 1
"""Largest per-request seed: seeds travel to the sampler in a float64 table (``sampling.RowParams``), exact
up to 2**53; a larger seed would collide with another."""


@dataclass(kw_only=True)
class SamplingParams:
    """How one request is sampled. Validated at construction."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy. Log-probs are reported under the scaled distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables."""
    min_p: float = 0.0
    """Drop the tokens whose probability (after the temperature) is below ``min_p`` times the most likely
    token's; in [0, 1], 0 disables. Applied before top-k / top-p, as vLLM does (``sampling.py``)."""
    repetition_penalty: float = 1.0
    """> 0; 1 disables. Each token of the prompt or of the output so far has a positive logit divided by
    it and a negative one multiplied by it, before the temperature (Hugging Face / vLLM semantics; greedy
    rows too). Like top-k / top-p / min_p a part of the sampler: log-probs stay those of the
    temperature-scaled model distribution without it."""
    min_new_tokens: int = 0
    """EOS and stop tokens are suppressed until this many tokens were generated."""
    max_new_tokens: int = 128
    """Hard cap on generated tokens (finish reason ``length``)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the tokenizer's EOS always does unless ignore_eos)."""
    stop: tuple[str, ...] = ()
    """Stop strings, checked on the decoded output."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens (benchmarks)."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same tokens."""
    detokenize: bool = True
    """Fill ``GenerationOutput.text``. False: the caller reads only the tokens (a workflow that decodes
    its completions itself), so areno's engine and rollout server skip decoding them and leave the
    text empty, except a stop string's cut text; vLLM and SGLang servers return their text anyway."""

    def __post_init__(self) -> None:
        # types first: a string would otherwise fail the range checks below as a raw comparison error
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"SamplingParams.{name}: must be a number, got {value!r}")
        for name in ("top_k", "min_new_tokens", "max_new_tokens", "seed"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, numbers.Integral)) and not (
                name == "seed" and value is None
            ):
                raise TypeError(f"SamplingParams.{name}: must be an integer, got {value!r}")
        # NaN passed a `< 0` check and sampled greedily; a seed past MAX_SEED collided with another in the
        # sampler's float64 table (the server refused both; the Python API and agent clients did not)
        if not (self.temperature == 0 or (math.isfinite(self.temperature) and self.temperature >= MIN_TEMPERATURE)):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if self.seed is not None and abs(self.seed) > MAX_SEED:
            raise ValueError(f"seed must be within +-{MAX_SEED} (2**53 - 1), got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:  # NaN fails both comparisons
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not (0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):  # "" is found at once: one token, then stop
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")


@dataclass(kw_only=True)
class GenerationOutput:
    """What the rollout engine returns for one request."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """Log-prob of each output token under the temperature-scaled sampling distribution."""
    output_versions: list[int]
    """Policy version that produced each output token (changes mid-request after a weight swap)."""
    finish_reason: str
    """``stop`` (EOS / stop token / stop string), ``length`` or ``abort``."""
    text: str = ""
    routes_TLK: torch.Tensor | None = None
    """Mixture-of-experts engines asked to record them: int16 [prompt + output, L, K] top-k expert ids
    of every sparse layer for each token the engine ran a forward for, -1 where it ran none."""


@dataclass(kw_only=True)
class Trajectory:
    """One sequence to train on: a prompt and what the policy produced after it.

    ``completion_mask`` lets multi-turn workflows exclude environment/tool tokens that sit inside
    the completion from the loss (1 = model-generated, trained).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    """Behaviour log-probs of completion tokens (0 where completion_mask is 0)."""
    versions: list[int]
    """Policy version per completion token (-1 where completion_mask is 0)."""
    reward: float
    completion_mask: list[int] | None = None
    group_id: str = ""
    """Trajectories of one prompt share a group id (GRPO groups)."""
    finish_reason: str = "stop"
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form metadata: the sample, the answer, turn count, store keys of large observations."""
    extra_T: dict[str, list[float]] = field(default_factory=dict)
    """Per-completion-token values a workflow measured (``teacher_executed_T``: 1 where the teacher
    generated the token); ``TokenBatch.from_trajectories`` packs each into ``batch.extra`` (0 on
    prompt tokens, and on every token of a trajectory without the key). Names end in ``_T``."""
    routes_TLK: torch.Tensor | None = None
    """The rollout's expert ids of a mixture-of-experts policy (``GenerationOutput.routes_TLK``) over
    the prompt and completion; ``from_trajectories`` packs them into ``batch.extra[ROUTES_KEY]``."""

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"trajectory lengths differ: completion {n}, logprobs {len(self.logprobs)}, "
                f"versions {len(self.versions)}"
            )
        if self.completion_mask is None:
            self.completion_mask = [1] * n
        elif len(self.completion_mask) != n:
            raise ValueError(f"completion_mask has {len(self.completion_mask)} entries, expected {n}")
        for key, values in self.extra_T.items():
            if not key.endswith("_T") or len(values) != n:
                raise ValueError(
                    f"trajectory extra_T[{key!r}]: needs a name ending in _T and one value per completion "
                    f"token ({n}), got {len(values)}"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(kw_only=True)
class TokenBatch:
    """A packed batch of B sequences (T tokens in all, no padding): the only training input format.

    Per-token tensors follow the alignment convention in this module's docstring. ``extra`` holds
    role-specific per-token or per-sequence tensors (``ref_logprobs_T``, ``values_T``, …) whose
    names end in their shape letter.
    """

    input_ids_T: torch.Tensor
    """int64 [T] token ids of all sequences, concatenated."""
    cu_seqlens_B1: torch.Tensor
    """int64 [B+1] sequence boundaries: sequence b is input_ids_T[cu[b]:cu[b+1]]."""
    loss_mask_T: torch.Tensor
    """bool [T] tokens trained on (model-generated completion tokens)."""
    logprobs_T: torch.Tensor
    """float32 [T] behaviour log-probs (0 where not in the loss)."""
    versions_T: torch.Tensor
    """int64 [T] policy version that produced each token (-1 for prompt/environment tokens)."""
    advantages_T: torch.Tensor
    """float32 [T] per-token advantages (0 outside the loss mask)."""
    rewards_B: torch.Tensor
    """float32 [B] scalar reward per sequence."""
    group_ids: list[str] = field(default_factory=list)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    images_B: list[Any] = field(default_factory=list)
    """Vision-language batches: per sequence, its images (``{"pixel_values", "grid_thw"}``, the
    pixels a store reference until the engine fetches them) or None; empty for a text-only batch."""
    truncated_B: torch.Tensor | None = None
    """bool [B]: the sequence's completion ended at a length limit (``finish_reason`` "length", no EOS);
    None where no rollout made the batch (an offline recipe's, one built by hand)."""

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens_B1.numel() - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

    @property
    def seqlens_B(self) -> torch.Tensor:
        return self.cu_seqlens_B1[1:] - self.cu_seqlens_B1[:-1]

    def position_ids_T(self) -> torch.Tensor:
        """Positions restarting at 0 for each packed sequence."""
        seqlens_B = self.seqlens_B
        starts_T = torch.repeat_interleave(self.cu_seqlens_B1[:-1], seqlens_B)
        return torch.arange(self.num_tokens, dtype=torch.long, device=starts_T.device) - starts_T

    def token_indices(self, seq_indices: list[int]) -> torch.Tensor:
        """long [T']: the packed positions of the given sequences' tokens, in the given order."""
        cu = self.cu_seqlens_B1.tolist()
        token_idx = [torch.arange(cu[i], cu[i + 1]) for i in seq_indices]
        return torch.cat(token_idx) if token_idx else torch.zeros(0, dtype=torch.long)

    def select(self, seq_indices: list[int]) -> TokenBatch:
        """A new packed batch holding the given sequences, in the given order."""
        cu = self.cu_seqlens_B1.tolist()
        idx_T = self.token_indices(seq_indices)
        seqlens = torch.tensor([cu[i + 1] - cu[i] for i in seq_indices], dtype=torch.long)
        new_cu = torch.zeros(len(seq_indices) + 1, dtype=torch.long)
        new_cu[1:] = torch.cumsum(seqlens, 0)
        return self.gather(idx_T, new_cu, seq_indices)

    def gather(
        self, idx_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, seq_indices: list[int] | None = None
    ) -> TokenBatch:
        """A new batch of the tokens ``idx_T`` (an index or a bool mask [T]) packed by
        ``cu_seqlens_B1``: every per-token field (and ``extra`` key ending in ``_T``) is indexed; the
        per-sequence ones follow ``seq_indices`` (None keeps them as they are)."""
        seq_idx_B = None if seq_indices is None else torch.tensor(seq_indices, dtype=torch.long)
        per_seq = (lambda v: v) if seq_idx_B is None else (lambda v: v.index_select(0, seq_idx_B))
        if idx_T.dtype == torch.bool:
            per_tok = lambda v: v[idx_T]
        else:  # index_select: ~3x less host time than advanced indexing for these 1-D gathers
            per_tok = lambda v: v.index_select(0, idx_T)
        return dataclasses.replace(
            self,
            input_ids_T=per_tok(self.input_ids_T),
            cu_seqlens_B1=cu_seqlens_B1,
            loss_mask_T=per_tok(self.loss_mask_T),
            logprobs_T=per_tok(self.logprobs_T),
            versions_T=per_tok(self.versions_T),
            advantages_T=per_tok(self.advantages_T),
            rewards_B=per_seq(self.rewards_B),
            group_ids=self.group_ids
            if seq_indices is None or not self.group_ids
            else [self.group_ids[i] for i in seq_indices],
            extra={k: (per_tok(v) if k.endswith("_T") else per_seq(v)) for k, v in self.extra.items()},
            images_B=self.images_B
            if seq_indices is None or not self.images_B
            else [self.images_B[i] for i in seq_indices],
            truncated_B=None if self.truncated_B is None else per_seq(self.truncated_B),
        )

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory]) -> TokenBatch:
        """Pack trajectories (advantages left at 0; a specialization fills them)."""
        if not trajectories:
            raise ValueError("cannot build a TokenBatch from zero trajectories")
        # joined through numpy (a third of torch.tensor's time on a list): a Python step per token
        # cost ~30 ms at 64 x 576 tokens, on the critical path between rollout and training
        ids = join_flat([p for t in trajectories for p in (t.prompt_ids, t.completion_ids)], np.int64)
        # masks and versions are mostly one value per trajectory: filled, not converted per token
        loss_mask_T = join_flat(
            [p for t in trajectories for p in (_fill(t, 0), t.completion_mask)], np.bool_, runs=True
        )
        logprobs_T = join_flat([p for t in trajectories for p in (_fill(t, 0), t.logprobs)], np.float32)
        versions_T = join_flat([p for t in trajectories for p in (_fill(t, -1), t.versions)], np.int64, runs=True)
        logprobs_T.masked_fill_(~loss_mask_T, 0.0)
        versions_T.masked_fill_(~loss_mask_T, -1)
        cu = [0, *accumulate(t.num_tokens for t in trajectories)]
        # The first token of a sequence is never a target (nothing predicts it).
        loss_mask_T[torch.tensor(cu[:-1])] = False
        extra: dict[str, torch.Tensor] = {}
        keys = sorted({k for t in trajectories for k in t.extra_T})
        # joined like the fields above (a Python list of every value cost ~110 ms a key at 2.3M tokens);
        # prompt tokens, and a trajectory without the key, get views of one zero array
        zeros = np.zeros(max(t.num_tokens for t in trajectories) if keys else 0, dtype=np.float32)
        for key in keys:
            extra[key] = join_flat(
                [
                    p
                    for t in trajectories
                    for p in (zeros[: len(t.prompt_ids)], t.extra_T.get(key, zeros[: len(t.completion_ids)]))
                ],
                np.float32,
            )
        if any(t.routes_TLK is not None for t in trajectories):
            extra[ROUTES_KEY] = _pack_routes(trajectories)
        parts = [t.info.get(REWARD_PARTS_INFO_KEY) for t in trajectories]
        if parts[0] and all(p is not None and len(p) == len(parts[0]) for p in parts):
            extra[REWARD_PARTS_KEY] = torch.tensor(parts, dtype=torch.float32)
        images_B = [t.info.get("images") for t in trajectories]
        return cls(
            input_ids_T=ids,
            cu_seqlens_B1=torch.tensor(cu, dtype=torch.long),
            loss_mask_T=loss_mask_T,
            logprobs_T=logprobs_T,
            versions_T=versions_T,
            advantages_T=torch.zeros(len(ids), dtype=torch.float32),
            rewards_B=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            group_ids=[t.group_id for t in trajectories],
            extra=extra,
            images_B=images_B if any(im is not None for im in images_B) else [],
            truncated_B=torch.tensor([t.finish_reason == "length" for t in trajectories], dtype=torch.bool),
        )

    @classmethod
    def concat(cls, parts: list[TokenBatch]) -> TokenBatch:
        """Batches packed by ``from_trajectories``, end to end: equal to ``from_trajectories`` of
        their trajectories joined (a part without an ``extra`` key holds what a trajectory without
        it gets there: 0, and -1 for the expert routes). It lets groups be packed as they finish."""
        if not parts:
            raise ValueError("cannot build a TokenBatch from zero trajectories")
        if len(parts) == 1:
            return parts[0]
        offsets = accumulate((p.num_tokens for p in parts[:-1]), initial=0)
        cu = torch.cat([parts[0].cu_seqlens_B1[:1], *(p.cu_seqlens_B1[1:] + o for p, o in zip(parts, offsets))])
        extra: dict[str, torch.Tensor] = {}
        for key in sorted({k for p in parts for k in p.extra}):
            # from_trajectories packs per-token values and the per-sequence reward parts
            assert key.endswith("_T") or key == REWARD_PARTS_KEY, key
            like = next(p.extra[key] for p in parts if key in p.extra)
            if key == REWARD_PARTS_KEY:  # a part without them: NaN rows (an estimator that reads them refuses)
                extra[key] = torch.cat(
                    [p.extra.get(key, like.new_full((p.num_seqs, *like.shape[1:]), math.nan)) for p in parts]
                )
                continue
            fill = -1 if key == ROUTES_KEY else 0
            extra[key] = torch.cat(
                [p.extra.get(key, like.new_full((p.num_tokens, *like.shape[1:]), fill)) for p in parts]
            )
        has_images = any(p.images_B for p in parts)
        return cls(
            input_ids_T=torch.cat([p.input_ids_T for p in parts]),
            cu_seqlens_B1=cu,
            loss_mask_T=torch.cat([p.loss_mask_T for p in parts]),
            logprobs_T=torch.cat([p.logprobs_T for p in parts]),
            versions_T=torch.cat([p.versions_T for p in parts]),
            advantages_T=torch.cat([p.advantages_T for p in parts]),
            rewards_B=torch.cat([p.rewards_B for p in parts]),
            group_ids=[g for p in parts for g in p.group_ids],
            extra=extra,
            images_B=[im for p in parts for im in (p.images_B or [None] * p.num_seqs)] if has_images else [],
            truncated_B=None
            if any(p.truncated_B is None for p in parts)
            else torch.cat([p.truncated_B for p in parts]),
        )


def join_flat(parts: list, dtype, *, runs: bool = False) -> torch.Tensor:
    """The sequences ``parts`` (lists or arrays) end to end as one tensor of numpy ``dtype``.
    ``runs``: a list holding one value throughout is repeated from its first item rather than
    converted item by item (the same result; integer and bool dtypes only, where equal values
    convert alike)."""
    if not runs:
        return torch.from_numpy(np.concatenate([_as_array(p, dtype) for p in parts]))
    assert np.dtype(dtype).kind in "biu", dtype  # a float run could hold both 0.0 and -0.0
    parts = [p for p in parts if len(p)]
    heads = [p[:1] if type(p) is list and p.count(p[0]) == len(p) else None for p in parts]
    lengths = [len(p) for p in parts]
    if all(h is not None for h in heads):  # one conversion and one repeat for the whole batch
        return torch.from_numpy(np.repeat(np.asarray([h[0] for h in heads], dtype=dtype), lengths))
    arrays = [np.asarray(p if h is None else h, dtype=dtype) for p, h in zip(parts, heads)]
    return torch.from_numpy(
        np.concatenate([a if h is None else np.repeat(a, n) for a, h, n in zip(arrays, heads, lengths)])
    )


def _as_array(part: Any, dtype) -> np.ndarray:
    """``part`` (a list, an array, or a tensor on any device and of any dtype numpy lacks) as a ``dtype`` array."""
    if isinstance(part, torch.Tensor):
        part = part.detach().cpu()
        part = (part.float() if part.is_floating_point() else part).numpy()
    return np.asarray(part, dtype=dtype)


def _fill(traj: Trajectory, value: int) -> list[int]:
    """``value`` over the trajectory's prompt tokens."""
    return [value] * len(traj.prompt_ids)


ROUTES_KEY = "moe_routes_T"
"""``TokenBatch.extra`` key of the rollout's routes: int16 [T, L, K], -1 where none was recorded."""
REWARD_PARTS_INFO_KEY = "reward_parts"
"""``Trajectory.info`` key of a ``reward.fn`` list's scores, unweighted, in the list's order (a failed one 0)."""
REWARD_PARTS_KEY = "reward_parts_BK"
"""``TokenBatch.extra`` key of the sequences' ``REWARD_PARTS_INFO_KEY`` scores: float32 [B, K], packed where every
trajectory has K of them (NaN rows for a batch joined with one that had none: ``concat``)."""


def _pack_routes(trajectories: list[Trajectory]) -> torch.Tensor:
    """The trajectories' ``routes_TLK`` packed [T, L, K]; -1 rows for a trajectory without them."""
    _, L, K = next(t.routes_TLK for t in trajectories if t.routes_TLK is not None).shape
    parts = []
    for t in trajectories:
        routes = t.routes_TLK
        if routes is None or routes.shape[0] != t.num_tokens:
            routes = torch.full((t.num_tokens, L, K), -1, dtype=torch.int16)
        parts.append(routes)
    return torch.cat(parts)


# ------------------------------------------------------------------------------ packed layout
def repeat_per_sequence(values_B: torch.Tensor, cu_seqlens_B1: torch.Tensor) -> torch.Tensor:
    """``values_B[b]`` repeated over sequence b's tokens ([T], on values' device). The token count
    is read from ``cu_seqlens_B1``: pass host bounds (as the training backend does) and nothing
    waits on the GPU."""
    T = int(cu_seqlens_B1[-1])
    cu = cu_seqlens_B1.to(values_B.device, non_blocking=True)
    return torch.repeat_interleave(values_B, cu[1:] - cu[:-1], output_size=T)


def sequence_index_T(cu_seqlens_B1: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """int64 [T] index of the sequence each packed token belongs to, on ``device``."""
    return repeat_per_sequence(torch.arange(cu_seqlens_B1.numel() - 1, device=device), cu_seqlens_B1)


@dataclass(kw_only=True)
class RolloutBatch:
    """What one rollout produces: trajectories, their packed batch, and rollout metrics."""

    trajectories: list[Trajectory]
    batch: TokenBatch
    metrics: dict[str, float] = field(default_factory=dict)
    pass_order: list[int] | None = None
    """Set on a later optimizer pass (``reshuffle``): this batch is the rollout's sequences in this
    order, and the backend reuses the first pass's no-grad forwards (proximal / old / reference
    log-probs of the iteration's start). None: the rollout as generated, a first pass."""
