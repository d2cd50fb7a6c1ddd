"""Training backends: the ``TrainBackend`` contract, its FSDP2 and single-process implementations,
token-budget packing, optimizer/schedules, DCP checkpoints, sleep/wake and LoRA."""

from areno.train.base import Reducer, TrainBackend
from areno.train.config import LoraConfig, TrainBackendConfig
from areno.train.fsdp import FSDP2TrainBackend
from areno.train.local import LocalTrainBackend
from areno.train.packing import MicroBatchPlan, MicroBatchSpec, plan_micro_batches

__all__ = [
    "FSDP2TrainBackend",
    "LocalTrainBackend",
    "LoraConfig",
    "MicroBatchPlan",
    "MicroBatchSpec",
    "Reducer",
    "TrainBackend",
    "TrainBackendConfig",
    "plan_micro_batches",
]
