"""Image rows of a prefill chunk (walk37 #10): the prompt's image-token positions are found once per
sequence and each chunk bisects them, where every chunk rescanned the whole prompt. Same rows, same
outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from areno.models.vision import ImageInputs, VisionLanguageModel, expand_image_tokens, tiny_vl_config
from areno.rollout import stepping
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams

IMAGE, START, END = 60, 61, 62


def old_chunk_image_rows(seq, start: int, n: int):
    """The rows as they were computed: the whole prompt scanned for every chunk."""
    if seq.images is None:
        return None
    is_image = [t == seq.image_token_id for t in seq.prompt_ids]
    a = sum(is_image[:start])
    b = a + sum(is_image[start : start + n])
    return (a, b) if b > a else None


@pytest.fixture(scope="module")
def vl():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = VisionLanguageModel(
            tiny_vl_config(64, image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
        ).eval()
    return model, model.config


def image(seed: int, h: int, w: int):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def prompts(vc):
    """Two requests: two images with text between them, and one image."""
    two = ImageInputs.from_images([image(1, 32, 48), image(2, 24, 24)], vc)
    one = ImageInputs.from_images([image(3, 40, 32)], vc)
    ids_two = expand_image_tokens([5, 6, START, IMAGE, END, 7, 8, START, IMAGE, END, 9], two.grid_thw, vc)
    ids_one = expand_image_tokens([10, START, IMAGE, END, 11, 12], one.grid_thw, vc)
    return [(ids_two, two), (ids_one, one)]


def run(model, config, chunk: int):
    engine = RolloutEngine(
        model, config, config=RolloutEngineConfig(device="cpu", block_size=4, prefill_chunk_size=chunk, num_blocks=256)
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    rid = [engine.add_request(ids, params, images=images) for ids, images in prompts(model.vision_config)]
    done = {}
    while len(done) < len(rid):
        done.update({o.request_id: o for o in engine.step()})
    return [(done[r].output_ids, done[r].output_logprobs) for r in rid]


def test_chunked_image_prefill_gives_the_outputs_of_the_whole_prompt_scan(vl, monkeypatch):
    model, config = vl
    scans, calls = [], []
    scan, rows = stepping._image_positions, stepping._chunk_image_rows
    monkeypatch.setattr(stepping, "_image_positions", lambda ids, tok: scans.append(len(ids)) or scan(ids, tok))
    monkeypatch.setattr(stepping, "_chunk_image_rows", lambda *a: calls.append(a[1:]) or rows(*a))
    new = run(model, config, chunk=7)  # chunks that start and end inside image runs
    assert len(scans) == 2 and len(calls) > 2 * len(scans)  # one scan per sequence, many chunks
    monkeypatch.setattr(stepping, "_chunk_image_rows", old_chunk_image_rows)
    assert new == run(model, config, chunk=7)


def test_chunk_rows_equal_the_whole_prompt_scan_for_every_chunk(vl):
    model, _ = vl
    for ids, images in prompts(model.vision_config):
        seq = stepping.Sequence("r", ids, SamplingParams(), 0, images=images, image_token_id=IMAGE)
        for n in (1, 3, 7, 64):
            for start in range(0, len(ids) + 3):
                assert stepping._chunk_image_rows(seq, start, n) == old_chunk_image_rows(seq, start, n)
    text = stepping.Sequence("t", [IMAGE, 5], SamplingParams(), 0)  # no images: never image rows
    assert stepping._chunk_image_rows(text, 0, 2) is None
