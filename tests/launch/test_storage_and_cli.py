import json
import sys

import pytest

from areno.cli import main
from areno.launch.storage import StorageCheckError, check_shared_storage


def test_controller_only_probe_cleans_up(tmp_path):
    check_shared_storage([str(tmp_path / "ckpt"), f"file://{tmp_path / 'data'}"])
    assert (tmp_path / "ckpt").is_dir() and list((tmp_path / "ckpt").iterdir()) == []


def test_unwritable_path_names_node_and_path(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        StorageCheckError, match=r"node '.+' \(controller\) cannot write under '.*/file/ckpt' \(NotADirectoryError"
    ):
        check_shared_storage([str(tmp_path / "file" / "ckpt")])


def test_url_without_fsspec_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(
        StorageCheckError, match=r"'s3://bucket/ckpt' is a URL and needs fsspec .* pip install fsspec s3fs"
    ):
        check_shared_storage(["s3://bucket/ckpt"])


def test_url_with_missing_protocol_package(monkeypatch):
    pytest.importorskip("fsspec")
    import importlib.util

    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed")
    with pytest.raises(StorageCheckError, match=r"storage path 's3://bucket/ckpt': .*s3fs"):
        check_shared_storage(["s3://bucket/ckpt"])


def test_memory_url_roundtrip_in_one_process():
    pytest.importorskip("fsspec")
    check_shared_storage(["memory://bucket/ckpt"])  # one process: the object store is shared


def test_cli(capsys, tmp_path):
    assert main(["launch", "allocation", "areno[rollout]:d2t2+fsdp[actor]:d4", "--devices", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device_lists"] == {"rollout": [0, 1, 2, 3], "actor": [4, 5, 6, 7]} and out["world_size"] == 8
    assert main(["launch", "allocation", "areno:d2+", "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areno: error: cluster.allocation_mode: invalid allocation_mode at column 10")
    assert main(["launch", "allocation", "areno:d2+fsdp:d2", "--devices", "2"]) == 2
    assert "needs 4 devices but only 2 are available" in capsys.readouterr().err
    assert main(["launch", "storage", str(tmp_path / "x")]) == 2  # a typo is not created
    (tmp_path / "x").mkdir()
    assert main(["launch", "storage", str(tmp_path / "x")]) == 0
