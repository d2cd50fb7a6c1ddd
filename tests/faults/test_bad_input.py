"""Bad input: malformed dataset rows fail in one line naming the file before any model loads;
malformed HTTP requests get a 4xx naming the field while other requests keep being served; a
corrupted checkpoint gives a named error (or is skipped), never a silent partial load."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from areno.api.config import load_config
from areno.errors import ModelDirError
from areno.types import SamplingParams
from tests.helpers.serving import serving

# ------------------------------------------------------------------------------------- datasets
ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def _trainer_init(tmp_path: Path, train_path: Path, eval_path: Path | None = None):
    """Trainer.init with a model directory that does not exist: any model load would fail with a
    model.path error, so the data error proves the data is checked first."""
    from areno.api.trainer import Trainer

    overrides = [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'no-model'}",
        "model.init_tiny=null",
        "data.task=null",
        f"data.train_path={train_path}",
        "cluster.device=cpu",
        "observe.console=false",
    ]
    if eval_path is not None:
        overrides.append(f"data.eval_path={eval_path}")
    return Trainer.init(load_config(None, overrides))


@pytest.mark.parametrize(
    "lines, pattern",
    [
        ([json.dumps(ROWS[0]), "{oops", json.dumps(ROWS[1])], r"line 2: not valid JSON"),
        (
            [json.dumps(ROWS[0]), json.dumps({"question": "3+3=", "answer": "6"})],
            r"line 2: no string field 'prompt' \(fields are 'question', 'answer';",
        ),
        (
            [json.dumps(ROWS[0]), json.dumps({"prompt": 123, "answer": "6"})],
            r"line 2: no string field 'prompt' \('prompt' is number, not a string;",
        ),
        (
            [json.dumps(ROWS[0]), json.dumps(["prompt", "answer"])],
            r"line 2: no string field 'prompt' \(the row is a JSON array, not an object;",
        ),
        ([json.dumps({"prompt": None})], r"line 1: no string field 'prompt' \('prompt' is null"),
        ([json.dumps(ROWS[0]), "", "  ", json.dumps({"answer": "6"})], r"line 4: no string field 'prompt'"),
    ],
)
def test_malformed_rows_fail_in_one_line_before_any_model_loads(tmp_path, lines, pattern):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=pattern) as info:
        _trainer_init(tmp_path, path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "model.path" not in message  # the data was checked before the model


def test_missing_field_names_the_fix(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"set data\.prompt_key to the field that holds the prompt"):
        _trainer_init(tmp_path, path)


def test_malformed_eval_file_is_named(tmp_path):
    good, bad = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    bad.write_text(json.dumps(ROWS[0]) + "\n" + "not json at all\n")
    with pytest.raises(ValueError, match=rf"{bad}.*line 2: not valid JSON"):
        _trainer_init(tmp_path, good, bad)


def test_cli_prints_a_bad_dataset_in_one_line(tmp_path, capsys):
    from areno.cli import main

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n{"prompt": \n')
    rc = main(
        [
            "train",
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'no-model'}",
            "data.task=null",
            f"data.train_path={path}",
            "cluster.device=cpu",
            "observe.console=false",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("areno: error: ") and "line 2" in err[0]


# ------------------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from areno.rollout.server import build_engine, create_app

    engine, tokenizer = build_engine(str(tiny_model_dir), device="cpu", num_blocks=256, block_size=8, max_model_len=64)
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny")
    with serving(app) as base:
        yield base, engine


# (path, body or raw bytes, the field the 4xx must name). Cases already in tests/rollout/test_server.py
# (empty prompt, max_tokens 0/-3, prompt too long, bad temperature/top_p, unknown sampling param) are
# not repeated one by one; a few are mixed in below to run concurrently with a good request.
BAD_REQUESTS = [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 100000}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 500, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "no role"}]}, "messages.0.role"),
    ("/generate", {"sampling_params": {}}, "prompt_ids"),
    ("/generate", {"prompt_ids": "abc"}, "prompt_ids"),
    ("/generate", {"prompt_ids": [1.5, 2]}, "prompt_ids.0"),
    ("/generate", {"prompt_ids": [10**6]}, "prompt_ids"),
    ("/generate", {"prompt_ids": [-1, 5]}, "prompt_ids"),
    ("/generate", {"prompt_ids": [5], "sampling_params": {"max_new_tokens": -5}}, "sampling_params"),
    ("/generate", {"prompt_ids": [5], "sampling_params": {"temperature": "x"}}, "sampling_params"),
    ("/generate", {"prompt_ids": [5], "sampling_params": [1, 2]}, "sampling_params"),
    ("/generate", b"{not json", "body"),
    ("/generate", b"[1, 2, 3]", "body"),
    ("/generate", b"", "body"),
]


def _post(client: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize("path, body, field", BAD_REQUESTS, ids=[f"{p}:{f}" for p, _, f in BAD_REQUESTS])
def test_bad_request_is_4xx_naming_the_field(server, path, body, field):
    base, _ = server
    with httpx.Client(base_url=base, timeout=30) as client:
        r = _post(client, path, body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == field, err  # as the request spells it (no union member tag like ``prompt.str``)
    assert field.split(".")[0] in err["message"] or field == "body", err


def test_bad_requests_do_not_disturb_requests_in_flight(server):
    """A long good request runs while every bad request above hits the server concurrently: each
    bad one gets its 4xx, the good one finishes whole, and the server keeps serving afterwards."""
    base, engine = server
    good_body = {
        "prompt_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0.0},
    }
    results: dict[str, object] = {}

    def good() -> None:
        with httpx.Client(base_url=base, timeout=120) as client:
            results["good"] = client.post("/generate", json=good_body)

    thread = threading.Thread(target=good)
    thread.start()
    deadline = time.monotonic() + 30
    while not engine.has_unfinished() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)  # the good request is in the engine
    with httpx.Client(base_url=base, timeout=30) as client:
        codes = [_post(client, path, body).status_code for path, body, _ in BAD_REQUESTS * 2]
    thread.join(timeout=120)
    assert all(400 <= c < 500 for c in codes), codes
    good_response = results["good"]
    assert good_response.status_code == 200, good_response.text
    out = good_response.json()
    assert len(out["output_ids"]) == 40 and out["finish_reason"] == "length"
    with httpx.Client(base_url=base, timeout=30) as client:
        again = client.post("/generate", json=good_body).json()
    assert again["output_ids"] == out["output_ids"]  # greedy: the same answer, the engine is intact


def test_multi_server_client_raises_a_4xx_at_once(server):
    """A bad request is the caller's fault: no fail-over, no server marked unhealthy."""
    from areno.rollout.client import MultiServerRolloutClient, RolloutServerError
    from areno.rollout.health import HealthMonitor

    base, _ = server
    monitor = HealthMonitor([base], max_misses=1)
    client = MultiServerRolloutClient([base], request_timeout_s=30, health=monitor)

    async def go():
        try:
            await client.agenerate([10**6], SamplingParams(max_new_tokens=2))
        finally:
            await client.aclose()

    with pytest.raises(RolloutServerError, match=rf"{base}/generate answered 400: prompt_ids") as info:
        asyncio.run(go())
    assert info.value.status == 400 and monitor.is_healthy(base)


# ------------------------------------------------------------------------------------- checkpoints
def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_missing_shard_is_named(tiny_model_dir, tmp_path):
    """A sharded checkpoint whose index lists a shard that is not there."""
    from areno.models.hf_io import load_model

    model_dir = _copy_model(tiny_model_dir, tmp_path / "m")
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(str(model_dir / "model-00001-of-00002.safetensors"), framework="pt") as f:
        names = list(f.keys())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map[names[-1]] = "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelDirError, match=r"model-00002-of-00002\.safetensors is listed in .* but does not exist"):
        load_model(model_dir)


def test_garbage_complete_checkpoint_is_named(tiny_model_dir, tmp_path):
    """A step directory with a COMPLETE marker but no checkpoint in it (e.g. copied by hand)."""
    from areno.train import LocalTrainBackend, TrainBackendConfig

    backend = LocalTrainBackend(TrainBackendConfig(device="cpu"))
    backend.initialize(tiny_model_dir)
    step = tmp_path / "checkpoints" / "step_00000002"
    (step / "policy").mkdir(parents=True)
    (step / "COMPLETE").write_text("ok")
    (step / "policy" / "junk.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelDirError, match=r"step_00000002/policy is not an areno checkpoint"):
        backend.load_checkpoint(step / "policy")


def _shard(model_dir: Path) -> dict[str, str]:
    """Split ``model.safetensors`` into two shards + ``model.safetensors.index.json`` (HF's layout);
    returns the weight map."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:]), start=1):
        file = f"model-{k:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(model_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


@pytest.mark.parametrize("damage", ["half", "header", "empty", "pickle"])
def test_truncated_safetensors_is_named(tiny_model_dir, tmp_path, damage):
    from areno.models.hf_io import load_model

    model_dir = _copy_model(tiny_model_dir, tmp_path / "m")
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(
        {"half": data[: len(data) // 2], "header": data[:20], "empty": b"", "pickle": b"\x80\x04\x95" + b"\x00" * 64}[
            damage
        ]
    )
    with pytest.raises(ValueError) as info:
        load_model(model_dir)
    message = str(info.value)
    assert message.startswith(f"{path} is truncated or not a safetensors file (") and "\n" not in message
    assert message.endswith("re-export the checkpoint, or point model.path at a complete one"), message


def test_cli_prints_a_truncated_model_in_one_line(tiny_model_dir, tmp_path, capsys):
    from areno.cli import main

    model_dir = _copy_model(tiny_model_dir, tmp_path / "m")
    _truncate(model_dir / "model.safetensors")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    rc = main(
        [
            "train",
            f"run_dir={tmp_path / 'run'}",
            f"model.path={model_dir}",
            "model.init_tiny=null",
            "data.task=null",
            f"data.train_path={data}",
            "cluster.device=cpu",
            "observe.console=false",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"areno: error: {model_dir}/model.safetensors is truncated") and "model.path" in err[0]


def test_truncated_shard_of_a_sharded_checkpoint_is_named(tiny_model_dir, tmp_path):
    from areno.models.hf_io import load_model

    model_dir = _copy_model(tiny_model_dir, tmp_path / "m")
    _shard(model_dir)
    load_model(model_dir)  # the sharded layout itself loads
    _truncate(model_dir / "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match=r"m/model-00002-of-00002\.safetensors is truncated"):
        load_model(model_dir)


@pytest.mark.parametrize("index_text", ["{not json", "[1, 2]", '{"metadata": {}}', '{"weight_map": {}}'])
def test_malformed_index_is_named(tiny_model_dir, tmp_path, index_text):
    from areno.models.hf_io import load_model

    model_dir = _copy_model(tiny_model_dir, tmp_path / "m")
    (model_dir / "model.safetensors.index.json").write_text(index_text)
    pattern = r"m/model\.safetensors\.index\.json (is not a safetensors index|has an empty)"
    with pytest.raises(ValueError, match=pattern) as info:
        load_model(model_dir)
    assert "\n" not in str(info.value) and "re-export the checkpoint" in str(info.value)


# ---- the rollout engine's hot load: rejected as a whole, the old version keeps serving
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine_and_new_weights(tiny_model_dir, tmp_path, char_tokenizer):
    """An engine serving ``tiny_model_dir`` (version 0) and a different checkpoint to load."""
    from areno.models.hf_io import init_model_dir, read_config
    from areno.rollout.server import build_engine

    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    new_dir = init_model_dir(tmp_path / "new", read_config(tiny_model_dir), char_tokenizer, seed=1)
    return engine, new_dir


def _snapshot(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.weight_tensors().items()}


def _assert_unchanged(engine, before: dict, outputs_before) -> None:
    import torch

    assert engine.version == 0
    after = engine.weight_tensors()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # not one tensor was written
    assert engine.generate([[5, 6, 7]], GREEDY)[0].output_ids == outputs_before


@pytest.mark.parametrize("damage", ["truncated", "missing_shard", "tensor_not_in_shard"])
def test_engine_rejects_a_damaged_checkpoint_as_a_whole(engine_and_new_weights, damage):
    from safetensors.torch import load_file, save_file

    from areno.rollout.engine import WeightUpdateError

    engine, new_dir = engine_and_new_weights
    weight_map = _shard(new_dir)
    first, second = new_dir / "model-00001-of-00002.safetensors", new_dir / "model-00002-of-00002.safetensors"
    if damage == "truncated":
        _truncate(second)
        pattern = (
            rf"^weight update rejected: {second} is truncated or not a safetensors file \(.*\): "
            r"this engine keeps serving version 0; re-export the checkpoint$"
        )
    elif damage == "missing_shard":
        second.unlink()
        pattern = (
            rf"^weight update rejected: {second} is listed in {new_dir}/model\.safetensors\.index\.json "
            r"but does not exist: copy the missing shard"
        )
    else:
        tensors = load_file(str(second))
        dropped = sorted(tensors)[0]
        save_file({k: v for k, v in tensors.items() if k != dropped}, str(second))
        pattern = (
            rf"^weight update rejected: tensor '{dropped}' is listed in .*index\.json in "
            rf"{second.name} but that shard does not hold it \(1 such tensors\)"
        )
    assert any(f == first.name for f in weight_map.values())  # the first shard is intact and readable
    before, outputs_before = _snapshot(engine), engine.generate([[5, 6, 7]], GREEDY)[0].output_ids
    with pytest.raises(WeightUpdateError, match=pattern) as info:
        engine.update_weights_from_disk(str(new_dir), version=3)
    assert "\n" not in str(info.value)
    _assert_unchanged(engine, before, outputs_before)


def test_engine_follows_the_index_and_ignores_stray_files(engine_and_new_weights, tmp_path):
    """With an index only the shards it lists are read: a stray file (a leftover of an older
    export, here garbage) is never opened; without the index the same directory is refused."""
    import torch

    from areno.models.hf_io import load_model
    from areno.rollout.engine import WeightUpdateError

    engine, new_dir = engine_and_new_weights
    _shard(new_dir)
    (new_dir / "model-old.safetensors").write_bytes(b"garbage")
    engine.update_weights_from_disk(str(new_dir), version=4)
    reference = load_model(new_dir)[0].state_dict()
    live = engine.weight_tensors()
    assert engine.version == 4 and set(live) <= set(reference)
    assert all(torch.equal(live[k], reference[k]) for k in live)  # every tensor came from the two shards
    (new_dir / "model.safetensors.index.json").unlink()
    with pytest.raises(WeightUpdateError, match=r"model-old\.safetensors is truncated or not a safetensors file"):
        engine.update_weights_from_disk(str(new_dir), version=5)
    assert engine.version == 4 and all(torch.equal(live[k], reference[k]) for k in live)


def test_server_refuses_a_truncated_weight_update(engine_and_new_weights):
    from fastapi.testclient import TestClient

    from areno.rollout.server import create_app

    engine, new_dir = engine_and_new_weights
    _truncate(new_dir / "model.safetensors")
    with TestClient(create_app(engine)) as client:
        r = client.post("/update_weights_from_disk", json={"path": str(new_dir), "version": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "path"
        assert f"{new_dir}/model.safetensors is truncated" in r.json()["error"]["message"]
        assert client.get("/version").json() == {"version": 0}
        out = client.post("/generate", json={"prompt_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
        assert out.status_code == 200 and out.json()["output_versions"] == [0, 0, 0]


# ---- TestRolloutManager: a corrupt checkpoint is reported and skipped, the thread lives on
def _score_workflow():
    from areno.types import Trajectory
    from areno.workflows.base import RolloutWorkflow

    class Score(RolloutWorkflow):
        async def run_episode(self, client, sample):
            out = await client.agenerate([5, 6], SamplingParams(max_new_tokens=2, temperature=0.0))
            return Trajectory(
                prompt_ids=[5, 6],
                completion_ids=out.output_ids,
                logprobs=out.output_logprobs,
                versions=out.output_versions,
                reward=float(out.output_versions[-1]),
            )

    return Score()


def _checkpoint(tiny_model_dir: Path, root: Path, step: int) -> Path:
    hf = _copy_model(tiny_model_dir, root / f"step_{step:08d}" / "hf")
    (root / f"step_{step:08d}" / "COMPLETE").write_text("ok")
    return hf


def test_test_rollout_skips_a_truncated_checkpoint(tiny_model_dir, tmp_path, caplog):
    from areno.engine.test_rollout import TestRolloutManager
    from areno.rollout.client import InProcessRolloutClient
    from areno.rollout.server import build_engine

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        _checkpoint(tiny_model_dir, root, step)
    _truncate(root / "step_00000002" / "hf" / "model.safetensors")
    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    client = InProcessRolloutClient(engine)
    manager = TestRolloutManager(root, engine, client, _score_workflow(), [{"prompt": "x"}])
    try:
        with caplog.at_level(logging.ERROR, logger="areno.engine.test_rollout"):
            assert manager.poll_once() is None  # the newest is corrupt: skipped with a named error
            assert manager.poll_once() is None  # and not retried
        errors = [r.getMessage() for r in caplog.records if r.name == "areno.engine.test_rollout"]
        assert len(errors) == 1 and "\n" not in errors[0], errors
        assert "step 2" in errors[0] and "step_00000002/hf/model.safetensors is truncated" in errors[0]
        assert engine.version == 0 and manager.failed_steps == [2]
    finally:
        manager.stop()
        client.close()


def test_test_rollout_thread_survives_a_truncated_checkpoint(tiny_model_dir, tmp_path):
    """The background thread meets a corrupt checkpoint, reports it, and evaluates the next one."""
    from areno.engine.test_rollout import TestRolloutManager
    from areno.rollout.client import InProcessRolloutClient
    from areno.rollout.server import build_engine

    root = tmp_path / "checkpoints"
    _checkpoint(tiny_model_dir, root, 1)
    _truncate(root / "step_00000001" / "hf" / "model.safetensors")
    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    client = InProcessRolloutClient(engine)
    manager = TestRolloutManager(root, engine, client, _score_workflow(), [{"prompt": "x"}], poll_interval_s=0.02)
    manager.start()
    try:
        deadline = time.monotonic() + 30
        while manager.failed_steps != [1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.failed_steps == [1] and manager._thread.is_alive()
        _checkpoint(tiny_model_dir, root, 2)
        results: list = []
        while not results and time.monotonic() < deadline:
            results = manager.pop_results()
            time.sleep(0.01)
        assert [step for step, _ in results] == [2] and results[0][1]["eval/reward_mean"] == 2.0
        assert engine.version == 2 and manager._thread.is_alive()
    finally:
        manager.stop()
        client.close()


def test_test_rollout_thread_survives_an_evaluation_error(tiny_model_dir, tmp_path, caplog):
    """An error past the load (here the metrics callback raising) is logged with the step; the
    thread keeps polling and evaluates the next checkpoint."""
    from areno.engine.test_rollout import TestRolloutManager
    from areno.rollout.client import InProcessRolloutClient
    from areno.rollout.server import build_engine

    seen: list[int] = []

    def on_metrics(step, metrics):
        seen.append(step)
        if len(seen) == 1:
            raise RuntimeError("metrics sink is down")

    root = tmp_path / "checkpoints"
    _checkpoint(tiny_model_dir, root, 1)
    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    client = InProcessRolloutClient(engine)
    manager = TestRolloutManager(
        root, engine, client, _score_workflow(), [{"prompt": "x"}], poll_interval_s=0.02, on_metrics=on_metrics
    )
    with caplog.at_level(logging.ERROR, logger="areno.engine.test_rollout"):
        manager.start()
        try:
            deadline = time.monotonic() + 30
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
            _checkpoint(tiny_model_dir, root, 2)
            while len(seen) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert seen == [1, 2] and manager._thread.is_alive()
        finally:
            manager.stop()
            client.close()
    assert "evaluating checkpoint step 1 failed" in caplog.text and "metrics sink is down" in caplog.text


def test_truncated_dcp_shard_is_named(tiny_model_dir, tmp_path):
    from areno.train import LocalTrainBackend, TrainBackendConfig

    backend = LocalTrainBackend(TrainBackendConfig(device="cpu"))
    backend.initialize(tiny_model_dir)
    path = tmp_path / "ckpt"
    backend.save_checkpoint(path, extra_state={})
    _truncate(next(path.glob("*.distcp")))
    with pytest.raises((ValueError, OSError), match="ckpt") as info:
        backend.load_checkpoint(path)
    assert "\n" not in str(info.value)
