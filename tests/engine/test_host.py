"""engine/host.py: a CPU run's malloc keeps freed memory, so a large allocation after a larger
block was freed does not page-fault in fresh (measured in a subprocess: the setting is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areno.engine.host import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="the malloc settings are glibc's")

_SCRIPT = """
import resource, sys, torch
from areno.engine.config import ClusterSection
from areno.engine.host import apply_host_settings
apply_host_settings(ClusterSection(cpu_keep_freed_memory=sys.argv[2] == "1"), sys.argv[1])
x = torch.ones(32 << 20)  # 128 MiB, touched: above glibc's largest heap-served block by default
del x
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20)  # 64 MiB: fits in the freed block when it was kept
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


PAGES = (64 << 20) // 4096
"""Pages of the second, 64 MiB allocation."""


def _faults_of_second_allocation(device_type: str, keep: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, device_type, "1" if keep else "0"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout.split()[-1])


def test_cpu_run_reuses_freed_memory_without_page_faults():
    assert _faults_of_second_allocation("cpu", keep=True) < PAGES // 8
    assert _faults_of_second_allocation("cpu", keep=False) > PAGES // 2  # unmapped at free, faulted in again


def test_cuda_run_leaves_malloc_as_it_is():
    assert _faults_of_second_allocation("cuda", keep=True) > PAGES // 2
