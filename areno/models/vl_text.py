"""The text model of a vision-language checkpoint, trained on its own with text prompts: Gemma 3 4B and
larger (``Gemma3ForConditionalGeneration``) read as ``Gemma3ForCausalLM``; Mistral Small 3.1 / 3.2 and
Ministral 3 (``Mistral3ForConditionalGeneration``) as ``MistralForCausalLM`` / ``Ministral3ForCausalLM``;
Qwen3-VL and Qwen3-VL-MoE as ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``. The vision tower and projector
are not loaded; a save writes the trained text weights beside them, copied from the checkpoint the model
came from, under that checkpoint's config.json, so that what comes out is the same vision-language
checkpoint with a new text model. ``ModelConfig.container`` carries the architecture, the whole config.json
and the directory the untrained tensors come from (``hf_io.read_config`` sets it).

Qwen3-VL's multimodal RoPE turns a text token by the same position in each of its sections, which is the
plain RoPE of its text model: its ``mrope_section`` / ``mrope_interleaved`` are dropped from the text
config, and the rollout engine's positions are the text positions."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    """How a vision-language checkpoint holds its text model."""

    text_types: dict[str, tuple[str, str]]
    """The ``model_type`` of the file's ``text_config`` -> areno's architecture of the text model and its
    ``model_type``; the first where the file gives none (the vision-language config class's default)."""
    text_prefixes: tuple[tuple[str, str], ...]
    """Disk prefix of a text tensor -> the text model's prefix (every form transformers versions wrote)."""
    other_prefixes: tuple[tuple[str, str], ...]
    """Disk prefix of a tensor the text model does not hold -> where a save writes it."""
    save_prefixes: tuple[tuple[str, str], ...]
    """The text model's prefix -> where a save writes it."""
    tie_default: bool
    """Whether the output projection is the embedding where config.json's top level does not say (the
    vision-language config class's default, which transformers 5 reads over the text config's)."""
    dropped_rope_keys: tuple[str, ...] = ()
    """Keys of the text config's RoPE dict the text positions make moot."""
    text_overrides: tuple[tuple[str, Any], ...] = ()
    """config.json keys the text model's class fixes rather than reads (Qwen3-VL-MoE always renormalises
    its top-k weights: ``norm_topk_prob``)."""
    fused_experts: bool = False
    """The checkpoint stores each layer's experts as the model holds them (``mlp.experts.gate_up_proj``
    [E, 2I, D], ``down_proj`` [E, D, I]), or those transposed (the released files: [E, D, 2I], [E, I, D]),
    not one by one."""


LAYOUTS: dict[str, Layout] = {
    # released as language_model.model.*, which transformers' save_pretrained still writes and every reader reads
    **{
        outer: Layout(
            text_types=types,
            text_prefixes=(
                ("model.language_model.", "model."),
                ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."),
            ),
            other_prefixes=(
                ("model.vision_tower.", "vision_tower."),
                ("model.multi_modal_projector.", "multi_modal_projector."),
                ("vision_tower.", "vision_tower."),
                ("multi_modal_projector.", "multi_modal_projector."),
            ),
            save_prefixes=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
            tie_default=True,
        )
        for outer, types in (
            ("Gemma3ForConditionalGeneration", {"gemma3_text": ("Gemma3ForCausalLM", "gemma3_text")}),
            (
                "Mistral3ForConditionalGeneration",
                {"mistral": ("MistralForCausalLM", "mistral"), "ministral3": ("Ministral3ForCausalLM", "ministral3")},
            ),
        )
    },
    "Qwen3VLForConditionalGeneration": Layout(
        text_types={"qwen3_vl_text": ("Qwen3ForCausalLM", "qwen3")},
        text_prefixes=(("model.language_model.", "model."),),
        other_prefixes=(("model.visual.", "model.visual."),),
        save_prefixes=(("model.", "model.language_model."),),
        tie_default=False,
        dropped_rope_keys=("mrope_section", "mrope_interleaved"),
    ),
    "Qwen3VLMoeForConditionalGeneration": Layout(
        text_types={"qwen3_vl_moe_text": ("Qwen3MoeForCausalLM", "qwen3_moe")},
        text_prefixes=(("model.language_model.", "model."),),
        other_prefixes=(("model.visual.", "model.visual."),),
        save_prefixes=(("model.", "model.language_model."),),
        tie_default=False,
        dropped_rope_keys=("mrope_section", "mrope_interleaved"),
        text_overrides=(("norm_topk_prob", True),),
        fused_experts=True,
    ),
}
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def split_config(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A vision-language config.json as (its text model's config.json dict, the container). The token ids
    and the tying of the whole model's config win over the text part's, as transformers reads them."""
    outer = d["architectures"][0]
    layout = LAYOUTS[outer]
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{outer} config.json has no 'text_config' object (the text model's keys)")
    text_type = text.get("model_type", next(iter(layout.text_types)))
    if text_type not in layout.text_types:
        raise ValueError(
            f"{outer} config.json text_config.model_type is {text_type!r}, not one of {sorted(layout.text_types)}"
        )
    arch, model_type = layout.text_types[text_type]
    flat = {**text, "architectures": [arch], "model_type": model_type}
    if "num_local_experts" in flat:  # transformers 5 writes Qwen3-VL-MoE's num_experts under its attribute map's name
        flat.setdefault("num_experts", flat["num_local_experts"])
    for key in _IDS:
        if d.get(key) is not None:
            flat[key] = d[key]
    flat.update(layout.text_overrides)
    tied = d.get("tie_word_embeddings")
    flat["tie_word_embeddings"] = layout.tie_default if tied is None else tied
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(flat.get(key), dict) and layout.dropped_rope_keys:
            flat[key] = {k: v for k, v in flat[key].items() if k not in layout.dropped_rope_keys}
    return flat, {"architecture": outer, "config": d, "text_type": text_type}


def layout_of(container: dict[str, Any]) -> Layout:
    """The ``Layout`` of ``container``'s checkpoint."""
    return LAYOUTS[container["architecture"]]


def _swap(prefixes: tuple[tuple[str, str], ...], name: str) -> str | None:
    for prefix, other in prefixes:
        if name.startswith(prefix):
            return other + name[len(prefix) :]
    return None


def text_name(container: dict[str, Any], disk: str) -> str | None:
    """The text model's name of a tensor stored as ``disk``; None for one it does not hold (the vision
    tower's, the projector's); ``disk`` itself for any other (which the loader then names as unexpected)."""
    layout = layout_of(container)
    ours = _swap(layout.text_prefixes, disk)
    if ours is not None:
        return ours
    return None if _swap(layout.other_prefixes, disk) is not None else disk


def other_name(container: dict[str, Any], disk: str) -> str | None:
    """Where a save writes a tensor the text model does not hold (stored as ``disk``); None for a text one."""
    return _swap(layout_of(container).other_prefixes, disk)


def disk_name(container: dict[str, Any], name: str) -> str:
    """The name a save writes the text model's tensor ``name`` under."""
    return _swap(layout_of(container).save_prefixes, name) or name


def to_disk_state(container: dict[str, Any] | None, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (the text model's names) under the names of its vision-language checkpoint; ``state``
    itself for a model stored alone (``container`` None)."""
    if container is None:
        return state
    return {disk_name(container, name): t for name, t in state.items()}


PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)
"""Files of the checkpoint's image processor, copied into a save beside the tokenizer's."""


def adapter_name(name: str) -> str:
    """PEFT's name on the whole model of the text model's adapter tensor ``name``
    (``base_model.model.model.layers...`` -> ``base_model.model.model.language_model.layers...``: transformers'
    module names, which PEFT matches)."""
    prefix = "base_model.model.model."
    return prefix + "language_model." + name[len(prefix) :] if name.startswith(prefix) else name


def adapter_targets(modules: list[str]) -> str:
    """PEFT's ``target_modules`` of the text model's ``modules`` on the whole model: a pattern that leaves
    the vision tower's layers of the same names (q_proj, v_proj) without adapters."""
    return r"model\.language_model\..*\.(" + "|".join(re.escape(m) for m in modules) + ")"


_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def fused_experts(container: dict[str, Any] | None) -> bool:
    """Whether ``container``'s checkpoint stores experts fused (``Layout.fused_experts``)."""
    return container is not None and layout_of(container).fused_experts


def as_held(container: dict[str, Any], name: str, tensor: Any, shape: tuple[int, ...]) -> Any:
    """``tensor`` (stored under the text model's ``name``) in the layout the model holds, ``shape``: a fused
    expert tensor of the released files transposed, any other as it is (the caller checks its shape)."""
    if fused_experts(container) and name.endswith(_FUSED) and tuple(tensor.shape) != tuple(shape):
        if tuple(tensor.shape) == (shape[0], shape[2], shape[1]):
            return tensor.transpose(1, 2)
    return tensor
