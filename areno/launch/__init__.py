"""Placement and launch: ``allocation_mode`` strings, the Scheduler API (local, Ray, SLURM) and the
shared-storage probe. ``scheduler_from_config`` builds the scheduler a config names; Ray itself is
imported only when a Ray scheduler is built."""

from areno.launch.allocation import AllocationMode, AllocationModeError, Component, map_roles, parse_allocation_mode
from areno.launch.factory import scheduler_from_config
from areno.launch.scheduler import (
    LocalScheduler,
    RoleSpec,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    WorkerDiedError,
    WorkerError,
    WorkerHandle,
    scheduler_config,
)
from areno.launch.storage import StorageCheckError, check_shared_storage

__all__ = [
    "AllocationMode",
    "AllocationModeError",
    "Component",
    "LocalScheduler",
    "RoleSpec",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "StorageCheckError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerHandle",
    "check_shared_storage",
    "main",
    "map_roles",
    "parse_allocation_mode",
    "scheduler_config",
    "scheduler_from_config",
]


def main(argv: list[str] | None = None) -> int:
    """``areno launch allocation STRING [--devices N]`` prints the device lists as JSON;
    ``areno launch storage PATH...`` probes paths from this node. User errors: one line, exit 2."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="areno launch", description=main.__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_alloc = sub.add_parser("allocation", help="parse an allocation_mode string and print its device lists")
    p_alloc.add_argument("allocation_mode")
    p_alloc.add_argument("--devices", type=int, default=None, help="devices available (default: what it needs)")
    p_store = sub.add_parser("storage", help="check that paths are writable and readable from this node")
    p_store.add_argument("paths", nargs="+")
    ns = parser.parse_args(argv)
    try:
        if ns.cmd == "allocation":
            alloc = parse_allocation_mode(ns.allocation_mode)
            out = {
                "allocation_mode": str(alloc),
                "world_size": alloc.world_size,
                "colocated": alloc.colocated,
                "device_lists": alloc.device_lists(ns.devices if ns.devices is not None else alloc.world_size),
            }
            print(json.dumps(out))
        else:
            check_shared_storage(ns.paths)
            print(json.dumps({"ok": ns.paths}))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
