"""Checkpoints with ``torch.distributed.checkpoint`` (DCP); works with or without a process group.

Layout of a checkpoint directory:
- DCP files (``.metadata``, ``__*.distcp``): ``model`` and ``optim`` state, sharded as trained
  (each rank writes its shards; a different world size can load them, DCP reshards);
- ``trainer_state.pt`` (rank 0): step, scheduler state, skipped-step count, caller's ``extra``;
- ``rng_rank{r}.pt``: every rank's torch / CUDA / python / numpy RNG states, for bit-for-bit resume.

A run's checkpoints (``run_dir/checkpoints/step_N``) are published atomically: everything is written
into ``step_N.tmp`` (:func:`staging_dir`), then :func:`commit` writes the ``COMPLETE`` marker there
and renames the directory into place. A ``step_N`` directory therefore always holds a whole
checkpoint; a killed write leaves only a ``.tmp`` directory, which :func:`latest_complete` ignores
and :func:`remove_stale` deletes with a warning.

Before the marker, :func:`commit` writes ``MANIFEST.json``: the size and sha256 of every file of the
checkpoint. :func:`verify` checks them (a flipped byte, a truncated or missing file) and
:func:`newest_intact` is what a resume loads: the newest checkpoint that verifies, passing over
damaged ones with a warning naming the file.

Incremental checkpoints (``train.checkpoint_full_every``): a full checkpoint also records a content
hash of every model and optimizer tensor (``tensor_hashes_rank{r}.json``); an incremental one
(:func:`save` with ``base``) writes only the tensors whose hash differs from the full one's, plus
``INCREMENTAL.json`` naming that full checkpoint. :func:`load` loads the full one and overlays the
changed tensors. :func:`verify` fails an incremental checkpoint whose base is missing or damaged, so
:func:`newest_intact` falls back to an older checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areno.errors import ModelDirError
from areno.models.checkpoint_dirs import COMPLETE_MARKER, STEP_DIR, complete_checkpoints, is_complete, newest_complete

TRAINER_STATE = "trainer_state.pt"
MANIFEST = "MANIFEST.json"
_HASH_CHUNK = 1 << 22
STAGING_SUFFIX = ".tmp"
INCREMENTAL = "INCREMENTAL.json"
_HASHES = "tensor_hashes_rank{rank}.json"
_UNLOADABLE = (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, ValueError, OSError)
"""What ``torch.load`` raises for a damaged file (tried: random bytes, truncated zips, text, a flipped
byte), an unreadable one, or one holding more than tensors and plain values (``weights_only``)."""

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _dcp_alone_quietly() -> Iterator[None]:
    """DCP warns at every save and load of a process without a process group that it saves or loads
    alone, which is what a one-process run means: that note is left out, nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent is to (save|load)")
        yield


def _dcp_load(state: dict[str, Any], path: Path, base: Path | None) -> None:
    """``state`` in place from the checkpoint at ``path``: an incremental one's full base first, then
    its changed tensors over it (the same tensor objects)."""
    import torch.distributed.checkpoint as dcp  # slow import (sympy): only to save or load

    if base is None:
        dcp.load(state, checkpoint_id=str(path))
        return
    dcp.load(state, checkpoint_id=str(base))
    stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    dcp.load(_subset(state, stored), checkpoint_id=str(path))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """This process's torch / CUDA / python / numpy RNG states, in types ``weights_only`` loads."""
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:  # absent in checkpoints written before numpy was recorded
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


WRITE_THREADS = 4
"""Files a rank writes its part of a checkpoint into, in parallel: the manifest hashes each file on one
thread (about 1.4 GB/s), so one file per rank took 17 s a save for a one-GPU 1.5B run's 24 GB. torch loses
a writer thread's error: ``check_written`` finds what it left out."""


def check_written(path: str | Path) -> None:
    """An OSError naming what is missing unless the DCP checkpoint at ``path`` stored every item its plan
    holds, each file as long as its items reach. A writer thread's error is lost in torch's multi-threaded
    FileSystemWriter (its items are left out of the metadata): the save returned and the manifest hashed
    what was there, so the loss showed only at resume."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    path = Path(path)
    metadata = FileSystemReader(str(path)).read_metadata()
    stored = metadata.storage_data
    missing = []
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            if any(MetadataIndex(fqn, chunk.offsets) not in stored for chunk in item.chunks):
                missing.append(fqn)
        elif MetadataIndex(fqn) not in stored:
            missing.append(fqn)
    ends: dict[str, int] = {}
    for info in stored.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    short = [name for name, end in ends.items() if not (path / name).is_file() or (path / name).stat().st_size < end]
    if missing or short:
        raise OSError(
            errno.EIO,
            f"the checkpoint write left out {len(missing)} of {len(metadata.state_dict_metadata)} items "
            f"({', '.join(missing[:3])}) and {len(short)} files are short ({', '.join(short[:3])}): a writer "
            "thread failed",
            str(path),
        )


def _storage_writer(path: str | Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return FileSystemWriter(str(path), thread_count=max(1, min(WRITE_THREADS, cores)))


# ------------------------------------------------------------------ atomic publication of a run's checkpoints
def staging_dir(path: str | Path) -> Path:
    """The empty directory to write the checkpoint ``path`` into before :func:`commit`; a staging
    directory left by a killed write is removed first."""
    tmp = Path(path).with_name(Path(path).name + STAGING_SUFFIX)
    if tmp.exists():
        logger.warning("removing %s: a checkpoint write that never completed", tmp)
        shutil.rmtree(tmp)
    return tmp


def commit(tmp: str | Path, path: str | Path, *, marker_text: str = "ok") -> None:
    """Publish the checkpoint written into ``tmp`` as ``path``: the ``COMPLETE`` marker goes in
    first, then one rename, so ``path`` never exists half-written. An older ``path`` (a run
    restarted without resume over the same run_dir) is replaced."""
    tmp, path = Path(tmp), Path(path)
    write_manifest(tmp)
    (tmp / COMPLETE_MARKER).write_text(marker_text)
    if path.exists():
        old = path.with_name(path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)


# ------------------------------------------------------------------ integrity
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(root: Path, names: list[str]) -> dict[str, str]:
    # hashlib releases the GIL on large buffers: the shards of a big checkpoint hash in parallel
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda name: _sha256(root / name), names)))


def write_manifest(path: str | Path) -> None:
    """Record the size and sha256 of every file under ``path`` in ``path/MANIFEST.json``."""
    path = Path(path)
    names = sorted(
        str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name not in (MANIFEST, COMPLETE_MARKER)
    )
    digests = _hash_files(path, names)
    files = {name: {"size": (path / name).stat().st_size, "sha256": digests[name]} for name in names}
    (path / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1))


def verify(path: str | Path) -> str | None:
    """None when the checkpoint at ``path`` is whole; else what is wrong with it, naming the file.
    Every file of the manifest must be there with its size and sha256; a checkpoint written before
    manifests existed is checked for its DCP metadata and state files only (present and non-empty)."""
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return _verify_unlisted(path)
    except (ValueError, KeyError, TypeError):
        return f"{path / MANIFEST} is unreadable"
    for name, entry in files.items():
        if not (path / name).is_file():
            return f"{path / name} is missing"
        size = (path / name).stat().st_size
        if size != entry["size"]:
            return f"{path / name} has {size} bytes, {entry['size']} were written"
    digests = _hash_files(path, list(files))
    for name, entry in files.items():
        if digests[name] != entry["sha256"]:
            return f"{path / name} does not match its checksum in {MANIFEST} (the file was changed or corrupted)"
    return _verify_bases(path)


def _verify_bases(path: Path) -> str | None:
    """An incremental checkpoint is whole only with its full base: committed and verifying."""
    for record in path.rglob(INCREMENTAL):
        base = incremental_base(record.parent)
        root = _committed_root(base)
        if root is None:
            return f"{record} names base checkpoint {base}, which is missing or incomplete"
        problem = verify(root)
        if problem is not None:
            return f"{record} names base checkpoint {base}, which is damaged: {problem}"
    return None


def _committed_root(path: Path) -> Path | None:
    """The directory holding ``COMPLETE`` at or above ``path`` (a role's directory is inside the
    ``step_N`` one that was committed), or None."""
    for candidate in (path, *path.parents[:2]):
        if is_complete(candidate):
            return candidate
    return None


def _verify_unlisted(path: Path) -> str | None:
    """The checks a checkpoint without a manifest allows: DCP metadata and state files non-empty, and
    the state files (small) loadable, so a resume passes over a damaged one before any model loads."""
    metadata = list(path.rglob(".metadata"))
    if not metadata:
        return f"{path} holds no .metadata (no DCP checkpoint)"
    states = [*path.rglob(TRAINER_STATE), *path.rglob("rng_rank*.pt")]
    for file in [*metadata, *states]:
        if file.stat().st_size == 0:
            return f"{file} is empty"
    for file in states:
        try:
            torch.load(file, weights_only=True)
        except _UNLOADABLE as exc:
            return f"{file} does not load ({type(exc).__name__}: the file is damaged)"
    return None


def newest_intact(checkpoints_dir: str | Path) -> Path | None:
    """The newest completed checkpoint that :func:`verify` passes, warning about each newer one that
    does not (naming the file); None when there is no completed checkpoint. A
    :class:`~areno.errors.ModelDirError` when there are some but every one is damaged."""
    found = complete_checkpoints(checkpoints_dir)
    problems = []
    for _, path in reversed(found):
        problem = verify(path)
        if problem is None:
            return path
        logger.warning("checkpoint %s is damaged, resuming from an earlier one: %s", path, problem)
        problems.append(problem)
    if problems:
        raise ModelDirError(
            f"every checkpoint in {checkpoints_dir} is damaged (newest: {problems[0]}): restore the files, "
            "or start over with resume=false overwrite=true"
        )
    return None


def latest_complete(checkpoints_dir: str | Path) -> Path | None:
    """The newest completed checkpoint under ``checkpoints_dir``, or None."""
    found = newest_complete(checkpoints_dir)
    return found[1] if found else None


def remove_stale(checkpoints_dir: str | Path) -> list[Path]:
    """Delete, with a warning each, what killed writes left: staging directories (``*.tmp``; one
    that already holds ``COMPLETE`` is renamed into place instead),
    replaced-checkpoint leftovers (``*.old``) and ``step_N`` directories without ``COMPLETE``
    (written by versions that renamed before marking). Returns the removed paths."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    removed = []
    for child in sorted(root.iterdir()):
        if not child.is_dir() or not child.name.startswith("step_"):
            continue
        final = child.with_name(child.name[: -len(STAGING_SUFFIX)])
        if child.name.endswith(STAGING_SUFFIX) and is_complete(child) and not final.exists():
            child.rename(final)  # killed between the marker and the rename: the checkpoint is whole
            continue
        stale = child.name.endswith((STAGING_SUFFIX, ".old")) or (
            STEP_DIR.match(child.name) is not None and not is_complete(child)
        )
        if stale:
            logger.warning(
                "removing %s: an incomplete checkpoint (the write was interrupted); it is never loaded", child
            )
            shutil.rmtree(child)
            removed.append(child)
    return removed


BEST_FILE = "best.json"
"""In a run's ``checkpoints/``: the checkpoint whose evaluation figure ``train.best_metric`` is the best so far
(``{"step", "path", "metric", "value", "mode"}``), which ``prune`` keeps."""


def read_best(checkpoints_dir: str | Path) -> dict[str, Any] | None:
    """The best checkpoint's record (``BEST_FILE``), or None: no record, or its checkpoint is no longer whole
    (a resume from before it removed it)."""
    path = Path(checkpoints_dir) / BEST_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    step_dir = Path(checkpoints_dir) / Path(str(record.get("path", ""))).name
    return record if isinstance(record, dict) and is_complete(step_dir) else None


def write_best(checkpoints_dir: str | Path, record: dict[str, Any]) -> None:
    """Replace ``BEST_FILE`` with ``record`` in one rename: a reader sees the old record or the new one."""
    path = Path(checkpoints_dir) / BEST_FILE
    staged = path.with_name(path.name + STAGING_SUFFIX)
    staged.write_text(json.dumps(record) + "\n")
    os.replace(staged, path)


def prune(checkpoints_dir: str | Path, keep: int) -> list[Path]:
    """Delete the completed checkpoints older than the newest ``keep`` (``train.keep_checkpoints``),
    except the best one (``BEST_FILE``) and the full checkpoints that a kept incremental one overlays;
    ``keep`` 0 deletes nothing. Returns the removed paths."""
    found = [path.resolve() for _, path in complete_checkpoints(checkpoints_dir)]
    if keep <= 0 or len(found) <= keep:
        return []
    kept = found[-keep:]
    best = read_best(checkpoints_dir)
    if best is not None:
        kept.append((Path(checkpoints_dir) / Path(best["path"]).name).resolve())
    needed = set(kept)
    for path in kept:
        for record in path.rglob(INCREMENTAL):
            root = _committed_root(incremental_base(record.parent))
            if root is not None:
                needed.add(root.resolve())
    removed = [path for path in found[:-keep] if path not in needed]
    for path in removed:
        logger.info("removing checkpoint %s: train.keep_checkpoints=%d newer ones are kept", path, keep)
        shutil.rmtree(path)
    return removed


# ------------------------------------------------------------------ incremental checkpoints
def published_path(path: str | Path) -> Path:
    """Where ``path`` (possibly inside a ``step_N.tmp`` staging directory) lives once committed."""

    def published(part: str) -> str:
        name = part.removesuffix(STAGING_SUFFIX)
        return name if STEP_DIR.match(name) else part

    return Path(*[published(part) for part in Path(path).absolute().parts])


def incremental_base(path: str | Path) -> Path:
    """The full checkpoint the incremental checkpoint at ``path`` overlays."""
    record = json.loads((Path(path) / INCREMENTAL).read_text())
    return (Path(path) / record["base"]).resolve()


def is_incremental(path: str | Path) -> bool:
    return (Path(path) / INCREMENTAL).is_file()


def _tensor_items(state: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(dotted key, tensor)`` of every tensor in a nested state dict, in a fixed order."""
    items = []
    for key in sorted(state, key=str) if isinstance(state, dict) else range(len(state)):
        value = state[key]
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            items.append((name, value))
        elif isinstance(value, (dict, list)):
            items.extend(_tensor_items(value, name + "."))
    return items


def _tensor_hash(tensor: torch.Tensor) -> str:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    data = local.detach().contiguous().cpu()
    digest = hashlib.blake2b(f"{data.dtype}{tuple(data.shape)}".encode(), digest_size=16)
    if data.numel():
        digest.update(data.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no bytes copy
    return digest.hexdigest()


def _tensor_hashes(items: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    # hashlib releases the GIL on large buffers: tensors hash (and leave the device) in parallel
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(items)))) as pool:
        return dict(zip((name for name, _ in items), pool.map(lambda item: _tensor_hash(item[1]), items)))


def _agree_changed(changed: list[bool]) -> list[bool]:
    """A tensor changed on any rank is saved by every rank (DCP saves and loads keys collectively)."""
    if not dist.is_initialized() or not changed:
        return changed
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor(changed, dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def _subset(state: dict[str, Any], keep: set[str], prefix: str = "") -> dict[str, Any]:
    """``state`` with only the tensors whose dotted key is in ``keep`` (non-tensor leaves kept)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            if name in keep:
                out[key] = value
        elif isinstance(value, dict):
            sub = _subset(value, keep, name + ".")
            if sub:
                out[key] = sub
        else:
            out[key] = value
    return out


def read_hashes(path: str | Path) -> dict[str, str]:
    """This rank's tensor hashes recorded in the full checkpoint at ``path`` ({} when absent)."""
    file = Path(path) / _HASHES.format(rank=_rank())
    return json.loads(file.read_text()) if file.is_file() else {}


def save(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    *,
    base: str | Path | None = None,
    base_hashes: dict[str, str] | None = None,
    record_hashes: bool = False,
) -> dict[str, str]:
    """Write a checkpoint of ``model`` and ``optimizer`` into ``path``. Without ``base``: a full
    checkpoint, recording this rank's tensor hashes when ``record_hashes`` (returned; {} otherwise:
    hashing reads every tensor once more). With ``base`` (a full checkpoint) and its ``base_hashes``:
    an incremental one, only the tensors whose hash differs."""
    import torch.distributed.checkpoint as dcp  # slow import (sympy): only to save or load
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    items = _tensor_items(state) if base is not None or record_hashes else []
    hashes = _tensor_hashes(items)
    if base is None:
        with _dcp_alone_quietly():
            dcp.save(state, storage_writer=_storage_writer(path))
        check_written(path)
        if record_hashes:
            (path / _HASHES.format(rank=_rank())).write_text(json.dumps(hashes))
    else:
        known = base_hashes or {}
        changed = _agree_changed([known.get(name) != digest for name, digest in hashes.items()])
        keep = {name for (name, _), c in zip(items, changed) if c}
        with _dcp_alone_quietly():
            dcp.save(_subset(state, keep), storage_writer=_storage_writer(path))
        check_written(path)
        if _rank() == 0:
            relative = os.path.relpath(published_path(base), published_path(path))
            record = {"base": relative, "changed_tensors": len(keep), "tensors": len(items)}
            (path / INCREMENTAL).write_text(json.dumps(record, indent=1))
    torch.save(rng_state(), path / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        torch.save(trainer_state, path / TRAINER_STATE)
    _barrier()
    return hashes


def _check_shapes(path: Path, model_sd: dict[str, torch.Tensor]) -> None:
    """One-line error naming the first model tensor the checkpoint lacks or has in another shape."""
    import torch.distributed.checkpoint as dcp  # slow import (sympy): only to save or load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in model_sd.items():
        key = f"model.{name}"
        stored = metadata.get(key)
        if not isinstance(stored, TensorStorageMetadata):
            raise ModelDirError(
                f"checkpoint {path} has no tensor {name!r}: it was saved from a different model "
                f"(or with/without LoRA); load a checkpoint of this model"
            )
        if tuple(stored.size) != tuple(tensor.shape):
            raise ModelDirError(
                f"checkpoint {path} tensor {name!r} has shape {tuple(stored.size)} but the model's is "
                f"{tuple(tensor.shape)}: it was saved from a different model shape"
            )


def _without_unsaved_optim_state(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``state`` less the optimizer states the checkpoint at ``path`` does not hold. A parameter that
    never had a gradient (a critic's unused ``lm_head``) had no optimizer state when saved, while
    the fresh optimizer's state dict has zeros for every parameter; loading leaves it without state
    again, as in the uninterrupted run. Model tensors stay required."""
    import torch.distributed.checkpoint as dcp  # slow import (sympy): only to save or load

    stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    keep = {name for name, _ in _tensor_items(state) if name in stored or not name.startswith("optim.state.")}
    return _subset(state, keep)


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG in place; returns the trainer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path = Path(path)
    if not (path / ".metadata").is_file() or not (path / TRAINER_STATE).is_file():
        raise ModelDirError(
            f"{path} is not an areno checkpoint (no .metadata / {TRAINER_STATE}): resume from another step_N "
            "directory or delete this one"
        )
    trainer_state = _load_state_file(path / TRAINER_STATE)  # before the weights: a damaged file fails at once
    rng_path = path / f"rng_rank{_rank()}.pt"
    # absent when resuming on more ranks than saved: RNG is then re-seeded
    rng = _load_state_file(rng_path) if rng_path.is_file() else None
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    base = incremental_base(path) if is_incremental(path) else None
    _check_shapes(base or path, model_sd)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    state = _without_unsaved_optim_state(state, base or path)
    # the optimizer's param groups stay this run's: their settings are the run's own (the backend applies
    # its ``optim`` section after loading) and their layout may differ from the checkpoint's (one group
    # before biases and norms were spared weight decay); the state of each parameter is found by its name
    groups = state.get("optim", {}).pop("param_groups", None)
    try:
        with _dcp_alone_quietly():
            _dcp_load(state, path, base)
    except BaseException as exc:  # torch's CheckpointException is a BaseException with a per-rank report
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        first = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
        raise ModelDirError(
            f"checkpoint {path} is damaged or incomplete ({type(exc).__name__}: {first}); resume from an "
            "earlier step_N directory or delete this one"
        ) from None
    if groups is not None:
        state["optim"]["param_groups"] = groups
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        # the model's tensors were all required by dcp.load above; only optimizer states may be absent
        options=StateDictOptions(strict=False),
    )
    if rng is not None:
        set_rng_state(rng)
    return trainer_state


def _load_state_file(file: Path) -> Any:
    """``torch.load(file)`` of tensors and plain values only (never arbitrary pickle); a damaged file
    is a one-line :class:`ModelDirError` naming it."""
    try:
        return torch.load(file, weights_only=True)
    except _UNLOADABLE as exc:  # torch's message would suggest weights_only=False: not repeated here
        raise ModelDirError(
            f"{file} does not load ({type(exc).__name__}: the file is damaged, or holds more than tensors and "
            "plain values); resume from an earlier step_N directory or delete this one"
        ) from None
