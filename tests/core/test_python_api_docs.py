"""docs/python.md works as written: its blocks, in order, in an empty working directory. A block whose
first line is a comment naming a file (``# my_reward.py``, ``# add.yaml``) is that file; the other Python
blocks run in one namespace; the ``areno`` lines of a bash block run as commands."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from areno.cli import main
from tests.helpers.recipes import user_code_dir

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"
FILE_COMMENT = re.compile(r"# ([\w.-]+\.(?:py|yaml))\n")


def _blocks() -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_docs_python_api_page_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = _blocks()
    assert [lang for lang, _ in blocks].count("python") >= 6 and ("bash", blocks[-1][1]) == blocks[-1]
    namespace: dict = {}
    commands = 0
    with user_code_dir(tmp_path, monkeypatch):
        for lang, code in blocks:
            named = FILE_COMMENT.match(code)
            if named:
                (tmp_path / named.group(1)).write_text(code)
            elif lang == "python":
                exec(compile(code, f"{DOC}:{lang}", "exec"), namespace)
            else:
                assert lang == "bash", lang
                for line in code.splitlines():
                    assert line.startswith("areno "), line
                    assert main(shlex.split(line)[1:]) == 0, line
                    commands += 1
        out = capsys.readouterr().out
    assert commands == 1
    assert "[1, 2, 3, 4]" in out  # the steps the doc says the two run() calls logged
    assert namespace["summary"]["accuracy_before"] is not None and namespace["summary"]["accuracy_after"] is not None
    assert (tmp_path / "runs" / "add" / "checkpoints" / "step_00000004" / "hf").is_dir()
    assert (tmp_path / "runs" / "add_ws" / "warm_start" / "final_model" / "COMPLETE").is_file()
