"""AdamW, learning-rate schedules, global grad-norm clipping (DTensor-aware) and the non-finite
step guard."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from areno.errors import ConfigError
from areno.train.config import OptimConfig, TrainBackendConfig
from areno.train.dtensor import is_dtensor, local_tensor


class NonFiniteStepError(ConfigError):
    """Too many optimizer steps in a row had a non-finite loss or grad norm and were skipped.

    A :class:`ConfigError` (a user error) so that the CLI prints it as one line: the usual causes are a
    learning rate that is too high, a broken reward/advantage (NaN), or bad data, and training on would
    only waste compute on a diverged model.
    """

    def __init__(self, *, role: str, step: int, consecutive: int, loss: float, grad_norm: float) -> None:
        who = f"role {role!r}" if role else "the training backend"
        super().__init__(
            f"{who} skipped {consecutive} optimizer steps in a row (last: step {step}, loss={loss:g}, "
            f"grad_norm={grad_norm:g}) because the loss or gradient norm was NaN/inf; stopping instead of "
            f"training on garbage: lower optim.lr, check the reward/advantages and data for NaN, or raise "
            f"train.max_consecutive_skips (0 never stops)"
        )
        self.role, self.step, self.consecutive = role, step, consecutive


class NonFiniteParametersError(ConfigError):
    """The parameters became NaN/inf (an update overflowed): the run stops before it saves them.

    A :class:`ConfigError` for the reasons of :class:`NonFiniteStepError`; skipping steps cannot
    bring such a model back.
    """

    def __init__(self, *, role: str, step: int, when: str) -> None:
        who = f"role {role!r}" if role else "the training backend"
        super().__init__(
            f"{who}: the parameters are NaN/inf after step {step} ({when}); stopping without saving them: "
            "lower optim.lr and resume from the last checkpoint (resume=auto)"
        )
        self.role, self.step = role, step


def nonfinite_parameters(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """How many of this rank's parameters (local shards of DTensors) hold a NaN/inf, as a 0-dim
    float tensor on their device (the caller all-reduces it)."""
    count: torch.Tensor | None = None
    for p in params:
        local = local_tensor(p)
        bad = (~torch.isfinite(local.detach())).any().float()
        count = bad if count is None else count + bad
    return count if count is not None else torch.zeros(())


class LocalShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose update runs on the local shards of DTensor parameters.

    Parameters and optimizer state stay DTensors (so ``state_dict``, distributed checkpoints and
    sleep/wake see the same objects), but the foreach / fused kernels are called on their
    ``_local_tensor``s: AdamW is element-wise, so each shard's update needs nothing from other
    ranks, and DTensor's dispatch (sharding propagation over every list element of every
    foreach op) is pure host cost. The values are the same as ``AdamW`` on the DTensors.
    """

    def _init_group(self, group, *tensor_lists):
        # AdamW's step fills these lists (params, grads, exp_avgs, ...) and then calls the
        # functional update on them: swap each DTensor for its local shard in between.
        has_complex = super()._init_group(group, *tensor_lists)
        for tensors in tensor_lists:
            if isinstance(tensors, list):  # (torch versions before 2.6 also passed an amsgrad flag here)
                tensors[:] = [t._local_tensor if is_dtensor(t) else t for t in tensors]
        return has_complex


def trainable_parameters(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters that require a gradient; a ValueError when there are none."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: set trainable=False for a frozen role")
    return params


def decays(param: torch.Tensor, cfg: OptimConfig) -> bool:
    """Whether ``optim.weight_decay`` applies to ``param``: weights of two or more dimensions always, the
    one-dimensional ones (biases, norm scales) with ``decay_biases_and_norms``."""
    return cfg.decay_biases_and_norms or param.ndim >= 2


def param_groups(params: list[torch.nn.Parameter], cfg: OptimConfig) -> list[dict]:
    """AdamW's parameter groups: the parameters ``optim.weight_decay`` applies to (``decays``), then those
    it does not (weight decay 0); a group without parameters is left out."""
    split = ([p for p in params if decays(p, cfg)], [p for p in params if not decays(p, cfg)])
    return [
        {"params": group, "weight_decay": cfg.weight_decay if decay else 0.0}
        for group, decay in zip(split, (True, False))
        if group
    ]


def group_weight_decay(group: dict, cfg: OptimConfig) -> float:
    """The weight decay of one of the optimizer's param groups under ``cfg``: ``optim.weight_decay`` where its
    parameters decay (a group is all of one kind, ``param_groups``), else 0."""
    return cfg.weight_decay if decays(group["params"][0], cfg) else 0.0


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainBackendConfig, device: str) -> LocalShardAdamW:
    """AdamW over the trainable parameters (on DTensors' local shards: ``LocalShardAdamW``), in the groups of
    ``param_groups``: torch's fused kernel on CUDA and CPU (one pass over each tensor instead of a foreach
    op per term of the update, which made the CPU update a large share of a small model's step), foreach
    elsewhere."""
    params = trainable_parameters(params)
    fused = device in ("cuda", "cpu")
    return LocalShardAdamW(
        param_groups(params, cfg),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused,
        foreach=None if fused else True,
    )


def lr_factor(step: int, cfg: TrainBackendConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based: the first step uses step=0).

    linear_warmup: (step + 1) / warmup_steps during warm-up, then 1. cosine: the same warm-up, then
    ``min + (1 - min) * (1 + cos(pi * progress)) / 2`` with progress from 0 at the end of warm-up to 1
    at total_steps (held at the minimum afterwards). linear: the same warm-up, then ``min + (1 - min) *
    (1 - progress)``.
    """
    if cfg.schedule == "constant":
        return 1.0
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "linear_warmup":
        return 1.0
    assert cfg.total_steps is not None
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    left = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * left


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainBackendConfig) -> torch.optim.lr_scheduler.LambdaLR:
    # a partial, not a callable object: LambdaLR saves an object's __dict__ (here the config) in its
    # state_dict, which checkpoints must not carry (they load with torch.load(weights_only=True))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, cfg=cfg))


def _group_key(grad: torch.Tensor) -> tuple:
    if is_dtensor(grad):
        return (id(grad.device_mesh), grad.placements, grad.device.type)
    return (None, None, grad.device.type)


def global_grad_norm(params: Iterable[torch.nn.Parameter]) -> tuple[float, list[list[torch.Tensor]]]:
    """L2 norm of all gradients (full, unsharded) and the gradients' local shards grouped for
    foreach ops (``clip_grads`` then scales them without DTensor dispatch).

    Gradients on different device meshes (FSDP-only vs FSDP x TP parameters) cannot share one
    foreach kernel, so the norm is taken per group: the norm of the group's local shards (plain
    foreach kernels, no DTensor dispatch), squared and summed over the mesh dimensions the group is
    sharded on (replicated dimensions hold copies). One host read for all groups.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_group_key(p.grad), []).append(p.grad)
    local_groups = [[g._local_tensor if is_dtensor(g) else g for g in grads] for grads in groups.values()]
    norms = []
    for grads, local in zip(groups.values(), local_groups):
        norm = torch.nn.utils.get_total_norm(local, norm_type=2.0)
        first = grads[0]
        if is_dtensor(first):
            mesh = first.device_mesh
            shard_dims = [i for i, pl in enumerate(first.placements) if pl.is_shard() and mesh.size(i) > 1]
            assert not any(pl.is_partial() for pl in first.placements), "gradients are never Partial here"
            if shard_dims:  # sum of squares over the shards, then back to a norm
                sq = norm.float().square()
                for dim in shard_dims:
                    dist.all_reduce(sq, group=mesh.get_group(dim))
                norm = sq.sqrt()
        norms.append(norm.float())
    total_sq = 0.0
    for value in torch.stack(norms).tolist() if norms else []:  # one host read for every group
        total_sq += value**2
    return math.sqrt(total_sq), local_groups


def clip_grads(grad_groups: list[list[torch.Tensor]], total_norm: float, max_norm: float) -> None:
    """Scale gradients in place so that their global norm is at most ``max_norm``."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for grads in grad_groups:
            torch._foreach_mul_(grads, coef)
