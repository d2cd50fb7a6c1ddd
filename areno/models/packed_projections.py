"""Checkpoints that store a layer's q/k/v projections as one tensor and its gate/up projections as
another (Phi-3: ``self_attn.qkv_proj``, ``mlp.gate_up_proj``; GLM-4: ``mlp.gate_up_proj`` only), against the
``Decoder``'s separate ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj``.

Only files use the packed names: ``hf_io.save_state`` writes them (what transformers loads) and
``hf_io.load_model`` and the engine's disk reload split them; a LoRA adapter's export packs the
adapters of the parts into one of the packed layer (``pack_adapter``). In memory, in policy syncs and
in training the tensors stay separate; vLLM and SGLang load the separate names into their packed layers
themselves, as they do for Llama.
"""

from __future__ import annotations

import torch

from areno.models.config import ModelConfig

PACKED_ARCHITECTURES = ("Phi3ForCausalLM", "Glm4ForCausalLM")
_PACKED_QKV = ("Phi3ForCausalLM",)


def packed_names(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """On-disk packed name -> its parts in row order, ``(in-memory name, rows)``; {} for other layouts."""
    if getattr(config, "architecture", None) not in PACKED_ARCHITECTURES:
        return {}
    dh = config.head_dim
    q, kv, inter = config.num_attention_heads * dh, config.num_key_value_heads * dh, config.intermediate_size
    out: dict[str, list[tuple[str, int]]] = {}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        if config.architecture in _PACKED_QKV:
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


def pack_adapter(
    config: ModelConfig, weights: dict[str, torch.Tensor], rank: int, alpha: float
) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, float]]:
    """PEFT adapters (``base_model.model.<module>.lora_A.weight`` [r, D], ``lora_B.weight`` [N, r]) of the
    parts of a packed layer as one adapter of the packed layer, which is what a checkpoint's model has:
    A the parts' A stacked [k r, D], B block-diagonal [sum N, k r] (zero rows for an unadapted part), so
    B A is each part's own product in its rows. Its rank is k r, so its alpha is k x ``alpha`` (PEFT
    scales by alpha / rank). Returns the weights and the ``rank_pattern`` / ``alpha_pattern`` entries."""
    packed = packed_names(config)
    if not packed:
        return weights, {}, {}
    prefix, out = "base_model.model.", dict(weights)
    ranks: dict[str, int] = {}
    for disk, parts in packed.items():
        modules = [part.removesuffix(".weight") for part, _ in parts]
        adapted = [i for i, m in enumerate(modules) if f"{prefix}{m}.lora_A.weight" in weights]
        if not adapted:
            continue
        a = [out.pop(f"{prefix}{modules[i]}.lora_A.weight") for i in adapted]
        b = {i: out.pop(f"{prefix}{modules[i]}.lora_B.weight") for i in adapted}
        rows = [n for _, n in parts]
        block = torch.zeros(sum(rows), len(adapted) * rank, dtype=a[0].dtype)
        for j, i in enumerate(adapted):
            start = sum(rows[:i])
            block[start : start + rows[i], j * rank : (j + 1) * rank] = b[i]
        layer = disk.removesuffix(".weight")
        out[f"{prefix}{layer}.lora_A.weight"] = torch.cat(a)
        out[f"{prefix}{layer}.lora_B.weight"] = block
        ranks[layer.rsplit(".", 1)[-1]] = len(adapted) * rank
    return out, ranks, {name: alpha * r / rank for name, r in ranks.items()}


def packed_target_modules(config: ModelConfig, target_modules: tuple[str, ...]) -> list[str]:
    """``target_modules`` with the names of packed parts replaced by their packed layer's (``q_proj`` ->
    ``qkv_proj``), in order, each once: what PEFT finds in a checkpoint's model."""
    packed = packed_names(config)
    by_part = {
        part.removesuffix(".weight").rsplit(".", 1)[-1]: disk.removesuffix(".weight").rsplit(".", 1)[-1]
        for disk, parts in packed.items()
        for part, _ in parts
    }
    return list(dict.fromkeys(by_part.get(name, name) for name in target_modules))


def unpacked_target_modules(config: ModelConfig, target_modules: tuple[str, ...]) -> list[str]:
    """``target_modules`` with a packed layer's name (``gate_up_proj``, ``qkv_proj``: what transformers and peft
    call them in a checkpoint's model) replaced by its parts' names (``gate_proj``, ``up_proj``), in order, each
    once: the modules areno's decoder adapts."""
    parts: dict[str, list[str]] = {}
    for disk, members in packed_names(config).items():
        leaf = disk.removesuffix(".weight").rsplit(".", 1)[-1]
        parts.setdefault(leaf, [m.removesuffix(".weight").rsplit(".", 1)[-1] for m, _ in members])
    out: list[str] = []
    for name in target_modules:
        out.extend(parts.get(name, [name]))
    return list(dict.fromkeys(out))
