"""``Stepper``: one step of the rollout engine, from the scheduled batch to the finished requests.

One ``step()`` = admit new requests → schedule (``scheduler.py``) → one packed forward of the shared
``Decoder`` with the paged-KV attention backend (``attention.py``) → sample (``sampling.py``) → stop
checks. A pure-decode batch runs ``decode_steps`` forwards back to back instead (a CUDA-graph loop
where one is captured, ``cuda_graph.py``): sampling, feeding the tokens back and the stop/length
checks stay on the device, and one small tensor is copied to the host at the end. A mixed step of a
large batch goes on the same way with ``decode_steps - 1`` decode steps of every row that sampled in
it (``RolloutEngineConfig.mixed_decode_min_rows``).

The stepper holds the engine's parts it runs (model, cache, scheduler, sampler, graphs) and the
counters ``RolloutEngine.stats`` reports; the model's output projection and the sampler are called
through the engine's ``logits`` / ``sample_rows`` hooks (tensor parallelism overrides them, ``tp.py``).
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from areno.data.detokenize import TextTail, text_tail
from areno.models.moe import RouteCapture, sparse_blocks
from areno.observe.startup import mark_first_token
from areno.rollout.attention import PagedAttention
from areno.rollout.control import EngineControl
from areno.rollout.cuda_graph import DecodeGraphRunner
from areno.rollout.kv_cache import KVCache
from areno.rollout.prefill_graph import PrefillGraphRunner
from areno.rollout.presence import PresenceTable
from areno.rollout.requests import RequestTable
from areno.rollout.sampling import RowParams, RowTable, check_stop, stop_decision
from areno.rollout.scheduler import ScheduledBatch, Scheduler, Sequence
from areno.types import GenerationOutput

WAITING_CLAMP_MAX_ROWS = 32
"""With requests waiting for a slot, a pure-decode batch of fewer rows runs only until its first row
can end by length (so a waiting request joins at once); a larger batch runs its full ``decode_steps``:
one freed slot idle for a few steps costs little there, while a host round trip per token (most
rows' remaining lengths differ) made asynchronous rollouts host-bound (bench/LOG.md)."""


IMAGE_FEATURES_KEPT = 16
"""Vision-tower outputs the stepper keeps for the next samples of the same images."""


class Stepper:
    graphs: DecodeGraphRunner | None
    """Decode CUDA graphs (None: every step runs eagerly); ``RolloutEngine`` sets it after construction."""
    prefill_graphs: PrefillGraphRunner | None
    """Prefill CUDA graphs (None: steps with prompt chunks run eagerly); set by ``RolloutEngine`` too."""

    def __init__(
        self,
        *,
        control: EngineControl,
        requests: RequestTable,
        scheduler: Scheduler,
        model: torch.nn.Module,
        cache: KVCache,
        config: Any,
        device: torch.device,
        decode_steps: int,
        max_model_len: int,
        max_position: int,
        vocab_size: int,
        sliding_window: int | None,
        window_layers: tuple[int, ...] | None,
        eos_token_ids: tuple[int, ...],
        logits: Callable[[torch.Tensor], torch.Tensor],
        sample_rows: Callable[[torch.Tensor, RowParams], tuple[torch.Tensor, torch.Tensor]],
        presence: PresenceTable,
    ) -> None:
        """``config``: the engine's ``RolloutEngineConfig``; ``logits``: hidden states [B, D] to
        full-vocabulary logits [B, V] (fp32, or the model dtype on CUDA); ``sample_rows``: logits to token ids and log-probs [B];
        ``presence``: the seen tokens of each slot's sequence, which the sampler reads for a repetition penalty."""
        self.control, self.requests, self.scheduler = control, requests, scheduler
        self.model, self.cache, self.config, self.device = model, cache, config, device
        self.decode_steps, self.max_model_len, self.max_position = decode_steps, max_model_len, max_position
        self.vocab_size, self.sliding_window, self.eos_token_ids = vocab_size, sliding_window, eos_token_ids
        self.window_layers = window_layers
        self.logits, self.sample_rows = logits, sample_rows
        self.graphs = None
        self.prefill_graphs = None
        self.routes: RouteCapture | None = None
        """With ``config.record_routes`` on a mixture of experts: what every forward's sparse layers
        record, handed to the sequences after each forward (``Sequence.routes``)."""
        blocks = sparse_blocks(model) if config.record_routes else []
        if blocks:
            self.routes = RouteCapture()
            for b in blocks:
                b.record = self.routes
        self.row_table = RowTable(config.max_num_seqs + 1)
        """Static sampling rows of the running requests by slot (``Sequence.row``)."""
        self.presence = presence
        """Seen tokens by slot: synced before a step with a penalised row (rows new to their slot rebuilt)."""
        # Counters (``RolloutEngine.stats``), plain ints: the server's watchdog reads ``steps`` unlocked.
        self.steps = 0
        self.round_trips = 0
        self.generated_tokens = 0
        self.prefill_tokens = 0
        self.mixed_steps = 0
        self.busy_s = 0.0
        """Seconds spent in steps that ran a batch (``stats()["busy_s"]``: busy fraction over time)."""
        self._last_step_ran = False
        self.overlap = (
            config.overlap_round_trips
            and decode_steps > 1
            and self.routes is None
            and (device.type == "cuda" or config.overlap_round_trips_on_cpu)
        )
        """Chain pure-decode round trips (``RolloutEngineConfig.overlap_round_trips``); a
        tensor-parallel engine turns it off (its ranks must take the same steps)."""
        self.chained_round_trips = 0
        """Round trips launched before the host read the previous one's tokens."""
        self._text_tails: weakref.WeakKeyDictionary[Sequence, TextTail | None] = weakref.WeakKeyDictionary()
        """Per sequence with stop strings: its output's text, followed token by token (``_text_tail``)."""
        self.vision_runs = 0
        """Vision-tower forwards (image prompts): one per distinct image set and policy version."""
        self._image_features: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        """Recent vision-tower outputs by (``Sequence.prefix_root``, policy version): the samples of
        a GRPO group share one (the prefix cache shares their K/V, this their image rows)."""

    def step(self) -> list[GenerationOutput]:
        c = self.control
        with c.lock:
            t0 = time.perf_counter()
            try:
                return self._step_locked()
            finally:
                # counted under the lock: a stats() snapshot sees whole steps (its busy_s and
                # clock_s are read together, so busy_s / elapsed stays within [0, 1] per window)
                if self._last_step_ran:
                    self.busy_s += time.perf_counter() - t0

    def _step_locked(self) -> list[GenerationOutput]:
        self.requests.admit()
        self._last_step_ran = False
        c = self.control
        if c.paused or c.sleeping or c.torn is not None or not self.scheduler.has_unfinished():
            return []
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self._last_step_ran = True
        pure_decode = batch.num_decode == len(batch.seqs) and all(batch.samples)
        sampling = batch.seqs if pure_decode else [s for s, do in zip(batch.seqs, batch.samples) if do]
        self.prefill_tokens += batch.num_tokens - len(sampling)
        self.mixed_steps += not pure_decode
        if not sampling:
            self._forward(batch)
            self.scheduler.after_step(batch)
            self.steps += 1
            return []
        slots = [s.row for s in sampling]
        self.row_table.sync(slots, [s.sample_row for s in sampling])
        lengths = [len(s.token_ids) for s in sampling]
        rp = RowParams.gather(
            self.row_table,
            slots,
            [n - len(s.prompt_ids) for s, n in zip(sampling, lengths)],
            lengths,
            self.max_model_len,
            self.device,
            self.presence,
        )
        if rp.any_penalty:
            self.presence.sync(slots, sampling)
        if pure_decode:
            k = self._plan_decode_steps(batch.seqs)
            if k > 1 and self.overlap:
                return self._chained_decode(batch, k, rp)
            tokens_KB, logprobs_KB, keep_B = self._run_decode(batch, k, rp)
            self.scheduler.after_step(batch, k)
            self.steps += k
        else:
            logits_BV = self._forward(batch)
            self.scheduler.after_step(batch)
            tokens_B, logprobs_B = self.sample_rows(logits_BV, rp)
            self.steps += 1
            k, tokens_KB, logprobs_KB, keep_B = self._decode_after_mixed(
                sampling, len(batch.seqs), tokens_B, logprobs_B, rp
            )
        self.round_trips += 1
        return self._commit_tokens(sampling, *_read_tokens(_token_table(tokens_KB, logprobs_KB, keep_B).cpu(), k))

    def _chained_decode(self, batch: ScheduledBatch, k: int, rp: RowParams) -> list[GenerationOutput]:
        """Pure-decode round trips back to back (``overlap_round_trips``): the next k-step loop is
        launched, fed the last tokens on the device, before the host reads this one's, so the
        host's reading and stop checks of round trip N run while the device decodes N + 1. Chains
        while no row has ended, nothing has arrived and nobody waits for the step lock; reads the
        last launched round trip before returning. A row that ended in N ran on in N + 1: those
        tokens are dropped, and its K/V past its end went to positions no one reads (blocks it
        releases, or the scratch block), which later steps overwrite in stream order."""
        seqs = batch.seqs
        launched: list[tuple[int, tuple[torch.Tensor, torch.cuda.Event | None]]] = []

        def launch(k: int, rp: RowParams, ids_B: torch.Tensor | None) -> torch.Tensor:
            tokens_KB, logprobs_KB, keep_B = self._run_decode(batch, k, rp, ids_B=ids_B)
            self.scheduler.after_step(batch, k)
            self.steps += k
            self.round_trips += 1
            # copied out before the next launch may overwrite a graph's output buffers (stream order)
            launched.append((k, _copy_out(_token_table(tokens_KB, logprobs_KB, keep_B))))
            return tokens_KB[k - 1]

        last_B = launch(k, rp, None)
        ahead = k  # tokens launched that the host has not read
        chaining = True
        outputs: list[GenerationOutput] = []
        while launched:
            if chaining and len(launched) == 1:
                k_next = self._plan_decode_steps(seqs, sampled=ahead, k=self.decode_steps)
                if k_next > 1:
                    rp = rp.shifted(launched[0][0])
                    last_B = launch(k_next, rp, last_B)
                    ahead += k_next
                    self.chained_round_trips += 1
                chaining = k_next > 1
            n, (host_XB, ready) = launched.pop(0)
            if ready is not None:
                ready.synchronize()
            ahead -= n
            tokens_BK, logprobs_BK, keep_B = _read_tokens(host_XB, n)
            if outputs:  # rows that ended in the round trip before: their tokens here are past their end
                ended = {out.request_id for out in outputs}
                rows = [i for i, s in enumerate(seqs) if s.request_id not in ended]
                assert keep_B is not None
                outputs += self._commit_tokens(
                    [seqs[i] for i in rows],
                    [tokens_BK[i] for i in rows],
                    [logprobs_BK[i] for i in rows],
                    [keep_B[i] for i in rows],
                )
            else:
                outputs += self._commit_tokens(seqs, tokens_BK, logprobs_BK, keep_B)
            if outputs or self.requests.inbox or self.control.lock.waiters:
                chaining = False
        return outputs

    def _decode_after_mixed(
        self,
        sampling: list[Sequence],
        num_scheduled: int,
        tokens_B: torch.Tensor,
        logprobs_B: torch.Tensor,
        rp: RowParams,
    ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """After a mixed step sampled each row's next token (``tokens_B``, on the device, not yet in
        ``token_ids``): up to ``decode_steps - 1`` decode steps of these rows in the same round trip
        (``mixed_decode_min_rows``; ``num_scheduled``: the step's sequences, sampling or not).
        Returns (K, token ids and log-probs [K, B], real tokens per row [B] or None when K = 1): the
        first token, then the decode steps' (none for a row the first token ended: a stop id, or its
        length limit)."""
        m = self.config.mixed_decode_min_rows
        sched = self.scheduler
        # Not while prefill work is left that the next round trip would start: a prompt partly
        # prefilled, or waiting requests with free slots (the step's token budget ran out).
        go_on = (
            m is not None
            and len(sampling) >= m
            and len(sampling) == num_scheduled
            and (not sched.waiting or len(sched.running) >= sched.max_num_seqs)
        )
        k = self._plan_decode_steps(sampling, sampled=1) if go_on else 1
        if k <= 1:
            return 1, tokens_B[None], logprobs_B[None], None
        B = len(sampling)
        batch = ScheduledBatch(
            seqs=sampling,
            starts=[s.num_computed for s in sampling],
            num_new=[1] * B,
            samples=[True] * B,
            rows=[s.row for s in sampling],
            num_decode=B,
        )
        first_done_B = rp.advance(tokens_B)
        tokens_KB, logprobs_KB, keep_B = self._run_decode(batch, k, rp.shifted(1), ids_B=tokens_B)
        self.scheduler.after_step(batch, k)
        self.steps += k
        keep_B = torch.where(first_done_B, 0, keep_B) + 1
        return k + 1, torch.cat((tokens_B[None], tokens_KB)), torch.cat((logprobs_B[None], logprobs_KB)), keep_B

    def _commit_tokens(
        self,
        sampling: list[Sequence],
        tokens_BK: list[list[int]],
        logprobs_BK: list[list[float]],
        keep_B: list[int] | None,
    ) -> list[GenerationOutput]:
        """Append each row's new tokens (its first ``keep_B`` of K; all K = 1 when None), apply the
        stop rules, finish requests."""
        done: list[tuple[Sequence, str]] = []
        eos = self.eos_token_ids
        version = self.control.version
        max_len = self.max_model_len
        generated = 0
        for i, (seq, toks, lps) in enumerate(zip(sampling, tokens_BK, logprobs_BK)):
            n = keep_B[i] if keep_B is not None else 1
            p = seq.params
            ids = seq.token_ids
            if p.stop:  # stop strings need the decoded text after every token
                known = len(ids)
                reason = None
                plen = len(seq.prompt_ids)
                tail = self._text_tail(seq)
                for t, lp in zip(toks[:n], lps[:n]):
                    ids.append(t)
                    seq.output_logprobs.append(lp)
                    seq.output_versions.append(version)
                    count = len(ids) - plen
                    text, offset, searched = None, 0, 0
                    if tail is not None:
                        tail.add(t)
                    if count >= p.min_new_tokens:  # the text matters only from here
                        if seq.stop_from is None:  # once: min_new_tokens reached
                            head = ids[plen : plen + max(p.min_new_tokens - 1, 0)]
                            seq.stop_from = len(self.requests.decode(head) or "")
                        if tail is not None:
                            (text, offset), searched = tail.tail(), tail.searched
                        else:  # a tokenizer whose text can change anywhere: all of it, every token
                            text = self.requests.decode(ids[plen:])
                    reason, cut = stop_decision(p, count, t, eos, text, seq.stop_from or 0, searched, offset)
                    if reason is None and len(ids) >= max_len:
                        reason = "length"
                    if reason is not None:
                        # the whole text once, as before: cut before the stop string that matched
                        seq.text = text if tail is None and text is not None else self.requests.decode(ids[plen:])
                        if cut is not None and seq.text is not None:
                            seq.text = seq.text[:cut]
                        break
                    if tail is not None and count >= p.min_new_tokens:
                        tail.mark()
                generated += len(ids) - known
            else:
                if n == 1:
                    ids.append(toks[0])
                    seq.output_logprobs.append(lps[0])
                    seq.output_versions.append(version)
                else:
                    ids.extend(toks[:n])
                    seq.output_logprobs.extend(lps[:n])
                    seq.output_versions.extend([version] * n)
                generated += n
                # check_stop can only end the request on a stop/EOS token (``sample_row[9]``) or at
                # its length limit; skip the call (and its copy of the output ids) otherwise.
                if len(ids) >= seq.limit or ids[-1] in seq.sample_row[9]:
                    reason, seq.text = check_stop(p, seq.output_ids, eos, None)
                    if reason is None and len(ids) >= max_len:
                        reason = "length"
                else:
                    reason = None
            if reason is not None:
                del self.requests.live[seq.request_id]
                done.append((seq, reason))
        if done:
            self.scheduler.remove_finished([seq for seq, _ in done])
        if generated and not self.generated_tokens:
            mark_first_token()
        self.generated_tokens += generated
        return self.requests.outputs(done) if done else []

    def _text_tail(self, seq: Sequence) -> TextTail | None:
        """``seq``'s output text as its tokens arrive (made at its first tokens), so that a stop-string
        check decodes one token, not the whole output (O(L^2) a request, on the step thread). None
        without a tokenizer, or where only a whole decode gives the text (``text_tail``)."""
        try:
            return self._text_tails[seq]
        except KeyError:
            pass
        tok = self.requests.tokenizer
        tail = text_tail(tok, max(len(s) for s in seq.params.stop) - 1) if tok is not None else None
        if tail is not None:
            for t in seq.output_ids:  # tokens it already has (none, unless it arrived with some)
                tail.add(t)
        self._text_tails[seq] = tail
        return tail

    def _plan_decode_steps(self, seqs: list[Sequence], sampled: int = 0, k: int | None = None) -> int:
        """How many decode steps these rows run before the next host round trip (their blocks for
        them are reserved here; 1 when the pool cannot hold them). ``sampled``: tokens each row
        sampled earlier, not yet in its ``token_ids`` (1 after a mixed step; a chained round trip's
        tokens in flight). ``k``: steps wanted (default ``decode_steps - sampled``: k tokens per
        round trip in all, after a mixed step's first one)."""
        k = self.decode_steps - sampled if k is None else k
        if k <= 1:
            return 1
        remaining = [s.limit - len(s.token_ids) - sampled for s in seqs]
        k = min(k, max(remaining))
        if self.scheduler.waiting and len(seqs) < WAITING_CLAMP_MAX_ROWS:
            # a small full batch: let a waiting request take the first slot a length limit frees
            k = min(k, min(remaining))
        if k <= 1:
            return 1
        # Step j writes the K/V of position num_computed + j; a row stops needing blocks at its end.
        upto = [s.num_computed + (k if r >= k else r) for s, r in zip(seqs, remaining)]
        return k if self.scheduler.reserve_ahead(seqs, upto) else 1

    def _run_decode(
        self, batch: ScheduledBatch, k: int, rp: RowParams, ids_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``k`` decode steps of a pure-decode batch without a host round trip. Returns token ids
        and log-probs [k, B] and, for k > 1, how many of each row's tokens are real (a row that
        hits a stop id or its length limit keeps running; its later tokens are discarded).
        ``ids_B``: the rows' input tokens on the device (tokens sampled earlier in this round trip,
        at position ``num_computed``); None: each row's last token."""
        seqs = batch.seqs
        B = len(seqs)
        first_B = ids_B
        ids = [0] * B if first_B is not None else [s.token_ids[-1] for s in seqs]
        ctx = [s.num_computed + 1 for s in seqs]
        graph = None
        graphs = self.graphs
        # image prompts decode at their M-RoPE offset: eagerly (the graphs take plain positions)
        delta_B = _position_deltas(seqs)
        if delta_B is not None:
            graphs = None
        if graphs is not None and graphs.can_loop(batch, rp, k):
            # The whole k-step loop (forwards, sampling, stop and length checks) is one graph replay.
            out = graphs.run_loop(batch, ids, ctx, rp, k, ids_B=first_B)
            if out is not None:
                return out
        if graphs is not None and graphs.can_run(batch):
            prepared = graphs.prepare(batch, ids, ctx, ids_B=first_B)
            if prepared is not None:
                graph, ids_B, ctx_B = prepared
        if graph is None:  # eager (no graphs, a batch graphs cannot serve, or captures held)
            ids_ctx_2B = torch.tensor([ids, ctx], dtype=torch.long).to(self.device, non_blocking=True)
            if first_B is not None:
                ids_ctx_2B[0].copy_(first_B)
            ids_B, ctx_B = ids_ctx_2B[0], ids_ctx_2B[1]
            bt_BN = self.scheduler.block_tables_for(batch.rows, batch.max_blocks).to(self.device, non_blocking=True)
            kv_slots_BL = (
                PagedAttention.decode_kv_slots(bt_BN, self.config.block_size)
                if self.config.decode_attention == "gather"
                else None
            )
        tokens, logprobs, routes = [], [], []
        keep_B = alive_B = None
        if k > 1:
            keep_B = torch.full((B,), k, dtype=torch.long, device=self.device)
            alive_B = torch.ones(B, dtype=torch.bool, device=self.device)
            if graph is None and rp.num_seeded:
                rp.prefetch_uniforms(k)
        final_keys = max(s.limit for s in seqs) if graph is None else None
        for j in range(k):
            if graph is not None:
                logits_BV = graphs.replay(graph, B)
            else:
                attn = PagedAttention.for_decode(
                    self.cache,
                    bt_BN,
                    ctx_B,
                    self.sliding_window,
                    kv_slots_BL,
                    self.config.decode_attention,
                    carry=True,
                    final_keys=final_keys,
                    window_layers=self.window_layers,
                )
                pos_B = ctx_B - 1 if delta_B is None else ctx_B - 1 + delta_B.to(self.device)
                hidden_BD = self.model(ids_B, pos_B.clamp(max=self.max_position - 1), attn)
                logits_BV = self.logits(hidden_BD)
            if self.routes is not None:
                routes.append(self.routes.take())
            tokens_B, logprobs_B = self.sample_rows(logits_BV, rp)
            tokens.append(tokens_B)
            logprobs.append(logprobs_B)
            if k > 1:
                done_B = rp.advance(tokens_B)
                keep_B = torch.where(done_B & alive_B, j + 1, keep_B)
                alive_B &= ~done_B
                if j + 1 < k:
                    ids_B.copy_(tokens_B)
                    ctx_B.add_(1)
        if routes:  # step j ran each row's token at its start + j
            routes_KBLK = torch.stack(routes)
            for b, (seq, start) in enumerate(zip(seqs, batch.starts)):
                _add_routes(seq, start, routes_KBLK[:, b])
        return torch.stack(tokens), torch.stack(logprobs), keep_B

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [B, V] of the sequences that sample this step (in batch order)."""
        hidden_BD = self.prefill_graphs.hidden(batch) if self.prefill_graphs is not None else None
        if hidden_BD is not None:
            rows = [i for i, do in enumerate(batch.samples) if do]
            if len(rows) < len(batch.seqs):
                hidden_BD = hidden_BD[torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)]
            return self.logits(hidden_BD) if rows else hidden_BD.new_empty(0, self.vocab_size)
        logits_BV = self._forward_rows(batch)
        if self.routes is not None:
            _keep_routes(batch, self.routes.take())
        return logits_BV

    def _forward_rows(self, batch: ScheduledBatch) -> torch.Tensor:
        nd = batch.num_decode
        seqs, starts, samples = batch.seqs, batch.starts, batch.samples
        # Decode rows: one token each at its start; then each prefill chunk's tokens.
        ids = [s.token_ids[c] for s, c in zip(seqs[:nd], starts)]
        pos = starts[:nd]
        last = list(range(nd)) if all(samples[:nd]) else [i for i in range(nd) if samples[i]]
        for seq, start, n, do in zip(seqs[nd:], starts[nd:], batch.num_new[nd:], samples[nd:]):
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            if do:
                last.append(len(ids) - 1)
        T = len(ids)
        if any(s.images is not None for s in seqs):
            return self._forward_multimodal(batch, ids, last)
        # token ids, positions and the rows to sample in one host-to-device copy
        packed = torch.tensor(ids + pos + (last if len(last) < T else []), dtype=torch.long)
        packed = packed.to(self.device, non_blocking=True)
        attn = self._attention(batch, packed[T : T + nd])
        hidden_TD = self.model(packed[:T], packed[T : 2 * T], attn)
        if not last:
            return hidden_TD.new_empty(0, self.vocab_size)
        if len(last) == T:
            return self.logits(hidden_TD)
        return self.logits(hidden_TD[packed[2 * T :]])

    def _forward_multimodal(self, batch: ScheduledBatch, ids: list[int], last: list[int]) -> torch.Tensor:
        """``_forward`` of a batch holding image prompts: M-RoPE positions [3, T] (the prompt's
        from the request, generated tokens at index + delta), and the vision tower's rows for the
        image tokens of this step's prefill chunks."""
        nd = batch.num_decode
        seqs, starts = batch.seqs, batch.starts
        cols, embeds, mask = [], [], [False] * nd
        for s, c in zip(seqs[:nd], starts):
            cols.append(torch.full((3, 1), c + s.position_delta, dtype=torch.long))
        for s, start, n in zip(seqs[nd:], starts[nd:], batch.num_new[nd:]):
            cols.append(_chunk_positions(s, start, n))
            p = len(s.prompt_ids)
            mask.extend(
                j < p and s.images is not None and s.token_ids[j] == s.image_token_id for j in range(start, start + n)
            )
            rows = _chunk_image_rows(s, start, n)
            if rows is not None:
                if s.image_embeds is None:
                    s.image_embeds = self._vision(s)
                embeds.append(s.image_embeds[rows[0] : rows[1]])
        pos_3T = torch.cat(cols, dim=1).clamp(max=self.max_position - 1).to(self.device)
        ids_T = torch.tensor(ids, dtype=torch.long, device=self.device)
        attn = self._attention(batch, torch.tensor(starts[:nd], dtype=torch.long, device=self.device))
        image_embeds = torch.cat(embeds) if embeds else None
        mask_T = torch.tensor(mask, dtype=torch.bool, device=self.device)
        hidden_TD = self.model(ids_T, pos_3T, attn, image_embeds=image_embeds, image_mask_T=mask_T)
        if not last:
            return hidden_TD.new_empty(0, self.vocab_size)
        return self.logits(hidden_TD[torch.tensor(last, device=self.device)])

    def _vision(self, seq: Sequence) -> torch.Tensor:
        """``seq``'s image rows: the vision tower's output, computed once per image set and version."""
        key = (seq.prefix_root, self.control.version)
        feats = self._image_features.get(key)
        if feats is None:
            feats = self._image_features[key] = self.model.image_features(seq.images)
            self.vision_runs += 1
            while len(self._image_features) > IMAGE_FEATURES_KEPT:
                self._image_features.popitem(last=False)
        return feats

    def _attention(self, batch: ScheduledBatch, decode_pos_B: torch.Tensor) -> PagedAttention:
        """The attention metadata of a graph-less step. Its decode rows' (the large part at hundreds
        of rows) come from their block tables and positions on the device
        (``PagedAttention.for_decode`` in the engine's decode attention: the paged kernel, or key
        slots and masks for the gathered form) rather than from the host; the prefill chunks' from
        the host (``PagedAttention.build``). ``decode_pos_B``: the decode rows' positions, on the device."""
        nd = batch.num_decode
        bt_BN = self.scheduler.block_tables_for(batch.rows, batch.max_blocks)
        windows = dict(window_layers=self.window_layers)
        if nd == 0:
            return PagedAttention.build(self.cache, batch.chunks, self.device, self.sliding_window, bt_BN, **windows)
        width = max([len(s.block_table) for s in batch.seqs[:nd]])
        dec_bt_BN = bt_BN[:nd, :width].to(self.device, non_blocking=True)
        # decode rows as in a pure-decode step: the paged kernel where configured (on CUDA by default;
        # the gathered form's SDPA over [rows, context] took most of a mixed step's time on an H200)
        dec = PagedAttention.for_decode(
            self.cache,
            dec_bt_BN,
            decode_pos_B + 1,
            self.sliding_window,
            decode_attention=self.config.decode_attention,
            **windows,
        )
        if nd == len(batch.seqs):
            return dec
        pre = PagedAttention.build(
            self.cache, batch.chunks_from(nd), self.device, self.sliding_window, bt_BN[nd:], **windows
        )
        return PagedAttention.mixed(dec, pre)


def _token_table(tokens_KB: torch.Tensor, logprobs_KB: torch.Tensor, keep_B: torch.Tensor | None) -> torch.Tensor:
    """A round trip's token ids, log-probs [K, B] (and real tokens per row [B]) as one tensor
    [2K (+1), B]: one device-to-host copy."""
    parts = [tokens_KB.double(), logprobs_KB.double()] + ([keep_B.double()[None]] if keep_B is not None else [])
    return torch.cat(parts)


def _copy_out(table_XB: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``table_XB`` copied to pinned host memory without waiting: (the host tensor, the event after
    which it holds the values; None when it is on the host already)."""
    if table_XB.device.type != "cuda":
        return table_XB, None
    host_XB = torch.empty(table_XB.shape, dtype=table_XB.dtype, pin_memory=True)
    host_XB.copy_(table_XB, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host_XB, ready


def _read_tokens(host_XB: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]], list[int] | None]:
    """Per row: its k token ids, k log-probs and real-token count (None without one) from a
    ``_token_table`` on the host."""
    keep = host_XB[2 * k].long().tolist() if host_XB.shape[0] > 2 * k else None
    return host_XB[:k].T.long().tolist(), host_XB[k : 2 * k].T.tolist(), keep


def _keep_routes(batch: ScheduledBatch, routes_TLK: torch.Tensor) -> None:
    """Hand a packed forward's expert ids to its sequences: one row per decode row (at its start),
    then each prefill chunk's rows (``_forward_rows``' order)."""
    nd = batch.num_decode
    for i, (seq, start) in enumerate(zip(batch.seqs[:nd], batch.starts)):
        _add_routes(seq, start, routes_TLK[i : i + 1])
    row = nd
    for seq, start, n in zip(batch.seqs[nd:], batch.starts[nd:], batch.num_new[nd:]):
        _add_routes(seq, start, routes_TLK[row : row + n])
        row += n


def _add_routes(seq: Sequence, start: int, routes_nLK: torch.Tensor) -> None:
    if seq.routes is None:
        seq.routes = []
    seq.routes.append((start, routes_nLK))


def _position_deltas(seqs: list[Sequence]) -> torch.Tensor | None:
    """Each row's M-RoPE offset of generated tokens (None when every row is text)."""
    if all(s.images is None for s in seqs):
        return None
    return torch.tensor([s.position_delta for s in seqs], dtype=torch.long)


def _chunk_positions(seq: Sequence, start: int, n: int) -> torch.Tensor:
    """long [3, n] positions of ``seq``'s tokens start .. start + n."""
    if seq.mrope_3P is None:
        return torch.arange(start, start + n).expand(3, -1)
    p = seq.mrope_3P.shape[1]
    head = seq.mrope_3P[:, start : min(start + n, p)]
    tail = torch.arange(max(start, p), max(start + n, p)) + seq.position_delta
    return torch.cat([head, tail.expand(3, -1)], dim=1)


def _chunk_image_rows(seq: Sequence, start: int, n: int) -> tuple[int, int] | None:
    """Rows of ``seq``'s image features its tokens start .. start + n take (None: no image token)."""
    if seq.images is None:
        return None
    positions = _IMAGE_POSITIONS.get(seq)
    if positions is None:
        positions = _IMAGE_POSITIONS[seq] = _image_positions(seq.prompt_ids, seq.image_token_id)
    a = bisect.bisect_left(positions, start)
    b = bisect.bisect_left(positions, start + n)
    return (a, b) if b > a else None


def _image_positions(prompt_ids: list[int], image_token_id: int) -> list[int]:
    """Where the prompt's image tokens are, in order: the image rows before a position are a bisection
    away. Once per sequence: a scan of a 16k-token prompt per prefill chunk took 23 ms a prompt."""
    return [j for j, t in enumerate(prompt_ids) if t == image_token_id]


_IMAGE_POSITIONS: weakref.WeakKeyDictionary[Sequence, list[int]] = weakref.WeakKeyDictionary()
"""``_image_positions`` of each image sequence, kept while the sequence lives."""
