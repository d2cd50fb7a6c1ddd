"""A parameter that never received a gradient has no optimizer state: resume must still load."""

from __future__ import annotations

import torch

from areno.train import checkpoint


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)  # like a critic's lm_head: in the model, never in the loss


def _trained(seed: int) -> tuple[_TwoHeads, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model.used(torch.randn(3, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def test_resume_with_a_parameter_that_never_had_a_gradient_continues_like_the_uninterrupted_run(tmp_path):
    model, optimizer = _trained(0)
    assert not optimizer.state[model.unused.weight]  # the situation: no state for this parameter
    checkpoint.save(tmp_path / "ckpt", model, optimizer, {"step": 2})

    fresh = _TwoHeads()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert checkpoint.load(tmp_path / "ckpt", fresh, fresh_optimizer) == {"step": 2}

    torch.manual_seed(1)
    x = torch.randn(3, 4)
    for m, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        m.used(x).pow(2).mean().backward()
        opt.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_a_one_process_checkpoint_saves_and_loads_without_dcps_single_process_warning(tmp_path, recwarn):
    """DCP warns at every save and load without a process group; a one-process run (the demo) is
    exactly that, so the note is left out (other warnings still show)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    checkpoint.save(tmp_path / "ckpt", model, optimizer, {"step": 1})
    fresh = torch.nn.Linear(3, 2)
    assert checkpoint.load(tmp_path / "ckpt", fresh, torch.optim.AdamW(fresh.parameters()))["step"] == 1
    assert torch.equal(fresh.weight, model.weight)
    assert not [w for w in recwarn if "assuming the intent is to" in str(w.message)]


def test_a_rank_writes_its_checkpoint_into_several_files_that_the_manifest_hashes_apart(tmp_path, monkeypatch):
    """walk37: one file per rank was hashed on one thread after the write (17 s a save for a one-GPU 1.5B
    run); a rank now writes up to WRITE_THREADS files, in parallel, and the checkpoint loads the same."""
    import json
    import os

    model, optimizer = _trained(0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    tmp = checkpoint.staging_dir(tmp_path / "ckpt")
    checkpoint.save(tmp, model, optimizer, {"step": 2})
    checkpoint.commit(tmp, tmp_path / "ckpt")
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("*.distcp"))
    assert len(shards) == checkpoint.WRITE_THREADS, shards
    manifest = json.loads((tmp_path / "ckpt" / "MANIFEST.json").read_text())["files"]
    assert set(shards) <= set(manifest) and checkpoint.verify(tmp_path / "ckpt") is None
    fresh = _TwoHeads()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert checkpoint.load(tmp_path / "ckpt", fresh, fresh_optimizer) == {"step": 2}
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_a_writer_thread_that_fails_fails_the_save(tmp_path, monkeypatch):
    """walk38: torch's multi-threaded FileSystemWriter loses a worker thread's error (its items are left
    out of the metadata): the save returned, the manifest hashed what was there, and only the resume failed.
    The save checks the metadata against its plan and the files, and raises an OSError (a disk failure to
    the engine: one line naming the checkpoint and where resume=auto goes on from)."""
    import errno
    import os
    import threading

    import pytest
    from torch.distributed.checkpoint.filesystem import FileSystem

    from areno.engine.api import save_failure
    from areno.errors import RunFailure

    model, optimizer = _trained(0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    real = FileSystem.create_stream

    def full_disk_off_the_main_thread(self, path, mode):
        if mode == "wb" and str(path).endswith(".distcp") and threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", full_disk_off_the_main_thread)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's own traceback
    tmp = checkpoint.staging_dir(tmp_path / "ckpt")
    with pytest.raises(OSError, match=r"the checkpoint write left out \d+ of \d+ items .*a writer thread failed") as e:
        checkpoint.save(tmp, model, optimizer, {"step": 2})
    failure = save_failure(e.value, tmp_path / "ckpt")
    assert isinstance(failure, RunFailure) and "saving checkpoint" in str(failure)


def test_torch_saves_own_report_of_a_full_disk_is_the_disk_failure_line(tmp_path):
    """``torch.save``'s zip writer (under a DCP write) and safetensors (the export) report a full disk as
    errors of their own: the same one line naming the checkpoint as an OSError gets."""
    from areno.engine.api import save_failure
    from areno.errors import RunFailure

    for message in (
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598",
        "PytorchStreamWriter failed writing file data/0: file write failed",
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
    ):
        wrapped = ValueError("a DCP writer failed")
        wrapped.__cause__ = RuntimeError(message)
        failure = save_failure(wrapped, tmp_path / "ckpt")
        assert isinstance(failure, RunFailure), message
        assert f"saving checkpoint {tmp_path / 'ckpt'} failed" in str(failure) and "free space on" in str(failure)
    other = RuntimeError("CUDA error: an illegal memory access")
    assert save_failure(other, tmp_path / "ckpt") is other
