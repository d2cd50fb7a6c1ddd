"""Shared-storage probe, run before training starts.

Checkpoints and data must be visible from every node. For each path the controller writes a
probe file with a random token; every worker of every role (through the scheduler, so on its
own node) reads that file back, checks the token and writes a file of its own; the controller
then reads every worker's file. A path on node-local disk, a missing mount or a read-only
bucket therefore fails here, with the node and the path named, instead of at the first
checkpoint hours later.

Local and network file systems (NFS, Lustre, ...) are probed with ``os`` calls and an
``fsync``; URLs (``s3://``, ``gs://``, ``memory://``, ...) go through fsspec as objects
(write, read, delete; no directories), which needs fsspec and the protocol's package.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import shlex
import socket
from collections.abc import Sequence
from typing import Any

from areno.errors import ConfigError

__all__ = ["StorageCheckError", "check_exists", "check_shared_storage", "probe_path"]

_PROBE_DIR = ".areno-storage-probe"


class StorageCheckError(ConfigError):
    """A path that is not readable and writable from every node; the message names node and path."""


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _fs(path: str) -> Any:
    try:
        import fsspec
    except ImportError:
        raise StorageCheckError(
            f"storage path {path!r} is a URL and needs fsspec (plus the protocol's package, e.g. s3fs "
            f"for s3://): pip install fsspec s3fs, or use a shared file-system path"
        ) from None
    try:
        fs, _ = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise StorageCheckError(f"storage path {path!r}: {e}") from None
    return fs


def _write(path: str, text: str) -> None:
    if _is_url(path):
        _fs(path).pipe_file(path, text.encode())
        return
    path = path.removeprefix("file://")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read(path: str) -> str:
    if _is_url(path):
        return _fs(path).cat_file(path).decode()
    with open(path.removeprefix("file://")) as f:
        return f.read()


def _remove_tree(path: str) -> None:
    if _is_url(path):
        fs = _fs(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        return
    import shutil

    local = path.removeprefix("file://")
    shutil.rmtree(local, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(local))  # .areno-storage-probe, when no other probe runs
    except OSError:
        pass  # not empty (a concurrent probe) or already gone


def check_exists(path: str) -> None:
    """StorageCheckError (one line) unless the local path ``path`` is an existing directory."""
    local = path.removeprefix("file://")
    if os.path.isdir(local):
        return
    if os.path.exists(local):
        raise StorageCheckError(f"storage path {path!r} is not a directory: give the directory to check")
    parent = os.path.dirname(os.path.abspath(local))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    raise StorageCheckError(
        f"storage path {path!r} does not exist (its nearest existing directory is {parent!r}): create it first "
        f"(mkdir -p {shlex.quote(local)}) or fix the path"
    )


def probe_path(probe_dir: str, token: str, label: str) -> tuple[str, str, str | None]:
    """Worker side: read the controller's token, write our own file.

    Returns ``(host, our_file, error)``; errors are returned, not raised, so that the controller
    reports every node in one message."""
    host = socket.gethostname()
    mine = posixpath.join(probe_dir, f"{label}-{host}-{os.getpid()}")
    theirs = posixpath.join(probe_dir, "controller")
    try:
        seen = _read(theirs)
    except (OSError, StorageCheckError) as e:
        return host, mine, f"cannot read {theirs!r} written by the controller ({type(e).__name__}: {e})"
    if seen != token:
        return host, mine, f"reads a different {theirs!r} than the controller wrote (not the same storage)"
    try:
        _write(mine, token + " " + label)
    except (OSError, StorageCheckError) as e:
        return host, mine, f"cannot write {mine!r} ({type(e).__name__}: {e})"
    return host, mine, None


def check_shared_storage(
    paths: Sequence[str],
    scheduler: Any | None = None,
    roles: Sequence[str] | None = None,
    *,
    must_exist: bool = False,
) -> None:
    """Check that every path is readable and writable from the controller and from every worker.

    ``scheduler`` is a ``Scheduler`` whose workers already run (None checks this node only);
    ``roles`` defaults to all of its roles. Raises ``StorageCheckError`` naming each failing
    node and path. The probe is a temporary ``.areno-storage-probe/<token>`` directory under each
    path, removed afterwards; a missing local path is created, unless ``must_exist`` (a check
    that must not create what it checks, ``areno launch storage``) makes it an error."""
    controller = socket.gethostname()
    roles = list(roles if roles is not None else (scheduler.roles if scheduler is not None else []))
    for path in paths:
        if _is_url(path):
            _fs(path)  # fsspec and the protocol's package must import here first
        elif must_exist:
            check_exists(path)
        token = secrets.token_hex(8)
        probe_dir = posixpath.join(path.rstrip("/"), _PROBE_DIR, token)
        try:
            _write(posixpath.join(probe_dir, "controller"), token)
            if _read(posixpath.join(probe_dir, "controller")) != token:
                raise StorageCheckError(f"node {controller!r} (controller) reads back other data under {path!r}")
        except OSError as e:
            raise StorageCheckError(
                f"shared storage check failed: node {controller!r} (controller) cannot write under {path!r} "
                f"({type(e).__name__}: {e}); create the directory or fix its permissions"
            ) from None
        errors: list[str] = []
        try:
            for role in roles:
                handles = scheduler.workers(role)
                results = scheduler.call_each(role, probe_path, [(probe_dir, token, h.name) for h in handles])
                for h, (host, mine, err) in zip(handles, results):
                    if err is not None:
                        errors.append(f"node {host!r} ({h.name}) {err}")
                        continue
                    try:
                        ok = _read(mine) == f"{token} {h.name}"
                    except OSError as e:
                        ok, err = False, f"{type(e).__name__}: {e}"
                    if not ok:
                        errors.append(
                            f"node {controller!r} (controller) cannot read {mine!r} written by {h.name} on "
                            f"{host!r}{f' ({err})' if err else ''}"
                        )
        finally:
            _remove_tree(probe_dir)
        if errors:
            raise StorageCheckError(
                f"shared storage check failed for {path!r}: "
                + "; ".join(errors)
                + "; put checkpoints and data on storage every node mounts (NFS/Lustre) or an object store URL"
            )
