"""Multi-process helpers for the policy-sync tests: a spawned gloo world, a tiny Llama-shaped weight
set and its TP plan."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areno.sync.base import NamedTensorSource, PolicySyncError, ShardSpec, StagedReceiver, TensorEngine, copy_into
from areno.sync.plan import shard_specs_from_tp_plan
from areno.sync.stream import StreamSyncConfig, StreamTopology, StreamTransport
from tests.helpers.rendezvous import port_file, tcp_store

TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.embed_tokens": "vocab",
    "lm_head": "colwise",
}


def tiny_weights(seed: int, d: int = 32, v: int = 64, layers: int = 2) -> dict[str, torch.Tensor]:
    """fp32 tensors with Hugging Face Qwen2 names (q/k/v biases, untied head)."""
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(v, d, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (d, d),
            "self_attn.q_proj.bias": (d,),
            "self_attn.k_proj.weight": (d // 2, d),
            "self_attn.k_proj.bias": (d // 2,),
            "self_attn.v_proj.weight": (d // 2, d),
            "self_attn.v_proj.bias": (d // 2,),
            "self_attn.o_proj.weight": (d, d),
            "mlp.gate_proj.weight": (2 * d, d),
            "mlp.up_proj.weight": (2 * d, d),
            "mlp.down_proj.weight": (d, 2 * d),
            "input_layernorm.weight": (d,),
            "post_attention_layernorm.weight": (d,),
        }
        for k, s in shapes.items():
            w[p + k] = torch.randn(*s, generator=g)
    w["model.norm.weight"] = torch.randn(d, generator=g)
    w["lm_head.weight"] = torch.randn(v, d, generator=g)
    return w


def init_world(rank: int, world: int, port_path: str, timeout_s: float = 60.0) -> dist.Store:
    store = tcp_store(rank, world, port_path, datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return store


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, port_path, *args)`` in ``world`` processes; ``port_path`` is for ``init_world``."""
    with port_file() as port_path:
        mp.spawn(fn, args=(world, port_path, *args), nprocs=world, join=True)


# ------------------------------------------------------------------ workers (run in spawned ranks)
TRAIN, ROLLOUT = (0, 1), (2, 3)
# Overlapping device lists: train on dev0, dev1; rollout TP 2 also on dev0, dev1.
DEVICES = {0: "dev0", 1: "dev1", 2: "dev0", 3: "dev1"}


def _build(rank: int, weights: dict, bucket_bytes: int, timeout_s: float):
    topo = StreamTopology(train_ranks=TRAIN, sender_ranks=TRAIN, rollout_ranks=ROLLOUT, devices=DEVICES)
    cfg = StreamSyncConfig(bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    live, receiver = None, None
    if rank in ROLLOUT:
        meta = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
        specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=rank - ROLLOUT[0], tp_size=len(ROLLOUT))
        live = {n: torch.zeros(s.local_shape, dtype=s.dtype) for n, s in specs.items()}
        receiver = StagedReceiver(specs, copy_into(live))
    source = NamedTensorSource(lambda: weights.items()) if rank in TRAIN else None
    transport = StreamTransport(topology=topo, config=cfg, source=source, receiver=receiver)
    return transport, receiver, live


def report_and_exit(out: str, prefix: str, rank: int, world: int, result: dict) -> None:
    """Write this rank's ``result`` to ``out/<prefix><rank>.pt`` (atomically), wait until every rank
    has reported (rank 0 hosts the store: keep it up until then), then exit without tearing the
    process groups down (after a timeout or a failed sync they may be broken)."""
    tmp = Path(out) / f".{prefix}{rank}.pt"
    torch.save(result, tmp)
    tmp.rename(Path(out) / f"{prefix}{rank}.pt")
    deadline = time.time() + 60
    while time.time() < deadline and not all((Path(out) / f"{prefix}{r}.pt").exists() for r in range(world)):
        time.sleep(0.1)
    os._exit(0)


def worker_scenario(rank: int, world: int, port_path: str, out: str, bucket_bytes: int, timeout_s: float) -> None:
    """v1 and v2 (new weights) complete; for v3, rank 3 never joins: everyone else must raise
    within the timeout, naming rank 3, and rollout rank 2 must keep v2 intact. Each rank saves
    what it holds after each step to ``out/rank{rank}.pt``."""
    init_world(rank, world, port_path)
    weights = tiny_weights(seed=1)
    transport, receiver, live = _build(rank, weights, bucket_bytes, timeout_s=timeout_s)
    snapshot = lambda: {n: t.clone() for n, t in live.items()} if live is not None else None
    result = {
        "relays": transport.relays,
        "plan_rows": dict(transport.plan.owner),
        "peak_buffer_bytes": transport.peak_buffer_bytes,
        "max_bucket": transport.plan.max_bucket_bytes,
    }
    for version, seed in ((1, 1), (2, 2)):
        weights.update(tiny_weights(seed=seed))  # same dict object: the source sees new values
        stats = transport.sync(version)
        result[f"v{version}"] = {
            "metrics": stats.as_metrics(),
            "live": snapshot(),
            "receiver_version": receiver.version if receiver is not None else None,
        }
    result["peak_buffer_bytes"] = transport.peak_buffer_bytes
    result["pop"] = transport.pop_metrics()
    result["pop_again"] = transport.pop_metrics()

    weights.update(tiny_weights(seed=3))
    if rank == 3:  # hang: stay alive (sockets open) until the others have given up
        deadline = time.time() + 60
        while time.time() < deadline and not all((Path(out) / f"rank{r}.pt").exists() for r in (0, 1, 2)):
            time.sleep(0.1)
    else:
        t0 = time.perf_counter()
        try:
            transport.sync(3)
            result["error"] = None
        except PolicySyncError as e:
            result["error"] = str(e)
        result["elapsed"] = time.perf_counter() - t0
        result["after"] = snapshot()
        result["receiver_version"] = receiver.version if receiver is not None else None
    report_and_exit(out, "rank", rank, world, result)


def worker_engine(rank: int, world: int, port_path: str, out: str, model_dir: str) -> None:
    """Rank 0 trains (LocalTrainBackend, weights moved as by a step), rank 1 serves a RolloutEngine
    from the original checkpoint; a stream sync carries the trained policy over; both save what
    they need to compare log-probs of one fixed sequence."""
    from areno.models.hf_io import load_model
    from areno.models.logprobs import packed_logprobs
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.sync.base import engine_receiver
    from areno.train import LocalTrainBackend, TrainBackendConfig
    from areno.types import SamplingParams

    torch.set_num_threads(1)
    init_world(rank, world, port_path)
    topo = StreamTopology(train_ranks=(0,), sender_ranks=(0,), rollout_ranks=(1,))
    cfg = StreamSyncConfig(bucket_bytes=8192, timeout_s=60)
    prompt = [5, 9, 12, 7, 3, 11]
    if rank == 0:
        b = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", grad_clip=None))
        b.initialize(model_dir)
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            for p in b.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        transport = StreamTransport(topology=topo, config=cfg, source=NamedTensorSource(b.named_weights))
        transport.sync(1)
        dist.barrier()  # rank 1 generated and saved its output ids
        ids_T = torch.tensor(prompt + torch.load(Path(out) / "engine.pt", weights_only=True)["ids"])
        with torch.no_grad():
            lp, _ = packed_logprobs(b.model, ids_T, torch.tensor([0, ids_T.numel()]))
        torch.save({"logprobs": lp[len(prompt) :]}, Path(out) / "trainer.pt")
    else:
        model, mcfg = load_model(model_dir, dtype=torch.float32, device="cpu")
        engine = RolloutEngine(model, mcfg, config=RolloutEngineConfig(block_size=4, num_blocks=64))
        meta_shapes = {n: tuple(t.shape) for n, t in engine.weight_tensors().items()}
        specs = {n: ShardSpec(name=n, full_shape=s, dtype=torch.float32) for n, s in meta_shapes.items()}
        transport = StreamTransport(topology=topo, config=cfg, receiver=engine_receiver(engine, specs))
        params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3)
        before = engine.generate([prompt], params)[0]
        transport.sync(1)
        after = engine.generate([prompt], params)[0]
        torch.save(
            {
                "ids": after.output_ids,
                "logprobs": torch.tensor(after.output_logprobs),
                "version": engine.version,
                "before_version": before.output_versions[0],
            },
            Path(out) / "engine.pt",
        )
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


def worker_source_error(rank: int, world: int, port_path: str, out: str, timeout_s: float) -> None:
    """v1 completes; during v2 training rank 1's source raises midway: rank 1 surfaces its own
    error, every other rank raises PolicySyncError naming rank 1, the rollout ranks keep v1."""
    init_world(rank, world, port_path)
    weights = tiny_weights(seed=1)
    transport, receiver, live = _build(rank, weights, bucket_bytes=1024, timeout_s=timeout_s)
    transport.sync(1)
    v1 = {n: t.clone() for n, t in live.items()} if live is not None else None
    weights.update(tiny_weights(seed=2))
    if rank == 1:

        def broken():
            for i, item in enumerate(weights.items()):
                if i == 10:
                    raise ValueError("source broke")
                yield item

        transport.source = NamedTensorSource(broken)
    result = {}
    t0 = time.perf_counter()
    try:
        transport.sync(2)
        result["error"] = None
    except (PolicySyncError, ValueError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["elapsed"] = time.perf_counter() - t0
    if live is not None:
        result["intact"] = all(torch.equal(live[n], v1[n]) for n in live)
        result["version"] = receiver.version
    torch.save(result, Path(out) / f".rank{rank}.pt")
    (Path(out) / f".rank{rank}.pt").rename(Path(out) / f"rank{rank}.pt")
    deadline = time.time() + 60
    while time.time() < deadline and not all((Path(out) / f"rank{r}.pt").exists() for r in range(world)):
        time.sleep(0.1)
    os._exit(0)


def mixed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Matrices bf16, vectors fp32: packed buckets mix source dtypes."""
    return {n: (t if t.dim() == 1 else t.to(torch.bfloat16)) for n, t in weights.items()}


EXACT_CONFIGS = (  # tag, direct_bytes, wire dtype, commit, mixed source dtypes, stream-ordered waits
    ("direct", 1024, None, "swap", False, False),
    ("cast", 512, torch.bfloat16, "copy", False, False),
    ("mixed", 1024, None, "swap", True, True),
)


def worker_exact(rank: int, world: int, port_path: str, out: str, gpu: bool = False) -> None:
    """Several transports in one world, each syncing v1 then v2 (new weights):
    "direct": fp32, chunks >= 1 KiB unpacked (cut at the TP boundaries, received in place),
    committed by storage swap; "cast": bf16 on the wire and in the receivers, chunks >= 512 B
    unpacked, so cast chunks are packed into a buffer while another bucket is still open;
    "mixed": bf16 matrices and fp32 vectors in the same buckets, swap commit, waits forced
    stream-ordered (on gloo they still block; this runs the deferred host check's bookkeeping).
    ``gpu``: ranks on cuda:0/cuda:1 (train and rollout overlapping), NCCL data plane.
    Saves each rollout rank's live tensors after each version to ``out/exact{rank}.pt``."""
    from areno.sync.base import swap_into

    init_world(rank, world, port_path)
    device = torch.device(f"cuda:{rank % 2}") if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    topo = StreamTopology(train_ranks=TRAIN, sender_ranks=TRAIN, rollout_ranks=ROLLOUT, devices=DEVICES)
    result = {}
    for tag, direct, wire, commit, mix, ordered in EXACT_CONFIGS:
        convert = (
            (lambda w: {n: t.to(device) for n, t in mixed(w).items()})
            if mix
            else (lambda w: {n: t.to(device) for n, t in w.items()})
        )
        weights = convert(tiny_weights(seed=1))
        meta = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
        live, receiver = None, None
        if rank in ROLLOUT:
            specs = shard_specs_from_tp_plan(meta, TP_PLAN, tp_rank=rank - ROLLOUT[0], tp_size=len(ROLLOUT), dtype=wire)
            live = {n: torch.zeros(s.local_shape, dtype=s.dtype, device=device) for n, s in specs.items()}
            receiver = StagedReceiver(specs, (swap_into if commit == "swap" else copy_into)(live), device=device)
        source = NamedTensorSource(weights.items) if rank in TRAIN else None
        cfg = StreamSyncConfig(bucket_bytes=2048, timeout_s=30, wire_dtype=wire, direct_bytes=direct)
        transport = StreamTransport(
            topology=topo,
            config=cfg,
            source=source,
            receiver=receiver,
            tag=tag,
            device=device,
            backend="nccl" if gpu else None,
        )
        sizes = [len(b.items) for b in transport.plan.buckets]
        result[tag] = {
            "single": sum(n == 1 for n in sizes),
            "packed": sum(n > 1 for n in sizes),
            "peak_buffer_bytes": transport.peak_buffer_bytes,
            "fanout": list(transport.fanout),
            "wire_bytes": transport.wire_bytes,
            "total_bytes": transport.plan.total_bytes,
            "stream_ordered": transport.collectives.stream_ordered,
        }
        if ordered:
            transport.collectives.stream_ordered = True
        for version, seed in ((1, 1), (2, 2)):
            weights.update(convert(tiny_weights(seed=seed)))
            transport.sync(version)
            if live is not None:
                result[tag][f"v{version}"] = {n: t.cpu().clone() for n, t in live.items()}
        result[tag]["phases"] = dict(transport.last_phases)
    torch.save(result, Path(out) / f"exact{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


class PauseProbe:
    """A ``ShardReceiver`` that delegates to ``inner`` and records, at every ``stage``, whether
    ``engine`` was paused (what generation could do while the sync wrote that tensor)."""

    def __init__(self, inner, engine) -> None:
        self.inner, self.engine = inner, engine
        self.paused_at_stage: list[bool] = []

    def shard_specs(self):
        return self.inner.shard_specs()

    def begin(self, version: int) -> None:
        self.inner.begin(version)

    def stage(self, name: str) -> torch.Tensor:
        self.paused_at_stage.append(self.engine.is_paused)
        return self.inner.stage(name)

    def commit(self, version: int) -> None:
        self.inner.commit(version)

    def abort(self, reason: str = "") -> None:
        self.inner.abort(reason)

    @property
    def last_paused_s(self):
        return self.inner.last_paused_s


def trained_weights(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors moved as by a training step (seeded), by Hugging Face name."""
    from areno.models.hf_io import load_model

    model, _ = load_model(model_dir, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    return {n: (t + 0.05 * torch.randn(t.shape, generator=g)).detach() for n, t in model.state_dict().items()}


def worker_inplace(rank: int, world: int, port_path: str, out: str, model_dir: str, timeout_s: float) -> None:
    """Rank 0 trains (a dict of weights), rank 1 serves two RolloutEngines from the checkpoint:
    one takes syncs through a staged receiver, the other in place. v1: both; v2: in place into an
    engine paused beforehand; v3: in place, the source raises after some buckets; v4: in place
    over a rebuilt transport (the failed one's groups may be broken), same receiver. Rank 1 saves
    engine weights, pause records, stats and errors to ``out/inplace1.pt``."""
    from areno.models.hf_io import load_model
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig, TornWeightsError
    from areno.sync.base import engine_receiver
    from areno.types import SamplingParams

    torch.set_num_threads(1)
    init_world(rank, world, port_path)
    topo = StreamTopology(train_ranks=(0,), sender_ranks=(0,), rollout_ranks=(1,))
    cfg = StreamSyncConfig(bucket_bytes=16384, direct_bytes=4096, timeout_s=timeout_s)
    weights = trained_weights(model_dir, seed=1)
    res: dict = {}

    def transport(tag: str, receiver=None) -> StreamTransport:
        source = NamedTensorSource(lambda: weights.items()) if rank == 0 else None
        return StreamTransport(topology=topo, config=cfg, source=source, receiver=receiver, tag=tag)

    if rank == 0:
        staged, live = transport("staged"), transport("inplace")
        staged.sync(1)
        live.sync(1)
        weights.update(trained_weights(model_dir, seed=2))
        live.sync(2)
        weights.update(trained_weights(model_dir, seed=3))

        def broken():
            for i, item in enumerate(weights.items()):
                if i == len(weights) // 2:
                    raise ValueError("source broke")
                yield item

        live.source = NamedTensorSource(broken)
        try:
            live.sync(3)
        except ValueError as e:
            res["error"] = str(e)
        weights.update(trained_weights(model_dir, seed=4))
        transport("inplace-retry").sync(4)
        res["v4"] = weights
    else:

        def engine() -> RolloutEngine:
            model, mcfg = load_model(model_dir, dtype=torch.float32, device="cpu")
            return RolloutEngine(model, mcfg, config=RolloutEngineConfig(block_size=4, num_blocks=64))

        def snapshot(e: RolloutEngine) -> dict[str, torch.Tensor]:
            return {n: t.detach().clone() for n, t in e.weight_tensors().items()}

        params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=3)
        e_staged, e_live = engine(), engine()
        specs = {
            n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=t.dtype) for n, t in e_live.weight_tensors().items()
        }
        probe = PauseProbe(engine_receiver(e_live, specs, commit="inplace"), e_live)
        staged = transport("staged", engine_receiver(e_staged, specs, commit="staged"))
        live = transport("inplace", probe)
        s_staged = staged.sync(1)
        s_live = live.sync(1)
        res["v1"] = {
            "staged": snapshot(e_staged),
            "inplace": snapshot(e_live),
            "version": e_live.version,
            "paused_at_stage": list(probe.paused_at_stage),
            "paused_after": e_live.is_paused,
            "stats": {"staged": s_staged.as_metrics(), "inplace": s_live.as_metrics()},
        }
        e_live.pause()  # paused beforehand: the sync leaves it paused
        probe.paused_at_stage.clear()
        live.sync(2)
        res["v2"] = {
            "paused_after": e_live.is_paused,
            "version": e_live.version,
            "paused_at_stage": list(probe.paused_at_stage),
            "weights": snapshot(e_live),
        }
        e_live.resume()
        res["v2"]["serves"] = len(e_live.generate([[5, 9, 12]], params)[0].output_ids)
        try:
            live.sync(3)
            res["v3"] = {"error": None}
        except PolicySyncError as e:
            res["v3"] = {"error": str(e)}
        res["v3"]["paused_after"] = e_live.is_paused
        res["v3"]["version"] = e_live.version
        v2 = res["v2"]["weights"]
        res["v3"]["changed"] = sorted(n for n, t in snapshot(e_live).items() if not torch.equal(t, v2[n]))
        for what, call in (
            ("generate", lambda: e_live.generate([[5, 9, 12]], params)),
            ("add_request", lambda: e_live.add_request([5, 9, 12], params)),
        ):
            try:
                call()
                res["v3"][what] = None
            except TornWeightsError as e:
                res["v3"][what] = str(e)
        retry = transport("inplace-retry", probe)
        stats = retry.sync(4)
        res["v4"] = {
            "weights": snapshot(e_live),
            "paused_after": e_live.is_paused,
            "version": e_live.version,
            "paused_s": stats.generation_paused_s,
            "serves": len(e_live.generate([[5, 9, 12]], params)[0].output_ids),
        }
    report_and_exit(out, "inplace", rank, world, res)


def worker_vote(rank: int, world: int, port_path: str, out: str, gpu: bool) -> None:
    """Rank 0 trains, rank 1 receives in place; ``gpu``: on cuda:0 and cuda:1 with an NCCL data
    plane (distinct GPUs: the vote runs on NCCL), else on CPU over gloo. v1 completes; in v2 the
    source raises after its last tensor (every byte moved, so nothing hangs): the vote must fail
    naming rank 0 and leave the engine torn; v3 on the same transport completes. Saves what each
    rank saw to ``out/vote{rank}.pt``."""
    from areno.sync.base import engine_receiver

    init_world(rank, world, port_path)
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    topo = StreamTopology(
        train_ranks=(0,), sender_ranks=(0,), rollout_ranks=(1,), devices={0: f"{device.type}:0", 1: f"{device.type}:1"}
    )
    cfg = StreamSyncConfig(bucket_bytes=2048, direct_bytes=1024, timeout_s=30)
    weights = {n: t.to(device) for n, t in tiny_weights(seed=1).items()}
    engine = receiver = source = None
    if rank == 0:
        source = NamedTensorSource(lambda: weights.items())
    else:
        engine = TensorEngine({n: torch.zeros_like(t) for n, t in weights.items()})
        specs = {n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=t.dtype) for n, t in weights.items()}
        receiver = engine_receiver(engine, specs, commit="inplace")
    transport = StreamTransport(
        topology=topo, config=cfg, source=source, receiver=receiver, device=device, backend="nccl" if gpu else None
    )
    res = {"vote_backend": transport.vote_backend}
    transport.sync(1)
    if rank == 1:
        res["v1"] = {n: t.cpu().clone() for n, t in engine.weight_tensors().items()}
    weights.update({n: t.to(device) for n, t in tiny_weights(seed=2).items()})
    if rank == 0:

        def raises_at_the_end():
            yield from weights.items()
            raise ValueError("source broke after its last tensor")

        transport.source = NamedTensorSource(raises_at_the_end)
    try:
        transport.sync(2)
        res["v2_error"] = None
    except (PolicySyncError, ValueError) as e:
        res["v2_error"] = f"{type(e).__name__}: {e}"
    if rank == 1:
        res["v2_torn"], res["v2_paused"] = engine.torn, engine.is_paused
    else:
        transport.source = NamedTensorSource(lambda: weights.items())
    weights.update({n: t.to(device) for n, t in tiny_weights(seed=3).items()})
    transport.sync(3)
    if rank == 1:
        res["v3"] = {n: t.cpu().clone() for n, t in engine.weight_tensors().items()}
        res["v3_torn"], res["v3_paused"], res["v3_version"] = engine.torn, engine.is_paused, engine.version
    torch.save(res, Path(out) / f"vote{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
