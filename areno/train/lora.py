"""LoRA adapters through ``peft`` on the plain decoder, and merged-weight export.

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` with a LoRA layer in place
(its weight moves to ``<name>.base_layer.weight``) and freezes everything but the adapters, so the
optimizer only ever sees adapter parameters (so its state is adapter-only). Two exports:

- **merged**: the full weights under the original HF names, ``W = W0 + (alpha / r) * B @ A``, for a
  rollout engine that knows nothing about adapters and for HF export;
- **adapter-only**: just the A/B matrices under PEFT's names (``base_model.model.<module>.lora_A.weight``),
  a few MB instead of the whole model, for policy sync to an engine that keeps the base weights and
  applies ``(alpha / r) * B @ A`` itself, and for ``PeftModel.from_pretrained`` on disk.

``peft`` is imported on first use (``apply_lora``, ``save_adapter``): it pulls in much of
``transformers`` (~3 s on a laptop CPU), which every process without LoRA would otherwise pay at start.

Legend: R = adapter rank, D = input features, O = output features.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from areno.errors import check_config
from areno.models import vl_text
from areno.models.config import ModelConfig
from areno.models.packed_projections import pack_adapter, packed_target_modules, unpacked_target_modules
from areno.train.config import UNADAPTABLE, LoraConfig

logger = logging.getLogger(__name__)

ADAPTER = "default"
HEAD_FILE = "score.safetensors"
"""Beside a wrapped role's saved adapter: the head the wrapper adds (``score.weight``, ``score.bias``),
trained in full, which the adapter cannot carry."""


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Inject adapters into ``model`` in place; only adapter parameters stay trainable. A packed layer's
    name (Phi-3's ``qkv_proj``, GLM-4's ``gate_up_proj``) adapts its parts."""
    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig):
        cfg = dataclasses.replace(cfg, target_modules=tuple(unpacked_target_modules(config, cfg.target_modules)))
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names.discard(UNADAPTABLE)  # refused by LoraConfig: its weight is read, the module never called
    unknown = [t for t in cfg.target_modules if t not in names]
    check_config(
        not unknown,
        "train.lora.target_modules",
        f"{unknown} match no linear layer of the model; choose from {sorted(names)}",
    )
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    targeted = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in cfg.target_modules
    ]
    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )
    expert_model = any(".experts" in n for n, _ in model.named_modules())
    try:
        inject_adapter_in_model(peft_cfg, model)
    except ValueError as exc:
        # peft reads a transformers 5 expert model's MLP names (GLM-4.5's, OLMoE's, Qwen3-MoE's, Mixtral's w1/w3)
        # as its fused experts' and refuses a gate without its up projection before adapting anything
        check_config(
            False,
            "train.lora.target_modules",
            f"{list(cfg.target_modules)}: peft refuses them ({exc}); " + _advice(expert_model),
        )
    _check_adapted(model, cfg, targeted)
    mlp = [n for n in targeted if ".mlp." in n]
    if mlp and expert_model:
        # Qwen2-MoE: MLP names adapt its shared experts and dense layers; a user may expect the routed ones too
        logger.info(
            "LoRA: %d MLP layers adapted (shared experts and dense layers, e.g. %s); the routed experts stay frozen",
            len(mlp),
            mlp[0],
        )
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def _check_adapted(model: torch.nn.Module, cfg: LoraConfig, targeted: list[str]) -> None:
    """Refuse adapters areno cannot merge, or names peft left unadapted. On a mixture-of-experts model
    peft reads MLP names as the experts' fused 3-D weights (its ``ParamWrapper``), whose delta no merged
    export or policy sync carries, and then skips the dense layers' linear layers of those names."""
    layers = lora_layers(model)
    other = {n: type(m.get_base_layer()).__name__ for n, m in layers.items()}
    other = {n: kind for n, kind in other.items() if kind != "Linear"}
    missed = [n for n in targeted if n not in layers]
    if not other and not missed:
        return
    experts = any(".experts" in n for n in other)
    check_config(
        False,
        "train.lora.target_modules",
        f"{list(cfg.target_modules)} put adapters on layers that are not linear "
        f"({', '.join(f'{n}: {kind}' for n, kind in sorted(other.items())[:2]) or 'none'}"
        f"{'; the fused experts of an expert model' if experts else ''}) and left linear layers of those names "
        f"without one ({', '.join(missed[:2]) or 'none'}): areno merges adapters of linear layers only; "
        + _advice(experts),
    )


def _advice(experts: bool) -> str:
    """What to target instead, on an expert model or another."""
    if experts:
        return "target the attention projections (q_proj,k_proj,v_proj,o_proj) of an expert model"
    return "target names only linear layers have (a vision tower's patch_embed.proj is a convolution)"


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``name -> module`` of each peft LoRA layer in ``model`` (none while peft was never imported:
    no LoRA layer can exist before it is)."""
    lora = sys.modules.get("peft.tuners.lora")
    if lora is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, lora.LoraLayer)}


def merged_named_weights(
    model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full weights with adapters merged; ``full`` turns a (sharded) tensor into a full one.

    Yields in state-dict order; adapter tensors themselves are not yielded.
    """
    lora_modules = lora_layers(model)
    # keep_vars: the parameters themselves, detached once after ``full`` (a DTensor's detach is a
    # dispatched op; two per tensor were most of a one-rank sync's read of the weights)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in lora_modules and leaf == "weight":
            layer = lora_modules[owner]
            a_RD = full(layer.lora_A[ADAPTER].weight).detach()
            b_OR = full(layer.lora_B[ADAPTER].weight).detach()
            w0 = full(tensor).detach()
            delta = (b_OR.float() @ a_RD.float()) * layer.scaling[ADAPTER]
            yield f"{owner}.weight", (w0.float() + delta).to(w0.dtype)
        elif owner in lora_modules:
            yield f"{owner}.{leaf}", full(tensor).detach()
        else:
            yield name, full(tensor).detach()


def adapter_scaling(cfg: LoraConfig) -> float:
    """The factor on ``B @ A`` in the merged weight: ``alpha / rank``."""
    return cfg.alpha / cfg.rank


def adapter_named_weights(
    model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor], *, decoder_prefix: str = ""
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsharded) adapter tensors under PEFT's saved names, in state-dict order:
    ``base_model.model.<HF module>.lora_A.weight`` [R, D] and ``...lora_B.weight`` [O, R]
    (unscaled; the merged weight is ``W0 + adapter_scaling * B @ A``). ``decoder_prefix``: where a
    wrapper (a value head) holds the decoder, e.g. ``"decoder."``; it is left out of the names, so
    the adapter loads onto the base model."""
    marker = f".{ADAPTER}."
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            hf_name = name.removeprefix(decoder_prefix).replace(marker, ".")
            yield "base_model.model." + hf_name, full(tensor.detach())


def head_named_weights(
    model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor], *, decoder_prefix: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors a wrapper adds around the decoder at ``decoder_prefix`` (a value or score head's
    ``score.weight``, ``score.bias``), under the wrapper's names; nothing for a bare decoder."""
    if not decoder_prefix:
        return
    for name, tensor in model.state_dict().items():
        if not name.startswith(decoder_prefix):
            yield name, full(tensor.detach())


def save_adapter(
    path: str | Path,
    weights: dict[str, torch.Tensor],
    cfg: LoraConfig,
    base_model: str | Path,
    head: dict[str, torch.Tensor] | None = None,
    model_config: ModelConfig | None = None,
) -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's layout) under ``path``,
    and a wrapped role's ``head`` (``head_named_weights``) as ``HEAD_FILE`` beside them. With a
    ``model_config`` whose checkpoints pack projections (Phi-3), the parts' adapters are written as
    adapters of the packed layers (``packed_projections.pack_adapter``); of a vision-language checkpoint's
    text model (``vl_text``), as adapters of that model's text layers only."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    from peft import LoraConfig as PeftLoraConfig

    targets, ranks, alphas = list(cfg.target_modules), {}, {}
    if model_config is not None:
        weights, ranks, alphas = pack_adapter(model_config, weights, cfg.rank, cfg.alpha)
        targets = packed_target_modules(model_config, cfg.target_modules)
    if model_config is not None and model_config.container is not None:  # the text model of a whole checkpoint
        weights = {vl_text.adapter_name(k): v for k, v in weights.items()}
        targets = vl_text.adapter_targets(targets)
    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(out / "adapter_model.safetensors"))
    if head:  # kept out of the adapter file, which PEFT reads as adapter tensors only
        save_file({k: v.contiguous().cpu() for k, v in head.items()}, str(out / HEAD_FILE))
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        rank_pattern=ranks,
        alpha_pattern=alphas,
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_model),
    )
    peft_cfg.save_pretrained(str(out))
    return out


def model_config_of(model: torch.nn.Module) -> ModelConfig | None:
    """The ``ModelConfig`` of the decoder inside ``model`` (itself, or wrapped), or None."""
    return next((m.config for m in model.modules() if isinstance(getattr(m, "config", None), ModelConfig)), None)
