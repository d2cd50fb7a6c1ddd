"""Reading docs/metrics.md's tables: the metric keys they document, as written and as patterns."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented_keys() -> list[tuple[int, str]]:
    """``(line, key)`` of every key of docs/metrics.md's tables: the backticked names of a row's first cell."""
    keys = []
    for number, line in enumerate(DOC.read_text().splitlines(), 1):
        first = re.match(r"^\| (.*?) \| ", line)
        if first is not None:
            keys += [(number, key) for key in re.findall(r"`([^`]+)`", first.group(1))]
    return keys


def documented_patterns() -> list[re.Pattern]:
    """The documented keys as regular expressions, a ``<placeholder>`` standing for one name (no ``/``)."""
    patterns = []
    for _, key in documented_keys():
        parts = re.split(r"<[a-z]+>", key)
        patterns.append(re.compile("[A-Za-z0-9_@.]+".join(map(re.escape, parts)) + "$"))
    return patterns


def undocumented(keys: set[str]) -> list[str]:
    """The keys no documented pattern matches, sorted."""
    patterns = documented_patterns()
    return sorted(k for k in keys if not any(p.match(k) for p in patterns))
