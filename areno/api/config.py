"""The user's configuration: a YAML file plus dotted command-line overrides (``optim.lr=1e-5``),
merged by OmegaConf against the structured schema (``areno.engine.config``), so an unknown key, a
wrong type or an out-of-range value is a one-line :class:`ConfigError` naming the key before
anything expensive starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areno.engine.config import (
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
from areno.errors import ConfigError
from areno.train.config import OptimConfig

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
    "load_config",
    "to_dict",
    "to_yaml",
]


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or ""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{key}: {first}" if key else first


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ArenoConfig:
    """Merge the YAML file at ``path`` and dotted ``overrides`` into an :class:`ArenoConfig`.

    Raises:
        ConfigError: missing file, YAML syntax, unknown key, wrong type, bad value, missing field.
    """
    schema = OmegaConf.structured(ArenoConfig)
    layers = [schema]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist: pass the path of a YAML config")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:  # yaml.YAMLError and friends: report the file and the parse error
            raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from exc
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} must look like key=value (e.g. optim.lr=1e-5)")
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise ConfigError(_describe(exc)) from None


def to_yaml(config: ArenoConfig) -> str:
    """The resolved config as YAML (written into the run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: ArenoConfig) -> dict[str, Any]:
    """The resolved config as nested plain dicts and lists (what ``to_yaml`` writes)."""
    return OmegaConf.to_container(OmegaConf.structured(config))  # type: ignore[return-value]
