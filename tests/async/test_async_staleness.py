import pytest

from areno.engine.staleness import StalenessManager


def test_capacity_formula_hand_computed():
    # eta=2, bs=4, max_concurrent=10: at version 0 room for (2+0+1)*4 = 12, but concurrency caps at 10.
    sm = StalenessManager(max_head_offpolicyness=2, batch_size=4, max_concurrent=10)
    assert sm.capacity() == 10
    for _ in range(7):
        sm.on_submit()
    assert sm.capacity() == min(10 - 7, 12 - 7) == 3
    for _ in range(5):
        sm.on_accept()
    # running 2, accepted 5: min(10-2, 12-(5+2)) = 5
    assert sm.capacity() == 5
    sm.set_version(1)
    # (2+1+1)*4 - 7 = 9; 10 - 2 = 8
    assert sm.capacity() == 8
    sm.on_reject()  # running 1
    assert sm.capacity() == min(9, 16 - 6) == 9
    sm.on_drop_accepted()  # accepted 4
    assert sm.snapshot() == {"version": 1, "running": 1, "accepted": 4, "rejected": 1, "capacity": min(9, 16 - 5)}


def test_eta_zero_is_synchronous():
    sm = StalenessManager(max_head_offpolicyness=0, batch_size=3, max_concurrent=100)
    admitted = 0
    while sm.try_submit():
        admitted += 1
    assert admitted == 3  # exactly one batch per version
    for _ in range(3):
        sm.on_accept()
    assert sm.capacity() == 0  # still version 0: nothing more until the weights update
    sm.set_version(1)
    assert sm.capacity() == 3


def test_validation_and_version_monotonic():
    with pytest.raises(ValueError, match="max_head_offpolicyness"):
        StalenessManager(max_head_offpolicyness=-1, batch_size=1, max_concurrent=1)
    with pytest.raises(ValueError, match="batch_size"):
        StalenessManager(max_head_offpolicyness=0, batch_size=0, max_concurrent=1)
    sm = StalenessManager(max_head_offpolicyness=0, batch_size=1, max_concurrent=1)
    sm.set_version(3)
    with pytest.raises(ValueError, match="backwards"):
        sm.set_version(2)
