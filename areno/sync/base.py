"""The policy-sync contract: a sender that enumerates weights, a receiver that keeps one slice of
each, a transport that moves one to the other and bumps the policy version only when it completes.

Three narrow pieces keep the transports independent of the trainer and the rollout engine:

- ``WeightSource`` (train side): ``meta()`` lists ``(name, shape, dtype)`` in a fixed order that is
  the same on every training rank; ``iter_tensors()`` yields ``(name, tensor)`` in that order. A
  tensor may be a full tensor or a ``DTensor`` (FSDP2 / TP shard): ``full_tensor`` gathers it, and
  every training rank iterates so that such gathers stay collective.
- ``ShardSpec`` (rollout side): for one Hugging Face name, which dimension this receiver splits and
  which slice ``[start, start + length)`` of it the receiver keeps (``dim=None``: all of it).
- ``ShardReceiver``: ``begin(version)``, ``stage(name) -> destination tensor``, ``commit(version)``,
  ``abort(reason)``. Transports write slices only into the tensors ``stage`` hands out.

Two receivers for a rollout engine (``engine_receiver(engine, specs, commit=...)``), a trade-off:

- ``StagedReceiver`` (``commit="staged"``: a copy into the live tensors, or ``"swap"``: a storage
  swap for eager engines): slices land in a staging copy while the engine keeps generating;
  ``commit`` applies them all at once (generation pauses only for that), so a sync that fails
  midway leaves the engine serving the old version, intact. Costs one extra copy of the policy
  shard in memory and the commit's copy.
- ``LiveReceiver`` (``commit="inplace"``): the fastest and leanest. ``begin`` pauses the engine
  and ``stage`` hands out its live tensors, so buckets are received straight into the weights (no
  staging memory, no commit copy); generation is paused for the whole sync. A sync that fails
  after the first write leaves the weights half-written: the engine stays paused and refuses to
  generate (``RolloutEngine.mark_torn``, a one-line error naming the failed sync) until the next
  sync completes or the weights are reloaded from disk.

Every completed sync logs one line and returns ``SyncStats``; ``as_metrics()`` gives the names the
trainer emits with its next training metrics.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from areno.errors import RunFailure

logger = logging.getLogger("areno.sync")

METRIC_NAMES = (
    "policy_sync_time_s",
    "policy_sync_transfer_time_s",
    "policy_sync_bytes",
    "policy_sync_tensors",
    "policy_sync_throughput_gbps",
    "policy_sync_generation_paused_s",
)

SLOW_SYNC_S = 10.0
"""A sync that took longer is logged at INFO (the console shows it); the others at DEBUG, their
figures being in the step's metrics (``METRIC_NAMES``). Syncs take milliseconds to a second or so
(bench/RESULTS.md, policy sync): one of many seconds is worth a line."""


class PolicySyncError(RunFailure):
    """A policy sync did not complete; the receivers kept their previous version."""


@dataclass(frozen=True, kw_only=True)
class SyncStats:
    """What one completed policy sync cost."""

    version: int
    """The policy version the receivers hold after the sync."""
    total_time_s: float
    """Wall time of ``sync()`` on this rank, from the call to the commit."""
    transfer_time_s: float
    """Time this rank spent inside collectives (or copies, for the in-place transport)."""
    bytes: int
    """Bytes of the policy moved (the sum over all tensors as sent, not per receiver)."""
    tensors: int
    """Number of named tensors in the policy."""
    generation_paused_s: float | None = None
    """Time the rollout engine stopped generating for this sync (a staged receiver: the commit's
    copy alone); None = the whole sync (the in-place transport copies into a paused engine)."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Where this rank's ``total_time_s`` went, by phase (a transport's own names, e.g. pack, post,
    wait, stage, vote, commit, device_sync); reported as ``policy_sync_phase_<name>_s``."""

    @property
    def throughput_gbps(self) -> float:
        """Effective throughput in GB/s (1e9 bytes): policy bytes over total sync time."""
        return self.bytes / self.total_time_s / 1e9 if self.total_time_s > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        return {
            "policy_sync_time_s": self.total_time_s,
            "policy_sync_transfer_time_s": self.transfer_time_s,
            "policy_sync_bytes": float(self.bytes),
            "policy_sync_tensors": float(self.tensors),
            "policy_sync_throughput_gbps": self.throughput_gbps,
            "policy_sync_generation_paused_s": (
                self.total_time_s if self.generation_paused_s is None else self.generation_paused_s
            ),
            **{f"policy_sync_phase_{name}_s": float(v) for name, v in self.phases_s.items()},
        }

    def log(self, transport: str) -> None:
        """One line with the figures: DEBUG, or INFO for a sync slower than ``SLOW_SYNC_S``."""
        m = self.as_metrics()
        logger.log(
            logging.INFO if self.total_time_s > SLOW_SYNC_S else logging.DEBUG,
            "policy sync v%d (%s): policy_sync_time_s=%.4f policy_sync_transfer_time_s=%.4f "
            "policy_sync_bytes=%d policy_sync_tensors=%d policy_sync_throughput_gbps=%.3f "
            "policy_sync_generation_paused_s=%.4f",
            self.version,
            transport,
            m["policy_sync_time_s"],
            m["policy_sync_transfer_time_s"],
            self.bytes,
            self.tensors,
            m["policy_sync_throughput_gbps"],
            m["policy_sync_generation_paused_s"],
        )


class PolicySyncTransport(abc.ABC):
    """Moves the trained policy into the rollout engine and bumps its version.

    ``sync`` is called on every participating rank with the same ``version``; it returns only once
    the receivers committed ``version`` and raises ``PolicySyncError`` otherwise.
    """

    name: str = "transport"
    last_stats: SyncStats | None = None
    _pending_metrics: dict[str, float] | None = None

    @abc.abstractmethod
    def _sync(self, version: int) -> SyncStats:
        """Run one sync; implemented by each transport."""

    def sync(self, version: int) -> SyncStats:
        stats = self._sync(version)
        stats.log(self.name)
        self.last_stats = stats
        self._pending_metrics = stats.as_metrics()
        return stats

    def pop_metrics(self) -> dict[str, float]:
        """The metrics of the last completed sync, once (to go out with the next training step)."""
        metrics, self._pending_metrics = self._pending_metrics or {}, None
        return metrics


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """Which slice of one full (Hugging Face) tensor a receiver keeps."""

    name: str
    full_shape: tuple[int, ...]
    """Shape of the full tensor as the trainer holds it."""
    dtype: torch.dtype
    """dtype of the receiver's tensor (a cast happens on write)."""
    dim: int | None = None
    """Dimension split across tensor-parallel ranks; None when the receiver keeps it all."""
    start: int = 0
    """First index this receiver keeps along ``dim``."""
    length: int = 0
    """How many indices along ``dim`` this receiver keeps (ignored when ``dim`` is None)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_shape", tuple(int(s) for s in self.full_shape))
        if self.dim is not None:
            if not 0 <= self.dim < len(self.full_shape):
                raise ValueError(f"{self.name}: shard dim {self.dim} out of range for shape {self.full_shape}")
            if self.start < 0 or self.length <= 0 or self.start + self.length > self.full_shape[self.dim]:
                raise ValueError(
                    f"{self.name}: slice [{self.start}, {self.start + self.length}) does not fit dim "
                    f"{self.dim} of shape {self.full_shape}"
                )

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This receiver's slice of the full tensor (a view)."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.length)


def write_rows(spec: ShardSpec, dest: torch.Tensor, rows: torch.Tensor, row_start: int) -> None:
    """Write rows ``[row_start, row_start + len(rows))`` (dim 0) of the full tensor into ``dest``,
    the receiver's local shard, keeping only the receiver's slice. Casts to ``dest.dtype``."""
    row_end = row_start + rows.shape[0]
    if spec.dim == 0:
        lo, hi = max(row_start, spec.start), min(row_end, spec.start + spec.length)
        if lo < hi:
            dest[lo - spec.start : hi - spec.start].copy_(rows[lo - row_start : hi - row_start])
    elif spec.dim is None:
        dest[row_start:row_end].copy_(rows)
    else:
        dest[row_start:row_end].copy_(rows.narrow(spec.dim, spec.start, spec.length))


class WeightSource(abc.ABC):
    """Train side: the policy as named tensors, in the same order on every training rank."""

    @abc.abstractmethod
    def meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, full shape, dtype)`` of every tensor, in iteration order, without gathering."""

    @abc.abstractmethod
    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` in ``meta()`` order; DTensors are allowed (see ``full_tensor``)."""


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a tensor that may be a DTensor shard (a collective over its mesh)."""
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    return tensor


class NamedTensorSource(WeightSource):
    """A ``WeightSource`` over a callable returning ``(name, tensor)`` pairs (a state dict's items,
    ``TrainBackend.named_weights``, a model's ``named_parameters``).

    ``meta()`` iterates the callable once (shapes and dtypes; a DTensor reports its global shape)
    and caches the result; pass ``meta`` to skip that pass when the list is known.
    """

    def __init__(
        self,
        named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        meta: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None,
    ) -> None:
        self._named_tensors = named_tensors
        self._meta = meta

    def meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if self._meta is None:
            self._meta = [(name, tuple(t.shape), t.dtype) for name, t in self._named_tensors()]
        return self._meta

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named_tensors():
            # a training backend's named_weights are detached already: one dispatched op per tensor fewer
            yield name, t.detach() if t.requires_grad else t


class ShardReceiver(abc.ABC):
    """Rollout side: where the received slices go."""

    @abc.abstractmethod
    def shard_specs(self) -> Mapping[str, ShardSpec]:
        """One spec per tensor name this receiver keeps."""

    @abc.abstractmethod
    def begin(self, version: int) -> None:
        """A sync to ``version`` starts; staging tensors must be writable after this."""

    @abc.abstractmethod
    def stage(self, name: str) -> torch.Tensor:
        """The staging tensor (``spec.local_shape``, receiver dtype) that ``name`` is written into."""

    @abc.abstractmethod
    def commit(self, version: int) -> None:
        """Every staged tensor is complete: apply them all and switch to ``version``."""

    @abc.abstractmethod
    def abort(self, reason: str = "") -> None:
        """The sync failed (``reason`` says why): drop what was staged (a staged receiver: the
        previous version stays live)."""

    last_paused_s: float | None = None
    """Seconds the last completed sync stopped generation on this receiver (None: unknown, count
    the whole sync)."""

    def wait_committed(self, timeout_s: float | None = None) -> None:
        """Return once the last commit is applied (a receiver that applies it within ``commit``:
        at once; see ``StagedReceiver``'s deferred mode)."""


def _never_arrived(specs: Mapping[str, ShardSpec], written: set[str], version: int) -> str:
    """A receiver's commit check: the one-line error naming tensors no bucket wrote, or ''."""
    missing = set(specs) - written
    return f"sync v{version}: {len(missing)} tensors never arrived, e.g. {sorted(missing)[:3]}" if missing else ""


class StagedReceiver(ShardReceiver):
    """Double-buffered receiver: slices land in a staging copy (allocated once, reused), and
    ``commit`` hands the complete set to ``apply(named_tensors, version)`` — e.g. the rollout
    engine's all-or-nothing ``update_weights``, or an in-place ``copy_`` into live tensors.

    Memory: one extra copy of this receiver's local shard of the policy, the price of a sync that
    can fail midway without touching the live weights. ``apply`` may return the seconds it actually
    stopped generation (from the engine's pause taking effect to its resume: not the wait for the
    running step to end, during which generation goes on), its device copies waited for; else the
    commit waits for the device and the whole apply counts as paused.

    ``deferred``: ``commit`` checks that every tensor arrived, then returns at once and applies on a
    background thread (for an engine that is generating, the apply first waits for its running
    step, up to one whole k-step decode loop: the sync need not wait with it). The engine's version
    switches at that step boundary; the tokens generated until then carry the old one, as recorded.
    ``wait_committed`` (and the next ``begin``, before the staging tensors are rewritten) waits for it;
    ``last_paused_s`` is then the last *completed* apply's.
    """

    def __init__(
        self,
        specs: Mapping[str, ShardSpec],
        apply: Callable[[list[tuple[str, torch.Tensor]], int], float | None],
        device: torch.device | str = "cpu",
        *,
        deferred: bool = False,
    ) -> None:
        self._specs = dict(specs)
        self._apply = apply
        self._device = torch.device(device)
        self._staging: dict[str, torch.Tensor] = {}
        self._written: set[str] = set()
        self.deferred = deferred
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        self.version: int | None = None
        """Version of the last commit, None before the first."""
        self.last_apply_s = 0.0
        """Seconds the last ``commit`` spent applying (the only time generation must pause)."""
        self.last_paused_s = 0.0 if deferred else None

    def shard_specs(self) -> Mapping[str, ShardSpec]:
        return self._specs

    def wait_committed(self, timeout_s: float | None = None) -> None:
        """Wait for a deferred commit still being applied; PolicySyncError if it failed (the engine
        then still serves the version before it) or did not end within ``timeout_s``."""
        pending = self._pending
        if pending is not None:
            pending.join(timeout_s)
            if pending.is_alive():
                raise PolicySyncError(
                    f"the deferred commit of a policy sync did not end within {timeout_s} s "
                    "(the rollout engine's running step never ended)"
                )
            self._pending = None
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise PolicySyncError(
                f"the deferred commit of the previous policy sync failed: {type(error).__name__}: {error}"
            ) from error

    def begin(self, version: int) -> None:
        self.wait_committed()
        if not self._staging:
            self._staging = {
                n: torch.empty(s.local_shape, dtype=s.dtype, device=self._device) for n, s in self._specs.items()
            }
        self._written = set()

    def stage(self, name: str) -> torch.Tensor:
        self._written.add(name)
        return self._staging[name]

    def commit(self, version: int) -> None:
        missing = _never_arrived(self._specs, self._written, version)
        if missing:
            raise PolicySyncError(missing)
        if not self.deferred:
            self._apply_now(version)
            return
        self.wait_committed()  # (begin waited already: a no-op unless commit is called twice)

        def run() -> None:
            try:
                self._apply_now(version)
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait_committed / the next sync
                self._pending_error = exc

        self._pending = threading.Thread(target=run, name=f"areno-commit-v{version}", daemon=True)
        self._pending.start()

    def _apply_now(self, version: int) -> None:
        t0 = time.perf_counter()
        paused_s = self._apply(list(self._staging.items()), version)
        if paused_s is None and self._device.type == "cuda":  # (a timed apply waited for its copies)
            torch.cuda.synchronize(self._device)
        self.last_apply_s = time.perf_counter() - t0
        self.last_paused_s = self.last_apply_s if paused_s is None else paused_s
        self.version = version

    def abort(self, reason: str = "") -> None:
        self._written = set()


def copy_into(live: Mapping[str, torch.Tensor]) -> Callable[[list[tuple[str, torch.Tensor]], int], None]:
    """An ``apply`` for ``StagedReceiver`` that copies staged tensors into ``live`` in place."""

    def apply(named: list[tuple[str, torch.Tensor]], version: int) -> None:
        for name, t in named:
            assert live[name].shape == t.shape, (name, live[name].shape, t.shape)
        dst = [live[name] for name, _ in named]
        torch._foreach_copy_(dst, [t for _, t in named])

    return apply


def swap_into(live: Mapping[str, torch.Tensor]) -> Callable[[list[tuple[str, torch.Tensor]], int], None]:
    """An ``apply`` for ``StagedReceiver`` that swaps storages instead of copying: each live tensor
    object takes the staged storage and the staging tensor takes the old live one (reused by the
    next sync, which overwrites it). No bytes move, so the commit pauses generation for
    microseconds. Only valid when the consumer reads its weights through these tensor objects at
    every step (eager modules, parameters); never under captured CUDA graphs or kernels holding
    raw pointers. Copied instead: a pair whose dtype, device or strides differ, and live tensors
    that share storage with another live tensor object (views of a fused weight); one object
    under two names (tied weights) is swapped once."""
    owners: dict[int, set[int]] = {}
    for t in live.values():
        owners.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
    shared = {id(t) for t in live.values() if len(owners[t.untyped_storage().data_ptr()]) > 1}

    def apply(named: list[tuple[str, torch.Tensor]], version: int) -> None:
        # Per tensor on the commit's pause: the cheapest checks first, three ``.data`` operations
        # per swap (~1 us each: this loop is most of a swap commit's pause for ~300 tensors).
        done: set[int] = set()
        with torch.no_grad():
            for name, staged in named:
                dst = live[name]
                if id(dst) in done:
                    continue
                if (
                    dst.dtype is staged.dtype
                    and id(dst) not in shared
                    and dst.is_contiguous()
                    and staged.is_contiguous()
                    and dst.shape == staged.shape
                    and dst.device == staged.device
                ):
                    old = dst.data
                    dst.data = staged
                    staged.data = old
                    done.add(id(dst))
                else:
                    assert dst.shape == staged.shape, (name, dst.shape, staged.shape)
                    dst.copy_(staged)

    return apply


class Timer:
    """Accumulates seconds spent in ``with timer:`` blocks (synchronising CUDA when asked)."""

    def __init__(self, cuda_sync: bool = False) -> None:
        self.seconds = 0.0
        self._cuda_sync = cuda_sync
        self._t0 = 0.0

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cuda_sync:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self._t0


COMMIT_MODES = ("staged", "swap", "inplace")
"""How ``engine_receiver`` commits a sync: copy from staging, swap storages with staging, or none
(written in place into a paused engine)."""


class TensorEngine:
    """The rollout-engine surface ``engine_receiver`` drives (live tensors by name, pause/resume,
    version, torn flag) over plain tensors, for benchmarks and tests of the receivers' real commit
    paths without generating."""

    def __init__(self, live: Mapping[str, torch.Tensor]) -> None:
        self._live = dict(live)
        self.is_paused = False
        self.version = 0
        self.torn: str | None = None

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._live)

    def pause(self) -> None:
        self.is_paused = True

    def resume(self) -> None:
        self.is_paused = False

    def commit_weights(self, version: int) -> None:
        self.version, self.torn = version, None

    def mark_torn(self, reason: str) -> None:
        self.torn = reason


def engine_receiver(
    engine: object, specs: Mapping[str, ShardSpec], *, commit: str = "staged", deferred: bool = False
) -> ShardReceiver:
    """A receiver for a rollout engine exposing ``weight_tensors()`` (its live, possibly
    TP-sharded tensors by HF name), ``commit_weights(version)``, ``pause()``, ``resume()``,
    ``is_paused`` and, for ``commit="inplace"``, ``mark_torn(reason)``.

    ``commit="staged"`` (default): slices are staged in the live tensors' dtype and device while
    the engine keeps generating; at commit the engine is paused (at a step boundary), the staged
    tensors are copied in place, the version bumps and generation resumes (unless it was paused
    before). ``"swap"``: the same, but the commit swaps storages (``swap_into``): only for an
    engine that reads its weights through these tensor objects at every step (no captured CUDA
    graphs). ``"inplace"``: a ``LiveReceiver`` (no staging; the engine paused for the whole sync;
    a failed sync leaves it refusing to generate until the next one).

    ``deferred`` (staged and swap only): the commit's apply runs in the background (see
    ``StagedReceiver``), so a sync into a generating engine does not wait for its running step.

    Everything is validated here, before any byte moves: only names present on both sides are
    kept; a live tensor whose shape differs from its spec's slice, or whose dtype the sync cannot
    cast into, is a ValueError naming it.
    """
    if commit not in COMMIT_MODES:
        raise ValueError(f"commit={commit!r}: must be one of {', '.join(COMMIT_MODES)}")
    live = engine.weight_tensors()  # type: ignore[attr-defined]
    kept = {}
    for name, spec in specs.items():
        if name not in live:
            continue
        t = live[name]
        if tuple(t.shape) != spec.local_shape:
            raise ValueError(
                f"{name}: engine tensor {tuple(t.shape)} != shard {spec.local_shape}; "
                "check the rollout TP rank/size given to the shard specs"
            )
        if t.dtype != spec.dtype and not (t.dtype.is_floating_point and spec.dtype.is_floating_point):
            raise ValueError(
                f"{name}: engine tensor dtype {t.dtype} cannot take {spec.dtype} (only floating "
                "dtypes are cast); fix the shard spec's dtype"
            )
        kept[name] = ShardSpec(
            name=name, full_shape=spec.full_shape, dtype=t.dtype, dim=spec.dim, start=spec.start, length=spec.length
        )
    if commit == "inplace":
        if deferred:
            raise ValueError(
                "deferred=True needs a staged or swap commit: an in-place sync writes the paused "
                "engine's weights directly, so there is nothing to apply later"
            )
        return LiveReceiver(engine, kept)
    device = next(iter(live.values())).device
    copy = swap_into(live) if commit == "swap" else copy_into(live)

    def apply(named: list[tuple[str, torch.Tensor]], version: int) -> float:
        was_paused = engine.is_paused  # type: ignore[attr-defined]
        engine.pause()  # type: ignore[attr-defined]  (returns at the step boundary)
        stopped = time.perf_counter()
        try:
            with torch.no_grad():
                copy(named, version)
            if device.type == "cuda":  # the copy ends before generation goes on (its time is paused time)
                torch.cuda.synchronize(device)
            engine.commit_weights(version)  # type: ignore[attr-defined]
        finally:
            if not was_paused:
                engine.resume()  # type: ignore[attr-defined]
        return time.perf_counter() - stopped

    return StagedReceiver(kept, apply, device=device, deferred=deferred)


class LiveReceiver(ShardReceiver):
    """In-place receiver: the sync writes the rollout engine's live tensors while it is paused.

    ``begin`` pauses the engine at a step boundary (remembering whether it ran) and, on CUDA,
    waits for its last kernels; ``stage(name)`` returns the live tensor itself, so a transport
    receives buckets straight into the weights and its copies write into them: no staging memory
    and no commit copy, the fastest sync. ``commit`` bumps the engine's version and resumes it.
    Generation is paused for the whole sync (``last_paused_s``: from the pause to the resume).

    ``abort`` after the first ``stage`` (the weights may be half-written) keeps the engine paused
    and marks it torn (``mark_torn``): it refuses to generate with a one-line error naming the
    failed sync, until a later sync commits (it then resumes as the first sync would have) or the
    weights are reloaded from disk (``update_weights_from_disk`` clears the mark; the engine stays
    paused until ``resume``). A sync that aborts before any ``stage`` left the weights intact and
    resumes the engine as it was.
    """

    def __init__(self, engine: object, specs: Mapping[str, ShardSpec]) -> None:
        live = engine.weight_tensors()  # type: ignore[attr-defined]
        self._engine = engine
        self._specs = dict(specs)
        self._live = {n: live[n].detach() for n in self._specs}  # the same memory, writable without autograd
        self._device = next(iter(live.values())).device
        self._written: set[str] = set()
        self._resume = False
        """Whether ``commit`` resumes generation (the engine ran before the sync that paused it)."""
        self._torn = False
        """An aborted sync of this receiver left the live weights half-written."""
        self._pending: int | None = None
        """The version of the sync under way (between ``begin`` and its commit or abort)."""
        self._paused_at = 0.0
        self.version: int | None = None
        """Version of the last commit, None before the first."""
        self.last_paused_s = 0.0

    def shard_specs(self) -> Mapping[str, ShardSpec]:
        return self._specs

    @property
    def torn(self) -> bool:
        return self._torn

    def begin(self, version: int) -> None:
        if not self._torn:  # after our own failed sync the pause is ours: keep the earlier state
            self._resume = not self._engine.is_paused  # type: ignore[attr-defined]
        self._paused_at = time.perf_counter()
        self._engine.pause()  # type: ignore[attr-defined]
        if self._device.type == "cuda":  # the last step's kernels may still read the weights
            torch.cuda.synchronize(self._device)
        self._written = set()
        self._pending = version

    def stage(self, name: str) -> torch.Tensor:
        self._written.add(name)
        return self._live[name]

    def commit(self, version: int) -> None:
        msg = _never_arrived(self._specs, self._written, version)
        if msg:
            self.abort(msg)
            raise PolicySyncError(msg)
        if self._device.type == "cuda":  # every write landed before the engine reads them
            torch.cuda.synchronize(self._device)
        self._engine.commit_weights(version)  # type: ignore[attr-defined]
        self._torn = False
        if self._resume:
            self._engine.resume()  # type: ignore[attr-defined]
        self.last_paused_s = time.perf_counter() - self._paused_at
        self.version = version
        self._pending = None

    def abort(self, reason: str = "") -> None:
        version, self._pending = self._pending, None
        if version is None:  # no sync under way (it failed before ``begin``): nothing paused
            return
        if not self._written and not self._torn:  # nothing handed out: the weights are intact
            if self._resume:
                self._engine.resume()  # type: ignore[attr-defined]
            return
        self._torn = True
        why = " ".join(reason.split()).removeprefix(f"policy sync v{version} failed ")  # one line
        why = why if len(why) <= 300 else why[:297] + "..."
        self._engine.mark_torn(  # type: ignore[attr-defined]
            f"the rollout weights are half-written: in-place policy sync v{version} failed midway"
            + (f" ({why})" if why else "")
            + "; this engine refuses to generate until the next policy sync "
            "completes or the weights are reloaded from disk (update_weights_from_disk, then resume); "
            "cluster.sync_commit=staged keeps serving the old weights through a failed sync"
        )
