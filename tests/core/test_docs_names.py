"""The docs name only what the code has: every backticked name of README.md and docs/*.md that points
into the repository resolves there, so a rename that forgets a doc fails here.

Five kinds are checked, each where it can be without false alarms:

- repository paths (``areno/models/moe.py``, ``tests/core/test_layers.py::test_name``, globs, ``{a,b}``
  alternatives, ``<placeholder>`` parts), bare test file names and relative markdown links exist; a
  ``::test`` names a function of that file, a ``:line`` a line it has, a link's ``#anchor`` a heading;
- dotted names whose first part is areno's (``areno.engine.seams``, a module by its unique basename
  ``moe.SigmoidRouter``, a class or function by its name ``ModelRole.sync_to_rollout``, ``module:name``)
  resolve by import and ``getattr``; an attribute a class sets on its instances (``self.x = ...``, a
  class-level annotation, a dataclass field) counts, and the walk goes on only into a dataclass field's
  dataclass; a lower-case name that is a module's may also be a variable holding one of its classes
  (``engine.step``, ``trainer.backend``), ``VARIABLES`` names the others; a module that needs a missing
  optional extra (vllm, ray) is read statically; ``Name(keyword=...)`` gives a parameter ``Name`` takes;
- config keys (``rollout.max_head_offpolicyness``, ``train.lora.rank``, the overrides of an ``areno``
  command, the keys of a config's YAML block) are settings of ``ArenoConfig``: found by the walk
  ``load_config`` types a refused override with (``areno.api.config._schema_type``), a stale one told in
  ``load_config``'s own words; a key under a mapping setting passes, one under ``train.algorithm_kwargs``
  where it is an option of some registered recipe;
- ``areno <command> --flag`` names a subcommand of ``areno.cli.build_parser`` (and of ``areno launch``)
  and an option its parser takes; the delegated commands' parsers are caught as their ``main`` parses;
- the metric keys of docs/metrics.md are built by areno's code (the words of their last part are in it
  outside docstrings and comments): the reverse of tests/observe/test_metrics_documented.py; and a
  metric key any doc names is one docs/metrics.md's tables document.

Of the fenced blocks only the ``areno`` command lines of shell blocks and the config YAML blocks are read
(docs/python.md's blocks run as a test of their own).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import functools
import importlib
import inspect
import itertools
import os
import re
import typing
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import yaml

from areno.api.config import ConfigError, _schema_type, load_config
from areno.cli import DELEGATED, build_parser, launch_parser
from areno.engine.config import ArenoConfig
from areno.recipes import TRAINING_CONFIGS
from areno.recipes.registry import REFERENCE_SYNC_OPTIONS, recipe_options
from tests.helpers.metrics_doc import documented_keys, undocumented

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SPAN = re.compile(r"`([^`\n]+)`")
FILE_SUFFIXES = frozenset("py json jsonl yaml yml md pt png toml lark tmp txt html sh lock".split())
"""A dotted span ending in one of these is a file name (``moe.py``, ``config.yaml``), not an attribute."""

ALLOWED = {
    "config.train.stpes": "the misspelling docs/python.md shows refused",
    "train.stpes": "the misspelling docs/python.md shows refused",
    "train.algorithm_kwargs.temperature": "the option docs/recipes.md says is refused (rollout.temperature sets it)",
    "tokenizer.encode": "a Hugging Face tokenizer's method, not the module areno.data.tokenizer",
    "train/policy/reinforce/advantage": "the figure docs/recipes.md's example recipe logs, a user's own metric",
}
"""Names that look like areno's but are deliberately something else, with why (checked by no kind)."""
VARIABLES = {
    "client": ("areno.rollout.client.RolloutClient", "areno.workflows.openai_client.ArenoAsyncOpenAI"),
}
"""Variables the docs name by their role, read as an instance of one of these classes: ``client`` is a
workflow's ``RolloutClient`` (``client.agenerate``) or an agent's OpenAI-style client (``client.ascore``)."""


@dataclasses.dataclass(frozen=True)
class Span:
    doc: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: `{self.text}`"


FENCED = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.S | re.M)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


@functools.cache
def spans() -> tuple[Span, ...]:
    """Every inline backticked span of the docs, and each ``areno`` command line of a fenced shell block
    (its continuation lines joined); the other fenced blocks are left out."""
    found = []
    for doc in DOCS:
        text, name = doc.read_text(), str(doc.relative_to(ROOT))
        for block in FENCED.finditer(text):
            if block.group(1) in ("bash", "sh", "shell", "console"):
                code = block.group(2).replace("\\\n", " ")
                lines = [line.strip().removeprefix("$ ") for line in code.splitlines()]
                line = _line(text, block.start(2))
                found += [Span(name, line, c) for c in lines if re.match(r"(python -m )?areno ", c)]
        inline = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for number, line in enumerate(inline.splitlines(), 1):
            found += [Span(name, number, s) for s in SPAN.findall(line)]
    return tuple(found)


@functools.cache
def yaml_blocks() -> tuple[tuple[Span, dict], ...]:
    """The fenced YAML blocks of the docs that are a config (a mapping naming a setting of ``ArenoConfig``)."""
    found = []
    top = {f.name for f in dataclasses.fields(ArenoConfig)}
    for doc in DOCS:
        text = doc.read_text()
        for block in FENCED.finditer(text):
            if block.group(1) in ("yaml", "yml"):
                loaded = yaml.safe_load(block.group(2))
                if isinstance(loaded, dict) and set(loaded) & top:
                    span = Span(str(doc.relative_to(ROOT)), _line(text, block.start(2)), "```yaml```")
                    found.append((span, loaded))
    return tuple(found)


# --- repository paths ---------------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w./-])((?:areno|tests|bench|examples|docs|\.ci)/[\w./{},<>*:\-]*)")


def _alternatives(path: str) -> list[str]:
    """``path`` with each ``{a,b}`` expanded and each ``<placeholder>`` a glob star."""
    path = re.sub(r"<[\w-]+>", "*", path)
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


@functools.cache
def _headings(doc: Path) -> frozenset[str]:
    """The anchors of ``doc``'s headings as GitHub makes them (lower case, punctuation dropped, ``-`` for spaces)."""
    if not doc.is_file():
        return frozenset()
    text = FENCED.sub("", doc.read_text())
    titles = re.findall(r"^#+\s+(.*?)\s*$", text, re.M)
    return frozenset(re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles)


def stale_path(text: str) -> str | None:
    """Why the repository path ``text`` (``file``, ``file::test``, ``file:line``, a glob) is stale; None if not."""
    text = text.rstrip(".,;:)")
    text, _, anchor = text.partition("#")
    if anchor and anchor not in _headings(ROOT / text):
        return f"{text} has no heading #{anchor}"
    path, _, where = text.partition("::") if "::" in text else text.partition(":")
    for alt in _alternatives(path):
        if any(c in alt for c in "*?["):
            if not list(ROOT.glob(alt)):
                return f"{alt} matches nothing"
            continue
        if not (ROOT / alt).exists():
            return f"{alt} does not exist"
        if where.isdigit() and len((ROOT / alt).read_text().splitlines()) < int(where):
            return f"{alt} has no line {where}"
        if where and not where.isdigit():
            names = where.split("::")
            source = (ROOT / alt).read_text()
            missing = [n for n in names if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b", source, re.M)]
            if missing:
                return f"{alt} has no {missing[0]}"
    return None


TEST_FILE = re.compile(r"(?<![\w./-])(test_\w+\.py)((?:::\w+)?)(?![\w/])")


def path_names() -> list[tuple[Span, str]]:
    """Every repository path in a span, every bare test file name (``test_stop_signal.py``) as the one
    file of that name under tests/, and the target of every relative markdown link."""
    found = [(s, p) for s in spans() for p in PATH.findall(s.text)]
    for span in spans():
        for name, test in TEST_FILE.findall(span.text):
            hits = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob(name)]
            found.append((span, (hits[0] if len(hits) == 1 else f"tests/**/{name}") + test))
    for doc in DOCS:  # the targets of relative markdown links, from the doc's directory
        text = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), doc.read_text())
        for link in re.finditer(r"\]\(([^)\s#:]*)(#[^)\s]*)?\)", text):
            path, anchor = link.group(1), link.group(2) or ""
            target = os.path.relpath(doc.parent / path if path else doc, ROOT) + anchor
            found.append((Span(str(doc.relative_to(ROOT)), _line(text, link.start()), link.group(0)), target))
    return found


# --- areno's dotted names -----------------------------------------------------------------------------


@functools.cache
def areno_index() -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, Path]]:
    """Read statically: module basename -> modules, module-level class or function -> modules,
    module -> its file."""
    basenames: dict[str, list[str]] = {}
    defined: dict[str, list[str]] = {}
    files: dict[str, Path] = {}
    for path in sorted((ROOT / "areno").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[module] = path
        basenames.setdefault(module.rpartition(".")[2], []).append(module)
        for name in TOP_LEVEL_DEF.findall(path.read_text()):
            defined.setdefault(name, []).append(module)
    return basenames, defined, files


TOP_LEVEL_DEF = re.compile(r"^(?:async def|def|class) (\w+)", re.M)
"""A module-level class or function: a regular expression reads areno's files much faster than ``ast``."""


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _instance_attributes(cls: type) -> set[str]:
    """What ``cls`` sets on its instances: ``self.<name>`` assignments in its (and its areno bases')
    source, class-level annotations and dataclass fields."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for klass in cls.__mro__:
        names |= set(vars(klass).get("__annotations__", {}))
        if not klass.__module__.startswith("areno"):
            continue
        tree = _tree(Path(inspect.getfile(klass)))
        body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
        for node in ast.walk(body):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                if ast.unparse(node.func) in ("setattr", "object.__setattr__"):  # frozen dataclasses
                    names.add(node.args[1].value)
    return names


def _statically_defined(module: str, name: str) -> bool:
    """Whether ``module`` (one that cannot be imported here) defines ``name`` at module level."""
    for node in _tree(areno_index()[2][module]).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return True
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.partition(".")[0]) == name for a in node.names):
                return True
    return False


def _field_class(cls: object, attr: str) -> type | None:
    """The dataclass that field ``attr`` of dataclass ``cls`` holds, where its annotation names one."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return None
    try:
        hint = typing.get_type_hints(cls).get(attr)
    except NameError:  # an annotation only a type checker resolves
        return None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _walk(module: str, attrs: list[str]) -> str | None:
    """Why ``module`` then ``attrs`` does not resolve; None if it does."""
    try:
        obj: object = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("areno"):  # an optional extra: read the file instead
            return None if _statically_defined(module, attrs[0]) else f"{module} has no {attrs[0]}"
        raise
    where = module
    for attr in attrs:
        if isinstance(obj, ModuleType) and not hasattr(obj, attr) and f"{where}.{attr}" in areno_index()[2]:
            obj = importlib.import_module(f"{where}.{attr}")
        elif hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif _field_class(obj, attr) is not None:  # `config.train.steps`: ArenoConfig.train holds a TrainSection
            obj = _field_class(obj, attr)
        elif isinstance(obj, type) and attr in _instance_attributes(obj):
            return None  # an instance's attribute: what it holds is not known here
        else:
            return f"{where} has no {attr}"
        where = f"{where}.{attr}"
    return None


def _classes(module: str) -> list[str]:
    return [c for c, modules in areno_index()[1].items() if module in modules and c[:1].isupper()]


def _candidates(parts: list[str]) -> list[tuple[str, list[str]]] | None:
    """The (module, attributes) readings of ``parts`` in areno; None when its first part is not areno's."""
    basenames, defined, files = areno_index()
    if parts[0] == "areno":
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in files:
                return [(".".join(parts[:n]), parts[n:])]
        return [("areno", parts[1:])]
    if parts[0] in VARIABLES:
        return [(m, [c, *parts[1:]]) for m, _, c in (v.rpartition(".") for v in VARIABLES[parts[0]])]
    if parts[0] in basenames:
        modules = basenames[parts[0]]
        # a variable named after its module (`engine.step`, `trainer.backend`): one of its classes' instances
        instances = (
            [(m, [c, *parts[1:]]) for m in modules for c in _classes(m)]
            if parts[1:2] and parts[1][:1].islower()
            else []
        )
        return [(m, parts[1:]) for m in modules] + instances
    if parts[0] in defined:
        return [(m, parts) for m in defined[parts[0]]]
    return None


@functools.cache
def stale_dotted(name: str) -> str | None:
    """Why areno's dotted ``name`` (``moe.SigmoidRouter``, ``areno.rewards.math:math_verify``) does not
    resolve; None if it does (or it is not areno's). Of a basename or class several modules have, one
    reading that resolves is enough."""
    if name.startswith("bench."):  # a benchmark module, python -m bench.e2e
        return None if (ROOT / (name.replace(".", "/") + ".py")).is_file() else f"{name} is no module of bench/"
    readings = _candidates(re.split(r"[.:]", name))
    assert readings is not None, name
    reasons = []
    for module, attrs in readings:
        reasons.append(_walk(module, attrs))
        if reasons[-1] is None:
            return None
    return "; ".join(reasons)


DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
MODULE_NAME = re.compile(r"(?<![\w.])(areno(?:\.\w+)+:\w+)")


def dotted_names() -> list[tuple[Span, str]]:
    """The spans that start with a dotted name (``a.b.c``, ``a.b(x, y)``, ``a.b == 1``, ``a.b["k"]``) whose
    first part is areno's and that are no config key, every ``areno.module:name`` in a span, and the names
    of a ``from areno... import`` span."""
    found = []
    for span in spans():
        found += [(span, n) for n in MODULE_NAME.findall(span.text)]
        imported = re.fullmatch(r"from (areno(?:\.\w+)*) import ([\w, ]+)", span.text)
        if imported:  # `from areno.api import Trainer, load_config`
            found += [(span, f"{imported.group(1)}:{n.strip()}") for n in imported.group(2).split(",")]
            continue
        match = re.match(rf"({DOTTED.pattern})(?=$|\(|\[| ?==?)", span.text)  # a.b, a.b(..), a.b[..], a.b == ..
        name = match and match.group(1)
        if name is None or name in ALLOWED:
            continue
        parts = name.split(".")
        if parts[-1] in FILE_SUFFIXES or parts[0] in config_sections():
            continue
        if parts[0] == "bench" or _candidates(parts) is not None:
            found.append((span, name))
    return found


def _resolved(name: str) -> list[object]:
    """The class or function areno's ``name`` (by its name or dotted path) is, in each reading that
    resolves to one."""
    found = []
    for module, attrs in _candidates(name.split(".")) or []:
        if _walk(module, attrs) is None:
            obj: object = importlib.import_module(module)
            for attr in attrs:
                obj = getattr(obj, attr, None)
            if callable(obj):
                found.append(obj)
    return found


def keyword_arguments() -> list[tuple[Span, str, str]]:
    """``(span, callable, keyword)`` of every ``Name(keyword=...)`` in a span whose ``Name`` is areno's
    class or function (``AgentWorkflow(proxy=True)``, ``RecipeRunner(placement=)``)."""
    found = []
    for span in spans():
        for name, arguments in re.findall(r"(?<![\w.])([A-Za-z_][\w.]*)\((.*?)\)", span.text):
            if _resolved(name):
                found += [(span, name, k) for k in re.findall(r"(?:^|,)\s*(\w+)=", arguments)]
    return found


def stale_keyword(name: str, keyword: str) -> str | None:
    """Why ``name`` takes no ``keyword``; None if one of its readings does (or takes ``**kwargs``)."""
    for obj in _resolved(name):
        parameters = inspect.signature(obj).parameters.values()
        if any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in parameters):
            return None
    return f"{name} takes no {keyword}="


# --- config keys --------------------------------------------------------------------------------------


@functools.cache
def config_sections() -> frozenset[str]:
    """The sections of a config file (``model``, ``rollout``, ...): the settings of ``ArenoConfig`` that hold keys."""
    return frozenset(f.name for f in dataclasses.fields(ArenoConfig) if dataclasses.is_dataclass(_schema_type(f.name)))


KEY = re.compile(r"(?<![\w./-])([a-z_]+(?:\.[A-Za-z_<>][\w<>]*)+)(?=$|[=\s,;:)\]}])")


def config_keys() -> list[tuple[Span, str]]:
    """Every ``section.key`` of a known section in a span: the span itself (``train.compile``,
    ``train.compile=true``) or an override of a command."""
    found = []
    for span in spans():
        for key in KEY.findall(span.text):
            key = f"train.{key}" if key.startswith("algorithm_kwargs.") else key
            parts = key.split(".")
            if parts[0] not in config_sections() or parts[-1] in FILE_SUFFIXES or key in ALLOWED:
                continue
            found.append((span, key))
    return found


def yaml_keys() -> list[tuple[Span, str]]:
    """Every key of the docs' config YAML blocks, as a dotted key (``rollout.n_samples``); the keys
    under a mapping setting are its values, not settings, but for ``train.algorithm_kwargs``'s options."""
    found = []

    def walk(span: Span, prefix: str, node: dict) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            found.append((span, key))
            if isinstance(value, dict) and dataclasses.is_dataclass(_schema_type(key)):
                walk(span, f"{key}.", value)
            elif isinstance(value, dict) and key == "train.algorithm_kwargs":  # recipe options
                found.extend((span, f"{key}.{option}") for option in value)

    for span, loaded in yaml_blocks():
        walk(span, "", loaded)
    return found


@functools.cache
def stale_key(key: str) -> str | None:
    """Why ``key`` is no setting of ``ArenoConfig``; None if it is. A placeholder part (``KEY``,
    ``<name>``) ends what is checked."""
    parts = list(itertools.takewhile(lambda p: not (p.isupper() or "<" in p), key.split(".")))
    checked = ".".join(parts)
    if _schema_type(checked) is None:  # what `areno train ... KEY=...` would say of it
        with pytest.raises(ConfigError) as refused:
            load_config(None, [f"{checked}=null"])
        return f"not a setting: {refused.value}"
    if parts[:2] == ["train", "algorithm_kwargs"] and len(parts) > 2 and parts[2] not in recipe_option_names():
        return f"{parts[2]} is an option of no recipe (areno recipes NAME lists them)"
    return None


@functools.cache
def recipe_option_names() -> frozenset[str]:
    """Every option ``train.algorithm_kwargs`` takes for some registered recipe."""
    return frozenset(REFERENCE_SYNC_OPTIONS).union(*({row[0] for row in recipe_options(n)} for n in TRAINING_CONFIGS))


# --- areno commands and flags -------------------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def _caught_parser(main) -> argparse.ArgumentParser:
    """The parser a delegated command's ``main`` builds, caught as it parses (nothing runs)."""

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", catch):
        with pytest.raises(_Parsed) as parsed:
            main([])
    return parsed.value.parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@functools.cache
def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """``areno``'s subcommands (and ``launch <cmd>``) -> the parser of their options."""
    parsers = {}
    for name, parser in _subparsers(build_parser()).items():
        if name in DELEGATED and name != "launch":
            module, _, function = DELEGATED[name][0].partition(":")
            parser = _caught_parser(getattr(importlib.import_module(module), function or "main"))
        parsers[name] = parser
    parsers["launch"] = launch_parser()
    parsers |= {f"launch {n}": p for n, p in _subparsers(launch_parser()).items()}
    return parsers


COMMAND = re.compile(r"(?:^|\s)areno\s+([a-z][\w-]*)(.*)")


def commands() -> list[tuple[Span, str, list[str]]]:
    """``(span, command, flags)`` of every span that is an ``areno`` command line."""
    found = []
    for span in spans():
        match = COMMAND.match(span.text) or re.match(r"python -m areno\s+([a-z][\w-]*)(.*)", span.text)
        if match is None:
            continue
        command, rest = match.groups()
        words = rest.replace("[", " ").replace("]", " ").split()
        if command == "launch" and words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
            command = f"launch {words[0]}"
        flags = [re.sub(r"[=,].*", "", w) for w in words if re.match(r"-{1,2}[A-Za-z*]", w)]
        found.append((span, command, flags))
    return found


def stale_command(command: str, flags: list[str]) -> str | None:
    """Why ``areno <command> <flags>`` is refused; None if not. A ``*`` in a flag is a glob."""
    parser = command_parsers().get(command)
    if parser is None:
        return f"areno has no command {command!r}"
    options = list(parser._option_string_actions)
    bad = [f for f in flags if not fnmatch.filter(options, f)]
    return f"areno {command} takes no {', '.join(bad)}" if bad else None


# --- metric keys --------------------------------------------------------------------------------------


@functools.cache
def areno_code() -> str:
    """areno's source without its triple-quoted strings (docstrings) and its comments: what builds metric keys."""
    source = "\n".join(p.read_text() for p in sorted((ROOT / "areno").rglob("*.py")))
    source = re.sub(r"(\"\"\"|\'\'\').*?\1", "", source, flags=re.S)
    return re.sub(r"#[^\n\"']*$", "", source, flags=re.M)


def metric_keys() -> list[tuple[Span, str]]:
    """The keys of docs/metrics.md's tables (the backticked names of a row's first cell)."""
    return [(Span("docs/metrics.md", line, key), key) for line, key in documented_keys()]


METRIC = re.compile(r"(?:rollout|train|eval|test|timing|system)/[\w@<>{},.*/-]*[\w>*}]|policy_sync_[\w<>*]+")


def metric_mentions() -> list[tuple[Span, str]]:
    """Every span that is a metric key (``rollout/reward_mean``, ``policy_sync_*``, ``eval/pass@<k>``), a
    ``{a,b}`` one read as each of its keys; docs/metrics.md's table keys are not mentions of themselves."""
    tables = {(line, key) for line, key in documented_keys()}
    found = []
    for span in spans():
        if not METRIC.fullmatch(span.text) or span.text.rpartition(".")[2] in FILE_SUFFIXES or span.text in ALLOWED:
            continue
        if span.doc != "docs/metrics.md" or (span.line, span.text) not in tables:
            found += [(span, key) for key in _alternatives(span.text.replace("...", "<name>"))]
    return found


def stale_mention(key: str) -> str | None:
    """Why the metric ``key`` named in a doc is none docs/metrics.md documents (a glob, placeholders
    included: matches none)."""
    if "*" in key:
        return None if fnmatch.filter([k for _, k in documented_keys()], key) else f"{key} matches no documented key"
    return f"{key} is not in docs/metrics.md's tables" if undocumented({key}) else None


def stale_metric(key: str) -> str | None:
    """Why the documented metric ``key`` is logged by no code: the words of its last part (``reward_mean``
    of ``rollout/reward_mean``, ``_mean`` of ``rollout/reward/<name>_mean``) are nowhere in areno's code.
    tests/observe/test_metrics_documented.py checks the other way, that what a run logs is documented."""
    words = [w.strip("_") for w in re.split(r"<\w+>", key.rpartition("/")[2]) if len(w.strip("_")) > 2]
    missing = [w for w in words if w not in areno_code()]
    return f"areno's code has no {missing[0]!r}" if missing else None


# --- the tests ----------------------------------------------------------------------------------------


def _stale(found, why) -> list[str]:
    return [f"{span}: {reason}" for span, *name in found if (reason := why(*name))]


def test_every_repository_path_the_docs_name_exists():
    found = path_names()
    assert len(found) > 150
    assert _stale(found, stale_path) == []


def test_every_areno_name_the_docs_give_resolves():
    found = dotted_names()
    assert len(found) > 100
    assert _stale(found, stale_dotted) == []


def test_every_keyword_the_docs_give_an_areno_callable_is_a_parameter():
    found = keyword_arguments()
    assert len(found) > 15
    assert _stale(found, stale_keyword) == []


def test_every_config_key_the_docs_give_is_a_setting():
    found = config_keys() + yaml_keys()
    assert len(found) > 300 and len(yaml_keys()) > 10
    assert _stale(found, stale_key) == []


def test_every_areno_command_and_flag_the_docs_give_is_accepted():
    found = commands()
    assert len(found) > 40
    assert _stale(found, stale_command) == []


def test_every_metric_docs_metrics_md_lists_is_built_by_the_code():
    found = metric_keys()
    assert len(found) > 150
    assert _stale(found, stale_metric) == []


def test_every_metric_the_docs_name_is_in_docs_metrics_md():
    found = metric_mentions()
    assert len(found) > 100
    assert _stale(found, stale_mention) == []


def test_the_checks_catch_stale_names():
    assert stale_path("areno/models/moe.py") is None and stale_path("tests/models/test_<family>.py") is None
    assert stale_path("areno/models/no_such.py") and stale_path("examples/{dapo_sort,no_such}.yaml")
    assert stale_path("tests/core/test_layers.py::test_no_such_test") and stale_path("bench/no_*.py")
    assert stale_path("docs/launch.md#ray") is None and stale_path("docs/launch.md#no-such-heading")
    assert stale_dotted("moe.SigmoidRouter") is None and stale_dotted("areno.rewards.math:math_verify") is None
    assert stale_dotted("moe.NoSuchRouter") and stale_dotted("areno.engine.no_such_module")
    assert stale_dotted("Decoder.no_such_attribute") and stale_dotted("areno.rewards.math:no_such")
    assert stale_dotted("config.train.steps") is None and stale_dotted("config.train.no_such_setting")
    assert stale_keyword("AgentWorkflow", "proxy") is None and stale_keyword("AgentWorkflow", "no_such")
    assert stale_key("rollout.max_head_offpolicyness") is None and stale_key("train.algorithm_kwargs.KEY") is None
    assert stale_key("rollout.no_such_key") and stale_key("train.lora.no_such_key")
    assert stale_key("train.algorithm_kwargs.kl_coef") is None and stale_key("train.algorithm_kwargs.no_such_option")
    assert stale_command("train", ["--check"]) is None and stale_command("serve", ["--max-*"]) is None
    assert stale_command("train", ["--no-such-flag"]) and stale_command("no-such-command", [])
    assert stale_command("launch allocation", ["--devices"]) is None and stale_command("doctor", ["--nope"])
    assert stale_metric("rollout/reward/<name>_mean") is None and stale_metric("rollout/no_such_figure_mean")
    assert stale_mention("eval/gsm8k/accuracy") is None and stale_mention("policy_sync_*") is None
    assert stale_mention("rollout/no_such_figure") and stale_mention("train/no_such_*")


def test_a_module_that_needs_a_missing_extra_is_read_without_importing_it(monkeypatch):
    import_module = importlib.import_module

    def without_vllm(name: str, *args):
        if name == "areno.models.moe":
            raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
        return import_module(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_vllm)
    assert _walk("areno.models.moe", ["SigmoidRouter", "anything"]) is None
    assert _walk("areno.models.moe", ["NoSuchRouter"]) == "areno.models.moe has no NoSuchRouter"
