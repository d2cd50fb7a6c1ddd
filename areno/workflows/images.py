"""Image prompts for vision-language models (Qwen2.5-VL layout, ``models/vision.py``).

A data row carries its images in ``images`` (a list of PIL images, PNG bytes, base64 strings or
``data:image/png;base64,...`` URLs). ``image_prompt`` turns the row's prompt and images into token
ids (one ``<|vision_start|><|image_pad|>…<|vision_end|>`` per image, the pad repeated once per
merged patch) and the pixel patches the rollout engine's vision tower reads.

The pixels of a trajectory travel by reference: ``stash_images`` puts them into the run's
``ObservationStore`` and leaves a ``StoreRef`` in ``Trajectory.info["images"]``; the engine fetches
them when it builds the training batch (``TokenBatch.images_B``) and releases them after the step.
"""

from __future__ import annotations

from typing import Any

from areno.data.prompts import apply_template, prompt_messages, render_prompt, uses_template
from areno.errors import DataError
from areno.models.hf_io import read_config
from areno.models.vision import ImageInputs, VisionConfig, decode_image, expand_image_tokens
from areno.rollout.store import ObservationStore
from areno.workflows.common import describe_sample, takes_param

IMAGES_KEY = "images"
"""The data rows' field holding a prompt's images."""


def vision_kwargs(workflow: Any, model_dir: Any, workflow_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``{"vision": VisionConfig}`` for a workflow that takes ``vision`` when the model at
    ``model_dir`` is a vision-language model and ``workflow_kwargs`` does not set it, else ``{}``."""
    if "vision" in workflow_kwargs or not takes_param(workflow, "vision"):
        return {}
    config = read_config(model_dir)
    return {"vision": VisionConfig.from_hf(config.vision)} if config.vision is not None else {}


def row_images(sample: dict[str, Any], vision: VisionConfig | None) -> list[Any]:
    """The row's images (decoded), ``[]`` for a text row; a :class:`DataError` for a row with
    images when the model has no vision tower, or an image that does not decode."""
    images = sample.get(IMAGES_KEY) or []
    if not images:
        return []
    if vision is None:
        raise DataError(
            f"dataset {describe_sample(sample)} has images but model.path is a text-only model (the "
            "vision-language checkpoints of Gemma 3, Mistral Small 3 and Qwen3-VL train their text model only): use a Qwen2.5-VL checkpoint or drop the images field"
        )
    if not isinstance(images, (list, tuple)):
        images = [images]
    try:
        return [decode_image(im) for im in images]
    except Exception as exc:  # noqa: BLE001 - PIL raises several types for a bad image
        raise DataError(f"dataset {describe_sample(sample)}: an image does not decode ({exc})") from None


def image_prompt(
    tokenizer: Any,
    prompt: str | list[dict],
    images: list[Any],
    vision: VisionConfig,
    *,
    chat_template: str = "auto",
    system_prompt: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[int], ImageInputs]:
    """(prompt token ids with the image tokens expanded, the images' pixel patches). With a chat
    template the images are parts of the first user message, before its text (a string prompt is
    that one message; the Qwen2.5-VL template writes the vision tokens in the turn); without one the
    vision tokens lead the prompt."""
    inputs = ImageInputs.from_images(images, vision)
    if uses_template(tokenizer, chat_template):
        messages = prompt_messages(prompt, system_prompt)
        user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if user is None:
            raise DataError(f"prompt {prompt!r:.80}: a row with images needs a user message to hold them")
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": messages[user]["content"]}]
        messages[user] = {**messages[user], "content": parts}
        ids = apply_template(tokenizer, messages, **(chat_template_kwargs or {}))
    else:
        text = render_prompt(
            tokenizer,
            prompt,
            chat_template=chat_template,
            system_prompt=system_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        vision_ids = [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]
        ids = vision_ids * len(images) + text
    return expand_image_tokens(ids, inputs.grid_thw, vision), inputs


def stash_images(inputs: ImageInputs, store: ObservationStore | None) -> dict[str, Any]:
    """What ``Trajectory.info["images"]`` holds: the pixels (a ``StoreRef`` when a store is given,
    the tensor otherwise) and the grids."""
    pixels = store.put(inputs.pixel_values) if store is not None else inputs.pixel_values
    return {"pixel_values": pixels, "grid_thw": [list(g) for g in inputs.grid_thw]}
