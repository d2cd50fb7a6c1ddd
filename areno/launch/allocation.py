"""``allocation_mode``: a one-line description of where every role runs.

Grammar (``allocation.lark``)::

    areno[rollout]:d4t2 + fsdp[actor]:d8        # disaggregated: 8 rollout devices, then 8 train devices
    areno:d1t2 | fsdp:d2                        # colocated: both roles share the same 2 devices

A *component* is ``backend[role]:dims``. ``dims`` are counts of data (``d``), tensor (``t``) and
pipeline (``p``) parallelism in any order, each at most once, missing ones meaning 1; the
component's world size is ``d * t * p``. ``p`` is reserved on backends without pipeline
parallelism (``p1`` is accepted there, more is an error). ``e`` (expert parallelism of a
mixture-of-experts model, training only) splits the experts over ``e`` of the ``d`` data-parallel
ranks: it must divide ``d`` and does not add devices. ``c`` (context parallelism, training only)
likewise groups ``c`` of the ``d`` data-parallel ranks to share each packed micro-batch, each
running the layers on 1/c of its tokens: it must divide ``d`` and adds no devices. On ``fsdp``, ``e``
and ``c`` each rule out ``t`` and each other (``fsdp:d4e2t2`` is refused, naming ``fsdp:d8e2`` and
``fsdp:d4t2``). The role defaults to ``rollout`` for inference backends and ``actor`` for training backends.

``+`` *disaggregates*: each ``+``-separated group gets its own consecutive device indices.
``|`` *colocates*: the components of a group share one device list, so they must have the same
world size. Device indices are logical: positions within the parent's ``CUDA_VISIBLE_DEVICES``,
exactly like the ``train_devices`` / ``rollout_devices`` lists of the partitioned topology, which
remain the explicit alternative to an allocation string.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lark

from areno.errors import ConfigError

__all__ = [
    "BACKENDS",
    "AllocationMode",
    "AllocationModeError",
    "SERVER_BACKENDS",
    "SUPPORTED_BACKENDS",
    "BackendSpec",
    "Component",
    "build_gpu_allocations",
    "check_supported",
    "inference_backend",
    "map_roles",
    "parse_allocation_mode",
    "role_placements",
]


class AllocationModeError(ConfigError):
    """An allocation string that does not parse or does not fit; the message points at the position."""


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """What the allocation grammar knows about one backend name."""

    kind: Literal["inference", "train"]
    """Inference backends serve rollouts; train backends hold optimizer state."""
    dims: frozenset[str]
    """Parallel dimensions the backend implements; others are reserved (count 1 only)."""

    @property
    def default_role(self) -> str:
        return "rollout" if self.kind == "inference" else "actor"


BACKENDS: dict[str, BackendSpec] = {
    "areno": BackendSpec(kind="inference", dims=frozenset("dt")),
    "sglang": BackendSpec(kind="inference", dims=frozenset("dtp")),
    "vllm": BackendSpec(kind="inference", dims=frozenset("dtp")),
    "fsdp": BackendSpec(kind="train", dims=frozenset("dtec")),
    "megatron": BackendSpec(kind="train", dims=frozenset("dtpe")),
}
"""Backend names accepted in allocation strings. areno's own engines are ``areno`` and ``fsdp``;
vllm and sglang are inference servers of those systems; megatron only parses."""

SUPPORTED_BACKENDS = frozenset({"areno", "fsdp", "vllm", "sglang"})
"""The backends a run can use (``check_supported``); the others (megatron) only parse."""
SERVER_BACKENDS = frozenset({"vllm", "sglang"})
"""Inference backends that are servers of another system (``engine/servers.py``)."""

_DIM_NAMES = {"d": "data", "t": "tensor", "p": "pipeline", "e": "expert", "c": "context"}


@dataclass(frozen=True, kw_only=True)
class Component:
    """One ``backend[role]:dims`` term."""

    backend: str
    """Backend name (a key of ``BACKENDS``)."""
    role: str
    """Role name; defaults to ``rollout`` (inference) or ``actor`` (train)."""
    dp: int = 1
    """Data-parallel size."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size: ranks of the data-parallel dimension the experts are split over."""
    cp: int = 1
    """Context-parallel size: ranks of the data-parallel dimension that share each micro-batch."""
    column: int = field(default=1, compare=False)
    """1-based column of the component in the source string (for error messages)."""

    @property
    def kind(self) -> Literal["inference", "train"]:
        return BACKENDS[self.backend].kind

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        dims = "".join(
            f"{d}{n}"
            for d, n in (("d", self.dp), ("t", self.tp), ("p", self.pp), ("e", self.ep), ("c", self.cp))
            if n > 1
        )
        return f"{self.backend}[{self.role}]:{dims or 'd1'}"


@dataclass(frozen=True, kw_only=True)
class AllocationMode:
    """A parsed allocation string: groups of colocated components, the groups disaggregated."""

    source: str
    """The string as written."""
    groups: tuple[tuple[Component, ...], ...]
    """``+``-separated groups; the components of one group share devices (``|``)."""

    @property
    def components(self) -> tuple[Component, ...]:
        return tuple(c for g in self.groups for c in g)

    @property
    def world_size(self) -> int:
        """Devices needed: the sum over disaggregated groups of the group's world size."""
        return sum(g[0].world_size for g in self.groups)

    def component(self, role: str) -> Component:
        for c in self.components:
            if c.role == role:
                return c
        raise AllocationModeError(
            f"allocation_mode {self.source!r} has no role {role!r}; roles: {[c.role for c in self.components]}"
        )

    def device_lists(self, num_devices: int) -> dict[str, list[int]]:
        """Logical device indices per role: ``+`` groups consecutive, ``|`` members the same list."""
        if self.world_size > num_devices:
            raise AllocationModeError(
                f"allocation_mode {self.source!r} needs {self.world_size} devices but only "
                f"{num_devices} are available; shrink the d/t/p counts or add devices"
            )
        out: dict[str, list[int]] = {}
        start = 0
        for group in self.groups:
            devices = list(range(start, start + group[0].world_size))
            for c in group:
                out[c.role] = list(devices)
            start += group[0].world_size
        return out

    def train_rollout_devices(self, num_devices: int) -> tuple[list[int], list[int]]:
        """``(train_devices, rollout_devices)`` of the partitioned topology.

        Train devices are those of every train-backend component, rollout devices those of the
        inference components (``rollout``, the only inference role ``check_supported`` lets
        through). Colocated strings give equal lists."""
        lists = self.device_lists(num_devices)
        train = sorted({d for c in self.components if c.kind == "train" for d in lists[c.role]})
        rollout = sorted(
            {d for c in self.components if c.kind == "inference" and c.role == "rollout" for d in lists[c.role]}
        )
        if not train or not rollout:
            raise AllocationModeError(
                f"allocation_mode {self.source!r} must name a train backend (fsdp, megatron) and an "
                f"inference backend with role 'rollout' (areno, sglang, vllm) to give train/rollout devices"
            )
        return train, rollout

    @property
    def colocated(self) -> bool:
        """True when some train component shares its devices with an inference component."""
        return any(len({c.kind for c in g}) > 1 for g in self.groups)

    def __str__(self) -> str:
        return "+".join("|".join(str(c) for c in g) for g in self.groups)


# ---------------------------------------------------------------------------------------------
# Parsing


@functools.cache
def _parser() -> lark.Lark:
    grammar = (Path(__file__).with_name("allocation.lark")).read_text()
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False)


_TERMINAL_WORDS = {
    "PLUS": "'+'",
    "VBAR": "'|'",
    "COLON": "':'",
    "LSQB": "'['",
    "RSQB": "']'",
    "DIM": "a dimension such as d2, t2, p2 or e2",
    "BACKEND": "a backend name",
    "ROLE": "a role name",
    "$END": "end of string",
}


def _error(source: str, column: int, message: str) -> AllocationModeError:
    caret = " " * (column - 1) + "^"
    return AllocationModeError(f"invalid allocation_mode at column {column}: {message}\n  {source}\n  {caret}")


def _expected(names: set[str] | frozenset[str]) -> str:
    words = sorted({_TERMINAL_WORDS.get(n, n) for n in names})
    return " or ".join(words) if words else "nothing"


def parse_allocation_mode(source: str) -> AllocationMode:
    """Parse and validate an allocation string; errors are ``AllocationModeError`` with a caret."""
    if not source.strip():
        raise AllocationModeError("allocation_mode is empty; write e.g. 'areno[rollout]:d2+fsdp[actor]:d2'")
    try:
        tree = _parser().parse(source)
    except lark.UnexpectedCharacters as e:
        raise _error(
            source, e.column, f"unexpected {source[e.pos_in_stream]!r}, expected {_expected(e.allowed)}"
        ) from None
    except lark.UnexpectedEOF as e:
        raise _error(source, len(source) + 1, f"unexpected end, expected {_expected(e.expected)}") from None
    except lark.UnexpectedToken as e:
        if e.token.type == "$END":
            raise _error(source, len(source) + 1, f"unexpected end, expected {_expected(e.expected)}") from None
        raise _error(source, e.column, f"unexpected {e.token.value!r}, expected {_expected(e.expected)}") from None

    groups = tuple(tuple(_component(source, comp) for comp in group.children) for group in tree.children)
    _check(source, groups)
    return AllocationMode(source=source, groups=groups)


def _component(source: str, tree: lark.Tree) -> Component:
    backend_tok = tree.children[0]
    backend = str(backend_tok)
    if backend not in BACKENDS:
        raise _error(source, backend_tok.column, f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    spec = BACKENDS[backend]
    role = spec.default_role
    counts: dict[str, int] = {}
    for child in tree.children[1:]:
        if isinstance(child, lark.Tree) and child.data == "role":
            role = str(child.children[0])
            continue
        tok = child  # a DIM token such as "t2"
        dim, count = tok[0], int(tok[1:])
        if dim in counts:
            raise _error(source, tok.column, f"dimension {dim!r} given twice in {backend}[{role}]")
        if count < 1:
            raise _error(source, tok.column, f"{_DIM_NAMES[dim]} size must be >= 1, got {tok}")
        if dim not in spec.dims and count > 1:
            raise _error(
                source,
                tok.column,
                f"{_DIM_NAMES[dim]} parallelism ({tok}) is reserved: backend {backend!r} does not implement it",
            )
        counts[dim] = count
    if counts.get("d", 1) % counts.get("e", 1):
        raise _error(
            source,
            backend_tok.column,
            f"expert parallelism e{counts['e']} must divide the data-parallel size d{counts.get('d', 1)} of {backend}[{role}]",
        )
    if counts.get("d", 1) % counts.get("c", 1):
        raise _error(
            source,
            backend_tok.column,
            f"context parallelism c{counts['c']} must divide the data-parallel size d{counts.get('d', 1)} of {backend}[{role}]",
        )
    _check_combinations(source, backend, role, counts, backend_tok.column)
    return Component(
        backend=backend,
        role=role,
        dp=counts.get("d", 1),
        tp=counts.get("t", 1),
        pp=counts.get("p", 1),
        ep=counts.get("e", 1),
        cp=counts.get("c", 1),
        column=backend_tok.column,
    )


_EXCLUSIVE: dict[str, tuple[tuple[str, str], ...]] = {"fsdp": (("e", "t"), ("c", "t"), ("c", "e"))}
"""Dimensions a backend cannot combine in one component: fsdp splits experts (e) and packed
tokens (c) over its data-parallel ranks, each holding whole layers (no t), and one of the two."""


def _check_combinations(source: str, backend: str, role: str, counts: dict[str, int], column: int) -> None:
    """An error naming the two dimensions ``backend`` cannot combine and the strings that would run:
    the first keeps the devices (its data-parallel size takes the dropped dimension's), the second
    drops the ``e``/``c`` dimension instead."""
    for a, b in _EXCLUSIVE.get(backend, ()):
        if counts.get(a, 1) > 1 and counts.get(b, 1) > 1:
            d, na, nb = counts.get("d", 1), counts[a], counts[b]
            name = backend if role == BACKENDS[backend].default_role else f"{backend}[{role}]"
            keep = {k: v for k, v in counts.items() if k not in (a, b, "d")}
            rest = "".join(f"{k}{v}" for k, v in keep.items() if v > 1)
            if b == "t":  # the same devices without t: d*t data-parallel ranks, a still dividing them
                same, other = f"{name}:d{d * nb}{a}{na}{rest}", f"{name}:d{d}t{nb}{rest}"
                what = f"the same {d * nb} devices with {_DIM_NAMES[a]} parallelism"
            else:
                same, other = f"{name}:d{d}{a}{na}{rest}", f"{name}:d{d}{b}{nb}{rest}"
                what = f"{_DIM_NAMES[a]} parallelism only"
            raise _error(
                source,
                column,
                f"{_DIM_NAMES[a]} parallelism {a}{na} and {_DIM_NAMES[b]} parallelism {b}{nb} do not combine on "
                f"{backend}: use {same} ({what}) or {other}",
            )


def _check(source: str, groups: tuple[tuple[Component, ...], ...]) -> None:
    seen: set[str] = set()
    for group in groups:
        for c in group:
            if c.role in seen:
                raise _error(source, c.column, f"role {c.role!r} appears twice; name roles with backend[role]")
            seen.add(c.role)
        first = group[0]
        for c in group[1:]:
            if c.world_size != first.world_size:
                raise _error(
                    source,
                    c.column,
                    f"colocated components must have the same world size: {first} has {first.world_size}, "
                    f"{c} has {c.world_size}",
                )


def check_supported(alloc: AllocationMode) -> None:
    """``AllocationModeError`` (one line) naming the first component areno cannot run: a training
    backend other than fsdp, two different inference backends, or an inference server (vllm,
    sglang) beside training on more than one device (its training side is this process)."""
    for c in alloc.components:
        if c.backend not in SUPPORTED_BACKENDS:
            raise AllocationModeError(f"training backend {c.backend!r} ({c}) is not supported: use fsdp")
    inference = {c.backend for c in alloc.components if c.kind == "inference"}
    if len(inference) > 1:
        raise AllocationModeError(f"one inference backend per run, got {sorted(inference)}")
    for c in alloc.components:
        if c.kind == "inference" and c.role != "rollout":  # nothing would run there: its devices sit idle
            raise AllocationModeError(
                f"{c}: the inference role {c.role!r} is not one areno runs; the rollout side is the only one: "
                f"write {c.backend}:{str(c).split(':', 1)[1]}"
            )
    if inference & SERVER_BACKENDS:
        for c in alloc.components:
            if c.kind == "train" and c.world_size > 1:
                raise AllocationModeError(
                    f"{c} with a {next(iter(inference))} rollout: training runs in this process on one device "
                    f"with inference servers; use {c.backend}:d1"
                )
            if c.kind == "inference" and c.pp > 1:
                raise AllocationModeError(f"{c}: pipeline parallelism of inference servers is not supported; use d/t")


def inference_backend(alloc: AllocationMode) -> str | None:
    """The inference backend the string names (areno, vllm, sglang), or None when it names none."""
    return next((c.backend for c in alloc.components if c.kind == "inference"), None)


# ---------------------------------------------------------------------------------------------
# Roles of a recipe

_ROLE_ALIASES = {"actor": "policy", "critic": "value", "ref": "reference", "rm": "reward"}
"""Allocation role name (scheduler terminology) -> recipe role name (RL terminology)."""


def role_of(given: str, recipe_role_names: Iterable[str] | None = None) -> str:
    """The recipe role a config names: itself where the recipe has a role of that name (or where
    ``recipe_role_names`` is not known), else the role its alias stands for (``critic`` -> ``value``)."""
    if recipe_role_names is not None and given in recipe_role_names:
        return given
    return _ROLE_ALIASES.get(given, given)


def resolve_roles(given: Iterable[str], recipe_role_names: Iterable[str], *, key: str) -> dict[str, str]:
    """Each name of ``given`` (a recipe role or its alias) -> its recipe role; a one-line
    ``ConfigError`` naming ``key`` for a role the recipe does not have or one named twice."""
    names = list(recipe_role_names)
    resolved: dict[str, str] = {}
    for name in given:
        role = role_of(name, names)
        if role not in names:
            raise ConfigError(
                f"{key}: role {name!r} is not a role of the recipe; its roles: {names} (aliases: {_ROLE_ALIASES})"
            )
        if role in resolved.values():
            raise ConfigError(f"{key}: role {role!r} is named twice (once by an alias); name it once")
        resolved[name] = role
    return resolved


def map_roles(alloc: AllocationMode, recipe_role_names: list[str] | tuple[str, ...]) -> dict[str, Component]:
    """Place each recipe role on an allocation component.

    A train component's role matches a recipe role by name or by alias (``actor`` -> ``policy``,
    ``critic`` -> ``value``, ``ref`` -> ``reference``, ``rm`` -> ``reward``). Recipe roles the
    string does not name share the devices of the policy's component (``actor`` / ``policy``),
    because all roles of a recipe train on one shared ``TrainBackend`` unless placed apart.
    Inference components are not recipe roles and are not in the result.
    """
    train = [c for c in alloc.components if c.kind == "train"]
    if not train:
        raise AllocationModeError(
            f"allocation_mode {alloc.source!r} has no train backend (fsdp, megatron) for recipe roles "
            f"{list(recipe_role_names)}"
        )
    placed: dict[str, Component] = {}
    for c in train:
        name = c.role if c.role in recipe_role_names else _ROLE_ALIASES.get(c.role, c.role)
        if name not in recipe_role_names:
            raise AllocationModeError(
                f"cluster.allocation_mode: role {c.role!r} ({c}) is not a role of the recipe; its roles: "
                f"{list(recipe_role_names)} (aliases: {_ROLE_ALIASES})"
            )
        if name in placed:
            raise AllocationModeError(
                f"cluster.allocation_mode: role {name!r} placed twice ({placed[name]} and {c}, once by an alias): place it once"
            )
        placed[name] = c
    default = placed.get("policy") or next((c for c in train if c.role in ("actor", "policy")), None)
    for name in recipe_role_names:
        if name in placed:
            continue
        if default is None:
            raise AllocationModeError(
                f"recipe role {name!r} is not placed by allocation_mode {alloc.source!r} and there is no "
                f"actor/policy component to share; add e.g. '+fsdp[{name}]:d1'"
            )
        placed[name] = default
    return {name: placed[name] for name in recipe_role_names}


def role_placements(alloc: AllocationMode) -> dict[str, list[int]] | None:
    """The role placements a colocated run's string names, or None for any other string.

    When the rollout component and the policy's (``actor`` / ``policy``) share one group (``|``),
    the run is colocated and every other group's components place recipe roles on devices of
    their own: ``areno:d1|fsdp:d1+fsdp[critic]:d1`` is ``cluster.role_devices={actor: [0],
    critic: [1]}`` (check them with ``build_gpu_allocations``). A string without ``+`` or one that
    parts rollout from the policy (a partitioned run) gives None."""
    if len(alloc.groups) < 2:
        return None
    for group in alloc.groups:
        roles = {c.role for c in group}
        rollout = any(c.kind == "inference" and c.role == "rollout" for c in group)
        if rollout and roles & {"actor", "policy"}:
            lists = alloc.device_lists(alloc.world_size)
            return {c.role: lists[c.role] for c in alloc.components if c.kind == "train" or c.role != "rollout"}
    return None


def build_gpu_allocations(
    role_devices: Mapping[str, Sequence[int]],
    recipe_role_names: Sequence[str],
    *,
    policy_role: str,
    num_devices: int,
    key: str = "cluster.role_devices",
) -> dict[str, tuple[int, ...]]:
    """The logical devices of every recipe role in a colocated run (seed 004's role pools).

    ``role_devices`` maps a recipe role (or its alias: ``ref``, ``critic``, ``actor``, ``rm``) to
    its device list; roles it does not name share device 0 with the policy and the rollout engine.
    Roles with equal lists form one placement (they train one after another), placements are
    disjoint (they train concurrently). ``policy_role`` (the role synced to rollout) must stay on
    device 0, next to the rollout engine. One device per placement. A mistake is a one-line
    ``ConfigError`` naming ``key``, raised before anything starts."""
    names = list(recipe_role_names)
    placed: dict[str, tuple[int, ...]] = {}
    for given, name in resolve_roles(role_devices, names, key=key).items():
        devices = role_devices[given]
        devices = (devices,) if isinstance(devices, int) else tuple(devices)
        if not devices or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in devices):
            raise ConfigError(f"{key}.{given}: give a non-empty list of device indices >= 0, got {list(devices)}")
        if max(devices) >= num_devices:
            raise ConfigError(
                f"{key}.{given}: device {max(devices)} does not exist: {num_devices} device(s) are available "
                f"(indices 0..{num_devices - 1})"
            )
        placed[name] = devices
    if placed.get(policy_role, (0,)) != (0,):
        raise ConfigError(
            f"{key}.{policy_role}: the policy is synced to the rollout engine and stays on its device [0]; "
            f"place the other roles instead"
        )
    out = {name: placed.get(name, (0,)) for name in names}
    placements = sorted(set(out.values()))
    for i, a in enumerate(placements):
        for b in placements[i + 1 :]:
            if set(a) & set(b):
                raise ConfigError(
                    f"{key}: device lists {list(a)} and {list(b)} overlap; roles either share the same list or "
                    f"have disjoint ones"
                )
    for devices in placements:
        if len(devices) != 1:
            raise ConfigError(
                f"{key}: placement {list(devices)} has {len(devices)} devices; a role placement takes exactly "
                f"one device today (e.g. [1])"
            )
    return out
