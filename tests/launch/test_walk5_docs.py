"""docs/launch.md is accurate (audit walk5, C8): every ``areno`` command of its shell blocks parses
and its overrides make a valid config, every ``allocation_mode`` example is accepted or refused as
the table says, and its scheduler option table names real options with their defaults."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.api.pipeline import DEMO_CONFIG
from areno.cli import _check_allocation, _parse, build_parser, launch_parser
from areno.errors import UserError
from areno.launch.scheduler import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "launch.md"


def shell_commands(text: str) -> list[list[str]]:
    """The ``areno`` commands of the doc's ``bash`` blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("areno "):
                commands.append(shlex.split(line)[1:])
    return commands


def table(text: str, after: str) -> list[list[str]]:
    """The body rows of the first table after the text ``after`` (cells stripped, ``\\|`` unescaped)."""
    lines = text.split(after, 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = []
    for ln in lines[start + 2 : end]:  # past the header and its |---| line
        cells = re.split(r"(?<!\\)\|", ln.strip())[1:-1]
        rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows


def _code(cell: str) -> str:
    match = re.fullmatch(r"`([^`]*)`", cell)
    assert match, f"not one code span: {cell!r}"
    return match.group(1)


COMMANDS = shell_commands(DOC.read_text())


def test_the_doc_has_commands_of_each_kind():
    kinds = {tuple(c[:2]) if c[0] == "launch" else (c[0],) for c in COMMANDS}
    assert {("train",), ("demo",), ("launch", "slurm-script"), ("launch", "allocation")} <= kinds


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_every_command_parses_and_its_overrides_are_valid(argv):
    if argv[0] == "launch":
        ns = launch_parser().parse_args(argv[1:])
        if ns.cmd == "allocation":
            _check_allocation(ns.allocation_mode, devices=ns.devices, algorithm=ns.algorithm)
            return
        assert ns.cmd == "slurm-script"
        overrides = ns.overrides
    else:
        ns = _parse(build_parser(), argv)
        overrides = list(ns.overrides)
        if argv[0] == "demo":
            load_config(DEMO_CONFIG, overrides)
            return
    assert ns.config == "config.yaml"  # a placeholder: its overrides are checked on the defaults
    load_config(None, [*overrides, "model.path=unused"])


ALLOCATIONS = table(DOC.read_text(), "## `allocation_mode` examples")


@pytest.mark.parametrize("row", ALLOCATIONS, ids=[r[0] for r in ALLOCATIONS])
def test_each_allocation_example_is_answered_as_the_doc_says(row):
    string, verdict = _code(row[0]), row[1]
    if verdict.startswith("ok"):
        algorithm = re.search(r"--algorithm (\w+)", verdict)
        _check_allocation(string, devices=None, algorithm=algorithm.group(1) if algorithm else "grpo")
    else:
        assert verdict == "refused"
        with pytest.raises(UserError):
            _check_allocation(string, devices=None, algorithm="grpo")


def test_the_examples_cover_what_the_audit_found_approved_and_refused():
    strings = {_code(r[0]): r[1] for r in ALLOCATIONS}
    for refused in ("areno:d1+fsdp:d4e2t2", "areno:d1+fsdp:d2c2t2", "areno:d2|fsdp:d2", "vllm:d1+fsdp:d2t2"):
        assert strings[refused] == "refused"


def test_the_option_table_names_real_options_and_their_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    rows = table(DOC.read_text(), "**Time limit.**")
    assert [r[0] for r in rows][:2] == ["`slurm_partition`, `slurm_account`", "`slurm_time`"]
    for keys, default, _ in rows:
        for key in re.findall(r"`(\w+)`", keys):
            assert key in defaults, key
            value = defaults[key]
            if isinstance(value, str) and value:
                assert default == f"`{value}`", (key, default, value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                assert float(default) == value, (key, default, value)


def test_readme_and_performance_link_it():
    assert "](docs/launch.md)" in (ROOT / "README.md").read_text()
    performance = (ROOT / "docs" / "performance.md").read_text()
    section = performance.split("## Several GPUs (partitioned)", 1)[1].split("\n## ", 1)[0]
    assert "](launch.md)" in section
