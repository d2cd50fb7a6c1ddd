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
from areno.engine.config import ArenoConfig, ModelSection
from areno.engine.roles import check_partitioned_roles, role_allocation
from areno.errors import ConfigError, ModelDirError
from areno.launch.allocation import resolve_roles
from areno.models.hf_io import open_safetensors, read_config, safetensors_files, tiny_config
from areno.recipes import TrainingConfig, get_recipe
from areno.rewards.loader import reward_function
from areno.train import checkpoint
from areno.workflows.base import check_workflow_arguments, workflow_factory

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model directory holding none of these has no tokenizer (transformers would build an empty one)."""


def check_run(config: ArenoConfig) -> None:
    """Raise the first :class:`~areno.errors.UserError` that ``config`` would meet, without
    building a model: recipe, reward, workflow, data, device, resume, optional packages, model
    directory, in that order."""
    recipe = get_recipe(config.train.algorithm, policy_kwargs=dict(config.train.algorithm_kwargs))
    reward_function(config.reward.fn)  # evaluation scores with it in every recipe
    if recipe.online:  # the engine adds its own arguments (tokenizer, reward_fn, ...) when it builds it
        factory = workflow_factory(config.rollout.workflow)
        check_workflow_arguments(config.rollout.workflow, factory, dict(config.rollout.workflow_kwargs), partial=True)
    check_splits(config.data, need_answers=not recipe.online)  # offline recipes train on the answers
    if config.cluster.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cluster.device=cuda but no CUDA device is visible: use cluster.device=cpu or auto")
    role_allocation(config, recipe)  # cluster.role_devices names roles of this recipe and devices that exist
    check_role_optim(config, recipe)
    check_partitioned_roles(config, recipe)
    check_fresh(config.run_dir, resume=config.resume, overwrite=config.overwrite)
    if config.resume is True and checkpoint.latest_complete(Path(config.run_dir) / "checkpoints") is None:
        raise ConfigError(
            f"resume=true but {Path(config.run_dir) / 'checkpoints'} holds no completed checkpoint "
            "(step_N/COMPLETE): use resume=auto to start fresh when there is none"
        )
    check_optional_packages(config)
    for role in recipe.roles:
        if role.model_path:  # a teacher or another model than the policy
            check_model_files(Path(role.model_path), key=f"role {role.name!r} model_path")
    tokenizer = check_model(config.model)
    check_chat_template(tokenizer, config.data.chat_template, config.data.system_prompt)


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


def check_model(model: ModelSection) -> Any:
    """``model.path`` is a loadable checkpoint directory with a tokenizer that has an EOS token, or
    ``model.init_tiny`` can create one there; returns the tokenizer the run will use."""
    path = Path(model.path)
    if model.init_tiny is not None and not (path / "config.json").is_file():
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
