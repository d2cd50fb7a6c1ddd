"""LoRA adapters through ``peft`` on the plain decoder, and merged-weight export.

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` with a LoRA layer in place
(its weight moves to ``<name>.base_layer.weight``) and freezes everything but the adapters, so the
optimizer only ever sees adapter parameters. Policy sync and HF export need the merged weights
under the original HF names: ``W = W0 + (alpha / r) * B @ A``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from areno.train.config import LoraConfig

ADAPTER = "default"


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Inject adapters into ``model`` in place; only adapter parameters stay trainable."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = [t for t in cfg.target_modules if t not in names]
    if unknown:
        raise ValueError(
            f"lora.target_modules {unknown} match no linear layer of the model; "
            f"choose from {sorted(names)}"
        )
    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )
    inject_adapter_in_model(peft_cfg, model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def has_lora(model: torch.nn.Module) -> bool:
    return any(isinstance(m, LoraLayer) for m in model.modules())


def merged_named_weights(
    model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full weights with adapters merged; ``full`` turns a (sharded) tensor into a full one.

    Yields in state-dict order; adapter tensors themselves are not yielded.
    """
    lora_modules = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in lora_modules and leaf == "weight":
            layer = lora_modules[owner]
            a_RD = full(layer.lora_A[ADAPTER].weight.detach())
            b_OR = full(layer.lora_B[ADAPTER].weight.detach())
            w0 = full(tensor.detach())
            delta = (b_OR.float() @ a_RD.float()) * layer.scaling[ADAPTER]
            yield f"{owner}.weight", (w0.float() + delta).to(w0.dtype)
        elif owner in lora_modules:
            yield f"{owner}.{leaf}", full(tensor.detach())
        else:
            yield name, full(tensor.detach())
