"""``NcclWeightTransfer``: a policy sync to vLLM servers over NCCL (``rollout.weight_transfer=nccl``),
vLLM's "Weight Transfer" protocol with its NCCL backend (servers started with
``--weight-transfer-config '{"backend": "nccl"}'``):

- once, at start: every server ``POST /init_weight_transfer_engine`` with ``{"init_info":
  {master_address, master_port, rank_offset, world_size}}`` while this process joins the same
  group as rank 0 (vLLM's ``NCCLWeightTransferEngine.trainer_init``: a ``StatelessProcessGroup``
  and a ``PyNcclCommunicator``). Server i's TP workers take ranks ``1 + i * tp ...``; the world is
  ``1 + servers * tp``. Both halves must run at once (the rendezvous waits for every rank).
- each sync (servers paused by the caller): ``POST /start_weight_update`` on every server, then
  ``POST /update_weights`` with ``{"update_info": {names, dtype_names, shapes, packed: true}}`` on
  every server (each answers once its workers received and loaded everything) while this process
  broadcasts the tensors in that order (``trainer_send_weights(packed=True)``: vLLM's own bucketing,
  the one its receivers unpack), then ``POST /finish_weight_update``.

The group spans every server: a server lost during the run cannot leave it, so the next sync stops
the run (``rollout.weight_transfer=disk`` survives losing servers). CUDA only; tests drive it with
a recording group and recording routes (``join``/``send``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch

from areno.errors import RunFailure

Meta = list[tuple[str, tuple[int, ...], torch.dtype]]
"""``(name, shape, dtype)`` of every tensor a sync sends, in order."""


def vllm_trainer_group(master_address: str, master_port: int, world_size: int) -> Any:
    """Rank 0 of the weight-transfer group, as vLLM's trainer side makes it."""
    # vllm is an optional extra, heavy to import: only a run with weight_transfer=nccl loads it
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    return NCCLWeightTransferEngine.trainer_init(
        {"master_address": master_address, "master_port": master_port, "world_size": world_size}
    )


def vllm_send(tensors: Iterable[tuple[str, torch.Tensor]], group: Any) -> None:
    """Broadcast ``tensors`` from rank 0, packed into vLLM's buckets."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine  # see vllm_trainer_group

    NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), group, src=0, packed=True)


class NcclWeightTransfer:
    """The trainer's half of vLLM's NCCL weight transfer to ``urls`` (see the module docstring).

    ``admin``: the servers' routes (``VLLMAdmin``). ``dtype``/``device``: what the servers hold and
    where the broadcast runs (each tensor is cast and moved before it is sent). ``float32_names``: the
    tensors the servers hold in float32 whatever ``dtype`` (GLM-4.5's routers, ``moe.float32_names``),
    sent and announced in float32 so that a bf16 wire does not round them. ``join(address, port,
    world_size) -> group`` and ``send(tensors, group)``: vLLM's trainer side by default."""

    def __init__(
        self,
        admin: Any,
        urls: list[str],
        tp: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        master_address: str,
        master_port: int,
        float32_names: Collection[str] = (),
        join: Callable[[str, int, int], Any] = vllm_trainer_group,
        send: Callable[[Iterable[tuple[str, torch.Tensor]], Any], None] = vllm_send,
    ) -> None:
        self.admin, self.urls, self.tp = admin, list(urls), tp
        self.dtype, self.device = dtype, device
        self.float32_names = frozenset(float32_names)
        self.master_address, self.master_port = master_address, master_port
        self._join, self._send = join, send
        self.group: Any = None

    @property
    def world_size(self) -> int:
        return 1 + len(self.urls) * self.tp

    def start(self) -> None:
        """Every server joins the group with this process (rank 0)."""
        calls = [
            _in_daemon_thread(
                self.admin.init_weight_transfer,
                url,
                {
                    "master_address": self.master_address,
                    "master_port": self.master_port,
                    "rank_offset": 1 + i * self.tp,
                    "world_size": self.world_size,
                },
            )
            for i, url in enumerate(self.urls)
        ]
        joined = _in_daemon_thread(self._join, self.master_address, self.master_port, self.world_size)
        _all_or_first_error([*calls, joined], "joining the NCCL weight-transfer group")
        self.group = joined.result()

    def send(self, meta: Meta, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One sync: start, the tensors (``meta`` order) broadcast while every server receives,
        finish. The servers must be paused (requests kept) by the caller."""
        assert self.group is not None, "start() the transfer first"
        info = {
            "names": [name for name, _, _ in meta],
            "dtype_names": [str(self._wire_dtype(name)).removeprefix("torch.") for name, _, _ in meta],
            "shapes": [list(shape) for _, shape, _ in meta],
            "packed": True,
        }
        for url in self.urls:
            self.admin.start_weight_update(url)
        cast = ((name, t.to(device=self.device, dtype=self._wire_dtype(name))) for name, t in tensors)
        # the broadcast runs in a thread too: a server that refuses its update must stop the run
        # rather than leave this thread waiting on a collective nobody else joins
        receiving = [_in_daemon_thread(self.admin.update_weights_nccl, url, info) for url in self.urls]
        sending = _in_daemon_thread(self._send, cast, self.group)
        _all_or_first_error([*receiving, sending], "the NCCL weight transfer")
        for url in self.urls:
            self.admin.finish_weight_update(url)

    def _wire_dtype(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` is announced and broadcast in (vLLM's packed broadcast takes one per tensor)."""
        return torch.float32 if name in self.float32_names else self.dtype


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` in a daemon thread: one left in a collective nobody else joins (a server refused
    its part) must not hold the process at exit, where an executor's threads are joined."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="areno-nccl-transfer").start()
    return future


def _all_or_first_error(futures: list[concurrent.futures.Future], what: str) -> None:
    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for future in done:
        exc = future.exception()
        if isinstance(exc, RunFailure):
            raise exc
        if exc is not None:
            raise RunFailure(f"{what} failed: {type(exc).__name__}: {exc}") from exc
