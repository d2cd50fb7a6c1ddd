"""Resolving user code named by a path: a module (``pkg.module:attr`` or ``pkg.module.attr``),
importable from the installed packages, PYTHONPATH or the working directory, or a file
(``./rewards.py:score``, ``/abs/path/rewards.py:score``) imported from its location."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from areno.errors import RewardImportError, UserError
from areno.rewards.combined import WeightedRewards
from areno.rewards.inprocess import InProcessReward
from areno.rewards.sandbox import SANDBOX_CWD_PREFIX, RewardSandbox, pools_metrics, release_shared, shared_sandbox


def is_file_path(module: str) -> bool:
    """``module`` (the part before ``:``) names a Python file rather than a dotted module."""
    return module.endswith(".py") or "/" in module or os.sep in module


def resolve_path(path: str) -> str:
    """``path`` with a file location made absolute, so another process (a reward sandbox worker,
    which runs in its own temporary directory) imports the same file."""
    module, sep, attr = path.partition(":")
    if sep and is_file_path(module):
        return f"{Path(module).expanduser().resolve()}:{attr}"
    return path


def import_module(module: str, *, what: str, error: type[UserError] = RewardImportError) -> ModuleType:
    """Import ``module``: a dotted name, looked up on sys.path and then in the working directory
    (the ``areno`` script, unlike ``python -m``, does not put it on sys.path), or a ``.py`` file.
    A file is imported once per process (under a name derived from its absolute path), so a
    ``@recipe`` module named twice does not register twice."""
    if is_file_path(module):
        return _import_file(Path(module).expanduser().resolve(), what=what, error=error)
    cwd = os.getcwd()
    if cwd not in sys.path:  # appended: the working directory never shadows an installed package
        sys.path.append(cwd)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not _names_module(module, exc.name):  # the module exists; what it imports does not
            raise _import_failure(exc, module, what=what, error=error) from exc
        raise error(
            f"{what}: cannot import module {module!r} ({exc}): check the spelling, and that it is in the "
            f"working directory ({cwd}) or on PYTHONPATH, or name the file (./{module.replace('.', '/')}.py:NAME)"
        ) from None
    except (Exception, SystemExit) as exc:  # the user's module ran and raised: re-raised as one line, cause kept
        raise _import_failure(exc, module, what=what, error=error) from exc


def _names_module(module: str, missing: str) -> bool:
    """Whether ``missing`` (a ModuleNotFoundError's name) is ``module`` or one of its parent packages."""
    return module == missing or module.startswith(missing + ".")


def _import_failure(exc: BaseException, module: str, *, what: str, error: type[UserError]) -> UserError:
    """The one-line ``error`` for ``exc``, raised while importing the user's ``module``: where it
    happened (a SyntaxError's file and line, else the innermost frame of the traceback), the
    exception's type and the first line of its message."""
    if isinstance(exc, SyntaxError):  # its traceback is the compiler's caller; the exception has the line
        file, line, message = exc.filename, exc.lineno, exc.msg
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
        # an areno call the module made that refused (@recipe): the module's line that made it
        if frames and Path(frames[-1].filename).is_relative_to(_ARENO_DIR):
            frames = [f for f in frames if not Path(f.filename).is_relative_to(_ARENO_DIR)] or frames
        file, line = (frames[-1].filename, frames[-1].lineno) if frames else (None, None)
        message = str(exc)
    first = next(iter(str(message or "").strip().splitlines()), "")
    where = "" if not file else f" at line {line}" if file == module else f" at {file} line {line}"
    fix = "install what it imports, or fix the import" if isinstance(exc, ImportError) else "fix the module"
    if isinstance(exc, OSError) and Path.cwd().name.startswith(SANDBOX_CWD_PREFIX):
        fix = (
            "the reward sandbox's workers run in a private temporary directory, not the run's: open files by "
            "absolute path or relative to the module's __file__"
        )
    return error(f"{what}: importing {module} failed{where}: {type(exc).__name__}{': ' if first else ''}{first}: {fix}")


_ARENO_DIR = Path(__file__).resolve().parents[1]
"""The ``areno`` package's directory."""

USER_FILE_MODULE = "areno_user_"
"""The prefix of the module name a file named by path is imported under (one per absolute path)."""


def _import_file(file: Path, *, what: str, error: type[UserError]) -> ModuleType:
    if not file.is_file():
        raise error(f"{what}: file {file} does not exist: check the path (relative paths start at {os.getcwd()})")
    name = f"{USER_FILE_MODULE}{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it, as import does (dataclasses and pickle look it up)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # the user's module raised: re-raised as one line, cause kept
        del sys.modules[name]
        raise _import_failure(exc, str(file), what=what, error=error) from exc
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_object(path: str, *, what: str, error: type[UserError] = RewardImportError) -> Any:
    """Import ``path`` (``module:name``, ``module:Class.attr``, ``package.module.name`` or
    ``./file.py:name``); a bad path, or a module that fails to import, is a one-line ``error`` (a
    :class:`RewardImportError` unless told) naming ``what`` (the config key)."""
    module_name, sep, attr = path.partition(":")
    if not sep and not is_file_path(path):
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise error(f"{what}: {path!r} is not a path like 'package.module:name' or './file.py:name'")
    obj: Any = import_module(module_name, what=what, error=error)
    if not sep and not hasattr(obj, attr) and _is_submodule(path):  # `pkg.rewards` for `pkg.rewards:score`
        raise error(f"{what}: {_names_module_message(path, import_module(path, what=what, error=error))}")
    for part in attr.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=1)
            hint = f" (did you mean {module_name}:{attr[: -len(part)]}{close[0]}?)" if close else ""
            raise error(f"{what}: module {module_name!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    return obj


def _names_module_message(path: str, module: ModuleType) -> str:
    """Why ``path``, which names ``module``, names nothing to call, and the fix: the functions and
    classes the module defines."""
    defined = [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__
    ]
    listed = f" (it defines {', '.join(defined[:6])})" if defined else ""
    example = f"{module.__name__}:{defined[0] if defined else 'NAME'}"
    return f"{path!r} names a module, not a function or class in it: add :NAME, e.g. {example}{listed}"


def _is_submodule(name: str) -> bool:
    """Whether the dotted ``name`` is a module that can be imported (its parent is imported already)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def wants_sandbox(fns: Iterable[Any], sandbox: bool | None) -> bool:
    """``reward.sandbox`` resolved for the functions ``fns`` of ``reward.fn``: an explicit bool wins; auto
    (None) sandboxes them all unless every one is marked ``fn.areno_sandbox = False`` (shipped rewards that
    are cheap, bounded string ops)."""
    if sandbox is not None:
        return sandbox
    return any(getattr(fn, "areno_sandbox", True) for fn in fns)


def reward_function(path: str, *, key: str = "reward.fn") -> Callable[..., Any]:
    """The function ``path`` names, imported here; a :class:`RewardImportError` naming ``key`` (the
    setting: ``reward.fn``, ``reward.fn[1]``) when the path does not import or names something that
    cannot be called, or is not a path at all (a function set on a config built in Python)."""
    if not isinstance(path, str):
        raise RewardImportError(
            f"{key}: must be a 'module:function' or './file.py:function' path, got {path!r}: the reward runs "
            "in sandbox processes, which import it by path, so put it in a file and name it there"
        )
    try:
        fn = import_object(path, what=key)
    except RewardImportError:
        listed = _listed_paths(path)
        if listed is None:
            raise
        fix = (
            f"give each its own entry of the list, separated by commas: {', '.join(listed)}"
            if key != "reward.fn"
            else f"to score with several, write them as a list, reward.fn=[{', '.join(listed)}] (with "
            "reward.weights=[...] to weigh them)"
        )
        raise RewardImportError(f"{key}: {path!r} names {len(listed)} functions in one string: {fix}") from None
    if inspect.ismodule(fn):  # a package's submodule it imports itself: an attribute, but not a function
        raise RewardImportError(f"{key}: {_names_module_message(path, fn)}")
    if not callable(fn):
        raise RewardImportError(f"{key}: {path!r} is a {type(fn).__name__}, not a function")
    return fn


def _listed_paths(path: str) -> list[str] | None:
    """The paths of several functions written as one string (``a:f,b:g``, or ``a:f b:g`` from a list whose
    comma was left out), each ``module:name``; None when ``path`` does not split so."""
    parts = [p for p in re.split(r"[,\s]+", path) if p]
    return parts if len(parts) > 1 and all(":" in p for p in parts) else None


def reward_functions(section: Any) -> list[Callable[..., Any]]:
    """Every function a ``RewardSection``'s ``fn`` names, imported in its order (``reward_function``: the
    first that fails is the error, naming its entry)."""
    return [reward_function(path, key=key) for path, key in zip(section.paths(), section.fn_keys())]


REWARD_ARGUMENTS = ("prompt", "completion", "answer")
"""What the workflows pass a reward by position: ``fn(prompt, completion, answer, **row)``."""


def takes_answer(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` needs the answer: the parameter the call's third positional argument binds to
    has no default (``(prompt, completion, answer, **row)``; not ``answer=None``, nor ``*args``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except ValueError:  # no signature (some builtins): nothing says it needs one
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 and positional[2].default is positional[2].empty


def check_reward_signature(
    fn: Callable[..., Any],
    path: str,
    row_keys: Iterable[str],
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    row_fields: Iterable[str] | None = None,
    key: str = "reward.fn",
) -> None:
    """A one-line :class:`RewardImportError` when ``fn`` cannot take the call the workflows make:
    ``fn(prompt, completion, answer, **row)``, the first three positional, ``row`` holding
    ``row_keys`` (a data row's fields other than its prompt, answer and images: what
    ``areno.workflows.common.sample_fields`` passes). Otherwise every call would fail, each scored 0
    as a reward error, and the run would train on zeros. A callable without a signature (some
    builtins) is not checked.

    A row field named as one of the arguments the call passes by position (``answer``, when
    ``data.answer_key`` names another field) collides with it: that is the data keys' doing, not the
    signature's, so the error names the field and the ``data.*_key`` to set (``prompt_key``,
    ``answer_key``: the run's; ``row_fields``: every field of the row, listed in the message). ``key``: the
    setting that names ``fn`` (``reward.fn``, ``reward.fn[1]``)."""
    try:
        signature = inspect.signature(fn)
    except ValueError:  # no signature to check against: the calls will tell
        return
    keys = sorted(row_keys)
    try:
        signature.bind("prompt", "completion", "answer", **dict.fromkeys(keys))
    except TypeError as exc:
        positional = [
            n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        collided = [k for k in REWARD_ARGUMENTS if k in keys and k in positional[:3]]
        if collided:
            fields = None if row_fields is None else list(row_fields)
            problem = _collision(collided[0], prompt_key, answer_key, fields)
            raise RewardImportError(f"{key}: {path}: {problem}") from None
        row = f", the row's fields {keys} as keywords" if keys else ""
        takes = str(signature).replace("\n", " ")  # a default's repr may span lines; the error may not
        raise RewardImportError(
            f"{key}: {path} takes {takes} but is called as fn(prompt, completion, answer, **row){row} ({exc}): "
            "make it take (prompt, completion, answer, **row), or add **kwargs"
        ) from None


def _collision(field: str, prompt_key: str, answer_key: str, fields: list[str] | None) -> str:
    """Why the row field ``field`` collides with the reward's argument of that name, and the fix."""
    if field == "completion":  # the generated text: a row cannot give it
        return (
            "the row field 'completion' collides with the reward's argument 'completion', the generated text it "
            "scores: to score against it, set data.answer_key=completion (TRL's prompt/completion rows); else "
            "rename the field"
        )
    key, setting = (prompt_key, "data.prompt_key") if field == "prompt" else (answer_key, "data.answer_key")
    absent = ""
    if fields is not None and key not in fields:
        absent = f", not a field of the rows, whose fields are {', '.join(fields)}"
    return (
        f"the row field {field!r} collides with the reward's argument {field!r}, which the workflows fill from "
        f"the row's {setting} field ({setting}={key!r}{absent}): the row's own {field!r} would be a second value "
        f"for it; set {setting}={field}, or rename the row field"
    )


def load_reward(section: Any) -> Any:
    """The reward function of a ``RewardSection``: when it runs in-process, the imported function
    watched for calls past ``reward.timeout_s`` (``InProcessReward``); else the shared
    :class:`~areno.rewards.sandbox.RewardSandbox` for it (an async callable with the same signature). Either way the workflows call it through ``acall_reward``;
    sandbox failures raise ``RewardFailure`` there and score 0.

    ``reward.fn`` as a list, or with ``reward.weights``: a :class:`WeightedRewards` of its functions,
    each loaded so (in-process only when every one may be: ``wants_sandbox``), each sandboxed one its own
    pool. A list of one function without weights is that function, as the plain string is."""
    paths = section.paths()
    if not paths:  # reward.model alone: the training side adds its score to this 0
        return no_reward
    fns = reward_functions(section)
    sandboxed = wants_sandbox(fns, section.sandbox)
    rewards = [_load_one(fn, path, section, sandboxed=sandboxed) for fn, path in zip(fns, paths)]
    if len(rewards) == 1 and section.weights is None:
        return rewards[0]
    return WeightedRewards(paths, rewards, section.weights or [1.0] * len(rewards))


def no_reward(prompt: Any, completion: str, answer: Any = None, **row: Any) -> float:
    """The rollout's reward where ``reward.fn`` names no function (``reward.model`` scores on the training side)."""
    return 0.0


def _load_one(fn: Callable[..., Any], path: str, section: Any, *, sandboxed: bool) -> Any:
    if not sandboxed:
        return InProcessReward(fn, name=path, timeout_s=section.timeout_s)
    return shared_sandbox(
        resolve_path(path),
        workers=section.workers,
        timeout_s=section.timeout_s,
        memory_mb=section.memory_mb,
        cpu_s=section.cpu_s,
        allow_network=section.allow_network,
    )


def reward_pools(reward: Any) -> list[RewardSandbox]:
    """The sandbox pools ``reward`` (``load_reward``'s) scores with: none for an in-process one."""
    parts = reward.rewards if isinstance(reward, WeightedRewards) else [reward]
    return [p for p in parts if isinstance(p, RewardSandbox)]


def start_reward(reward: Any) -> Any:
    """``reward`` (``load_reward``'s), with each sandbox's first worker started: it imports the reward
    while the caller loads its models, and ``check_reward_started`` waits for it."""
    for pool in reward_pools(reward):
        pool.start_early()
    return reward


def check_reward_started(reward: Any) -> None:
    """A one-line RewardImportError when ``reward`` is (or holds) a sandbox whose workers cannot import
    it (nothing to check for an in-process one: it is imported already)."""
    for pool in reward_pools(reward):
        pool.check_started()


def reward_pool_metrics(reward: Any) -> dict[str, float]:
    """The ``rollout/reward_*`` counters of the pools ``reward`` scores with (``RewardSandbox.metrics``,
    summed over the functions of a list), or nothing when it runs in-process."""
    pools = list({id(p): p for p in reward_pools(reward)}.values())  # a function listed twice: one pool
    if len(pools) == 1:  # its own figures as they are (a sum's mean call time may round apart)
        return pools[0].metrics()
    return pools_metrics(pools) if pools else {}


def release_reward(reward: Any) -> None:
    """Give back ``reward``'s sandbox pools (``release_shared``: each closed once no other run of this
    process scores with it)."""
    for pool in reward_pools(reward):
        release_shared(pool)
