"""Loading prompts: shipped synthetic tasks or a user's JSONL / Parquet file.

Every row is checked for the prompt field before training starts, so a malformed file fails with
one line (a :class:`~areno.errors.DataError`) naming the file, the line (JSONL) or row (JSON list,
Parquet) and the field. Preference recipes (``pairs``) read TRL's preference rows: ``prompt``
(``data.prompt_key``), ``chosen`` and ``rejected`` (``PAIR_KEYS``), each completion a non-empty
string or a list of assistant messages (TRL's conversational format). The other recipes read a
prompt and its reference answer; two of TRL's layouts give them otherwise and are read as such rows
(``answer_field``): a ``messages`` conversation (the prompt the messages before its last assistant
ones, the answer those); and a warm start on preference rows trains on their ``chosen`` completion
(``warm_start_answer_key``).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
from pathlib import Path

from areno.data.messages import completion_problem, completion_text, message_list_problem
from areno.data.tasks import TaskSpec, generate_rows
from areno.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

PAIR_KEYS = ("chosen", "rejected")
"""The fields of a preference row holding its preferred and its dispreferred completion (TRL's names)."""
CONVERSATION_KEY = "messages"
"""The field of TRL's conversational rows: one whole conversation, a list of ``{role, content}`` messages."""


def load_rows(
    path: str | Path,
    *,
    prompt_key: str,
    answer_key: str | None = None,
    pairs: bool = False,
    answer_field: str | None = None,
    key: str | None = None,
) -> list[dict]:
    """Rows of a ``.jsonl`` / ``.json`` (list) / ``.parquet`` file, validated: each an object with a
    ``prompt_key`` field holding a string or a list of ``{"role", "content"}`` messages and, when
    ``answer_key`` is given (supervised recipes train on it), an ``answer_key`` field; with ``pairs``
    (preference recipes), ``chosen`` and ``rejected`` fields (``PAIR_KEYS``), each a non-empty string
    or a list of assistant messages.

    Without ``pairs``, a row of TRL's conversational layout (``messages`` and no ``prompt_key``) is
    read as its prompt, the messages before the last assistant ones, under ``prompt_key``, and its
    answer, those assistant messages, under ``answer_field`` (default ``answer_key``; ``messages``
    dropped), as TRL's SFT reads it.

    A bad row is named by its 1-based line number in a ``.jsonl`` file (``file line N: ...``, blank
    lines counted, as an editor shows them) and by its 0-based index in a ``.json`` list or a
    ``.parquet`` table (``file row i: ...``). Every problem is a one-line :class:`DataError`; a missing
    file's names ``key``, the setting that gave it (``data.train_path``, ``data.eval_path``).
    """
    path = Path(path)
    rows, where = _read_rows(path, key=key)
    answer_field = answer_field or answer_key
    for i, (row, name) in enumerate(zip(rows, where)):
        if answer_field is not None and not pairs and isinstance(row, dict) and prompt_key not in row:
            row = _from_conversation(row, prompt_key, answer_field)
            if isinstance(row, str):
                raise DataError(f"{path} {name}: {row}")
            rows[i] = row
        problem = _row_problem(row, prompt_key, answer_key)
        if problem is None and pairs:
            problem = _pair_problem(row)
        if problem is not None:
            raise DataError(f"{path} {name}: {problem}")
    return rows


def _read_rows(path: Path, *, key: str | None = None) -> tuple[list, list[str]]:
    """The file's rows as parsed, and how an error names each (``line N``, ``row i``); a file that does
    not parse or does not exist, a one-line DataError (naming ``key``, the setting that gave the path)."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        if key is None:
            raise DataError(f"dataset file {path} {what}: set data.train_path / data.eval_path to a data file")
        shards = f", or a pattern of its files such as {path / '*.parquet'}" if path.is_dir() else ""
        raise DataError(f"{key}: dataset file {path} {what}: set {key} to a .jsonl, .json or .parquet file{shards}")
    where: list[str]  # how each row is named in an error
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as exc:  # ArrowInvalid: not a parquet file, truncated, corrupt
            raise DataError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
        where = [f"row {i}" for i in range(len(rows))]
    elif path.suffix == ".json":
        try:
            rows = json.loads(_read_text(path))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rows, list):
            raise DataError(
                f"{path}: a .json dataset must be a list of objects, got a {type(rows).__name__} "
                f"(or write one object per line as .jsonl)"
            )
        where = [f"row {i}" for i in range(len(rows))]
    elif path.suffix == ".jsonl":
        rows, where = [], []
        for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
            where.append(f"line {lineno}")
    else:
        raise DataError(f"dataset file {path}: unsupported suffix {path.suffix!r}; use .jsonl, .json or .parquet")
    return rows, where


def data_files(value: str | list[str], *, key: str) -> list[Path]:
    """The files a ``data.train_path`` setting names (``key``, for errors): one path, a glob pattern (its files
    in name order), or a list of those, in the order given. A pattern that matches no file is a DataError
    naming it; a path that is no file is left for :func:`load_rows` to name."""
    files = []
    for item in value if isinstance(value, list) else [value]:
        if not glob.has_magic(item):
            files.append(Path(item))
            continue
        matched = sorted(p for p in glob.glob(item, recursive=True) if Path(p).is_file())
        if not matched:
            raise DataError(f"{key}: the pattern {item} matches no file: check the directory and the pattern")
        files.extend(Path(p) for p in matched)
    return files


def shown_paths(value: str | list[str]) -> str:
    """A ``data.train_path`` / ``eval_path`` setting as a message shows it: its paths, comma-separated."""
    return ", ".join(value) if isinstance(value, list) else value


def load_files(value: str | list[str], *, key: str, **read) -> list[dict]:
    """The rows of every file :func:`data_files` names, in its order, each file read by :func:`load_rows`
    (``read``: its arguments); with several files, a file that holds no row is a DataError naming it."""
    files = data_files(value, key=key)
    rows = []
    for path in files:
        part = load_rows(path, key=key, **read)
        if not part and len(files) > 1:
            raise DataError(f"{key}: dataset file {path} holds no rows: remove it from the list or add rows")
        rows.extend(part)
    return rows


def row_source(value: str | list[str], index: int, *, key: str) -> str:
    """Where row ``index`` of the rows :func:`load_files` read comes from, as a load error names it: ``FILE line N``
    (a ``.jsonl`` file's line, as an editor counts them), else ``FILE row i`` (0-based within its file). Reads the
    files again: for an error's message only."""
    for path in data_files(value, key=key):
        where = _read_rows(path, key=key)[1]
        if index < len(where):
            return f"{path} {where[index]}"
        index -= len(where)
    raise IndexError(f"{key} holds no row {index}")


def held_out_row_source(data_cfg, index: int) -> str:
    """Where held-out row ``index`` (of :func:`build_splits`' held-out rows) comes from, as :func:`row_source` names
    it. Reads the files again: for an error's message only."""
    read = {"prompt_key": data_cfg.prompt_key, "answer_field": data_cfg.answer_key}
    for path, rows in held_out_files(data_cfg, **read):
        if index < len(rows):
            return f"{path} {_read_rows(path, key='data.eval_path')[1][index]}"
        index -= len(rows)
    raise IndexError(f"data.eval_path holds no held-out row {index}")


def _first_row(path: Path) -> object:
    """The file's first row (None: it has none), a ``.jsonl`` file's read without the lines after it."""
    if path.suffix == ".jsonl" and path.is_file():
        with path.open(encoding="utf-8-sig") as f:  # a byte-order mark some editors write is no JSON
            line = next((line for line in f if line.strip()), None)
        try:
            return None if line is None else json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON ({exc.msg})") from None
    rows, _ = _read_rows(path)
    return rows[0] if rows else None


def warm_start_answer_key(data_cfg) -> str:
    """The answer field a supervised warm start trains on: ``data.answer_key``, except for a file of TRL
    preference rows (``prompt``, ``chosen``, ``rejected``; read from its first row) without one while
    the key is left at its default: ``chosen``, the preferred completion (what ``data.answer_key=chosen``
    would name). A file that does not read keeps the key (preflight names its problem)."""
    key = data_cfg.answer_key
    if data_cfg.task is not None or data_cfg.train_path is None or key != _default(data_cfg, "answer_key"):
        return key
    try:
        row = _first_row(data_files(data_cfg.train_path, key="data.train_path")[0])
    except (DataError, UnicodeDecodeError):
        return key
    return PAIR_KEYS[0] if _is_preference_row(row, data_cfg.prompt_key) and key not in row else key


def _from_conversation(row: dict, prompt_key: str, answer_field: str) -> dict | str:
    """A TRL conversational row (``messages``, no ``prompt_key``) as a prompt/answer row: the prompt the
    messages before the last assistant ones, the answer those assistant messages (TRL's SFT trains on
    them; the prompt's earlier assistant turns are context). Another row is returned as it is; a
    conversation that cannot be split, the problem and its fix."""
    messages = row.get(CONVERSATION_KEY)
    if not isinstance(messages, list):
        return row
    problem = message_list_problem(messages)
    if problem is not None:
        return f"{CONVERSATION_KEY!r} is a message list but {problem} (each message needs string 'role' and 'content')"
    split = len(messages)
    while split > 0 and messages[split - 1]["role"] == "assistant":
        split -= 1
    if split == len(messages):
        return (
            f"{CONVERSATION_KEY!r} has no assistant turn at its end (its last message is the "
            f"{messages[-1]['role']!r}'s): a conversation row's completion is its last assistant message(s); "
            f"end it with the assistant's reply, or give a prompt without one as {prompt_key!r}"
        )
    if split == 0:
        return (
            f"{CONVERSATION_KEY!r} holds only assistant messages: a conversation row's prompt is the messages "
            "before its last assistant one(s); begin it with the user's turn"
        )
    if answer_field in row:
        return (
            f"both {CONVERSATION_KEY!r}, whose last assistant message(s) are the row's answer, and "
            f"{answer_field!r}: keep one, or give the prompt as {prompt_key!r}"
        )
    rest = {k: v for k, v in row.items() if k != CONVERSATION_KEY}
    return {**rest, prompt_key: messages[:split], answer_field: messages[split:]}


def _is_preference_row(row: object, prompt_key: str) -> bool:
    """A TRL preference row: an object with a prompt and both ``PAIR_KEYS``."""
    return isinstance(row, dict) and prompt_key in row and all(k in row for k in PAIR_KEYS)


def _row_problem(row: object, prompt_key: str, answer_key: str | None) -> str | None:
    """What is wrong with one row, and the fix (None: nothing)."""
    fix = "set data.prompt_key to the field that holds the prompt"
    if not isinstance(row, dict):  # no field to name: the fix is the row's shape
        return (
            f"no string field {prompt_key!r} (the row is a JSON {_json_type(row)}, not an object; write each row as "
            f"an object holding its fields, {{{prompt_key!r}: ...}})"
        )
    fields = ", ".join(map(repr, list(row)[:8])) or "none"
    if prompt_key not in row and isinstance(row.get(PAIR_KEYS[0]), list):
        return (
            f"no field {prompt_key!r}: TRL's implicit-prompt preference rows (the prompt inside "
            f"{PAIR_KEYS[0]!r} and {PAIR_KEYS[1]!r}) are not read: move the shared opening messages into a "
            f"{prompt_key!r} field (or set data.prompt_key to the field that holds the prompt)"
        )
    if prompt_key not in row and isinstance(row.get(CONVERSATION_KEY), list):  # preference recipes
        return (
            f"no field {prompt_key!r}, only {CONVERSATION_KEY!r} (TRL's conversational layout, one conversation a "
            f"row), but preference recipes read TRL's preference rows: {{{prompt_key!r}, 'chosen', 'rejected'}}"
        )
    if prompt_key not in row:
        return f"no string field {prompt_key!r} (fields are {fields}; {fix})"
    prompt = row[prompt_key]
    if isinstance(prompt, list):
        problem = message_list_problem(prompt)
        if problem is not None:
            return f"{prompt_key!r} is a message list but {problem} (each message needs string 'role' and 'content')"
    elif not isinstance(prompt, str):
        return f"no string field {prompt_key!r} ({prompt_key!r} is {_json_type(prompt)}, not a string; {fix})"
    elif not prompt.strip():
        what = "an empty string" if not prompt else "whitespace only"
        return f"{prompt_key!r} is {what}: give the row a prompt or remove it"
    if answer_key is not None and answer_key not in row and "completion" in row:  # named, never taken silently
        return (
            f"no field {answer_key!r} but a 'completion' (TRL's prompt/completion layout): "
            "set data.answer_key=completion"
        )
    if answer_key is not None and answer_key not in row:
        return (
            f"no field {answer_key!r}: the reference answer, which supervised training and answer-scoring "
            f"rewards (a reward.fn whose answer argument has no default) need (fields are {fields}; set "
            "data.answer_key to the field that holds it)"
        )
    if answer_key is not None:
        return completion_problem(row[answer_key]) or _blank_answer_problem(row[answer_key], answer_key)
    return None


def _blank_answer_problem(answer: object, answer_key: str) -> str | None:
    """A null or empty reference answer (None: it has text): SFT would train on the text "None" or on EOS
    alone, and an answer-scoring reward would score against nothing."""
    if answer is None:
        return f"{answer_key!r} is null: give the row its reference answer, or remove the row"
    if completion_text(answer).strip() == "":
        return f"{answer_key!r} is empty: give the row its reference answer, or remove the row"
    return None


def _pair_problem(row: dict) -> str | None:
    """What keeps a row (a dict with a good prompt) from being a preference pair (None: nothing)."""
    for key, what in zip(PAIR_KEYS, ("preferred", "dispreferred")):
        if key not in row:
            fields = ", ".join(map(repr, list(row)[:8]))
            return (
                f"no field {key!r}: the {what} completion, which preference recipes (dpo, reward_model) train on "
                f"(fields are {fields}; a row is TRL's {{prompt, chosen, rejected}})"
            )
        value = row[key]
        if isinstance(value, list):
            problem = message_list_problem(value)
            if problem is None and any(m["role"] != "assistant" for m in value):
                problem = "a message is not the assistant's"
            if problem is not None:
                return f"{key!r} is a message list but {problem} (a completion is a string or assistant messages)"
            text = "".join(m["content"] for m in value)
        elif isinstance(value, str):
            text = value
        else:
            kind = _json_type(value)
            kind = kind if value is None else f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"
            return f"{key!r} is {kind}, not a string or a list of assistant messages: give the {what} completion"
        if not text.strip():
            return f"{key!r} is empty: a pair needs two non-empty completions; fill it in or remove the row"
    return None


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; a file in another encoding is a DataError naming it and the byte."""
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark some editors write is no JSON
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): "
            "convert the file to UTF-8 (e.g. iconv -t UTF-8)"
        ) from None


def _json_type(value: object) -> str:
    """JSON's name for ``value``'s type (``null``, ``number``, ``array`` ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def build_splits(
    data_cfg, *, need_answers: bool = False, eval_answers: bool = False, pairs: bool = False
) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for a ``DataSection``; rows use the configured keys.
    ``need_answers``: every training row must hold ``data.answer_key`` (supervised recipes train on it,
    and some rewards score against it); ``eval_answers``: every held-out row too (such a reward);
    ``pairs``: every row of both files is a preference pair (preference recipes; a shipped task,
    which makes prompt/answer rows, is a ConfigError)."""
    if pairs:
        _check_pair_source(data_cfg)
    if data_cfg.task is not None:
        spec = TaskSpec(name=data_cfg.task, kwargs=dict(data_cfg.task_kwargs))
        train = generate_rows(spec, split="train", num=20_000, seed=data_cfg.seed)
        held_out = generate_rows(spec, split="eval", num=data_cfg.num_eval, seed=data_cfg.seed)
        if data_cfg.prompt_key != "prompt" or data_cfg.answer_key != "answer":
            remap = lambda r: {  # other fields (a row's images) stay as they are
                **{k: v for k, v in r.items() if k not in ("prompt", "answer")},
                data_cfg.prompt_key: r["prompt"],
                data_cfg.answer_key: r["answer"],
            }
            train, held_out = [remap(r) for r in train], [remap(r) for r in held_out]
        return train, held_out
    answer_key = data_cfg.answer_key if need_answers else None
    # a conversation gives its answer under data.answer_key whether or not this recipe needs it: the
    # engine and `areno eval` load the rows without asking for answers, and must see the same ones
    read = {"prompt_key": data_cfg.prompt_key, "pairs": pairs, "answer_field": data_cfg.answer_key}
    train = load_files(data_cfg.train_path, answer_key=answer_key, key="data.train_path", **read)
    if not train:
        raise DataError(
            f"dataset file {shown_paths(data_cfg.train_path)} holds no rows: data.train_path needs training prompts"
        )
    held_out = []
    if data_cfg.eval_path is not None:
        eval_answer_key = data_cfg.answer_key if eval_answers else None
        for _, rows in held_out_files(data_cfg, answer_key=eval_answer_key, **read):
            held_out.extend(rows)
        _warn_shared_prompts(data_cfg, train, held_out, pairs=pairs)
    return train, held_out


def held_out_files(data_cfg, **read) -> list[tuple[Path, list[dict]]]:
    """Each file of ``data.eval_path`` (:func:`data_files`) with its first ``data.num_eval`` rows, in order
    (``read``: :func:`load_rows`'s arguments); a file without rows is a DataError naming it."""
    out = []
    for path in data_files(data_cfg.eval_path, key="data.eval_path"):
        rows = load_rows(path, key="data.eval_path", **read)
        if not rows:
            raise DataError(f"dataset file {path} holds no rows: data.eval_path needs held-out prompts, or unset it")
        out.append((path, rows[: data_cfg.num_eval]))
    return out


def eval_sources(data_cfg) -> list[tuple[str, int]]:
    """``(name, rows)`` of each held-out file in the order :func:`build_splits` reads them, when
    ``data.eval_path`` names several (a list, or a pattern that matches more than one): the held-out figures
    are then also given per file, ``eval/<name>/...``. The name is the file's stem (a second file of one stem
    ``<stem>_2``; ``reward``, the namespace of the reward's own figures, ``reward_data``). [] otherwise."""
    if not several_held_out_files(data_cfg):  # one file: not read again
        return []
    return source_names(held_out_files(data_cfg, prompt_key=data_cfg.prompt_key, answer_field=data_cfg.answer_key))


def several_held_out_files(data_cfg) -> bool:
    """Whether ``data.eval_path`` names more than one file (a list, or a pattern that matches several)."""
    if data_cfg.task is not None or data_cfg.eval_path is None:
        return False
    return len(data_files(data_cfg.eval_path, key="data.eval_path")) > 1


def source_names(files: list[tuple[Path, list[dict]]]) -> list[tuple[str, int]]:
    """``(name, rows)`` of :func:`held_out_files`' files, named as :func:`eval_sources` says."""
    out: list[tuple[str, int]] = []
    for path, rows in files:
        stem = "reward_data" if path.stem == "reward" else path.stem
        name, k = stem, 1
        while name in {n for n, _ in out}:
            k += 1
            name = f"{stem}_{k}"
        out.append((name, len(rows)))
    return out


_SHARED_SAID: set[tuple] = set()
"""The file pairs whose shared prompts were told in this process (preflight and the engine both read them)."""


def _warn_shared_prompts(data_cfg, train: list[dict], held_out: list[dict], *, pairs: bool = False) -> None:
    """One warning when held-out rows are also training rows: they would be trained on and still counted as held
    out (a shipped task's splits are disjoint by construction). A row is its prompt, a preference row its whole
    pair (one prompt with other completions is another pair)."""
    said = (str(data_cfg.train_path), str(data_cfg.eval_path), data_cfg.num_eval, data_cfg.prompt_key, pairs)
    if said in _SHARED_SAID:
        return
    _SHARED_SAID.add(said)
    fields = (data_cfg.prompt_key, *PAIR_KEYS) if pairs else (data_cfg.prompt_key,)

    def key(row: dict) -> str:  # a prompt may be a string or a message list
        return json.dumps([row.get(f) for f in fields], sort_keys=True)

    trained = {key(row) for row in train}
    shared = sum(key(row) in trained for row in held_out)
    if shared:
        what = "pairs" if pairs else "prompts"
        logger.warning(
            "data.eval_path %s: %d of its %d held-out %s are also training %s of data.train_path %s: "
            "they are trained on and still counted as held out; remove them from one of the files",
            shown_paths(data_cfg.eval_path),
            shared,
            len(held_out),
            what,
            what,
            shown_paths(data_cfg.train_path),
        )


def _default(data_cfg, key: str) -> object:
    """The default of the data section's setting ``key`` (a dataclass field)."""
    return next(f.default for f in dataclasses.fields(data_cfg) if f.name == key)


def _check_pair_source(data_cfg) -> None:
    """Preference pairs come from files: a ConfigError for a shipped task (prompt/answer rows)."""
    if data_cfg.task is not None:
        raise ConfigError(
            f"data.task={data_cfg.task!r} makes prompt/answer rows, but the recipe (train.algorithm) trains on "
            "preference pairs: set data.task=null and data.train_path to a file of {prompt, chosen, rejected} rows"
        )


def check_splits(
    data_cfg, *, need_answers: bool = False, eval_answers: bool = False, pairs: bool = False
) -> tuple[list[dict], list[dict]] | None:
    """Raise what :func:`build_splits` would raise (a :class:`DataError` or :class:`ConfigError`),
    without generating a shipped task's rows: the check before anything expensive starts. Returns a
    file's splits (None for a shipped task, whose rows are well formed by construction)."""
    if pairs:
        _check_pair_source(data_cfg)
    if data_cfg.task is not None:
        TaskSpec(name=data_cfg.task, kwargs=dict(data_cfg.task_kwargs))  # validates the generator's arguments
        return None
    return build_splits(data_cfg, need_answers=need_answers, eval_answers=eval_answers, pairs=pairs)


def check_prompt_forms(data_cfg, splits: tuple[list[dict], list[dict]] | None, *, templated: bool) -> None:
    """Message-list prompts need a chat template: a DataError naming the first such row of a file's
    splits when prompts are not templated (``prompts.uses_template``)."""
    if splits is None or templated:
        return
    for key, rows in (("data.train_path", splits[0]), ("data.eval_path", splits[1])):
        for i, row in enumerate(rows):
            if isinstance(row[data_cfg.prompt_key], list):
                train = key == "data.train_path"
                where = row_source(data_cfg.train_path, i, key=key) if train else held_out_row_source(data_cfg, i)
                raise DataError(
                    f"{where}: {data_cfg.prompt_key!r} is a message list, which needs a chat template, but "
                    f"prompts are not templated (data.chat_template={data_cfg.chat_template}, or a tokenizer without "
                    "one): use data.chat_template=always with a templated tokenizer, or string prompts"
                )
