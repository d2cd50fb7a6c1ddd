"""``RecipeRunner``: one training step of a recipe over its roles' training backends.

    step(rollout_data):
        1. no-grad forwards: every DataSync and RewardSync source and every role with self-forward keys
           runs ``forward_only`` once on the step's batch (cached per role);
        2. inject: a RewardSync's weighted scores are added to the batch's rewards, DataSync outputs
           become target batch ``extra`` tensors;
        3. each trainable role: ``prepare_batch`` then ``train_step`` — concurrently in threads
           for roles on different backends, serialised for roles sharing one backend;
        4. every trained role's weight version + 1, its specialization's ``after_optimizer_step`` (an
           adaptive coefficient's update; ``checkpoint_state`` keeps it); a ``reference_sync``'s frozen role
           moves toward its source every ``every`` optimizer steps of it.

    With ``num_minibatches = k > 1`` step 3 runs k times, on consecutive slices of the prepared
    batch (each one optimizer step) — all on the forwards of step 1.

    step(rollout_data, pass_order=order): a later optimizer pass (``train.num_train_passes``) over
    the previous first pass's rollout, its sequences in ``order``: steps 1-3's forwards and
    prepared batches are reused, so proximal / old / reference log-probs stay those of the
    iteration's start (as PPO's epochs: the trust region of a decoupled or recomputed-old-logprob
    loss acts from the second pass on; recomputing them every pass would keep the ratio at 1).

``roles_to_sync()`` names the roles whose weights the caller then publishes to rollout.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from areno.recipes.config import RewardSync, TrainingConfig
from areno.specializations.base import (
    POLICY_VERSION_KEY,
    ModelSpecialization,
    check_methods,
    check_returns_batch,
    kept_sequences,
    without_gradient_free,
)
from areno.types import TokenBatch

ROLLOUT_INDEX_KEY = "rollout_index_B"
"""Batch extra key the RecipeRunner adds before ``prepare_batch``: each sequence's index in the step's
rollout batch, so that a later pass finds the sequences a prepared batch kept (dynamic sampling drops some)."""

SPECIALIZATION_STATE_KEY = "specialization_state"
"""A role checkpoint's ``extra_state`` key for its specialization's ``state_dict`` (``RecipeRunner.checkpoint_state``)."""


class RecipeRunner:
    """Dispatches a recipe's roles onto their ``TrainBackend``s (one per role name; two roles may
    share a backend object, which serialises them). ``placement``: role -> where it runs (its
    devices); roles with equal placements train one after another, the others concurrently."""

    # set in __init__
    config: TrainingConfig
    backends: dict[str, Any]
    specs: dict[str, ModelSpecialization]
    versions: dict[str, int]

    def __init__(
        self,
        training_config: TrainingConfig,
        backends: dict[str, Any],
        *,
        policy_kwargs: dict[str, Any] | None = None,
        initial_version: int = 0,
        num_minibatches: int = 1,
        placement: dict[str, Any] | None = None,
        measure_rollout_logprobs: bool = False,
    ) -> None:
        if num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
        if policy_kwargs:
            training_config = training_config.with_policy_kwargs(**policy_kwargs)
        names = [r.name for r in training_config.roles]
        missing = [n for n in names if n not in backends]
        if missing:
            raise ValueError(
                f"recipe {training_config.name!r}: no training backend for role(s) {missing}; got {sorted(backends)}"
            )
        for role in training_config.roles:
            cfg = getattr(backends[role.name], "cfg", None)
            if cfg is not None and getattr(cfg, "trainable", True) is False and role.trainable:
                raise ValueError(f"role {role.name!r} is trainable but its backend was built with trainable=False")
        for role in training_config.roles:  # a TrainingConfig built in Python never met get_recipe's check
            check_methods(role.specialization_cls)
        self.config = training_config
        self.backends = {n: backends[n] for n in names}
        self.specs = {r.name: r.build() for r in training_config.roles}
        self.versions = {n: initial_version for n in names}
        self.num_minibatches = num_minibatches
        self.placement = placement
        """Optimizer steps per ``step`` call: the prepared batch is cut into this many consecutive
        minibatches of whole sequences, each one optimizer step, all on the same no-grad forwards
        (AReaL's ppo_n_minibatches: the decoupled clip against pi_prox acts from the second one)."""
        self.measure_rollout_logprobs = measure_rollout_logprobs
        """Compare the rollout's log-probs with the trainer's own, per step (see ``step``)."""
        self._first_pass: dict[str, TokenBatch] | None = None
        """The last first pass's prepared batches (per trainable role), reused by later passes."""
        self._first_pass_seqs = 0
        """The sequences of the last first pass's rollout batch (a prepared batch may keep fewer)."""

    def checkpoint_state(self, role: str, extra_state: dict[str, Any]) -> dict[str, Any]:
        """``extra_state`` for ``role``'s checkpoint with its specialization's state (``state_dict``: an
        adaptive coefficient) under ``SPECIALIZATION_STATE_KEY``, where it has any."""
        state = self.specs[role].state_dict()
        return {**extra_state, SPECIALIZATION_STATE_KEY: state} if state else extra_state

    def restore_state(self, role: str, extra_state: dict[str, Any]) -> None:
        """``role``'s specialization state from its checkpoint's ``extra_state`` (``checkpoint_state``)."""
        self.specs[role].load_state_dict(extra_state.get(SPECIALIZATION_STATE_KEY, {}))
        self._share_state(role)

    def _share_state(self, role: str) -> None:
        """A role trained in a worker process of its own (``RemoteRoleBackend``) computes its loss with that
        process's copy of the specialization: it gets this one's state, where there is any."""
        share = getattr(self.backends[role], "load_specialization_state", None)
        state = self.specs[role].state_dict() if share is not None else None
        if state:
            share(state)

    def roles_to_sync(self) -> list[str]:
        """Roles whose weights go to the rollout engine after a step."""
        return [r.name for r in self.config.roles if r.sync_to_rollout]

    def step(self, rollout_data: TokenBatch, *, pass_order: list[int] | None = None) -> dict[str, float]:
        """Inject syncs, then train every trainable role once; metrics are ``role/name``.
        ``pass_order``: a later pass over the previous first pass's batch (see the module doc);
        ``rollout_data`` must then be that batch in this order."""
        trainable = [r.name for r in self.config.roles if r.trainable]
        if pass_order is not None:
            prepared = self._later_pass(rollout_data, pass_order)
        else:
            prepared = self._prepare(rollout_data, trainable)
            self._first_pass, self._first_pass_seqs = prepared, rollout_data.num_seqs
        metrics: dict[str, float] = {}
        for part in self._minibatches(prepared):  # logged: the last minibatch's metrics
            metrics = self._train(part, trainable)
            metrics |= self._follow(metrics)
        return {**metrics, **self._batch_metrics}

    def _follow(self, metrics: dict[str, float]) -> dict[str, float]:
        """The recipe's ``reference_sync`` after an optimizer step of its source: every ``every`` steps (the
        source backend's count, which a checkpoint restores), the frozen target's weights become
        ``alpha * source + (1 - alpha) * target``. Returns ``<target>/ref_syncs``, the moves so far."""
        sync = self.config.reference_sync
        if sync is None:
            return {}
        step = int(metrics[f"{sync.source}/step"])
        if step % sync.every == 0:
            self.backends[sync.target].mix_weights(self.backends[sync.source].named_weights(), alpha=sync.alpha)
        return {f"{sync.target}/ref_syncs": float(step // sync.every)}

    def prepare(self, rollout_data: TokenBatch) -> dict[str, TokenBatch]:
        """Each trainable role's prepared batch of ``rollout_data`` (steps 1-2 and ``prepare_batch``,
        as ``step`` makes them) with no update: what an offline recipe's held-out evaluation reads."""
        return self._prepare(rollout_data, [r.name for r in self.config.roles if r.trainable], measure=False)

    def _minibatches(self, prepared: dict[str, TokenBatch]) -> list[dict[str, TokenBatch]]:
        n = next(iter(prepared.values())).num_seqs
        k = min(self.num_minibatches, n)
        if k <= 1:
            return [prepared]
        bounds = [round(i * n / k) for i in range(k + 1)]
        return [
            {name: batch.select(list(range(lo, hi))) for name, batch in prepared.items()}
            for lo, hi in zip(bounds[:-1], bounds[1:])
        ]

    def _later_pass(self, rollout_data: TokenBatch, pass_order: list[int]) -> dict[str, TokenBatch]:
        if self._first_pass is None:
            raise ValueError("RecipeRunner.step(pass_order=...) needs a first pass (pass_order=None) on this rollout")
        n = self._first_pass_seqs
        if sorted(pass_order) != list(range(n)) or rollout_data.num_seqs != n:
            raise ValueError(
                f"pass_order must be a permutation of the first pass's {n} sequences; "
                f"got {len(pass_order)} indices for a batch of {rollout_data.num_seqs}"
            )
        out = {}
        for name, batch in self._first_pass.items():
            # the rollout sequences the prepared batch holds (dynamic sampling drops some), in the new order
            index_B = batch.extra.get(ROLLOUT_INDEX_KEY)
            if index_B is None and batch.num_seqs != n:
                raise ValueError(
                    f"role {name!r}: its prepare_batch kept {batch.num_seqs} of the {n} sequences without "
                    f"batch.extra[{ROLLOUT_INDEX_KEY!r}] (select the batch it was given: extra follows the sequences)"
                )
            at = {i: i for i in range(n)} if index_B is None else {int(i): k for k, i in enumerate(index_B.tolist())}
            out[name] = batch.select([at[i] for i in pass_order if i in at])
        return out

    def _prepare(
        self, rollout_data: TokenBatch, trainable: list[str], *, measure: bool = True
    ) -> dict[str, TokenBatch]:
        outputs: dict[str, dict[str, torch.Tensor]] = {}
        computed_T: dict[str, torch.Tensor] = {}  # a partial forward's tokens
        self._follow_shared(trainable)

        def forward(role: str, free_B: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            if role not in outputs:
                spec = self.specs[role]
                if free_B is None or not bool(free_B.any()):
                    outputs[role] = self.backends[role].forward_only(rollout_data, forward_fn=spec.extract_model_output)
                else:
                    keep = kept_sequences(rollout_data, free_B)
                    part = self.backends[role].forward_only(
                        rollout_data.select(keep), forward_fn=spec.extract_model_output
                    )
                    outputs[role], computed_T[role] = _scattered(rollout_data, keep, part)
            return outputs[role]

        rollout_data, reward_metrics = self._scored_rewards(rollout_data, forward)
        data = {
            r.name: dataclasses.replace(
                rollout_data,
                extra={
                    **rollout_data.extra,
                    POLICY_VERSION_KEY: torch.full((rollout_data.num_seqs,), self.versions[r.name], dtype=torch.long),
                    ROLLOUT_INDEX_KEY: torch.arange(rollout_data.num_seqs),
                },
            )
            for r in self.config.roles
        }
        for sync in self.config.syncs:
            out = forward(sync.source)
            for key, target_key in zip(sync.keys, sync.target_keys):
                data[sync.target].extra[target_key] = out[key]
        for name in trainable:
            keys = self.specs[name].self_forward_keys
            if keys:  # the sequences the step leaves out whatever their values: not forwarded
                out = forward(name, self.specs[name].self_forward_free_B(data[name]))
                for key, target_key in keys.items():
                    data[name].extra[target_key] = out[key]
        synced = [n for n in self.roles_to_sync() if n in trainable]
        if measure:  # what each role's prepare_batch does to the batch (dynamic sampling's drops)
            self._batch_metrics = reward_metrics | {
                f"{name}/{key}": value
                for name in trainable
                for key, value in self.specs[name].prepare_metrics(data[name]).items()
            }
        if measure and self.measure_rollout_logprobs and synced:
            # the policy's own no-grad forward (shared with a recompute the loss asks for)
            # only tokens sampled by the policy version being trained: staleness is not mismatch
            current_T = rollout_data.versions_T == self.versions[synced[0]]
            current_T &= computed_T.get(synced[0], torch.ones_like(current_T))
            self._batch_metrics |= logprob_diff_metrics(
                rollout_data.logprobs_T, forward(synced[0])["logprobs_T"], rollout_data.loss_mask_T.bool() & current_T
            )
        prepared = {
            name: check_returns_batch(self.specs[name].prepare_batch(data[name]), self.specs[name], "prepare_batch")
            for name in trainable
        }
        if measure:  # what the prepared batches hold (the advantages)
            for name in trainable:
                self._batch_metrics |= {
                    f"{name}/{key}": value for key, value in self.specs[name].batch_metrics(prepared[name]).items()
                }
        return prepared

    def _follow_shared(self, trainable: list[str]) -> None:
        """Each trainable role takes what the others share (``shared_state``: the policy's KL coefficient, which a
        critic's returns follow) before the step prepares its batches."""
        for name in trainable:
            shared = {k: v for other in trainable if other != name for k, v in self.specs[other].shared_state().items()}
            if shared:
                self.specs[name].follow(shared)

    def _scored_rewards(self, rollout_data: TokenBatch, forward: Any) -> tuple[TokenBatch, dict[str, float]]:
        """``rollout_data`` with each ``RewardSync``'s weighted score added to its rewards (the roles' forwards
        through ``forward``), and what ``with_model_rewards`` logs of them."""
        if not self.config.reward_syncs:
            return rollout_data, {}
        scores = {sync.source: forward(sync.source)[sync.key] for sync in self.config.reward_syncs}
        rewards_B, metrics = with_model_rewards(
            rollout_data.rewards_B, self.config.reward_syncs, scores, rollout_data.truncated_B
        )
        return dataclasses.replace(rollout_data, rewards_B=rewards_B), metrics

    def reward_scores(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """``reward_model_scores`` of ``batch`` by this runner's backends: what a held-out evaluation adds."""
        return reward_model_scores(self.config, self.backends, batch)

    _batch_metrics: dict[str, float] = {}
    """The step's figures of its rollout batch, the same for every pass over it."""

    def _train(self, prepared: dict[str, TokenBatch], trainable: list[str]) -> dict[str, float]:
        # group roles by placement (else by backend object): roles in one group run one after another
        groups: dict[Any, list[str]] = {}
        for name in trainable:
            key = self.placement[name] if self.placement is not None else id(self.backends[name])
            groups.setdefault(key, []).append(name)

        def run_group(names: list[str]) -> dict[str, float]:
            metrics: dict[str, float] = {}
            for name in names:
                spec = self.specs[name]
                batch, skipped = prepared[name], None
                # a backend that truncates long sequences shortens them after this point: the left-out
                # sequences' share of the denominator, counted here, would be their untruncated one
                if getattr(getattr(self.backends[name], "cfg", None), "long_sequences", "error") != "truncate":
                    batch, skipped = without_gradient_free(spec, batch)
                result = self.backends[name].train_step(
                    batch,
                    forward_fn=spec.extract_model_output,
                    loss_fn=spec.compute_loss,
                    denominator_fn=spec.step_denominator,
                )
                # the statistics (reduce_stats': "actor/ratio", ...) as means over the trained tokens; none
                # where no token trained (dapo, every group's rewards equal): a mean of nothing read as 0
                kept = spec.denominator(batch) if skipped else result.get("loss_denominator", 1.0)
                scale = spec.step_denominator(batch) / kept if skipped and kept else 1.0
                result = {k: v * scale if "/" in k else v for k, v in result.items() if kept or "/" not in k}
                metrics.update({f"{name}/{k}": float(v) for k, v in result.items()})
                # the sequences of the step's batch, which an adaptive KL controller's update is proportional to
                adapted = spec.after_optimizer_step({**result, "batch_seqs": float(prepared[name].num_seqs)})
                metrics.update({f"{name}/{k}": float(v) for k, v in adapted.items()})
                self._share_state(name)
                if skipped is not None:
                    metrics[f"{name}/skipped_zero_grad_seqs"] = float(skipped)
            return metrics

        metrics: dict[str, float] = {}
        if len(groups) == 1:
            metrics.update(run_group(next(iter(groups.values()))))
        else:
            with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="role") as pool:
                for result in pool.map(run_group, groups.values()):
                    metrics.update(result)
        for name in trainable:
            self.versions[name] += 1
        return metrics


def reward_model_scores(config: TrainingConfig, backends: dict[str, Any], batch: TokenBatch) -> dict[str, torch.Tensor]:
    """Each ``RewardSync`` source's score of every sequence of ``batch`` (float32 [B], on the CPU), by a no-grad
    forward of its backend in ``backends``: what a held-out evaluation adds to its rewards (``with_model_rewards``)."""
    out = {}
    for sync in config.reward_syncs:
        spec = config.role(sync.source).build()
        scores = backends[sync.source].forward_only(batch, forward_fn=spec.extract_model_output)
        out[sync.source] = scores[sync.key].detach().float().cpu()
    return out


def with_model_rewards(
    rewards_B: torch.Tensor,
    syncs: tuple[RewardSync, ...],
    scores: dict[str, torch.Tensor],
    truncated_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``rewards_B`` + each ``RewardSync``'s weight times its source's score ``scores[source]`` [B], less its
    ``missing_eos_penalty`` where ``truncated_B``, and the figures to log: ``<source>/score_mean`` / ``_std`` (the
    model's own scores) and ``<source>/reward_mean`` (the sum)."""
    rewards_B = rewards_B.float()
    metrics: dict[str, float] = {}
    for sync in syncs:
        score_B = scores[sync.source].detach().float().to(rewards_B.device)
        penalty_B = torch.zeros_like(score_B)
        if sync.missing_eos_penalty:
            if truncated_B is None:
                raise ValueError(
                    f"RewardSync {sync.source}: missing_eos_penalty needs the batch's truncated_B (which sequences were "
                    "cut at the length limit; TokenBatch.from_trajectories sets it from each finish_reason)"
                )
            penalty_B = sync.missing_eos_penalty * truncated_B.to(score_B.device, torch.float32)
        rewards_B = rewards_B + sync.weight * (score_B - penalty_B)
        metrics[f"{sync.source}/score_mean"] = score_B.mean().item()
        metrics[f"{sync.source}/score_std"] = score_B.std(unbiased=False).item()
        metrics[f"{sync.source}/reward_mean"] = rewards_B.mean().item()
    return rewards_B, metrics


def _scattered(
    batch: TokenBatch, keep: list[int], part: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A forward of ``batch.select(keep)`` laid out over ``batch``'s tokens, and which tokens it
    computed. The others keep the batch's own tensor of that name (the rollout's log-probs), else zero:
    finite values that the step's loss multiplies by a zero advantage or drops."""
    index_T = batch.token_indices(keep)
    computed_T = torch.zeros(batch.num_tokens, dtype=torch.bool)
    computed_T[index_T] = True
    out: dict[str, torch.Tensor] = {}
    for key, value in part.items():
        if value.shape[0] != index_T.numel():
            raise ValueError(f"a partial self-forward needs per-token outputs; {key!r} has shape {tuple(value.shape)}")
        own = getattr(batch, key, None)
        full = own.to(value) if isinstance(own, torch.Tensor) and own.shape == (batch.num_tokens,) else None
        full = full.clone() if full is not None else value.new_zeros((batch.num_tokens, *value.shape[1:]))
        full[index_T.to(value.device)] = value
        out[key] = full
    return out, computed_T


def logprob_diff_metrics(
    rollout_logprobs_T: torch.Tensor, trainer_logprobs_T: torch.Tensor, loss_mask_T: torch.Tensor
) -> dict[str, float]:
    """``rollout/logprob_abs_diff_mean`` and ``_max``: |rollout log-prob - trainer log-prob| over
    the tokens of ``loss_mask_T`` (the train/inference mismatch of an inference server's numerics)."""
    mask_T = loss_mask_T.to(torch.bool)
    if not mask_T.any():
        return {}
    diff_T = (rollout_logprobs_T.float().cpu() - trainer_logprobs_T.detach().float().cpu()).abs()[mask_T.cpu()]
    return {"rollout/logprob_abs_diff_mean": float(diff_T.mean()), "rollout/logprob_abs_diff_max": float(diff_T.max())}
