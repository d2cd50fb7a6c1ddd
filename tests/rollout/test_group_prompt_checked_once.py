"""``InProcessRolloutClient.agenerate_many`` converts and checks a group's shared prompt once, not once
per sample, and refuses a bad group as a whole with the error each sample's ``add_request`` raised."""

from __future__ import annotations

import asyncio

import pytest

from areno.rollout.client import InProcessRolloutClient
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.rollout.requests import CheckedPrompt
from areno.types import SamplingParams
from tests.helpers.rollout import EOS, VOCAB

ONE = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)


class CountingPrompt(list):
    """A prompt that counts the passes over its ids."""

    passes = 0

    def __iter__(self):
        self.passes += 1
        return super().__iter__()


def engine(tiny, **kw) -> RolloutEngine:
    model, cfg = tiny
    config = RolloutEngineConfig(block_size=4, num_blocks=12, max_model_len=64, **kw)
    return RolloutEngine(model, cfg, config=config, eos_token_ids=(EOS,))


def test_the_prompt_is_converted_once_per_group_and_the_outputs_are_unchanged(tiny):
    eng = engine(tiny)
    client = InProcessRolloutClient(eng)
    prompt = CountingPrompt([5, 6, 7, 8])
    sampled = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=s) for s in range(8)]
    try:
        outs = asyncio.run(client.agenerate_many(prompt, sampled))
        singles = asyncio.run(_one_by_one(client, [5, 6, 7, 8], sampled))
    finally:
        client.close()
    assert prompt.passes == 1  # was 8: one conversion (and vocabulary scan) per sample
    assert [(o.prompt_ids, o.output_ids) for o in outs] == [(o.prompt_ids, o.output_ids) for o in singles]
    for out, single in zip(outs, singles):  # batched and alone: float rounding apart
        assert out.output_logprobs == pytest.approx(single.output_logprobs, abs=1e-5)
    assert all(type(o.prompt_ids) is list and o.prompt_ids == [5, 6, 7, 8] for o in outs)


async def _one_by_one(client, prompt, params):
    return [await client.agenerate(prompt, p) for p in params]


def test_the_group_shares_one_checked_prompt_which_add_takes_as_it_is(tiny):
    eng = engine(tiny)
    eng.pause()  # the requests stay in the inbox
    client = InProcessRolloutClient(eng)

    async def main():
        task = asyncio.ensure_future(client.agenerate_many((5, 6, 7), [ONE] * 3))
        await asyncio.sleep(0)
        seqs = list(eng._requests.inbox.values())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seqs

    try:
        seqs = asyncio.run(main())
    finally:
        client.close()
    assert len(seqs) == 3 and all(s.prompt_ids is seqs[0].prompt_ids for s in seqs)
    assert type(seqs[0].prompt_ids) is CheckedPrompt and seqs[0].prompt_ids == [5, 6, 7]
    assert [s.token_ids for s in seqs] == [[5, 6, 7]] * 3 and seqs[0].token_ids is not seqs[1].token_ids
    assert client.num_pending == 0 and not eng.has_unfinished()


def test_a_checked_prompt_of_another_vocabulary_is_checked_again(tiny):
    eng = engine(tiny)
    with pytest.raises(ValueError, match=f"token id {VOCAB} outside the vocabulary"):
        eng.add_request(CheckedPrompt([5, VOCAB], VOCAB + 1), ONE)


BAD_STOP = SamplingParams(temperature=0, max_new_tokens=2, stop_token_ids=(VOCAB,))
TOO_LONG = SamplingParams(temperature=0, max_new_tokens=200)  # beyond the 48-token KV pool

CASES = {
    "text": ("5 6 7", [ONE, ONE]),
    "bytes": (b"567", [ONE]),
    "not iterable": (5, [ONE]),
    "not an id": ([5, "x", 7], [ONE, ONE]),
    "none": ([5, None], [ONE]),
    "infinite": ([5, float("inf")], [ONE, ONE]),
    "empty": ([], [ONE, ONE]),
    "negative": ([5, -1], [ONE]),
    "outside": ([5, VOCAB], [ONE, ONE]),
    "too long for the context": (list(range(3, 63)) + [3, 4, 5, 6], [ONE]),
    "bad stop token of the second": ([5, 6], [ONE, BAD_STOP, ONE]),
    "kv pool of the third": ([5, 6], [ONE, ONE, TOO_LONG]),
    "params not SamplingParams": ([5, 6], [ONE, {"max_new_tokens": 2}]),
}


def _per_sample_error(eng: RolloutEngine, prompt, params) -> BaseException:
    """What the group met when each sample's ``add_request`` converted and checked the prompt itself."""
    added = []
    try:
        for p in params:
            added.append(eng.add_request(prompt, p))
    except Exception as e:  # noqa: BLE001 - the error to compare with
        return e
    finally:
        for request_id in added:
            eng.abort(request_id)
    raise AssertionError("the group was accepted")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_group_is_refused_whole_with_the_per_sample_error(tiny, case):
    prompt, params = CASES[case]
    expected = _per_sample_error(engine(tiny), prompt, params)
    eng = engine(tiny)
    client = InProcessRolloutClient(eng)
    try:
        with pytest.raises(type(expected)) as got:
            asyncio.run(client.agenerate_many(prompt, params))
    finally:
        client.close()
    assert str(got.value) == str(expected)
    assert client.num_pending == 0 and not eng.has_unfinished()


@pytest.mark.parametrize("prompt", [[5, 6], [5, VOCAB], "abc"])
def test_a_torn_engine_refuses_first_whatever_the_prompt(tiny, prompt):
    from areno.rollout.engine import TornWeightsError

    eng = engine(tiny)
    eng.mark_torn("sync failed")
    client = InProcessRolloutClient(eng)
    try:
        with pytest.raises(TornWeightsError, match="sync failed"):
            asyncio.run(client.agenerate_many(prompt, [ONE, ONE]))
    finally:
        client.close()
    assert client.num_pending == 0
