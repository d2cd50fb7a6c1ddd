import pytest

from areno.api.config import ArenoConfig, ConfigError, load_config, to_yaml


def test_defaults_and_overrides(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model:\n  path: /some/model\noptim:\n  lr: 0.001\n")
    cfg = load_config(cfg_file, ["optim.lr=2e-5", "rollout.n_samples=4", "train.algorithm_kwargs.kl_coef=0.1"])
    assert isinstance(cfg, ArenoConfig)
    assert cfg.optim.lr == pytest.approx(2e-5)
    assert cfg.rollout.n_samples == 4
    assert cfg.train.algorithm_kwargs == {"kl_coef": 0.1}
    assert cfg.model.path == "/some/model"
    # the resolved YAML round-trips
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["optim.lrr=1"], "optim.lrr: Key 'lrr' not in 'OptimConfig'. Did you mean: 'lr'?"),
        (["optim.lr=abc"], "optim.lr"),
        (["optim.lr=-1"], "optim.lr: must be > 0"),
        (["rollout.top_p=1.5"], "rollout.top_p: must be in (0, 1]"),
        (["train.steps=1.5"], "train.steps"),
        (["cluster.device=tpu"], "cluster.device"),
        (["noequals"], "must look like key=value"),
        (["train.long_sequences=split"], "train.long_sequences: must be error or truncate"),
        (["train.max_consecutive_skips=-1"], "train.max_consecutive_skips: must be >= 0"),
        (["rollout.decode_steps=-2"], "rollout.decode_steps: must be >= 0"),
        (["rollout.decode_attention=flash"], "rollout.decode_attention: must be auto, gather or paged"),
        (["rollout.request_timeout_s=-1"], "rollout.request_timeout_s: must be >= 0"),
        (["cluster.collective_timeout_s=0"], "cluster.collective_timeout_s: must be > 0"),
        (["train.attention=flash"], "train.attention: must be auto, flex or varlen"),
        (["train.compile_scope=whole"], "train.compile_scope: must be layers or model"),
        (["rollout.fused_projections=maybe"], "rollout.fused_projections"),
    ],
)
def test_errors_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.path=/m", *overrides])
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_missing_model_path_and_file(tmp_path):
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, [])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, [])


def test_demo_config_parses():
    from areno.api.pipeline import DEMO_CONFIG

    cfg = load_config(DEMO_CONFIG, ["run_dir=/tmp/x"])
    assert cfg.train.algorithm == "grpo"
    assert cfg.warm_start.steps > 0


def test_demo_config_ships_inside_the_package():
    """``areno demo`` after a plain (non-editable) ``pip install``: its config is package data of a
    package setuptools finds, not a file of the source checkout."""
    import tomllib
    from pathlib import Path

    import areno
    from areno.api.pipeline import DEMO_CONFIG

    pkg = Path(areno.__file__).resolve().parent
    assert DEMO_CONFIG.is_relative_to(pkg) and DEMO_CONFIG.exists()
    assert (DEMO_CONFIG.parent / "__init__.py").exists()  # a regular package: packages.find includes it
    pyproject = tomllib.loads((pkg.parent / "pyproject.toml").read_text())
    assert "*.yaml" in pyproject["tool"]["setuptools"]["package-data"]["*"]
