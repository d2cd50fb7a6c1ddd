"""The in-place commit (``engine_receiver(..., commit="inplace")``) against real rollout engines,
and the choice of the commit vote's backend.

One spawned gloo world (rank 0 trains, rank 1 serves a staged and an in-place engine) runs the
whole scenario: both take v1, the in-place engine takes v2 while paused beforehand, v3 fails
midway (the trainer's source raises), v4 succeeds on a rebuilt transport."""

from __future__ import annotations

import pytest
import torch

from areno.models.hf_io import load_model
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig, TornWeightsError
from areno.sync.base import LiveReceiver, PolicySyncError, ShardSpec, StagedReceiver, engine_receiver
from areno.sync.stream import StreamTopology, vote_backend
from areno.types import SamplingParams
from tests.helpers.sync import spawn, tiny_weights, trained_weights, worker_inplace, worker_vote

TIMEOUT_S = 2.0
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=3)


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("inplace")
    spawn(worker_inplace, 2, str(out), str(tiny_model_dir), TIMEOUT_S)
    return {r: torch.load(out / f"inplace{r}.pt", weights_only=True) for r in range(2)}


def test_inplace_sync_equals_staged_sync_bit_for_bit(results, tiny_model_dir):
    v1 = results[1]["v1"]
    want = trained_weights(str(tiny_model_dir), seed=1)
    assert set(v1["inplace"]) == set(v1["staged"]) and v1["version"] == 1
    for name, t in v1["inplace"].items():
        assert torch.equal(t, v1["staged"][name]), name
        assert torch.equal(t, want[name]), name


def test_engine_is_paused_during_an_inplace_sync_and_resumed_after(results):
    v1, v2 = results[1]["v1"], results[1]["v2"]
    assert v1["paused_at_stage"] and all(v1["paused_at_stage"])  # every write went into a paused engine
    assert v1["paused_after"] is False
    # Paused before the sync: still paused after it (the caller resumes), then it serves v2.
    assert all(v2["paused_at_stage"]) and v2["paused_after"] is True and v2["version"] == 2
    assert v2["serves"] == PARAMS.max_new_tokens


def test_generation_paused_time_is_the_whole_inplace_sync(results):
    stats = results[1]["v1"]["stats"]
    live, staged = stats["inplace"], stats["staged"]
    assert 0.5 * live["policy_sync_time_s"] < live["policy_sync_generation_paused_s"] <= live["policy_sync_time_s"]
    # The staged engine paused only for its commit's copy.
    assert staged["policy_sync_generation_paused_s"] < live["policy_sync_generation_paused_s"]


def test_failed_inplace_sync_leaves_engine_refusing_until_the_next_sync(results, tiny_model_dir):
    assert results[0]["error"] == "source broke"
    v3 = results[1]["v3"]
    assert v3["error"] is not None and v3["error"].startswith("policy sync v3 failed on rank 1")
    # Torn for real: the buckets before the failure landed in the live weights, the rest did not.
    total = len(results[1]["v2"]["weights"])
    assert 0 < len(v3["changed"]) < total, v3["changed"]
    assert v3["paused_after"] is True and v3["version"] == 2
    for what in ("generate", "add_request"):
        msg = v3[what]
        assert msg is not None and "\n" not in msg, (what, msg)
        assert "in-place policy sync v3 failed midway" in msg
        assert "refuses to generate until the next policy sync" in msg
    # The next sync (rebuilt transport, same receiver) commits, resumes and serves the new policy.
    v4 = results[1]["v4"]
    assert v4["version"] == 4 and v4["paused_after"] is False and v4["serves"] == PARAMS.max_new_tokens
    want = trained_weights(str(tiny_model_dir), seed=4)
    assert all(torch.equal(t, want[n]) for n, t in v4["weights"].items())
    assert v4["paused_s"] > 0


# ---------------------------------------------------------------- in process
@pytest.fixture()
def engine(tiny_model_dir):
    model, cfg = load_model(tiny_model_dir, dtype=torch.float32, device="cpu")
    return RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64))


def specs_of(engine, dtype=None):
    return {
        n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=dtype or t.dtype)
        for n, t in engine.weight_tensors().items()
    }


def test_engine_receiver_validates_before_any_byte_moves(engine):
    assert isinstance(engine_receiver(engine, specs_of(engine)), StagedReceiver)
    assert isinstance(engine_receiver(engine, specs_of(engine), commit="inplace"), LiveReceiver)
    with pytest.raises(ValueError, match="commit='copy': must be one of staged, swap, inplace"):
        engine_receiver(engine, specs_of(engine), commit="copy")
    with pytest.raises(ValueError, match="cannot take torch.int64"):
        engine_receiver(engine, specs_of(engine, torch.int64), commit="inplace")
    name = "model.norm.weight"
    bad = {name: ShardSpec(name=name, full_shape=(7,), dtype=torch.float32)}
    with pytest.raises(ValueError, match=f"{name}: engine tensor"):
        engine_receiver(engine, bad, commit="inplace")
    # A cast (bf16 on the wire, fp32 engine) is allowed: the stager's copies cast.
    r = engine_receiver(engine, specs_of(engine, torch.bfloat16), commit="inplace")
    assert r.shard_specs()[name].dtype == torch.float32


def test_live_receiver_hands_out_the_live_tensors_and_aborts_cleanly_before_a_write(engine):
    r = engine_receiver(engine, specs_of(engine), commit="inplace")
    r.begin(1)
    assert engine.is_paused
    r.abort("sender went away")  # nothing handed out yet: the weights are intact, serving goes on
    assert not engine.is_paused and not r.torn
    assert len(engine.generate([[5, 9, 12]], PARAMS)[0].output_ids) == PARAMS.max_new_tokens
    r.begin(1)
    name = "model.norm.weight"
    assert r.stage(name).data_ptr() == engine.weight_tensors()[name].data_ptr()  # the live memory: no staging
    with pytest.raises(PolicySyncError, match="never arrived"):
        r.commit(1)  # the other tensors never came: torn, refuses to generate
    assert r.torn and engine.is_paused and engine.version == 0
    with pytest.raises(TornWeightsError, match="in-place policy sync v1 failed midway"):
        engine.generate([[5, 9, 12]], PARAMS)
    # A disk (or any full) reload also repairs it; here a complete in-place sync does.
    r.begin(2)
    for n in r.shard_specs():
        r.stage(n)
    r.commit(2)
    assert not r.torn and not engine.is_paused and engine.version == 2
    assert len(engine.generate([[5, 9, 12]], PARAMS)[0].output_ids) == PARAMS.max_new_tokens


# ---------------------------------------------------------------- vote backend
def topo(devices: dict[int, str]) -> StreamTopology:
    return StreamTopology(train_ranks=(0, 1), sender_ranks=(0, 1), rollout_ranks=(2, 3), devices=devices)


def test_vote_backend_is_nccl_only_on_distinct_gpus_under_an_nccl_data_plane():
    distinct = topo({0: "cuda:0", 1: "cuda:1", 2: "cuda:2", 3: "cuda:3"})
    shared = topo({0: "cuda:0", 1: "cuda:1", 2: "cuda:0", 3: "cuda:1"})
    assert vote_backend(distinct, "nccl") == "nccl"
    assert vote_backend(distinct, "cpu:gloo,cuda:nccl") == "nccl"
    assert vote_backend(distinct, "gloo") == "gloo"
    assert vote_backend(shared, "nccl") == "gloo"  # a communicator must never hold a GPU twice
    # Ranks without a device entry count as distinct devices.
    assert vote_backend(topo({}), "NCCL") == "nccl"
    assert vote_backend(topo({0: "cuda:0", 3: "cuda:0"}), "nccl") == "gloo"


def check_vote(res: dict, backend: str) -> None:
    assert res[0]["vote_backend"] == res[1]["vote_backend"] == backend
    assert all(torch.equal(t.cpu(), tiny_weights(seed=1)[n]) for n, t in res[1]["v1"].items())
    assert res[0]["v2_error"] == "ValueError: source broke after its last tensor"
    assert res[1]["v2_error"].startswith("PolicySyncError: policy sync v2 failed on rank 1: failed rank(s) [0]")
    assert "in-place policy sync v2 failed midway" in res[1]["v2_torn"] and res[1]["v2_paused"]
    assert all(torch.equal(t.cpu(), tiny_weights(seed=3)[n]) for n, t in res[1]["v3"].items())
    assert res[1]["v3_torn"] is None and not res[1]["v3_paused"] and res[1]["v3_version"] == 3


def test_a_rank_that_raised_fails_the_vote_and_the_same_transport_recovers(tmp_path):
    """No timeout involved: every byte moved before the sender raised, so the groups stay usable."""
    spawn(worker_vote, 2, str(tmp_path), False)
    check_vote({r: torch.load(tmp_path / f"vote{r}.pt", weights_only=True) for r in range(2)}, "gloo")


@pytest.mark.gpu
def test_nccl_vote_on_two_gpus_names_the_failed_rank_and_inplace_recovers(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    spawn(worker_vote, 2, str(tmp_path), True)
    check_vote({r: torch.load(tmp_path / f"vote{r}.pt", weights_only=True) for r in range(2)}, "nccl")
