"""Rewards of the shipped tasks.

A reward function has the signature ``fn(prompt: str, completion: str, answer, **row) -> float``
(``row`` holds the other fields of the data row). Users replace it with ``reward.fn=pkg.mod:func``.
"""

from __future__ import annotations

from areno.data.messages import completion_text
from areno.data.tasks import extract_answer


def exact_match(prompt: str, completion: str, answer, **row) -> float:
    """1.0 when the completion's first line equals the reference answer (a string, a number, or TRL's
    conversational completion: the text SFT trains on, :func:`completion_text`), else 0.0. A reference
    of several lines is compared with as many first lines of the completion, each stripped of spaces."""
    if answer is None:  # str(None) would make the completion "None" correct
        raise ValueError(
            "exact_match: the row's answer is missing or null: set data.answer_key to the reference answer field, "
            "or give the row an answer"
        )
    reference = completion_text(answer).strip()
    if "\n" not in reference:
        return float(extract_answer(completion) == reference)
    lines = reference.split("\n")
    got = completion.strip().split("\n")[: len(lines)]
    return float([line.strip() for line in got] == [line.strip() for line in lines])


exact_match.areno_sandbox = False  # pure string comparison: bounded, safe in-process (reward.sandbox auto)
exact_match.areno_needs_answer = True  # rows without one are refused before the run (preflight)
