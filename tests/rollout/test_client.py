import asyncio
import threading

import pytest

from areno.rollout.client import InProcessRolloutClient
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams
from tests.helpers.rollout import EOS, make_model, naive_greedy, random_prompts

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


def test_weight_updates_from_another_thread_during_generation():
    """A trainer thread swaps weights while the driver thread generates: every output's versions
    are non-decreasing and end at most at the last published version."""
    import threading

    model, cfg = make_model(0)
    other, _ = make_model(1)
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=256), eos_token_ids=())
    client = InProcessRolloutClient(eng)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)
    states = [other.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}]

    swapped = [threading.Event() for _ in range(5)]
    step = eng.step

    def step_then_wait():
        # past a swap point the driver waits for the trainer's swap (on a loaded machine it could
        # otherwise finish every request before the trainer thread runs at all)
        out = step()
        v = next((v for v in range(1, 5) if not swapped[v].is_set()), None)
        if v is not None and eng.stats()["generated_tokens"] >= 24 * v:
            swapped[v].wait(10)
        return out

    eng.step = step_then_wait

    def trainer():
        for version in range(1, 5):
            while eng.stats()["generated_tokens"] < 24 * version:  # swap mid-generation
                time.sleep(0.002)
            eng.pause()
            eng.update_weights(states[version % 2].items(), version=version)
            eng.resume()
            swapped[version].set()
            client.wake()

    import time

    async def main():
        t = threading.Thread(target=trainer)
        t.start()
        outs = await asyncio.gather(*(client.agenerate([5, 6, 7, i + 8], params) for i in range(6)))
        t.join()
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        client.close()
    for out in outs:
        assert len(out.output_ids) == 30
        assert out.output_versions == sorted(out.output_versions) and out.output_versions[-1] <= 4
    assert eng.version == 4 and all(len(set(o.output_versions)) > 1 for o in outs)


def test_agenerate_many_enters_the_engine_as_one_group(tiny):
    """A group's requests are added together and the driver thread woken once (here it wakes only
    when told): the first step admits the whole group; the outputs come back in ``params`` order."""
    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=128), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng, idle_wait_s=3600.0)
    prompt = random_prompts(1, seed=21)[0]
    one_token = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    lengths = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (3, 1, 5, 2)]
    try:
        burst = asyncio.run(client.agenerate_many(prompt, [one_token] * 6))
        steps = eng.stats()["steps"]
        outs = asyncio.run(client.agenerate_many(prompt, lengths))
    finally:
        client.close()
    assert steps == 1 and len(burst) == 6  # six one-token requests admitted and finished by one step
    ref = naive_greedy(model, prompt, 5)[0]
    assert [o.output_ids for o in outs] == [ref[:3], ref[:1], ref[:5], ref[:2]]


def test_agenerate_many_refuses_a_bad_group_whole_and_aborts_it_on_timeout(tiny):
    from areno.rollout.client import RolloutRequestTimeout

    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=16), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng, request_timeout_s=0.2)
    too_long = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)  # beyond the 64-token pool
    try:
        with pytest.raises(ValueError, match="exceeds the KV pool"):
            asyncio.run(client.agenerate_many([5, 6, 7], [GREEDY, GREEDY, too_long]))
        assert not eng.has_unfinished() and client.num_pending == 0  # the two valid ones were withdrawn
        eng.pause()  # a stalled engine: nothing finishes before the deadline
        with pytest.raises(RolloutRequestTimeout, match="did not finish within 0.2s"):
            asyncio.run(client.agenerate_many([5, 6, 7], [GREEDY, GREEDY]))
        assert not eng.has_unfinished() and client.num_pending == 0
        eng.resume()
        client.wake()
        assert [len(o.output_ids) for o in asyncio.run(client.agenerate_many([5, 6, 7], [GREEDY] * 2))] == [8, 8]
    finally:
        client.close()


def test_cancelled_group_aborts_its_requests_without_logging_an_unread_exception(tiny):
    """A GRPO group cancelled mid-generation (shutdown, staleness) aborts its requests and leaves
    nothing for asyncio to report ("_GatheringFuture exception was never retrieved", once per group)."""
    import gc

    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=128), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng, request_timeout_s=60.0)  # awaited through wait_for
    long = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)

    reported: list[str] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context["message"]))
        eng.pause()
        task = asyncio.ensure_future(client.agenerate_many([5, 6, 7], [long] * 3))
        await asyncio.sleep(0.05)
        assert client.num_pending == 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
        gc.collect()
    finally:
        client.close()
    assert reported == []
    assert client.num_pending == 0 and not eng.has_unfinished()


def _stepping_threads(eng) -> set[str]:
    """Record the name of every thread that steps ``eng`` from now on."""
    names: set[str] = set()
    step = eng.step

    def recorded():
        names.add(threading.current_thread().name)
        return step()

    eng.step = recorded
    return names


def test_caller_drives_steps_the_engine_in_the_waiting_thread(tiny):
    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=128), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng, caller_drives=True)
    stepping = _stepping_threads(eng)
    prompts = random_prompts(4, seed=21)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    loop_thread.start()

    async def main():
        return await asyncio.gather(*(client.agenerate(p, GREEDY) for p in prompts))

    try:
        done = client.drive_until(lambda: asyncio.run_coroutine_threadsafe(main(), loop))
        outs = done.result(timeout=0)  # finished when drive_until returned
        driver = client._thread
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        client.close()
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == naive_greedy(model, prompt, 8)[0]
    assert stepping == {threading.current_thread().name}  # no driver thread stepped it
    assert driver is None  # nor was one started


def test_caller_drives_client_still_serves_requests_nobody_drives(tiny):
    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=128), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng, caller_drives=True)
    stepping = _stepping_threads(eng)
    prompt = random_prompts(1, seed=22)[0]
    try:
        out = asyncio.run(client.agenerate(prompt, GREEDY))  # no drive_until: the driver thread steps
        driver = client._thread
        if driver is not None:
            driver.join(timeout=10)  # it ends once the engine is idle, its thread team with it
        ended = client._thread is None and (driver is None or not driver.is_alive())
    finally:
        client.close()
    assert out.output_ids == naive_greedy(model, prompt, 8)[0]
    assert stepping == {"areno-rollout-driver"}
    assert ended


def test_drive_until_without_caller_drives_leaves_driving_to_the_thread(tiny):
    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=128), eos_token_ids=(EOS,))
    client = InProcessRolloutClient(eng)
    stepping = _stepping_threads(eng)
    prompt = random_prompts(1, seed=23)[0]
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    loop_thread.start()
    try:
        done = client.drive_until(lambda: asyncio.run_coroutine_threadsafe(client.agenerate(prompt, GREEDY), loop))
        out = done.result(timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        client.close()
    assert out.output_ids == naive_greedy(model, prompt, 8)[0]
    assert stepping == {"areno-rollout-driver"}
