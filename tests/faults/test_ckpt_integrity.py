"""A damaged checkpoint is detected at resume: every file's size and sha256 are written into
``MANIFEST.json`` at save and checked before loading; a resume passes over a damaged checkpoint to
the previous intact one with a warning naming the file, and stops with one line (exit 2: data on
disk the user must restore) when none is intact."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from areno.api.config import load_config
from areno.engine.api import prepare_model_dir
from areno.errors import ModelDirError
from areno.train import checkpoint
from tests.helpers.resume import losses, overrides, resumed_step, run_areno, train_rows


def _flip(path: Path, nbytes: int = 4096) -> None:
    """Invert ``nbytes`` bytes in the middle of ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - nbytes // 2)
    for i in range(start, min(len(data), start + nbytes)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _save(root: Path, step: int) -> Path:
    """A committed checkpoint of a small model and its optimizer, as a run publishes it."""
    torch.manual_seed(step)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    final = root / f"step_{step:08d}"
    tmp = checkpoint.staging_dir(final)
    checkpoint.save(tmp / "policy", model, optimizer, {"step": step})
    checkpoint.commit(tmp, final)
    return final


DAMAGES = {
    "flipped shard": lambda p: _flip(p / "policy" / "__0_0.distcp"),
    "truncated .metadata": lambda p: (p / "policy" / ".metadata").write_bytes(
        (p / "policy" / ".metadata").read_bytes()[:10]
    ),
    "empty trainer_state.pt": lambda p: (p / "policy" / "trainer_state.pt").write_bytes(b""),
    "empty rng_rank0.pt": lambda p: (p / "policy" / "rng_rank0.pt").write_bytes(b""),
    "missing shard": lambda p: (p / "policy" / "__0_0.distcp").unlink(),
}
DAMAGED_FILE = {
    "flipped shard": "__0_0.distcp",
    "truncated .metadata": ".metadata",
    "empty trainer_state.pt": "trainer_state.pt",
    "empty rng_rank0.pt": "rng_rank0.pt",
    "missing shard": "__0_0.distcp",
}


def test_manifest_lists_every_file(tmp_path):
    path = _save(tmp_path, 1)
    files = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
    assert {"policy/.metadata", "policy/trainer_state.pt", "policy/rng_rank0.pt", "policy/__0_0.distcp"} <= set(files)
    assert checkpoint.verify(path) is None


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_file_is_named(tmp_path, damage):
    path = _save(tmp_path, 1)
    DAMAGES[damage](path)
    problem = checkpoint.verify(path)
    assert problem is not None and str(path / "policy" / DAMAGED_FILE[damage]) in problem, problem


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_falls_back_to_the_previous_intact_checkpoint(tmp_path, caplog, damage):
    older, newer = _save(tmp_path, 2), _save(tmp_path, 4)
    DAMAGES[damage](newer)
    with caplog.at_level(logging.WARNING, logger="areno.train.checkpoint"):
        assert checkpoint.newest_intact(tmp_path) == older
    assert DAMAGED_FILE[damage] in caplog.text and str(newer) in caplog.text


def test_no_intact_checkpoint_is_one_line_naming_the_file(tmp_path):
    for step in (2, 4):
        _flip(_save(tmp_path, step) / "policy" / "__0_0.distcp")
    with pytest.raises(ModelDirError) as info:
        checkpoint.newest_intact(tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "step_00000004" / "policy" / "__0_0.distcp") in message


def test_checkpoint_without_manifest_is_checked_for_empty_files(tmp_path):
    """Checkpoints written before manifests existed still load; an empty state file is still caught."""
    path = _save(tmp_path, 1)
    (path / checkpoint.MANIFEST).unlink()
    assert checkpoint.verify(path) is None
    (path / "policy" / "trainer_state.pt").write_bytes(b"")
    assert "trainer_state.pt is empty" in checkpoint.verify(path)


def test_checkpoint_without_manifest_with_a_damaged_state_file_is_passed_over(tmp_path, caplog):
    """Without a manifest, the state files (small) are parsed: a resume passes over a damaged one
    before any model loads, and a direct load names it in one line before reading the weights."""
    older, newer = _save(tmp_path, 2), _save(tmp_path, 4)
    for path in (older, newer):
        (path / checkpoint.MANIFEST).unlink()
    state = newer / "policy" / checkpoint.TRAINER_STATE
    state.write_bytes(b"not a torch.save file")
    assert checkpoint.verify(newer) == f"{state} does not load (UnpicklingError: the file is damaged)"
    with caplog.at_level(logging.WARNING, logger="areno.train.checkpoint"):
        assert checkpoint.newest_intact(tmp_path) == older
    assert str(state) in caplog.text


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "rng_rank0.pt"])
def test_a_damaged_state_file_is_one_line_before_the_weights_load(tmp_path, monkeypatch, damaged):
    path = _save(tmp_path, 1) / "policy"
    data = (path / damaged).read_bytes()
    (path / damaged).write_bytes(data[: len(data) // 2])  # truncated: torch's zip reader fails

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read before the state files")

    monkeypatch.setattr(checkpoint, "_dcp_load", no_weights)
    with pytest.raises(ModelDirError) as info:
        checkpoint.load(path, torch.nn.Linear(64, 64), None)
    message = str(info.value)  # torch's error for a truncated zip depends on where it was cut
    assert message.startswith(f"{path / damaged} does not load (") and "\n" not in message
    assert message.endswith(
        ": the file is damaged, or holds more than tensors and plain values); "
        "resume from an earlier step_N directory or delete this one"
    )


def test_incremental_checkpoint_with_a_damaged_base_falls_back(tmp_path, caplog):
    """An incremental checkpoint is intact only with its full base: a damaged base passes over both."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    model.bias.requires_grad_(False)  # a frozen tensor: stored once, in the full checkpoint
    optimizer = torch.optim.AdamW([model.weight])
    older = _save(tmp_path, 1)
    paths, hashes = [], {}
    for step in (2, 3):
        model(torch.randn(2, 64)).sum().backward()
        optimizer.step()
        final = tmp_path / f"step_{step:08d}"
        tmp = checkpoint.staging_dir(final)
        if step == 2:
            hashes = checkpoint.save(tmp / "policy", model, optimizer, {"step": step}, record_hashes=True)
        else:
            checkpoint.save(
                tmp / "policy", model, optimizer, {"step": step}, base=paths[0] / "policy", base_hashes=hashes
            )
        checkpoint.commit(tmp, final)
        paths.append(final)
    assert checkpoint.is_incremental(paths[1] / "policy") and checkpoint.newest_intact(tmp_path) == paths[1]
    _flip(paths[0] / "policy" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING):
        assert checkpoint.newest_intact(tmp_path) == older
    assert "names base checkpoint" in caplog.text and "__0_0.distcp" in caplog.text


# ------------------------------------------------------------------------------ through `areno train`
@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integrity")
    prepare_model_dir(load_config(None, overrides(tmp, tmp / "unused")))
    return tmp


@pytest.mark.slow  # over 10 s: the default suite keeps within its 10 minutes
def test_flipped_shard_resumes_from_the_previous_checkpoint_bit_for_bit(tmp):
    run_dir = tmp / "run"
    ckpts = run_dir / "checkpoints"
    args = overrides(tmp, run_dir, steps=4, save_interval=2)
    first = run_areno(args)
    assert first.returncode == 0, first.stderr[-3000:]
    before = train_rows(run_dir)
    shard = ckpts / "step_00000004" / "policy" / "__0_0.distcp"
    _flip(shard)

    resumed = run_areno(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_step(resumed) == 2  # step 4 is damaged: steps 3 and 4 train again from step 2
    assert str(shard) in resumed.stderr and "damaged" in resumed.stderr
    assert losses(train_rows(run_dir)) == losses(before)
    assert checkpoint.verify(ckpts / "step_00000004") is None  # rewritten whole

    for step in (2, 4):  # nothing intact left: one line, exit 2, naming the newest damaged file
        _flip(ckpts / f"step_{step:08d}" / "policy" / "__0_0.distcp")
    stopped = run_areno(args)
    last = stopped.stderr.strip().splitlines()[-1]
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert last.startswith("areno: error: every checkpoint") and str(shard) in last, last
