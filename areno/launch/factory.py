"""``scheduler_from_config``: the scheduler that ``cluster.scheduler`` names, built from its
``SchedulerConfig``. It sits above the three implementations, which import only the Scheduler API
(``areno.launch.scheduler``), never each other."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from areno.launch.ray_scheduler import RayScheduler
from areno.launch.scheduler import LocalScheduler, Scheduler, SchedulerConfig, scheduler_config
from areno.launch.slurm import SlurmScheduler

__all__ = ["scheduler_from_config"]


def scheduler_from_config(cfg: SchedulerConfig | Mapping[str, Any]) -> Scheduler:
    """Build the scheduler named by ``cfg.type`` (a ``SchedulerConfig`` or a plain mapping with
    ``type`` and options). SchedulerError (one line) when Ray or the SLURM tools are missing, a
    Ray address does not answer or no SLURM controller does."""
    if not isinstance(cfg, SchedulerConfig):
        options = dict(cfg)
        cfg = scheduler_config(options.pop("type", "local"), options)
    if cfg.type == "local":
        return LocalScheduler(connect_timeout_s=cfg.connect_timeout_s, log_dir=cfg.log_dir)
    if cfg.type == "ray":
        return RayScheduler(
            address=cfg.ray_address,
            connect_timeout_s=cfg.ray_connect_timeout_s,
            placement_strategy=cfg.ray_placement_strategy,
            cpus_per_worker=cfg.ray_cpus_per_worker,
            placement_timeout_s=cfg.ray_placement_timeout_s,
            log_dir=cfg.log_dir,
        )
    return SlurmScheduler(cfg)
