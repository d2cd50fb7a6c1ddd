"""Policy sync: move the trained policy into the rollout engine and bump its version.

Transports (``PolicySyncTransport.sync(version) -> SyncStats``):
- ``InPlaceTransport`` (colocated: the engine reads the trained tensors; a cast copy at most),
- ``StreamTransport`` (bucketed device-to-device over torch.distributed: NCCL on GPU, gloo on CPU),
- ``DiskTransport`` (HF safetensors published atomically; receivers load from disk).
The contract between trainer and engine is narrow: a ``WeightSource`` on the train side, a
``ShardReceiver`` described by one ``ShardSpec`` per tensor on the rollout side: a staged one
(the engine generates during the transfer; atomic) or a live one (``commit="inplace"``: written
straight into a paused engine; fastest; a failed sync leaves it refusing to generate until the next).
"""

from areno.sync.base import (
    COMMIT_MODES,
    METRIC_NAMES,
    LiveReceiver,
    NamedTensorSource,
    PolicySyncError,
    PolicySyncTransport,
    ShardReceiver,
    ShardSpec,
    StagedReceiver,
    SyncStats,
    WeightSource,
    copy_into,
    engine_receiver,
    swap_into,
)
from areno.sync.disk import DiskTransport, latest_policy
from areno.sync.inplace import InPlaceTransport
from areno.sync.plan import SyncPlan, assign_rows, choose_relays, plan_buckets, shard_specs_from_tp_plan
from areno.sync.stream import StreamSyncConfig, StreamTopology, StreamTransport, vote_backend

__all__ = [
    "COMMIT_MODES",
    "METRIC_NAMES",
    "DiskTransport",
    "InPlaceTransport",
    "LiveReceiver",
    "NamedTensorSource",
    "PolicySyncError",
    "PolicySyncTransport",
    "ShardReceiver",
    "ShardSpec",
    "StagedReceiver",
    "StreamSyncConfig",
    "StreamTopology",
    "StreamTransport",
    "SyncPlan",
    "SyncStats",
    "WeightSource",
    "assign_rows",
    "choose_relays",
    "copy_into",
    "engine_receiver",
    "latest_policy",
    "plan_buckets",
    "shard_specs_from_tp_plan",
    "swap_into",
    "vote_backend",
]
