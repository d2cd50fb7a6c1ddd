"""Security defaults: loopback binding, API-key enforcement on every endpoint, the admin-key rule
beyond loopback, and no arbitrary pickle when loading weights or checkpoints."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from areno.cli import main as areno_main
from areno.errors import ModelDirError
from areno.rollout.server import ADMIN_ENDPOINTS, build_parser, check_bind, create_app, is_loopback

REPO = Path(__file__).resolve().parents[2]
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    from areno.models.hf_io import load_model
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, config = load_model(str(tiny_model_dir), dtype=torch.float32, device="cpu")  # no tokenizer: faster
    engine = RolloutEngine(
        model, config, config=RolloutEngineConfig(num_blocks=64, block_size=8, max_model_len=64), eos_token_ids=(0,)
    )
    return create_app(engine, model_name="tiny", api_key=KEY)


def _routes(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def test_every_endpoint_but_health_needs_the_key(app):
    routes = _routes(app)
    assert {("POST", p) for p in ADMIN_ENDPOINTS} <= set(routes)  # the admin endpoints are all checked
    with TestClient(app) as client:
        for method, path in routes:
            if path == "/health":
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Api-Key": KEY}):
                resp = client.request(method, path, headers=headers, json={})
                assert resp.status_code == 401, (method, path, headers, resp.status_code)
                assert resp.json()["error"]["type"] == "authentication_error"
        assert client.get("/health").status_code == 200


def test_the_key_opens_endpoints_and_admin_works(app):
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:
        assert client.get("/version", headers=auth).status_code == 200
        assert client.post("/pause", headers=auth).json() == {"paused": True}
        assert client.post("/resume", headers=auth).json() == {"paused": False}
        assert client.post("/abort", headers=auth, json={"request_id": "nope"}).status_code == 404


def test_malformed_requests_get_named_400s(app):
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:
        bad_json = client.post("/generate", headers={**auth, "Content-Type": "application/json"}, content=b"{nope")
        assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
        missing = client.post("/generate", headers=auth, json={"sampling_params": {}})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt_ids"
        unknown = client.post("/generate", headers=auth, json={"prompt_ids": [1], "sampling_params": {"bogus": 1}})
        assert unknown.status_code == 400 and "bogus" in unknown.json()["error"]["message"]
        assert client.get("/version", headers=auth).status_code == 200  # still serving


def test_weight_update_from_a_pickle_is_refused_without_running_it(app, tmp_path):
    marker = tmp_path / "pwned"
    payload = tmp_path / "model.safetensors"
    payload.write_bytes(pickle.dumps(_Exploit(str(marker))))
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:
        resp = client.post("/update_weights_from_disk", headers=auth, json={"path": str(payload), "version": 9})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "path"
        assert client.get("/version", headers=auth).json()["version"] != 9
    assert not marker.exists()


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("example.com", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_admin_key_rule_beyond_loopback(monkeypatch, capsys):
    monkeypatch.delenv("ARENO_API_KEY", raising=False)
    assert build_parser().parse_args(["m"]).host == "127.0.0.1"  # loopback by default
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", KEY)
    with pytest.raises(ValueError, match="--host 0.0.0.0 listens beyond loopback.*pass --api-key"):
        check_bind("0.0.0.0", None)
    # the CLI refuses before loading any model (the directory does not even exist)
    assert areno_main(["serve", "/nonexistent/model", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("areno: error: --host 0.0.0.0")
    assert "/update_weights_from_disk" in err and "ARENO_API_KEY" in err


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_checkpoint_with_a_pickle_payload_is_refused(tmp_path):
    from areno.train import checkpoint

    model = torch.nn.Linear(2, 2)
    checkpoint.save(tmp_path / "ckpt", model, None, {"step": 3, "extra": {"data": {"cursor": 5}}})
    assert checkpoint.load(tmp_path / "ckpt", model, None)["step"] == 3  # a real one loads
    marker = tmp_path / "pwned"
    torch.save({"step": 3, "extra": _Exploit(str(marker))}, tmp_path / "ckpt" / checkpoint.TRAINER_STATE)
    with pytest.raises(ModelDirError, match=r"trainer_state\.pt does not load \(UnpicklingError"):
        checkpoint.load(tmp_path / "ckpt", model, None)
    assert not marker.exists()


def _torch_load_calls(source: str) -> list[ast.Call]:
    calls = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            calls.append(node)
    return calls


def test_every_torch_load_in_the_repo_is_weights_only():
    # every Python file of the checkout, listed without git (a source tarball or a `git archive` copy has none),
    # past hidden and scratch directories (virtual environments, caches, /tmp, run outputs)
    skip = {"tmp", "runs", "build", "dist", "__pycache__"}
    files = [
        str(p.relative_to(REPO))
        for p in REPO.rglob("*.py")
        if not any(part.startswith(".") or part in skip for part in p.relative_to(REPO).parts[:-1])
    ]
    offenders, seen = [], 0
    for name in files:
        path = REPO / name
        text = path.read_text() if path.is_file() else ""
        if "torch.load" not in text:
            continue
        for call in _torch_load_calls(text):
            seen += 1
            flag = next((k.value for k in call.keywords if k.arg == "weights_only"), None)
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                offenders.append(f"{name}:{call.lineno}")
    assert seen > 0
    assert offenders == [], f"torch.load without weights_only=True: {offenders}"


def test_serve_reaches_every_engine_setting_and_refuses_bad_ones_before_loading(capsys):
    from areno.rollout.server import engine_settings

    assert engine_settings(["cuda_graphs=false", "decode_steps=4", "cuda_graph_max_batch=null"]) == {
        "cuda_graphs": False,
        "decode_steps": 4,
        "cuda_graph_max_batch": None,
    }
    for pair, message in (
        ("cuda_graphs", "give KEY=VALUE"),
        ("cuda_graph=false", "not a rollout engine setting"),
        ("cuda_grafs=false", r"--engine-set cuda_grafs: not a rollout engine setting \(did you mean 'cuda_graphs'\?\)"),
        ("max_num_seqs=8", "it has a flag of its own: --max-num-seqs"),
        ("decode_steps=abc", "--engine-set decode_steps: Value 'abc' of type 'str' could not be converted to Integer"),
    ):
        with pytest.raises(ValueError, match=message):
            engine_settings([pair])
    # a bad value is the engine config's one-line error, before any model is loaded
    assert areno_main(["serve", "/nonexistent/model", "--engine-set", "decode_steps=-2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "rollout.decode_steps: must be >= 0" in err
