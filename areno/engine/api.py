"""ArenoEngine: one engine over two seams (seed 000), and the settings both placements share.

The engine holds the data stream, the rollout pool (``WorkflowExecutor``, ``SampleLedger``,
staleness) and two sides (``engine/seams.py``): a ``TrainingSide`` where the recipe's roles train
and a ``RolloutSide`` that generates. Colocated (the default), both live in this process
(``engine/local.py``); partitioned, both are worker processes of one world (``engine/remote.py``).
``build_engine`` (``engine/placement.py``) picks them from the config.

    generate_rollout(rollout_id)  prompts -> WorkflowExecutor -> RolloutWorkflow.run_episode
                                   -> RolloutSide.client; trajectories -> TokenBatch
    step(rollout)                  TrainingSide.step: inject syncs, then each trainable role trains
    update_weights()               TrainingSide.publish_weights -> RolloutSide.update_weights, version + 1
                                   (an offline recipe: at its next evaluation)

A run that never generates (``generates``: an offline recipe with no held-out evaluation that
generates, e.g. dpo or reward_model) builds no rollout engine: ``ArenoEngine.rollout`` is None.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from areno.algo.filters import dynamic_sampling_kept
from areno.data.datasets import PAIR_KEYS, build_splits, eval_sources
from areno.data.offline import Rendered, RenderedRows
from areno.data.prompts import render_completion, render_prompt
from areno.data.tasks import PromptStream
from areno.data.tokenizer import TOKENIZER_FILES, build_char_tokenizer, load_pretrained_tokenizer
from areno.engine.config import ArenoConfig, build_rollout_engine_config, build_train_backend_config, check_unset
from areno.engine.executor import GroupFilter, RolloutPoolBroken, WorkflowExecutor
from areno.engine.host import HeapFreezer
from areno.engine.ledger import SEQ_KEY, LedgerWorkflow, ResumableStaleness, SampleLedger, SeedingClient
from areno.engine.residency import Phase, Residency
from areno.engine.rollout_side import RolloutSide
from areno.engine.scoring import add_model_scores, ascore_rows, eval_metrics, eval_params, held_burst, rollout_sampling
from areno.engine.seams import SideSetup, WeightKind, choose_weight_kind
from areno.engine.training_side import TrainingSide
from areno.errors import ConfigError, ModelDirError, RunFailure
from areno.faults import fault_point
from areno.models.checkpoint_dirs import newest_checkpoint
from areno.models.hf_io import init_model_dir, missing_model_dir, read_config, tiny_config
from areno.models.vision import ImageInputs, VisionConfig
from areno.recipes import TRAINING_CONFIGS, get_recipe
from areno.recipes.config import ModelRole, RewardSync, TrainingConfig
from areno.recipes.registry import resolve_name
from areno.rewards.combined import part_names
from areno.rewards.loader import (
    check_reward_started,
    load_reward,
    release_reward,
    reward_pool_metrics,
    start_reward,
)
from areno.rollout.store import InProcessStore, fetch_refs, release_refs
from areno.specializations.actor import ActorConfig, ActorSpecialization
from areno.specializations.base import RUN_SET_OPTIONS, takes_option
from areno.specializations.preference import PAIRWISE_SPECIALIZATIONS, DPOSpecialization, pair_metrics
from areno.specializations.scorer import SequenceScorerSpecialization
from areno.train import checkpoint
from areno.train.local import LocalTrainBackend
from areno.types import ROUTES_KEY, RolloutBatch, SamplingParams, TokenBatch, Trajectory, join_flat
from areno.workflows.base import ENGINE_ARGUMENTS, NONFINITE_REWARD_KEY, RolloutWorkflow, load_workflow, routes_dropped
from areno.workflows.common import (
    REWARD_FAILED_PARTS_KEY,
    REWARD_FIGURES_KEY,
    WEIGHTED_SUM_PART,
    prompt_kwargs,
    reward_figure_means,
    store_kwargs,
    takes_param,
    teacher_kwargs,
    warn_reward_errors,
)
from areno.workflows.images import image_prompt, row_images, stash_images, vision_kwargs

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cluster.device=cuda but no CUDA device is visible: use cluster.device=cpu or auto")
    else:
        device = torch.device(name)
    if device.type == "cuda":
        check_cuda_capability(device)
    return device


MIN_CUDA_CAPABILITY = (8, 0)
"""bfloat16, flash attention and areno's Triton decode kernels: Ampere (A100, A10, L4, RTX 30xx) or newer."""


def check_cuda_capability(device: torch.device) -> None:
    """A ConfigError on a GPU older than ``MIN_CUDA_CAPABILITY`` (a V100, a T4), before any model
    loads: there the defaults failed deep inside the first forward."""
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CUDA_CAPABILITY:
        major, minor = capability
        raise ConfigError(
            f"cluster.device: {torch.cuda.get_device_name(device)} has CUDA compute capability {major}.{minor}; "
            "areno's CUDA path (bfloat16, flash attention, its Triton decode kernels) needs 8.0 or newer (A100, "
            "A10, L4, RTX 30xx, H100): use cluster.device=cpu, or a newer GPU"
        )


def rollout_engine_config(cfg: ArenoConfig, *, device: str, dtype: str, num_blocks: int = 0):
    """The ``RolloutEngineConfig`` of a rollout engine from the ``rollout`` section (colocated and
    partitioned alike); ``num_blocks`` 0 sizes the KV pool automatically."""
    return build_rollout_engine_config(
        cfg, device=device, dtype=dtype, max_num_seqs=rollout_max_num_seqs(cfg), num_blocks=num_blocks
    )


def rollout_sequences_in_flight(cfg: ArenoConfig) -> int:
    """Sequences a run can have in flight at once: at most eta + 1 batches of episodes (the staleness
    capacity), each of ``n_samples`` sequences, and no more than ``max_concurrent`` episodes."""
    r = cfg.rollout
    return min(r.max_concurrent, r.batch_size * (r.max_head_offpolicyness + 1)) * r.n_samples


AUTO_MAX_NUM_SEQS = (256, 1024)
"""Bounds of the rollout engine's running batch when ``rollout.max_num_seqs`` is 0 (automatic)."""


def rollout_max_num_seqs(cfg: ArenoConfig) -> int:
    """The rollout engine's running-batch limit: ``rollout.max_num_seqs``, or (0) the run's sequences
    in flight within ``AUTO_MAX_NUM_SEQS``."""
    if cfg.rollout.max_num_seqs:
        return cfg.rollout.max_num_seqs
    lo, hi = AUTO_MAX_NUM_SEQS
    return max(lo, min(rollout_sequences_in_flight(cfg), hi))


def rollout_sampling_params(cfg: ArenoConfig) -> SamplingParams:
    """The sampling of training rollouts (``rollout`` section); evaluations take ``scoring.eval_params``."""
    return rollout_sampling(cfg)


def warm_up_rollout_engine(engine, cfg: ArenoConfig) -> int:
    """Capture the rollout engine's decode CUDA graphs now (``rollout.cuda_graph_warmup``): batch
    sizes up to the run's concurrency in sequences, contexts up to ``max_new_tokens`` + 256 prompt
    tokens (longer contexts capture their graphs at first use, except on a tensor-parallel engine), the
    training rollouts' sampling and the evaluation's. Returns the graphs held; 0 without CUDA graphs (CPU,
    or turned off). A tensor-parallel engine's failed warm-up stops the run (its ranks' graphs could differ)."""
    r = cfg.rollout
    if not r.cuda_graph_warmup or not r.cuda_graphs or engine.device.type != "cuda":
        return 0
    t0 = time.perf_counter()
    # training requests carry seeds (SeedingClient: a hashed uniform per row, its own graph mode)
    params = [dataclasses.replace(rollout_sampling_params(cfg), seed=0)]
    in_flight = rollout_sequences_in_flight(cfg)
    if cfg.data.num_eval and cfg.train.eval_interval:
        evaluation = eval_params(cfg, cfg.train.eval_samples, cfg.train.eval_temperature, name="train.eval_samples")
        params.append(evaluation if evaluation.temperature == 0 else dataclasses.replace(evaluation, seed=0))
        in_flight = max(in_flight, cfg.data.num_eval * cfg.train.eval_samples)
    try:
        held = engine.warmup_cuda_graphs(list(range(1, in_flight + 1)), r.max_new_tokens + 256, params)
    except (RuntimeError, torch.OutOfMemoryError) as exc:  # graphs are then captured at first use
        if getattr(engine, "tp_size", 1) > 1:
            # its ranks may hold different graphs now, and then launch different collectives (a hang)
            raise RunFailure(
                f"rollout engine: CUDA graph warm-up of a tensor-parallel engine failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): lower rollout.kv_memory_fraction, "
                "or set rollout.cuda_graphs=false"
            ) from exc
        logger.warning(
            "rollout engine: CUDA graph warm-up failed after %.1f s (%s: %s); graphs are captured "
            "when first needed instead (rollout.cuda_graph_warmup=false skips the warm-up)",
            time.perf_counter() - t0,
            type(exc).__name__,
            exc,
        )
        return 0
    logger.info(
        "rollout engine: %d decode CUDA graphs captured in %.1f s (rollout.cuda_graph_warmup)",
        held,
        time.perf_counter() - t0,
    )
    return held


def build_role_backends(cfg: ArenoConfig, recipe, model_dir: Path, new_backend, *, only=None) -> dict:
    """One initialised training backend per recipe role, configured alike colocated and
    partitioned: ``new_backend(TrainBackendConfig)`` makes it (one process, or FSDP2 over a training
    sub-mesh); each role loads its own checkpoint (``role.model_path``, else ``model_dir``) and its
    specialization may wrap the model (value and reward heads). ``only``: the names of the roles
    to build here (the others train elsewhere, ``cluster.role_devices``); None builds all."""
    backends = {}
    for role in recipe.roles:
        if only is not None and role.name not in only:
            continue
        if role.model_path and not role.trainable:  # its tensors score the policy's token ids
            check_same_vocabulary(Path(role.model_path), model_dir, role.name)
            logger.info("role %r: %s, frozen (%s)", role.name, role.model_path, role.specialization_cls.__name__)
        backend = new_backend(build_train_backend_config(cfg, role_name=role.name, trainable=role.trainable))
        backend.initialize(Path(role.model_path or model_dir), wrap_model=role.build().wrap_model)
        backends[role.name] = backend
    # train.compile=auto is resolved by each backend, which knows its device
    compiled = [b for role, b in zip(recipe.roles, backends.values()) if role.trainable and b.cfg.compile]
    if compiled:
        logger.info(
            "training: compiling the training step (train.compile=%s, train.compile_scope=%s) during the first "
            "training step%s; compiled graphs are cached in %s, so a later run of the same shapes loads them",
            cfg.train.compile,
            cfg.train.compile_scope,
            " (the whole layer stack as one graph: minutes on a GPU)" if cfg.train.compile_scope == "model" else "",
            compiled[0].compile_cache,
        )
    return backends


def reward_model_backends(cfg: ArenoConfig, recipe: TrainingConfig, model_dir: Path, device: torch.device) -> dict:
    """The backends of ``recipe``'s reward models alone (its ``RewardSync`` sources), frozen, on ``device``: what
    scores held-out completions away from the training side (``areno eval``, the background test rollout)."""
    new_backend = lambda c: LocalTrainBackend(dataclasses.replace(c, device=device.type))
    return build_role_backends(cfg, recipe, model_dir, new_backend, only={s.source for s in recipe.reward_syncs})


def check_same_vocabulary(role_dir: Path, policy_dir: Path, role: str) -> None:
    """A frozen role with its own checkpoint (teacher, reward model) reads the policy's token ids:
    its tokenizer must map tokens to the same ids (compared when both directories hold one; else
    the vocabulary sizes must match). A one-line ConfigError otherwise."""
    if (role_dir / "tokenizer_config.json").is_file() and (policy_dir / "tokenizer_config.json").is_file():
        same = load_pretrained_tokenizer(role_dir).get_vocab() == load_pretrained_tokenizer(policy_dir).get_vocab()
    else:
        same = read_config(role_dir).vocab_size == read_config(policy_dir).vocab_size
    if not same:
        raise ConfigError(
            f"role {role!r}: the tokenizer of {role_dir} differs from the policy's ({policy_dir}); the role scores the "
            "policy's token ids, so give it a checkpoint with the policy's tokenizer"
        )


INIT_TINY_MARKER = "areno_init_tiny.json"
"""What made a ``model.init_tiny`` model: its arguments and seed (``init_tiny_stale``)."""
COMPLETIONS_FILENAME = "completions.jsonl"
"""What ``observe.log_completions`` writes in the run directory."""


def init_tiny_marker(config: ArenoConfig) -> dict[str, Any]:
    """The arguments a ``model.init_tiny`` model of ``config`` is made from."""
    return json.loads(json.dumps({"init_tiny": config.model.init_tiny, "seed": config.train.seed}))


def init_tiny_stale(config: ArenoConfig) -> dict[str, Any] | None:
    """The marker of the tiny model at ``model.path`` when ``config`` would make another one (other
    ``init_tiny`` arguments or seed), else None (none there yet, the same one, or not areno's)."""
    marker = Path(config.model.path) / INIT_TINY_MARKER
    if config.model.init_tiny is None or not marker.is_file():
        return None
    made = json.loads(marker.read_text())
    return made if made != init_tiny_marker(config) else None


def prepare_model_dir(config: ArenoConfig) -> Path:
    """The checkpoint directory, created from ``model.init_tiny`` when asked to (again, when the one
    there was made from other arguments or another seed, unless the run resumes: its checkpoints and
    reference came from that one); else it must exist."""
    path = Path(config.model.path)
    check_init_tiny_target(config)  # before anything at model.path is moved
    stale = init_tiny_stale(config)
    if (
        stale is not None
        and config.resume is not False
        and checkpoint.latest_complete(Path(config.run_dir) / "checkpoints")
    ):
        logger.warning("model.init_tiny: %s was made from %s; the resumed run keeps it", path, stale)
        stale = None
    elif stale is not None:
        logger.info("model.init_tiny: %s was made from %s; making it from %s", path, stale, init_tiny_marker(config))
    if (stale is not None or not (path / "config.json").is_file()) and config.model.init_tiny is not None:
        _make_tiny_model(config, path)
    if not path.is_dir():
        raise ModelDirError(missing_model_dir("model.path", path))
    if not (path / "config.json").is_file():
        raise ModelDirError(f"model.path: {path} has no config.json: is it a Hugging Face checkpoint directory?")
    return path


def check_init_tiny_target(config: ArenoConfig) -> None:
    """``model.init_tiny`` replaces the directory at ``model.path`` only where nothing can be lost: one
    that does not exist, an empty one, or a tiny model areno made (its marker). A one-line
    ModelDirError otherwise (a checkpoint or run directory names its ``hf/`` export)."""
    path = Path(config.model.path)
    if config.model.init_tiny is None or (path / INIT_TINY_MARKER).is_file() or not path.exists():
        return
    if (path / "config.json").is_file() or (path.is_dir() and not any(path.iterdir())):
        return  # a model without the marker is used as it is (never made again); an empty one is filled
    newest = newest_checkpoint(path)
    export = path / "hf" if (path / "hf" / "config.json").is_file() else newest / "hf" if newest else None
    if export is not None:
        raise ModelDirError(
            f"model.path: {path} is an areno checkpoint or run directory, not a model, and model.init_tiny "
            f"would replace it: start from its export (model.path={export} model.init_tiny=null), or point "
            "model.path at a new directory for the tiny model"
        )
    raise ModelDirError(
        f"model.path: {path} is not an empty directory and holds no config.json, and model.init_tiny would "
        "replace it: point model.path at a new directory for the tiny model, or at a Hugging Face checkpoint "
        "with model.init_tiny=null"
    )


def _make_tiny_model(config: ArenoConfig, path: Path) -> None:
    """``model.init_tiny``'s model at ``path``, made beside it and moved in whole (another run reading the
    directory finds the old model, the new one or, for the moment between two renames, none; never half
    of each)."""
    tokenizer = build_char_tokenizer()
    path = path.resolve()  # a symlinked model.path: the directory it points at is replaced
    made = path.with_name(f"{path.name}.making-{os.getpid()}")
    shutil.rmtree(made, ignore_errors=True)
    init_model_dir(made, tiny_config(len(tokenizer), **config.model.init_tiny), tokenizer, seed=config.train.seed)
    (made / INIT_TINY_MARKER).write_text(json.dumps(init_tiny_marker(config)))
    old = path.with_name(f"{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    made.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def resolve_recipe(config: ArenoConfig):
    """The recipe of ``train.algorithm`` with ``train.algorithm_kwargs`` applied, an online one resolved
    against its rollouts: a factory option ``max_completion_length`` whose default is None (dr_grpo's L,
    dapo's L_max) and that the kwargs leave unset is rollout.max_new_tokens (a length no completion can
    reach is warned about, ``_warn_lengths``), and every role that scores the rollout's tokens by
    log-probs (the policy, a reference, a teacher) does so at rollout.temperature (``_at_temperature``).
    Unknown recipe, bad kwargs, a kwarg the run sets itself (``RUN_SET_OPTIONS``: temperature), a
    teacher role without checkpoint: a ConfigError here, before any model loads."""
    name = config.train.algorithm
    policy_kwargs = dict(config.train.algorithm_kwargs)
    factory = TRAINING_CONFIGS.get(resolve_name(name))  # None: get_recipe names the unknown recipe
    options = inspect.signature(factory).parameters if factory is not None else {}
    for key, setting in RUN_SET_OPTIONS.items():
        if key in policy_kwargs and key not in options:  # a factory's own option of that name is its own
            why = (
                f"an online recipe's roles score the rollout's tokens at the temperature they were sampled at "
                f"({setting}), an offline recipe's at 1"
                if key == "temperature"
                else f"it is {setting}"
            )
            raise ConfigError(f"train.algorithm_kwargs.{key}: set by the run, not the recipe: {why}: drop it")
    recipe = get_recipe(name, policy_kwargs=policy_kwargs)
    if config.reward.model is not None and not recipe.online:
        raise ConfigError(
            f"reward.model: train.algorithm={recipe.name} trains offline on dataset rows, which no reward scores: "
            "unset reward.model, or use an online recipe (grpo, ppo, ...)"
        )
    if not recipe.online:
        return recipe
    length = options.get("max_completion_length")
    if length is not None and length.default is None and "max_completion_length" not in policy_kwargs:
        recipe = get_recipe(
            name, policy_kwargs={**policy_kwargs, "max_completion_length": config.rollout.max_new_tokens}
        )
    _warn_lengths(recipe, policy_kwargs, config.rollout.max_new_tokens)
    if config.rollout.temperature > 0:
        recipe = _at_temperature(recipe, config.rollout.temperature)
    if config.reward.model is not None:
        recipe = with_reward_model(recipe, config)
    if recipe.policy_role.init_kwargs.get("advantage_estimator") == "gdpo":
        recipe = _with_reward_weights(recipe, config)
    return recipe


REWARD_MODEL_ROLE = "reward_model"
"""The frozen role ``reward.model`` adds to a recipe."""


def with_reward_model(recipe: TrainingConfig, config: ArenoConfig) -> TrainingConfig:
    """``recipe`` with ``reward.model`` as the frozen role ``reward_model`` (``SequenceScorerSpecialization``),
    whose score of each sequence, times ``reward.model_weight``, a ``RewardSync`` adds to the rewards before
    training (an online recipe's). A one-line ConfigError where its roles train on no reward, or where
    something decides on the rollout side's rewards before the model has scored (dynamic sampling's further
    rounds, ``gdpo``'s per-function normalisation)."""
    key = "reward.model"
    if REWARD_MODEL_ROLE in (r.name for r in recipe.roles):
        raise ConfigError(f"{key}: recipe {recipe.name} has a role named {REWARD_MODEL_ROLE!r} already")
    spec = recipe.policy_role.build()
    if isinstance(spec, ActorSpecialization):
        options = spec.config
        if options.advantage_estimator == "gdpo":
            raise ConfigError(
                f"{key}: advantage_estimator=gdpo normalises each function of reward.fn on its own, and the reward "
                "model's score is added to their sum on the training side: use advantage_estimator=grpo"
            )
        if options.dynamic_sampling and options.dynamic_sampling_max_rounds != 1:
            raise ConfigError(
                f"{key}: dynamic sampling's further rounds (dynamic_sampling_max_rounds="
                f"{options.dynamic_sampling_max_rounds}) judge groups by the rollout's rewards, before the reward "
                "model scores them on the training side: set train.algorithm_kwargs.dynamic_sampling_max_rounds=1 "
                "(training then drops the groups whose rewards, the model's score included, are all equal)"
            )
    roles = (
        *recipe.roles,
        ModelRole(
            name=REWARD_MODEL_ROLE,
            specialization_cls=SequenceScorerSpecialization,
            trainable=False,
            model_path=config.reward.model,
            init_kwargs={"head_path": config.reward.model},
        ),
    )
    sync = RewardSync(
        source=REWARD_MODEL_ROLE,
        weight=config.reward.model_weight,
        missing_eos_penalty=config.reward.missing_eos_penalty or 0.0,
    )
    try:
        return dataclasses.replace(recipe, roles=roles, reward_syncs=(*recipe.reward_syncs, sync))
    except ConfigError as exc:  # the recipe's roles train on no reward
        raise ConfigError(f"{key}: train.algorithm={recipe.name}: {exc}") from None


def _with_reward_weights(recipe: TrainingConfig, config: ArenoConfig) -> TrainingConfig:
    """``recipe`` whose policy weighs each function of the ``reward.fn`` list by ``reward.weights`` (``gdpo``'s
    advantages normalise each function on its own); a ConfigError where there is no list to normalise."""
    paths = config.reward.paths()
    if not config.reward.several():
        raise ConfigError(
            f"train.algorithm_kwargs.advantage_estimator=gdpo normalises each function of a reward.fn list on its "
            f"own, and reward.fn is one function ({paths[0]}): list two or more (reward.fn=[a,b]), or use "
            "advantage_estimator=grpo"
        )
    weights = tuple(float(w) for w in config.reward.weights) if config.reward.weights else (1.0,) * len(paths)
    return recipe.with_policy_kwargs(reward_weights=weights)


def _at_temperature(recipe: TrainingConfig, temperature: float) -> TrainingConfig:
    """``recipe`` with its policy role, and every other role that takes a ``temperature`` option its
    ``init_kwargs`` leave unset (a reference's or a teacher's ``LogProbSpecialization``), scoring at
    ``temperature``: a KL or a distillation loss compares two distributions at the same temperature."""
    policy = recipe.policy_role.name
    roles = tuple(
        dataclasses.replace(role, init_kwargs={**role.init_kwargs, "temperature": temperature})
        if role.name != policy
        and "temperature" not in role.init_kwargs
        and takes_option(role.specialization_cls, "temperature")
        else role
        for role in recipe.roles
    )
    if roles != recipe.roles:
        recipe = dataclasses.replace(recipe, roles=roles)
    try:
        return recipe.with_policy_kwargs(temperature=temperature)
    except ConfigError as exc:  # a user's loss class that does not take it: not train.algorithm_kwargs' fault
        raise ConfigError(
            f"{exc}; areno passes temperature=rollout.temperature to an online recipe's policy role (its "
            "log-probs are scored at the rollout's temperature): take it in __init__ (docs/recipes.md)"
        ) from None


_LENGTHS_WARNED: set[str] = set()
"""The length warnings said in this process (``resolve_recipe`` runs several times for one run)."""


def _warn_lengths(recipe: TrainingConfig, policy_kwargs: dict[str, Any], max_new_tokens: int) -> None:
    """Warn, once per process, where an actor's length constant exceeds what ``rollout.max_new_tokens``
    lets a generation reach: an overlong penalty that never fires, a ``constant`` aggregation whose L
    shrinks every gradient by about (mean length) / L. A warning, not a refusal: a multi-turn workflow
    joins several generations into one completion."""
    spec = recipe.policy_role.build()
    if not isinstance(spec, ActorSpecialization):
        return
    c = spec.config
    given = "max_completion_length" if "max_completion_length" in policy_kwargs else None
    lines = []
    if c.overlong_max_length is not None and c.overlong_max_length - c.overlong_buffer_length >= max_new_tokens:
        key = given or "overlong_max_length"
        lines.append(
            f"train.algorithm={recipe.name}: train.algorithm_kwargs.{key}={c.overlong_max_length} with "
            f"overlong_buffer_length={c.overlong_buffer_length} starts the overlong penalty past "
            f"{c.overlong_max_length - c.overlong_buffer_length} tokens, but rollout.max_new_tokens={max_new_tokens} "
            f"ends every generation before: the penalty never fires (leave {key} unset to follow "
            "rollout.max_new_tokens)"
        )
    if c.loss_aggregation == "constant" and c.loss_agg_constant > max_new_tokens:
        key = given or "loss_agg_constant"
        lines.append(
            f"train.algorithm={recipe.name}: train.algorithm_kwargs.{key}={c.loss_agg_constant:g} > "
            f"rollout.max_new_tokens={max_new_tokens}: the constant aggregation divides each completion's loss by "
            f"it, so every gradient shrinks by about (mean length) / {c.loss_agg_constant:g} (set {key} to "
            "rollout.max_new_tokens, dr_grpo's default)"
        )
    for line in lines:
        if line not in _LENGTHS_WARNED:
            _LENGTHS_WARNED.add(line)
            logger.warning(line)


def sft_trajectories(
    rows: list[dict],
    tokenizer,
    prompt_key: str,
    answer_key: str,
    *,
    chat_template: str = "auto",
    system_prompt: str | None = None,
    chat_template_kwargs: dict | None = None,
    vision: VisionConfig | None = None,
) -> list[Trajectory]:
    """Offline data for supervised recipes: the prompt rendered as rollouts render it
    (:func:`render_prompt`, a row's ``images`` as :func:`image_prompt` puts them; ``vision``: the model's),
    then the reference answer (a string, or TRL's assistant messages) as the chat template writes the
    assistant's turn, or its text and EOS untemplated (:func:`render_completion`)."""
    templating = {
        "chat_template": chat_template,
        "system_prompt": system_prompt,
        "chat_template_kwargs": chat_template_kwargs,
    }
    ids = [_render_offline_row(tokenizer, prompt_key, (answer_key,), templating, vision, row) for row in rows]
    return _sft_from_ids(rows, prompt_key, ids, vision)


def preference_trajectories(
    rows: list[dict],
    tokenizer,
    prompt_key: str,
    *,
    chat_template: str = "auto",
    system_prompt: str | None = None,
    chat_template_kwargs: dict | None = None,
    vision: VisionConfig | None = None,
) -> list[Trajectory]:
    """Offline data for preference recipes (``trains_on_pairs``): each row {prompt, chosen, rejected}
    (``PAIR_KEYS``) two trajectories of one group, the chosen first with reward 1, the rejected with 0
    (what ``preference_pairs`` reads), each the prompt and the completion rendered as
    :func:`sft_trajectories` renders them. Their ``logprobs`` record nothing (zeros): a reference's come
    from a reference role (``check_pair_recipe``)."""
    templating = {
        "chat_template": chat_template,
        "system_prompt": system_prompt,
        "chat_template_kwargs": chat_template_kwargs,
    }
    ids = [_render_offline_row(tokenizer, prompt_key, PAIR_KEYS, templating, vision, row) for row in rows]
    return _pairs_from_ids(rows, prompt_key, ids, vision)


def _render_offline_row(
    tokenizer,
    prompt_key: str,
    completion_keys: tuple[str, ...],
    templating: dict[str, Any],
    vision: VisionConfig | None,
    row: dict,
) -> Rendered:
    """A row's prompt ids and the ids of its completions under ``completion_keys``, in that order. A row's
    images go into its prompt as rollouts put them (:func:`image_prompt`; a :class:`DataError` on a text-only
    model); the assistant's turn after them is what the template writes after the text-only prompt."""
    images = row_images(row, vision)
    text_ids = render_prompt(tokenizer, row[prompt_key], **templating)
    prompt_ids = image_prompt(tokenizer, row[prompt_key], images, vision, **templating)[0] if images else text_ids
    completions = [
        render_completion(tokenizer, row[prompt_key], row[key], text_ids, **templating) for key in completion_keys
    ]
    return prompt_ids, completions


def _offline_images(row: dict, vision: VisionConfig | None) -> dict[str, Any] | None:
    """``Trajectory.info["images"]`` of an offline row: its pixel patches, made at each draw (a split's
    rows keep only their ids, :class:`RenderedRows`); None for a text row."""
    images = row_images(row, vision)
    return stash_images(ImageInputs.from_images(images, vision), None) if images else None


def _sft_from_ids(
    rows: list[dict], prompt_key: str, ids: list[Rendered], vision: VisionConfig | None = None
) -> list[Trajectory]:
    return [
        _offline_trajectory(prompt_ids, completion_ids, prompt=row[prompt_key], images=_offline_images(row, vision))
        for row, (prompt_ids, (completion_ids,)) in zip(rows, ids, strict=True)
    ]


def _pairs_from_ids(
    rows: list[dict], prompt_key: str, ids: list[Rendered], vision: VisionConfig | None = None
) -> list[Trajectory]:
    out = []
    # group ids by place in the batch: a row drawn twice makes two pairs
    for i, (row, (prompt_ids, completions)) in enumerate(zip(rows, ids, strict=True)):
        images = _offline_images(row, vision)  # one copy for both: nothing releases an offline row's pixels
        for completion_ids, reward in zip(completions, (1.0, 0.0), strict=True):
            out.append(
                _offline_trajectory(
                    prompt_ids,
                    completion_ids,
                    prompt=row[prompt_key],
                    reward=reward,
                    group_id=f"pair{i}",
                    images=images,
                )
            )
    return out


def _offline_trajectory(
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    prompt: Any,
    reward: float = 0.0,
    group_id: str = "",
    images: dict[str, Any] | None = None,
) -> Trajectory:
    """A dataset's completion (``render_completion``'s ids) after ``prompt_ids``, as a trajectory no policy
    sampled: version 0, log-probs 0; ``images``: the prompt's (``_offline_images``)."""
    n = len(completion_ids)
    return Trajectory(
        prompt_ids=list(prompt_ids),
        completion_ids=completion_ids,
        logprobs=[0.0] * n,
        versions=[0] * n,
        reward=reward,
        group_id=group_id,
        info={"prompt": prompt} if images is None else {"prompt": prompt, "images": images},
    )


def trains_on_pairs(recipe: TrainingConfig) -> bool:
    """Whether ``recipe`` is an offline recipe whose trainable role learns from preference pairs
    (``PAIRWISE_SPECIALIZATIONS``: dpo, dpo_distributed, reward_model): its data are preference rows."""
    return not recipe.online and any(
        r.trainable and issubclass(r.specialization_cls, PAIRWISE_SPECIALIZATIONS) for r in recipe.roles
    )


def generates(recipe: TrainingConfig, *, pairs: bool, held_out: bool) -> bool:
    """Whether a run of ``recipe`` ever generates: an online recipe's rollouts, or an offline recipe's
    evaluation of its ``held_out`` rows, which samples completions unless the recipe learns from
    preference pairs (``pairs``: scored on the training side). A run that does not builds no
    rollout side."""
    return recipe.online or (held_out and not pairs)


def check_pair_recipe(config: ArenoConfig, recipe: TrainingConfig) -> bool:
    """``trains_on_pairs(recipe)``, after refusing (ConfigError) what such a recipe cannot do on a
    dataset's pairs: DPO reading reference log-probs recorded with the data (``ref_key='logprobs_T'``;
    a dataset's rows record none, and zeros would be a silent wrong reference), and the settings of a
    generating evaluation: ``train.eval_samples`` / ``eval_temperature`` / ``eval_pass_threshold`` and
    the background test rollout (a preference recipe's held-out figure is its pair accuracy)."""
    if not trains_on_pairs(recipe):
        return False
    for role in recipe.roles:
        if role.trainable and issubclass(role.specialization_cls, DPOSpecialization):
            if role.build().ref_key == "logprobs_T":
                raise ConfigError(
                    f"recipe {recipe.name!r}: role {role.name!r} reads its reference log-probs from the data "
                    "(ref_key='logprobs_T'), but preference rows record none: drop train.algorithm_kwargs.ref_key, "
                    "or give the recipe a frozen reference role and a DataSync to ref_logprobs_T (as dpo does)"
                )
    check_unset(
        config.train,
        "train",
        ("eval_samples", "eval_temperature", "eval_pass_threshold"),
        f"train.algorithm={recipe.name} evaluates held-out preference pairs by the model's scores and generates "
        "nothing: the setting does nothing here: drop it",
    )
    if config.train.long_sequences == "truncate":
        # each role cuts to its own micro-batch budget: the policy's and the reference's sums of a
        # long completion would cover different tokens, a biased implicit reward
        raise ConfigError(
            f"train.long_sequences=truncate: train.algorithm={recipe.name} compares whole completions (and DPO "
            "against a reference role, whose cut could differ): use train.long_sequences=error and shorten the "
            "data's longest rows, or raise train.max_tokens_per_mb"
        )
    if config.test_rollout.enabled:
        raise ConfigError(
            f"test_rollout.enabled: the test rollout generates completions of held-out prompts, but "
            f"train.algorithm={recipe.name} learns from preference pairs, whose held-out figure (the fraction of "
            "data.eval_path's pairs it prefers the chosen of) the run evaluates itself: set test_rollout.enabled=false"
        )
    return True


_UNTRAINABLE_WARNED: set[str] = set()
"""The kinds of untrainable batch warned about in this process (``warn_untrainable``)."""


def warn_untrainable(recipe: TrainingConfig, trajectories: list[Trajectory], workflow: str, rollout_id: int) -> None:
    """Warn, once per process each, about a rollout batch of which nothing can train, the step's loss 0
    without a word: no completion token marked to train, or every group one trajectory under a recipe
    that compares a group's completions (``needs_groups``; ``check_n_samples`` refuses
    ``rollout.n_samples=1`` before the run, but a workflow can still return its samples one by one)."""
    if not trajectories:
        return
    step = f"step {rollout_id + 1}'s rollout batch"
    lines = {}
    if not any(any(t.completion_mask) for t in trajectories):
        lines["tokens"] = (
            f"no trajectory of {step} has a completion token to train (empty completion_ids, or completion_mask "
            f"all 0): the step trains nothing; check {workflow} (completion_mask: 1 marks a trained token)"
        )
    elif len(trajectories) > 1 and len({t.group_id for t in trajectories}) == len(trajectories):
        need = next((what for role in recipe.roles if role.trainable and (what := role.build().needs_groups)), None)
        if need:
            lines["groups"] = (
                f"every group of {step} holds one trajectory: recipe {recipe.name!r} ({need}) compares the "
                f"completions of a prompt within their group, so nothing trains: return a row's samples as one "
                f"list from the run_episode of {workflow} (docs/workflows.md)"
            )
    for kind, line in lines.items():
        if kind not in _UNTRAINABLE_WARNED:
            _UNTRAINABLE_WARNED.add(kind)
            logger.warning(line)


def rollout_metrics(trajectories: list[Trajectory], version: int, batch: TokenBatch | None = None) -> dict[str, float]:
    """Per-batch rollout figures. The reward mean and std cover the finite rewards only: a NaN or inf
    reward a workflow set (scored 0 where ``as_group`` saw it, ``NONFINITE_REWARD_KEY``; one built
    elsewhere is left out of the mean) is counted in ``rollout/reward_nonfinite`` instead of turning the
    mean into null. ``batch``: the trajectories packed (``TokenBatch.from_trajectories``), whose
    versions it reads rather than joining them again."""
    rewards = torch.tensor([t.reward for t in trajectories])
    finite = torch.isfinite(rewards)
    nonfinite = int((~finite).sum()) + sum(1 for t in trajectories if t.info.get(NONFINITE_REWARD_KEY))
    if nonfinite:
        rewards = rewards[finite] if finite.any() else torch.zeros(1)
    lengths = torch.tensor([len(t.completion_ids) for t in trajectories], dtype=torch.float32)
    # version -1: a token no policy version sampled (the teacher's, areno.workflows.teacher)
    if batch is None:
        versions_T = join_flat([t.versions for t in trajectories], np.int64, runs=True)
        sampled_T = join_flat([t.completion_mask for t in trajectories], np.bool_, runs=True)
        versions_T = versions_T[sampled_T & (versions_T >= 0)]
    else:  # packed, -1 on prompt and unsampled tokens: the same versions in the same order
        versions_T = batch.versions_T[batch.versions_T >= 0]
    staleness = (version - versions_T).float() if len(versions_T) else torch.zeros(1)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "rollout/reward_min": rewards.min().item(),
        "rollout/reward_max": rewards.max().item(),
        "rollout/reward_nonfinite": float(nonfinite),
        "rollout/completion_len_mean": lengths.mean().item(),
        "rollout/completion_len_min": lengths.min().item(),
        "rollout/completion_len_max": lengths.max().item(),
        "rollout/num_seqs": float(len(trajectories)),
        "rollout/num_tokens": float(sum(t.num_tokens for t in trajectories)),
        "rollout/truncated_frac": sum(t.finish_reason == "length" for t in trajectories) / len(trajectories),
        "rollout/reward_errors": float(sum("reward_error" in t.info for t in trajectories)),
        "rollout/staleness_mean": staleness.mean().item(),
        "rollout/staleness_max": staleness.max().item(),
        **reward_figure_means(trajectories, "rollout/reward"),
    }


def scored_reward_mean(trajectories: list[Trajectory], filtered: list[float]) -> float:
    """The mean finite reward of the batch's trajectories and of those dynamic sampling left out since the
    last batch: what the policy scores on the prompts it was given (``rollout/reward_mean`` covers the kept
    groups, whose rewards vary by construction, so it hides a policy that solves more and more of them)."""
    rewards = torch.tensor([t.reward for t in trajectories] + filtered, dtype=torch.float64)
    rewards = rewards[torch.isfinite(rewards)]
    return rewards.mean().item() if len(rewards) else 0.0


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's tokenizer; it must have an EOS token (generation stops on it)."""
    tokenizer = load_pretrained_tokenizer(model_dir)
    if tokenizer.eos_token_id is None:
        raise ModelDirError(
            f"model.path: the tokenizer in {model_dir} has no eos_token: set one in tokenizer_config.json"
        )
    return tokenizer


_DISK_WRITE_FAILURE = re.compile(
    r"inline_container\.cc|PytorchStreamWriter failed|unexpected pos \d+ vs \d+|No space left on device|StorageFull"
    r"|Disk quota exceeded"
)
"""What ``torch.save`` and safetensors raise where the file they write stops growing (a full disk, a quota)."""


def save_failure(exc: BaseException, path: Path) -> BaseException:
    """What a failed checkpoint save raises: the signal that interrupted it (DCP wraps a second Ctrl-C in its
    ``CheckpointException``), a one-line :class:`RunFailure` for the disk (full, a size limit, a file where a
    directory goes) naming the checkpoint and the one ``resume=auto`` goes on from, else ``exc`` itself."""
    causes = [exc, exc.__cause__, exc.__context__]
    causes += [failure for failure, _ in getattr(exc, "failures", {}).values()]  # DCP's CheckpointException
    for cause in causes:
        if isinstance(cause, KeyboardInterrupt):
            return cause
    for cause in causes:
        # torch.save's zip writer ("unexpected pos 704 vs 598") and safetensors ("StorageFull") report a full
        # disk as errors of their own
        if isinstance(cause, OSError) or (cause is not None and _DISK_WRITE_FAILURE.search(str(cause))):
            last = checkpoint.latest_complete(path.parent)
            resume = f"resume=auto goes on from {last}" if last is not None else "there is no earlier checkpoint"
            return RunFailure(
                f"saving checkpoint {path} failed ({type(cause).__name__}: {cause}): free space on (or fix) "
                f"{path.parent}; {resume}"
            )
    return exc


_WHOLE_REWARD = ""
"""``_failed_parts``' name of a failure of the whole reward (one function, or a workflow's own reward)."""


def _failed_parts(trajectory: Trajectory) -> set[str]:
    """What failed in ``trajectory``'s reward: the functions of a ``reward.fn`` list that did
    (``REWARD_FAILED_PARTS_KEY``), else the whole reward where it has an error, else nothing."""
    if "reward_error" not in trajectory.info:
        return set()
    return set(trajectory.info.get(REWARD_FAILED_PARTS_KEY) or [_WHOLE_REWARD])


class RewardsFailing(RunFailure):
    """Every reward call of ``REWARD_FAILED_BATCHES`` rollout batches in a row failed (a judge server gone, a
    reward bug): the run stops rather than train on zero rewards."""

    training_side_intact = True
    """The steps trained before are sound: the Trainer saves an emergency checkpoint of the step reached."""


REWARD_FAILED_BATCHES = 3
"""Rollout batches in a row whose every reward call failed that stop a run (one may be a passing
outage of what the reward calls: a judge's server, a sandbox restarting)."""


def _index(device: torch.device) -> int | None:
    """``device``'s index, a CUDA device without one being the current device."""
    if device.type == "cuda" and device.index is None:
        return torch.cuda.current_device()
    return device.index


class ArenoEngine:
    """The run's data, its rollout pool, and the two sides (see the module doc)."""

    # set in __init__
    config: ArenoConfig
    run_dir: Path
    training: TrainingSide
    rollout: RolloutSide | None
    """Where rollouts and generating evaluations run; None once ``initialize`` finds that the run
    never generates (``generates``): no rollout engine is built, started or synced."""
    weight_kind: WeightKind
    """How the policy travels between the sides (``WeightKind``), chosen when they are paired."""
    residency: Residency | None
    """Colocated runs: what stays on the device in each phase (``cluster.offload``) and each phase's
    peak memory (``engine/residency.py``). None: the sides have devices of their own."""
    _pending_sync_metrics: dict[str, float]
    _rollout_behind: bool
    _reward_failed_batches: dict[str, int]
    """Per failing reward (``_failed_parts``), the rollout batches in a row on whose every completion it failed
    (``REWARD_FAILED_BATCHES`` stop the run)."""
    # set in initialize()
    tokenizer: Any
    recipe: TrainingConfig
    executor: WorkflowExecutor | None = None
    train_stream: PromptStream
    eval_rows: list[dict]
    ledger: SampleLedger | None = None
    """Online recipes: hands out the prompts, keeps those not yet trained (the data cursor an
    asynchronous pool runs ahead of) and their stream keys (the episodes' sampling seeds)."""
    workflow: RolloutWorkflow | None = None
    """Online recipes: the user's workflow (``rollout.workflow``), closed at shutdown."""
    store: InProcessStore | None = None
    """Online recipes: where workflows put large observations (freed once trained or dropped)."""
    vision: VisionConfig | None = None
    """A vision-language model's vision tower shape and image tokens (rows with images)."""
    reward_fn: Any = None
    version: int = 0
    asynchronous: bool = False
    """True when max_head_offpolicyness > 0: the rollout pool runs ahead of training."""
    _offline_rows: dict[str, RenderedRows] | None = None
    """Offline recipes: each split's rows rendered so far (``_offline_trajectories``)."""
    pairs: bool = False
    """An offline recipe that learns from preference pairs (``trains_on_pairs``): its rows, training and
    held-out, are {prompt, chosen, rejected}; its evaluation is pair accuracy (``evaluate``)."""
    shared_device: torch.device | None = None
    """Colocated: the device both sides use; None when each side has its own."""
    taking_turns: bool = False
    """Asynchronous on one device with ``rollout.generate_during_train`` false: the engine generates
    only while the trainer waits for a batch (or an evaluation), paused otherwise."""

    def __init__(
        self,
        config: ArenoConfig,
        run_dir: Path,
        *,
        training: TrainingSide,
        rollout: RolloutSide,
        residency: Residency | None = None,
        shared_device: torch.device | None = None,
    ) -> None:
        """A ConfigError when the sides have no way in common to move the policy. ``shared_device``: the
        device both sides use (colocated; ``rollout.generate_during_train`` applies), else None."""
        self.config = config
        self.shared_device = shared_device
        self.run_dir = run_dir
        self.training = training
        self.rollout = rollout
        self.residency = residency
        self.weight_kind = choose_weight_kind(training.weight_kinds, rollout.weight_kinds)
        self._pending_sync_metrics = {}
        self._rollout_behind = False  # an offline recipe trained since the rollout side's last sync
        self._reward_failed_batches = {}
        self._heap = HeapFreezer(config.cluster.gc_freeze)  # frozen after the first step's sync
        self._unpublished = False  # a step trained whose policy update_weights has not published yet
        # set by initialize(); None until then, so a shutdown after a failed start stops what did start
        self.executor = None
        self.workflow = None
        self.reward_fn = None

    # ----------------------------------------------------------------------------- set-up
    def initialize(self) -> None:
        cfg = self.config
        self.recipe = resolve_recipe(cfg)  # errors before any model loads
        self.pairs = check_pair_recipe(cfg, self.recipe)
        # malformed rows: error before models load
        train_rows, self.eval_rows = build_splits(cfg.data, pairs=self.pairs)
        # several held-out files: their figures one by one too (a preference recipe's pair figures: the whole's)
        self.eval_sources = eval_sources(cfg.data) if not self.pairs else []
        # batch_size: a batch that straddles two epochs is kept free of rows it already holds; the stage after
        # a warm start (whose own config has warm_start.steps=0) shuffles apart from the warm start's rows
        stage = "after_warm_start" if cfg.warm_start.steps > 0 else ""
        self.train_stream = PromptStream(
            train_rows, seed=cfg.data.seed, batch_size=cfg.rollout.batch_size, stage=stage, shuffle=cfg.data.shuffle
        )
        if not generates(self.recipe, pairs=self.pairs, held_out=bool(self.eval_rows)):
            self._drop_rollout_side()
        if self.recipe.online:  # a sandboxed reward's first worker imports it while the models load
            self.reward_fn = start_reward(load_reward(cfg.reward))
        model_dir = self.model_dir = prepare_model_dir(cfg)
        self.tokenizer = load_tokenizer(model_dir)
        vision = read_config(model_dir).vision
        self.vision = VisionConfig.from_hf(vision) if vision is not None else None
        setup = SideSetup(recipe=self.recipe, model_dir=model_dir, tokenizer=self.tokenizer)
        self.training.start(setup)
        self.asynchronous = self.recipe.online and cfg.rollout.max_head_offpolicyness > 0
        shared = self.shared_device
        if self.rollout is not None:
            # before the rollout engine sizes its KV pool: with cluster.offload=sleep the training
            # state is in host memory by then
            self._enter(Phase.ROLLOUT)
            if shared is not None:  # the pool leaves what training will take at its first step
                setup = dataclasses.replace(setup, device_bytes_reserved=self.training_bytes_to_come(shared))
            self.rollout.start(setup)
        # Taking turns on one device: the engine generates only while the trainer waits for a batch,
        # so the batches admitted meanwhile decode together, and no decode step runs between (or
        # delays) the training step and the policy sync.
        self.taking_turns = (
            self.asynchronous and shared is not None and not cfg.rollout.resolved_generate_during_train(shared.type)
        )
        if self.taking_turns:
            self._rollout_side("taking turns").pause()
        self.executor = self._build_executor() if self.recipe.online else None

    def training_bytes_to_come(self, device: torch.device) -> int:
        """Device bytes the training side will still take on ``device`` (``TrainingSide.device_bytes_to_come``
        when it trains there): an engine started there later (the test rollout's) leaves them free."""
        shared = self.shared_device
        if shared is None or shared.type != device.type or _index(shared) != _index(device):
            return 0
        if self.residency is not None and self.residency.moves_state:
            return 0  # cluster.offload=sleep: the run's engine releases more than that while training
        return self.training.device_bytes_to_come()

    def _drop_rollout_side(self) -> None:
        """A run that never generates keeps no rollout side (unstarted: nothing loaded yet), so no
        rollout model, KV cache or CUDA graphs take device memory beside the training roles."""
        self.rollout = None
        if self.residency is not None:
            # with no rollout engine to take turns with, every phase keeps the training side resident
            if self.config.cluster.offload == "sleep":
                logger.warning(
                    "cluster.offload=sleep: train.algorithm=%s generates nothing in this run, so no rollout engine "
                    "is built and there is nothing to offload; cluster.offload=none does the same",
                    self.recipe.name,
                )
            self.residency = Residency(self.residency.device)

    def _rollout_side(self, purpose: str) -> RolloutSide:
        """The rollout side, for ``purpose`` (something that generates or syncs the policy to it); a
        RuntimeError in a run that built none (``generates``), rather than a call that does nothing."""
        if self.rollout is None:
            raise RuntimeError(
                f"{purpose} needs the rollout side, but train.algorithm={self.recipe.name} generates nothing in "
                "this run (offline, with no held-out evaluation that generates), so none was built"
            )
        return self.rollout

    def _enter(self, phase: Phase) -> None:
        """Start ``phase`` of a synchronous step (``Residency.enter``). An asynchronous run generates
        while it trains: it has no phases (and ``cluster.offload=sleep`` refuses it)."""
        if self.residency is not None and not self.asynchronous:
            self.residency.enter(phase)

    @contextlib.contextmanager
    def _generating_while_waiting(self) -> Iterator[None]:
        """Taking turns (``taking_turns``): the engine generates for the body's wait only."""
        if not self.taking_turns:
            yield
            return
        rollout = self._rollout_side("taking turns")
        rollout.resume()
        try:
            yield
        finally:
            rollout.pause()

    def _phase_metrics(self) -> dict[str, float]:
        return self.residency.metrics() if self.residency is not None and not self.asynchronous else {}

    def _teacher_reserve(self) -> dict[str, int]:
        """``teacher_kv_reserved_bytes`` for a workflow whose teacher engine (built at its first teacher
        request, in this process) sizes its KV pool from free memory: what the training side will still
        take on the teacher's device. Empty when the workflow has no such engine or the user set it."""
        cfg = self.config
        name = "teacher_kv_reserved_bytes"
        if name in cfg.rollout.workflow_kwargs or not takes_param(cfg.rollout.workflow, name):
            return {}
        setting = cfg.rollout.workflow_kwargs.get("teacher_device", "auto")
        device = resolve_device(setting)
        if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
            raise ConfigError(
                f"rollout.workflow_kwargs.teacher_device={setting}: the teacher's engine runs in the trainer's "
                "process on its current device: use auto, cuda or cpu"
            )
        return {name: self.training_bytes_to_come(device)}

    def _build_executor(self) -> WorkflowExecutor:
        cfg = self.config
        reward_fn = self.reward_fn
        check_reward_started(reward_fn)
        # one observation store: workflows taking `store=` put large observations there; the
        # executor frees those of dropped groups, step() those of trained ones
        self.store = InProcessStore()
        engine_kwargs = {
            "tokenizer": self.tokenizer,
            "reward_fn": reward_fn,
            "n_samples": cfg.rollout.n_samples,
            "sampling_params": rollout_sampling_params(cfg),
            "prompt_key": cfg.data.prompt_key,
            "answer_key": cfg.data.answer_key,
        }
        assert engine_kwargs.keys() == ENGINE_ARGUMENTS.keys()  # what preflight checks the workflow against
        workflow = load_workflow(
            cfg.rollout.workflow,
            **engine_kwargs,
            **store_kwargs(cfg.rollout.workflow, self.store, cfg.rollout.workflow_kwargs),
            **teacher_kwargs(cfg.rollout.workflow, self.recipe, cfg.rollout.workflow_kwargs),
            **self._teacher_reserve(),
            **vision_kwargs(cfg.rollout.workflow, self.model_dir, cfg.rollout.workflow_kwargs),
            **prompt_kwargs(cfg.rollout.workflow, cfg.rollout.workflow_kwargs, **cfg.data.templating()),
            **cfg.rollout.workflow_kwargs,
        )
        staleness = ResumableStaleness(
            max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
            batch_size=cfg.rollout.batch_size,
            max_concurrent=cfg.rollout.max_concurrent,
        )
        self.workflow = workflow
        # The ledger hands out the prompts and keeps the cursor of what was trained (the pool reads
        # ahead of training); episodes sample with seeds from their place in the data order.
        self.ledger = SampleLedger(self.train_stream)
        workflow = LedgerWorkflow(workflow, self.ledger, seed=cfg.train.seed)
        group_filter, max_rounds = self._group_filter()
        return WorkflowExecutor(
            SeedingClient(self._rollout_side("an online recipe's rollouts").client),
            workflow,
            self.ledger,
            staleness,
            num_workers=cfg.rollout.max_concurrent,
            max_retries=cfg.rollout.max_retries,
            max_consecutive_dropped=cfg.rollout.max_consecutive_dropped,
            store=self.store,
            group_filter=group_filter,
            max_filtered_batches=max_rounds if group_filter is not None else 0,
        )

    def _group_filter(self) -> tuple[GroupFilter | None, int]:
        """The rollout's group filter and its rounds: DAPO's dynamic sampling where the policy role runs
        ``ActorConfig.dynamic_sampling`` with ``dynamic_sampling_max_rounds`` > 1 (None, 1: no filter; the
        training side's own drop is the one left)."""
        policy = self.recipe.policy_role
        config_cls = policy.specialization_cls.config_cls
        if config_cls is None or not issubclass(config_cls, ActorConfig):
            return None, 1
        options = config_cls(**policy.init_kwargs)
        if not options.dynamic_sampling or options.dynamic_sampling_max_rounds == 1:
            return None, 1
        return dynamic_sampling_kept, options.dynamic_sampling_max_rounds

    # ----------------------------------------------------------------------------- the loop
    def generate_rollout(self, rollout_id: int) -> RolloutBatch:
        cfg = self.config
        if self.recipe.online and self.asynchronous:
            # everlasting pool: the oldest finished groups, generated up to η versions ago
            with self._generating_while_waiting():
                groups = self.executor.wait_batch(cfg.rollout.batch_size)
            taken: list[int | None] | None = [group[0].info.get(SEQ_KEY) for group in groups]
            trajectories = [t for group in groups for t in group]
            batch = TokenBatch.from_trajectories(trajectories)
            metrics = {**self.executor.metrics(), **rollout_metrics(trajectories, self.version, batch)}
        elif self.recipe.online:
            self._enter(Phase.ROLLOUT)
            groups, rounds, taken = self._synchronous_groups(cfg.rollout.batch_size)
            trajectories = [t for group, _ in groups for t in group]
            batch = TokenBatch.concat([part for _, part in groups])
            metrics = {
                **self.executor.metrics(),  # failures, drops and refusals count in synchronous runs too
                **rollout_metrics(trajectories, self.version, batch),
                **self._phase_metrics(),
                **({"rollout/sampling_rounds": float(rounds)} if self.executor.group_filter is not None else {}),
            }
        else:
            taken = None
            indices = self.train_stream.take_indices(cfg.rollout.batch_size)
            trajectories = self._offline_trajectories("train", self.train_stream.rows, indices)
            batch = TokenBatch.from_trajectories(trajectories)
            metrics = {
                "rollout/num_seqs": float(len(trajectories)),
                "rollout/num_tokens": float(sum(t.num_tokens for t in trajectories)),
            }
        if self.recipe.online and cfg.observe.log_completions:
            self._log_completions(rollout_id, trajectories[: cfg.observe.log_completions])
        if self.recipe.online and self.executor.group_filter is not None:
            metrics["rollout/scored_reward_mean"] = scored_reward_mean(
                trajectories, self.executor.take_filtered_rewards()
            )
        if self.recipe.online:
            warn_reward_errors(trajectories, f"step {rollout_id + 1}'s rollout batch", several=cfg.reward.several())
            warn_untrainable(self.recipe, trajectories, f"rollout.workflow ({cfg.rollout.workflow})", rollout_id)
            if not any(r.name == "teacher" for r in self.recipe.roles):  # distillation: a log
                self._check_rewards(rollout_id, trajectories)
        if taken is not None:  # only now: a step that stops the run above leaves its samples for the resume
            self.ledger.trained(taken)
        metrics["rollout/epoch"] = self.train_stream.epochs_drawn
        metrics.update(reward_pool_metrics(self.reward_fn))  # a sandbox's calls, failures by kind, restarts
        if self.rollout is not None:  # the rollout side's own: replica health, engine counters
            metrics.update(self.rollout.metrics())
        if batch.images_B and self.store is not None:  # the pixels stayed in the store until now
            batch.images_B = fetch_refs(batch.images_B, self.store)
        return RolloutBatch(trajectories=trajectories, batch=batch, metrics=metrics)

    def _log_completions(self, rollout_id: int, trajectories: list[Trajectory]) -> None:
        """``observe.log_completions``: these trajectories as JSON lines of run_dir/completions.jsonl."""

        def text(t: Trajectory, key: str, ids: list[int]) -> Any:
            # the workflow's own text where it kept one; decoded only where it did not
            return t.info[key] if key in t.info else self.tokenizer.decode(ids, skip_special_tokens=True)

        with open(self.run_dir / COMPLETIONS_FILENAME, "a", encoding="utf-8") as f:
            for t in trajectories:
                row = {
                    "step": rollout_id + 1,
                    "prompt": text(t, "prompt", t.prompt_ids),
                    "completion": text(t, "completion", t.completion_ids),
                    "reward": t.reward,
                    "finish_reason": t.finish_reason,
                    **({"figures": t.info[REWARD_FIGURES_KEY]} if REWARD_FIGURES_KEY in t.info else {}),
                    **({"reward_error": t.info["reward_error"]} if "reward_error" in t.info else {}),
                }
                f.write(json.dumps(row, default=str) + "\n")

    def _synchronous_groups(
        self, batch_size: int
    ) -> tuple[list[tuple[list[Trajectory], TokenBatch]], int, list[int | None]]:
        """A synchronous step's groups and packed parts, the rounds it took and the ledger numbers of its
        samples: ``batch_size`` samples; with the rollout's group filter (dynamic sampling), more rounds while
        groups are missing, each sized by the step's share of samples kept so far (at most ``batch_size``), up
        to ``max_filtered_batches`` rounds. Groups past ``batch_size`` (the last round's last) are done
        untrained; a step whose rounds kept no group stops the run. Its samples stay pending in the ledger
        until the caller marks them trained, so a step that stops the run (its emergency checkpoint) leaves
        them, filtered, rejected and dropped ones included, for the resumed run to generate again."""
        executor = self.executor
        max_rounds = executor.max_filtered_batches if executor.group_filter is not None else 1
        rollout = self._rollout_side("a synchronous rollout")
        groups: list[tuple[list[Trajectory], TokenBatch]] = []
        handed: dict[int, dict[str, Any]] = {}  # ledger number -> sample, in hand-out order
        rounds, filtered_before = 0, executor.stats.counts["filtered_groups"]
        self.ledger.begin_step()  # the rounds' prompts are one batch: none twice where the data allows
        while True:
            missing = batch_size - len(groups)
            n = batch_size if not groups else min(batch_size, -(-missing * len(handed) // len(groups)))
            samples = self.ledger.take(n)
            handed.update((self.ledger.lookup(s)[0], s) for s in samples)
            rollout.pause()  # start the engine on the whole first burst (see SeedingClient)
            executor.client.hold(rollout.resume)
            groups.extend(executor.rollout_groups(samples, first_round=rounds == 0))
            executor.client.release_now()
            rounds += 1
            if len(groups) >= batch_size or rounds >= max_rounds:
                break
        if executor.group_filter is not None and not groups:
            filtered = executor.stats.counts["filtered_groups"] - filtered_before
            raise RolloutPoolBroken(
                f"dynamic sampling kept no group of this step's {len(handed)} samples ({rounds} rounds: {filtered} "
                f"filtered, {len(handed) - filtered} rejected or dropped): {executor.filtered_cause()}"
            )
        if len(groups) < batch_size and executor.group_filter is not None:
            logger.warning(
                "dynamic sampling kept %d of %d groups in %d rounds (%d samples): this step trains on fewer; raise "
                "train.algorithm_kwargs.dynamic_sampling_max_rounds (%d) to sample more",
                len(groups),
                batch_size,
                rounds,
                len(handed),
                max_rounds,
            )
        for group, _ in groups[batch_size:]:  # surplus of the last round: done untrained, as a filtered one
            self.ledger.release(handed.pop(group[0].info[SEQ_KEY]))
        return groups[:batch_size], rounds, list(handed)

    def _offline_trajectories(self, split: str, rows: list[dict], indices: list[int]) -> list[Trajectory]:
        """An offline recipe's trajectories of ``rows[i]`` for ``indices`` (``rows``: split ``split``'s): two
        per preference row (``pairs``), else one per row, its answer the completion. Each row is tokenized
        once per run (:class:`RenderedRows`): every epoch draws the same rows."""
        data = self.config.data
        if self._offline_rows is None:
            self._offline_rows = {}
        rendered = self._offline_rows.get(split)
        if rendered is None or rendered.rows is not rows:  # a split replaced (held-out rows set anew): its own ids
            rendered = self._offline_rows[split] = RenderedRows(rows)
        keys = PAIR_KEYS if self.pairs else (data.answer_key,)
        render = functools.partial(
            _render_offline_row, self.tokenizer, data.prompt_key, keys, data.templating(), self.vision
        )
        ids = [rendered.ids(i, render) for i in indices]
        picked = [rows[i] for i in indices]
        if self.pairs:
            return _pairs_from_ids(picked, data.prompt_key, ids, self.vision)
        return _sft_from_ids(picked, data.prompt_key, ids, self.vision)

    def _check_rewards(self, rollout_id: int, trajectories: list[Trajectory]) -> None:
        """A reward that fails on every call (each scored 0, a batch's failures warned about once) would
        have the run train on nothing: ``REWARD_FAILED_BATCHES`` such batches in a row stop it with the
        last error. Of a ``reward.fn`` list, one function failing on every call stops it so (naming it);
        rows that each lost some other function's part do not."""
        failed = [_failed_parts(t) for t in trajectories]
        always = set.intersection(*failed) if failed else set()
        counts = {part: self._reward_failed_batches.get(part, 0) + 1 for part in always}
        self._reward_failed_batches = counts
        stopping = sorted(part for part, n in counts.items() if n >= REWARD_FAILED_BATCHES)
        if not stopping:
            return
        errors = [t.info["reward_error"] for t in trajectories if "reward_error" in t.info]
        last = next(iter(errors[-1].splitlines()), "")
        if all(t.info.get(NONFINITE_REWARD_KEY) for t in trajectories):  # set by the workflow, not reward.fn
            raise RewardsFailing(
                f"every reward of the last {REWARD_FAILED_BATCHES} rollout batches was NaN or inf (step "
                f"{rollout_id + 1}; last: {last}): fix rollout.workflow ({self.config.rollout.workflow}), which "
                "set them; the run stopped rather than train on zero rewards"
            )
        part = stopping[0]
        if part == WEIGHTED_SUM_PART:
            raise RewardsFailing(
                f"the weighted sum of reward.fn's scores was beyond float32 on every completion of the last "
                f"{REWARD_FAILED_BATCHES} rollout batches (step {rollout_id + 1}): lower reward.weights "
                f"({self.config.reward.weights}); the run stopped rather than train on zero rewards"
            )
        if part != _WHOLE_REWARD:  # a function of a reward.fn list
            paths = self.config.reward.paths()
            i = part_names(paths).index(part)
            raise RewardsFailing(
                f"reward.fn[{i}] ({paths[i]}) failed on every completion of the last {REWARD_FAILED_BATCHES} "
                f"rollout batches (step {rollout_id + 1}; last: {last}): fix that function; the run stopped "
                "rather than train on rewards missing its part"
            )
        raise RewardsFailing(
            f"every reward call of the last {REWARD_FAILED_BATCHES} rollout batches failed (step {rollout_id + 1}; "
            f"last: {last}): fix reward.fn ({', '.join(self.config.reward.paths())}); the run stopped rather than train on "
            "zero rewards"
        )

    def step(self, rollout: RolloutBatch) -> dict[str, float]:
        self._check_routes(rollout)
        # Asynchronous: the engine generates in its own thread meanwhile. No CUDA graph may be captured
        # beside the training step's kernels and device synchronizations (they invalidate a capture:
        # cudaErrorStreamCaptureUnsupported); a decode step needing a new graph meanwhile runs eagerly.
        hold = (
            self._rollout_side("an asynchronous step").hold_graph_captures()
            if self.asynchronous
            else contextlib.nullcontext()
        )
        self._enter(Phase.TRAIN)
        with hold:  # taking turns, the engine is paused here already (_generating_while_waiting)
            # the version the rollout policy carries (loglinear π_prox)
            out = self.training.step(rollout.batch, pass_order=rollout.pass_order, policy_version=self.version)
        self._unpublished = True
        # the training side's figures of the rollout (rollout/logprob_abs_diff_*) keep their section
        metrics = {k if k.startswith("rollout/") else f"train/{k}": v for k, v in out.items()}
        metrics.update(self._phase_metrics())
        if self.store is not None and rollout.pass_order is None:
            # trained (later passes reuse the prepared batch): their stored observations are done with
            release_refs([t.info for t in rollout.trajectories], self.store)
        metrics.update(self._pending_sync_metrics)  # the previous sync's figures ride with the next step
        self._pending_sync_metrics = {}
        return metrics

    def _check_routes(self, rollout: RolloutBatch) -> None:
        """``train.moe_rollout_routes`` / ``moe_routing_replay`` with a workflow whose trajectories drop the
        engine's routes would train without them and say nothing: refused at the first step instead (at
        start-up where the workflow class says so of itself: ``declares_no_routes``)."""
        train = self.config.train
        if (train.moe_rollout_routes or train.moe_routing_replay) and rollout.trajectories:
            if ROUTES_KEY not in rollout.batch.extra:
                key = "train.moe_routing_replay" if train.moe_routing_replay else "train.moe_rollout_routes"
                raise routes_dropped(key, self.config.rollout.workflow)

    def update_weights(self) -> dict[str, float]:
        if not self.recipe.online:
            # an offline recipe's rollout side serves evaluations only: the policy goes there before one
            # (a run without one has nothing to sync, and logs no sync)
            self.version += 1
            self._rollout_behind = self.rollout is not None
        else:
            self._sync_weights(self.version + 1)
        self._unpublished = False
        self._heap.after_step()
        return {}

    def _sync_weights(self, version: int) -> dict[str, float]:
        """Publish the trained policy as ``version`` and load it into the rollout side."""
        rollout = self._rollout_side("a policy sync")
        self._rollout_behind = False
        self._enter(Phase.SYNC)
        update = self.training.publish_weights(version, self.weight_kind)
        if update is None:  # no role syncs to the rollout side
            return {}
        if self.asynchronous:  # bracket the swap: admission and the engine pause, then continue
            self.executor.pause()
            rollout.pause()
        try:
            metrics = rollout.update_weights(update)
        finally:
            if self.executor is not None:  # the pool's version: rollout/version, and the staleness bound's
                self.executor.set_version(rollout.version)
            if self.asynchronous:
                if not self.taking_turns:  # taking turns, it generates at the next wait for a batch
                    rollout.resume()
                self.executor.resume()
        self.version = update.version
        self._pending_sync_metrics = {**metrics, **self._phase_metrics()}
        return {}

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy (mean reward) of the current rollout policy: greedy, or the mean over
        ``train.eval_samples`` seeded samples with their ``pass@k`` (``engine/scoring.py``). A
        preference recipe's: its held-out pairs (``_evaluate_pairs``)."""
        if not self.eval_rows:
            return {}
        if self.pairs:
            return self._evaluate_pairs()
        rollout = self._rollout_side("a held-out evaluation that generates")
        if self._rollout_behind:
            self._sync_weights(self.version)
        cfg = self.config
        if self.reward_fn is None:  # offline recipes build no executor
            self.reward_fn = load_reward(cfg.reward)
            check_reward_started(self.reward_fn)
        samples = cfg.train.eval_samples
        params = eval_params(cfg, samples, cfg.train.eval_temperature, name="train.eval_samples")
        self._enter(Phase.ROLLOUT)
        t0 = time.perf_counter()

        # synchronous: the engine starts on the whole burst (the same batches, hence scores, every run)
        burst = held_burst(rollout) if not self.asynchronous else contextlib.nullcontext(rollout.client)
        with burst as client, self._generating_while_waiting():
            scored = asyncio.run(
                ascore_rows(
                    client,
                    self.tokenizer,
                    self.reward_fn,
                    self.eval_rows,
                    cfg,
                    params,
                    self.vision,
                    samples=samples,
                    base_seed=cfg.train.seed,
                )
            )
        model_metrics = {}
        if self.recipe.reward_syncs:  # the reward models score on the training side, as in a step
            self._enter(Phase.TRAIN)
            model_metrics = add_model_scores(scored, self.recipe.reward_syncs, self.training.reward_scores)
        rewards = [[t.reward for t in ts] for ts in scored]
        metrics = eval_metrics(rewards, scored, cfg.train.eval_pass_threshold, self.eval_sources)
        return {**metrics, **model_metrics, "eval/time_s": time.perf_counter() - t0}

    def _evaluate_pairs(self) -> dict[str, float]:
        """A preference recipe's held-out figures, by the trained weights and without generating: its
        pairwise role's ``pair_metrics`` over ``data.eval_path``'s pairs, with no update (``eval/accuracy``:
        the fraction of pairs whose chosen completion it scores higher, DPO by its implicit reward;
        ``eval/loss``, ``eval/margin``). Further pairwise roles' figures are ``eval/<role>/...``."""
        t0 = time.perf_counter()
        self._enter(Phase.TRAIN)
        pairs = self._offline_trajectories("eval", self.eval_rows, list(range(len(self.eval_rows))))
        prepared = self.training.prepare(TokenBatch.from_trajectories(pairs))
        pairwise = PAIRWISE_SPECIALIZATIONS
        roles = [r.name for r in self.recipe.roles if r.name in prepared and issubclass(r.specialization_cls, pairwise)]
        metrics = {"eval/num_pairs": float(len(self.eval_rows))}
        for name in roles:
            prefix = "eval/" if name == roles[0] else f"eval/{name}/"
            metrics.update({prefix + key: value for key, value in pair_metrics(prepared[name]).items()})
        return {**metrics, "eval/time_s": time.perf_counter() - t0}

    # ----------------------------------------------------------------------------- state
    def save(self, path: Path, trainer_state: dict) -> None:
        """Write the checkpoint into a staging directory, then publish it with one rename
        (``checkpoint.commit``): ``path`` exists only once it is whole."""
        state = {**trainer_state, **self.resume_state()}  # incl. the async pool's untrained samples
        tmp = checkpoint.staging_dir(path)
        self._enter(Phase.TRAIN)
        try:
            self.training.save(tmp, state)
            self.export_policy(tmp / "hf")  # what `transformers` and `areno serve` load
            fault_point("checkpoint_write", int(trainer_state.get("rollout_id", -1)) + 1)
            checkpoint.commit(tmp, path)
        except BaseException as exc:  # noqa: BLE001 - re-raised as save_failure says
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written staging directory holds the disk's space
            raise save_failure(exc, path) from None
        checkpoint.prune(path.parent, self.config.train.keep_checkpoints)  # once the new one is whole

    def resume_state(self) -> dict:
        """What a checkpoint needs beyond the training backends' state: the data cursor (the
        stream's, plus the untrained samples of an asynchronous pool), the policy version and the
        rollout sampler's generator (a synchronous run then samples the same tokens after resume; a run
        without a rollout side has none)."""
        state: dict = {
            "data": self.ledger.state_dict() if self.ledger is not None else self.train_stream.state_dict(),
            # a step trained but not published (an emergency checkpoint after a failed policy sync: the
            # Trainer's) holds the policy of the next version, which a resumed run publishes as such
            "version": self.version + int(self._unpublished),
        }
        rng = self.rollout.rng_state() if self.rollout is not None else None
        if rng is not None:
            state["rollout_rng"] = rng
        return state

    def check_loadable(self) -> None:
        """A checkpoint loads only before an asynchronous engine's rollout pool starts (its samples in
        flight would be lost or trained twice): RuntimeError, before any weight is read, otherwise."""
        handed_out = self.ledger.num_handed_out if self.ledger is not None else 0
        if handed_out:
            raise RuntimeError(
                f"load(): this asynchronous engine's rollout pool has started ({handed_out} samples handed out); "
                "load a checkpoint into a new engine before its first rollout, as a resumed run does"
            )

    def load(self, path: Path) -> dict:
        self.check_loadable()
        self._enter(Phase.TRAIN)
        state = self.training.load(path)
        self._restore(state)
        return state

    def _restore(self, state: dict) -> None:
        """Data cursor, policy version and sampler state of a checkpoint (``resume_state``); the
        loaded weights go to the rollout side."""
        data = state["data"]
        if "stream" in data:  # written by an asynchronous run: stream cursor + untrained samples
            if self.ledger is not None:
                self.ledger.load_state_dict(data)
                # The staleness bound counts every group ever accepted: credit the version's worth at
                # this run's batch size (the untrained ones are regenerated and counted again). The
                # groups the checkpoint trained are that number only at an unchanged rollout.batch_size;
                # a smaller one would leave no room at all, and the run would wait forever.
                staleness = self.executor.staleness
                staleness.credit_accepted(int(state["version"]) * staleness.batch_size)
            elif data["pending"]:
                raise ConfigError(
                    f"the checkpoint holds {len(data['pending'])} untrained samples of an asynchronous run "
                    "(rollout.max_head_offpolicyness > 0): resume it with an online recipe"
                )
            else:
                self.train_stream.load_state_dict(data["stream"])
        else:
            self.train_stream.load_state_dict(data)
        self.version = int(state["version"]) - 1  # update_weights publishes them as that version
        self.update_weights()
        # A run without a rollout side has no sampler: the state that checkpoints of such runs held
        # before they built none is left unread.
        if "rollout_rng" in state and self.rollout is not None:
            self.rollout.set_rng_state(state["rollout_rng"])

    def export_policy(self, path: Path | str) -> None:
        path = Path(path)
        self._enter(Phase.TRAIN)
        self.training.export_hf(path)
        if not any((path / name).is_file() for name in TOKENIZER_FILES):  # else the model's own files, as they are
            self.tokenizer.save_pretrained(path)

    def shutdown(self) -> None:
        """Stop what started, each part even when an earlier one fails to stop (a failed start-up
        leaves some unstarted); the first failure is raised after all were tried."""
        steps = []
        if self.executor is not None:
            steps.append(self.executor.stop)
        if self.workflow is not None:
            steps.append(self.workflow.close)
        if self.rollout is not None:
            steps.append(self.rollout.shutdown)
        steps += [self.training.shutdown, self.close_reward, self._heap.thaw]
        failure: BaseException | None = None
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the others still stop; the first is raised below
                failure = failure or exc
        if failure is not None:
            raise failure

    def close_reward(self) -> None:
        """Stop this run's reward sandbox workers (a later run starts a fresh pool)."""
        release_reward(self.reward_fn)  # closed once no other run of this process scores with it
        self.reward_fn = None
