"""Shipped synthetic task family with verifiable answers.

Each task is a seeded generator of rows ``{"prompt": str, "answer": str}``. The train and held-out
splits are disjoint: a row belongs to the held-out split when a stable hash of its prompt falls in
the held-out bucket, so no held-out prompt is ever trained on, whatever the seeds.

Prompts are plain text the model continues (``"57+68="`` → ``"125"``), so tiny character-level
models learn them on a CPU in minutes. ``count_squares`` is the vision-language task: its rows carry
one image (``images``: a base64 PNG) of red squares on black, the answer is how many.
"""

from __future__ import annotations

import base64
import difflib
import functools
import hashlib
import inspect
import io
import itertools
import json
import random
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from areno.errors import ConfigError, DataError, is_of_type, wrong_type

HELD_OUT_BUCKETS = 10  # 1 in 10 prompts is held out


def _is_held_out(prompt: str) -> bool:
    digest = hashlib.sha256(prompt.encode()).digest()
    return digest[0] % HELD_OUT_BUCKETS == 0


def _arithmetic(rng: random.Random, *, min_digits: int = 1, max_digits: int = 2, ops: str = "+") -> dict:
    digits_a = rng.randint(min_digits, max_digits)
    digits_b = rng.randint(min_digits, max_digits)
    a = rng.randint(0, 10**digits_a - 1)
    b = rng.randint(0, 10**digits_b - 1)
    op = rng.choice(ops)
    if op == "-" and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": f"{a}{op}{b}=", "answer": str(value)}


def _reverse(rng: random.Random, *, min_len: int = 3, max_len: int = 6, alphabet: str = "abcdefgh") -> dict:
    word = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
    return {"prompt": f"reverse {word}:", "answer": word[::-1]}


def _sort(rng: random.Random, *, min_len: int = 3, max_len: int = 6) -> dict:
    digits = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(min_len, max_len)))
    return {"prompt": f"sort {digits}:", "answer": "".join(sorted(digits))}


def _count_squares(
    rng: random.Random, *, size: int = 16, cell: int = 8, min_count: int = 1, max_count: int = 3
) -> dict:
    """A ``size``×``size`` image with ``min_count``..``max_count`` (uniform) red ``cell``-pixel
    squares on black, each in its own cell of the grid and of a random shade (so every count has
    many distinct images), and the prompt ``"count:"``; the answer is the count."""
    cells = (size // cell) ** 2
    if not 1 <= min_count <= max_count <= cells:
        raise ValueError(f"count_squares needs 1 <= min_count <= max_count <= {cells} cells")
    n = rng.randint(min_count, max_count)
    squares = [(c, (rng.randint(128, 255), rng.randint(0, 63), 0)) for c in rng.sample(range(cells), n)]
    return {"prompt": "count:", "images": [_squares_png(squares, size, cell)], "answer": str(n)}


def _squares_png(squares: list[tuple[int, tuple[int, int, int]]], size: int, cell: int) -> str:
    """Base64 PNG of squares on black: (cell index, RGB colour) each."""
    from PIL import Image  # imported by this task only

    image = Image.new("RGB", (size, size))
    per_row = size // cell
    for c, colour in squares:
        x, y = (c % per_row) * cell, (c // per_row) * cell
        image.paste(colour, (x, y, x + cell, y + cell))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


ENUMERATE_MAX = 200_000
"""Largest space of distinct rows a task lists whole (``_ALL_ROWS``) instead of sampling it."""

Listing = tuple[int, Iterator[dict]]
"""How many distinct rows a task's generator can draw, and (lazily) all of them."""


def _all_arithmetic(*, min_digits: int = 1, max_digits: int = 2, ops: str = "+") -> Listing:
    # every operand below 10**max_digits can be drawn (a draw of max_digits digits covers them all)
    n, ops = 10**max_digits, "".join(dict.fromkeys(ops))
    values = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    size = sum(n * (n + 1) // 2 if op == "-" else n * n for op in ops)
    rows = (
        {"prompt": f"{a}{op}{b}=", "answer": str(values[op](a, b))}
        for op in ops
        for a in range(n)
        for b in range(a + 1 if op == "-" else n)  # "-" swaps its operands so that a >= b
    )
    return size, rows


def _all_strings(min_len: int, max_len: int, alphabet: str) -> tuple[int, Iterator[str]]:
    alphabet, lengths = "".join(dict.fromkeys(alphabet)), range(max(min_len, 0), max_len + 1)
    size = sum(len(alphabet) ** k for k in lengths)
    return size, ("".join(t) for k in lengths for t in itertools.product(alphabet, repeat=k))


def _all_reverse(*, min_len: int = 3, max_len: int = 6, alphabet: str = "abcdefgh") -> Listing:
    size, words = _all_strings(min_len, max_len, alphabet)
    return size, ({"prompt": f"reverse {w}:", "answer": w[::-1]} for w in words)


def _all_sort(*, min_len: int = 3, max_len: int = 6) -> Listing:
    size, digits = _all_strings(min_len, max_len, "0123456789")
    return size, ({"prompt": f"sort {d}:", "answer": "".join(sorted(d))} for d in digits)


_ALL_ROWS: dict[str, Callable[..., Listing]] = {
    "arithmetic": _all_arithmetic,
    "reverse": _all_reverse,
    "sort": _all_sort,
}
"""Per task: every distinct row its generator can draw (tasks without an entry are never listed)."""


TASKS: dict[str, Callable[..., dict]] = {
    "arithmetic": _arithmetic,
    "reverse": _reverse,
    "sort": _sort,
    "count_squares": _count_squares,
}


def task_arguments(name: str) -> dict[str, Any]:
    """The keyword arguments shipped task ``name`` takes (``data.task_kwargs``), with their types."""
    generator = TASKS[name]
    hints = typing.get_type_hints(generator)
    params = inspect.signature(generator).parameters.values()
    return {p.name: hints[p.name] for p in params if p.kind is p.KEYWORD_ONLY}


def row_key(row: dict) -> str:
    """What makes a row distinct (and decides its split): the prompt, and its images when it has any."""
    images = row.get("images")
    return row["prompt"] if not images else row["prompt"] + "\0" + "\0".join(map(str, images))


@dataclass(kw_only=True)
class TaskSpec:
    """A shipped task and its generator arguments."""

    name: str
    """Key of TASKS."""
    kwargs: dict
    """Generator keyword arguments (e.g. max_digits for arithmetic)."""

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            close = difflib.get_close_matches(str(self.name), list(TASKS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"data.task: unknown task {self.name!r}{hint}; shipped tasks: {sorted(TASKS)}")
        types = task_arguments(self.name)
        for key, value in self.kwargs.items():
            if key not in types:
                close = difflib.get_close_matches(str(key), list(types), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"data.task_kwargs: task {self.name!r} takes no argument {key!r}{hint}; it takes {', '.join(types)}"
                )
            if not is_of_type(value, types[key]):
                raise wrong_type(f"data.task_kwargs.{key}", types[key], value)
        try:
            TASKS[self.name](random.Random(0), **self.kwargs)
        except (TypeError, ValueError) as exc:  # an unknown argument, or a value the generator cannot use
            raise ConfigError(f"data.task_kwargs: {exc}") from None


def generate_rows(spec: TaskSpec, *, split: str, num: int, seed: int) -> list[dict]:
    """``num`` distinct rows of ``split`` ('train' or 'eval'), deterministic in ``seed``.

    If the task has fewer distinct prompts than asked for, returns all of them in a seeded order
    when the task can list them (arithmetic, sort and reverse with small ranges: a search would draw
    ``50 * num`` times to find them, seconds at start-up), else all it found after a bounded search.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    # The eval split ignores the seed so that every run is compared on the same held-out prompts.
    rng = random.Random(f"{spec.name}/{split}/{seed if split == 'train' else 0}")
    lister = _ALL_ROWS.get(spec.name)
    if lister is not None:
        size, listed = lister(**spec.kwargs)
        share = 1 / HELD_OUT_BUCKETS if split == "eval" else 1 - 1 / HELD_OUT_BUCKETS
        if size <= ENUMERATE_MAX and size * share <= 2 * num:  # the search would be slow
            rows = [row for row in listed if _is_held_out(row_key(row)) == (split == "eval")]
            if len(rows) <= num:
                rng.shuffle(rows)
                return rows
    rows, seen = [], set()
    for _ in range(num * 50):
        row = TASKS[spec.name](rng, **spec.kwargs)
        key = row_key(row)
        if key in seen or _is_held_out(key) != (split == "eval"):
            continue
        seen.add(key)
        rows.append(row)
        if len(rows) == num:
            break
    return rows


def extract_answer(completion: str) -> str:
    """The answer is the completion up to the first newline, stripped of spaces."""
    return completion.split("\n", 1)[0].strip()


STREAM_VERSION = 3
"""How :class:`PromptStream` orders rows, kept in its state so that a resumed run keeps its checkpoint's order.
1: epoch e shuffled by ``random.Random(seed * 1_000_003 + e)`` (seeds -s and s alike: an int seeds by its
absolute value). 2: shuffled by a string of the seed, the stage and the epoch (every seed and stage its own
order), and a batch that straddles two epochs holds no row twice (``swaps``). 3: 2, and a batch its consumer
marks (``begin_batch``: a synchronous step, which dynamic sampling may make longer than ``batch_size``) holds
no row twice either, wherever it starts and however many rows it takes."""


class PromptStream:
    """An endless, seeded, resumable stream of training rows: a new shuffle each epoch.

    ``state_dict()`` holds (epoch, position), the cursor of rows actually handed out, the rows' count and
    fingerprint, which a resumed stream must match (a data file rewritten in place would be read from the old
    cursor), the ordering rule's ``version`` (``STREAM_VERSION``; a checkpoint without one has version 1) and the
    ``swaps`` that made the current epoch's order from its shuffle, and the ``stage``.

    ``batch_size``: the rows a step takes (``take(batch_size)``, or as many ``take(1)``), counted from the start
    of the stream. When an epoch ends inside a batch, the rows of the new epoch that batch would take again are
    swapped with the next rows of the new epoch it does not hold: later in the epoch, still once each. With
    ``batch_size`` above the number of rows a batch holds rows more than once whatever the order.

    ``begin_batch()``: the rows taken from here to the next call are one batch (a synchronous step's, of any
    length): a row it already holds is swapped with the next row of the epoch it does not (rule 3), so that
    only a batch longer than the rows holds one twice.

    ``stage``: which stage of a run of several the stream feeds; each stage has an order of its own, so that
    the stage after a warm start does not retrace the warm start's rows. A resumed stream keeps its
    checkpoint's stage. ``shuffle=False``: every epoch takes the rows in their order (no stage, no seed).
    """

    def __init__(
        self, rows: list[dict], *, seed: int, batch_size: int = 1, stage: str = "", shuffle: bool = True
    ) -> None:
        if not rows:
            raise DataError("the training dataset is empty: check data.train_path or data.task")
        if batch_size < 1:
            raise ValueError(f"PromptStream batch_size must be >= 1, got {batch_size}")
        self._rows = rows
        self._seed = seed
        self._batch_size = batch_size
        self._stage = stage
        self._shuffled = shuffle
        self._version = STREAM_VERSION
        self.epoch = 0
        self.position = 0
        self._swaps: list[tuple[int, int]] = []
        self._order = self._shuffle(0)
        self._batch_rows: set[int] | None = None  # the rows of the batch begin_batch began (None: not marked)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if not self._shuffled:
            return order
        if self._version == 1:  # a checkpoint of an older areno resumes in its own order
            random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        else:  # a string seeds by all of its bytes: data.seed=-1 is not data.seed=1
            stage = f"{self._stage}/" if self._stage else ""
            random.Random(f"areno/data/{self._seed}/{stage}{epoch}").shuffle(order)
        return order

    @property
    def rows(self) -> list[dict]:
        """The rows in their split's order (what :meth:`take_indices` indexes)."""
        return self._rows

    @property
    def epochs_drawn(self) -> float:
        """Passes over the rows handed out so far: the epoch and the share of its rows taken."""
        return self.epoch + self.position / len(self._rows)

    def take(self, n: int) -> list[dict]:
        return [self._rows[i] for i in self.take_indices(n)]

    def take_indices(self, n: int) -> list[int]:
        """The next ``n`` rows as places in :attr:`rows` (what an offline recipe's per-row cache keys)."""
        out = []
        for _ in range(n):
            if self.position == len(self._order):
                self._next_epoch()
            held = self._batch_rows
            if held is not None and self._order[self.position] in held:  # from the epoch before, this batch
                later = next(
                    (j for j in range(self.position + 1, len(self._order)) if self._order[j] not in held), None
                )
                if later is not None:  # none: the batch holds every row already
                    self._swap(self.position, later)
            out.append(self._order[self.position])
            if held is not None:
                held.add(out[-1])
            self.position += 1
        return out

    def begin_batch(self) -> None:
        """The rows taken from here to the next call are one batch, which holds no row twice where the rows
        allow (rule 3; a cursor of rule 1 or 2 keeps its order)."""
        self._batch_rows = set() if self._version >= 3 else None

    def _next_epoch(self) -> None:
        n, previous = len(self._rows), self._order
        self.epoch += 1
        self.position = 0
        self._order = self._shuffle(self.epoch)
        self._swaps = []
        held = self.epoch * n % self._batch_size  # rows of the previous epoch in the batch this one starts
        if self._version == 1 or held == 0 or self._batch_size > n:
            return
        head, tail = self._batch_size - held, set(previous[n - held :])
        later = head  # rows from here on are taken by later batches; `tail` has `held` rows, so one is found
        for i in range(head):
            if self._order[i] in tail:
                while self._order[later] in tail:
                    later += 1
                self._swap(i, later)
                later += 1

    def _swap(self, i: int, j: int) -> None:
        self._order[i], self._order[j] = self._order[j], self._order[i]
        self._swaps.append((i, j))

    def __iter__(self) -> Iterator[dict]:
        while True:
            yield from self.take(1)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "rows": len(self._rows),
            "fingerprint": self.fingerprint,
            "version": self._version,
            "swaps": [list(pair) for pair in self._swaps],
            "stage": self._stage,
        }

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of up to 1,024 rows spread over the dataset (JSON values; others by type name, so images
        hash alike in every process)."""
        n = len(self._rows)
        picked = sorted({i * n // 1024 for i in range(min(n, 1024))})
        digest = hashlib.sha1(str(n).encode())
        for i in picked:
            digest.update(json.dumps(self._rows[i], sort_keys=True, default=lambda o: type(o).__name__).encode())
        return digest.hexdigest()[:16]

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("rows"), state.get("fingerprint")
        if saved[0] is not None and saved != (len(self._rows), self.fingerprint):
            raise DataError(
                f"resume: the training rows are not the checkpoint's ({saved[0]} rows then, {len(self._rows)} now, "
                "or rows changed in place): the data cursor would read other rows; restore the data file as it was, "
                "or start over (resume=false overwrite=true) or in another run_dir"
            )
        version = int(state.get("version", 1))
        if version not in (1, 2, STREAM_VERSION):
            raise DataError(
                f"resume: the checkpoint's data cursor orders rows by rule {version}, which this areno does not "
                f"know (it knows 1 to {STREAM_VERSION}): resume with the areno that wrote it, or start over "
                "(resume=false overwrite=true) or in another run_dir"
            )
        self._version, self._stage = version, str(state.get("stage", ""))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order, self._swaps, self._batch_rows = self._shuffle(self.epoch), [], None
        for i, j in state.get("swaps", []):
            self._swap(int(i), int(j))
