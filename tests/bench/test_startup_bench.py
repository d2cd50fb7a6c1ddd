"""bench/startup.py: medians, ratios to ``import torch`` and the speedup over a baseline tree, from
stubbed timings (the real ones spawn interpreters); a tree without areno is refused in one line."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import bench.startup as startup  # noqa: E402


def test_ratios_and_speedup_from_interleaved_rounds(tmp_path, monkeypatch, capsys):
    (tmp_path / "areno").mkdir()
    (tmp_path / "areno" / "__init__.py").write_text("")
    base = {"torch": 2.0, "cli": 6.0, "worker": 8.0}
    calls = []

    def fake(code, tree):
        entry = next(e for e, c in startup.ENTRY_POINTS.items() if c == code)
        calls.append((entry, tree == tmp_path))
        return base[entry] * (1.0 if tree == tmp_path else 0.5)

    monkeypatch.setattr(startup, "time_import", fake)
    startup.main(["--rounds", "3", "--baseline-tree", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    # interleaved: each round times every entry point on both trees before the next round
    assert (
        calls[:6]
        == [("torch", False), ("torch", True), ("cli", False), ("cli", True), ("worker", False), ("worker", True)]
        and len(calls) == 18
    )
    assert out["this"]["cli"] == {"median_s": 3.0, "ratio_to_torch": 3.0, "runs_s": [3.0, 3.0, 3.0]}
    assert out["baseline"]["worker"]["ratio_to_torch"] == 4.0
    assert out["speedup_vs_baseline"] == {"torch": 2.0, "cli": 2.0, "worker": 2.0}


def test_baseline_tree_without_areno_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"--baseline-tree .*: no areno/__init__.py there; export a checkout"):
        startup.main(["--baseline-tree", str(tmp_path)])


def test_failing_import_names_the_code_tree_and_error(tmp_path):
    with pytest.raises(SystemExit, match=r"python -c 'import no_such_module_here' failed in .*: ModuleNotFoundError"):
        startup.time_import("import no_such_module_here", tmp_path)
