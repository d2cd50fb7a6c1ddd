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
from pathlib import Path
from typing import Any

import torch

from areno.api.rundir import check_fresh
from areno.data.datasets import check_splits
from areno.data.prompts import check_chat_template
from areno.data.tokenizer import build_char_tokenizer, load_pretrained_tokenizer
from areno.engine.api import init_tiny_marker, init_tiny_stale
from areno.engine.config import ArenoConfig, RewardSection, field_default
from areno.engine.roles import check_partitioned_roles, role_allocation
from areno.errors import ConfigError, ModelDirError
from areno.launch.allocation import resolve_roles
from areno.models.hf_io import open_safetensors, read_config, safetensors_files, tiny_config
from areno.recipes import TrainingConfig, get_recipe
from areno.rewards.loader import reward_function, wants_sandbox
from areno.train import checkpoint
from areno.workflows.base import check_workflow_arguments, workflow_factory

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model directory holding none of these has no tokenizer (transformers would build an empty one)."""


def check_run(config: ArenoConfig) -> None:
    """Raise the first :class:`~areno.errors.UserError` that ``config`` would meet, without
    building a model: recipe, reward, workflow, data, device, resume, optional packages, model
    directory, in that order."""
    recipe = get_recipe(config.train.algorithm, policy_kwargs=dict(config.train.algorithm_kwargs))
    check_reward(config)  # evaluation scores with it in every recipe
    if recipe.online:  # the engine adds its own arguments (tokenizer, reward_fn, ...) when it builds it
        factory = workflow_factory(config.rollout.workflow)
        check_workflow_arguments(config.rollout.workflow, factory, dict(config.rollout.workflow_kwargs), partial=True)
    check_splits(config.data, need_answers=not recipe.online)  # offline recipes train on the answers
    if config.cluster.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cluster.device=cuda but no CUDA device is visible: use cluster.device=cpu or auto")
    if config.test_rollout.enabled and config.test_rollout.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("test_rollout.device=cuda but no CUDA device is visible: use test_rollout.device=cpu or auto")
    check_held_out(config)
    check_placement(config, recipe)
    check_minibatches(config, recipe)
    role_allocation(config, recipe)  # cluster.role_devices names roles of this recipe and devices that exist
    check_role_optim(config, recipe)
    check_partitioned_roles(config, recipe)
    check_fresh(config.run_dir, resume=config.resume, overwrite=config.overwrite)
    if config.resume is True and checkpoint.latest_complete(Path(config.run_dir) / "checkpoints") is None:
        raise ConfigError(
            f"resume=true but {Path(config.run_dir) / 'checkpoints'} holds no completed checkpoint "
            "(step_N/COMPLETE): use resume=auto to start fresh when there is none"
        )
    stale = init_tiny_stale(config)
    if stale is not None and resumes(config):
        raise ConfigError(
            f"model.init_tiny: the run resumes, but its tiny model {config.model.path} was made from {stale} and this "
            f"config makes another one ({init_tiny_marker(config)}): resume with those settings, or start over "
            "(overwrite=true)"
        )
    check_optional_packages(config)
    for role in recipe.roles:
        if role.model_path:  # a teacher or another model than the policy
            check_model_files(Path(role.model_path), key=f"role {role.name!r} model_path")
    tokenizer = check_model(config)
    check_chat_template(tokenizer, config.data.chat_template, config.data.system_prompt)


def resumes(config: ArenoConfig) -> bool:
    """Whether the run continues from a checkpoint of its run_dir."""
    return config.resume is not False and checkpoint.latest_complete(Path(config.run_dir) / "checkpoints") is not None


def check_reward(config: ArenoConfig) -> None:
    """``reward.fn`` imports; the sandbox's limits are not set for a reward that runs in-process."""
    section = config.reward
    if wants_sandbox(reward_function(section.fn), section.sandbox):
        return
    for key in ("timeout_s", "memory_mb", "cpu_s", "workers", "allow_network"):
        if getattr(section, key) != field_default(RewardSection, key):
            how = "reward.sandbox=false" if section.sandbox is False else f"{section.fn} is cheap and safe in-process"
            raise ConfigError(
                f"reward.{key} bounds the reward's sandbox workers, but the reward runs in this process ({how}): "
                "set reward.sandbox=true, or drop the key"
            )


def check_held_out(config: ArenoConfig) -> None:
    """What evaluates held-out rows has some: the background test rollout."""
    data = config.data
    if config.test_rollout.enabled and (data.num_eval == 0 or (data.task is None and data.eval_path is None)):
        raise ConfigError(
            "test_rollout.enabled: there are no held-out rows to evaluate: set data.num_eval > 0 "
            "(and data.eval_path when data.task is null), or test_rollout.enabled=false"
        )


def check_placement(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """A partitioned placement needs a recipe with a rollout side (an offline one would run colocated)."""
    if config.cluster.asks_partitioned() and not recipe.online and config.rollout.backend == "areno":
        raise ConfigError(
            f"train.algorithm={recipe.name!r} trains offline, with no rollout side, but cluster.train_devices / "
            "rollout_devices or a '+' cluster.allocation_mode partition the run: unset them to train it "
            "colocated on cluster.device"
        )


def check_minibatches(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """``train.num_minibatches`` splits a step's sequences: at most one minibatch per sequence."""
    rollout = config.rollout
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


def check_model(config: ArenoConfig) -> Any:
    """``model.path`` is a loadable checkpoint directory with a tokenizer that has an EOS token, or
    ``model.init_tiny`` can create one there; returns the tokenizer the run will use."""
    model = config.model
    path = Path(model.path)
    if model.init_tiny is not None and (not (path / "config.json").is_file() or init_tiny_stale(config)):
        check_init_tiny(model.init_tiny)  # the engine creates the model there
        return build_char_tokenizer()
    check_model_files(path, key="model.path")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(
            f"model.path: {path} has no tokenizer ({' / '.join(TOKENIZER_FILES)}): copy the model's tokenizer files there"
        )
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
    return tokenizer


def check_model_files(path: Path, *, key: str) -> None:
    """What loading the checkpoint at ``path`` would reject, found without reading a tensor:
    config.json (a model this decoder implements), the weight files and their headers."""
    if not path.is_dir():
        raise ModelDirError(f"{key}: directory {path} does not exist: point it at a local Hugging Face checkpoint")
    read_config(path)
    for weights in safetensors_files(path):
        with open_safetensors(weights):  # parses the header: a truncated file fails here
            pass


def check_init_tiny(init_tiny: dict) -> None:
    """``model.init_tiny`` makes a model for the character tokenizer."""
    vocab = len(build_char_tokenizer())
    try:
        config = tiny_config(vocab, **init_tiny)
    except (TypeError, ValueError) as exc:  # an unknown argument, or a shape the model cannot take
        raise ConfigError(f"model.init_tiny: {exc}") from None
    if config.vocab_size < vocab:
        raise ConfigError(
            f"model.init_tiny: vocab_size {config.vocab_size} is smaller than the character tokenizer's "
            f"{vocab} tokens: leave vocab_size out"
        )
