"""What a dataset row's messages and reference answers must look like, and the answer's text: read
by the data checks, supervised batches and the shipped rewards, which run in sandbox workers that
need neither a tokenizer nor transformers (hence this module, apart from ``prompts``)."""

from __future__ import annotations

from typing import Any

from areno.errors import DataError


def message_list_problem(prompt: object) -> str | None:
    """What is wrong with a message-list prompt (None: a list of {role: str, content: str})."""
    if not prompt:
        return "the message list is empty"
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is not an object with string 'role' and 'content' ({m!r:.80})"
    return None


def completion_problem(answer: object) -> str | None:
    """What keeps a row's reference answer from being a supervised target (None: a string, a number, or
    TRL's conversational completion, a list of assistant messages)."""
    if not isinstance(answer, list):
        return None
    problem = message_list_problem(answer)
    if problem is None and any(m["role"] != "assistant" for m in answer):
        problem = "a message is not the assistant's"
    return (
        None if problem is None else f"the answer is a message list but {problem} (a completion is assistant messages)"
    )


def completion_text(answer: Any) -> str:
    """The text a supervised recipe trains on for a row's reference answer: a string (a number as its
    text), or the contents of TRL's conversational completion (assistant messages) one after another."""
    problem = completion_problem(answer)
    if problem is not None:
        raise DataError(problem)
    return "".join(m["content"] for m in answer) if isinstance(answer, list) else str(answer)
