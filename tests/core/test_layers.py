"""The layer order of ``pyproject.toml`` holds: `lint-imports` passes, no two areno modules import
each other in a loop (imports inside functions count), and areno modules are imported at module
level only (an import inside a function is for a heavy optional dependency, never to dodge a loop)."""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")  # import-linter brings it (the test extra)

ROOT = Path(__file__).resolve().parents[2]

LAZY_AREANO_IMPORTS = {
    # `areno --help` and each subcommand load only the layers they use
    "areno/cli.py",
}


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_import_linter_contracts_hold():
    proc = subprocess.run(["lint-imports"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def import_loops(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return loops


def test_no_import_loops():
    graph = grimp.build_graph("areno", include_external_packages=False)
    assert import_loops(graph) == []


def test_areno_modules_are_imported_at_module_level():
    offenders = []
    for path in sorted((ROOT / "areno").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in LAZY_AREANO_IMPORTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for sub in ast.walk(node):
                names = (
                    [sub.module or ""]
                    if isinstance(sub, ast.ImportFrom)
                    else [a.name for a in sub.names]
                    if isinstance(sub, ast.Import)
                    else []
                )
                if any(n == "areno" or n.startswith("areno.") for n in names):
                    offenders.append(f"{rel}:{sub.lineno}")
    assert not offenders, offenders


def test_no_test_module_imports_another():
    """What tests share lives in ``tests/helpers``: a test importing another test module runs that module's
    import-time code and couples the two files."""
    tests = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"^\s*(from|import)\s+tests\.(?!helpers\b)[\w.]*\btest_\w+", re.MULTILINE)
    offenders = [
        f"{path.relative_to(tests)}: {m.group(0).strip()}"
        for path in sorted(tests.rglob("*.py"))
        for m in pattern.finditer(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "move what they share into tests/helpers:\n" + "\n".join(offenders)
