"""Where the two sides of ``ArenoEngine`` run, from the config: ``build_engine``.

Colocated (the default): both sides in this process, on ``cluster.device``. Inference servers
(``rollout.backend`` vllm or sglang): training in this process, rollouts from the servers. Partitioned (device
lists or a ``+`` allocation_mode, and an online recipe): both on the workers of one
``PartitionedCluster``. Nothing loads here: ``ArenoEngine.initialize`` starts the sides, the rollout
side only when the run generates (``generates``; else it is dropped unstarted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from areno.engine.api import ArenoEngine, resolve_device
from areno.engine.config import ArenoConfig
from areno.engine.host import apply_host_settings
from areno.engine.local import LocalRolloutSide, LocalTrainingSide, SleepResidency
from areno.engine.partitioned import PartitionedCluster, is_partitioned
from areno.engine.remote import RemoteRolloutSide, RemoteTrainingSide
from areno.engine.residency import Residency
from areno.engine.servers import ServerRolloutSide
from areno.launch.allocation import parse_allocation_mode


def build_engine(config: ArenoConfig, run_dir: Path) -> ArenoEngine:
    """The engine the config asks for: inference servers when ``rollout.backend`` names vllm or
    sglang, partitioned when ``is_partitioned``, else colocated."""
    if config.rollout.backend != "areno":
        return server_engine(config, run_dir)
    if is_partitioned(config):
        return partitioned_engine(config, run_dir)
    return colocated_engine(config, run_dir)


def colocated_engine(config: ArenoConfig, run_dir: Path) -> ArenoEngine:
    """Both sides in this process, on ``cluster.device`` (with the cluster's host settings applied)."""
    device = resolve_device(config.cluster.device)
    apply_host_settings(config.cluster, device.type)
    training = LocalTrainingSide(config, device, export_root=run_dir / "policy")
    rollout = LocalRolloutSide(config, device)
    # cluster.offload: what each phase of a step keeps on the shared device
    if config.cluster.offload == "sleep":
        residency = SleepResidency(training, rollout, device)
    else:
        residency = Residency(device)
    return ArenoEngine(config, run_dir, training=training, rollout=rollout, residency=residency, shared_device=device)


def server_engine(config: ArenoConfig, run_dir: Path) -> ArenoEngine:
    """Training in this process, rollouts from vLLM or SGLang servers (``ServerRolloutSide``); the
    policy travels as a safetensors export. On CUDA the training device is the allocation's train
    component's first (the servers take the devices before it)."""
    device = resolve_device(config.cluster.device)
    mode = config.cluster.allocation_mode
    if device.type == "cuda" and mode is not None:
        alloc = parse_allocation_mode(mode)
        train = next(c for c in alloc.components if c.kind == "train")
        device = torch.device("cuda", alloc.device_lists(torch.cuda.device_count())[train.role][0])
        # the training backends take "cuda", the current device: make it the train component's (it
        # stayed cuda:0, which the servers hold)
        torch.cuda.set_device(device)
    apply_host_settings(config.cluster, device.type)
    training = LocalTrainingSide(config, device, export_root=run_dir / "policy", measure_rollout_logprobs=True)
    return ArenoEngine(config, run_dir, training=training, rollout=ServerRolloutSide(config, run_dir))


def partitioned_engine(
    config: ArenoConfig,
    run_dir: Path,
    *,
    scheduler: Any = None,
    device_capacity: dict[int, int] | int | None = None,
) -> ArenoEngine:
    """Both sides on the workers of one ``PartitionedCluster`` (its layout is validated here: a
    ``LayoutError`` before anything loads). ``scheduler`` and ``device_capacity``: as
    ``PartitionedCluster``."""
    cluster = PartitionedCluster(config, run_dir, scheduler=scheduler, device_capacity=device_capacity)
    return ArenoEngine(config, run_dir, training=RemoteTrainingSide(cluster), rollout=RemoteRolloutSide(cluster))
