"""areno doctor reports versions, devices and optional parts, and survives missing packages."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from areno.observe import doctor


def test_doctor_prints_versions_devices_and_optional_parts(capsys):
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    for section in ("versions:", "devices:", "optional:"):
        assert section in out
    assert f"torch  {torch.__version__}".replace("  ", " ") in " ".join(out.split())
    for name in ("transformers", "areno", "cuda", "nccl", "ray", "tensorboard", "wandb", "flex_attention"):
        assert f"  {name} " in out


def test_doctor_survives_missing_optional_packages(monkeypatch, capsys):
    for module in (
        "ray",
        "wandb",
        "torch.utils.tensorboard",
        "torch.nn.attention.flex_attention",
        "triton",
        "math_verify",
    ):
        monkeypatch.setitem(sys.modules, module, None)  # import -> ImportError
    assert doctor.main(["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    optional = {c["name"]: c for c in result["optional"]}
    for name in ("ray", "wandb", "tensorboard", "flex_attention", "triton"):
        assert optional[name]["ok"] is False
        assert optional[name]["detail"].startswith("not installed")
    assert "pip install 'areno[ray]'" in optional["ray"]["detail"]
    assert optional["gloo"]["ok"] is True
    versions = {c["name"]: c for c in result["versions"]}
    assert versions["math-verify"]["ok"] is False
    assert versions["torch"] == {"name": "torch", "ok": True, "detail": torch.__version__}


def test_doctor_reports_a_broken_package_instead_of_crashing(monkeypatch):
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("corrupt install")

    monkeypatch.setitem(sys.modules, "ray", Broken())
    (ray,) = [c for c in doctor.optional_parts() if c.name == "ray"]
    assert not ray.ok and ray.detail == "broken: RuntimeError: corrupt install"


def test_require_gates_on_checks(capsys):
    assert doctor.main(["--require", "gloo"]) == 0
    expected = 0 if torch.cuda.is_available() else 1
    assert doctor.main(["--require", "cuda,gloo"]) == expected
    with pytest.raises(ValueError, match="unknown check"):
        doctor.main(["--require", "quantum"])


def test_an_unknown_required_check_is_told_before_any_check_runs(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "run_checks", lambda: pytest.fail("the checks ran before --require was checked"))
    with pytest.raises(
        ValueError, match=r"^--require: unknown check\(s\) cdua \(did you mean cuda\?\), quantum; choose"
    ):
        doctor.main(["--require", "cdua,quantum"])
    assert capsys.readouterr().out == ""


def test_the_check_names_are_those_the_checks_report():
    assert sorted(doctor.check_names()) == sorted(c.name for cs in doctor.run_checks().values() for c in cs)
