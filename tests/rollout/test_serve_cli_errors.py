"""``areno serve``'s mistakes are one line on stderr (``areno: error: ...``, exit 2) naming the flag and
the fix, found before the model loads: a device this host lacks, a port out of range or taken, a
default ``max_tokens`` of 0, a tokenizer that does not load. A good command serves on the socket it
bound first and exits 0 when stopped."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn

from areno.cli import main as areno_main
from areno.errors import ModelDirError
from areno.launch.scheduler import free_port
from areno.rollout import server as server_module


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if ``areno serve`` starts loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(server_module, "build_engine", refuse)


def _serve_error(capsys, *argv: str) -> str:
    assert areno_main(["serve", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("areno: error: ")
    return captured.err


def test_device_is_a_choice_of_what_serve_supports(capsys):
    with pytest.raises(SystemExit) as exc:
        areno_main(["serve", "/nonexistent/model", "--device", "tpu"])
    assert exc.value.code == 2
    assert "invalid choice: 'tpu' (choose from auto, cpu, cuda, cuda:N)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys, no_model_load, tiny_model_dir):
    err = _serve_error(capsys, str(tiny_model_dir), "--device", "cuda")
    assert "--device cuda: this torch sees no CUDA device" in err and "pass --device cpu" in err
    err = _serve_error(capsys, str(tiny_model_dir), "--device", "cuda:1")
    assert "--device cuda:1: this torch sees no CUDA device" in err


def test_another_gpu_is_chosen_with_cuda_visible_devices(capsys, no_model_load, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    err = _serve_error(capsys, str(tiny_model_dir), "--device", "cuda:1")
    assert "--device cuda:1: serve on that GPU with CUDA_VISIBLE_DEVICES=1 areno serve ... --device cuda" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "--port: must be in 1-65535 (0: any free port), got 99999"),
        (["--port", "-1"], "--port: must be in 1-65535"),
        (["--default-max-tokens", "0"], "--default-max-tokens: must be >= 1, got 0"),
        (["--max-n", "0"], "--max-n: must be >= 1, got 0"),
        (["--max-queued", "-1"], "--max-queued: must be >= 0, got -1"),
    ],
)
def test_bad_values_are_refused_before_the_model_loads(capsys, no_model_load, tiny_model_dir, argv, message):
    assert message in _serve_error(capsys, str(tiny_model_dir), *argv)


def test_a_taken_port_is_named_before_the_model_loads(capsys, no_model_load, tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _serve_error(capsys, str(tiny_model_dir), "--port", str(port))
    assert f"cannot listen on --host 127.0.0.1 --port {port} (Address already in use)" in err
    assert "pick another --port" in err


def test_a_tokenizer_that_does_not_load_is_named_before_the_weights(capsys, tmp_path, tiny_model_dir, monkeypatch):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model_dir / "tokenizer.json").write_text("{not json")

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(server_module, "load_model", no_weights)
    err = _serve_error(capsys, str(model_dir), "--port", "0")
    assert f"the tokenizer in {model_dir} does not load" in err and "copy the model's tokenizer files" in err


@contextlib.contextmanager
def _serving(monkeypatch, argv: list[str]) -> Iterator[tuple[list[uvicorn.Server], threading.Thread]]:
    """``areno <argv>`` (a serve) in a thread; its uvicorn servers recorded as they are made; stopped on
    exit, which it must answer with exit code 0."""
    servers: list[uvicorn.Server] = []
    init = uvicorn.Server.__init__

    def recording_init(self, config):
        init(self, config)
        servers.append(self)

    monkeypatch.setattr(uvicorn.Server, "__init__", recording_init)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(areno_main(argv)), daemon=True)
    thread.start()
    try:
        yield servers, thread
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(timeout=30)
    assert result == [0]


def test_serves_on_the_socket_it_bound_and_exits_0_when_stopped(monkeypatch, tiny_model_dir):
    port = free_port()
    argv = ["serve", str(tiny_model_dir), "--port", str(port), "--device", "cpu", "--default-max-tokens", "3"]
    argv += ["--max-model-len", "64", "--block-size", "8"]
    base = f"http://127.0.0.1:{port}"
    with _serving(monkeypatch, argv) as (servers, thread):
        deadline = time.monotonic() + 60
        while not (servers and servers[0].started):
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        body = {"model": tiny_model_dir.name, "prompt": "hi", "temperature": 0, "ignore_eos": True}
        choice = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()["choices"][0]
        assert len(choice["token_ids"]) == 3  # --default-max-tokens


def test_a_missing_model_dir_names_the_argument(capsys, tmp_path):
    err = _serve_error(capsys, str(tmp_path / "nope"))
    assert "MODEL_DIR: directory" in err and "does not exist: point it at a local Hugging Face checkpoint" in err


def _run_with_checkpoint(tmp_path, tiny_model_dir, *, complete: bool = True):
    """``run/checkpoints/step_00000002`` holding the tiny model as its ``hf/`` export and a LoRA adapter."""
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    shutil.copytree(tiny_model_dir, step / "hf")
    (step / "policy" / "adapter").mkdir(parents=True)
    (step / "policy" / "adapter" / "adapter_config.json").write_text("{}")
    if complete:
        (step / "COMPLETE").write_text("{}")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 2}\n')
    return tmp_path / "run", step


def test_a_checkpoint_is_served_from_its_export_and_a_run_dir_names_the_checkpoint(tmp_path, tiny_model_dir):
    run, step = _run_with_checkpoint(tmp_path, tiny_model_dir)
    for given in (step, step / "hf", f"{step}/"):
        assert server_module.serve_model_dir(str(given)) == str(step / "hf"), given
    assert server_module.serve_model_dir(str(tiny_model_dir)) == str(tiny_model_dir)
    with pytest.raises(ModelDirError, match=rf"MODEL_DIR {run} is a run directory, not a model: .*areno serve {step}$"):
        server_module.serve_model_dir(str(run))
    with pytest.raises(ModelDirError, match=rf"is a run directory, .*areno serve {step}$"):
        server_module.serve_model_dir(str(run / "checkpoints"))
    adapter = step / "policy" / "adapter"
    with pytest.raises(
        ModelDirError, match=rf"{adapter} is a LoRA adapter of checkpoint {step}, .*areno serve {step}$"
    ):
        server_module.serve_model_dir(str(adapter))
    (step / "COMPLETE").unlink()
    with pytest.raises(ModelDirError, match=r"MODEL_DIR: .*step_00000002 is incomplete \(no COMPLETE marker\)"):
        server_module.serve_model_dir(str(step))
    with pytest.raises(ModelDirError, match="is a run directory without a complete checkpoint"):
        server_module.serve_model_dir(str(run))


def test_a_run_dir_is_one_line_naming_the_checkpoint_to_serve(capsys, no_model_load, tmp_path, tiny_model_dir):
    run, step = _run_with_checkpoint(tmp_path, tiny_model_dir)
    err = _serve_error(capsys, str(run))
    assert f"MODEL_DIR {run} is a run directory, not a model" in err and f"areno serve {step}" in err


def test_a_checkpoint_served_by_its_step_logs_when_it_is_ready(monkeypatch, caplog, tmp_path, tiny_model_dir):
    """``areno serve run/checkpoints/step_N`` serves its hf/ export as ``step_N``; the start-up is
    logged when the server listens, not at the first request (which would time the client)."""
    from areno.observe import startup

    _, step = _run_with_checkpoint(tmp_path, tiny_model_dir)
    monkeypatch.setattr(startup, "_first_token_s", None)  # this process's first token is yet to come
    port = free_port()
    argv = ["serve", str(step), "--port", str(port), "--device", "cpu", "--max-model-len", "64", "--block-size", "8"]
    with caplog.at_level(logging.INFO), _serving(monkeypatch, argv) as (servers, thread):
        deadline = time.monotonic() + 60
        ready: list[str] = []
        while not ready:  # logged once the server listens
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
            ready = [r.getMessage() for r in caplog.records if "ready to serve after" in r.getMessage()]
        assert servers[0].started and len(ready) == 1 and "from the process start" in ready[0], ready
        base = f"http://127.0.0.1:{port}"
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["step_00000002"]
        body = {"model": "step_00000002", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
    assert startup.startup_to_first_token_s() is not None  # the engine generated its first token...
    assert not [r for r in caplog.records if "first generated token" in r.getMessage()]  # ...not logged as start-up
    assert not logging.getLogger("areno.observe.startup").filters  # the process's other runs log it again


def test_a_checkpoint_export_is_served_by_its_step():
    assert server_module.served_name("/runs/x/checkpoints/step_00000120/hf/") == "step_00000120"
    assert server_module.served_name("/models/qwen2.5-0.5b") == "qwen2.5-0.5b"
    assert server_module.served_name("/models/hf") == "hf"
