"""``RolloutEngine``: the embedded inference engine every rollout goes through.

One ``step()`` = schedule (``scheduler.py``) → one packed forward of the shared ``Decoder`` with the
paged-KV attention backend (``attention.py``) → sample (``sampling.py``) → stop checks. A pure-decode
batch runs ``decode_steps`` forwards back to back instead: sampling, feeding the tokens back and the
stop/length checks stay on the device, and one small tensor is copied to the host at the end (on a
GPU the per-step host work — scheduling, block tables, bookkeeping — is what bounds decode speed). A
mixed step (new requests' prefill beside decoding rows) of a large batch goes on the same way with
``decode_steps - 1`` decode steps of every row that sampled in it (``mixed_decode_min_rows``). Requests
join and leave at every step (continuous batching); long prompts are prefilled in chunks; blocks of
identical prefixes are shared; when the pool runs out the youngest request is preempted and later
recomputed. Nothing here blocks: drive it with ``step()`` (``InProcessRolloutClient`` does so from a
background thread) or use ``generate()``.

Weight updates happen between steps (every public method takes the engine lock). In-flight requests
keep their tokens and continue under the new weights; each output token records the policy version
that sampled it (``GenerationOutput.output_versions``). With ``recompute_kv_on_weight_update`` their
K/V is recomputed under the new weights, so every token after the switch is sampled exactly from the
new policy given its context (by default the old K/V is kept); the prefix cache is always cleared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import torch

from areno.models import fused_linear, fused_ops
from areno.observe.trace import instant, span
from areno.rollout.attention import DECODE_CARRY_MAX_BYTES, DecodeCarry, PagedAttention
from areno.rollout.config import RolloutEngineConfig, resolve_decode_attention
from areno.rollout.kv_cache import BlockAllocator, KVCache
from areno.rollout.sampling import RowParams, RowTable, Sampler, check_stop
from areno.rollout.scheduler import ScheduledBatch, Scheduler, Sequence
from areno.types import GenerationOutput, SamplingParams

log = logging.getLogger(__name__)


class UnknownRequestError(KeyError):
    """``abort`` got a request id the engine does not hold (never added, or already finished)."""

    def __str__(self) -> str:
        return str(self.args[0])


class TornWeightsError(RuntimeError):
    """An in-place policy sync failed midway: the live weights are half-written (``mark_torn``)."""


class WeightUpdateError(ValueError):
    """A weight update was rejected as a whole; the engine still serves the previous version."""


WAITING_CLAMP_MAX_ROWS = 32
"""With requests waiting for a slot, a pure-decode batch of fewer rows runs only until its first row
can end by length (so a waiting request joins at once); a larger batch runs its full ``decode_steps``:
one freed slot idle for a few steps costs little there, while a host round trip per token (most
rows' remaining lengths differ) made asynchronous rollouts host-bound (bench/LOG.md)."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RolloutEngine:
    """Continuous-batching generation with a paged KV cache and hot weight swap."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        *,
        config: RolloutEngineConfig,
        eos_token_ids: Iterable[int] = (),
        tokenizer: Any = None,
    ) -> None:
        self.model = model.eval()
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        param = next(model.parameters())
        self.device = torch.device(config.device) if config.device else param.device
        self.config = config = dataclasses.replace(
            config, decode_attention=resolve_decode_attention(config.decode_attention, self.device)
        )
        # Fused inference kernels serve this engine's steps only (``fused_ops.inference``): a
        # trainer in the same process keeps the eager ops in all its forwards.
        self._fused = bool(config.fused_kernels and self.device.type == "cuda" and fused_ops.enable())
        if self._fused:
            fused_linear.enable(self.device)  # SiLU-and-multiply straight off the fused gate/up product
        if hasattr(model, "fuse_projections"):
            # Before ``_params`` and any CUDA graph: the parameters become views of the fused
            # weights (same objects and names), so the graphs read and the syncs write one storage.
            if config.fused_projections:
                model.fuse_projections()
                if self.device.type == "cuda":  # the per-projection weights just freed: back to the
                    torch.cuda.empty_cache()  # driver, so the KV pool sized below can use them
            else:
                model.unfuse_projections()
        if hasattr(model, "pack_cpu_gemms"):  # after fusing: the fused groups get the copies
            if config.cpu_packed_gemm and self.device.type == "cpu" and model.pack_cpu_gemms(config.max_num_seqs):
                log.info(
                    "rollout engine: the large CPU weights multiply through oneDNN-packed copies (%.2f GB more "
                    "memory from the first step; rollout.cpu_packed_gemm=false keeps F.linear)",
                    model.cpu_packed_bytes / 1e9,
                )
            else:
                model.unpack_cpu_gemms()
        self.kv_dtype = _DTYPES[config.dtype] if config.dtype else param.dtype
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.max_position = model_config.max_position_embeddings
        self.decode_steps = config.decode_steps or (8 if self.device.type == "cuda" else 1)
        mixed_k = self.decode_steps - 1 if config.mixed_decode_min_rows is not None else 0
        self.loop_steps = (self.decode_steps,) + ((mixed_k,) if mixed_k > 1 else ())
        """Decode steps of one round trip's device loop: ``decode_steps`` (pure decode) and, with
        ``mixed_decode_min_rows``, ``decode_steps - 1`` (after a mixed step's first token)."""
        self.vocab_size = model_config.vocab_size
        self.sliding_window = getattr(model_config, "sliding_window", None)

        layer0 = model.model.layers[0].self_attn
        # Local head counts come from the (possibly TP-sharded) weights.
        num_kv_heads = layer0.k_proj.weight.shape[0] // model_config.head_dim
        num_blocks = config.num_blocks or self._agree_num_blocks(self._auto_num_blocks(num_kv_heads))
        self.cache = KVCache(
            num_layers=model_config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.allocator = BlockAllocator(
            num_blocks, config.block_size, enable_prefix_sharing=config.enable_prefix_sharing
        )
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=config.max_num_seqs,
            max_tokens_per_step=config.max_tokens_per_step,
            prefill_chunk_size=config.prefill_chunk_size,
            max_blocks_per_seq=-(-self.max_model_len // config.block_size),
        )
        if self.device.type == "cpu" and config.decode_attention == "gather" and config.cpu_decode_carry:
            # pure-decode steps keep the gathered K/V across steps (attention.DecodeCarry)
            self.cache.decode_carry = DecodeCarry(
                model_config.num_hidden_layers,
                self.scheduler.max_blocks_per_seq * config.block_size,
                DECODE_CARRY_MAX_BYTES,
            )
        self.sampler = Sampler(device=self.device, seed=config.seed)
        self._row_table = RowTable(config.max_num_seqs + 1)
        """Static sampling rows of the running requests by slot (``Sequence.row``)."""
        self._params = dict(model.state_dict(keep_vars=True))
        self._lock = threading.RLock()
        self._seqs: dict[str, Sequence] = {}
        self._inbox: dict[str, Sequence] = {}
        """Requests added since the last step (``add_request`` takes only ``_inbox_lock``)."""
        self._inbox_lock = threading.Lock()
        self._busy_s = 0.0
        """Seconds spent in steps that ran a batch (``stats()["busy_s"]``: busy fraction over time)."""
        self._last_step_ran = False
        self._arrivals = 0
        self._version = 0
        self._paused = False
        self._sleeping = False
        self._torn: str | None = None
        """Set by ``mark_torn`` (the reason); cleared when weights are committed or loaded."""
        self._steps = 0
        self._round_trips = 0
        self._generated_tokens = 0
        self._prefill_tokens = 0
        self._mixed_steps = 0
        self._started = time.monotonic()
        self._stream = torch.cuda.Stream(self.device) if config.cuda_stream and self.device.type == "cuda" else None
        self._stream_waits_default = True
        """The next step first waits for the default stream (weights or KV written there)."""
        self._graphs = None
        if config.cuda_graphs and self.device.type == "cuda":
            from areno.rollout.cuda_graph import DecodeGraphRunner

            self._graphs = DecodeGraphRunner(
                self, max_batch=min(config.cuda_graph_max_batch or config.max_num_seqs, config.max_num_seqs)
            )

    def _auto_num_blocks(self, num_kv_heads: int) -> int:
        per_block = KVCache.bytes_per_block(
            num_layers=self.model_config.num_hidden_layers,
            block_size=self.config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.kv_dtype,
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.kv_memory_fraction)
        else:
            budget = self.config.cpu_kv_cache_bytes
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget of {budget} bytes holds no block of {per_block} bytes: "
                "raise kv_memory_fraction / cpu_kv_cache_bytes or set num_blocks"
            )
        return num_blocks

    # ------------------------------------------------------------------ requests
    @property
    def version(self) -> int:
        """Policy version of the current weights (set by ``update_weights``)."""
        return self._version

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; it joins the running batch at the next step. Returns its id."""
        if self._torn is not None:
            raise TornWeightsError(self._torn)
        prompt_ids = list(map(int, prompt_ids))
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            raise ValueError(f"prompt_ids holds token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the context is max_model_len="
                f"{self.max_model_len}: shorten the prompt"
            )
        longest = min(len(prompt_ids) + params.max_new_tokens, self.max_model_len)
        if -(-longest // self.config.block_size) > self.allocator.num_blocks:
            raise ValueError(
                f"prompt + max_new_tokens = {longest} tokens exceeds the KV pool of "
                f"{self.allocator.num_blocks * self.config.block_size} tokens: lower max_new_tokens "
                "or give the engine more KV memory"
            )
        sample_row = RowParams.row_of(params, self.eos_token_ids, self.vocab_size)
        # Only the inbox lock: a request arriving from a server's event loop must not wait for a
        # running step (the step lock is held through a whole decode round trip).
        with self._inbox_lock:
            request_id = request_id or uuid.uuid4().hex
            if request_id in self._seqs or request_id in self._inbox:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._inbox[request_id] = Sequence(
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                arrival=0,
                sample_row=sample_row,
                limit=longest,
            )
        return request_id

    def _admit(self) -> None:
        """Move the inbox's requests, in arrival order, into the scheduler. Call holding ``_lock``."""
        if not self._inbox:
            return
        with self._inbox_lock:
            arrived, self._inbox = self._inbox, {}
        for request_id, seq in arrived.items():
            seq.arrival = self._arrivals
            self._arrivals += 1
            self._seqs[request_id] = seq
            self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        if self._inbox:
            return True
        with self._lock:
            return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> GenerationOutput:
        """Stop a request now; returns what it generated so far (finish reason ``abort``)."""
        with self._lock:
            self._admit()
            seq = self._seqs.pop(request_id, None)
            if seq is None:
                raise UnknownRequestError(f"no unfinished request with id {request_id!r}")
            self.scheduler.remove(seq)
            return self._output(seq, "abort")

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationOutput]:
        """Run ``prompts`` to completion (in order of ``prompts``). The engine must not be driven
        by anything else meanwhile (e.g. an ``InProcessRolloutClient``)."""
        if self._torn is not None:
            raise TornWeightsError(self._torn)
        if self._paused or self._sleeping:
            raise RuntimeError("generate() on a paused or sleeping engine would never finish: resume()/wake() first")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, GenerationOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[GenerationOutput]:
        """Run one forward pass over the scheduled tokens (a pure-decode batch: up to
        ``decode_steps`` of them back to back); returns the requests that finished."""
        with span("engine_step", "rollout"), fused_ops.inference(self._fused):
            return self._step()

    def _step(self) -> list[GenerationOutput]:
        with self._lock:
            t0 = time.perf_counter()
            try:
                if self._stream is None:
                    return self._step_locked()
                if self._stream_waits_default:
                    self._stream.wait_stream(torch.cuda.default_stream(self.device))
                    self._stream_waits_default = False
                with torch.cuda.stream(self._stream):
                    return self._step_locked()
            finally:
                # counted under the lock: a stats() snapshot sees whole steps (its busy_s and
                # clock_s are read together, so busy_s / elapsed stays within [0, 1] per window)
                if self._last_step_ran:
                    self._busy_s += time.perf_counter() - t0

    def _step_locked(self) -> list[GenerationOutput]:
        self._admit()
        self._last_step_ran = False
        if self._paused or self._sleeping or self._torn is not None or not self.scheduler.has_unfinished():
            return []
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self._last_step_ran = True
        pure_decode = batch.num_decode == len(batch.seqs) and all(batch.samples)
        sampling = batch.seqs if pure_decode else [s for s, do in zip(batch.seqs, batch.samples) if do]
        self._prefill_tokens += batch.num_tokens - len(sampling)
        self._mixed_steps += not pure_decode
        if not sampling:
            logits_BV = self._forward(batch)
            self.scheduler.after_step(batch)
            self._steps += 1
            return []
        slots = [s.row for s in sampling]
        self._row_table.sync(slots, [s.sample_row for s in sampling])
        lengths = [len(s.token_ids) for s in sampling]
        rp = RowParams.gather(
            self._row_table,
            slots,
            [n - len(s.prompt_ids) for s, n in zip(sampling, lengths)],
            lengths,
            self.max_model_len,
            self.device,
        )
        if pure_decode:
            k = self._plan_decode_steps(batch.seqs)
            tokens_KB, logprobs_KB, keep_B = self._run_decode(batch, k, rp)
            self.scheduler.after_step(batch, k)
            self._steps += k
        else:
            logits_BV = self._forward(batch)
            self.scheduler.after_step(batch)
            tokens_B, logprobs_B = self._sample_rows(logits_BV, rp)
            self._steps += 1
            k, tokens_KB, logprobs_KB, keep_B = self._decode_after_mixed(
                sampling, len(batch.seqs), tokens_B, logprobs_B, rp
            )
        self._round_trips += 1
        # One device-to-host copy: per row, k token ids, k log-probs (and how many to keep).
        parts = [tokens_KB.double(), logprobs_KB.double()] + ([keep_B.double()[None]] if keep_B is not None else [])
        host_XB = torch.cat(parts).cpu()
        return self._commit_tokens(
            sampling,
            host_XB[:k].T.long().tolist(),
            host_XB[k : 2 * k].T.tolist(),
            host_XB[2 * k].long().tolist() if keep_B is not None else None,
        )

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
        self._steps += k
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
        finished, done = [], []
        eos = self.eos_token_ids
        version = self._version
        max_len = self.max_model_len
        generated = 0
        for i, (seq, toks, lps) in enumerate(zip(sampling, tokens_BK, logprobs_BK)):
            n = keep_B[i] if keep_B is not None else 1
            p = seq.params
            ids = seq.token_ids
            if p.stop:  # stop strings need the decoded text after every token
                known = len(ids)
                reason = None
                for t, lp in zip(toks[:n], lps[:n]):
                    ids.append(t)
                    seq.output_logprobs.append(lp)
                    seq.output_versions.append(version)
                    reason, seq.text = check_stop(p, seq.output_ids, eos, self._decode(seq.output_ids))
                    if reason is None and len(ids) >= max_len:
                        reason = "length"
                    if reason is not None:
                        break
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
                del self._seqs[seq.request_id]
                done.append(seq)
                finished.append(self._output(seq, reason))
        if done:
            self.scheduler.remove_finished(done)
        self._generated_tokens += generated
        return finished

    def _plan_decode_steps(self, seqs: list[Sequence], sampled: int = 0) -> int:
        """How many decode steps these rows run before the next host round trip (their blocks for
        them are reserved here; 1 when the pool cannot hold them). ``sampled``: tokens each row
        sampled earlier in this round trip, not yet in its ``token_ids`` (1 after a mixed step)."""
        k = self.decode_steps - sampled  # k tokens per round trip in all (after a mixed step's first one)
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
        if self._graphs is not None and self._graphs.can_loop(batch, rp, k):
            # The whole k-step loop (forwards, sampling, stop and length checks) is one graph replay.
            out = self._graphs.run_loop(batch, ids, ctx, rp, k, ids_B=first_B)
            if out is not None:
                return out
        if self._graphs is not None and self._graphs.can_run(batch):
            prepared = self._graphs.prepare(batch, ids, ctx, ids_B=first_B)
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
        tokens, logprobs = [], []
        keep_B = alive_B = None
        if k > 1:
            keep_B = torch.full((B,), k, dtype=torch.long, device=self.device)
            alive_B = torch.ones(B, dtype=torch.bool, device=self.device)
        for j in range(k):
            if graph is not None:
                logits_BV = self._graphs.replay(graph, B)
            else:
                attn = PagedAttention.for_decode(
                    self.cache, bt_BN, ctx_B, self.sliding_window, kv_slots_BL, self.config.decode_attention, carry=True
                )
                hidden_BD = self.model(ids_B, (ctx_B - 1).clamp(max=self.max_position - 1), attn)
                logits_BV = self._logits(hidden_BD)
            tokens_B, logprobs_B = self._sample_rows(logits_BV, rp)
            tokens.append(tokens_B)
            logprobs.append(logprobs_B)
            if k > 1:
                done_B = rp.advance(tokens_B)
                keep_B = torch.where(done_B & alive_B, j + 1, keep_B)
                alive_B &= ~done_B
                if j + 1 < k:
                    ids_B.copy_(tokens_B)
                    ctx_B.add_(1)
        return torch.stack(tokens), torch.stack(logprobs), keep_B

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [B, V] of the sequences that sample this step (in batch order)."""
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
        # token ids, positions and the rows to sample in one host-to-device copy
        packed = torch.tensor(ids + pos + (last if len(last) < T else []), dtype=torch.long)
        packed = packed.to(self.device, non_blocking=True)
        attn = self._attention(batch, packed[T : T + nd])
        hidden_TD = self.model(packed[:T], packed[T : 2 * T], attn)
        if not last:
            return hidden_TD.new_empty(0, self.vocab_size)
        if len(last) == T:
            return self._logits(hidden_TD)
        return self._logits(hidden_TD[packed[2 * T :]])

    def _attention(self, batch: ScheduledBatch, decode_pos_B: torch.Tensor) -> PagedAttention:
        """The attention metadata of a graph-less step. Its decode rows' (the large part at hundreds
        of rows) come from their block tables and positions on the device
        (``PagedAttention.for_decode`` in the engine's decode attention: the paged kernel, or key
        slots and masks for the gathered form) rather than from the host; the prefill chunks' from
        the host (``PagedAttention.build``). ``decode_pos_B``: the decode rows' positions, on the device."""
        nd = batch.num_decode
        bt_BN = self.scheduler.block_tables_for(batch.rows, batch.max_blocks)
        if nd == 0:
            return PagedAttention.build(self.cache, batch.chunks, self.device, self.sliding_window, bt_BN=bt_BN)
        width = max([len(s.block_table) for s in batch.seqs[:nd]])
        dec_bt_BN = bt_BN[:nd, :width].to(self.device, non_blocking=True)
        # decode rows as in a pure-decode step: the paged kernel where configured (on CUDA by default;
        # the gathered form's SDPA over [rows, context] took most of a mixed step's time on an H200)
        dec = PagedAttention.for_decode(
            self.cache, dec_bt_BN, decode_pos_B + 1, self.sliding_window, decode_attention=self.config.decode_attention
        )
        if nd == len(batch.seqs):
            return dec
        pre = PagedAttention.build(
            self.cache, batch.chunks_from(nd), self.device, self.sliding_window, bt_BN=bt_BN[nd:]
        )
        return PagedAttention(
            self.cache, torch.cat((dec.slot_mapping_T, pre.slot_mapping_T)), nd, dec.decode, pre.prefill, dec.paged
        )

    # Hooks that tensor parallelism overrides (``tp.py``).
    def _agree_num_blocks(self, num_blocks: int) -> int:
        """The pool size every rank uses (ranks must schedule identically)."""
        return num_blocks

    LOGITS_CHUNK = 2048
    """CPU: vocabulary rows per matmul of the output projection (large vocabularies)."""

    def _logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits [B, V]."""
        weight_VD = getattr(self.model, "output_weight", None)
        pack = self.model.__dict__.get("cpu_pack")  # RolloutEngineConfig.cpu_packed_gemm
        if pack is not None and pack.applies(hidden_BD):
            return pack(hidden_BD, None).float()
        if (
            self.device.type == "cpu"
            and weight_VD is not None
            and weight_VD.shape[0] > 4 * self.LOGITS_CHUNK
            and weight_VD.dtype == hidden_BD.dtype
        ):
            # One matmul per cache-sized slice of the output weight (same dot products, so the same
            # values as one F.linear): ~1.3x faster on CPU for a 32k vocabulary at small batches.
            V, c = weight_VD.shape[0], self.LOGITS_CHUNK
            out_BV = hidden_BD.new_empty(hidden_BD.shape[0], V)
            for s in range(0, V, c):
                torch.mm(hidden_BD, weight_VD[s : s + c].t(), out=out_BV[:, s : s + c])
            return out_BV.float()
        return self.model.logits(hidden_BD).float()

    def _sample_rows(self, logits_BV: torch.Tensor, rp: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and log-probs [B] on the device (no host synchronisation)."""
        return self.sampler.sample_rows(logits_BV, rp)

    def _decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _output(self, seq: Sequence, reason: str) -> GenerationOutput:
        if reason == "stop" and seq.text is not None:
            text = seq.text  # cut before the stop string
        else:
            text = self._decode(seq.output_ids) or ""
        return GenerationOutput(
            request_id=seq.request_id,
            prompt_ids=list(seq.prompt_ids),
            output_ids=list(seq.output_ids),
            output_logprobs=list(seq.output_logprobs),
            output_versions=list(seq.output_versions),
            finish_reason=reason,
            text=text,
        )

    def warmup_cuda_graphs(
        self, batch_sizes: list[int], max_len: int, params: list[SamplingParams] | None = None
    ) -> int:
        """Capture the decode CUDA graphs for these batch sizes and contexts up to ``max_len``
        now rather than at first use: the one-step graphs and the multi-step loops for batches of
        requests sampled with one of ``params`` (None: greedy). Returns the number of graphs held
        (0 without CUDA graphs)."""
        if self._graphs is None:
            return 0
        # The capture lock before the engine lock, as a policy sync takes them (hold_graph_captures,
        # then pause): the one order, so a warm-up beside a sync cannot deadlock.
        with self._graphs.capture_lock, self._lock, fused_ops.inference(self._fused):
            return self._graphs.capture(batch_sizes, max_len, params)

    def hold_graph_captures(self) -> contextlib.AbstractContextManager:
        """A block in which no decode CUDA graph is captured (an ongoing capture finishes first);
        steps needing a new graph meanwhile run eagerly. The rollout worker holds it through a policy
        sync, so the sync's NCCL work never runs beside a capture on the same GPU."""
        return self._graphs.hold_captures() if self._graphs is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ control
    def pause(self) -> None:
        """Stop at the step boundary; in-flight requests keep their tokens and K/V."""
        instant("engine_pause", "rollout", version=self._version)
        with self._lock:
            self._paused = True
            self._drain_stream()

    def _drain_stream(self) -> None:
        """Wait for the engine's own CUDA stream (a step without sampling returns before its kernels
        end): weights or KV written or freed after this see no engine kernel still reading them."""
        if self._stream is not None:
            self._stream.synchronize()

    def resume(self) -> None:
        instant("engine_resume", "rollout", version=self._version)
        with self._lock:
            self._paused = False

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def sleep(self) -> None:
        """Free the KV pool (for a colocated trainer). In-flight requests are kept and recomputed
        after ``wake()``; ``step()`` does nothing while asleep."""
        with self._lock:
            if self._sleeping:
                return
            self.scheduler.preempt_all()
            self.allocator.clear_prefix_cache()
            self._drain_stream()
            if self._graphs is not None:
                self._graphs.clear()
            self.cache.release()
            self._sleeping = True

    def wake(self) -> None:
        """Re-allocate the KV pool released by ``sleep()``."""
        with self._lock:
            if not self._sleeping:
                return
            self.cache.allocate()
            self._sleeping = False
            self._stream_waits_default = True

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace weights by name (Hugging Face names) and set the policy version.

        The whole set is validated first — unknown or repeated name, wrong shape, wrong dtype — and
        rejected as a whole with a ``WeightUpdateError`` naming the tensor; the engine then keeps
        serving the previous weights. Any subset of the parameters may be sent.
        """
        items = list(named_tensors)
        with self._lock:
            targets = self._validate_weights(items)
            self._drain_stream()
            with torch.no_grad():
                for param, tensor in targets:
                    param.copy_(tensor, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._weights_changed(version)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's live weight tensors by Hugging Face name, for in-place (colocated) policy
        sync: a transport writes them, then calls :meth:`commit_weights`."""
        return dict(self._params)

    def mark_torn(self, reason: str) -> None:
        """The live weights are half-written (an in-place sync failed): refuse requests with
        ``TornWeightsError(reason)`` and take no step until weights are committed or loaded again."""
        with self._lock:
            self._torn = reason

    def commit_weights(self, version: int) -> None:
        """Declare that the tensors of :meth:`weight_tensors` now hold policy ``version``."""
        with self._lock:
            self._weights_changed(version)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load Hugging Face safetensors from ``path`` as ``update_weights``: one file, or a directory
        — the shards its ``model.safetensors.index.json`` lists when it has one, else every
        ``*.safetensors`` in it.

        Everything is read before any weight changes: a shard the index lists that is missing, a
        tensor the index lists that its shard lacks, or a truncated/corrupt file rejects the update
        as a whole with a one-line ``WeightUpdateError`` naming it (never a partial update); the
        engine keeps serving the previous version.
        """
        from areno.models.hf_io import open_safetensors, safetensors_files

        fix = f"this engine keeps serving version {self._version}; re-export the checkpoint"
        index: dict[str, str] = {}
        try:
            if os.path.isdir(path):
                files = safetensors_files(path)
                index_path = os.path.join(path, "model.safetensors.index.json")
                if os.path.isfile(index_path):  # valid: safetensors_files checked it
                    with open(index_path) as fh:
                        index = json.load(fh)["weight_map"]
            elif os.path.isfile(path):
                files = [path]
            else:
                raise FileNotFoundError(f"no .safetensors file or directory at {path!r}")
            tied = getattr(self.model_config, "tie_word_embeddings", False)
            items, found = [], set()
            for file in files:
                with open_safetensors(file, fix=fix) as f:
                    for name in f.keys():
                        found.add(name)
                        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                            continue  # recomputed / tied checkpoints may store the shared matrix twice
                        items.append((name, f.get_tensor(name)))
        except (OSError, ValueError) as exc:
            raise WeightUpdateError(f"weight update rejected: {exc}") from None
        lost = [name for name in index if name not in found]
        if lost:
            raise WeightUpdateError(
                f"weight update rejected: tensor {lost[0]!r} is listed in {path}/model.safetensors"
                f".index.json in {index[lost[0]]} but that shard does not hold it "
                f"({len(lost)} such tensors); {fix}"
            )
        self.update_weights(items, version)

    def _validate_weights(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seen: set[str] = set()
        targets = []
        for name, tensor in items:
            param = self._params.get(name)
            if param is None:
                raise WeightUpdateError(
                    f"weight update rejected: unknown tensor {name!r} (expected Hugging Face names)"
                )
            if name in seen:
                raise WeightUpdateError(f"weight update rejected: tensor {name!r} appears twice")
            seen.add(name)
            tensor = self._shard_for_update(name, tensor)
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightUpdateError(
                    f"weight update rejected: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            same = tensor.dtype == param.dtype
            castable = self.config.cast_weights and tensor.dtype.is_floating_point and param.dtype.is_floating_point
            if not (same or castable):
                raise WeightUpdateError(
                    f"weight update rejected: {name!r} has dtype {tensor.dtype}, expected {param.dtype}"
                )
            targets.append((param, tensor))
        return targets

    def _shard_for_update(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Hook for tensor parallelism: the local shard of a full tensor (identity at TP=1)."""
        return tensor

    def _weights_changed(self, version: int) -> None:
        self._stream_waits_default = True
        if hasattr(self.model, "invalidate_cpu_gemms"):
            self.model.invalidate_cpu_gemms()  # packed copies re-pack at their next use
        if self.config.recompute_kv_on_weight_update:
            self.scheduler.preempt_all()
        else:
            self.scheduler.mark_stale()
        self.allocator.clear_prefix_cache()
        self._version = int(version)
        self._torn = None

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._admit()
            elapsed = time.monotonic() - self._started
            a = self.allocator
            return {
                "version": self._version,
                "paused": self._paused,
                "sleeping": self._sleeping,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_total": a.num_blocks,
                "kv_blocks_used": a.num_used,
                "kv_usage": a.num_used / a.num_blocks,
                "prefix_hit_rate": a.prefix_hit_tokens / max(a.prefix_query_tokens, 1),
                "num_preemptions": self.scheduler.num_preemptions,
                "steps": self._steps,
                "busy_s": self._busy_s,
                "clock_s": time.perf_counter(),  # busy_s's clock, read with it
                "sampling_round_trips": self._round_trips,
                "generated_tokens": self._generated_tokens,
                "prefill_tokens": self._prefill_tokens,
                "mixed_steps": self._mixed_steps,
                "generated_tokens_per_s": self._generated_tokens / max(elapsed, 1e-9),
                "cuda_graphs_captured": self._graphs.captures if self._graphs is not None else 0,
                "cuda_graph_capture_s": self._graphs.capture_s if self._graphs is not None else 0.0,
                "cuda_graph_deferred_steps": self._graphs.deferred if self._graphs is not None else 0,
            }
