"""``model.fp32_logits`` (ScaleRL's FP32 LM head; TRL's ``cast_lm_head_to_fp32``): the head's logits leave its
product in float32 on both sides, the rollout engine's sampler and the trainer's chunked log-probs, from the
compute dtype's operands. Values against a float64 reference, the gradient, the engine's logits, the settings'
path from the run config, and the refusal with a vLLM rollout."""

from __future__ import annotations

import pytest
import torch

from areno.api.config import load_config
from areno.engine.config import build_rollout_engine_config, build_train_backend_config
from areno.errors import ConfigError
from areno.models.logprobs import Fp32HeadCopy, fp32_logits, fp32_product, logprobs_from_hidden
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.rollout import model_of

D, V, T = 32, 300, 24


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 2.0  # logits of a trained model's size (std ~11): bf16 rounds them
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, targets


def _reference(hidden, weight, targets):
    """float64 log-softmax of the product of the bfloat16-rounded operands (what both sides multiply)."""
    z = hidden.bfloat16().double() @ weight.bfloat16().double().t()
    return torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0]


def test_the_product_of_16_bit_operands_is_not_rounded_to_16_bits():
    hidden, weight, _ = _case()
    h, w = hidden.bfloat16(), weight.bfloat16()
    exact = h.double() @ w.double().t()
    z = fp32_product(h, w)
    assert z.dtype == torch.float32
    assert (z.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    rounded = (h @ w.t()).double()  # the bfloat16 product: about 2^-9 of each logit off
    assert (rounded - exact).abs().max() > 100 * (z.double() - exact).abs().max()
    assert torch.equal(fp32_product(hidden, weight), hidden @ weight.t())  # float32 operands: the plain product


@pytest.mark.parametrize("chunk", [7, 64])
def test_the_trainers_log_probs_under_bf16_autocast_take_the_fp32_logits(chunk):
    hidden, weight, targets = _case(1)
    reference = _reference(hidden, weight, targets)
    results = {}
    for flag in (False, True):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)  # the float32 master weight, cast by autocast
        with torch.autocast("cpu", dtype=torch.bfloat16), fp32_logits(flag):
            logp, _ = logprobs_from_hidden(h.bfloat16(), w, targets, 1.0, chunk)
        logp.sum().backward()
        results[flag] = (logp.detach().double(), h.grad, w.grad)
    err = {flag: (results[flag][0] - reference).abs().max().item() for flag in results}
    assert err[True] < 1e-4 < err[False], err
    # the gradients against float64's (of the bfloat16-rounded operands): the GEMMs keep the compute dtype
    h64 = hidden.bfloat16().double().requires_grad_(True)
    w64 = weight.bfloat16().double().requires_grad_(True)
    torch.log_softmax(h64 @ w64.t(), -1).gather(-1, targets[:, None]).sum().backward()
    for i, ref in ((1, h64.grad), (2, w64.grad)):
        rel = {flag: ((results[flag][i].double() - ref).norm() / ref.norm()).item() for flag in results}
        assert rel[True] < 0.02 and rel[True] <= 1.1 * rel[False], (i, rel)


def test_the_entropy_path_and_recomputed_backward_take_them_too():
    hidden, weight, targets = _case(2)
    h = hidden.bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp32_logits():
        logp, ent = logprobs_from_hidden(h, weight, targets, 0.7, 5, with_entropy=True)
    (logp.sum() + ent.sum()).backward()
    z = hidden.bfloat16().double() @ weight.bfloat16().double().t() / 0.7
    ref = torch.log_softmax(z, -1)
    assert (logp.double() - ref.gather(-1, targets[:, None])[:, 0]).abs().max() < 1e-4
    assert (ent.double() + (ref.exp() * ref).sum(-1)).abs().max() < 1e-4
    assert torch.isfinite(h.grad).all()


def test_a_bf16_engine_samples_from_the_fp32_logits():
    model, cfg = model_of("qwen2")
    model = model.to(torch.bfloat16)
    hidden = torch.randn(5, cfg.hidden_size).bfloat16()
    for flag in (False, True):
        config = RolloutEngineConfig(block_size=4, num_blocks=32, max_num_seqs=4, max_model_len=64, fp32_logits=flag)
        engine = RolloutEngine(model, cfg, config=config, eos_token_ids=())
        got = engine._logits(hidden)
        if flag:
            assert torch.equal(got, fp32_product(hidden, model.output_weight))
        else:  # the bfloat16 product's values
            assert torch.equal(got.float(), model.logits(hidden).float())


def test_a_cpu_engine_keeps_one_fp32_copy_of_the_head_until_its_weights_change():
    copy = Fp32HeadCopy()
    w = torch.randn(8, 4).bfloat16()
    first = copy(w)
    assert first.dtype == torch.float32 and copy(w) is first  # not cast again at the next step
    with torch.no_grad():
        w.add_(1.0)  # a weight update writes in place
    assert torch.equal(copy(w), w.float()) and copy(w) is not first
    w32 = torch.randn(8, 4)
    assert copy(w32) is w32
    # through the engine: a policy sync's new head reaches the sampler's logits
    model, cfg = model_of("qwen2")
    model = model.to(torch.bfloat16)
    config = RolloutEngineConfig(block_size=4, num_blocks=32, max_num_seqs=4, max_model_len=64, fp32_logits=True)
    engine = RolloutEngine(model, cfg, config=config, eos_token_ids=())
    hidden = torch.randn(3, cfg.hidden_size).bfloat16()
    before = engine._logits(hidden)
    name = "lm_head.weight" if not cfg.tie_word_embeddings else "model.embed_tokens.weight"
    engine.update_weights([(name, model.output_weight.detach().float() * 2)], version=1)
    after = engine._logits(hidden)
    assert torch.equal(after, fp32_product(hidden, model.output_weight)) and not torch.equal(after, before)


def test_the_run_setting_reaches_both_sides_and_a_vllm_rollout_refuses_it(tmp_path):
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), "model.fp32_logits=true"])
    assert build_train_backend_config(cfg, role_name="policy", trainable=True).fp32_logits
    assert build_rollout_engine_config(cfg, device="cpu", dtype="float32", max_num_seqs=4).fp32_logits
    with pytest.raises(ConfigError, match="model.fp32_logits") as info:
        load_config(None, [*tiny_run_overrides(tmp_path), "model.fp32_logits=true", "rollout.backend=vllm"])
    assert "rollout.backend=areno" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_on_cuda_the_head_multiplies_bf16_into_fp32_in_both_passes(compiled):
    """CUDA's bfloat16 product with a float32 result (``out_dtype``), eager and through the compiled head kernels:
    the log-probs are float64's of the rounded operands, the gradients finite and near float64's."""
    from areno.models.logprobs import compiled_logprob_kernels

    hidden, weight, targets = (x.cuda() for x in _case(3))
    h = hidden.bfloat16().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16), fp32_logits(), compiled_logprob_kernels(compiled):
        logp, _ = logprobs_from_hidden(h, w, targets, 1.0, 8)
    logp.sum().backward()
    assert (logp.double() - _reference(hidden, weight, targets)).abs().max() < 1e-4
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.gpu
def test_a_cuda_engine_with_graphs_samples_as_the_eager_one():
    """The fp32 logits inside captured decode graphs and the fused sampler: the same seeded tokens and log-probs
    as the eager engine, and each token's log-prob is the fp32 logits' (not the bfloat16 ones')."""
    from areno.types import SamplingParams
    from tests.helpers.rollout import random_prompts

    model, cfg = model_of("qwen2")
    model = model.to("cuda", torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)  # logits of a trained model's size
    prompts = random_prompts(4, seed=5, hi=12)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)
    outs = {}
    for graphs in (False, True):
        config = RolloutEngineConfig(
            block_size=4, num_blocks=64, max_num_seqs=4, max_model_len=64, fp32_logits=True, cuda_graphs=graphs
        )
        engine = RolloutEngine(model, cfg, config=config, eos_token_ids=())
        outs[graphs] = engine.generate(prompts, params)
        assert engine._logits(torch.randn(3, cfg.hidden_size, device="cuda").bfloat16()).dtype == torch.float32
    for a, b in zip(outs[False], outs[True]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), rtol=0, atol=2e-3)
    # the engine's log-probs are those of the fp32 logits of its own full forward
    from areno.models.logprobs import packed_logprobs

    seq = torch.tensor(prompts[0] + outs[True][0].output_ids, device="cuda")
    with torch.no_grad(), fp32_logits():
        ref, _ = packed_logprobs(model, seq, torch.tensor([0, len(seq)]))
    got = torch.tensor(outs[True][0].output_logprobs)
    torch.testing.assert_close(got, ref[len(prompts[0]) :].float().cpu(), rtol=0, atol=0.05)
