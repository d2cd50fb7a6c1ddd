"""``rollout.weight_transfer=nccl``: vLLM's NCCL weight transfer behind ``ServerRolloutSide``.

CPU: the config errors, and the HTTP calls of a sync and their order against a recording stand-in
vLLM server (``tests/helpers/fake_vllm.py``) with a recording group in place of NCCL. The real
transfer (a vLLM server on a GPU) is marked ``gpu`` and ``vllm``."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from areno.api.config import load_config
from areno.data.tokenizer import build_char_tokenizer
from areno.engine.seams import SideSetup, WeightKind, WeightUpdate
from areno.engine.servers import ServerRolloutSide
from areno.errors import ConfigError, RunFailure
from areno.launch.servers import ServerSpec, server_command
from areno.models.hf_io import init_model_dir, load_model, tiny_config
from areno.rollout.backends.nccl import NcclWeightTransfer
from areno.sync.base import NamedTensorSource
from tests.helpers.fake_vllm import RecordingGroup, StartedServer, fake_vllm_app
from tests.helpers.serving import serving


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.weight_transfer=gloo"], "rollout.weight_transfer: must be one of disk, nccl, got 'gloo'"),
        (
            ["rollout.backend=sglang", "rollout.weight_transfer=nccl"],
            "rollout.weight_transfer: nccl is implemented for vllm servers, not sglang",
        ),
        (
            ["rollout.backend=vllm", "rollout.weight_transfer=nccl", "cluster.device=cpu"],
            "rollout.weight_transfer: nccl needs CUDA (cluster.device is cpu): use rollout.weight_transfer=disk",
        ),
        (
            ["rollout.backend=vllm", "rollout.weight_transfer=nccl", "rollout.servers=[http://h:1]"],
            "rollout.weight_transfer: nccl is for the vllm servers areno starts",
        ),
    ],
)
def test_weight_transfer_key_errors(overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(None, ["model.path=m", *overrides])
    assert load_config(None, ["model.path=m"]).rollout.weight_transfer == "disk"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_nccl_without_cuda_is_refused_before_anything_starts(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr("areno.engine.servers.start_servers", lambda *a, **k: started.append(a))
    cfg = load_config(
        None, ["model.path=m", f"run_dir={tmp_path}", "rollout.backend=vllm", "rollout.weight_transfer=nccl"]
    )
    with pytest.raises(
        ConfigError, match=r"^rollout.weight_transfer: nccl needs CUDA, and this run has none: use disk"
    ):
        ServerRolloutSide(cfg, tmp_path)
    assert not started


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A ``ServerRolloutSide`` with nccl whose 'started' server is the stand-in and whose group records."""
    return _stand_in(tmp_path, monkeypatch, dict(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64))


def _stand_in(tmp_path, monkeypatch, tiny: dict):
    """``stand_in`` for a model of ``tiny_config(**tiny)``."""
    tok = build_char_tokenizer()
    model = tmp_path / "model"
    init_model_dir(model, tiny_config(len(tok), **tiny), tok)
    group = RecordingGroup()

    def join(address, port, world_size):
        group.joined = (address, port, world_size)
        return group

    def send(tensors, g):
        g.sent.extend(tensors)

    monkeypatch.setattr("areno.engine.servers.check_nccl_transfer", lambda config: None)
    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    monkeypatch.setattr(
        "areno.engine.servers.NcclWeightTransfer",
        functools.partial(_cpu_transfer, join=join, send=send),
    )
    return model, tok, group


def _cpu_transfer(*args, join, send, **kwargs):
    return NcclWeightTransfer(*args, **{**kwargs, "device": torch.device("cpu"), "join": join, "send": send})


def _side(tmp_path: Path, model: Path, app, monkeypatch, url: str) -> ServerRolloutSide:
    monkeypatch.setattr("areno.engine.servers.start_servers", lambda specs, log_dir, timeout_s: [StartedServer(url)])
    cfg = load_config(
        None,
        [f"model.path={model}", f"run_dir={tmp_path / 'run'}", "rollout.backend=vllm", "rollout.weight_transfer=nccl"],
    )
    side = ServerRolloutSide(cfg, tmp_path / "run")
    assert side.weight_kinds == {WeightKind.IN_PROCESS}
    side.start(SideSetup(recipe=None, model_dir=model, tokenizer=None))
    return side


def test_nccl_sync_sends_vllms_weight_transfer_calls_in_order(stand_in, tmp_path, monkeypatch):
    model, tok, group = stand_in
    app = fake_vllm_app(model, tok.eos_token_id)
    with serving(app) as url:
        side = _side(tmp_path, model, app, monkeypatch, url)
        try:
            assert app.state.calls == [
                (
                    "init_weight_transfer_engine",
                    {"init_info": {"master_address": "127.0.0.1", "master_port": group.joined[1], "rank_offset": 1,
                                   "world_size": 2}},
                )
            ]  # fmt: skip
            assert group.joined[0] == "127.0.0.1" and group.joined[2] == 2
            weights, _ = load_model(model)
            source = NamedTensorSource(lambda: list(weights.state_dict().items()))
            app.state.calls.clear()
            metrics = side.update_weights(WeightUpdate(version=1, kind=WeightKind.IN_PROCESS, source=source))
        finally:
            side.shutdown()
    names = [name for name, _ in app.state.calls]
    assert names == [
        "pause", "start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache", "resume"
    ]  # fmt: skip
    info = app.state.calls[2][1]["update_info"]
    meta = source.meta()
    assert info["names"] == [n for n, _, _ in meta] and info["packed"] is True
    assert info["shapes"] == [list(s) for _, s, _ in meta] and set(info["dtype_names"]) == {"bfloat16"}
    assert [n for n, _ in group.sent] == info["names"]  # broadcast in the announced order, as announced
    assert all(t.dtype is torch.bfloat16 for _, t in group.sent)
    assert side.version == 1 and metrics["policy_sync_load_s"] >= 0


def test_nccl_sync_sends_glm4_moes_float32_routers_in_float32(tmp_path, monkeypatch):
    """GLM-4.5's routers (weight and correction bias), which vLLM holds in float32, are announced and broadcast
    in float32 on a bf16 transfer, their values unrounded; every other tensor in bf16."""
    model, tok, group = _stand_in(tmp_path, monkeypatch, dict(arch="glm4_moe", hidden_size=32, layers=2, heads=2))
    weights, _ = load_model(model)
    with torch.no_grad():
        weights.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    routers = {f"model.layers.1.mlp.gate.{leaf}" for leaf in ("weight", "e_score_correction_bias")}
    app = fake_vllm_app(model, tok.eos_token_id)
    with serving(app) as url:
        side = _side(tmp_path, model, app, monkeypatch, url)
        try:
            source = NamedTensorSource(lambda: list(weights.state_dict().items()))
            app.state.calls.clear()
            side.update_weights(WeightUpdate(version=1, kind=WeightKind.IN_PROCESS, source=source))
        finally:
            side.shutdown()
    info = app.state.calls[2][1]["update_info"]
    announced = dict(zip(info["names"], info["dtype_names"]))
    assert {n for n, d in announced.items() if d == "float32"} == routers
    assert set(announced.values()) == {"float32", "bfloat16"}
    sent = dict(group.sent)
    assert [n for n, _ in group.sent] == info["names"]
    for name in routers:
        assert torch.equal(sent[name], weights.state_dict()[name])  # float32, not rounded to bf16
    assert all(t.dtype == torch.bfloat16 for n, t in sent.items() if n not in routers)


def test_nccl_needs_the_weight_transfer_routes(stand_in, tmp_path, monkeypatch):
    model, tok, _ = stand_in
    app = fake_vllm_app(model, tok.eos_token_id, weight_transfer=False)
    with serving(app) as url:
        with pytest.raises(ConfigError, match=r"^rollout.weight_transfer: vLLM server .* has no /init_weight_transfer"):
            _side(tmp_path, model, app, monkeypatch, url)


def test_a_lost_server_stops_an_nccl_run_at_the_next_sync(stand_in, tmp_path, monkeypatch):
    model, tok, _ = stand_in
    app = fake_vllm_app(model, tok.eos_token_id)
    with serving(app) as url:
        side = _side(tmp_path, model, app, monkeypatch, url)
        side._lost[url] = "its process exited"
        try:
            with pytest.raises(RunFailure, match="NCCL weight-transfer group are gone"):
                side.update_weights(WeightUpdate(version=1, kind=WeightKind.IN_PROCESS, source=None))
        finally:
            side.shutdown()


def test_launcher_starts_vllm_with_its_nccl_engine(tmp_path):
    spec = ServerSpec(
        backend="vllm", model_dir=tmp_path, served_name="p", dtype="bfloat16", tp=1, port=1, api_key="k",
        devices=[0], weight_transfer="nccl",
    )  # fmt: skip
    cmd = server_command(spec)
    i = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[i + 1]) == {"backend": "nccl"}
    assert "--weight-transfer-config" not in server_command(ServerSpec(**{**spec.__dict__, "weight_transfer": "disk"}))


@pytest.mark.gpu
@pytest.mark.vllm
def test_grpo_with_nccl_weight_transfer_through_a_real_vllm_server(tmp_path):
    """Three GRPO steps through a vLLM server on a GPU, each sync over NCCL: the trainer's log-probs
    match the server's after every sync (the broadcast reached its workers)."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one for training, one for the server)")
    tok = build_char_tokenizer()
    model = tmp_path / "model"
    init_model_dir(
        model, tiny_config(len(tok), hidden_size=64, layers=2, heads=2, kv_heads=1, intermediate_size=128), tok
    )
    from areno.api.trainer import Trainer

    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={model}",
            "cluster.device=cuda",
            "cluster.allocation_mode='fsdp:d1+vllm:d1'",
            "rollout.weight_transfer=nccl",
            "rollout.server_args=[--enforce-eager,--gpu-memory-utilization,0.3]",
            "rollout.max_model_len=1024",
            "data.task=arithmetic",
            "data.num_eval=0",
            "rollout.batch_size=2",
            "rollout.n_samples=4",
            "rollout.max_new_tokens=8",
            "train.steps=3",
            "optim.lr=0.05",
            "observe.console=false",
        ],
    )
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/logprob_abs_diff_mean" in r]
    assert len(steps) == 3 and all(r["rollout/logprob_abs_diff_max"] < 5e-2 for r in steps), steps  # bf16 server
    assert trainer.backend.engine.version == 3


STUCK_TRANSFER = """
import threading, torch
from areno.errors import RunFailure
from areno.rollout.backends.nccl import NcclWeightTransfer

class Admin:
    def start_weight_update(self, url): pass
    def finish_weight_update(self, url): pass
    def update_weights_nccl(self, url, info): raise RunFailure("server " + url + " refused the update")

never = threading.Event()
transfer = NcclWeightTransfer(Admin(), ["http://a"], 1, dtype=torch.float32, device=torch.device("cpu"),
    master_address="127.0.0.1", master_port=1, join=lambda *a: None, send=lambda tensors, group: never.wait())
transfer.group = object()
try:
    transfer.send([("w", (2,), None)], [("w", torch.zeros(2))])
except RunFailure as exc:
    print("refused:", exc)
"""


def test_a_refused_nccl_update_does_not_hold_the_process_at_exit():
    """walk34: when a server refused its update, the broadcast's thread stayed in a collective nobody else joined,
    and as an executor's thread it was joined at interpreter exit: `areno train` printed its error and never
    exited. The transfer's calls run in daemon threads now."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STUCK_TRANSFER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: " in done.stdout and "refused the update" in done.stdout
