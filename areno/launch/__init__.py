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
    "map_roles",
    "parse_allocation_mode",
    "scheduler_config",
    "scheduler_from_config",
]
