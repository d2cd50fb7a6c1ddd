"""``warm_up_rollout_engine``: which decode CUDA graphs a run captures at start-up."""

from __future__ import annotations

import torch

from areno.api.config import load_config
from areno.engine.api import warm_up_rollout_engine


class RecordingEngine:
    """Stands in for a CUDA rollout engine: records the warm-up request."""

    def __init__(self, device: str = "cuda") -> None:
        self.device = torch.device(device)
        self.calls: list[tuple[list[int], int, list]] = []

    def warmup_cuda_graphs(self, batch_sizes, max_len, params=None) -> int:
        self.calls.append((list(batch_sizes), max_len, list(params)))
        return 7


def _config(*extra: str):
    return load_config(
        None,
        [
            "model.path=m",
            "rollout.batch_size=4",
            "rollout.n_samples=8",
            "rollout.max_new_tokens=100",
            "rollout.temperature=0.7",
            "rollout.top_p=0.9",
            *extra,
        ],
    )


def test_sizes_cover_eta_plus_one_batches_and_both_samplers():
    engine = RecordingEngine()
    assert warm_up_rollout_engine(engine, _config("rollout.max_head_offpolicyness=2", "data.num_eval=10")) == 7
    ((sizes, max_len, params),) = engine.calls
    assert sizes == list(range(1, 3 * 4 * 8 + 1))  # (eta + 1) batches of 4 prompts x 8 samples
    assert max_len == 356
    assert [(p.temperature, p.top_p, p.max_new_tokens, p.seed) for p in params] == [
        (0.7, 0.9, 100, 0),
        (0.0, 1.0, 100, None),
    ]


def test_no_eval_no_greedy_graphs_and_max_concurrent_bounds_the_sizes():
    engine = RecordingEngine()
    warm_up_rollout_engine(
        engine, _config("rollout.max_head_offpolicyness=8", "rollout.max_concurrent=5", "data.num_eval=0")
    )
    ((sizes, _, params),) = engine.calls
    assert sizes == list(range(1, 5 * 8 + 1))
    assert [p.temperature for p in params] == [0.7]


def test_nothing_captured_on_cpu_or_when_turned_off():
    for engine, extra in (
        (RecordingEngine("cpu"), ()),
        (RecordingEngine(), ("rollout.cuda_graph_warmup=false",)),
        (RecordingEngine(), ("rollout.cuda_graphs=false",)),
    ):
        assert warm_up_rollout_engine(engine, _config(*extra)) == 0
        assert engine.calls == []


def test_a_failed_warm_up_warns_and_leaves_capture_to_first_use(caplog):
    class FailingEngine(RecordingEngine):
        def warmup_cuda_graphs(self, batch_sizes, max_len, params=None) -> int:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with caplog.at_level("WARNING"):
        assert warm_up_rollout_engine(FailingEngine(), _config()) == 0
    assert "warm-up failed" in caplog.text and "rollout.cuda_graph_warmup=false" in caplog.text


def test_async_colocated_training_step_holds_graph_captures(tmp_path):
    """While the trainer's step runs beside the generating engine, no CUDA graph is captured (its
    kernels and device synchronizations would invalidate the capture); synchronous steps hold nothing."""
    import contextlib

    from areno.api.backend.base import RolloutBatch
    from areno.engine.api import ArenoEngine
    from areno.engine.local import LocalRolloutSide, LocalTrainingSide

    events = []

    class Engine:
        @contextlib.contextmanager
        def hold_graph_captures(self):
            events.append("hold")
            yield
            events.append("release")

    class Runner:
        versions: dict = {}

        def roles_to_sync(self):
            return []

        def step(self, batch, pass_order=None):
            events.append("step")
            return {"loss": 1.0}

    for asynchronous, expected in ((True, ["hold", "step", "release"]), (False, ["step"])):
        events.clear()
        cfg, cpu = _config(), torch.device("cpu")
        training, rollout = LocalTrainingSide(cfg, cpu, export_root=tmp_path), LocalRolloutSide(cfg, cpu)
        training.runner, rollout.engine = Runner(), Engine()  # what start() would build
        engine = ArenoEngine(cfg, tmp_path, training=training, rollout=rollout)
        engine.asynchronous = asynchronous
        metrics = engine.step(RolloutBatch(trajectories=[], batch=None))  # the fake runner ignores the batch
        assert events == expected and metrics == {"train/loss": 1.0}


def test_engine_running_batch_follows_the_sequences_in_flight():
    from areno.engine.api import rollout_engine_config

    def engine_cfg(*extra: str):
        return rollout_engine_config(_config(*extra), device="cpu", dtype="float32")

    # eta 4: 5 batches of 4 prompts x 8 samples = 160 in flight -> the 256 floor
    assert engine_cfg("rollout.max_head_offpolicyness=4").max_num_seqs == 256
    # 20 prompts x 8 samples x 5 batches = 800 sequences in flight: the running batch and its graphs follow
    c = engine_cfg("rollout.batch_size=20", "rollout.max_head_offpolicyness=4")
    assert c.max_num_seqs == 800 and c.cuda_graph_max_batch is None  # graphs up to the running batch
    assert engine_cfg("rollout.batch_size=64", "rollout.max_head_offpolicyness=4").max_num_seqs == 1024  # ceiling
    assert (
        engine_cfg(
            "rollout.batch_size=20", "rollout.max_head_offpolicyness=4", "rollout.max_concurrent=40"
        ).max_num_seqs
        == 320
    )
    assert engine_cfg("rollout.max_num_seqs=96").max_num_seqs == 96  # explicit


def test_negative_max_num_seqs_is_refused_naming_the_key():
    import pytest

    from areno.api.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.max_num_seqs"):
        _config("rollout.max_num_seqs=-1")
