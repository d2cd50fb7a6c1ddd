"""Tensor-parallel layout of the decoder, as data (no torch.distributed here).

``tp_plan(config)`` maps Hugging Face parameter-name patterns (``fnmatch`` syntax, ``*`` matches a
layer index) to a style; the trainer's ``parallelize`` and the rollout engine's TP shards both read it,
so a weight streamed from one to the other is cut the same way.

Styles (weights are ``[out_features, in_features]`` as in ``nn.Linear``):
- ``colwise``: weight and bias split along dim 0 (output features / heads). Each rank computes its
  own heads or MLP columns; no communication. q/k/v, gate/up, and lm_head (vocab-parallel logits:
  gather them, or compute a distributed log-sum-exp).
- ``rowwise``: weight split along dim 1 (input features); each rank's output is a partial sum that
  is all-reduced. o_proj and down_proj. Their biases are ``replicate`` and added once, after the reduce.
- ``replicate``: every rank holds the full tensor: norms (including Qwen3's per-head q/k norms,
  which act inside one head) and the embedding (a vocab-parallel embedding needs a masked
  all-reduce that does not pay off at these sizes). A tied output projection is the embedding, so
  it is replicated too.

Head-split layouts need ``num_attention_heads`` and ``num_key_value_heads`` divisible by the TP
size; ``check_tp_size`` says so in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase

import torch

from areno.models.config import ModelConfig

COLWISE, ROWWISE, REPLICATE = "colwise", "rowwise", "replicate"

TPReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the tensor-parallel group and returns the sum (e.g. an all-reduce): what an
inference ``Decoder`` holding one rank's shards calls after its row-parallel projections."""
_SHARD_DIM = {COLWISE: 0, ROWWISE: 1, REPLICATE: None}


def tp_plan(config: ModelConfig) -> dict[str, str]:
    """HF parameter-name pattern -> ``colwise`` / ``rowwise`` / ``replicate`` for every tensor of the state dict
    (parameters, and the buffers an engine holds and syncs: GLM-4.5's correction bias)."""
    layer = "model.layers.*."
    plan: dict[str, str] = {
        "model.embed_tokens.weight": REPLICATE,
        f"{layer}input_layernorm.weight": REPLICATE,
        f"{layer}post_attention_layernorm.weight": REPLICATE,
        f"{layer}self_attn.q_proj.weight": COLWISE,
        f"{layer}self_attn.k_proj.weight": COLWISE,
        f"{layer}self_attn.v_proj.weight": COLWISE,
        f"{layer}self_attn.o_proj.weight": ROWWISE,
        f"{layer}mlp.gate_proj.weight": COLWISE,
        f"{layer}mlp.up_proj.weight": COLWISE,
        f"{layer}mlp.down_proj.weight": ROWWISE,
        "model.norm.weight": REPLICATE,
    }
    if config.attention_bias:
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}self_attn.{proj}.bias"] = COLWISE
    if config.attention_out_bias:
        plan[f"{layer}self_attn.o_proj.bias"] = REPLICATE
    if config.mlp_bias:
        plan[f"{layer}mlp.gate_proj.bias"] = COLWISE
        plan[f"{layer}mlp.up_proj.bias"] = COLWISE
        plan[f"{layer}mlp.down_proj.bias"] = REPLICATE
    if config.qk_norm:
        plan[f"{layer}self_attn.q_norm.weight"] = REPLICATE
        plan[f"{layer}self_attn.k_norm.weight"] = REPLICATE
    if config.norm_layout == "post":
        plan[f"{layer}post_feedforward_layernorm.weight"] = REPLICATE
    if config.norm_layout == "sandwich":
        for name in config.sandwich_norm_names:
            plan[f"{layer}{name}.weight"] = REPLICATE
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = COLWISE
    if config.num_experts:  # expert models run whole (check_tp_size): their sparse blocks are never split
        names = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if config.expert_bias:
            names += ["mlp.gate.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"]
        if config.router_scoring == "sigmoid":  # GLM-4.5's correction bias, a buffer the engine holds too
            names += ["mlp.gate.e_score_correction_bias"]
        if config.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert and its gate
            names += [f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            names += ["mlp.shared_expert_gate.weight"]
        if config.n_shared_experts:  # GLM-4.5's shared experts, whole as the rest of the block
            names += [f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        for name in names:
            plan[f"{layer}{name}"] = REPLICATE
    if config.attention_sinks:  # one per query head, split with the heads
        plan[f"{layer}self_attn.sinks"] = COLWISE
    return plan


def tp_style(plan: dict[str, str], param_name: str) -> str:
    """The style of one parameter; a name the plan does not cover is a ValueError naming it."""
    if param_name in plan:
        return plan[param_name]
    for pattern, style in plan.items():
        if fnmatchcase(param_name, pattern):
            return style
    raise ValueError(f"parameter {param_name!r} is not covered by the tensor-parallel plan")


def shard_dim(style: str) -> int | None:
    """Dimension a style splits (0 colwise, 1 rowwise), None for replicate."""
    if style not in _SHARD_DIM:
        raise ValueError(f"unknown TP style {style!r}; expected one of {sorted(_SHARD_DIM)}")
    return _SHARD_DIM[style]


def shard_tensor(full: torch.Tensor, style: str, rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a full tensor (a view; ``.contiguous()`` it before a collective).

    A 1-D tensor (bias or norm) under ``rowwise`` is never split (rowwise biases are replicate)."""
    dim = shard_dim(style)
    if dim is None or tp_size == 1 or dim >= full.dim():
        return full
    size = full.shape[dim]
    if size % tp_size:
        raise ValueError(f"dimension {dim} of size {size} is not divisible by tp_size={tp_size}")
    return full.narrow(dim, rank * (size // tp_size), size // tp_size)


def check_tp_norms(config: ModelConfig, tp_size: int) -> None:
    """One-line ValueError for q/k norms over the whole projection (OLMo 2) under ``tp_size > 1``: each
    rank holds some heads, and the norm reads all of them."""
    if tp_size > 1 and config.qk_norm and config.qk_norm_scope == "projection":
        raise ValueError(
            f"tp_size={tp_size}: {config.architecture} normalises q and k over all heads together, which "
            "tensor parallelism splits; tensor parallelism of it is not supported: use tp_size=1"
        )


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """One-line ValueError when ``tp_size`` cannot split this model's heads, MLP or vocabulary."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if config.num_experts and tp_size > 1:
        raise ValueError(
            f"tp_size={tp_size}: tensor parallelism of mixture-of-experts models ({config.architecture}) "
            "is not supported; use tp_size=1"
        )
    check_tp_norms(config, tp_size)
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field)
        if value % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide {field}={value}; pick a divisor of it")
    if not config.tie_word_embeddings and config.vocab_size % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide vocab_size={config.vocab_size} (lm_head is split by vocab); "
            "pick a divisor of it"
        )
