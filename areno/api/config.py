"""The user's configuration: a YAML file plus dotted command-line overrides (``optim.lr=1e-5``),
merged by OmegaConf against the structured schema (``areno.engine.config``), so an unknown key, a
wrong type or an out-of-range value is a one-line :class:`ConfigError` naming the key before
anything expensive starts.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException, ValidationError

from areno.data.datasets import build_splits
from areno.engine.api import resolve_recipe, trains_on_pairs
from areno.engine.config import (
    MANDATORY_HINTS,
    ArenoConfig,
    ClusterSection,
    DataSection,
    ModelSection,
    ObserveSection,
    RewardSection,
    RolloutSection,
    TestRolloutSection,
    TrainSection,
    WarmStartSection,
)
from areno.errors import ConfigError, is_of_type, wrong_type
from areno.rewards.loader import resolve_path
from areno.train.config import OptimConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ArenoConfig",
    "ClusterSection",
    "ConfigError",
    "DataSection",
    "ModelSection",
    "ObserveSection",
    "OptimConfig",
    "RewardSection",
    "RolloutSection",
    "TestRolloutSection",
    "TrainSection",
    "WarmStartSection",
    "absolute_code_paths",
    "absolute_paths",
    "checked_config",
    "counted_steps",
    "load_config",
    "to_dict",
    "to_yaml",
]


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or ""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{key}: {first}" if key else first


def _schema_type(full_key: str) -> Any:
    """The annotated type of ``full_key`` (``train.steps``, ``optim.betas[0]``) in ``ArenoConfig``;
    None when the key is not there."""
    hint: Any = ArenoConfig
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", full_key):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) not in (list, tuple, dict) and len(args) == 1:  # X | None
            hint = args[0]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if part.startswith("["):
            hint = args[0] if origin in (list, tuple) and args else None
        elif origin is dict and args:
            hint = args[1]
        elif dataclasses.is_dataclass(hint):
            hint = typing.get_type_hints(hint).get(part)
        else:
            hint = None
        if hint is None:
            return None
    return hint


def _type_error(exc: OmegaConfBaseException) -> ConfigError | None:
    """OmegaConf's refusal of a value of the wrong type, in the words of a section built in Python
    (``areno.errors.wrong_type``); None for any other error."""
    key = getattr(exc, "full_key", None)
    if not isinstance(exc, ValidationError) or not key:
        return None
    hint, value = _schema_type(key), getattr(exc, "value", None)
    if hint is None or is_of_type(value, hint):
        return None
    return wrong_type(key, hint, value)


def _load_yaml(path: Path) -> DictConfig:
    """The YAML file at ``path`` as OmegaConf nodes; a one-line ConfigError naming the file (and the
    line and column of a syntax error) when it is unreadable, not YAML, or not a mapping."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: pass the path of a YAML config")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file ({exc.reason} at byte {exc.start}): pass a YAML config") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror}): pass a readable YAML config") from None
    example = "e.g. `model: {path: /path/to/ckpt}`"
    try:
        loaded = OmegaConf.load(io.StringIO(text))
    except yaml.MarkedYAMLError as exc:  # syntax errors, duplicate keys, unknown tags: they have a position
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = exc.problem or exc.context
        if exc.problem and exc.context and exc.context_mark is not None:  # where the unclosed [ or { opened
            what += f" ({exc.context} at {exc.context_mark.line + 1}:{exc.context_mark.column + 1})"
        raise ConfigError(f"{where}: not valid YAML: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    except OmegaConfBaseException as exc:  # a malformed ${...} interpolation
        raise ConfigError(f"{path}: {_describe(exc)}") from None
    except OSError:  # OmegaConf's word for a top level that is a plain value (the text is already read)
        raise ConfigError(
            f"{path}: the top level is a plain value: a config file maps sections to their keys, {example}"
        ) from None
    if not isinstance(loaded, DictConfig):  # a ListConfig: OmegaConf's merge would call it a TypeError
        raise ConfigError(f"{path}: the top level is a list: a config file maps sections to their keys, {example}")
    return loaded


def _check_sections(layer: DictConfig, schema: DictConfig, source: str) -> None:
    """A section (``model``, ``rollout``, ...) given a value instead of keys is a one-line ConfigError
    with the section's form; OmegaConf's merge error names neither the key nor the fix."""
    given = OmegaConf.to_container(layer, resolve=False)
    for name, value in given.items():  # type: ignore[union-attr]
        if name not in schema or not OmegaConf.is_config(schema[name]) or isinstance(value, dict):
            continue
        fields = schema[name]
        mandatory = [k for k in fields if OmegaConf.is_missing(fields, k)]
        if mandatory:  # `model: /path` means model.path: the example takes the value given
            key, example = mandatory[0], value if isinstance(value, (str, int, float)) else "..."
        else:  # the first key with a plain default, as it is
            key = next(k for k in fields if isinstance(fields[k], (str, int, float)))
            example = str(fields[key]).lower() if isinstance(fields[key], bool) else fields[key]
        raise ConfigError(
            f"{source}: `{name}` is a section, not a value: write `{name}: {{{key}: {example}}}` "
            f"or `{name}.{key}={example}`"
        )


def _check_yaml(override: str) -> None:
    """A ConfigError naming ``override`` whose value is not YAML (``from_dotlist`` lets the parser's
    error through, which would print as a traceback)."""
    key = override.partition("=")[0]
    try:
        OmegaConf.from_dotlist([override])
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" at column {mark.column + 1} of the value" if mark is not None and mark.column else ""
        raise ConfigError(
            f"override {override!r}: its value is not valid YAML ({problem}{where}): close every bracket and put "
            f"a space after each ':' in a mapping, e.g. {key}={{name: [1, 2]}}; quote the whole override in the shell"
        ) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ArenoConfig:
    """Merge the YAML file at ``path`` and dotted ``overrides`` into an :class:`ArenoConfig`.

    Raises:
        ConfigError: missing or unreadable file, YAML syntax (with its line and column), a top level
            that is not a mapping, a section given a value, unknown key, wrong type, bad value, a
            mandatory key left unset.
    """
    schema = OmegaConf.structured(ArenoConfig)
    layers = [schema]
    if path is not None:
        path = Path(path)
        layers.append(_load_yaml(path))
        _check_sections(layers[-1], schema, str(path))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} must look like key=value (e.g. optim.lr=1e-5)")
    for override in overrides:
        _check_yaml(override)
    lengths_given: set[str] = set()  # the overrides' run-length keys: two of them are refused, as in a file
    try:
        merged = OmegaConf.merge(*layers)
        for override in overrides:  # in order: a later override may set a key of a mapping an earlier one emptied
            if _clears_mapping(schema, override):  # a mapping a file set, emptied (a merge would keep its keys)
                OmegaConf.update(merged, override.split("=", 1)[0].strip(), {}, merge=False)
                continue
            layer = OmegaConf.from_dotlist([override])
            _check_sections(layer, schema, f"override {override}")
            key = override.split("=", 1)[0].strip()
            other = RUN_LENGTH_KEYS.get(key)
            if other is not None and OmegaConf.select(layer, key) is not None and other not in lengths_given:
                OmegaConf.update(merged, other, None, merge=False)  # the file's train.steps, say, gives way
            lengths_given.add(key)
            merged = OmegaConf.merge(merged, layer)
        config: ArenoConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except ConfigError:
        raise
    except MissingMandatoryValue as exc:
        key = exc.full_key
        hint = MANDATORY_HINTS.get(key, f"a value, e.g. {key}=VALUE")
        raise ConfigError(f"{key}: not set: set it to {hint}") from None
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise _type_error(exc) or ConfigError(_describe(exc)) from None
    return absolute_code_paths(config)


RUN_LENGTH_KEYS = {"train.steps": "train.epochs", "train.epochs": "train.steps"}
"""Each sets a run's length: an override of one unsets the other where the file set it."""


def _clears_mapping(schema: DictConfig, override: str) -> bool:
    """Whether ``override`` empties a mapping setting (``data.task_kwargs={}``, or ``=null`` where null is no
    value it takes): the file's keys dropped, where a merge would keep them."""
    key, value = (part.strip() for part in override.split("=", 1))
    section, _, name = key.rpartition(".")
    node = OmegaConf.select(schema, section) if section else schema
    if not isinstance(node, DictConfig) or name not in node:
        return False
    field = node._get_node(name)
    if typing.get_origin(field._metadata.ref_type) is not dict:
        return False
    return value == "{}" or (value in ("null", "~") and not field._is_optional())


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def absolute_code_paths(config: ArenoConfig) -> ArenoConfig:
    """``config`` (changed in place) with the files of its user code made absolute from the working
    directory (``reward.fn``, ``rollout.workflow``, ``train.algorithm`` as ``./file.py:name``), so
    processes started elsewhere (Ray, SLURM, a reward sandbox in its own directory) import the same
    code. ``load_config`` calls it (``areno eval`` starts reward sandboxes), and ``absolute_paths``."""
    for key in CODE_PATH_KEYS:
        section, _, name = key.partition(".")
        owner = getattr(config, section)
        setattr(owner, name, absolute_setting(key, getattr(owner, name)))
    return config


FILE_PATH_KEYS = ("run_dir", "model.path", "data.train_path", "data.eval_path", "reward.model")
"""The settings that name a file or directory, which ``absolute_paths`` makes absolute (and, in
``train.algorithm_kwargs``, every key ending in ``_path``)."""
CODE_PATH_KEYS = ("reward.fn", "rollout.workflow", "train.algorithm")
"""The settings that name user code, ``module:name`` or ``./file.py:name`` (``resolve_path``; ``reward.fn``
may be a list of them)."""


def absolute_setting(key: str, value: Any) -> Any:
    """``value`` of the dotted setting ``key`` with a relative path in it made absolute from the
    working directory (``FILE_PATH_KEYS``, ``CODE_PATH_KEYS``, ``train.algorithm_kwargs.*_path``);
    any other value as it is. A list of them (``reward.fn``'s functions, ``data.train_path``'s files) has each made
    absolute."""
    if key in (*CODE_PATH_KEYS, *FILE_PATH_KEYS) and isinstance(value, (list, tuple)):  # reward.fn, data.train_path
        return [absolute_setting(key, v) for v in value]
    if not isinstance(value, str) or value == MISSING:
        return value
    if key in CODE_PATH_KEYS:
        return resolve_path(value)
    if key in FILE_PATH_KEYS or (key.startswith("train.algorithm_kwargs.") and key.endswith("_path")):
        return _absolute(value)
    return value


def absolute_paths(config: ArenoConfig) -> ArenoConfig:
    """``config`` (changed in place) with every relative path made absolute from the working directory
    (``absolute_setting``): its user code's, the run directory, the model, the data files and the
    paths of ``train.algorithm_kwargs`` (``*_path``: a teacher, a reward model). The run's config.yaml,
    written by ``Trainer.init``, then names the same files from any directory (``areno eval
    runs/x/config.yaml``, ``resume=auto``). ``checked_config`` calls it (``Trainer.init`` and
    ``run_pipeline``): configs from YAML, overrides and Python alike."""
    absolute_code_paths(config)
    for key in FILE_PATH_KEYS:
        section, _, name = key.rpartition(".")
        owner = getattr(config, section) if section else config
        setattr(owner, name, absolute_setting(key, getattr(owner, name)))
    config.train.algorithm_kwargs = {
        key: absolute_setting(f"train.algorithm_kwargs.{key}", value)
        for key, value in config.train.algorithm_kwargs.items()
    }
    return config


def checked_config(config: object, *, caller: str) -> ArenoConfig:
    """``config`` ready to run (``caller``: ``Trainer.init`` or ``run_pipeline``, for the message): an
    :class:`ArenoConfig` (a TypeError naming ``load_config`` for a YAML path or a mapping), checked again
    as at construction (``ArenoConfig.validate``: a setting assigned since), its paths absolute
    (``absolute_paths``)."""
    if not isinstance(config, ArenoConfig):
        path = isinstance(config, (str, os.PathLike))
        got = f"the path {os.fspath(config)!r}" if path else f"a {type(config).__name__}"  # type: ignore[arg-type]
        raise TypeError(
            f"{caller} takes an ArenoConfig, got {got}: read a YAML file with "
            "areno.api.config.load_config(path, overrides), or build one from its sections "
            "(ArenoConfig(model=ModelSection(path=...), ...))"
        )
    config.validate()
    return counted_steps(absolute_paths(config))


def counted_steps(config: ArenoConfig) -> ArenoConfig:
    """``config`` (changed in place) with ``train.epochs`` turned into ``train.steps``: ceil(epochs x training
    rows / ``rollout.batch_size``), the rows read as the run reads them (a preference recipe's pairs, a
    shipped task's generated rows), said in one line; ``train.epochs`` is then unset, so the run's
    config.yaml loads again as it is. A config without ``train.epochs`` is returned as it is."""
    train = config.train
    if train.epochs is None:
        return config
    rows, _ = build_splits(config.data, pairs=trains_on_pairs(resolve_recipe(config)))
    batch = config.rollout.batch_size
    steps = max(math.ceil(train.epochs * len(rows) / batch), 1)
    logger.info(
        "train.epochs=%g: %s training rows at rollout.batch_size=%d a step: train.steps=%d",
        train.epochs,
        f"{len(rows):,}",
        batch,
        steps,
    )
    train.steps, train.epochs = steps, None
    config.validate()  # what depends on the steps (observe.profile_steps, warmup_steps) is checked now
    return config


def to_yaml(config: ArenoConfig) -> str:
    """The resolved config as YAML (written into the run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: ArenoConfig) -> dict[str, Any]:
    """The resolved config as nested plain dicts and lists (what ``to_yaml`` writes)."""
    return OmegaConf.to_container(OmegaConf.structured(config))  # type: ignore[return-value]


def flat_settings(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.steps": 4, ...}`` of ``to_dict``'s nested dicts (lists and scalars are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat_settings(value, f"{prefix}.{key}" if prefix else str(key)))
    return out
