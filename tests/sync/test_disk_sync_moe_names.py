"""A policy sync to vLLM or SGLang servers carries what a checkpoint on disk holds: an expert model's
fused tensors (``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj``, Mixtral's
router under ``mlp.gate``) as transformers' per-expert ones, the names the servers' loaders know.
The DISK export (``DiskTransport`` with the policy's config, as ``LocalTrainingSide`` builds it)
and the NCCL broadcast (``ServerRolloutSide``) both equal ``hf_io.save_model`` of the same
weights, name for name, shape for shape, value for value; a dense model's sync is unchanged."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areno.api.config import load_config
from areno.data.tokenizer import build_char_tokenizer
from areno.engine.api import load_tokenizer, prepare_model_dir, resolve_recipe
from areno.engine.local import LocalTrainingSide
from areno.engine.seams import SideSetup, WeightKind, WeightUpdate
from areno.engine.servers import ServerRolloutSide
from areno.models.hf_io import build_model, load_model, save_model, tiny_config
from areno.rollout.backends.nccl import NcclWeightTransfer
from areno.sync.base import NamedTensorSource
from areno.sync.disk import CheckpointNamedSource, DiskTransport, latest_policy
from tests.helpers.fake_vllm import RecordingGroup, StartedServer, fake_vllm_app
from tests.helpers.moe import saved_by_transformers
from tests.helpers.serving import serving

torch.set_num_threads(1)


def _expert_model(layout: str, tmp_path: Path):
    """An expert model saved by transformers itself (``tests/helpers/moe.py``), loaded by areno."""
    saved_by_transformers(layout, tmp_path / "hf")
    decoder, config = load_model(tmp_path / "hf", dtype=torch.float32)
    return decoder, config, tmp_path / "hf"


def _source(decoder) -> NamedTensorSource:
    """What ``LocalTrainingSide`` syncs: the trained weights by in-memory name (state-dict order)."""
    return NamedTensorSource(lambda: decoder.state_dict().items())


def _synced(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The newest published version and its tensors, read through its index."""
    path, _ = latest_policy(root)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(path / shard))
    assert set(tensors) == set(index["weight_map"])
    return path, tensors


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].shape == t.shape and got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("layout", ["qwen3_moe", "mixtral"])
def test_disk_sync_of_an_expert_model_writes_what_save_model_writes(layout, tmp_path):
    decoder, config, model_dir = _expert_model(layout, tmp_path)
    expected = load_file(save_model(decoder, config, tmp_path / "saved") / "model.safetensors")
    # several shards: a fused tensor's experts may land in different files
    transport = DiskTransport(
        _source(decoder), tmp_path / "sync", model_dir=model_dir, model_config=config, max_shard_bytes=8192
    )
    stats = transport.sync(3)
    path, synced = _synced(tmp_path / "sync")
    assert len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    _assert_same(synced, expected)
    assert stats.tensors == len(expected)
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in synced)
    # the names transformers itself saved, the ones vLLM's and SGLang's loaders map
    assert sorted(synced) == sorted(load_file(model_dir / "model.safetensors"))
    if layout == "mixtral":
        assert (
            "model.layers.0.block_sparse_moe.gate.weight" in synced and "model.layers.0.mlp.gate.weight" not in synced
        )
    # a checkpoint loader reads the export back into the very weights that were synced
    reloaded, _ = load_model(path, dtype=torch.float32)
    _assert_same(reloaded.state_dict(), decoder.state_dict())


def test_checkpoint_names_are_announced_in_the_order_they_are_sent(tmp_path):
    decoder, config, _ = _expert_model("qwen3_moe", tmp_path)
    source = CheckpointNamedSource(_source(decoder), config)
    meta = source.meta()
    sent = list(source.iter_tensors())
    assert [name for name, _, _ in meta] == [name for name, _ in sent]
    assert [(shape, dtype) for _, shape, dtype in meta] == [(tuple(t.shape), t.dtype) for _, t in sent]
    assert all(t.is_contiguous() for _, t in sent)
    again = list(source.iter_tensors())  # a second sync sends the same (the plan is kept)
    assert [name for name, _ in again] == [name for name, _ in sent]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again, sent, strict=True))


def test_dense_disk_sync_is_unchanged(tmp_path):
    config = tiny_config(61, arch="qwen3", hidden_size=32, layers=2, heads=2, kv_heads=1)
    torch.manual_seed(0)
    decoder = build_model(config)
    expected = load_file(save_model(decoder, config, tmp_path / "saved") / "model.safetensors")
    DiskTransport(_source(decoder), tmp_path / "plain").sync(1)
    DiskTransport(_source(decoder), tmp_path / "named", model_config=config).sync(1)
    _, plain = _synced(tmp_path / "plain")
    _, named = _synced(tmp_path / "named")
    _assert_same(named, plain)
    _assert_same(named, expected)


def test_nccl_sync_of_an_expert_model_sends_the_checkpoints_names(tmp_path, monkeypatch):
    """``rollout.weight_transfer=nccl`` against the stand-in vLLM server and a recording group: the
    announced names and shapes, and the tensors broadcast, are the checkpoint's."""
    decoder, config, model_dir = _expert_model("mixtral", tmp_path)
    expected = load_file(save_model(decoder, config, tmp_path / "saved") / "model.safetensors")
    group = RecordingGroup()
    transfer = functools.partial(
        NcclWeightTransfer, join=lambda *a: group, send=lambda tensors, g: g.sent.extend(tensors)
    )
    monkeypatch.setattr(
        "areno.engine.servers.NcclWeightTransfer",
        lambda *a, **kw: transfer(*a, **{**kw, "device": torch.device("cpu"), "dtype": torch.float32}),
    )
    monkeypatch.setattr("areno.engine.servers.check_nccl_transfer", lambda config: None)
    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    app = fake_vllm_app(model_dir, build_char_tokenizer().eos_token_id)
    with serving(app) as url:
        monkeypatch.setattr(
            "areno.engine.servers.start_servers", lambda specs, log_dir, timeout_s: [StartedServer(url)]
        )
        cfg = load_config(
            None,
            [
                f"model.path={model_dir}",
                f"run_dir={tmp_path / 'run'}",
                "rollout.backend=vllm",
                "rollout.weight_transfer=nccl",
            ],
        )
        side = ServerRolloutSide(cfg, tmp_path / "run")
        side.start(SideSetup(recipe=None, model_dir=model_dir, tokenizer=None))
        try:
            update = WeightUpdate(version=1, kind=WeightKind.IN_PROCESS, source=_source(decoder))
            side.update_weights(update)
        finally:
            side.shutdown()
    info = next(body for call, body in app.state.calls if call == "update_weights")["update_info"]
    assert info["names"] == [name for name, _ in group.sent]
    assert info["shapes"] == [list(t.shape) for _, t in group.sent]
    _assert_same(dict(group.sent), expected)


def test_the_colocated_training_sides_disk_export_of_an_expert_policy_is_a_checkpoint(tmp_path):
    """``LocalTrainingSide.publish_weights(DISK)``, the export a vLLM or SGLang server loads."""
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "model.init_tiny={arch: qwen3_moe, hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64,"
            " moe_intermediate_size: 32, num_experts: 4, num_experts_per_tok: 2}",
            "data.task=arithmetic",
            "cluster.device=cpu",
            "observe.console=false",
        ],
    )
    model_dir = prepare_model_dir(cfg)
    training = LocalTrainingSide(cfg, torch.device("cpu"), export_root=tmp_path / "policy")
    training.start(SideSetup(recipe=resolve_recipe(cfg), model_dir=model_dir, tokenizer=load_tokenizer(model_dir)))
    try:
        backend = training.runner.backends[training.policy]
        update = training.publish_weights(1, WeightKind.DISK)
        decoder = build_model(backend.model_config)
        decoder.load_state_dict(dict(backend.named_weights()))
        expected = load_file(save_model(decoder, backend.model_config, tmp_path / "saved") / "model.safetensors")
    finally:
        training.shutdown()
    path, synced = _synced(tmp_path / "policy")
    assert path == update.path
    _assert_same(synced, expected)
