"""What a run's config is checked for before anything expensive starts (a model built, a warm start
run, a worker launched): the recipe and its arguments, the reward and workflow import paths, the
data files, the device, the run directory (a run that starts over may not append to another one), a
required checkpoint to resume from, the optional packages turned on, the model directory (or
the arguments that create it) and whether its tokenizer can render prompts as data.chat_template asks. Each problem is a one-line :class:`~areno.errors.UserError`.

``Trainer.init`` calls :func:`check_run` first; ``run_pipeline`` calls it for every stage before the
first one starts, so a typo in the main stage does not wait for the warm start. The engine checks
some of the same things again when it builds them: this module only makes them fail first.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from areno.api.config import absolute_setting, flat_settings, to_dict
from areno.api.rundir import check_fresh
from areno.data.datasets import check_prompt_forms, check_splits, data_files, held_out_row_source
from areno.data.prompts import check_chat_template, render_prompt, uses_template
from areno.data.tasks import TaskSpec, generate_rows
from areno.data.tokenizer import (
    TOKENIZER_FILES,
    build_char_tokenizer,
    check_has_tokenizer,
    load_pretrained_tokenizer,
)
from areno.engine.api import check_cuda_capability, check_pair_recipe, generates, init_tiny_stale, resolve_recipe
from areno.engine.config import (
    ArenoConfig,
    RewardSection,
    RolloutSection,
    build_train_backend_config,
    check_offline_rollout,
    field_default,
    has_held_out_rows,
    resolve_rollout_backend,
)
from areno.engine.partitioned import PartitionedCluster, is_partitioned, warn_cpu_oversubscription
from areno.engine.roles import check_partitioned_roles, places_roles, role_allocation
from areno.engine.servers import check_served_model
from areno.errors import ConfigError, DataError, ModelDirError
from areno.launch.allocation import resolve_roles
from areno.launch.servers import check_server_install
from areno.models.checkpoint_dirs import STEP_DIR, newest_checkpoint
from areno.models.config import SEQUENCE_CLASSIFIER_SUFFIX, ModelConfig
from areno.models.hf_io import (
    check_tiny_arguments,
    meta_model,
    missing_model_dir,
    open_safetensors,
    read_config,
    safetensors_files,
    tiny_config,
)
from areno.observe.metrics import resolve_wandb_mode
from areno.recipes import TRAINING_CONFIGS, TrainingConfig
from areno.recipes.registry import worker_name_problem
from areno.recipes.traits import stale_teacher_warning
from areno.rewards.loader import check_reward_signature, reward_functions, takes_answer, wants_sandbox
from areno.specializations import (
    ActorSpecialization,
    MixedLossDaggerOPDSpecialization,
    ModelSpecialization,
    RewardModelSpecialization,
    ScalarScorerSpecialization,
    SequenceScorerSpecialization,
)
from areno.train import checkpoint
from areno.train.lora import apply_lora
from areno.workflows.base import (
    check_workflow_arguments,
    declares_no_reward_parts,
    declares_no_routes,
    routes_dropped,
    workflow_factory,
)
from areno.workflows.common import sample_fields, takes_param
from areno.workflows.images import IMAGES_KEY
from areno.workflows.teacher import TeacherMixtureWorkflow

logger = logging.getLogger(__name__)


def check_run(config: ArenoConfig) -> None:
    """Raise the first :class:`~areno.errors.UserError` that ``config`` would meet, without
    building a model, in this order: recipe (and whether worker processes can import it), reward (and
    its sandbox settings), workflow, data rows (with answers where the reward takes one) and the
    reward's signature against them, devices, held-out rows, placement, minibatches, roles,
    the run directory and resume, optional packages, the model directory and tokenizer, prompt forms
    and held-out lengths, a partitioned layout against the model."""
    recipe = resolve_recipe(config)  # as the engine resolves it (an online policy gets rollout.temperature)
    check_worker_recipe(config)  # a script's own recipe, which worker processes would not find
    check_reward(config)  # evaluation scores with it in every recipe
    if recipe.online:  # with the arguments the engine adds (tokenizer, reward_fn, ...): before any warm start
        factory = workflow_factory(config.rollout.workflow)
        check_workflow_carries_routes(config, factory)
        check_workflow_carries_reward_parts(config, recipe, factory)
        check_workflow_arguments(config.rollout.workflow, factory, dict(config.rollout.workflow_kwargs))
        check_prompt_settings_reach_the_workflow(config, factory)
    # offline recipes train on the answers; a reward that takes one scores against it
    scores_answers = reward_needs_answer(config.reward)
    # dpo, reward_model: {prompt, chosen, rejected} rows, evaluated by pair accuracy (no answers, no reward)
    pairs = check_pair_recipe(config, recipe)
    check_classifier_export(config, recipe)
    answers = not pairs and (not recipe.online or scores_answers)
    splits = check_splits(config.data, need_answers=answers, eval_answers=scores_answers and not pairs, pairs=pairs)
    row, prompt_key, answer_key = reward_row(config, splits)
    check_workflow_takes_images(config, recipe, row)
    section = config.reward
    for fn, path, key in zip(reward_functions(section), section.paths(), section.fn_keys()):
        check_reward_signature(
            fn,
            path,
            list(sample_fields(row, prompt_key, answer_key, IMAGES_KEY)),
            prompt_key=prompt_key,
            answer_key=answer_key,
            row_fields=list(row),
            key=key,
        )
    say_how_many_rows(config, splits)
    if config.cluster.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cluster.device=cuda but no CUDA device is visible: use cluster.device=cpu or auto")
    if config.test_rollout.enabled and config.test_rollout.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("test_rollout.device=cuda but no CUDA device is visible: use test_rollout.device=cpu or auto")
    if config.cluster.device in ("auto", "cuda") and torch.cuda.is_available():
        check_cuda_capability(torch.device("cuda"))  # a GPU too old for the CUDA path, before any model loads
    check_held_out(config)
    say_if_held_out_evaluation_is_off(config)
    check_placement(config, recipe)
    check_minibatches(config, recipe)
    check_recipe_rollout(config, recipe)
    if not recipe.online:
        held_out = has_held_out_rows(config.data)
        check_offline_rollout(config, recipe.name, generates=generates(recipe, pairs=pairs, held_out=held_out))
    role_allocation(config, recipe)  # cluster.role_devices names roles of this recipe and devices that exist
    check_role_optim(config, recipe)
    check_decay_biases_and_norms(config, recipe)
    check_partitioned_roles(config, recipe)
    check_reference_sync(config, recipe)
    check_fresh(config.run_dir, resume=config.resume, overwrite=config.overwrite)
    if config.resume is True and checkpoint.latest_complete(Path(config.run_dir) / "checkpoints") is None:
        raise ConfigError(
            f"resume=true but {Path(config.run_dir) / 'checkpoints'} holds no completed checkpoint "
            "(step_N/COMPLETE): use resume=auto to start fresh when there is none"
        )
    check_resumed_reward_head(config, recipe)
    check_path_options(config, recipe)
    check_optional_packages(config)
    for role in recipe.roles:
        if role.model_path:  # a teacher or another model than the policy
            check_model_files(Path(role.model_path), key=f"role {role.name!r} model_path")
    tokenizer = check_model(config)
    check_served_model_at_start(config)
    check_lora_targets(config, recipe)
    check_role_vocabularies(config, recipe, tokenizer)
    check_chat_template(
        tokenizer, config.data.chat_template, config.data.system_prompt, config.data.chat_template_kwargs
    )
    check_prompt_forms(config.data, splits, templated=uses_template(tokenizer, config.data.chat_template))
    check_context_length(config)
    check_held_out_lengths(config, tokenizer, splits)
    check_partitioned_layout(config)


RUN_IDENTITY = (
    "model.path",
    "train.algorithm",
    "data.task",
    "data.task_kwargs",
    "data.train_path",
    "data.prompt_key",
    "data.answer_key",
    "data.seed",
    "data.shuffle",
    "train.lora.rank",
    "train.lora.target_modules",
)
"""Settings a resumed run may not change: its checkpoints' model, recipe and data order come from them (and the
shape of a LoRA run's adapters, which its checkpoints hold)."""


def check_resumed_config(config: ArenoConfig) -> None:
    """A run that resumes keeps its model, recipe and data (``RUN_IDENTITY``: a ConfigError naming the
    changed keys); other changed keys are logged as one warning line. ``Trainer.init`` checks it, with
    the stage's own config (``model.path`` a warm start's export)."""
    saved = Path(config.run_dir) / "config.yaml"
    if not resumes(config):
        return
    start_over = "or start over (resume=false overwrite=true) or in another run_dir"
    if not saved.is_file():
        raise ConfigError(
            f"resume: {config.run_dir} holds checkpoints but no config.yaml, without which a resumed run cannot "
            f"check that it keeps the run's model, recipe and data: restore {saved}, {start_over}"
        )
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(saved))
    except Exception as exc:  # noqa: BLE001 - YAML's parser errors, or a file that is not text
        loaded = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not isinstance(loaded, dict) or not loaded.get("model"):
        why = loaded if isinstance(loaded, str) else "it holds no run settings"
        raise ConfigError(f"resume: {saved} is unreadable ({why}): restore it, {start_over}")
    # a config.yaml written before paths were made absolute: its relative paths read from here
    before = {k: absolute_setting(k, v) for k, v in flat_settings(loaded).items()}
    # a tuple setting (train.lora.target_modules) reads back from YAML as a list: the same setting
    now = {k: list(v) if isinstance(v, tuple) else v for k, v in flat_settings(to_dict(config)).items()}
    keys = sorted((set(before) | set(now)) - {"resume", "overwrite"})  # how this run starts, not what it is
    # a key areno added since the run was saved: the saved run had its default
    defaults = flat_settings(to_dict(type(config)()))
    before = {k: before.get(k, defaults.get(k)) for k in keys}
    changed = [k for k in keys if before.get(k) != now.get(k)]
    fixed = [k for k in changed if any(k == p or k.startswith(p + ".") for p in RUN_IDENTITY)]
    if fixed:
        was = ", ".join(f"{k}={before.get(k)!r}" for k in fixed)
        raise ConfigError(
            f"resume: {config.run_dir} holds a run made with {was}, which a resumed run cannot change: resume "
            "with those, or start over (resume=false overwrite=true) or in another run_dir"
        )
    if changed:
        shown = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:8])
        logger.warning("resume: settings changed since the run was saved: %s", shown)


def check_workflow_carries_routes(config: ArenoConfig, factory: Callable[..., Any]) -> None:
    """``train.moe_rollout_routes`` / ``moe_routing_replay`` with a workflow class that says its trajectories
    drop the rollout's expert routes (``declares_no_routes``): refused here rather than at the first step."""
    train = config.train
    if (train.moe_rollout_routes or train.moe_routing_replay) and declares_no_routes(factory):
        key = "train.moe_routing_replay" if train.moe_routing_replay else "train.moe_rollout_routes"
        raise routes_dropped(key, config.rollout.workflow)


def check_workflow_carries_reward_parts(
    config: ArenoConfig, recipe: TrainingConfig, factory: Callable[..., Any]
) -> None:
    """``advantage_estimator=gdpo`` with a workflow class that says its trajectories carry no per-function reward
    scores (``declares_no_reward_parts``: an agent's, an environment's): refused here rather than at the first step."""
    if recipe.policy_role.init_kwargs.get("advantage_estimator") == "gdpo" and declares_no_reward_parts(factory):
        raise ConfigError(
            f"train.algorithm_kwargs.advantage_estimator=gdpo normalises each function of reward.fn on its own, and "
            f"rollout.workflow={config.rollout.workflow} records one reward per trajectory, not each function's "
            "score: use advantage_estimator=grpo"
        )


def check_workflow_takes_images(config: ArenoConfig, recipe: TrainingConfig, row: dict) -> None:
    """Rows with images need a workflow that puts them into its prompts (one that takes ``vision``, as
    ``RLVRWorkflow``): the multi-turn, agent and teacher workflows rendered the prompt alone, unsaid."""
    workflow = config.rollout.workflow
    if not recipe.online or not row.get(IMAGES_KEY) or "vision" in config.rollout.workflow_kwargs:
        return
    if not takes_param(workflow, "vision"):
        raise ConfigError(
            f"rollout.workflow={workflow}: the data's rows hold images, which this workflow does not put into its "
            "prompts (it takes no vision): use areno.workflows.rlvr:RLVRWorkflow (the default), or drop the images field"
        )


def reward_row(config: ArenoConfig, splits: tuple[list[dict], list[dict]] | None) -> tuple[dict, str, str]:
    """A data row as the reward meets it, with the keys of its prompt and answer fields: a file's
    first training row, or a shipped task's (whose fields build_splits names data.prompt_key and
    data.answer_key later). The row's other fields reach the reward as keywords (``sample_fields``)."""
    data = config.data
    if splits is None:
        row = generate_rows(TaskSpec(name=data.task, kwargs=dict(data.task_kwargs)), split="train", num=1, seed=0)[0]
        return row, "prompt", "answer"
    return splits[0][0], data.prompt_key, data.answer_key


def reward_needs_answer(section: RewardSection) -> bool:
    """Whether a reward ``reward.fn`` names scores against a row's answer: a shipped reward marked
    ``fn.areno_needs_answer``, or one whose ``answer`` argument has no default (``takes_answer``). A
    row without one would be scored against None, silently: such rows are refused instead."""
    return any(getattr(fn, "areno_needs_answer", False) or takes_answer(fn) for fn in reward_functions(section))


_ROWS_SAID: set[tuple] = set()
"""The data settings whose row counts were told in this process (``check_run`` runs twice for a run)."""


def say_how_many_rows(config: ArenoConfig, splits: tuple[list[dict], list[dict]] | None) -> None:
    """A file's rows against what the run asks of them: a warning when ``rollout.batch_size`` (a warm
    start's ``warm_start.batch_size``) is larger than the training file (every batch then holds rows
    more than once), and one line when ``data.num_eval`` asks for more held-out rows than
    ``data.eval_path`` has (all of them are evaluated)."""
    if splits is None:
        return
    data, batch_size = config.data, config.rollout.batch_size
    said = (str(data.train_path), str(data.eval_path), data.num_eval, batch_size)
    if said in _ROWS_SAID:
        return
    _ROWS_SAID.add(said)
    train, held_out = splits
    # the warm start's stage (pipeline.warm_start_config: sft in run_dir/warm_start) has its own batch setting
    warm = Path(config.run_dir).name == "warm_start" and config.train.algorithm == "sft"
    key = "warm_start.batch_size" if warm else "rollout.batch_size"
    if batch_size > len(train):
        logger.warning(
            "%s=%d is larger than data.train_path's %d rows: every batch holds some rows more than once (each "
            "about %g times); lower %s to %d or less, or add rows",
            key,
            batch_size,
            len(train),
            round(batch_size / len(train), 1),
            key,
            len(train),
        )
    one_file = data.eval_path is not None and len(data_files(data.eval_path, key="data.eval_path")) == 1
    if one_file and len(held_out) < data.num_eval:  # build_splits kept the first num_eval
        logger.info(
            "data.num_eval=%d but data.eval_path (%s) has %d rows: all %d are evaluated",
            data.num_eval,
            data.eval_path,
            len(held_out),
            len(held_out),
        )


def resumes(config: ArenoConfig) -> bool:
    """Whether the run continues from a checkpoint of its run_dir."""
    return config.resume is not False and checkpoint.latest_complete(Path(config.run_dir) / "checkpoints") is not None


def check_worker_recipe(config: ArenoConfig) -> None:
    """A recipe that worker processes resolve by name is one they can import: a run that starts them
    (``cluster.role_devices``, a partitioned run) refuses a bare name registered by a script's
    ``__main__`` or a module it imported (``registry.worker_name_problem``), which would fail there
    with "unknown recipe" once the workers start."""
    if not (places_roles(config) or is_partitioned(config)):
        return
    problem = worker_name_problem(config.train.algorithm)
    if problem is not None:
        workers = "cluster.role_devices" if places_roles(config) else "a partitioned run"
        raise ConfigError(
            f"train.algorithm={config.train.algorithm!r}: the worker processes of {workers} resolve the recipe "
            f"by name in a fresh interpreter, but it is {problem}"
        )


def check_reward(config: ArenoConfig) -> None:
    """Every function ``reward.fn`` names imports (the first that does not is the error, naming its
    entry); the sandbox's limits are not set for a reward that runs in-process (``reward.timeout_s`` is:
    an in-process call past it is reported, ``rewards/inprocess.py``)."""
    section = config.reward
    if wants_sandbox(reward_functions(section), section.sandbox):
        return
    for key in ("memory_mb", "cpu_s", "workers", "allow_network"):
        if getattr(section, key) != field_default(RewardSection, key):
            safe = section.paths()[0] if len(section.paths()) == 1 else "every function of reward.fn"
            how = "reward.sandbox=false" if section.sandbox is False else f"{safe} is cheap and safe in-process"
            raise ConfigError(
                f"reward.{key} bounds the reward's sandbox workers, but the reward runs in this process ({how}): "
                "set reward.sandbox=true, or drop the key"
            )


def check_held_out(config: ArenoConfig) -> None:
    """What evaluates held-out rows has some: the background test rollout, the best checkpoint's figure."""
    data = config.data
    if config.train.best_metric is not None and not has_held_out_rows(data):
        raise ConfigError(
            f"train.best_metric={config.train.best_metric}: the run has no held-out rows to evaluate: set "
            "data.num_eval > 0 (and data.eval_path when data.task is null), or unset train.best_metric"
        )
    if config.test_rollout.enabled and (data.num_eval == 0 or (data.task is None and data.eval_path is None)):
        raise ConfigError(
            "test_rollout.enabled: there are no held-out rows to evaluate: set data.num_eval > 0 "
            "(and data.eval_path when data.task is null), or test_rollout.enabled=false"
        )


def check_placement(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """A partitioned placement needs a recipe with a rollout side (an offline one would run colocated)."""
    cluster = config.cluster
    if cluster.asks_partitioned() and not recipe.online:
        given = (
            f"cluster.allocation_mode={cluster.allocation_mode!r}"
            if cluster.allocation_mode
            else "cluster.train_devices / cluster.rollout_devices"
        )
        raise ConfigError(
            f"train.algorithm={recipe.name!r} trains offline on the dataset's rows in this process (any held-out "
            f"evaluation samples beside it), but {given} would partition the run: unset it to train colocated "
            "on cluster.device"
        )


def check_reference_sync(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """A reference that follows the policy (``train.algorithm_kwargs.ref_sync_steps``) is mixed in place from
    the policy's unsharded weights, so both must be roles of this process: not a partitioned run's FSDP2
    shards in training workers, nor a reference that ``cluster.role_devices`` moves to a worker of its own."""
    sync = recipe.reference_sync
    if sync is None:
        return
    where = None
    if is_partitioned(config):
        where = "a partitioned run shards the policy and its reference over training workers"
    elif places_roles(config) and role_allocation(config, recipe)[sync.target] != (0,):
        key = "cluster.role_devices" if config.cluster.role_devices else "cluster.allocation_mode"
        where = f"{key} moves role {sync.target!r} to a worker process of its own"
    if where is not None:
        raise ConfigError(
            f"train.algorithm_kwargs.ref_sync_steps={sync.every}: the reference moves toward the policy in place, "
            f"in the policy's process, but {where}: train colocated with both roles on the policy's device, or drop "
            "ref_sync_steps"
        )


def check_prompt_settings_reach_the_workflow(config: ArenoConfig, factory: Any) -> None:
    """A ``data.*`` prompt setting the run sets is refused when its workflow renders its own prompts (it
    takes no such parameter, and ``rollout.workflow_kwargs`` do not set it): training would not see it,
    held-out evaluation would."""
    data, kwargs = config.data, config.rollout.workflow_kwargs
    given = {
        "chat_template": data.chat_template != "auto",
        "system_prompt": data.system_prompt is not None,
        "chat_template_kwargs": bool(data.chat_template_kwargs),
    }
    for name, set_ in given.items():
        if set_ and name not in kwargs and not takes_param(factory, name):
            raise ConfigError(
                f"data.{name} is set but rollout.workflow={config.rollout.workflow} renders its own prompts (it "
                f"takes no {name} parameter): its rollouts would not use it while held-out evaluation would; unset "
                "it, or use a workflow that takes it"
            )


def check_context_length(config: ArenoConfig) -> None:
    """``rollout.max_model_len`` within the model's positions (the engine refuses it later, after loading)."""
    model_config = run_model_config(config)
    where = f" in {config.model.path}/config.json"
    model_config.check_context(config.rollout.max_model_len, "rollout.max_model_len", where=where)
    context = config.rollout.max_model_len or model_config.max_seq_len
    if config.rollout.max_new_tokens >= context:
        logger.warning(
            "rollout.max_new_tokens=%d is not below the context of %d tokens (rollout.max_model_len, else the "
            "model's %s): a completion stops where its prompt and it fill the context, before its budget",
            config.rollout.max_new_tokens,
            context,
            model_config.positions_source,
        )


def check_held_out_lengths(config: ArenoConfig, tokenizer: Any, splits: tuple[list[dict], list[dict]] | None) -> None:
    """Every held-out prompt of a file fits the context with room for a token (each evaluation scores
    them all; a training row that does not fit is dropped with a warning instead)."""
    if splits is None or not splits[1]:
        return
    context = config.rollout.max_model_len or run_model_config(config).max_seq_len
    data = config.data
    templating = data.templating()
    for i, row in enumerate(splits[1]):
        if row.get(IMAGES_KEY):  # its image tokens are counted when the images are processed
            continue
        try:
            n = len(render_prompt(tokenizer, row[data.prompt_key], **templating))
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, or whatever the template raises
            raise DataError(
                f"{held_out_row_source(data, i)}: the chat template fails on its prompt ({type(exc).__name__}: {exc}): "
                "fix the row or the template"
            ) from None
        if n >= context:
            raise DataError(
                f"{held_out_row_source(data, i)}: the prompt has {n} tokens but the context is {context} "
                "(rollout.max_model_len, else the model's positions): shorten or remove the row"
            )


def check_classifier_export(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """A reward model is exported as transformers' sequence classifier of its decoder, which a
    vision-language model has none of: refused before training (its export loaded nowhere)."""
    trained = [r for r in recipe.roles if r.trainable and issubclass(r.specialization_cls, RewardModelSpecialization)]
    if trained and run_model_config(config).vision is not None:
        raise ConfigError(
            f"train.algorithm={recipe.name}: model.path is a vision-language model, and transformers has no sequence "
            "classifier of one to export the reward model as: train it on a text-only model"
        )


def run_model_config(config: ArenoConfig) -> ModelConfig:
    """The shape of the model the run will load: model.path's, or the one ``model.init_tiny`` makes
    there at start-up (none yet, or one of other arguments, which a resumed run keeps)."""
    path = Path(config.model.path)
    if (path / "config.json").is_file() and (init_tiny_stale(config) is None or resumes(config)):
        return read_config(path)
    return tiny_config(len(build_char_tokenizer()), **config.model.init_tiny)


def describe_model(model: ModelConfig) -> str:
    """One line on the model a run trains: its architecture and size, and what a vision-language
    checkpoint's text model leaves as it is."""
    line = f"{model.architecture}, {model.num_params() / 1e6:,.1f}M parameters"
    if model.container is not None:
        line += f", the text model of a {model.container['architecture']} (its vision tower is kept as it is)"
    return line


def check_partitioned_layout(config: ArenoConfig) -> None:
    """A partitioned run's device lists, TP sizes and routing fit the devices and the model: what the
    engine checks when it is built, here before a warm start or any model load (it reads config.json
    only, or the ``model.init_tiny`` arguments of a model not made yet)."""
    if not is_partitioned(config) or config.rollout.backend != "areno":
        return
    cluster = PartitionedCluster(config, Path(config.run_dir))  # plans and checks the layout; starts nothing
    cluster.check_tp(cluster.layout, run_model_config(config))
    warn_cpu_oversubscription(
        config, cluster.layout
    )  # before the model loads; the launch says it once more only if not


def check_minibatches(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """``train.num_minibatches`` splits a step's sequences: at most one minibatch per sequence."""
    rollout = config.rollout
    if recipe.online and rollout.workflow != field_default(RolloutSection, "workflow"):
        return  # a multi-turn or agent workflow may make more trajectories than samples
    sequences = rollout.batch_size * rollout.n_samples if recipe.online else rollout.batch_size
    if config.train.num_minibatches > sequences:
        raise ConfigError(
            f"train.num_minibatches={config.train.num_minibatches} is more than the {sequences} sequences of a step "
            f"(rollout.batch_size{' x rollout.n_samples' if recipe.online else ''}): set it to at most {sequences}"
        )


def check_role_optim(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """``train.role_optim`` names roles of the recipe that train."""
    roles = {r.name: r for r in recipe.roles}
    for given, role in resolve_roles(config.train.role_optim, roles, key="train.role_optim").items():
        if not roles[role].trainable:
            raise ConfigError(
                f"train.role_optim.{given}: role {role!r} is frozen in {recipe.name!r}: it has no optimizer"
            )


def check_decay_biases_and_norms(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """``decay_biases_and_norms`` (the ``optim`` section's, or a role's in ``train.role_optim``) set where it
    decays nothing: in every role that takes it, a weight decay of 0, or LoRA, whose adapters are matrices
    (decayed anyway) beside a frozen decoder. A role that wraps the decoder in a head (a critic's value head)
    trains that head in full under LoRA, its bias too."""
    roles = {r.name: r for r in recipe.roles}
    given = {role: name for name, role in resolve_roles(config.train.role_optim, roles, key="train.role_optim").items()}
    own = {role: config.train.role_optim[name] for role, name in given.items()}

    def why_inert(role: str) -> str | None:
        """Why ``decay_biases_and_norms`` decays nothing in ``role``, with the fix; None where it decays."""
        cfg = build_train_backend_config(config, role_name=role, trainable=True)
        if cfg.weight_decay == 0:
            where = f"train.role_optim.{given[role]}" if "weight_decay" in own.get(role, {}) else "optim"
            return f"the weight decay of role {role!r} is 0, so nothing decays: set {where}.weight_decay > 0 too, or drop it"
        # a role without a head of its own (ModelSpecialization.wrap_model kept) trains the adapters alone
        if cfg.lora is not None and roles[role].specialization_cls.wrap_model is ModelSpecialization.wrap_model:
            return (
                f"under train.lora role {role!r} trains only its adapters' matrices, which optim.weight_decay decays "
                "anyway (the decoder's biases and norm scales are frozen): drop it"
            )
        return None

    trainable = [r.name for r in recipe.roles if r.trainable]
    for role in trainable:  # a role's own setting
        why = why_inert(role) if own.get(role, {}).get("decay_biases_and_norms") else None
        if why:
            raise ConfigError(f"train.role_optim.{given[role]}.decay_biases_and_norms: true does nothing: {why}")
    takers = [role for role in trainable if "decay_biases_and_norms" not in own.get(role, {})]  # the optim section's
    reasons = [why_inert(role) for role in takers] if config.optim.decay_biases_and_norms else []
    if reasons and all(reasons):
        raise ConfigError(f"optim.decay_biases_and_norms: true does nothing: {reasons[0]}")


def check_optional_packages(config: ArenoConfig) -> None:
    """The packages of the optional features the config turns on are installed (the metrics logger
    imports them only once the models are built)."""
    observe = config.observe
    for enabled, package, fix in (
        (observe.tensorboard, "tensorboard", "pip install tensorboard, or set observe.tensorboard=false"),
        (observe.wandb_project is not None, "wandb", "pip install 'areno[wandb]', or unset observe.wandb_project"),
    ):
        if enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(f"observe: {package} is not installed: {fix}")
    if observe.wandb_project is not None:
        resolve_wandb_mode(observe.wandb_mode, os.environ)  # a bad WANDB_MODE, before any model is built


def check_model(config: ArenoConfig) -> Any:
    """``model.path`` is a loadable checkpoint directory with a tokenizer that has an EOS token, or
    ``model.init_tiny`` can create one there; returns the tokenizer the run will use."""
    model = config.model
    path = Path(model.path)
    if path.is_file():  # neither loadable nor a place to make a model in
        raise ModelDirError(_a_file("model.path", path, init_tiny=model.init_tiny is not None))
    if model.init_tiny is not None and (not (path / "config.json").is_file() or init_tiny_stale(config)):
        check_init_tiny(model.init_tiny)  # the engine creates the model there
        return build_char_tokenizer()
    model_config = check_model_files(path, key="model.path")
    check_has_tokenizer(path, key="model.path")
    try:
        tokenizer = load_pretrained_tokenizer(path)
    except (OSError, ValueError, TypeError) as exc:  # a corrupt or incomplete tokenizer file
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelDirError(
            f"model.path: the tokenizer in {path} does not load ({type(exc).__name__}: {first}): "
            "copy the model's tokenizer files there again"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ModelDirError(f"model.path: the tokenizer in {path} has no eos_token: set one in tokenizer_config.json")
    check_tokenizer_fits(tokenizer, model_config.vocab_size, path)
    return tokenizer


def check_served_model_at_start(config: ArenoConfig) -> None:
    """With vLLM or SGLang rollouts: the server's package is installed (unless the servers are the user's), and it
    serves ``model.path`` as areno trains it (``check_served_model``), before any model loads (a model
    ``model.init_tiny`` makes at start-up is checked when it is, before any server starts)."""
    backend = resolve_rollout_backend(config.rollout.backend, config.cluster.allocation_mode)
    if backend == "areno":
        return
    if not config.rollout.servers:
        check_server_install(backend)
    path = Path(config.model.path)
    if (path / "config.json").is_file():
        check_served_model(backend, path, json.loads((path / "config.json").read_text(encoding="utf-8")))


def check_lora_targets(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """``train.lora.target_modules`` adapt linear layers the trained roles' model has and areno merges: LoRA applied
    to the model built on the meta device (no weights read), so a misspelt name or an expert projection is one line
    before any weights load."""
    if config.train.lora is None or not any(role.trainable and not role.model_path for role in recipe.roles):
        return
    apply_lora(meta_model(run_model_config(config)), config.train.lora)


def check_tokenizer_fits(tokenizer: Any, vocab_size: int, path: Path) -> None:
    """The tokenizer is the model's: its ids within the embedding (a tokenizer copied from another model
    would fail every request) and text encodes to some token (tokenizer_config.json without its
    vocabulary file loads as a tokenizer of special tokens alone, and every prompt would train as empty)."""
    size = len(tokenizer)
    base = getattr(tokenizer, "vocab_size", size)  # without added tokens: a pad added past the embedding is unused
    if base > vocab_size:
        raise ModelDirError(
            f"model.path: the tokenizer in {path} has a vocabulary of {base} tokens but config.json's vocab_size is "
            f"{vocab_size}: it is another model's tokenizer; copy this model's tokenizer files there"
        )
    if not tokenizer.encode("1 + 1 = 2, the answer", add_special_tokens=False):
        raise ModelDirError(
            f"model.path: the tokenizer in {path} encodes text to no token ({size} tokens in all; its vocabulary "
            "file, tokenizer.json or vocab.json, is missing): copy the model's tokenizer files there again"
        )


def check_model_files(path: Path, *, key: str) -> ModelConfig:
    """What loading the checkpoint at ``path`` would reject, found without reading a tensor:
    config.json (a model this decoder implements), the weight files and their headers; returns the config."""
    if path.is_file():
        raise ModelDirError(_a_file(key, path))
    if not path.is_dir():
        raise ModelDirError(missing_model_dir(key, path))
    config = read_config(path, key=key)
    for weights in safetensors_files(path):
        with open_safetensors(weights):  # parses the header: a truncated file fails here
            pass
    return config


def _a_file(key: str, path: Path, *, init_tiny: bool = False) -> str:
    """The message of a model setting that names a file where a checkpoint directory goes (with
    ``init_tiny``: where ``model.init_tiny`` would make its model)."""
    if init_tiny:
        return (
            f"{key}: {path} is a file, not a directory: point model.path at a new directory for the tiny model, or at "
            "a Hugging Face checkpoint directory with model.init_tiny=null"
        )
    return (
        f"{key}: {path} is a file, not a directory: point it at a Hugging Face checkpoint directory "
        "(config.json, *.safetensors and the tokenizer files)"
    )


def check_init_tiny(init_tiny: dict) -> None:
    """``model.init_tiny`` makes a model for the character tokenizer: its keys and their types
    (``check_tiny_arguments``), then the shape they give."""
    check_tiny_arguments(init_tiny, key="model.init_tiny")
    try:
        tiny_config(len(build_char_tokenizer()), **init_tiny)
    except (TypeError, ValueError) as exc:  # a shape the model cannot take (heads that do not divide, ...)
        raise ConfigError(f"model.init_tiny: {exc}") from None


_SAID_ONCE: set[tuple[str, str, str]] = set()
"""(what, run_dir, recipe) of the start-up warnings said in this process: ``check_run`` runs twice for one
run (the pipeline's check, then ``Trainer.init``'s), and each warning is said once."""


def check_recipe_rollout(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """The rollout gives the recipe what its loss assumes: groups of ``rollout.n_samples >= 2`` where it
    compares a prompt's completions (a ConfigError with areno's workflows; a warning with a user's,
    which may build its groups otherwise). Said once at start, as warnings (each a legitimate choice, but
    easily mistaken): stale rollouts for a PPO-family loss that does not correct for them
    (``stale_rollout_warning``), a recipe made for stale rollouts run synchronously
    (``synchronous_decoupled_warning``), a mixed DAgger/OPD loss whose workflow executes no teacher
    token (``mixed_loss_warning``), and stale rollouts scored by a frozen teacher for a loss without an
    importance correction (``stale_teacher_warning``)."""
    try:
        recipe.check_n_samples(config.rollout.n_samples)
    except ConfigError as exc:
        if config.rollout.workflow.startswith("areno."):
            raise
        logger.warning("%s (unless rollout.workflow %s returns larger groups itself)", exc, config.rollout.workflow)
    if not recipe.online:
        return
    for what, say in (
        ("stale", stale_rollout_warning),
        ("synchronous", synchronous_decoupled_warning),
        ("mixed", mixed_loss_warning),
        ("teacher", lambda c, r: stale_teacher_warning(r, c.rollout.max_head_offpolicyness)),
    ):
        key = (what, config.run_dir, recipe.name)
        if key in _SAID_ONCE:
            continue
        line = say(config, recipe)
        if line:
            _SAID_ONCE.add(key)
            logger.warning("%s", line)


def stale_rollout_warning(config: ArenoConfig, recipe: TrainingConfig) -> str | None:
    """Why ``rollout.max_head_offpolicyness > 0`` trains this PPO-family policy on stale rollouts without
    correcting for them, and the correction that works for its loss; None where there is nothing to say:
    fresh rollouts, another loss, the decoupled loss (which corrects), or cispo's (its weight
    sg[min(pi_theta / pi_behave, 1 + eps_high)] is truncated importance sampling against the policy that
    sampled the tokens, a correction of its own)."""
    staleness = config.rollout.max_head_offpolicyness
    spec = recipe.policy_role.build() if staleness > 0 else None
    if not isinstance(spec, ActorSpecialization) or spec.config.use_decoupled_loss:
        return None
    c = spec.config
    if c.policy_loss == "cispo" and not c.recompute_logprob:
        return None
    corrected = f"{recipe.name}_async"
    if corrected in TRAINING_CONFIGS:
        instead = f"train.algorithm={corrected} (decoupled PPO)"
    elif c.policy_loss == "ppo":  # the decoupled loss is a form of the ppo loss only (ActorConfig refuses it else)
        instead = "train.algorithm_kwargs.use_decoupled_loss=true (decoupled PPO)"
    else:
        instead = f"train.algorithm=grpo_async (decoupled PPO; the {c.policy_loss} loss has no decoupled form)"
    anchor = (
        "its ratio taken against log-probs the current weights recompute, so their staleness is ignored, not corrected"
        if c.recompute_logprob
        else "its clip anchored at the stale policy that sampled them"
    )
    return (
        f"train.algorithm={recipe.name} with rollout.max_head_offpolicyness={staleness} trains on rollouts up to that "
        f"many policy versions old, {anchor}: use {instead}, or rollout.max_head_offpolicyness=0 for fresh rollouts"
    )


def synchronous_decoupled_warning(config: ArenoConfig, recipe: TrainingConfig) -> str | None:
    """Why a policy with the decoupled loss (the ``*_async`` recipes) gains nothing from it at
    ``rollout.max_head_offpolicyness=0``, where every rollout is fresh, and what makes the run asynchronous;
    None where the rollouts may be stale or the loss is another."""
    if config.rollout.max_head_offpolicyness > 0:
        return None
    # another engine's log-probs differ from the trainer's: the decoupled loss's behaviour weight corrects that
    # mismatch even with fresh rollouts (as TRL's vllm_importance_sampling_correction)
    if resolve_rollout_backend(config.rollout.backend, config.cluster.allocation_mode) != "areno":
        return None
    spec = recipe.policy_role.build()
    if not isinstance(spec, ActorSpecialization) or not spec.config.use_decoupled_loss:
        return None
    cost = (
        " and pays a no-grad forward of the policy every step for its proximal log-probs"
        if spec.config.prox_logp_method == "recompute"
        else ""
    )
    base = recipe.name.split("_async")[0]
    if base != recipe.name and base in TRAINING_CONFIGS:
        otherwise = f", or train.algorithm={base} for synchronous training"
    elif "use_decoupled_loss" in config.train.algorithm_kwargs:
        otherwise = ", or drop train.algorithm_kwargs.use_decoupled_loss for synchronous training"
    else:
        otherwise = ""
    return (
        f"train.algorithm={recipe.name} with rollout.max_head_offpolicyness=0 runs synchronously: every rollout "
        f"comes from the current policy, so its decoupled loss has no staleness to correct{cost}: set "
        f"rollout.max_head_offpolicyness=N (N >= 1, e.g. 2) to let rollouts run up to N policy versions ahead of "
        f"training{otherwise}"
    )


def mixed_loss_warning(config: ArenoConfig, recipe: TrainingConfig) -> str | None:
    """What a mixed DAgger/OPD policy trains on at first when areno's workflow marks no completion token
    teacher-executed (not ``TeacherMixtureWorkflow``, or that workflow with ``beta=0``): its cross-entropy
    term, weighted beta (1 at the start by default), is 0, and the reverse-KL term has weight 1 - beta, which the
    schedule raises from 0. None where the CE term has weight 0 from the start, the workflow executes
    teacher tokens, or it is a user's workflow (which may mark them)."""
    spec = recipe.policy_role.build()
    if not isinstance(spec, MixedLossDaggerOPDSpecialization) or spec.beta(0) == 0:
        return None
    factory = workflow_factory(config.rollout.workflow)
    if isinstance(factory, type) and issubclass(factory, TeacherMixtureWorkflow):
        share = config.rollout.workflow_kwargs.get("beta", inspect.signature(factory).parameters["beta"].default)
        if share > 0:
            return None
        why = "rollout.workflow_kwargs.beta=0 lets the teacher generate no completion"
    elif config.rollout.workflow.startswith("areno."):
        why = f"rollout.workflow={config.rollout.workflow} marks no token teacher-executed"
    else:
        return None
    decay = spec.beta_decay_steps  # step s trains policy version s - 1
    weights = (
        f"{1 - spec.beta_end:g} throughout (beta_decay_steps=0: beta = beta_end={spec.beta_end:g})"
        if decay == 0
        else f"{1 - spec.beta(0):g} at step 1, {1 - spec.beta(1):g} at step 2 and {1 - spec.beta(decay):g} from "
        f"step {decay + 1} on (beta from beta_start={spec.beta_start:g} to beta_end={spec.beta_end:g} over "
        f"beta_decay_steps={decay} policy versions)"
    )
    return (
        f"train.algorithm={recipe.name}: {why}, so the cross-entropy term (weight beta) is 0 and only the reverse-KL term "
        f"on the student's tokens trains, with weight 1 - beta = {weights}: for DAgger's teacher-executed tokens set "
        "rollout.workflow=areno.workflows.teacher:TeacherMixtureWorkflow (rollout.workflow_kwargs.beta > 0); for "
        "on-policy distillation from the first step set train.algorithm_kwargs.beta_start=0 (or use train.algorithm=opd)"
    )


def check_path_options(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """The directories the run loads are of the right kind, named by the setting that gives them:
    ``model.path`` and a role's model (a teacher's ``teacher_path``) a Hugging Face directory, not a
    run or checkpoint directory of areno (its ``checkpoints/step_N/hf`` export is one); a scorer role
    names the checkpoint of its head (``head_path``), for a value head (``value_head_path``) an areno
    critic checkpoint, ``checkpoints/step_N/<critic role>``."""
    check_model_path_option("model.path", Path(config.model.path))
    for role in recipe.roles:
        if role.model_path:
            key = path_setting(config, role.model_path, f"role {role.name!r} model_path")
            if Path(role.model_path).is_file():
                raise ModelDirError(_a_file(key, Path(role.model_path)))
            if not Path(role.model_path).is_dir():
                raise ModelDirError(
                    f"{key}: directory {role.model_path} does not exist: point it at a Hugging Face model directory "
                    "(a run's checkpoints/step_N/hf)"
                )
            check_model_path_option(key, Path(role.model_path))
            if not (Path(role.model_path) / "config.json").is_file():
                raise ModelDirError(
                    f"{key}: {role.model_path} has no config.json: point it at a Hugging Face model directory "
                    "(a run's checkpoints/step_N/hf)"
                )
        if issubclass(role.specialization_cls, SequenceScorerSpecialization) and role.model_path:
            check_sequence_classifier(
                path_setting(config, role.model_path, f"role {role.name!r}"), Path(role.model_path)
            )
        if not issubclass(role.specialization_cls, ScalarScorerSpecialization):
            continue
        head, head_path = role.init_kwargs.get("head", "reward_model"), role.init_kwargs.get("head_path")
        if head == "reward_model" and head_path and (Path(head_path) / "config.json").is_file():
            check_sequence_classifier(path_setting(config, head_path, f"role {role.name!r} head_path"), Path(head_path))
        if not head_path:
            raise ConfigError(
                f"role {role.name!r} (ScalarScorerSpecialization, head={head}) has no head_path, the checkpoint "
                f"its head is read from: set the role's init_kwargs.head_path to {SCORER_HEAD_SOURCES.get(head, 'it')}"
            )
        if head == "value_head":
            key = path_setting(config, head_path, f"role {role.name!r} head_path")
            check_critic_path_option(key, Path(head_path))
            check_critic_shape(key, Path(head_path), run_model_config(config))


def check_sequence_classifier(key: str, path: Path) -> None:
    """A ModelDirError, before any model loads, where the reward model at ``path`` (setting ``key``) is not a
    transformers sequence classifier with one label (``*ForSequenceClassification``, ``num_labels=1``): a
    causal LM has no score head, and several labels are no scalar reward."""
    hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    architectures = hf.get("architectures") or []
    made = (
        "train one with train.algorithm=reward_model (its checkpoints/step_N/hf), or save it with transformers' "
        "AutoModelForSequenceClassification(num_labels=1)"
    )
    if not any(str(a).endswith(SEQUENCE_CLASSIFIER_SUFFIX) for a in architectures):
        raise ModelDirError(
            f"{key}: {path} is a {', '.join(map(str, architectures)) or 'model without architectures'} checkpoint, not "
            f"a reward model (*{SEQUENCE_CLASSIFIER_SUFFIX}, one label): {made}"
        )
    labels = len(hf["id2label"]) if isinstance(hf.get("id2label"), dict) else hf.get("num_labels", 2)
    if labels != 1:
        raise ModelDirError(
            f"{key}: {path} is a classifier of {labels} labels; a reward is one score (num_labels=1): {made}"
        )


SCORER_HEAD_SOURCES = {
    "reward_model": "a transformers sequence-classification directory (AutoModelForSequenceClassification, "
    "num_labels=1; a reward_model run's checkpoints/step_N/hf)",
    "value_head": "an areno critic checkpoint, a PPO run's checkpoints/step_N/<critic role>",
}
"""What a scorer role's ``head_path`` names, per ``head`` (``specializations.scorer.SCORER_HEADS``)."""


def check_resumed_reward_head(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """A resumed reward model's checkpoint holds no head bias, or a zero one. An older areno's reward head
    had a bias; this one's has none (``RewardModelSpecialization.wrap_model``) and cannot take it, and
    dropping a nonzero one would shift every score the run exports by it: a ModelDirError naming the
    checkpoint and what to do instead."""
    step = checkpoint.latest_complete(Path(config.run_dir) / "checkpoints") if resumes(config) else None
    if step is None:
        return
    for role in recipe.roles:
        if not (role.trainable and issubclass(role.specialization_cls, RewardModelSpecialization)):
            continue
        bias = stored_model_tensor(step / role.name, "score.bias")
        if bias is not None and bool(bias.ne(0).any()):
            export = step / "hf"
            keep = f" (model.path={export} keeps its decoder)" if (export / "config.json").is_file() else ""
            raise ModelDirError(
                f"resume: {step / role.name} holds a reward head bias ({float(bias.flatten()[0]):.4g}), saved by an "
                "older areno: this areno's reward head has none (Bradley-Terry trains no bias) and resuming would "
                "shift every score it exports by that much: finish the run with the areno version that saved it, "
                f"or train a new reward model in another run_dir{keep}"
            )


def stored_model_tensor(path: Path, name: str) -> torch.Tensor | None:
    """The model tensor ``name`` of the areno checkpoint at ``path`` (an incremental one's from its full
    base when unchanged); None when it holds none, or when its metadata does not load (a resume passes
    over a damaged checkpoint to an earlier one)."""
    import torch.distributed.checkpoint as dcp  # slow import (sympy): only for a resumed reward model
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file():
        return None
    for where in (path, checkpoint.incremental_base(path)) if checkpoint.is_incremental(path) else (path,):
        try:
            stored = dcp.FileSystemReader(str(where)).read_metadata().state_dict_metadata.get(f"model.{name}")
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):  # empty, truncated or not a pickle
            return None
        if isinstance(stored, TensorStorageMetadata):
            tensor = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
            with warnings.catch_warnings():  # DCP's note that a process without a process group loads alone
                warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent is to load")
                dcp.load({"model": {name: tensor}}, checkpoint_id=str(where))
            return tensor
    return None


def check_role_vocabularies(config: ArenoConfig, recipe: TrainingConfig, tokenizer: Any) -> None:
    """A frozen role with a checkpoint of its own (a teacher, a reward model) never tokenizes: it scores
    the policy's token ids, and a teacher that generates (``TeacherMixtureWorkflow``) decodes with the
    policy's ``tokenizer``. So its vocabulary must be the policy's: compared token by token where its
    directory has a tokenizer (``tokenizer_config.json``), else by vocab_size (config.json), as the
    engine compares them when it builds the role. A one-line ConfigError naming the directory."""
    policy_vocab_size = run_model_config(config).vocab_size
    for role in recipe.roles:
        if not role.model_path or role.trainable:
            continue
        path = Path(role.model_path)
        key = path_setting(config, role.model_path, f"role {role.name!r} model_path")
        if (path / "tokenizer_config.json").is_file():
            try:
                same = load_pretrained_tokenizer(path).get_vocab() == tokenizer.get_vocab()
            except (OSError, ValueError, TypeError) as exc:  # a corrupt or incomplete tokenizer file
                raise ModelDirError(
                    f"{key}: the tokenizer in {path} does not load ({type(exc).__name__}): copy the model's "
                    "tokenizer files there again"
                ) from None
            if not same:
                raise ConfigError(
                    f"{key}: the tokenizer of {path} differs from the policy's ({config.model.path}); role "
                    f"{role.name!r} scores the policy's token ids, so give it a checkpoint with the policy's tokenizer"
                )
            continue
        vocab_size = read_config(path).vocab_size
        if vocab_size != policy_vocab_size:
            missing = "tokenizer_config.json" if any((path / f).is_file() for f in TOKENIZER_FILES) else "tokenizer"
            raise ConfigError(
                f"{key}: {path} has no {missing} and its vocab_size {vocab_size} differs from the policy's "
                f"{policy_vocab_size}; role {role.name!r} scores the policy's token ids: copy its model's tokenizer "
                "files there (its vocabulary is then compared with the policy's), or give it a checkpoint with the "
                "policy's vocabulary"
            )
        if (role.name, path) not in _UNCOMPARED_SAID:
            _UNCOMPARED_SAID.add((role.name, path))
            logger.info(
                "role %r: %s has no tokenizer; it scores the policy's token ids (vocab_size %d, as the policy's)",
                role.name,
                path,
                vocab_size,
            )


_UNCOMPARED_SAID: set[tuple[str, Path]] = set()
"""The roles told in this process that their vocabulary was compared by size only (``check_run`` runs
twice for a run)."""


def path_setting(config: ArenoConfig, value: str, fallback: str) -> str:
    """The setting that gave a recipe's path ``value``: the ``train.algorithm_kwargs`` key holding it
    (built-in recipes take their paths there), else ``fallback``."""
    for key, given in config.train.algorithm_kwargs.items():
        if given == value:
            return f"train.algorithm_kwargs.{key}"
    if config.reward.model is not None and value == config.reward.model:
        return "reward.model"
    return fallback


def check_model_path_option(key: str, path: Path) -> None:
    """A ModelDirError when ``path`` (setting ``key``), with no config.json of its own, is an areno run
    directory, its ``checkpoints/`` or a checkpoint ``step_N``: it names the ``step_N/hf`` to pass; or a PEFT
    adapter (a LoRA run's ``<role>/adapter``), which holds no model: it names the merged export or the base."""
    if (path / "config.json").is_file() or not path.is_dir():
        return
    if (path / "adapter_config.json").is_file():
        step = path.parent.parent
        merged = step / "hf" if STEP_DIR.match(step.name) and (step / "hf").is_dir() else None
        raise ModelDirError(
            f"{key}: {path} is a LoRA adapter, not a model directory: pass "
            + (f"its checkpoint's merged Hugging Face export, {merged}" if merged else "a merged model")
            + ", or the model it adapts with train.lora to train new adapters"
        )
    if STEP_DIR.match(path.name) and (path / "hf").is_dir():
        raise ModelDirError(
            f"{key}: {path} is an areno checkpoint, not a model directory: pass its Hugging Face export, {path / 'hf'}"
        )
    for checkpoints, what in ((path / "checkpoints", "a run directory"), (path, "a run's checkpoints directory")):
        steps = [p for p in checkpoints.glob("step_*") if STEP_DIR.match(p.name)] if checkpoints.is_dir() else []
        if steps:
            newest = newest_checkpoint(checkpoints)
            example = newest / "hf" if newest is not None else checkpoints / "step_N" / "hf"
            raise ModelDirError(
                f"{key}: {path} is {what}, not a model directory: pass a checkpoint's Hugging Face export, "
                f"such as {example}"
            )


def check_critic_path_option(key: str, path: Path) -> None:
    """A ModelDirError when ``path`` (setting ``key``) is not an areno critic checkpoint (a role's
    directory of a checkpoint, with ``.metadata`` and ``trainer_state.pt``): it names the directory to
    pass, ``checkpoints/step_N/<critic role>``."""
    if (path / ".metadata").is_file() and (path / checkpoint.TRAINER_STATE).is_file():
        return
    if path.name == "hf" and STEP_DIR.match(path.parent.name):
        step, what = path.parent, "the Hugging Face export of an areno checkpoint"
    elif STEP_DIR.match(path.name):
        step, what = path, "an areno checkpoint"
    else:  # a run directory or its checkpoints/: its newest checkpoint
        step, what = newest_checkpoint(path), "a run directory"
    roles = sorted(p.name for p in step.iterdir() if (p / ".metadata").is_file()) if step and step.is_dir() else []
    if roles:
        found = f"{step / 'value'}" if "value" in roles else f"one of {', '.join(str(step / r) for r in roles)}"
        raise ModelDirError(
            f"{key}: {path} is {what}, not a critic checkpoint: pass the directory of its critic role, {found}"
        )
    raise ModelDirError(
        f"{key}: {path} is not an areno critic checkpoint (no .metadata / {checkpoint.TRAINER_STATE}): pass the critic "
        "role's directory of a PPO run's checkpoint, run_dir/checkpoints/step_N/value"
    )


_HELD_OUT_OFF_SAID: set[tuple] = set()
"""The data settings whose missing held-out rows were told in this process: ``check_run`` runs for a
run twice (and for its warm start, with the same rows); the line is said once."""


def say_if_held_out_evaluation_is_off(config: ArenoConfig) -> None:
    """One log line when the run has no held-out rows, so nothing is evaluated (no ``eval/*`` metric,
    ``accuracy_after: null``): what turns evaluation on. A warning when ``data.num_eval`` asks for
    held-out rows that nothing gives (``data.train_path`` without ``data.eval_path``); an info line for
    ``data.num_eval=0``."""
    data = config.data
    if has_held_out_rows(data):
        return
    said = (data.task, str(data.train_path), str(data.eval_path), data.num_eval)
    if said in _HELD_OUT_OFF_SAID:
        return
    _HELD_OUT_OFF_SAID.add(said)
    if data.num_eval == 0:  # asked for: said for the record
        logger.info(
            "held-out evaluation is off (data.num_eval=0): nothing logs eval/*; set data.num_eval > 0 to turn it on"
        )
        return
    # data.num_eval asks for held-out rows but a data.train_path run has none: a warning, which a script that
    # configured no logging still shows (Python's last-resort handler prints warnings, not info lines)
    logger.warning(
        "held-out evaluation is off (data.task is null and data.eval_path is unset): nothing logs eval/*; "
        "set data.eval_path to a file of held-out rows to turn it on"
    )


def check_critic_shape(key: str, path: Path, model: ModelConfig) -> None:
    """The critic checkpoint at ``path`` (setting ``key``) has the decoder shape of the run's model, whose
    hidden states its head reads: its embeddings and its layer count, from the checkpoint's metadata."""
    import torch.distributed.checkpoint as dcp  # slow import (sympy): only for a value head
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:  # empty, truncated or not a pickle
        raise ModelDirError(
            f"{key}: {path}/.metadata does not load ({type(exc).__name__}): pass an intact checkpoint"
        ) from None
    names = [n for n, m in metadata.items() if n.startswith("model.") and isinstance(m, TensorStorageMetadata)]
    embed = next((tuple(metadata[n].size) for n in names if n.endswith("embed_tokens.weight")), None)
    layers = {int(m.group(1)) for n in names if (m := re.search(r"\.layers\.(\d+)\.", n))}
    there = (embed, len(layers))
    want = ((model.vocab_size, model.hidden_size), model.num_hidden_layers)
    if there != want:
        raise ModelDirError(
            f"{key}: {path} is the critic of another model (embeddings {embed}, {len(layers)} layers; the run's "
            f"model has {want[0]}, {want[1]} layers): pass the critic of a PPO run that started from model.path's model"
        )
