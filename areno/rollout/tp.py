"""Tensor-parallel rollout: one ``TensorParallelRolloutEngine`` per rank of a TP group, run SPMD.

Every rank holds its shards of the decoder (``areno.models.tp_plan``: q/k/v, gate/up and an untied
``lm_head`` split by output rows, o_proj/down_proj by input columns and all-reduced, norms and the
embedding whole) and a KV cache of its own KV heads. All ranks must receive the same calls in the
same order (``add_request``, ``step``, ``update_weights`` …); the scheduler is deterministic, so the
batches agree. Logits of a vocabulary-split ``lm_head`` are all-gathered; rank 0 samples and
broadcasts the tokens and log-probs, so the ranks can never drift apart.

The process group is gloo on CPU (tests spawn two processes) and NCCL on GPU.

Served replicas (the partitioned engine): only the TP leader (rank 0) has callers (its HTTP server's
driver thread). ``lead(command_group)`` makes it record every ``add_request`` and ``abort`` and
broadcast them, at each ``step``, over a gloo command group before it runs the step; the other
ranks sit in ``follow(command_group)``, applying the same calls in the same order and then taking
the same step, so every rank's scheduler holds the same requests at every step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from areno.models.hf_io import load_model
from areno.models.tp_plan import shard_tensor, tp_plan, tp_style
from areno.models.vision import ImageInputs
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig, WeightUpdateError
from areno.rollout.sampling import RowParams
from areno.types import GenerationOutput, SamplingParams

Command = tuple
"""``("add", prompt_ids, params, request_id)`` or ``("abort", request_id)``, as the leader took it."""


def make_tp_reduce(group: dist.ProcessGroup | None) -> Any:
    """The all-reduce (sum) the decoder calls after its row-parallel projections."""

    def tp_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    return tp_reduce


def load_tp_model(
    model_dir: str,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[torch.nn.Module, Any]:
    """This rank's shards of the checkpoint in ``model_dir`` (``hf_io.load_model`` with TP)."""
    return load_model(
        model_dir,
        dtype=dtype,
        device=device,
        tp_rank=dist.get_rank(group),
        tp_size=dist.get_world_size(group),
        tp_reduce=make_tp_reduce(group),
    )


class TensorParallelRolloutEngine(RolloutEngine):
    """A ``RolloutEngine`` over a TP-sharded ``Decoder``; see the module docstring for the protocol."""

    PARK_TIMEOUT_S = 600.0
    """How long a follower's weight commit waits for its leader's (the policy sync's timeout)."""

    LOCAL_SAMPLING = False  # rank 0's tokens are broadcast (``_sample_rows``): no sampling inside a graph

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        *,
        config: RolloutEngineConfig,
        group: dist.ProcessGroup | None = None,
        eos_token_ids=(),
        tokenizer: Any = None,
    ) -> None:
        self.group = group
        self.tp_rank = dist.get_rank(group)
        self.tp_size = dist.get_world_size(group)
        if getattr(model, "tp_size", 1) != self.tp_size:
            raise ValueError(
                f"the model is sharded for tp_size={getattr(model, 'tp_size', 1)} but the process "
                f"group has {self.tp_size} ranks: load it with load_tp_model"
            )
        self._plan = tp_plan(model_config)
        self._commands: list[Command] | None = None
        """The leader's calls since its last step (None: not leading; every rank is called directly)."""
        self._command_group: dist.ProcessGroup | None = None
        self._mirror_lock = threading.RLock()
        self._ordered_commits = False
        self._following = False
        """A follower with ordered commits: ``pause``/``resume`` park it at the leader's commit."""
        self._parked = threading.Event()
        self._released = threading.Event()
        super().__init__(model, model_config, config=config, eos_token_ids=eos_token_ids, tokenizer=tokenizer)
        self._stepper.overlap = False  # when to stop chaining depends on this rank's callers

    def _comm_device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(self.group) == "nccl"
            else torch.device("cpu")
        )

    def _agree_num_blocks(self, num_blocks: int) -> int:
        n = torch.tensor([num_blocks], device=self._comm_device())
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.group)
        return int(n.item())

    def _logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        local_BV = self._fp32_logits(hidden_BD)
        if local_BV is None:
            local_BV = self.model.logits(hidden_BD).float()  # mapped by the model where it maps
        elif self.logit_map is not None:  # each logit on its own: a shard as the whole
            local_BV = self.logit_map(local_BV)
        if self.model_config.tie_word_embeddings:
            return local_BV  # the embedding is replicated: full logits already
        parts = [torch.empty_like(local_BV) for _ in range(self.tp_size)]
        dist.all_gather(parts, local_BV.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def _sample_rows(self, logits_BV: torch.Tensor, rp: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        # Every rank samples (keeping the shared generator in step); rank 0's choice is broadcast.
        tokens_B, logprobs_B = self.sampler.sample_rows(logits_BV, rp)
        dev = self._comm_device()
        t = tokens_B.to(dev).contiguous()
        lp = logprobs_B.to(dev).contiguous()
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(t, src=src, group=self.group)
        dist.broadcast(lp, src=src, group=self.group)
        return t.to(self.device), lp.to(self.device)

    def _shard_for_update(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Full (Hugging Face shaped) tensors in, this rank's shard out."""
        try:
            return shard_tensor(tensor, tp_style(self._plan, name), self.tp_rank, self.tp_size)
        except ValueError as e:
            raise WeightUpdateError(f"weight update rejected: {name!r}: {e}") from None

    # ------------------------------------------------------------------ served replicas
    def lead(self, command_group: dist.ProcessGroup, *, ordered_commits: bool = False) -> None:
        """On TP rank 0, from now on: mirror every call that changes the requests to the followers
        (see the module docstring). ``command_group``: gloo, this replica's TP ranks.
        ``ordered_commits``: each ``commit_weights`` is sent too, so the followers switch weights
        at the same step boundary (for commits while the replica generates; the followers must
        follow with it as well)."""
        assert self.tp_rank == 0, "only TP rank 0 leads"
        self._command_group = command_group
        self._ordered_commits = ordered_commits
        self._commands = []

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        images: ImageInputs | None = None,
    ) -> str:
        if images is not None:  # vision-language models refuse tensor parallelism at load; a stray image too
            raise ValueError("image prompts need a rollout engine of TP 1: set the rollout TP to 1")
        if self._commands is None:
            return super().add_request(prompt_ids, params, request_id)
        with self._mirror_lock:
            request_id = super().add_request(prompt_ids, params, request_id)
            self._commands.append(("add", list(prompt_ids), params, request_id))
            return request_id

    def abort(self, request_id: str) -> GenerationOutput:
        if self._commands is None:
            return super().abort(request_id)
        with self._mirror_lock:
            output = super().abort(request_id)  # an unknown id raises before anything is recorded
            self._commands.append(("abort", request_id))
            return output

    def step(self) -> list[GenerationOutput]:
        if self._commands is None:
            return super().step()
        # Held through the step: a request added meanwhile would join this step here but the
        # next one on the followers; a pause would skip the step here but not there.
        with self._mirror_lock:
            c = self._control
            if c.paused or c.sleeping or c.torn is not None:
                return []  # a step that does nothing here: the followers must not take it either
            commands, self._commands = self._commands, []
            self._broadcast(("step", commands))
            return super().step()

    def pause(self) -> None:
        if self._following:  # ordered commits: hold the follower where its leader committed
            if not self._parked.wait(self.PARK_TIMEOUT_S):
                raise WeightUpdateError(
                    f"TP rank {self.tp_rank}: the leader did not commit within {self.PARK_TIMEOUT_S} s"
                )
            self._parked.clear()
            return
        with self._mirror_lock:  # between two mirrored steps
            super().pause()

    def resume(self) -> None:
        if self._following:
            self._released.set()
            return
        super().resume()

    def commit_weights(self, version: int) -> None:
        super().commit_weights(version)
        if self._commands is not None and self._ordered_commits:
            with self._mirror_lock:
                self._broadcast(("commit", [version]))

    def stop_followers(self) -> None:
        """Release the followers' ``follow`` loops (the leader shuts down)."""
        if self._commands is not None:
            with self._mirror_lock:
                self._broadcast(("stop", []))
                self._commands = None

    def follow(self, command_group: dist.ProcessGroup, *, ordered_commits: bool = False) -> None:
        """On TP ranks > 0: take the leader's calls and steps until it stops (blocking; run it in
        a thread of its own). ``ordered_commits``: as the leader's; this rank's weight commit
        (``pause``, copy, ``commit_weights``, ``resume`` from its receiver) then runs while this
        loop is held at the leader's commit."""
        assert self.tp_rank > 0, "TP rank 0 leads"
        self._command_group = command_group
        self._following = ordered_commits
        while True:
            kind, commands = self._broadcast(None)
            if kind == "stop":
                return
            if kind == "commit":
                self._parked.set()
                self._released.wait()
                self._released.clear()
                continue
            for command in commands:
                if command[0] == "add":
                    super().add_request(*command[1:])
                else:
                    super().abort(command[1])
            super().step()

    def _broadcast(self, message: tuple | None) -> tuple:
        box = [message]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._command_group, 0), group=self._command_group)
        return box[0]
