"""DTensor checks that do not import ``torch.distributed.tensor``.

Importing it is slow (it pulls in sympy), and a one-process run that makes no DTensor does not
need it before its first rollout token. No tensor can be a DTensor before that module is imported,
so the checks look it up in ``sys.modules`` instead of importing it; the code that makes DTensors
(``parallelize``, ``expert_parallel``) imports it where it runs.
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(t: object) -> bool:
    """``isinstance(t, DTensor)``, without importing DTensor's module when nothing imported it yet."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``to_local()``, differentiable); any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t
