"""What a compiled decoder layer runs eagerly, behind a graph break (``torch.compiler.disable``): the reads a graph
would specialise on, once per layer. ``moe`` imports this module only while dynamo traces, since
``torch.compiler.disable`` imports dynamo, which a start-up before the first rollout token does without."""

from __future__ import annotations

import torch

from areno.models import moe

grouped_experts = torch.compiler.disable(moe.grouped_experts)
"""``moe.grouped_experts``, whose per-expert counts are read on the host: traced, each count would be a guard."""


@torch.compiler.disable
def record_routes(block: moe.SparseMoE, experts_TK: torch.Tensor, used_TK: torch.Tensor | None) -> None:
    """A sparse block's routes into its record: traced, ``layer_idx`` and the record's contents would be guards."""
    block.record.add(block.layer_idx, experts_TK, used_TK=used_TK)
