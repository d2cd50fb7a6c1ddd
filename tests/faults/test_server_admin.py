"""Admin safety of the rollout server: ``/health`` says when the engine is paused, a weight update
must hold every parameter (or exactly a subset it names) and cannot move the version backwards,
``areno serve`` takes its limits from the command line, and ``areno train``'s own servers always
get a random key, also on loopback."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from areno.api.config import load_config
from areno.cli import main as areno_main
from areno.data.tokenizer import build_char_tokenizer
from areno.engine.partitioned import PartitionedCluster
from areno.models.hf_io import init_model_dir, tiny_config
from areno.rollout.server import build_engine, build_parser, create_app


@pytest.fixture
def engine(tiny_model_dir):
    return build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)[0]


def test_health_reports_paused(engine):
    with TestClient(create_app(engine)) as client:
        assert client.get("/health").json() == {"status": "ok", "paused": False}
        client.post("/pause")
        assert client.get("/health").json() == {"status": "ok", "paused": True}
        client.post("/resume")
        assert client.get("/health").json()["paused"] is False


def test_partial_weight_files_are_refused_unless_the_subset_is_named(engine, tiny_model_dir, tmp_path):
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    name = sorted(tensors)[0]
    one = tmp_path / "one.safetensors"
    save_file({name: tensors[name] + 1}, str(one))
    with TestClient(create_app(engine)) as client:
        r = client.post("/update_weights_from_disk", json={"path": str(one), "version": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "path"
        assert "lacks" in r.json()["error"]["message"] and client.get("/version").json() == {"version": 0}
        r = client.post("/update_weights_from_disk", json={"path": str(one), "version": 1, "names": ["other"]})
        assert r.status_code == 400 and "not among the declared names" in r.json()["error"]["message"]
        r = client.post("/update_weights_from_disk", json={"path": str(one), "version": 1, "names": [name]})
        assert r.status_code == 200 and client.get("/version").json() == {"version": 1}
        assert (engine.weight_tensors()[name] == tensors[name] + 1).all()


def test_versions_only_move_forward(engine, tiny_model_dir):
    with TestClient(create_app(engine)) as client:
        path = str(tiny_model_dir)
        assert client.post("/update_weights_from_disk", json={"path": path, "version": 5}).status_code == 200
        r = client.post("/update_weights_from_disk", json={"path": path, "version": 4})
        assert r.status_code == 409 and r.json()["error"]["param"] == "version"
        assert client.post("/update_weights_from_disk", json={"path": path, "version": -1}).status_code == 400
        assert client.get("/version").json() == {"version": 5}
        assert client.post("/update_weights_from_disk", json={"path": path, "version": 5}).status_code == 200


def test_serve_takes_limits_from_the_command_line(capsys):
    args = build_parser().parse_args(["m", "--max-body-mb", "1", "--max-n", "4", "--max-queued", "0"])
    assert (args.max_body_mb, args.max_n, args.max_queued) == (1.0, 4, 0)
    assert areno_main(["serve", "m", "--max-body-mb", "nan"]) == 2
    assert areno_main(["serve", "m", "--max-n", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("areno: error: --max-body-mb") and err[1] == "areno: error: --max-n: must be >= 1, got 0"


def test_train_starts_its_rollout_servers_with_a_random_key_on_loopback(tmp_path):
    class Recording:
        roles: list[str] = []

        def create_roles(self, specs):
            self.specs = specs

    tokenizer = build_char_tokenizer()
    model_dir = init_model_dir(tmp_path / "model", tiny_config(len(tokenizer)), tokenizer)  # launch checks its shape
    overrides = [
        f"model.path={model_dir}",
        "cluster.device=cpu",
        "cluster.train_devices=[0]",
        "cluster.rollout_devices=[1]",
    ]
    keys = []
    for run in ("a", "b"):
        scheduler = Recording()
        cluster = PartitionedCluster(load_config(None, overrides), tmp_path / run, scheduler=scheduler)
        cluster.launch(model_dir)
        (rollout,) = [s for s in scheduler.specs if s.role == "rollout"]
        assert rollout.kwargs["api_key"] == cluster.api_key
        keys.append(cluster.api_key)
    assert all(k and len(k) >= 32 for k in keys) and keys[0] != keys[1]
