"""``export_role``: a role's export, one function for the colocated training side
(``LocalTrainingSide.export_hf``) and the partitioned one (``TrainWorker.export_hf``). A policy is
written as the backend's causal LM; a reward model as transformers' sequence classifier (no LM
head, ``score.weight``), the directory the scorer reads (``q_source=reward_model``), alike from a
one-process backend and from FSDP2 over two ranks (rank 0 writes)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from areno.engine.local import LocalTrainingSide, export_role
from areno.engine.workers import TrainWorker
from areno.models.hf_io import is_sequence_classifier, load_model
from areno.specializations import RewardModelSpecialization, ScalarScorerSpecialization, SFTSpecialization
from areno.train import FSDP2TrainBackend, LocalTrainBackend, TrainBackendConfig
from areno.types import TokenBatch, Trajectory
from tests.helpers.train import make_model_dir, spawn

torch.set_num_threads(1)

HEAD = 0.25
"""The reward head's weight in these tests (``wrap_model`` starts it at 0)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("export_role") / "model", layers=2)


def _backend(backend_cls, model_dir: Path, spec=None):
    backend = backend_cls(TrainBackendConfig(lr=1e-3, device="cpu"))
    backend.initialize(str(model_dir), wrap_model=spec.wrap_model if spec is not None else None)
    if isinstance(spec, RewardModelSpecialization):
        with torch.no_grad():
            backend.model.score.weight.fill_(HEAD)  # a DTensor's shard under FSDP2: every rank fills its own
    return backend


def _side(backend, spec) -> SimpleNamespace:
    """What both training sides' ``export_hf`` read: the runner's backends and specs, and the role."""
    return SimpleNamespace(runner=SimpleNamespace(backends={"role": backend}, specs={"role": spec}), policy="role")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _assert_same_export(got: Path, want: Path) -> None:
    assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())
    a, b = _tensors(got), _tensors(want)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[name], b[name]) for name in b)


def test_a_policy_exports_as_the_backends_causal_lm(model_dir, tmp_path):
    backend = _backend(LocalTrainBackend, model_dir)
    export_role(backend, SFTSpecialization(), tmp_path / "role")
    backend.export_hf(tmp_path / "direct")
    _assert_same_export(tmp_path / "role", tmp_path / "direct")
    assert sorted(p.name for p in (tmp_path / "role").iterdir()) == sorted(
        p.name for p in (tmp_path / "direct").iterdir()
    )
    assert not is_sequence_classifier(tmp_path / "role")
    loaded, _ = load_model(tmp_path / "role", dtype=torch.float32)
    weights = dict(backend.named_weights())
    assert all(torch.equal(t, weights[name]) for name, t in loaded.state_dict().items())


def test_a_reward_model_exports_as_the_sequence_classifier_the_scorer_reads(model_dir, tmp_path):
    spec = RewardModelSpecialization()
    backend = _backend(LocalTrainBackend, model_dir, spec)
    out = tmp_path / "reward"
    export_role(backend, spec, out)
    assert is_sequence_classifier(out)
    assert json.loads((out / "config.json").read_text())["architectures"][0].endswith("ForSequenceClassification")
    assert "lm_head.weight" not in _tensors(out) and "score.bias" not in _tensors(out)
    scorer = ScalarScorerSpecialization(head="reward_model", head_path=str(out))
    read = scorer.wrap_model(load_model(out, dtype=torch.float32)[0])
    assert torch.equal(read.score.weight, torch.full_like(read.score.weight, HEAD))
    traj = Trajectory(prompt_ids=[5, 6, 7], completion_ids=[8, 9], logprobs=[0.0] * 2, versions=[0] * 2, reward=0.0)
    batch = TokenBatch.from_trajectories([traj])
    with torch.no_grad():
        torch.testing.assert_close(
            scorer.extract_model_output(read, batch)["q_T"], backend.model.scores_T(batch), rtol=0, atol=0
        )


def _partitioned_worker(rank: int, world: int, model_dir: str, out: str) -> None:
    spec = RewardModelSpecialization()
    backend = _backend(FSDP2TrainBackend, Path(model_dir), spec)
    TrainWorker.export_hf(_side(backend, spec), out)
    backend.shutdown()


def test_the_partitioned_worker_exports_a_reward_model_as_the_colocated_side_does(model_dir, tmp_path):
    spawn(_partitioned_worker, 2, str(model_dir), str(tmp_path / "partitioned"), tmp=tmp_path)
    spec = RewardModelSpecialization()
    LocalTrainingSide.export_hf(_side(_backend(LocalTrainBackend, model_dir, spec), spec), tmp_path / "colocated")
    assert is_sequence_classifier(tmp_path / "partitioned")
    _assert_same_export(tmp_path / "partitioned", tmp_path / "colocated")


def test_the_hf_export_writes_the_weights_without_loading_them_into_a_second_model(model_dir, tmp_path, monkeypatch):
    """walk37: every save rebuilt the decoder and copied every weight into it before writing (seconds a
    save, twice the model in host memory). The weights are written as gathered, checked by name and shape
    against a model built on meta; the file holds exactly the backend's weights."""
    from areno.models.decoder import Decoder
    from areno.train.backend import check_full_state

    backend = _backend(LocalTrainBackend, model_dir)

    def no_second_copy(self, *args, **kwargs):
        raise AssertionError("the export loaded the weights into another model")

    monkeypatch.setattr(Decoder, "load_state_dict", no_second_copy)
    backend.export_hf(tmp_path / "hf")
    saved = _tensors(tmp_path / "hf")
    weights = {name: t.detach() for name, t in backend.named_weights()}
    assert sorted(saved) == sorted(weights) and all(torch.equal(saved[n], weights[n]) for n in weights)
    expected = {"a": torch.empty(2, 3, device="meta"), "b": torch.empty(4, device="meta")}
    with pytest.raises(
        RuntimeError, match=r"missing \['b'\], unexpected \['c'\], wrong shapes \['a \(3, 2\) \(expected \(2, 3\)\)'\]"
    ):
        check_full_state({"a": torch.zeros(3, 2), "c": torch.zeros(1)}, expected, role="policy")
