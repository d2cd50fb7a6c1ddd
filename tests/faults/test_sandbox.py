"""Fault tests of the reward sandbox: hangs, crashes, exceptions, memory and CPU hogs and network
access in reward code score 0 as named, counted failures, and the pool keeps scoring afterwards.

The misbehaving reward functions live in tests/helpers/rewards.py: the sandbox workers import them
by dotted path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

import pytest

from areno.rewards.sandbox import RewardFailure, RewardSandbox
from tests.helpers.rewards import misbehave

TIMEOUT_S = 1.5
SLACK_S = 3.0  # kill + reap on a loaded 2-core machine


# -------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def sandbox():
    with RewardSandbox(
        "tests.helpers.rewards:misbehave", workers=2, timeout_s=TIMEOUT_S, memory_mb=512, cpu_s=1.0
    ) as pool:
        yield pool


def _delta(before: dict, after: dict) -> dict:
    return {
        k: after[k] - before[k]
        for k in after
        if k.startswith("rollout/reward_failures_") or k == "rollout/reward_calls"
        if after[k] != before[k]
    }


def _fails(pool: RewardSandbox, completion: str) -> tuple[RewardFailure, float, dict]:
    before = pool.metrics()
    t0 = time.perf_counter()
    with pytest.raises(RewardFailure) as info:
        pool.score("prompt", completion)
    return info.value, time.perf_counter() - t0, _delta(before, pool.metrics())


# ----------------------------------------------------------------------------------------- tests
def test_ok_scores_in_a_worker(sandbox):
    assert sandbox.score("p", "ok") == 1.0
    assert sandbox.score("p", "other") == 0.0


def test_hang_is_killed_within_timeout(sandbox):
    sandbox.score("p", "ok")  # both workers warm is not needed: the timeout counts from the request
    pids = set(sandbox.worker_pids())
    failure, elapsed, delta = _fails(sandbox, "hang")
    assert failure.kind == "timeout"
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S
    assert "tests.helpers.rewards:misbehave" in str(failure) and "reward.timeout_s" in str(failure)
    assert delta == {"rollout/reward_calls": 1.0, "rollout/reward_failures_timeout": 1.0}
    for pid in pids - set(sandbox.worker_pids()):  # the hung worker is gone, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("completion, described", [("segfault", "SIGSEGV"), ("exit", "exited with code 3")])
def test_crash_is_counted_and_worker_replaced(sandbox, completion, described):
    failure, _, delta = _fails(sandbox, completion)
    assert failure.kind == "crash" and described in str(failure)
    assert delta == {"rollout/reward_calls": 1.0, "rollout/reward_failures_crash": 1.0}
    assert sandbox.score("p", "ok") == 1.0


def test_exception_names_function_and_fix(sandbox):
    failure, _, delta = _fails(sandbox, "raise")
    assert failure.kind == "error"
    assert str(failure) == (
        "reward tests.helpers.rewards:misbehave raised KeyError: 'no such field': fix the reward function"
    )
    assert delta == {"rollout/reward_calls": 1.0, "rollout/reward_failures_error": 1.0}


def test_memory_hog_hits_rlimit(sandbox):
    failure, _, delta = _fails(sandbox, "hog")
    assert failure.kind == "memory" and "reward.memory_mb=512" in str(failure)
    assert delta == {"rollout/reward_calls": 1.0, "rollout/reward_failures_memory": 1.0}


def test_cpu_spin_hits_rlimit():
    with RewardSandbox("tests.helpers.rewards:misbehave", workers=1, timeout_s=20.0, cpu_s=0.5) as pool:
        failure, elapsed, delta = _fails(pool, "spin")
    assert failure.kind == "cpu" and "reward.cpu_s" in str(failure)
    assert elapsed < 15.0  # the CPU limit (1 CPU-second at most), not the 20 s wall clock, stopped it
    assert delta == {"rollout/reward_calls": 1.0, "rollout/reward_failures_cpu": 1.0}


def test_pool_survives_every_failure_and_keeps_scoring(sandbox):
    async def burst() -> list:
        calls = [sandbox("p", c) for c in ("hang", "ok", "segfault", "ok", "raise", "ok", "exit", "ok")]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(burst())
    assert [r for r in results if not isinstance(r, RewardFailure)] == [1.0] * 4
    assert sorted(r.kind for r in results if isinstance(r, RewardFailure)) == ["crash", "crash", "error", "timeout"]
    assert [sandbox.score("p", "ok") for _ in range(6)] == [1.0] * 6
    metrics = sandbox.metrics()
    assert metrics["rollout/reward_worker_restarts"] >= 3


def test_worker_killed_from_outside_while_idle_is_replaced(sandbox):
    sandbox.score("p", "ok")
    killed = [w for w in sandbox._slots if w.proc is not None]
    for w in killed:
        os.kill(w.proc.pid, 9)
    for w in killed:  # the kill took the worker's whole tree: its reply pipe reads EOF (an idle worker gone)
        assert w._replies.poll(30)
    assert [sandbox.score("p", "ok") for _ in range(3)] == [1.0] * 3  # not this call's fault: retried


def test_network_blocked_when_disallowed():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    with server:
        with RewardSandbox(
            "tests.helpers.rewards:misbehave", workers=1, timeout_s=10.0, allow_network=True
        ) as open_pool:
            assert open_pool.score("p", f"connect:{port}") == 1.0  # the probe does reach the listener
            server.accept()[0].close()
        with RewardSandbox("tests.helpers.rewards:misbehave", workers=1, timeout_s=10.0, allow_network=False) as closed:
            with pytest.raises(RewardFailure) as info:
                closed.score("p", f"connect:{port}")
            assert closed.network_isolation in ("netns", "socket-patch")
        assert info.value.kind == "error"
        with pytest.raises(socket.timeout):  # nothing got through
            server.accept()


def test_async_reward_and_acall_reward_integration(caplog):
    from areno.workflows.common import acall_reward

    with RewardSandbox("tests.helpers.rewards:async_reward", workers=1, timeout_s=5.0) as pool:
        assert asyncio.run(acall_reward(pool, "p", "7", "7", {})) == (1.0, None)
    with RewardSandbox("tests.helpers.rewards:misbehave", workers=1, timeout_s=5.0) as pool:
        with caplog.at_level(logging.WARNING, logger="areno.workflows"):
            reward, error = asyncio.run(acall_reward(pool, "p", "raise", None, {}))
    assert reward == 0.0 and error.startswith("RewardFailure: reward tests.helpers.rewards:misbehave raised KeyError")
    assert len(caplog.records) == 1 and "tests.helpers.rewards:misbehave" in caplog.records[0].getMessage()


def test_load_reward_auto_sandbox_and_shared_metrics():
    from areno.api.config import RewardSection
    from areno.rewards.loader import load_reward
    from areno.rewards.sandbox import close_all, reward_metrics
    from areno.rewards.tasks import exact_match
    from areno.workflows.agent import calculator_reward

    close_all()  # pools (and their counters) other tests of this process left open
    assert load_reward(RewardSection()).fn is exact_match  # shipped, marked safe in-process (watched)
    # the calculator example's: a pool of workers importing areno cost its every first evaluation seconds
    calculator = load_reward(RewardSection(fn="areno.workflows.agent:calculator_reward"))
    assert calculator.fn is calculator_reward and calculator.fn("p", "12", result="12") == 1.0
    for expr in ("9**9**9", "9" * 400):  # a power (refused), an integer past a float's range
        call = "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": expr}}) + "</tool_call>"
        assert calculator_reward("p", call, result=1) == 0
    assert isinstance(load_reward(RewardSection(sandbox=True)), RewardSandbox)
    assert load_reward(RewardSection(fn="tests.helpers.rewards:misbehave", sandbox=False)).fn is misbehave
    try:
        pool = load_reward(RewardSection(fn="tests.helpers.rewards:misbehave", timeout_s=5.0, workers=1))
        assert isinstance(pool, RewardSandbox)  # user code: sandboxed by default
        assert load_reward(RewardSection(fn="tests.helpers.rewards:misbehave", timeout_s=5.0, workers=1)) is pool
        with pytest.raises(RewardFailure):
            pool.score("p", "raise")
        assert pool.score("p", "ok") == 1.0
        metrics = reward_metrics()
        assert metrics["rollout/reward_calls"] == 2.0 and metrics["rollout/reward_failures_error"] == 1.0
    finally:
        close_all()
    assert reward_metrics() == {}


@pytest.mark.parametrize(
    "override, key",
    [
        ("reward.workers=0", "reward.workers"),
        ("reward.memory_mb=64", "reward.memory_mb"),
        ("reward.cpu_s=0", "reward.cpu_s"),
        ("reward.timeout_s=-1", "reward.timeout_s"),
    ],
)
def test_config_validation(override, key):
    from areno.api.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=key):
        load_config(None, ["model.path=unused", override])


def test_load_reward_rejects_non_callable():
    from areno.api.config import RewardSection
    from areno.rewards.loader import load_reward

    with pytest.raises(ValueError, match="reward.fn: 'math:pi' is a float, not a function"):
        load_reward(RewardSection(fn="math:pi"))


# ------------------------------------------------------------------------------- code execution
SUM_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def test_code_execution_scores_stdin_stdout_and_asserts():
    from areno.rewards.code import code_execution

    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2", "output": "4"}]
    assert code_execution("p", SUM_PROGRAM, None, tests=cases) == 1.0
    assert code_execution("p", SUM_PROGRAM, None, tests={"inputs": ["1 1", "5 5"], "outputs": ["2", "11"]}) == 0.5
    assert code_execution("p", "def f(x):\n    return 2 * x", "assert f(2) == 4\nassert f(3) == 6") == 1.0
    assert code_execution("p", "def f(x):\n    return x", "assert f(2) == 4") == 0.0


def test_candidate_program_is_confined(monkeypatch):
    from areno.rewards.code import OUTPUT_LIMIT_MB, run_program

    monkeypatch.setenv("ARENO_TEST_SECRET", "hunter2")
    hung = run_program("while True:\n    pass", time_limit_s=1.0)
    assert hung.timed_out and hung.wall_s < 1.0 + SLACK_S
    hog = run_program("x = bytearray(2 << 30)", memory_mb=256)
    assert hog.returncode == 1 and "MemoryError" in hog.stderr
    flood = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", time_limit_s=10.0)
    assert flood.returncode == 1 and len(flood.stdout) == OUTPUT_LIMIT_MB << 20  # RLIMIT_FSIZE, not the clock
    env = run_program("import os\nprint(os.environ.get('ARENO_TEST_SECRET'))")
    assert env.stdout.strip() == "None"  # the trainer's environment does not leak into candidates
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    with server:
        net = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), 2)")
    assert net.returncode == 1 and ("unreachable" in net.stderr or "disabled" in net.stderr)


def test_code_execution_bad_tests_is_a_named_error():
    from areno.rewards.code import code_execution

    with pytest.raises(ValueError, match="put them in the row's 'tests' field"):
        code_execution("p", SUM_PROGRAM, None, tests=[1, 2])


@pytest.mark.slow
def test_code_execution_and_math_verify_in_the_sandbox():
    """The shipped heavy rewards through the pool (math-verify imports sympy: seconds)."""
    with RewardSandbox("areno.rewards.code:code_execution", workers=1, timeout_s=30.0) as pool:
        assert pool.score("p", SUM_PROGRAM, None, tests=[{"input": "3 4", "output": "7"}]) == 1.0
        assert pool.score("p", "while True: pass", None, tests=[{"input": "", "output": ""}], time_limit_s=1) == 0.0
    with RewardSandbox("areno.rewards.math:math_verify", workers=1, timeout_s=60.0) as pool:
        assert pool.score("p", "so the answer is \\boxed{0.5}", "1/2") == 1.0
        assert pool.score("p", "the answer is 3", "4") == 0.0
    from concurrent.futures import ThreadPoolExecutor

    from areno.rewards.math import math_verify

    with ThreadPoolExecutor(1) as thread:  # in-process off the main thread: math-verify's alarms are off
        assert thread.submit(math_verify, "p", "\\boxed{\\frac{1}{2}}", "0.5").result() == 1.0


@pytest.mark.slow
def test_kill_9_of_the_trainer_leaves_no_worker_behind(tmp_path, monkeypatch):
    """PR_SET_PDEATHSIG: a hung worker dies with its parent. The workers' directories, which the killed
    parent could not remove, go when the next process starts a pool."""
    import subprocess
    import sys
    import tempfile

    from areno.rewards import sandbox as sandbox_module

    script = tmp_path / "parent.py"
    script.write_text(
        "import threading, time\n"
        "from areno.rewards.sandbox import RewardSandbox\n"
        "pool = RewardSandbox('tests.helpers.rewards:misbehave', workers=2, timeout_s=600)\n"
        "threading.Thread(target=pool.score, args=('p', 'hang'), daemon=True).start()\n"
        "pool.score('p', 'ok')\n"
        "print(*pool.worker_pids(), flush=True)\n"
        "time.sleep(600)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": repo, "TMPDIR": str(tmp)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in pids if _alive(p)]
    assert alive == []
    left = sorted(tmp.iterdir())
    assert len(left) == 2 and all(p.name.startswith("areno-reward-") for p in left)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert sandbox_module._sweep_orphan_dirs.__wrapped__() == 2 and list(tmp.iterdir()) == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its (dead) parent's reaper counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def test_shared_pool_closes_with_its_last_holder():
    """Two runs of one process share a pool: the first to end must not stop the other's workers."""
    from areno.rewards.sandbox import close_all, release_shared, shared_sandbox

    close_all()
    first = shared_sandbox("tests.helpers.rewards:misbehave", workers=1, timeout_s=5.0)
    second = shared_sandbox("tests.helpers.rewards:misbehave", workers=1, timeout_s=5.0)
    assert first is second
    try:
        release_shared(first)
        assert second.score("p", "ok") == 1.0  # still serving the other holder
        release_shared(second)
        assert second._closed
        third = shared_sandbox("tests.helpers.rewards:misbehave", workers=1, timeout_s=5.0)
        assert third is not second and third.score("p", "ok") == 1.0  # a fresh pool after the last release
    finally:
        close_all()


def test_code_execution_asserts_run_to_their_end_and_any_fence_counts():
    """walk14: a wrong program ending in sys.exit(0) (or os._exit(0), SystemExit) skipped the appended tests
    and scored 1, a reward a policy could learn to collect; the tests now print a random line last. Fences
    with another spelling of the language (```Python, ```py3) were run whole, fence and all."""
    from areno.rewards.code import code_execution

    tests = "assert f(2) == 4\nassert f(3) == 6"
    assert code_execution("p", "def f(x):\n    return 2 * x", tests) == 1.0
    for leave in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit(0)"):
        assert code_execution("p", f"def f(x):\n    return x\n{leave}", tests) == 0.0, leave
    assert code_execution("p", "def f(x):\n    return 2 * x\nprint('chatty')", tests) == 1.0
    for tag in ("Python", "py3", "python3", ""):
        assert code_execution("p", f"Here:\n```{tag}\ndef f(x):\n    return 2 * x\n```\ndone", tests) == 1.0, tag
    # stdin/stdout: each line's surrounding whitespace and blank end lines are ignored, on every line
    echo = "```python\nprint('  3 ')\nprint('4')\nprint()\n```"
    assert code_execution("p", echo, None, tests=[{"input": "", "output": "3\n  4\n"}]) == 1.0
    assert code_execution("p", echo, None, tests=[{"input": "", "output": "3\n5"}]) == 0.0


def test_code_execution_asserts_skip_the_programs_main_block():
    """A correct solution whose `if __name__ == "__main__":` block reads stdin scored 0 under assert tests (the
    block ran on empty stdin); HumanEval / MBPP harnesses do not run it. `from __future__` imports and
    dataclasses still work, and the tests still see private names and module globals."""
    from areno.rewards.code import code_execution

    tests = "assert f(2) == 4\nassert f(3) == 6"
    main_block = "def f(x):\n    return 2 * x\n\nif __name__ == '__main__':\n    print(f(int(input())))\n"
    assert code_execution("p", main_block, tests) == 1.0
    future = (
        "from __future__ import annotations\nimport typing\nfrom dataclasses import dataclass\n\n@dataclass\n"
        "class P:\n    k: typing.ClassVar[int] = 2\n\ndef f(x: int) -> int:\n    typing.get_type_hints(P)\n"
        "    return P.k * x\n"
    )
    assert code_execution("p", future, tests) == 1.0
    assert code_execution("p", "_K = 1\ndef f(x):\n    return _K * x", "_K = 2\nassert f(2) == 4") == 1.0
    assert code_execution("p", "def f(x)\n    return 2 * x", tests) == 0.0


def test_exact_match_compares_a_multi_line_reference_line_by_line():
    from areno.rewards.tasks import exact_match

    assert exact_match("p", "1349\nmore text", "1349") == 1.0
    assert exact_match("p", "def f():\n    return 1\n", "def f():\n    return 1") == 1.0
    assert exact_match("p", "def f():\n    return 2\n", "def f():\n    return 1") == 0.0
    assert exact_match("p", "def f():", "def f():\n    return 1") == 0.0


def test_math_verify_reads_float_references_and_escaped_dollars():
    """walk14: a float reference written with an exponent (1e-05, from a JSON number) parsed as an
    expression in Euler's e, and a reference with an escaped dollar (MATH's \\$18.90) did not parse:
    correct answers scored 0, or every sample of the row failed."""
    from areno.rewards.math import math_verify, reference_text

    assert reference_text(1e-05) == "$0.00001$" and reference_text(1e20) == "$100000000000000000000$"
    assert reference_text("\\$18.90") == "$\\$18.90$" and reference_text("$x$") == "$x$"
    assert math_verify("p", "so \\boxed{0.00001}", 1e-05) == 1.0
    assert math_verify("p", "\\boxed{100000000000000000000}", 1e20) == 1.0
    assert math_verify("p", "it costs \\boxed{18.90}", "\\$18.90") == 1.0
    assert math_verify("p", "\\boxed{0.5}", 0.5) == 1.0 and math_verify("p", "\\boxed{3}", 0.5) == 0.0


def test_math_verify_reads_plain_words_in_a_reference_as_text():
    """A plain-text reference parsed as a product of letters: `18 dollars` was 18·d·o·l·l·a·r·s (the boxed 18
    scored 0) and `Monday` was its letters' product (an anagram scored 1). Words are text now; math words,
    commands and letters beside digits stay math."""
    from areno.rewards.math import math_verify, reference_text

    assert math_verify("p", "The answer is \\boxed{18}.", "18 dollars") == 1.0
    assert math_verify("p", "\\boxed{19}", "18 dollars") == 0.0
    assert math_verify("p", "\\boxed{0.5}", "\\frac{1}{2} cup") == 1.0
    assert math_verify("p", "\\boxed{Monday}", "Monday") == 1.0
    assert math_verify("p", "\\boxed{Mnoday}", "Monday") == 0.0
    assert math_verify("p", "\\boxed{\\text{no solution}}", "no solution") == 1.0
    assert math_verify("p", "\\boxed{\\infty}", "infinity") == 1.0
    assert math_verify("p", "\\boxed{2yx}", "2xy") == 1.0
    for math in ("2xy", "x = 5", "ab", "log 2", "10 cm^2", "$x$ dollars", "\\sqrt{2}"):
        assert "\\text" not in reference_text(math), math


def test_the_sweep_removes_only_directories_no_live_pool_holds(tmp_path, monkeypatch):
    """A directory goes only when its lock file can be locked: a live pool's (here, in this process) stays,
    as do one without the lock file (another areno's, or being set up) and anything else in the directory."""
    import fcntl
    import tempfile

    from areno.rewards import sandbox as sandbox_module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with RewardSandbox("tests.helpers.rewards:misbehave", workers=1, timeout_s=TIMEOUT_S) as pool:
        assert pool.score("p", "ok") == 1.0
        (live,) = tmp_path.iterdir()
        orphan = tmp_path / "areno-reward-orphan"
        orphan.mkdir()
        (orphan / sandbox_module.DIR_LOCK).touch()  # its pool's process died: the kernel released the lock
        (orphan / "left.txt").write_text("a reward's file")
        unlocked = [tmp_path / "areno-reward-nolock", tmp_path / "other-dir"]
        for d in unlocked:
            d.mkdir()
        (tmp_path / "other-dir" / sandbox_module.DIR_LOCK).touch()
        held = tmp_path / "areno-reward-held"
        held.mkdir()
        fd = os.open(held / sandbox_module.DIR_LOCK, os.O_CREAT | os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another live pool, elsewhere
        try:
            assert sandbox_module._sweep_orphan_dirs.__wrapped__() == 1
        finally:
            os.close(fd)
        assert sorted(tmp_path.iterdir()) == sorted([live, held, *unlocked])
        assert pool.score("p", "ok") == 1.0  # the live worker's directory is still its working directory
    assert sorted(tmp_path.iterdir()) == sorted([held, *unlocked])  # the pool removed its own
