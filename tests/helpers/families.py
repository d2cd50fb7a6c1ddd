"""The model-family tests' shared pieces: a tiny random checkpoint saved by transformers itself, a packed
batch of three sequences, and transformers' log-probs of them (the reference areno's must equal)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

VOCAB = 61
LENS = [9, 14, 5]


def saved_by_transformers(
    config_cls, path, *, spread_norms: bool = False, spread_biases: bool = False, **kw
) -> torch.nn.Module:
    """A random model of ``config_cls`` (a transformers config class; ``kw`` over a 2-layer, 48-wide,
    4-head / 2-kv-head shape) saved to ``path`` by transformers and loaded back in float32 with eager
    attention. ``spread_norms``: norm weights drawn from [0.3, 1.7], so that a norm in the wrong place shows;
    ``spread_biases``: biases drawn from N(0, 0.2) (transformers initialises them to 0, where a missing one
    would not show)."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config_cls(**{**shape, **kw}), attn_implementation="eager")
    if spread_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.3, 1.7)
    if spread_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def saved_names(path) -> set[str]:
    """The tensor names of ``path``'s ``model.safetensors`` (a one-file checkpoint)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return set(f.keys())


def packed_batch() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Three random sequences of ``LENS`` tokens: (each, packed, cu_seqlens)."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENS]
    return seqs, torch.cat(seqs), torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])


def reference_logprobs(ref: torch.nn.Module, seqs: list[torch.Tensor], *, grad: bool = False) -> torch.Tensor:
    """logprobs_T[t] = log p(ids[t] | ids[:t]) under transformers' model, 0 at each sequence's start
    (``grad``: differentiable, for a backward to compare)."""
    out = []
    with torch.set_grad_enabled(grad):
        for s in seqs:
            logits = ref(s[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, s[1:, None])[:, 0]
            out.append(torch.cat([lp.new_zeros(1), lp]))
    return torch.cat(out)


def assert_export_reads_back(model, config, seqs: list[torch.Tensor], expected: torch.Tensor, out_dir) -> None:
    """areno's export of ``model`` loads into transformers with the log-probs ``expected`` (to 1e-5) and its
    config.json reads back to ``config``."""
    from areno.models import ModelConfig, save_model

    save_model(model, config, out_dir)
    back = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        assert (reference_logprobs(back.eval(), seqs) - expected).abs().max().item() <= 1e-5
    assert ModelConfig.from_hf(json.loads((Path(out_dir) / "config.json").read_text())) == config


def assert_engine_decodes_as_recompute(model, config, **engine_kw) -> None:
    """The rollout engine's greedy tokens for three prompts equal a full recompute's (``naive_greedy``)."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.types import SamplingParams
    from tests.helpers.rollout import naive_greedy, random_prompts

    engine_kw = dict(block_size=4, num_blocks=64, max_model_len=64) | engine_kw
    engine = RolloutEngine(model.eval(), config, config=RolloutEngineConfig(**engine_kw))
    prompts = [[t % VOCAB for t in p] for p in random_prompts(3, seed=15, lo=6, hi=14)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == naive_greedy(model, prompt, 10)[0]


def assert_engine_reloads_from_disk(model_dir: Path, out_dir: Path) -> None:
    """An engine holding the checkpoint's weights times 1.5 reads the checkpoint back from disk (its own names, as
    transformers saved them), then areno's export of the weights times 0.5 (``save_model``'s names): every tensor
    equals the model's both times."""
    from areno.models import load_model, save_model
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, config = load_model(model_dir)
    engine_model, _ = load_model(model_dir)
    with torch.no_grad():
        for p in engine_model.parameters():
            p.mul_(1.5)
    engine = RolloutEngine(engine_model, config, config=RolloutEngineConfig(block_size=4, num_blocks=32))
    for version, source in ((1, model_dir), (2, out_dir)):
        if version == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
            save_model(model, config, out_dir)
        engine.update_weights_from_disk(str(source), version=version)
        got = engine.weight_tensors()
        for name, t in model.state_dict().items():
            assert torch.equal(got[name], t), name


def assert_sampled_logprobs_are_the_trainers(model, config) -> None:
    """Tokens the engine samples at temperature 1 carry the log-probs ``packed_logprobs`` computes over prompt and
    completion: whatever the family does to its logits, the engine does as the trainer."""
    from areno.models.logprobs import packed_logprobs
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.types import SamplingParams

    engine = RolloutEngine(model.eval(), config, config=RolloutEngineConfig(block_size=4, num_blocks=64))
    prompts = [[5, 9, 11, 3, 20], [7, 1, 33, 40, 41, 42, 8, 9]]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=3))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor(prompt + out.output_ids)
        with torch.no_grad():
            lp, _ = packed_logprobs(model, ids, torch.tensor([0, len(ids)]))
        torch.testing.assert_close(torch.tensor(out.output_logprobs), lp[len(prompt) :], rtol=0, atol=1e-4)


def grpo_learns_and_exports(tmp_path, arch: str, extra: str = "", lr: float = 0.02) -> dict:
    """A 12-step GRPO run on a tiny ``arch`` model (``extra``: more ``init_tiny`` keys, ", key: value") at
    learning rate ``lr`` raises the demo reward; returns the config.json of its last checkpoint's export."""
    from tests.helpers.configs import grpo_rewards_on_tiny

    init = f"model.init_tiny={{arch: {arch}, hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64"
    rewards = grpo_rewards_on_tiny(tmp_path, init + extra + "}", lr)
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    exported = json.loads((tmp_path / "run" / "checkpoints" / "step_00000012" / "hf" / "config.json").read_text())
    assert exported["architectures"] == [config_architecture(arch)]
    return exported


def config_architecture(arch: str) -> str:
    """``tiny_config``'s architecture name of ``arch``."""
    from areno.models import tiny_config

    return tiny_config(VOCAB, arch=arch).architecture


def assert_gradients_match(model, ref: torch.nn.Module, names: list[str]) -> None:
    """The gradients of the summed log-probs of ``packed_batch()`` under areno's ``model`` equal those under
    transformers' ``ref`` for every parameter in ``names`` (each nonzero in the reference), to rtol 1e-4 and
    an atol of 1e-5 of the gradient's scale (a tied embedding sums the head's and the lookup's gradients)."""
    from areno.models.logprobs import packed_logprobs

    seqs, ids_T, cu_B1 = packed_batch()
    ours, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
    ours.sum().backward()
    reference_logprobs(ref, seqs, grad=True).sum().backward()
    ours_params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    for name in names:
        g, r = ours_params[name].grad, ref_params[name].grad
        assert r.abs().max() > 0, name
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * max(1.0, r.abs().max().item()), msg=name)


def assert_server_rollouts_refused(tmp_path, monkeypatch, backend: str, arch: str, match: str) -> None:
    """A run of a tiny ``arch`` checkpoint with ``rollout.backend=backend`` (vllm, sglang) stops with the
    one-line error ``match`` before any server starts."""
    from areno.api.config import load_config
    from areno.engine.seams import SideSetup
    from areno.engine.servers import ServerRolloutSide
    from areno.models import tiny_config

    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    started = []
    monkeypatch.setattr("areno.engine.servers.start_servers", lambda *a, **k: started.append(a))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config(VOCAB, arch=arch).to_hf()))
    cfg = load_config(None, [f"model.path={model}", f"run_dir={tmp_path / 'run'}", f"rollout.backend={backend}"])
    with pytest.raises(ValueError, match=match):
        ServerRolloutSide(cfg, tmp_path / "run").start(SideSetup(recipe=None, model_dir=model, tokenizer=None))
    assert not started
