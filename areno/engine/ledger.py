"""The data cursor of an asynchronous run: which prompts were handed out and not yet trained.

The everlasting rollout pool reads the prompt stream ahead of training: a prefetched sample,
episodes in flight, finished groups waiting for a trainer step. The stream's own cursor therefore
runs ahead of what was trained, and a checkpoint that stored only it would skip those prompts on
resume. ``SampleLedger`` sits between the stream and the pool: every sample it hands out is
pending until the trainer takes its group (``trained``) or the pool ``release``s it, done without a
group: rejected by the workflow, dropped after its attempts, or filtered, once a later group comes
(the streak that stops the run, a broken engine or workflow, stays pending for the resumed run to
generate); a prompt the engine refuses at once, the row's own fault; or too stale on every attempt (a
stale one is re-queued by the pool first, so it stays pending meanwhile). The pending set is therefore
what the pool holds, bounded by its staleness capacity and the streaks that stop it. A synchronous
step settles its samples together: trained when its batch is taken, pending when it stops the run.
A checkpoint stores the stream cursor together with the pending samples; after resume
they are handed out first — regenerated under the restored policy — and the stream continues where
it stopped. No prompt is skipped and none is trained twice.

Reproducible sampling: every hand-out has a key, the stream position it came from (epoch,
position), kept across replay. ``LedgerWorkflow`` derives the episode's sampling seed from it and
``SeedingClient`` gives each request of the episode ``episode_seed + k`` (k-th request of the
episode), so the tokens sampled for a prompt depend on the policy, the seed and the prompt's place
in the data order only — not on which other requests share the engine's batch, which depends on
thread timing. A synchronous run therefore samples the same tokens after a resume as without one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import random
import threading
from typing import Any

from areno.data.tasks import PromptStream
from areno.engine.executor import SampleSource
from areno.engine.staleness import StalenessManager
from areno.rollout.client import RolloutClient
from areno.workflows.base import EPISODE_SEED, EPISODE_SEEDS, EpisodeSeeds, RolloutWorkflow, as_group, run_episode_name

SEQ_KEY = "ledger_seq"
"""``Trajectory.info`` key holding the ledger number of the sample the trajectory came from."""


def episode_seed(base_seed: int, key: tuple[int, int]) -> int:
    """Sampling seed of the episode of the sample at stream position ``key`` = (epoch, position)."""
    # 52 bits: the engine carries seeds through float64 (exact below 2**53), with room for + k
    return random.Random(f"areno/{base_seed}/{key[0]}/{key[1]}").getrandbits(52)


class SampleLedger(SampleSource):
    """An iterator of samples (replayed ones first, then the stream) that remembers what is pending."""

    def __init__(self, stream: PromptStream) -> None:
        self.stream = stream
        self._lock = threading.Lock()
        self._replay: collections.deque[tuple[dict[str, Any], tuple[int, int]]] = collections.deque()
        self._pending: dict[int, tuple[dict[str, Any], tuple[int, int]]] = {}  # seq -> (sample, key), hand-out order
        self._seq_by_id: dict[int, int] = {}  # id(sample object handed out) -> seq
        self._next_seq = 0
        self.trained_groups = 0
        """Groups the trainer took since the run began (restored on resume)."""

    def __iter__(self) -> SampleLedger:
        return self

    def __next__(self) -> dict[str, Any]:
        with self._lock:
            if self._replay:
                row, key = self._replay.popleft()
            else:
                row = self.stream.take(1)[0]
                key = (self.stream.epoch, self.stream.position)
            sample = dict(row)  # a new object per hand-out: its identity names this hand-out
            seq = self._next_seq
            self._next_seq += 1
            self._pending[seq] = (sample, key)
            self._seq_by_id[id(sample)] = seq
        return sample

    def take(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` samples (the synchronous path)."""
        return [next(self) for _ in range(n)]

    def begin_step(self) -> None:
        """A synchronous step begins: the rows its rounds take from the stream are one batch
        (``PromptStream.begin_batch``), which holds no prompt twice where the data allows."""
        with self._lock:
            self.stream.begin_batch()

    def lookup(self, sample: dict[str, Any]) -> tuple[int, tuple[int, int]] | None:
        """(ledger number, stream key) of a handed-out sample; None for samples not from here."""
        with self._lock:
            seq = self._seq_by_id.get(id(sample))
            return None if seq is None else (seq, self._pending[seq][1])

    def _forget_locked(self, seq: int) -> None:
        entry = self._pending.pop(seq, None)
        if entry is not None:
            del self._seq_by_id[id(entry[0])]

    def trained(self, seqs: list[int | None]) -> None:
        """The trainer took these samples' groups."""
        with self._lock:
            for seq in seqs:
                if seq is not None:
                    self._forget_locked(seq)
            self.trained_groups += len(seqs)

    def release(self, sample: dict[str, Any]) -> None:
        """The pool is done with the sample, untrained, as in an uninterrupted run: it is not replayed."""
        with self._lock:
            seq = self._seq_by_id.get(id(sample))
            if seq is not None:
                self._forget_locked(seq)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._replay)

    def state_dict(self) -> dict[str, Any]:
        """Stream cursor, untrained samples (hand-out order, then not yet replayed ones) and the
        trained-group count, taken atomically with respect to the pool's reads."""
        with self._lock:
            untrained = list(self._pending.values()) + list(self._replay)
            return {
                "stream": self.stream.state_dict(),
                "pending": [{"row": dict(row), "key": list(key)} for row, key in untrained],
                "trained_groups": self.trained_groups,
            }

    @property
    def num_handed_out(self) -> int:
        """Samples handed out to the rollout pool and not yet trained (0 before the pool starts;
        ``num_pending`` also counts the loaded ones not yet replayed)."""
        with self._lock:
            return len(self._pending)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            assert not self._pending, "load the ledger before the rollout pool starts"
            self.stream.load_state_dict(state["stream"])
            self._replay = collections.deque(
                (dict(p["row"]), (int(p["key"][0]), int(p["key"][1]))) for p in state["pending"]
            )
            self.trained_groups = int(state["trained_groups"])


class LedgerWorkflow(RolloutWorkflow):
    """Runs the user's workflow under the episode's sampling seed; trajectories carry their sample's
    ledger number in ``info[SEQ_KEY]``. The pool, which decides each sample's fate, tells the ledger."""

    def __init__(self, inner: RolloutWorkflow, ledger: SampleLedger, *, seed: int) -> None:
        self.inner = inner
        self.ledger = ledger
        self.seed = seed

    async def run_episode(self, client: Any, sample: dict[str, Any]):
        found = self.ledger.lookup(sample)
        seq = found[0] if found is not None else None
        # a retry starts its seeds over, as the first attempt of the same sample would
        seed = episode_seed(self.seed, found[1]) if found is not None else None
        token = EPISODE_SEEDS.set(EpisodeSeeds(seed)) if seed is not None else None
        seed_token = EPISODE_SEED.set(seed) if seed is not None else None
        try:
            group = as_group(await self.inner.run_episode(client, sample), source=run_episode_name(self.inner))
        finally:
            # a coroutine closed by a stopping loop runs this in another context, where there is nothing to
            # reset: the ValueError it raises read as a failed episode, "retrying" after the run stopped
            with contextlib.suppress(ValueError):
                if token is not None:
                    EPISODE_SEEDS.reset(token)
                if seed_token is not None:
                    EPISODE_SEED.reset(seed_token)
        if seq is not None and group is not None:
            for traj in group:
                traj.info[SEQ_KEY] = seq
        return group


SETTLE_TURNS = 3
"""Event-loop turns without a new request after which a held burst of requests is released."""


class SeedingClient(RolloutClient):
    """A ``RolloutClient`` wrapper: a request without a seed made inside an episode of
    ``LedgerWorkflow`` gets the episode's next seed. Everything else is the wrapped client's.

    ``hold(release)``: the caller has paused the engine; the next burst of requests queues up and
    ``release`` runs once no new request arrived for ``SETTLE_TURNS`` turns of the event loop.
    The engine then starts on the whole burst in arrival order, which asyncio makes deterministic,
    instead of on whatever part of it had arrived when its driver thread woke: on CPU the rounding
    of a forward pass depends on what shares its batch, so this makes the log-probs of a
    synchronous single-turn rollout reproducible bit for bit."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._release: Any = None
        self._settler: asyncio.Task | None = None
        self._arrivals = 0

    def hold(self, release: Any) -> None:
        self._release = release

    def release_now(self) -> None:
        """Release a held burst that never came (every episode ended without a request)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    async def agenerate(self, prompt_ids: list[int], sampling_params: Any, **kwargs: Any):
        sampling_params = self._arrive([sampling_params])[0]
        return await self.inner.agenerate(prompt_ids, sampling_params, **kwargs)

    async def agenerate_many(self, prompt_ids: list[int], params: list[Any], **kwargs: Any):
        return await self.inner.agenerate_many(prompt_ids, self._arrive(params), **kwargs)

    def _arrive(self, params: list[Any]) -> list[Any]:
        """Seed the unseeded sampled requests from the episode's seeds (in order) and count them."""
        seeds = EPISODE_SEEDS.get(None)
        if seeds is not None:
            params = [
                dataclasses.replace(p, seed=seeds.next()) if p.seed is None and p.temperature > 0 else p for p in params
            ]
        self._arrivals += len(params)
        if self._release is not None and self._settler is None:
            self._settler = asyncio.get_running_loop().create_task(self._asettle())
        return params

    async def _asettle(self) -> None:
        seen, quiet = self._arrivals, 0
        while quiet < SETTLE_TURNS:
            await asyncio.sleep(0)
            quiet = quiet + 1 if self._arrivals == seen else 0
            seen = self._arrivals
        self._settler = None
        self.release_now()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ResumableStaleness(StalenessManager):
    """``StalenessManager`` whose accepted count can be restored from a checkpoint."""

    def credit_accepted(self, n: int) -> None:
        """Count ``n`` groups accepted before a resume, so the restored pool stays within η."""
        with self._lock:
            self._accepted += n
