"""Mistakes in a config file or override are one line naming the file (with the line and column of a
YAML error) or the key, and the fix: a top level that is not a mapping, YAML syntax, a section given
a value (``model: /path``), an unset ``model.path``."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from areno.api.config import ArenoConfig, ConfigError, load_config
from areno.cli import main as areno_main

SECTIONS = [name for name, node in OmegaConf.structured(ArenoConfig).items() if OmegaConf.is_config(node)]


def _refused(tmp_path, text: str | bytes, overrides: tuple[str, ...] = ()) -> str:
    path = tmp_path / "config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("text", "kind"),
    [("- model\n- rollout\n", "a list"), ("3\n", "a plain value")],
)
def test_a_top_level_that_is_not_a_mapping(tmp_path, text, kind):
    assert _refused(tmp_path, text) == (
        f"{tmp_path / 'config.yaml'}: the top level is {kind}: a config file maps sections to their keys, "
        "e.g. `model: {path: /path/to/ckpt}`"
    )


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("model: [unclosed\n", "2:1", "did not find expected ',' or ']' (while parsing a flow sequence at 1:8)"),
        ("model:\n  path: /m\n  bad: : x\n", "3:8", "mapping values are not allowed in this context"),
        ("model: {path: /m}\nmodel: {path: /n}\n", "2:1", "found duplicate key model (while constructing a mapping"),
    ],
)
def test_yaml_errors_keep_the_problem_and_its_line_and_column(tmp_path, text, where, problem):
    message = _refused(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'config.yaml'}:{where}: not valid YAML: {problem}")


def test_a_binary_file_is_not_a_config(tmp_path):
    assert "config.yaml: not a text file (invalid start byte at byte 0)" in _refused(tmp_path, b"\xff\xfe\x00")


def test_a_section_given_a_value_names_the_section_and_its_form(tmp_path):
    message = _refused(tmp_path, "model: /path\n")
    assert message == (
        f"{tmp_path / 'config.yaml'}: `model` is a section, not a value: write `model: {{path: /path}}` "
        "or `model.path=/path`"
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model=/path"])
    assert str(info.value) == (
        "override model=/path: `model` is a section, not a value: write `model: {path: /path}` or `model.path=/path`"
    )
    assert "write `model: {path: ...}`" in _refused(tmp_path, "model:\n")  # the keys left out under it


@pytest.mark.parametrize("section", [s for s in SECTIONS if s != "model"])
def test_the_form_suggested_for_each_section_loads(section):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.path=/m", f"{section}=3"])
    fix = re.fullmatch(
        rf"override {section}=3: `{section}` is a section, not a value: write .* or `(.+)`", str(info.value)
    )
    assert fix is not None, str(info.value)
    assert load_config(None, ["model.path=/m", fix.group(1)]) == load_config(None, ["model.path=/m"])


def test_an_unset_model_path_says_what_to_set_it_to(tmp_path):
    expected = "model.path: not set: set it to a local Hugging Face checkpoint directory, e.g. model.path=/path/to/ckpt"
    with pytest.raises(ConfigError) as info:
        load_config(None, [])
    assert str(info.value) == expected
    assert _refused(tmp_path, "optim:\n  lr: 0.1\n") == expected


def test_the_cli_prints_a_config_file_error_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("- a\n")
    assert areno_main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"areno: error: {path}: the top level is a list") and err.count("\n") == 1
