"""Checkpoints that store a layer's q/k/v projections as one tensor and its gate/up projections as
another (Phi-3: ``self_attn.qkv_proj``, ``mlp.gate_up_proj``), against the ``Decoder``'s separate
``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj``.

Only files use the packed names: ``hf_io.save_state`` writes them (what transformers loads) and
``hf_io.load_model`` and the engine's disk reload split them. In memory, in policy syncs and in
LoRA the tensors stay separate; vLLM and SGLang load the separate names into their packed layers
themselves, as they do for Llama.
"""

from __future__ import annotations

import torch

from areno.models.config import ModelConfig

PACKED_ARCHITECTURES = ("Phi3ForCausalLM",)


def packed_names(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """On-disk packed name -> its parts in row order, ``(in-memory name, rows)``; {} for other layouts."""
    if getattr(config, "architecture", None) not in PACKED_ARCHITECTURES:
        return {}
    dh = config.head_dim
    q, kv, inter = config.num_attention_heads * dh, config.num_key_value_heads * dh, config.intermediate_size
    out: dict[str, list[tuple[str, int]]] = {}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"{attn}qkv_proj.weight"] = [
            (f"{attn}q_proj.weight", q),
            (f"{attn}k_proj.weight", kv),
            (f"{attn}v_proj.weight", kv),
        ]
        out[f"{mlp}gate_up_proj.weight"] = [(f"{mlp}gate_proj.weight", inter), (f"{mlp}up_proj.weight", inter)]
    return out


def split_packed(parts: list[tuple[str, int]], tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One packed tensor as its ``parts`` (row slices, views); a row count that does not add up is a
    ValueError naming the expected split."""
    rows = [n for _, n in parts]
    if tensor.dim() != 2 or tensor.shape[0] != sum(rows):
        raise ValueError(
            f"a packed tensor of shape {tuple(tensor.shape)} does not split into rows {rows} "
            f"({', '.join(name for name, _ in parts)}): the checkpoint does not match config.json"
        )
    return [(name, t) for (name, _), t in zip(parts, tensor.split(rows), strict=True)]


def to_disk_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder state dict under the checkpoint's names: each layer's parts concatenated into its packed
    tensor (in the first part's place), every other tensor unchanged."""
    packed = packed_names(config)
    if not packed:
        return state
    first = {parts[0][0]: disk for disk, parts in packed.items()}
    member = {name for parts in packed.values() for name, _ in parts}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in first:
            disk = first[name]
            out[disk] = torch.cat([state[part] for part, _ in packed[disk]])
        elif name not in member:
            out[name] = t
    return out


def to_memory_items(config: ModelConfig, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs read from a checkpoint with each packed tensor split into its parts;
    separate names (a sync's files) pass as they are."""
    packed = packed_names(config)
    if not packed:
        return list(items)
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in items:
        out.extend(split_packed(packed[name], t) if name in packed else [(name, t)])
    return out
