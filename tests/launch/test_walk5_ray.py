"""RayScheduler (audit walk5, C3/C9): worker output lands in ``log_dir/<role>-<index>.log`` like the
other schedulers' (named when a worker dies); an unreachable address's message keeps whole words;
the install hint is doctor's."""

from __future__ import annotations

import pytest

from areno.launch.ray_scheduler import first_line
from areno.observe.doctor import INSTALL_HINTS


def test_first_line_is_whole_or_cut_between_words():
    assert first_line("failed to connect; last error: Connection refused\nmore") == (
        "failed to connect; last error: Connection refused"
    )
    long = "Failed to connect to remote host: " + "Connection refused " * 30
    cut = first_line(long, limit=120)
    assert cut.endswith(" ...") and len(cut) <= 124
    assert long.startswith(cut.removesuffix(" ...") + " ")  # ends at a word's end
    assert first_line("") == ""


def test_ray_hint_is_the_extra_doctor_names(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    from areno.launch.ray_scheduler import import_ray
    from areno.launch.scheduler import SchedulerError

    with pytest.raises(SchedulerError, match=r"pip install 'areno\[ray\]' or use cluster.scheduler=local$"):
        import_ray()
    assert INSTALL_HINTS["ray"] == "pip install 'areno[ray]'"


def test_a_refused_address_keeps_the_whole_reason():
    pytest.importorskip("ray")
    from areno.launch.ray_scheduler import check_ray_address
    from areno.launch.scheduler import SchedulerError, free_port

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(SchedulerError) as info:
        check_ray_address(address, 2.0)
    message = str(info.value)
    assert message.startswith(f"Ray address '{address}' does not answer (UNAVAILABLE: ")
    assert message.endswith(
        ": Failed to connect to remote host: Connection refused; within 2s); start the cluster (`ray start --head`) "
        "or fix cluster.scheduler_options.ray_address"
    )  # cut at 120 characters before: "...remote host: Connecti within 10s"
    assert "\n" not in message


@pytest.mark.slow
def test_worker_output_goes_to_the_log_dir_and_a_death_names_it(tmp_path):
    pytest.importorskip("ray")
    from areno.launch.ray_scheduler import RayScheduler
    from areno.launch.scheduler import WorkerDiedError

    with RayScheduler(cpus_per_worker=0.5, num_cpus=2, log_dir=str(tmp_path / "workers")) as sched:
        (handle,) = sched.create_workers("actor", "tests.helpers.launch_workers:GradWorker", 1, args=(1,))
        log = tmp_path / "workers" / "actor-0.log"
        assert handle.log_path == str(log)
        sched.call("actor", print, "hello from the actor", flush=True)
        assert "hello from the actor" in log.read_text()
        with pytest.raises(
            WorkerDiedError, match=rf"actor\[0\] \(pid {handle.pid} on .*\) died during crash .*; log: {log}$"
        ):
            sched.submit_one("actor", 0, "crash").result(timeout=120)
