"""``RolloutEngine``: the embedded inference engine every rollout goes through.

Continuous batching over a paged KV cache: requests join and leave at every step; long prompts are
prefilled in chunks; blocks of identical prefixes are shared; when the pool runs out the youngest
request is preempted and later recomputed. Nothing here blocks: drive it with ``step()``
(``InProcessRolloutClient`` does so from a background thread) or use ``generate()``.

The engine is a facade over one collaborator per responsibility, sharing one ``EngineControl`` (step
lock, pause/sleep flags, policy version): ``RequestTable`` (``requests.py``: requests in, outputs
out), ``Scheduler`` (``scheduler.py``: admission, preemption, the running batch), ``Stepper``
(``stepping.py``: prefill / decode / mixed steps and sampling), ``EngineWeights`` (``weights.py``:
weight updates, versions, torn-weights protection) and ``DecodeGraphRunner`` (``cuda_graph.py``).

Weight updates happen between steps (every public method takes the engine lock). In-flight requests
keep their tokens and continue under the new weights; each output token records the policy version
that sampled it (``GenerationOutput.output_versions``). With ``recompute_kv_on_weight_update`` their
K/V is recomputed under the new weights, so every token after the switch is sampled exactly from the
new policy given its context (by default the old K/V is kept); the prefix cache is always cleared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from areno.errors import ConfigError
from areno.models import decode_mlp, fused_linear, fused_ops
from areno.models.eager_ops import LogitMap
from areno.models.logprobs import Fp32HeadCopy, fp32_product
from areno.models.vision import ImageInputs, mrope_positions, position_delta
from areno.observe.trace import instant, span
from areno.rollout import fused_loop, fused_sampler
from areno.rollout.attention import DECODE_CARRY_MAX_BYTES, DecodeCarry
from areno.rollout.config import RolloutEngineConfig, resolve_decode_attention
from areno.rollout.control import EngineControl
from areno.rollout.cuda_graph import DecodeGraphRunner
from areno.rollout.errors import TornWeightsError, UnknownRequestError, WeightUpdateError
from areno.rollout.kv_cache import BlockAllocator, KVCache
from areno.rollout.prefill_graph import PrefillGraphRunner
from areno.rollout.presence import PresenceTable
from areno.rollout.requests import RequestTable
from areno.rollout.sampling import RowParams, Sampler, enable_fused_hash
from areno.rollout.scheduler import Scheduler
from areno.rollout.stepping import WAITING_CLAMP_MAX_ROWS, Stepper
from areno.rollout.weights import EngineWeights
from areno.types import GenerationOutput, SamplingParams

__all__ = [
    "WAITING_CLAMP_MAX_ROWS",
    "RolloutEngine",
    "RolloutEngineConfig",
    "TornWeightsError",
    "UnknownRequestError",
    "WeightUpdateError",
    "resolve_decode_attention",
]

log = logging.getLogger(__name__)


def automatic_num_blocks(
    config: RolloutEngineConfig, free: int | None, per_block: int, usable: int, device: torch.device
) -> int:
    """The blocks of a KV pool sized from memory: on CUDA ``kv_memory_fraction`` of the ``free`` bytes
    less ``kv_reserved_bytes``, on CPU (``free`` None) ``cpu_kv_cache_bytes``; at most ``usable`` (a small
    model on a large device: memory holds far more blocks than the engine can use). A ConfigError
    naming the settings when not one block fits."""
    if free is None:
        budget = config.cpu_kv_cache_bytes
    else:
        budget = int(max(free - config.kv_reserved_bytes, 0) * config.kv_memory_fraction)
    if budget >= per_block:
        return min(budget // per_block, usable)
    gib = 2**30
    if free is None:
        raise ConfigError(
            f"rollout.cpu_kv_cache_bytes={config.cpu_kv_cache_bytes} holds no KV block of {per_block} bytes: "
            "raise it, or set rollout.kv_blocks"
        )
    if config.kv_reserved_bytes:
        raise ConfigError(
            f"the rollout engine's KV pool has no room on {device}: {free / gib:.2f} GiB free, of which "
            f"{config.kv_reserved_bytes / gib:.2f} GiB stay for the training side on the same device (its "
            "gradients, optimizer state and a micro-batch's activations): lower train.max_tokens_per_mb, set "
            "cluster.offload=sleep, or rollout.kv_blocks"
        )
    raise ConfigError(
        f"the rollout engine's KV pool has no room on {device}: {free / gib:.2f} GiB free x "
        f"rollout.kv_memory_fraction={config.kv_memory_fraction} holds no KV block of {per_block} bytes: free "
        "device memory, raise rollout.kv_memory_fraction, or set rollout.kv_blocks"
    )


KV_BLOCKS_HEADROOM = 2
"""An automatically sized KV pool holds at most this many times the blocks of ``max_num_seqs`` sequences at
``max_model_len``: the running batch at full length, and as much again for cached prefixes."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prepare_model(model: torch.nn.Module, config: RolloutEngineConfig, device: torch.device) -> bool:
    """Set the engine's model up for inference as ``config`` says: fused q/k/v and gate/up projections
    (``fused_projections``), oneDNN-packed CPU weights (``cpu_packed_gemm``). Returns whether this
    engine's steps use the fused inference kernels (``fused_kernels``, CUDA with Triton)."""
    # Fused inference kernels serve this engine's steps only (``fused_ops.inference``): a
    # trainer in the same process keeps the eager ops in all its forwards.
    fused = bool(config.fused_kernels and device.type == "cuda" and fused_ops.enable())
    if fused:
        fused_linear.enable(device)  # SiLU-and-multiply straight off the fused gate/up product
        decode_mlp.enable(device)  # a decode step's MLP in two Triton GEMMs (few rows)
        enable_fused_hash()  # the seeded rows' uniform in one kernel per decode step
        fused_sampler.enable()  # the draw in two kernels instead of ~7 passes over [B, V]
        fused_loop.enable()  # the decode loop's slots and stop test in two kernels instead of ~25
    if hasattr(model, "fuse_projections"):
        # Before the weight table and any CUDA graph: the parameters become views of the fused
        # weights (same objects and names), so the graphs read and the syncs write one storage.
        if config.fused_projections:
            model.fuse_projections()
            if device.type == "cuda":  # the per-projection weights just freed: back to the
                torch.cuda.empty_cache()  # driver, so the KV pool sized after this can use them
        else:
            model.unfuse_projections()
    if hasattr(model, "pack_cpu_gemms"):  # after fusing: the fused groups get the copies
        if config.cpu_packed_gemm and device.type == "cpu" and model.pack_cpu_gemms(config.max_num_seqs):
            log.info(
                "rollout engine: the large CPU weights multiply through oneDNN-packed copies (%.2f GB more "
                "memory from the first step; rollout.cpu_packed_gemm=false keeps F.linear)",
                model.cpu_packed_bytes / 1e9,
            )
        else:
            model.unpack_cpu_gemms()
    return fused


def check_prompts(prompts: Any) -> None:
    """A TypeError unless ``prompts`` is a list of prompts, each a list of token ids (what
    ``RolloutEngine.generate`` takes): text, or one flat list of ids, is named with its fix."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a list of prompts, each a list of token ids, got {type(prompts).__name__} "
            f"{_shown(prompts)}: pass [tokenizer.encode(text)]"
        )
    if prompts and isinstance(prompts[0], numbers.Integral):
        raise TypeError(
            f"prompts is one flat list of token ids {_shown(prompts)}, but it is a list of prompts: pass [ids] "
            "for one prompt"
        )
    for i, prompt_ids in enumerate(prompts):
        check_prompt_ids(prompt_ids, f"prompts[{i}]")


def check_prompt_ids(prompt_ids: Any, what: str) -> None:
    """A TypeError naming ``what`` unless ``prompt_ids`` is a sequence of token ids: text is named
    with the tokenizer call that makes them (each id's own type is checked as the ids are converted,
    in ``RequestTable.add``)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"{what} is text {_shown(prompt_ids)}, not token ids: pass tokenizer.encode(text)")
    if not isinstance(prompt_ids, Iterable):
        raise TypeError(
            f"{what} must be a list of token ids, got {type(prompt_ids).__name__} {_shown(prompt_ids)}: "
            "pass tokenizer.encode(text)"
        )


def check_sampling_params(params: Any, what: str) -> None:
    """A TypeError naming ``what`` unless ``params`` is a ``SamplingParams`` (a dict of its fields is
    named with the call that makes one)."""
    if isinstance(params, SamplingParams):
        return
    fix = (
        "SamplingParams(**params)"
        if isinstance(params, dict)
        else "SamplingParams(temperature=..., max_new_tokens=...)"
    )
    raise TypeError(
        f"{what} must be an areno.types.SamplingParams, got {type(params).__name__} {_shown(params)}: pass {fix}"
    )


def _shown(value: Any) -> str:
    """``value``'s repr, cut to a length a one-line error can hold."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class RolloutEngine:
    """Continuous-batching generation with a paged KV cache and hot weight swap (see the module docstring)."""

    LOCAL_SAMPLING: ClassVar[bool] = True
    """``_sample_rows`` is this engine's own (no collective), so the k-step CUDA-graph loops may
    sample inside the graph; tensor parallelism (``tp.py``), whose rank 0 broadcasts, sets False."""
    LOGITS_CHUNK = 2048
    """CPU: vocabulary rows per matmul of the output projection (large vocabularies)."""

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
        self.logit_map = LogitMap.of(model_config)  # what the sampler's logits take (read every decode step)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        param = next(model.parameters())
        self.device = torch.device(config.device) if config.device else param.device
        if self.device.type == "cuda" and self.device.index not in (None, torch.cuda.current_device()):
            raise ValueError(
                f"RolloutEngine on {self.device} while this thread's current CUDA device is "
                f"cuda:{torch.cuda.current_device()}: call torch.cuda.set_device({self.device.index}) first (the "
                "engine's streams, events and Triton kernels follow the current device)"
            )
        self.config = config = dataclasses.replace(
            config, decode_attention=resolve_decode_attention(config.decode_attention, self.device)
        )
        self._fused = prepare_model(model, config, self.device)
        self._fp32_head = Fp32HeadCopy()  # config.fp32_logits on a device without a 16-bit product into fp32
        self.kv_dtype = _DTYPES[config.dtype] if config.dtype else param.dtype
        model_config.check_context(
            config.max_model_len, "max_model_len", fix="rollout.max_model_len (areno serve: --max-model-len)"
        )
        self.max_model_len = config.max_model_len or model_config.max_seq_len
        self.max_position = model_config.max_position_embeddings
        self.decode_steps = config.decode_steps or 8
        mixed_k = self.decode_steps - 1 if config.mixed_decode_min_rows is not None else 0
        self.loop_steps = (self.decode_steps,) + ((mixed_k,) if mixed_k > 1 else ())
        """Decode steps of one round trip's device loop: ``decode_steps`` (pure decode) and, with
        ``mixed_decode_min_rows``, ``decode_steps - 1`` (after a mixed step's first token)."""
        self.vocab_size = model_config.vocab_size
        self.sliding_window = getattr(model_config, "sliding_window", None)
        self.window_layers = getattr(model_config, "window_layers", None)
        """The layers the window applies to where only some slide (None: every layer)."""
        self.cache, self.allocator, self.scheduler = self._build_kv_pool()
        # the seen tokens of each slot's sequence (repetition penalty; allocated at the first request with one)
        presence = PresenceTable(config.max_num_seqs + 1, self.vocab_size, self.device)
        self.sampler = Sampler(device=self.device, seed=config.seed, presence=presence)
        self._control = EngineControl()
        self._lock = self._control.lock
        """The step lock (``EngineControl.lock``): every public method takes it."""
        self._requests = RequestTable(
            self.scheduler,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            tokenizer=tokenizer,
        )
        self._weights = EngineWeights(
            model,
            model_config,
            self._control,
            self.scheduler,
            self.allocator,
            device=self.device,
            cast_weights=config.cast_weights,
            recompute_kv=config.recompute_kv_on_weight_update,
            shard=self._shard_for_update,
        )
        self._stepper = Stepper(
            control=self._control,
            requests=self._requests,
            scheduler=self.scheduler,
            model=model,
            cache=self.cache,
            config=config,
            device=self.device,
            decode_steps=self.decode_steps,
            max_model_len=self.max_model_len,
            max_position=self.max_position,
            vocab_size=self.vocab_size,
            sliding_window=self.sliding_window,
            window_layers=self.window_layers,
            eos_token_ids=self.eos_token_ids,
            logits=self._logits,
            sample_rows=self._sample_rows,
            presence=presence,
        )
        self._started = time.monotonic()
        # recorded routes come from the blocks' Python forwards, which a graph replay skips
        graphs_fit = getattr(model, "vision_config", None) is None and not config.record_routes
        if config.cuda_graphs and self.device.type == "cuda" and graphs_fit:
            max_batch = min(config.cuda_graph_max_batch or config.max_num_seqs, config.max_num_seqs)
            self._stepper.graphs = DecodeGraphRunner(self, max_batch=max_batch)
            if config.prefill_cuda_graphs:
                why_not = PrefillGraphRunner.supported(self)
                if why_not is None:
                    self._stepper.prefill_graphs = PrefillGraphRunner(self._stepper.graphs)
                else:
                    log.info("prefill steps run without CUDA graphs: %s", why_not)

    def _build_kv_pool(self) -> tuple[KVCache, BlockAllocator, Scheduler]:
        """The KV cache (sized by ``num_blocks``, else by the memory budget), its block allocator and
        the scheduler over them."""
        config, model_config = self.config, self.model_config
        # Local head counts come from the (possibly TP-sharded) weights.
        num_kv_heads = self.model.model.layers[0].self_attn.k_proj.weight.shape[0] // model_config.head_dim
        shape = dict(
            num_layers=model_config.num_hidden_layers,
            block_size=config.block_size,
            num_kv_heads=num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=self.kv_dtype,
        )
        max_blocks_per_seq = -(-self.max_model_len // config.block_size)
        if config.num_blocks:
            num_blocks = config.num_blocks
        else:
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
            per_block = KVCache.bytes_per_block(**shape)
            usable = KV_BLOCKS_HEADROOM * config.max_num_seqs * max_blocks_per_seq
            num_blocks = self._agree_num_blocks(automatic_num_blocks(config, free, per_block, usable, self.device))
            if num_blocks < max_blocks_per_seq:
                log.warning(
                    "rollout engine: its KV pool holds %d tokens, fewer than one sequence at max_model_len=%d, so "
                    "longer requests are refused: set rollout.max_model_len to what the run needs, or make room "
                    "(rollout.kv_blocks%s)",
                    num_blocks * config.block_size,
                    self.max_model_len,
                    ", a lower train.max_tokens_per_mb, cluster.offload=sleep" if config.kv_reserved_bytes else "",
                )
            log.log(  # where device memory is the budget; a CPU pool's size is a fixed setting
                logging.INFO if free is not None else logging.DEBUG,
                "rollout engine: KV pool of %d blocks of %d tokens (%.2f GiB%s)",
                num_blocks,
                config.block_size,
                num_blocks * per_block / 2**30,
                f"; {config.kv_reserved_bytes / 2**30:.2f} GiB left free for the training side"
                if config.kv_reserved_bytes
                else "",
            )
        cache = KVCache(num_blocks=num_blocks, device=self.device, **shape)
        # recorded routes need a forward of every token of each sequence: no shared prefixes
        sharing = config.enable_prefix_sharing and not config.record_routes
        allocator = BlockAllocator(num_blocks, config.block_size, enable_prefix_sharing=sharing)
        scheduler = Scheduler(
            allocator,
            max_num_seqs=config.max_num_seqs,
            max_tokens_per_step=config.max_tokens_per_step,
            prefill_chunk_size=config.prefill_chunk_size,
            max_blocks_per_seq=max_blocks_per_seq,
        )
        if (
            self.device.type == "cpu"
            and config.decode_attention == "gather"
            and config.cpu_decode_carry
            and self.kv_dtype == torch.float32
        ):
            # pure-decode steps keep the gathered K/V across steps (attention.DecodeCarry); not in
            # bfloat16, where a batched matmul over the carried strided view copies it first and is
            # slower than a fresh gather (bench/LOG.md)
            cache.decode_carry = DecodeCarry(
                model_config.num_hidden_layers, scheduler.max_blocks_per_seq * config.block_size, DECODE_CARRY_MAX_BYTES
            )
        return cache, allocator, scheduler

    # ------------------------------------------------------------------ requests
    @property
    def version(self) -> int:
        """Policy version of the current weights (set by ``update_weights``)."""
        return self._control.version

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        images: ImageInputs | None = None,
    ) -> str:
        """Queue a request; it joins the running batch at the next step. Returns its id.
        ``images``: the pixel patches of a vision-language prompt whose image-pad tokens are
        expanded (``models/vision.py``); its M-RoPE positions and prefix-cache root are set here.
        ``prompt_ids`` text instead of token ids, or ``params`` not a ``SamplingParams``: a TypeError."""
        if self._control.torn is not None:
            raise TornWeightsError(self._control.torn)
        check_prompt_ids(prompt_ids, "prompt_ids")
        check_sampling_params(params, "params")
        multimodal = None
        if images is not None and images.grid_thw:
            vc = getattr(self.model, "vision_config", None)
            if vc is None:
                raise ValueError("a request with images needs a vision-language model (Qwen2.5-VL layout)")
            mrope_3P = mrope_positions(prompt_ids, images.grid_thw, vc)  # a ValueError when they do not match
            multimodal = {
                "images": images,
                "mrope_3P": mrope_3P,
                "position_delta": position_delta(mrope_3P),
                "prefix_root": images.key(),
                "image_token_id": vc.image_token_id,
            }
        return self._requests.add(prompt_ids, params, request_id, multimodal=multimodal)

    def has_unfinished(self) -> bool:
        if self._requests.inbox:
            return True
        with self._lock:
            return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> GenerationOutput:
        """Stop a request now; returns what it generated so far (finish reason ``abort``)."""
        with self._lock:
            self._requests.admit()
            seq = self._requests.live.pop(request_id, None)
            if seq is None:
                raise UnknownRequestError(f"no unfinished request with id {request_id!r}")
            self.scheduler.remove(seq)
            return self._requests.output(seq, "abort")

    def progress(self, known: dict[str, int]) -> dict[str, tuple[list[int], list[float]]]:
        """The output ids and log-probs each unfinished, admitted request of ``known`` made past its
        first ``known[request_id]`` tokens (a streaming client reads them between steps), for those
        that made any."""
        with self._lock:
            live, out = self._requests.live, {}
            for request_id, start in known.items():
                seq = live.get(request_id)
                if seq is not None and seq.num_generated > start:
                    first = len(seq.prompt_ids) + start
                    out[request_id] = (seq.token_ids[first:], seq.output_logprobs[start:])
            return out

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationOutput]:
        """Run ``prompts`` to completion (in order of ``prompts``). The engine must not be driven
        by anything else meanwhile (e.g. an ``InProcessRolloutClient``).

        ``prompts``: a list of prompts, each a list of token ids (``tokenizer.encode(text)``);
        ``params``: one ``SamplingParams`` for all, or a list of one per prompt. Anything else is a
        TypeError naming the argument and the form it takes, before any request is added."""
        if self._control.torn is not None:
            raise TornWeightsError(self._control.torn)
        if self._control.paused or self._control.sleeping:
            raise RuntimeError("generate() on a paused or sleeping engine would never finish: resume()/wake() first")
        check_prompts(prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        for i, sp in enumerate(params_list):
            check_sampling_params(sp, f"params[{i}]" if isinstance(params, list) else "params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, GenerationOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    @torch.inference_mode()
    def step(self) -> list[GenerationOutput]:
        """Run one forward pass over the scheduled tokens (a pure-decode batch: up to
        ``decode_steps`` of them back to back); returns the requests that finished. Inference mode,
        not only no-grad: each op skips autograd's and the version counters' bookkeeping, which a
        small model's CPU decode step (many small ops) pays for measurably; what a step creates and
        keeps (graphs' buffers, packed weights) is touched only by steps and by
        ``warmup_cuda_graphs``, which runs in it too."""
        with span("engine_step", "rollout"), fused_ops.inference(self._fused):
            return self._stepper.step()

    # ------------------------------------------------------------------ graphs
    def warmup_cuda_graphs(
        self, batch_sizes: list[int], max_len: int, params: list[SamplingParams] | None = None
    ) -> int:
        """Capture the decode CUDA graphs for these batch sizes and contexts up to ``max_len``
        now rather than at first use: the one-step graphs and the multi-step loops for batches of
        requests sampled with one of ``params`` (None: greedy). Returns the number of graphs held
        (0 without CUDA graphs)."""
        graphs = self._stepper.graphs
        if graphs is None:
            return 0
        # The capture lock before the engine lock, as a policy sync takes them (hold_graph_captures,
        # then pause): the one order, so a warm-up beside a sync cannot deadlock.
        with graphs.capture_lock, self._lock, torch.inference_mode(), fused_ops.inference(self._fused):
            return graphs.capture(batch_sizes, max_len, params)

    def hold_graph_captures(self) -> contextlib.AbstractContextManager:
        """A block in which no decode CUDA graph is captured (an ongoing capture finishes first);
        steps needing a new graph meanwhile run eagerly. The rollout worker holds it through a policy
        sync, so the sync's NCCL work never runs beside a capture on the same GPU."""
        graphs = self._stepper.graphs
        return graphs.hold_captures() if graphs is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ control
    def pause(self) -> None:
        """Stop at the step boundary; in-flight requests keep their tokens and K/V."""
        instant("engine_pause", "rollout", version=self._control.version)
        with self._lock:
            self._control.paused = True

    def resume(self) -> None:
        instant("engine_resume", "rollout", version=self._control.version)
        with self._lock:
            self._control.paused = False

    @property
    def is_paused(self) -> bool:
        return self._control.paused

    @property
    def is_sleeping(self) -> bool:
        return self._control.sleeping

    def sleep(self) -> None:
        """Free the KV pool (for a colocated trainer). In-flight requests are kept and recomputed
        after ``wake()``; ``step()`` does nothing while asleep."""
        with self._lock:
            if self._control.sleeping:
                return
            self.scheduler.preempt_all()
            self.allocator.clear_prefix_cache()
            if self._stepper.graphs is not None:
                self._stepper.graphs.clear()
            if self._stepper.prefill_graphs is not None:
                self._stepper.prefill_graphs.clear()
            self.cache.release()
            self._control.sleeping = True

    def wake(self) -> None:
        """Re-allocate the KV pool released by ``sleep()``."""
        with self._lock:
            if not self._control.sleeping:
                return
            self.cache.allocate()
            self._control.sleeping = False

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace weights by name (Hugging Face names) and set the policy version.

        The whole set is validated first — unknown or repeated name, wrong shape, wrong dtype — and
        rejected as a whole with a ``WeightUpdateError`` naming the tensor; the engine then keeps
        serving the previous weights. Any subset of the parameters may be sent.
        """
        self._weights.update(list(named_tensors), version)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's live weight tensors by Hugging Face name, for in-place (colocated) policy
        sync: a transport writes them, then calls :meth:`commit_weights`."""
        return self._weights.tensors()

    def mark_torn(self, reason: str) -> None:
        """The live weights are half-written (an in-place sync failed): refuse requests with
        ``TornWeightsError(reason)`` and take no step until weights are committed or loaded again."""
        self._weights.mark_torn(reason)

    def commit_weights(self, version: int) -> None:
        """Declare that the tensors of :meth:`weight_tensors` now hold policy ``version``."""
        self._weights.commit(version)

    def update_weights_from_disk(self, path: str, version: int, *, names: Iterable[str] | None = None) -> None:
        """Load Hugging Face safetensors from ``path`` as ``update_weights``: one file, or a directory
        — the shards its ``model.safetensors.index.json`` lists when it has one, else every
        ``*.safetensors`` in it.

        Everything is read before any weight changes: a shard the index lists that is missing, a
        tensor the index lists that its shard lacks, or a truncated/corrupt file rejects the update
        as a whole with a one-line ``WeightUpdateError`` naming it (never a partial update); the
        engine keeps serving the previous version. The files must hold every parameter of the
        model, or exactly the subset ``names`` declares. ``version`` only moves forward: one older
        than the served version is refused the same way (as ``areno serve`` refuses it).
        """
        self._weights.update_from_disk(path, version, names=names)

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._requests.admit()
            elapsed = time.monotonic() - self._started
            a, s, g = self.allocator, self._stepper, self._stepper.graphs
            return {
                "version": self._control.version,
                "paused": self._control.paused,
                "sleeping": self._control.sleeping,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_total": a.num_blocks,
                "kv_blocks_used": a.num_used,
                "kv_usage": a.num_used / a.num_blocks,
                "prefix_hit_rate": a.prefix_hit_tokens / max(a.prefix_query_tokens, 1),
                "num_preemptions": self.scheduler.num_preemptions,
                "steps": s.steps,
                "busy_s": s.busy_s,
                "clock_s": time.perf_counter(),  # busy_s's clock, read with it
                "sampling_round_trips": s.round_trips,
                "generated_tokens": s.generated_tokens,
                "prefill_tokens": s.prefill_tokens,
                "mixed_steps": s.mixed_steps,
                "generated_tokens_per_s": s.generated_tokens / max(elapsed, 1e-9),
                "cuda_graphs_captured": g.captures if g is not None else 0,
                "cuda_graph_capture_s": g.capture_s if g is not None else 0.0,
                "cuda_graph_deferred_steps": g.deferred if g is not None else 0,
                "cuda_graph_tp_eager_steps": g.tp_eager if g is not None else 0,
                "prefill_graph_steps": s.prefill_graphs.replays if s.prefill_graphs is not None else 0,
            }

    # The parts' state that the server's watchdog, tests and benches read (or swap) on the engine.
    @property
    def _graphs(self) -> DecodeGraphRunner | None:
        return self._stepper.graphs

    @_graphs.setter
    def _graphs(self, runner: DecodeGraphRunner | None) -> None:
        self._stepper.graphs = runner

    @property
    def _steps(self) -> int:
        return self._stepper.steps

    @property
    def _mixed_steps(self) -> int:
        return self._stepper.mixed_steps

    # ------------------------------------------------------------------ hooks tensor parallelism overrides (tp.py)
    def _agree_num_blocks(self, num_blocks: int) -> int:
        """The pool size every rank uses (ranks must schedule identically)."""
        return num_blocks

    def _logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, V]: fp32 on CPU, the model's dtype on CUDA (the sampler reads
        them in fp32, exactly the values of a cast); a mapped head's (``LogitMap``: Granite's ``logits_scaling``,
        Gemma 2's ``final_logit_softcapping``) mapped in fp32 on both, as the trainer's log-probs map them."""
        mapped = self.logit_map or (lambda z_BV: z_BV)
        fp32 = self._fp32_logits(hidden_BD)
        if fp32 is not None:
            return mapped(fp32)
        weight_VD = getattr(self.model, "output_weight", None)
        pack = self.model.__dict__.get("cpu_pack")  # RolloutEngineConfig.cpu_packed_gemm
        if pack is not None and pack.applies(hidden_BD):
            return mapped(pack(hidden_BD, None).float())
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
            return mapped(out_BV.float())
        logits_BV = self.model.logits(hidden_BD)  # mapped by the model where it maps
        # CUDA: no fp32 copy of [B, V] per decode step (~28 us at 64 x 151,936 on an H200); the
        # fused draw upcasts on load, the eager one in its first fp32 op
        return logits_BV if logits_BV.is_cuda else logits_BV.float()

    def _fp32_logits(self, hidden_BD: torch.Tensor) -> torch.Tensor | None:
        """``config.fp32_logits``' logits of this rank's head (``fp32_product``), or None where they do not
        apply (the flag off, or a float32 head, whose logits are float32 already)."""
        weight_VD = getattr(self.model, "output_weight", None)
        if not self.config.fp32_logits or weight_VD is None or weight_VD.dtype == torch.float32:
            return None
        return fp32_product(hidden_BD, self._fp32_head(weight_VD))

    def _sample_rows(self, logits_BV: torch.Tensor, rp: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and log-probs [B] on the device (no host synchronisation)."""
        return self.sampler.sample_rows(logits_BV, rp)

    def _shard_for_update(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The local shard of a full tensor (identity at TP=1)."""
        return tensor
