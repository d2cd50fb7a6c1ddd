"""Code-execution reward: run the candidate Python program in the completion against the row's tests.

Every test runs the program in a fresh ``python -I`` subprocess (its own session, PID namespace
where the kernel allows it, so it cannot signal the trainer, and temporary directory, a minimal
environment without the trainer's variables or secrets) under RLIMIT_AS,
RLIMIT_CPU, RLIMIT_FSIZE, no core dumps and no network (a fresh network namespace where the kernel
allows it; see :mod:`areno.rewards._exec` for the fallback and its limits), killed with its whole
process group at its time limit. The reward function itself runs in the reward sandbox by default
(``reward.sandbox`` auto), so ``reward.timeout_s`` bounds all tests of one completion together:
set it above ``tests × time_limit_s``.

Test formats, from the row field ``tests`` (else the ``answer``), a JSON string of them accepted:
- ``"assert f(2) == 4\\n..."``: Python run after the program in the same namespace; the program is
  run under the name ``solution``, so its ``if __name__ == "__main__":`` block (reading stdin, say)
  does not run, as in HumanEval / MBPP harnesses; reward 1 when it exits 0 after the tests ran to
  their end (a random line printed after them must end its output, so a program that exits early,
  ``sys.exit(0)`` or ``os._exit(0)``, skips them and scores 0), else 0;
- ``[{"input": "1 2\\n", "output": "3\\n"}, ...]`` or ``{"inputs": [...], "outputs": [...]}``
  (APPS / CodeContests): stdin → stdout, compared line by line, each line's surrounding whitespace
  and blank lines at either end ignored;
  reward = fraction of cases passed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_EXEC_SOURCE = (Path(__file__).parent / "_exec.py").read_text()
_FENCE = re.compile(r"```[ \t]*[\w+.-]*[ \t]*\r?\n(.*?)```", re.DOTALL)
"""A fenced block with any language tag or none (```python, ```Python, ```py3, ```)."""

DEFAULT_TIME_LIMIT_S = 5.0
"""Wall-clock limit of one test run (row field ``time_limit_s`` overrides it)."""
DEFAULT_MEMORY_MB = 512
"""Address-space limit of one test run (row field ``memory_limit_mb`` overrides it)."""
OUTPUT_LIMIT_MB = 16
"""A program writing more than this (stdout or files) is killed by SIGXFSZ."""


@dataclass(frozen=True)
class ProgramResult:
    """What one confined run of a program did."""

    returncode: int | None
    """Exit status (negative: killed by that signal); None when it timed out."""
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float


def extract_program(completion: str) -> str:
    """The last fenced code block of the completion, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def run_program(
    source: str, stdin: str = "", *, time_limit_s: float = DEFAULT_TIME_LIMIT_S, memory_mb: int = DEFAULT_MEMORY_MB
) -> ProgramResult:
    """Run ``source`` as ``__main__`` in a confined ``python -I`` subprocess (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="areno-code-") as tmp:
        program = os.path.join(tmp, "program.py")
        Path(program).write_text(source)
        Path(tmp, "stdin").write_text(stdin)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": tmp,
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
        }
        argv = [
            sys.executable,
            "-I",
            "-c",
            _EXEC_SOURCE,
            program,
            str(memory_mb),
            str(time_limit_s),
            str(OUTPUT_LIMIT_MB),
        ]
        t0 = time.perf_counter()
        with (
            open(os.path.join(tmp, "stdin"), "rb") as fin,
            open(os.path.join(tmp, "stdout"), "wb") as fout,
            open(os.path.join(tmp, "stderr"), "wb") as ferr,
        ):
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=tmp, env=env, start_new_session=True)
            try:
                returncode: int | None = proc.wait(timeout=time_limit_s)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:  # the program's own children and daemons go with it
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        wall_s = time.perf_counter() - t0
        read = lambda name: Path(tmp, name).read_bytes()[: OUTPUT_LIMIT_MB << 20].decode(errors="replace")
        return ProgramResult(
            returncode=returncode,
            stdout=read("stdout"),
            stderr=read("stderr"),
            timed_out=returncode is None,
            wall_s=wall_s,
        )


def _normalise(text: str) -> list[str]:
    lines = [line.strip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def parse_tests(tests: Any) -> str | list[tuple[str, str]]:
    """Assert code (a str) or a list of (stdin, expected stdout); a one-line ValueError otherwise."""
    if isinstance(tests, str):
        stripped = tests.strip()
        if stripped[:1] in ("[", "{"):
            try:
                tests = json.loads(stripped)
            except json.JSONDecodeError:
                return tests  # Python that starts with a list/dict literal
        else:
            return tests
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError("code tests: 'inputs' and 'outputs' have different lengths")
        return [(str(i), str(o)) for i, o in zip(tests["inputs"], tests["outputs"])]
    if isinstance(tests, list) and all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        return [(str(t["input"]), str(t["output"])) for t in tests]
    raise ValueError(
        f"code tests must be assert code, a list of {{'input', 'output'}} or {{'inputs', 'outputs'}}, "
        f"got {type(tests).__name__}: put them in the row's 'tests' field"
    )


def code_execution(prompt: str, completion: str, answer: Any = None, **row: Any) -> float:
    """Fraction of the row's tests the completion's program passes (see the module docstring)."""
    tests = row.get("tests", answer)
    if tests is None:
        raise ValueError(
            "code_execution: the row has neither a 'tests' field nor an answer holding the tests: add a 'tests' "
            "field, or set data.answer_key to the field that holds them"
        )
    cases = parse_tests(tests)
    program = extract_program(completion)
    time_limit_s = float(row.get("time_limit_s", DEFAULT_TIME_LIMIT_S))
    memory_mb = int(row.get("memory_limit_mb", DEFAULT_MEMORY_MB))
    if isinstance(cases, str):
        # the tests ran to their end only if the line after them was printed last: exit 0 alone is what
        # sys.exit(0) in the program gives too
        done = f"areno-tests-done-{secrets.token_hex(16)}"
        # compiled on its own, so that its `from __future__` imports stay first
        source = (
            "__name__ = 'solution'\n__import__('sys').modules['solution'] = __import__('sys').modules['__main__']\n"
            f"exec(compile({program!r}, 'solution.py', 'exec'))\n__name__ = '__main__'\n\n"
            f"{cases}\n\nimport sys as _areno_sys\n_areno_sys.stdout.write('\\n{done}\\n')\n"
        )
        result = run_program(source, time_limit_s=time_limit_s, memory_mb=memory_mb)
        return float(result.returncode == 0 and result.stdout.rstrip().endswith(done))
    if not cases:
        raise ValueError("code_execution: the row's test list is empty")
    passed = 0
    for stdin, expected in cases:
        result = run_program(program, stdin, time_limit_s=time_limit_s, memory_mb=memory_mb)
        passed += result.returncode == 0 and _normalise(result.stdout) == _normalise(expected)
    return passed / len(cases)


code_execution.areno_sandbox = True  # type: ignore[attr-defined]
