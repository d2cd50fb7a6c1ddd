"""The Qwen2.5-VL layout (``models/vision.py``) against ``transformers`` on a tiny random checkpoint
saved by ``transformers`` itself: image patches, M-RoPE positions, logits with an image and text-only."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.distributed.device_mesh import init_device_mesh

from areno.errors import ConfigError
from areno.models.config import ModelConfig
from areno.models.hf_io import load_model, save_model
from areno.models.vision import (
    ImageInputs,
    Segments,
    VisionAttention,
    VisionConfig,
    VisionLanguageModel,
    expand_image_tokens,
    image_patches,
    mrope_positions,
    tiny_vl_config,
)
from areno.train.parallelize import apply_tp
from bench.vlm import SHAPES, text_config_for

transformers = pytest.importorskip("transformers")

IMAGE, START, END = 60, 58, 59


TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def save_tiny_vl(path, seed: int = 0) -> None:
    """A random Qwen2.5-VL checkpoint written by transformers: ``bench.vlm``'s tiny shape (vision: 2 blocks,
    patch 4, window 16; image token IMAGE between START and END)."""
    torch.manual_seed(seed)
    tiny = SHAPES["tiny"]
    assert tiny["tokens"]["image_token_id"] == IMAGE and tiny["tokens"]["vision_start_token_id"] == START
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text_config_for(tiny["text"], transformers.__version__),
        vision_config=tiny["vision"],
        **tiny["tokens"],
    )
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(str(path))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_vl")
    save_tiny_vl(path)
    return path


def random_image(h: int, w: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def mm_kwargs(ids_T: torch.Tensor) -> dict:
    """The image-token mask transformers 5's Qwen2.5-VL takes beside the ids (4.x finds the tokens itself)."""
    return {"mm_token_type_ids": (ids_T == IMAGE).int()[None]} if TRANSFORMERS_MAJOR >= 5 else {}


def hf_processor(vc):
    try:  # transformers 5
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:  # 4.x: the same processor under its older name
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor as Qwen2VLImageProcessorPil,
        )

    return Qwen2VLImageProcessorPil(
        patch_size=vc.patch_size,
        merge_size=vc.spatial_merge_size,
        temporal_patch_size=vc.temporal_patch_size,
        min_pixels=vc.min_pixels,
        max_pixels=vc.max_pixels,
    )


@pytest.mark.parametrize("size", [(32, 48), (37, 50)])
def test_image_patches_equal_the_qwen2_vl_image_processor(vl_dir, size):
    model, _ = load_model(vl_dir)
    vc = model.vision_config
    image = random_image(*size)
    pixels, grid = image_patches(image, vc)
    ref = hf_processor(vc)(images=[image], return_tensors="pt")
    assert list(ref["image_grid_thw"][0].tolist()) == list(grid)
    torch.testing.assert_close(pixels, ref["pixel_values"].float(), atol=1e-5, rtol=1e-5)


def prompt_with_image(vc, grid):
    return expand_image_tokens([5, 6, START, IMAGE, END, 7, 8, 9], [grid], vc)


def test_logits_equal_transformers_with_an_image_and_text_only(vl_dir):
    model, config = load_model(vl_dir)
    assert isinstance(model, VisionLanguageModel)
    vc = model.vision_config
    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir)).eval()
    image = random_image(40, 56, seed=3)  # resized to a 40x56 grid of 4-pixel patches: several windows
    images = ImageInputs.from_images([image], vc)
    ids = prompt_with_image(vc, images.grid_thw[0])
    ids_T = torch.tensor(ids)
    pos_3T = mrope_positions(ids, images.grid_thw, vc)
    grid = torch.tensor([images.grid_thw[0]])
    if TRANSFORMERS_MAJOR >= 5:
        hf_pos, _ = ref.model.get_rope_index(ids_T[None], (ids_T == IMAGE).int()[None], image_grid_thw=grid)
    else:
        hf_pos, _ = ref.model.get_rope_index(ids_T[None], image_grid_thw=grid)
    assert torch.equal(pos_3T, hf_pos[:, 0])
    with torch.no_grad():
        got = model.logits(model(ids_T, pos_3T, images=images))
        want = ref(
            input_ids=ids_T[None],
            pixel_values=images.pixel_values,
            image_grid_thw=grid,
            **mm_kwargs(ids_T),
        ).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    text_T = torch.tensor([3, 4, 5, 6, 7, 8])
    with torch.no_grad():
        got = model.logits(model(text_T, torch.arange(6)))
        want = ref(input_ids=text_T[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_save_model_round_trips_through_transformers(vl_dir, tmp_path):
    model, config = load_model(vl_dir)
    save_model(model, config, tmp_path / "out")
    again, config2 = load_model(tmp_path / "out")
    assert config2.replace(vision=config.vision) == config
    # the image processor's pixel limits (defaults here) now travel in preprocessor_config.json
    assert VisionConfig.from_hf(config2.vision) == VisionConfig.from_hf(config.vision)
    for name, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name
    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "out"))
    assert set(ref.state_dict()) >= {"model.visual.merger.mlp.0.weight", "lm_head.weight"}


def test_rollout_engine_greedy_tokens_equal_transformers_generate(vl_dir):
    from areno.rollout.config import RolloutEngineConfig
    from areno.rollout.engine import RolloutEngine
    from areno.types import SamplingParams

    model, config = load_model(vl_dir)
    vc = model.vision_config
    ref = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir)).eval()
    images = ImageInputs.from_images([random_image(40, 56, seed=5)], vc)
    ids = prompt_with_image(vc, images.grid_thw[0])
    ids_T = torch.tensor(ids)
    want = ref.generate(
        input_ids=ids_T[None],
        pixel_values=images.pixel_values,
        image_grid_thw=torch.tensor(images.grid_thw),
        **mm_kwargs(ids_T),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    engine = RolloutEngine(
        model, config, config=RolloutEngineConfig(device="cpu", block_size=4, prefill_chunk_size=16, num_blocks=64)
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    rid = [engine.add_request(ids, params, images=images) for _ in range(3)]
    done = {}
    while len(done) < len(rid):
        done.update({o.request_id: o for o in engine.step()})
    for r in rid:
        assert done[r].output_ids == want
    stats = engine.stats()
    assert stats["prefix_hit_rate"] > 0  # the group reused the image prefill
    assert engine._stepper.vision_runs == 1  # and the vision tower ran once for the group
    # the same text with another image shares no cached block
    other = ImageInputs.from_images([random_image(40, 56, seed=6)], vc)
    assert other.key() != images.key()


def test_training_tensor_parallelism_refuses_a_vision_language_model(tmp_path):
    """The TP plan covers the decoder only: a VL model is a one-line error, not a half-sharded model."""
    model = VisionLanguageModel(tiny_vl_config(64, image_token_id=60, vision_start_token_id=61, vision_end_token_id=62))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="vision-language models train without tensor parallelism"):
            apply_tp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    finally:
        dist.destroy_process_group()


def loop_attention(attn: VisionAttention, x_NE, cu_seqlens, cos, sin):
    """The reference: one SDPA call per segment, rows in their own order."""
    n = x_NE.shape[0]
    q, k, v = attn.qkv(x_NE).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = cos[:, None], sin[:, None]
    q = q * cos + torch.cat((-q.chunk(2, -1)[1], q.chunk(2, -1)[0]), -1) * sin
    k = k * cos + torch.cat((-k.chunk(2, -1)[1], k.chunk(2, -1)[0]), -1) * sin
    outs = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
    return attn.proj(torch.cat(outs).reshape(n, -1))


# two images at the default window (4x4 merged patches, 64 rows): a 12x20-patch grid makes windows of
# 64, 64, 32 rows then a ragged edge row of 32, 32, 16; a 2x8x6 grid makes one 48-row window per frame
WINDOWS = [0, 64, 128, 160, 192, 224, 240, 288, 336]
IMAGES = [0, 240, 288, 336]


@pytest.mark.parametrize("cu_seqlens", [WINDOWS, IMAGES, [0, 48, 96, 144]], ids=["windows", "images", "equal"])
def test_batched_segment_attention_equals_a_loop_over_segments(cu_seqlens):
    torch.manual_seed(0)
    vc = VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)
    attn = VisionAttention(vc)
    n = cu_seqlens[-1]
    angles = torch.rand(n, vc.head_dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = torch.randn(n, vc.hidden_size, requires_grad=True)
    grad_out = torch.randn(n, vc.hidden_size)

    want = loop_attention(attn, x, cu_seqlens, cos, sin)
    want_grads = torch.autograd.grad(want, [x, *attn.parameters()], grad_out)
    got = attn(x, Segments.build(cu_seqlens, cos, sin))
    got_grads = torch.autograd.grad(got, [x, *attn.parameters()], grad_out)

    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_a_config_with_architectures_only_in_text_config_loads(vl_dir, tmp_path):
    """transformers 4.57 writes a Qwen2.5-VL config built in Python with ``architectures`` under
    ``text_config`` alone; the top-level ``model_type`` names the model."""
    d = json.loads((vl_dir / "config.json").read_text())
    arch = d.pop("architectures", None) or d["text_config"]["architectures"]
    d["text_config"]["architectures"] = arch
    config = ModelConfig.from_hf(d)
    assert config.architecture == "Qwen2_5_VLForConditionalGeneration"
    loaded = load_model(vl_dir)[1]
    assert config.mrope_section == loaded.mrope_section == (1, 1, 2)
    assert config.replace(vision=loaded.vision) == loaded
