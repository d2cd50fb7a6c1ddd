import asyncio

import pytest

from areno.api.types import SamplingParams
from areno.rollout.client import InProcessRolloutClient
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from tests.rollout.conftest import EOS, naive_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def test_concurrent_agenerate_batches_and_matches_reference(tiny):
    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=128), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng)
    prompts = random_prompts(6, seed=20)

    async def main():
        return await asyncio.gather(*(client.agenerate(p, GREEDY) for p in prompts))

    try:
        outs = asyncio.run(main())
    finally:
        client.close()
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == naive_greedy(model, prompt, 8)[0]
    # Six requests of 8 tokens took far fewer than 48 steps: they ran in one batch.
    assert eng.stats()["steps"] < 20


def test_abort_and_cancel_through_client(tiny):
    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=128), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng)
    long = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)

    async def main():
        eng.pause()
        task = asyncio.ensure_future(client.agenerate([5, 6, 7], long, request_id="a"))
        cancelled = asyncio.ensure_future(client.agenerate([5, 6, 8], long, request_id="b"))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        out = client.abort("a")
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return out, await task

    try:
        direct, awaited = asyncio.run(main())
    finally:
        client.close()
    assert direct.finish_reason == awaited.finish_reason == "abort" and awaited.output_ids == []
    assert not eng.has_unfinished()


def test_bad_request_raises_in_caller(tiny):
    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng)
    try:
        with pytest.raises(ValueError, match="empty"):
            asyncio.run(client.agenerate([], GREEDY))
    finally:
        client.close()
