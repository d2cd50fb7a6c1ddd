"""Images into a vision-language rollout: data rows (PIL images or base64 PNGs), the
OpenAI-compatible client's ``image_url`` parts, and pixels by reference through the observation store."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from areno.data.tokenizer import load_pretrained_tokenizer
from areno.models.hf_io import load_model
from areno.models.vision import ImageInputs, decode_image, encode_png
from areno.rollout.client import InProcessRolloutClient, MultiServerRolloutClient, agenerate_many
from areno.rollout.config import RolloutEngineConfig
from areno.rollout.engine import RolloutEngine
from areno.rollout.server import create_app
from areno.rollout.store import InProcessStore, StoreRef, fetch_refs
from areno.types import SamplingParams, TokenBatch
from areno.workflows.images import image_prompt, row_images
from areno.workflows.openai_client import ArenoAsyncOpenAI
from areno.workflows.rlvr import RLVRWorkflow
from tests.helpers.serving import serving
from tests.helpers.vlm import make_vl_dir


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = make_vl_dir(tmp_path_factory.mktemp("vl") / "model")
    model, config = load_model(path)
    return model, config, load_pretrained_tokenizer(path)


def squares(n: int):
    a = np.zeros((16, 16, 3), dtype=np.uint8)
    for i in range(n):
        a[4 * i : 4 * i + 4, 0:4, 0] = 200
    return Image.fromarray(a)


def engine_client(model, config):
    engine = RolloutEngine(model, config, config=RolloutEngineConfig(device="cpu", block_size=4, num_blocks=64))
    return engine, InProcessRolloutClient(engine)


def test_pil_and_base64_rows_give_the_same_prompt_and_pixels(vl):
    model, _, tok = vl
    vc = model.vision_config
    pil = squares(2)
    a = image_prompt(tok, "count:", row_images({"images": [pil]}, vc), vc)
    b = image_prompt(tok, "count:", row_images({"images": [encode_png(pil)]}, vc), vc)
    assert a[0] == b[0] and a[0].count(vc.image_token_id) == 4
    assert torch.equal(a[1].pixel_values, b[1].pixel_values)


QWEN2VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_message_list_prompts_put_the_images_in_the_user_turn_as_string_prompts_do(vl):
    """walk30: a message-list prompt had its vision tokens before the whole template, outside any turn."""
    model, _, tok = vl
    tok = copy.deepcopy(tok)
    tok.chat_template = QWEN2VL_TEMPLATE
    vc, images = model.vision_config, row_images({"images": [squares(1)]}, model.vision_config)
    templating = {"chat_template": "always", "system_prompt": "sq"}
    as_string, _ = image_prompt(tok, "count:", images, vc, **templating)
    as_list, _ = image_prompt(tok, [{"role": "user", "content": "count:"}], images, vc, **templating)
    with_system, _ = image_prompt(
        tok,
        [{"role": "system", "content": "sq"}, {"role": "user", "content": "count:"}],
        images,
        vc,
        chat_template="always",
    )
    assert as_list == as_string == with_system
    text = tok.decode(as_list).replace("<|image_pad|>", "")
    # (the character vocabulary lacks some letters): the vision tokens inside the user turn, after its header
    turns = text.split("<|im_start|>")
    assert (
        turns[0] == "" and turns[2].startswith("user") and turns[2].count("<|vision_start|><|vision_end|>count:") == 1
    )


def test_rlvr_rows_with_images_keep_pixels_by_reference(vl):
    model, config, tok = vl
    engine, client = engine_client(model, config)
    store = InProcessStore()
    flow = RLVRWorkflow(
        tok, lambda *a, **k: 1.0, 3, SamplingParams(max_new_tokens=2, seed=0), vision=model.vision_config, store=store
    )
    try:
        group = asyncio.run(flow.run_episode(client, {"prompt": "count:", "images": [squares(3)], "answer": "3"}))
    finally:
        client.close()
    assert len(store) == 3 and all(isinstance(t.info["images"]["pixel_values"], StoreRef) for t in group)
    batch = TokenBatch.from_trajectories(group)
    fetched = fetch_refs(batch.images_B, store)  # what the engine does when it builds the batch
    assert all(torch.is_tensor(im["pixel_values"]) for im in fetched)
    assert batch.select([2, 0]).images_B == [batch.images_B[2], batch.images_B[0]]


def test_an_rlvr_group_cancelled_while_rewarding_stashes_no_pixels(vl):
    """walk39a: the pixels of a group's first completions were stashed before the later rewards ran: a
    group cancelled then (a staleness abort during a slow reward) left them in the store for good."""
    model, config, tok = vl
    engine, client = engine_client(model, config)
    store = InProcessStore()
    calls, second = [], {}

    async def slow_reward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            second["reached"].set()
            await asyncio.Event().wait()
        return 1.0

    flow = RLVRWorkflow(
        tok, slow_reward, 3, SamplingParams(max_new_tokens=2, seed=0), vision=model.vision_config, store=store
    )

    async def acancelled():
        second["reached"] = asyncio.Event()
        episode = asyncio.ensure_future(flow.run_episode(client, {"prompt": "count:", "images": [squares(1)]}))
        await second["reached"].wait()
        episode.cancel()
        await asyncio.gather(episode, return_exceptions=True)

    try:
        asyncio.run(acancelled())
    finally:
        client.close()
    assert len(store) == 0


def test_openai_client_image_url_parts_generate_with_the_image(vl):
    model, config, tok = vl
    vc = model.vision_config
    engine, client = engine_client(model, config)
    store = InProcessStore()
    oa = ArenoAsyncOpenAI(client, tok, vision=vc, store=store)
    image = squares(1)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": encode_png(image)}},
                {"type": "text", "text": "count:"},
            ],
        }
    ]
    try:
        resp = asyncio.run(oa.chat.completions.create(model="x", messages=messages, max_tokens=4, temperature=0))
        prompt_ids = resp.choices[0].prompt_token_ids
        assert prompt_ids.count(vc.image_token_id) == 4
        # the same prompt with the same pixels straight to the engine: the same greedy tokens
        images = ImageInputs.from_images([decode_image(encode_png(image))], vc)
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        direct = asyncio.run(client.agenerate(prompt_ids, params, images=images))
        assert resp.choices[0].token_ids == direct.output_ids
        # and without the image the answer is computed from other inputs (the image mattered)
        with torch.no_grad():
            pos = torch.arange(len(prompt_ids))
            ids = torch.tensor(prompt_ids)
            with_image = model.logits(model(ids, pos, images=images))[-1]
            without = model.logits(model(ids, pos))[-1]
        assert not torch.allclose(with_image, without)
    finally:
        client.close()
    (traj,) = oa.export()
    assert isinstance(traj.info["images"]["pixel_values"], StoreRef) and len(store) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_image_inputs_wire_form_round_trips_and_names_what_is_wrong(vl, dtype):
    vc = vl[0].vision_config
    images = ImageInputs.from_images([squares(1), squares(2)], vc)
    images.pixel_values = images.pixel_values.to(dtype)
    back = ImageInputs.from_wire(json.loads(json.dumps(images.to_wire())))
    assert back.pixel_values.dtype == dtype and torch.equal(back.pixel_values, images.pixel_values)
    assert back.grid_thw == images.grid_thw and back.key() == images.key()
    wire = images.to_wire()
    with pytest.raises(ValueError, match="does not cover"):
        ImageInputs.from_wire({**wire, "grid_thw": [[1, 2, 2]]})
    with pytest.raises(ValueError, match="images.dtype must be one of"):
        ImageInputs.from_wire({**wire, "dtype": "int8"})


def test_http_rollout_server_takes_a_groups_images(vl):
    """``areno serve``'s ``/generate_many`` with ``images`` (partitioned placement): the same greedy
    tokens as the in-process engine, the group sharing one image prefill; bad pixels are a 400."""
    model, config, tok = vl
    vc = model.vision_config
    prompt_ids, images = image_prompt(tok, "count:", [squares(2)], vc)
    params = [SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)] * 3
    engine, client = engine_client(model, config)
    try:
        direct = asyncio.run(client.agenerate(prompt_ids, params[0], images=images))
    finally:
        client.close()
    engine, _ = engine_client(model, config)
    with serving(create_app(engine, tokenizer=tok)) as base:
        http = MultiServerRolloutClient([base])
        outs = asyncio.run(agenerate_many(http, prompt_ids, params, images=images))
        assert [o.output_ids for o in outs] == [direct.output_ids] * 3
        assert engine._stepper.vision_runs == 1  # one tower forward for the group
        body = {"prompt_ids": prompt_ids, "sampling_params": [{}], "images": {**images.to_wire(), "shape": [1, 2]}}
        bad = httpx.post(f"{base}/generate_many", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "images"
