"""The long-tailed workload shared by bench/async.py and bench/partitioned.py: prompts whose
completion length is fixed per row (a fraction of them long), EOS ignored, and a cheap
verifiable reward any model can learn."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

from areno.workflows.rlvr import RLVRWorkflow


class LongTailWorkflow(RLVRWorkflow):
    """RLVR with the completion length fixed per row (``row["len"]`` tokens, EOS ignored)."""

    async def run_episode(self, client, sample):
        # a per-episode copy: episodes run concurrently on one workflow object
        episode = object.__new__(type(self))
        episode.__dict__.update(self.__dict__)
        episode.sampling_params = dataclasses.replace(
            self.sampling_params, max_new_tokens=int(sample["len"]), ignore_eos=True
        )
        return await RLVRWorkflow.run_episode(episode, client, sample)


def parity_reward(prompt: str, completion: str, answer, **fields) -> float:
    """1 when the completion holds an even number of digits."""
    return float(sum(c.isdigit() for c in completion) % 2 == 0)


def long_tail_rows(*, short_len: int, long_len: int, long_frac: float, seed: int) -> Iterator[dict]:
    """Endless ``{"id", "prompt", "answer", "len"}`` rows; ``long_frac`` of them ``long_len`` long."""
    rng = random.Random(seed)
    i = 0
    while True:
        a, b = rng.randrange(1000), rng.randrange(1000)
        length = long_len if rng.random() < long_frac else short_len
        yield {"id": i, "prompt": f"{a}+{b}=", "answer": a + b, "len": length}
        i += 1
