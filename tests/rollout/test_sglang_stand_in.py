"""GRPO through ``Trainer`` with ``rollout.backend=sglang`` against stand-in SGLang servers
(``tests/helpers/fake_sglang.py``: areno's engine behind SGLang's native routes; SGLang does not
install on the CPU machine): syncs whose served outputs change, an asynchronous run, and a server
lost mid-step."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.tokenizer import build_char_tokenizer
from areno.launch.scheduler import free_port
from areno.models.hf_io import init_model_dir, tiny_config
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.fake_sglang import fake_sglang_app
from tests.helpers.serving import serving

PROBE = {
    "input_ids": [1, 20, 21, 22],
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
    "return_logprob": True,
}


def _model(tmp_path: Path) -> tuple[Path, int]:
    tok = build_char_tokenizer()
    model = tmp_path / "model"
    init_model_dir(
        model, tiny_config(len(tok), hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64), tok
    )
    return model, tok.eos_token_id


def _probe(url: str) -> list[float]:
    answer = httpx.post(url + "/generate", json=PROBE, timeout=60).json()
    return [t[0] for t in answer["meta_info"]["output_token_logprobs"]]


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("eta", [0, 1])
def test_grpo_through_the_sglang_backend_against_a_stand_in_server(tmp_path, eta):
    """Three steps: each sync goes out as a disk export loaded through SGLang's routes (pause with
    requests retracted, load, flush, continue); the served outputs change with the weights."""
    model, eos = _model(tmp_path)
    app = fake_sglang_app(model, eos)
    with serving(app) as url:
        before = _probe(url)
        cfg = load_config(
            None,
            [
                *tiny_run_overrides(tmp_path, num_eval=0),
                "train.steps=3",
                "optim.lr=0.05",
                "rollout.backend=sglang",
                f"rollout.servers=[{url}]",
                f"rollout.max_head_offpolicyness={eta}",
            ],
        )
        trainer = Trainer.init(cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
        after = _probe(url)
        info = httpx.get(url + "/get_model_info").json()
    steps = [r for r in _rows(tmp_path) if "rollout/healthy_servers" in r]
    assert len(steps) == 3 and all(r["rollout/staleness_max"] <= eta for r in steps), steps
    assert all(r.get("rollout/logprob_abs_diff_max", 0.0) < 1e-4 for r in steps), steps
    assert eta or all("rollout/logprob_abs_diff_max" in r for r in steps)
    assert app.state.engine.version == 3 and info["weight_version"] == "3"
    assert before != after  # the served policy moved with the syncs
    names = [name for name, _ in app.state.calls]
    assert names == ["pause_generation", "update_weights_from_disk", "flush_cache", "continue_generation"] * 3
    assert app.state.calls[0][1] == {"mode": "retract"}
    loads = [body for name, body in app.state.calls if name == "update_weights_from_disk"]
    assert [b["weight_version"] for b in loads] == ["1", "2", "3"] and not any(b["abort_all_requests"] for b in loads)


def _start(model: Path, eos: int, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.fake_sglang", "--model-path", str(model), "--port", str(port),
         "--eos-token-id", str(eos), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"stand-in server exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


@pytest.mark.slow
def test_grpo_through_two_sglang_servers_survives_losing_one_mid_step(tmp_path):
    """Two stand-in servers in processes of their own; the second dies on its sixth request (in
    the second step: each takes about four of a step's eight). Its requests go to the other, it is
    dropped at the next sync, and the run finishes on one server."""
    model, eos = _model(tmp_path)
    servers = [_start(model, eos), _start(model, eos, "--die-after", "6")]
    try:
        for proc, url in servers:
            _wait_ready(proc, url)
        cfg = load_config(
            None,
            [
                *tiny_run_overrides(tmp_path, num_eval=0),
                "train.steps=3",
                "rollout.backend=sglang",
                f"rollout.servers=[{servers[0][1]},{servers[1][1]}]",
            ],
        )
        trainer = Trainer.init(cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
        assert servers[1][0].wait(timeout=10) == 1  # it died
        info = httpx.get(servers[0][1] + "/get_model_info").json()
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait()
    steps = [r for r in _rows(tmp_path) if "rollout/healthy_servers" in r]
    assert len(steps) == 3
    assert all(r["rollout/logprob_abs_diff_max"] < 1e-4 for r in steps), steps  # every sync reached the live one
    assert steps[0]["rollout/lost_servers"] == 0 and steps[-1]["rollout/lost_servers"] == 1
    assert steps[-1]["rollout/healthy_servers"] == 1
    assert info["weight_version"] == "3" and trainer.backend.engine.version == 3
