"""Real vLLM servers behind the rollout seam (``pytest -m vllm``; needs ``areno[vllm]``, see README).

A two-layer Qwen2-layout model with areno's character tokenizer (a real ``tokenizers`` tokenizer),
saved as a Hugging Face directory; vLLM's CPU attention needs a head size of 32 or more. One server
serves the parity and pause tests; the GRPO run starts two and loses one mid-step.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

from safetensors.torch import load_file, save_file  # noqa: E402

from areno.api.config import load_config  # noqa: E402
from areno.api.trainer import Trainer  # noqa: E402
from areno.data.tokenizer import build_char_tokenizer  # noqa: E402
from areno.engine.api import load_tokenizer, resolve_recipe  # noqa: E402
from areno.engine.local import LocalRolloutSide  # noqa: E402
from areno.engine.seams import SideSetup, WeightKind, WeightUpdate  # noqa: E402
from areno.engine.servers import ServerRolloutSide  # noqa: E402
from areno.models.hf_io import init_model_dir, tiny_config  # noqa: E402
from areno.rollout.backends import VLLMRolloutClient  # noqa: E402
from areno.types import SamplingParams  # noqa: E402

LOGPROB_ATOL = 1e-4
"""|vLLM log-prob - areno's| per token: both float32 on the CPU, the same weights."""
SHAPE = {"hidden_size": 64, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate_size": 128}
PROMPTS = [[1, 20, 21, 22], [1, 40, 41], [1, 50, 51, 52, 53, 54]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm") / "model"
    tok = build_char_tokenizer()
    init_model_dir(path, tiny_config(len(tok), **SHAPE), tok, seed=0)
    return path


def _config(tmp: Path, model_dir: Path, *overrides: str):
    return load_config(
        None,
        [
            f"run_dir={tmp / 'run'}",
            f"model.path={model_dir}",
            "cluster.device=cpu",
            "observe.console=false",
            "rollout.backend=vllm",
            "rollout.server_args=[--enforce-eager,--max-num-seqs,16]",
            "rollout.max_model_len=1024",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """One started vLLM server behind a ``ServerRolloutSide``, and the setup it started from."""
    tmp = tmp_path_factory.mktemp("served")
    cfg = _config(tmp, model_dir)
    setup = SideSetup(recipe=resolve_recipe(cfg), model_dir=model_dir, tokenizer=load_tokenizer(model_dir))
    side = ServerRolloutSide(cfg, tmp / "run")
    t0 = time.perf_counter()
    side.start(setup)
    print(f"vLLM server ready in {time.perf_counter() - t0:.0f}s")
    yield side, setup, cfg
    side.shutdown()
    assert all(not p.alive() for p in side.processes)


def _generate(client, prompts, params):
    async def agen():
        return await asyncio.gather(*(client.agenerate(p, params) for p in prompts))

    return asyncio.run(agen())


def _teacher_logprobs(model_dir: Path, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each output token, teacher-forced through transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


def test_greedy_parity_with_areno_engine_and_sampled_logprobs_under_temperature(served, tmp_path):
    side, setup, cfg = served
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    ours = LocalRolloutSide(_config(tmp_path, setup.model_dir, "rollout.backend=areno"), torch.device("cpu"))
    ours.start(setup)
    try:
        want = _generate(ours.client, PROMPTS, greedy)
    finally:
        ours.shutdown()
    got = _generate(side.client, PROMPTS, greedy)
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        assert max(abs(a - b) for a, b in zip(g.output_logprobs, w.output_logprobs)) < LOGPROB_ATOL
        assert g.output_versions == [0] * 12
    # sampled tokens: log-probs of the temperature-scaled distribution, as the trainer recomputes them
    sampled = _generate(side.client, PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=12, seed=5))
    for s, prompt in zip(sampled, PROMPTS):
        teacher = _teacher_logprobs(setup.model_dir, prompt, s.output_ids, 0.7)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), teacher, atol=LOGPROB_ATOL, rtol=0)
    # seeds: the same seed gives the same tokens
    again = _generate(side.client, PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=12, seed=5))
    assert [a.output_ids for a in again] == [s.output_ids for s in sampled]


def _perturbed_export(model_dir: Path, out: Path, seed: int) -> Path:
    """A copy of the model directory with every weight moved (what a training step's export is)."""
    shutil.copytree(model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    save_file(
        {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}, str(out / "model.safetensors")
    )
    return out


def test_sync_pauses_with_requests_in_flight_and_stamps_versions(served, tmp_path):
    # long requests, so that the sync lands while they stream, also on an idle machine; by then the
    # streams hold tokens made under the old policy that the reader has not taken yet: they are
    # drained before the version moves on, or they would be stamped with the new one
    new_tokens = 900
    side, setup, _ = served
    probe = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = _generate(side.client, PROMPTS[:1], probe)[0]
    # the export is written before they start, so only the sync itself runs while they stream
    long = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=1)
    export = _perturbed_export(setup.model_dir, tmp_path / "policy", seed=new_tokens)
    old = side.version
    streaming = threading.Event()

    def version() -> int:  # called as each token arrives
        streaming.set()
        return side.version

    client = VLLMRolloutClient(
        side.urls[0], side.admin.api_key, model="areno-policy", version=version, activity=side.stream_activity
    )
    results: list = []
    thread = threading.Thread(target=lambda: results.extend(_generate(client, PROMPTS, long)))
    thread.start()
    assert streaming.wait(timeout=120)  # the requests are generating
    metrics = side.update_weights(WeightUpdate(version=side.version + 1, kind=WeightKind.DISK, path=export))
    thread.join(timeout=300)
    assert side.version == old + 1 and metrics["policy_sync_load_s"] > 0
    assert len(results) == len(PROMPTS)
    for out in results:
        assert len(out.output_ids) == new_tokens and out.finish_reason == "length"
        assert out.output_versions == sorted(out.output_versions)  # old policy, then the new one
    assert any(old in o.output_versions and old + 1 in o.output_versions for o in results), [
        o.output_versions for o in results
    ]
    # tokens after the sync are sampled from the new weights (the context recomputed under them)
    out = next(o for o in results if old + 1 in o.output_versions)
    first_new = out.output_versions.index(old + 1)
    teacher = _teacher_logprobs(export, out.prompt_ids, out.output_ids, 1.0)[first_new:]
    torch.testing.assert_close(torch.tensor(out.output_logprobs[first_new:]), teacher, atol=LOGPROB_ATOL, rtol=0)
    after = _generate(side.client, PROMPTS[:1], probe)[0]
    assert after.output_logprobs != before.output_logprobs and after.output_versions == [old + 1] * 8


def test_grpo_through_two_servers_survives_losing_one_mid_step(model_dir, tmp_path):
    cfg = _config(
        tmp_path,
        model_dir,
        "cluster.allocation_mode='vllm:d2+fsdp:d1'",
        "data.task=arithmetic",
        "data.num_eval=0",
        "rollout.batch_size=2",
        "rollout.n_samples=4",
        "rollout.max_new_tokens=8",
        "train.steps=3",
        "train.save_interval=0",
        "optim.lr=0.05",
        "reward.fn=tests.helpers.server_faults:kill_a_server_at_step_two",
        "reward.sandbox=false",
    )
    t0 = time.perf_counter()
    trainer = Trainer.init(cfg)
    side = trainer.backend.engine.rollout
    assert isinstance(side, ServerRolloutSide) and len(side.urls) == 2
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    print(f"3 GRPO steps through 2 vLLM servers in {time.perf_counter() - t0:.0f}s (server start included)")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/logprob_abs_diff_mean" in r]
    assert len(steps) == 3
    for r in steps:
        # the trainer's recompute agrees with what the servers sampled: each sync reached them
        assert r["rollout/logprob_abs_diff_max"] < 1e-3, r
        assert r["rollout/staleness_max"] == 0  # every token carries the version of its step
    assert steps[0]["rollout/lost_servers"] == 0 and steps[-1]["rollout/lost_servers"] == 1
    assert steps[-1]["rollout/healthy_servers"] == 1
    assert trainer.backend.engine.version == 3 and side.version == 3
    assert all(not p.alive() for p in side.processes)
