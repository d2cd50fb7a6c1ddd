"""Math answers checked with Hugging Face ``math-verify`` (LaTeX / expression parsing + sympy).

sympy can take unbounded time on adversarial expressions, and math-verify's own timeouts use
``signal.alarm``, which only works in a process's main thread. So this reward runs in the reward
sandbox by default (its workers call it in their main thread, with math-verify's timeouts on, and
``reward.timeout_s`` kills anything longer); called in-process off the main thread, math-verify's
timeouts are switched off and nothing bounds it.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal
from typing import Any

from areno.data.messages import completion_text

PARSE_TIMEOUT_S = 5
"""math-verify's own parsing and comparison timeouts (main thread only)."""

_MATH_DELIMITER = re.compile(r"(?<!\\)\$")
"""An unescaped ``$``: a reference holding one is LaTeX already (``\\$18.90`` is a dollar sign)."""


_WORDS = re.compile(r"(?<![\\A-Za-z0-9])[A-Za-z]{2,}(?:\s+[A-Za-z]{2,})*(?![A-Za-z0-9(^_])")
"""A run of plain words (not a LaTeX command, not letters beside digits like ``2xy``)."""
_MATH_WORDS = frozenset(
    "sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp sqrt min max gcd lcm mod det "
    "infinity infty pi".split()
)
"""Words math-verify reads as math, left as they are."""


def _text_words(match: re.Match[str]) -> str:
    words = match.group(0)
    if words.lower() in _MATH_WORDS or max(len(w) for w in words.split()) < 3:
        return words
    return f"\\text{{{words}}}"


def reference_text(answer: Any) -> str:
    """The reference as math-verify parses it: a float written out in full (``1e-05`` would read as an
    expression in Euler's e), in ``$...$`` unless it has math delimiters or a ``\\boxed``, its plain
    words in ``\\text{}`` (``18 dollars`` is 18 with a unit, ``Monday`` a word, not products of letters)."""
    if isinstance(answer, float) and answer == answer and abs(answer) != float("inf"):
        text = format(Decimal(repr(answer)), "f")
    else:
        text = completion_text(answer)
    if not _MATH_DELIMITER.search(text) and "\\boxed" not in text:
        text = "$" + _WORDS.sub(_text_words, text) + "$"
    return text


def math_verify(prompt: str, completion: str, answer: Any = None, **row: Any) -> float:
    """1.0 when the completion's final answer (``\\boxed{}`` first, else the last expression) equals
    the reference ``answer`` (its :func:`completion_text`, so TRL's conversational completion is its
    text) mathematically (``1/2`` = ``0.5`` = ``\\frac{1}{2}``), else 0.0."""
    if answer is None:  # before the import: a missing answer is the row's fault, whatever is installed
        raise ValueError(
            "math_verify: the row's answer is missing or null: set data.answer_key to the reference answer field, "
            "or give the row an answer"
        )
    from math_verify import parse, verify

    timeout = PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_text = reference_text(answer)
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the reference answer {gold_text[:80]!r}")
    pred = parse(completion, parsing_timeout=timeout)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=timeout))


math_verify.areno_sandbox = True  # type: ignore[attr-defined]
math_verify.areno_needs_answer = True  # type: ignore[attr-defined]
