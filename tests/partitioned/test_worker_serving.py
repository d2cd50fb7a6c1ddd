"""Where the rollout workers of a partitioned run listen, and what the controller dials."""

from __future__ import annotations

import socket

import pytest

from areno.api.config import load_config
from areno.engine.partitioned import advertised_address, bind_host
from areno.rollout.server import check_bind


@pytest.mark.parametrize("scheduler, host", [("local", "127.0.0.1"), ("ray", "0.0.0.0"), ("slurm", "0.0.0.0")])
def test_bind_host_follows_the_scheduler(scheduler, host):
    cfg = load_config(
        None,
        ["model.path=/m", f"cluster.scheduler={scheduler}", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]"],
    )
    assert bind_host(cfg) == host


def test_all_interfaces_need_a_key_and_advertise_a_routable_address(monkeypatch):
    with pytest.raises(ValueError, match="api"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "k" * 32)
    assert advertised_address("127.0.0.1") == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    address = advertised_address("0.0.0.0")
    socket.inet_aton(address)  # a dotted IPv4 address the controller can dial
    assert address != "0.0.0.0"
