"""The text model of a vision-language checkpoint, trained on its own: Gemma 3 4B and larger
(``Gemma3ForConditionalGeneration``) read as their text architecture (``Gemma3ForCausalLM``), whose
prompts are text. The vision tower and the projector are not loaded; a save writes the trained text
weights beside them, copied from the checkpoint the model came from, with the whole model's config.json,
so that what comes out is the same vision-language checkpoint with a new text model.

On disk the text model's tensors sit under ``language_model.model.`` (the checkpoints Gemma 3 was released
in, and what transformers' ``save_pretrained`` writes still) or ``model.language_model.`` (transformers'
module names since 4.52); areno reads both and writes the first, which every transformers version, vLLM
and SGLang read. ``ModelConfig.container`` carries the rest of config.json and
the directory the untrained tensors come from (``hf_io.read_config`` sets it)."""

from __future__ import annotations

import re
from typing import Any

TEXT_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),
}
"""Vision-language architecture -> (its text architecture, the text config's model_type)."""

_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
"""Disk prefix of a text tensor -> the text model's prefix."""
_OTHER_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.", "vision_tower."),
    ("multi_modal_projector.", "multi_modal_projector."),
)
"""Disk prefix of a tensor the text model does not hold -> where a save writes it."""
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def split_config(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A vision-language config.json as (its text model's config.json dict, the container: the
    architecture and every other key). The token ids and the tying of the whole model's config win over
    the text part's, as transformers reads them."""
    outer = d["architectures"][0]
    arch, model_type = TEXT_ARCHITECTURES[outer]
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{outer} config.json has no 'text_config' object (the text model's keys)")
    if text.get("model_type", model_type) != model_type:
        raise ValueError(f"{outer} config.json text_config.model_type is {text['model_type']!r}, not {model_type!r}")
    flat = {**text, "architectures": [arch], "model_type": model_type}
    for key in (*_IDS, "tie_word_embeddings"):
        if d.get(key) is not None:
            flat[key] = d[key]
    rest = {k: v for k, v in d.items() if k not in ("text_config", "architectures")}
    return flat, {"architecture": outer, "config": rest}


def nest_config(text: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """The whole model's config.json from its text model's (``ModelConfig.to_hf``) and the container."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    out = {"architectures": [container["architecture"]], **container["config"], "text_config": text}
    for key in (*_IDS, "tie_word_embeddings"):
        if key in container["config"]:
            out[key] = text[key]
    return out


def text_name(disk: str) -> str | None:
    """The text model's name of a tensor stored as ``disk``; None for one it does not hold (the vision
    tower's, the projector's); ``disk`` itself for any other (which the loader then names as unexpected)."""
    for prefix, ours in _TEXT_PREFIXES:
        if disk.startswith(prefix):
            return ours + disk[len(prefix) :]
    if any(disk.startswith(prefix) for prefix, _ in _OTHER_PREFIXES):
        return None
    return disk


def other_name(disk: str) -> str | None:
    """Where a save writes a tensor the text model does not hold (stored as ``disk``); None for a text one."""
    for prefix, out in _OTHER_PREFIXES:
        if disk.startswith(prefix):
            return out + disk[len(prefix) :]
    return None


def disk_name(name: str) -> str:
    """The name a save writes the text model's tensor ``name`` under."""
    return "language_model." + name


def to_disk_state(container: dict[str, Any] | None, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (the text model's names) under the names of its vision-language checkpoint; ``state``
    itself for a model stored alone (``container`` None)."""
    if container is None:
        return state
    return {disk_name(name): t for name, t in state.items()}


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json")
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
