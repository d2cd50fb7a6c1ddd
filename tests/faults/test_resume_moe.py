"""Resume of a GLM-4.5 (``Glm4MoeForCausalLM``) run with bf16 weights and compute: the float32 routers and their
``e_score_correction_bias`` buffers (never touched by a gradient, so easy to miss) come back from the checkpoint
exactly, the optimizer's state with them, and the training after the resume is the uninterrupted run's bit for bit;
the checkpoint's Hugging Face export holds the routers in float32."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from areno.models import moe
from areno.train import LocalTrainBackend, TrainBackendConfig
from tests.helpers.moe import BIAS, glm4_moe_dir
from tests.helpers.resume import losses, overrides, resumed_step, run_areno, train_rows
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, token_denominator

VOCAB = 100
LENGTHS = [13, 7, 21, 5, 9, 16]
CFG = dict(lr=1e-2, device="cpu", dtype="bfloat16", param_dtype="bfloat16", weight_decay=0.1, grad_clip=0.5)


def _steps(backend: LocalTrainBackend, seeds: range) -> list[tuple[float, float]]:
    out = []
    for s in seeds:
        m = backend.train_step(
            random_batch(LENGTHS, VOCAB, s), forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
        )
        out.append((m["loss"], m["grad_norm"]))
    return out


def test_a_bf16_glm4_moe_run_resumed_from_its_checkpoint_is_the_uninterrupted_run(tmp_path):
    """The resumed backend starts from another model (other weights, zero biases): everything it ends with
    came from the checkpoint."""
    model_dir = glm4_moe_dir(tmp_path / "model", seed=0, biased=True)
    biases = {i: load_file(model_dir / "model.safetensors")[BIAS.format(i)] for i in (1, 2)}
    whole = LocalTrainBackend(TrainBackendConfig(**CFG))
    whole.initialize(model_dir)
    _steps(whole, range(2))
    whole.save_checkpoint(tmp_path / "ckpt", {"pos": 2})
    expected = _steps(whole, range(2, 4))
    final = dict(whole.named_weights())

    resumed = LocalTrainBackend(TrainBackendConfig(**CFG))
    resumed.initialize(glm4_moe_dir(tmp_path / "other", seed=1, biased=False))
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"pos": 2}
    assert _steps(resumed, range(2, 4)) == expected
    got = dict(resumed.named_weights())
    assert sorted(got) == sorted(final)
    for name, t in final.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    for i in (1, 2):
        weight = got[f"model.layers.{i}.mlp.gate.weight"]
        assert weight.dtype == got[BIAS.format(i)].dtype == torch.float32
        assert not torch.equal(weight, weight.bfloat16().float())  # float32 values, trained in float32
        # the checkpoint's bias, untouched by weight decay (a buffer: not in the optimizer)
        assert biases[i].abs().min() > 0 and torch.equal(got[BIAS.format(i)], biases[i])
    assert {p.dtype for r in moe.float32_routers(resumed.model) for p in r.parameters()} == {torch.float32}

    resumed.export_hf(tmp_path / "hf")
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    for i in (1, 2):
        for name in (f"model.layers.{i}.mlp.gate.weight", BIAS.format(i)):
            assert stored[name].dtype == torch.float32 and torch.equal(stored[name], final[name]), name
    assert stored["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16


@pytest.mark.slow  # three CLI runs of 4 steps: about 25 s
@pytest.mark.parametrize("arch", ["glm4_moe", "qwen2_moe"])
def test_a_killed_bf16_moe_run_resumes_as_the_uninterrupted_run(tmp_path, arch):
    """``areno train`` killed after step 3 trained, resumed from step 2's checkpoint: the metrics of every step
    and both runs' ``step_N/hf`` exports equal bit for bit, GLM-4.5's routers in float32 there."""
    if arch == "glm4_moe":
        glm4_moe_dir(tmp_path / "model", seed=0, biased=True)
    else:
        make_model_dir(tmp_path / "model", arch=arch, layers=3, num_experts=4, initializer_range=0.2)

    def args(name: str) -> list[str]:
        given = overrides(tmp_path, tmp_path / name, "model.dtype=bfloat16", "model.compute_dtype=bfloat16")
        return [a for a in given if not a.startswith("model.init_tiny")]  # the model above

    for name, fault in (("whole", None), ("cut", "kill:train:3"), ("cut", None)):
        proc = run_areno(args(name), fault=fault)
        assert proc.returncode == (-9 if fault else 0), proc.stderr[-3000:]
    assert resumed_step(proc) == 2
    whole, cut = train_rows(tmp_path / "whole"), train_rows(tmp_path / "cut")
    assert sorted(cut) == sorted(whole) == [1, 2, 3, 4] and losses(cut) == losses(whole)
    for step in (2, 4):
        hf = f"checkpoints/step_{step:08d}/hf/model.safetensors"
        expected, got = load_file(tmp_path / "whole" / hf), load_file(tmp_path / "cut" / hf)
        assert sorted(got) == sorted(expected)
        for name, t in expected.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (step, name)
    routers = [name for name in expected if ".mlp.gate." in name]
    if arch == "glm4_moe":
        assert len(routers) == 4 and all(expected[name].dtype == torch.float32 for name in routers)
        assert torch.equal(
            expected[BIAS.format(1)], load_file(tmp_path / "model" / "model.safetensors")[BIAS.format(1)]
        )
    assert expected["model.embed_tokens.weight"].dtype == torch.bfloat16
