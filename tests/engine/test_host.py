"""engine/host.py: a CPU run's malloc keeps freed memory, so a large allocation after a larger
block was freed does not page-fault in fresh (measured in a subprocess: the setting is process-wide);
``cluster.gc_freeze`` exempts what a run's first step left alive from later collections, and its end
gives it back."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.engine.host import HeapFreezer, _glibc, thaw_heap
from tests.helpers.configs import tiny_grpo_overrides

needs_glibc = pytest.mark.skipif(_glibc() is None, reason="the malloc settings are glibc's")

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


@needs_glibc
def test_cpu_run_reuses_freed_memory_without_page_faults():
    assert _faults_of_second_allocation("cpu", keep=True) < PAGES // 8
    assert _faults_of_second_allocation("cpu", keep=False) > PAGES // 2  # unmapped at free, faulted in again


@needs_glibc
def test_cuda_run_leaves_malloc_as_it_is():
    assert _faults_of_second_allocation("cuda", keep=True) > PAGES // 2


@pytest.fixture
def unfrozen():
    """An earlier test's engine, never shut down, may have left this process frozen."""
    thaw_heap()
    assert gc.get_freeze_count() == 0


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_heap_freezer_freezes_once_and_thaws(unfrozen):
    before = _Cycle()
    freezer = HeapFreezer(True)
    try:
        freezer.after_step()
        frozen = gc.get_freeze_count()
        assert frozen > 0 and freezer.frozen
        after = _Cycle()
        freezer.after_step()  # once only: the later cycle stays with the collector
        assert gc.get_freeze_count() <= frozen  # not frozen again (refcounting may free frozen objects)
        assert not any(o is before for o in gc.get_objects())  # frozen: out of the collector's lists
        assert any(o is after for o in gc.get_objects())
    finally:
        freezer.thaw()
    assert gc.get_freeze_count() == 0 and not freezer.frozen
    assert any(o is before for o in gc.get_objects())
    off = HeapFreezer(False)
    off.after_step()
    assert gc.get_freeze_count() == 0 and not off.frozen


@pytest.mark.parametrize("enabled", [True, False])
def test_a_run_freezes_the_heap_after_its_first_step_and_thaws_it_at_shutdown(tmp_path, enabled, unfrozen):
    cfg = load_config(None, [*tiny_grpo_overrides(tmp_path), "train.steps=2", f"cluster.gc_freeze={enabled}"])
    trainer = Trainer.init(cfg)
    try:
        assert gc.get_freeze_count() == 0
        trainer.run()
        assert (gc.get_freeze_count() > 0) == enabled
    finally:
        trainer.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_new_run_thaws_a_heap_an_earlier_run_left_frozen(tmp_path, unfrozen):
    """A run that raised before its shutdown left the heap frozen: the next run's start gives its
    reference cycles back to the collector (a notebook's next run needs that memory)."""
    HeapFreezer(True).after_step()
    assert gc.get_freeze_count() > 0
    trainer = Trainer.init(load_config(None, [*tiny_grpo_overrides(tmp_path), "train.steps=1"]))
    try:
        assert gc.get_freeze_count() == 0
    finally:
        trainer.shutdown()


def test_a_run_leaves_a_freeze_of_other_code_alone(tmp_path, unfrozen):
    gc.freeze()  # the user's own, before any run
    try:
        frozen = gc.get_freeze_count()
        trainer = Trainer.init(load_config(None, [*tiny_grpo_overrides(tmp_path), "train.steps=2"]))
        try:
            trainer.run()
            # still frozen (refcounting freed a few), and not by this run: nothing was added
            assert frozen // 2 < gc.get_freeze_count() <= frozen
        finally:
            trainer.shutdown()
        assert frozen // 2 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
