import pytest

from areno.launch.allocation import AllocationModeError, Component, check_supported, map_roles, parse_allocation_mode


@pytest.mark.parametrize(
    "source, groups",
    [
        ("areno[rollout]:d2+fsdp[actor]:d2", [[("areno", "rollout", 2, 1, 1)], [("fsdp", "actor", 2, 1, 1)]]),
        ("areno:d1t2|fsdp:d2", [[("areno", "rollout", 1, 2, 1), ("fsdp", "actor", 2, 1, 1)]]),
        ("areno[rollout]:d4t2+fsdp[actor]:d8", [[("areno", "rollout", 4, 2, 1)], [("fsdp", "actor", 8, 1, 1)]]),
        ("sglang[rollout]:d48+fsdp[actor]:d16", [[("sglang", "rollout", 48, 1, 1)], [("fsdp", "actor", 16, 1, 1)]]),
        ("vllm:t2p2d2 + megatron[actor]:p2d4", [[("vllm", "rollout", 2, 2, 2)], [("megatron", "actor", 4, 1, 2)]]),
        ("fsdp:d2", [[("fsdp", "actor", 2, 1, 1)]]),
        ("areno:p1d2 | fsdp[critic]:d2", [[("areno", "rollout", 2, 1, 1), ("fsdp", "critic", 2, 1, 1)]]),
    ],
)
def test_valid(source, groups):
    alloc = parse_allocation_mode(source)
    got = [[(c.backend, c.role, c.dp, c.tp, c.pp) for c in g] for g in alloc.groups]
    assert got == groups
    assert parse_allocation_mode(str(alloc)).groups == alloc.groups  # str() round-trips


@pytest.mark.parametrize(
    "source, column, words",
    [
        ("areno:d2+", 10, "unexpected end"),
        ("areno[x:d2", 8, "expected ']'"),
        ("areno:d0", 7, "must be >= 1"),
        ("areno:p2", 7, "reserved: backend 'areno'"),
        ("fsdp:d2p2", 8, "reserved: backend 'fsdp'"),
        ("foo:d2", 1, "unknown backend 'foo'"),
        ("areno:d2d2", 9, "given twice"),
        ("areno d2", 7, "expected ':' or '['"),
        ("areno:x2", 7, "a dimension such as d2"),
        ("areno:d2 ++fsdp:d1", 11, "unexpected '+'"),
        ("areno:d2t2|fsdp:d2", 12, "same world size: areno[rollout]:d2t2 has 4, fsdp[actor]:d2 has 2"),
        ("fsdp:d2+fsdp:d2", 9, "role 'actor' appears twice"),
    ],
)
def test_invalid_points_at_column(source, column, words):
    with pytest.raises(AllocationModeError) as info:
        parse_allocation_mode(source)
    msg = str(info.value)
    first, echoed, caret = msg.split("\n")
    assert first.startswith(f"invalid allocation_mode at column {column}:")
    assert words in first
    assert echoed == "  " + source
    assert caret == "  " + " " * (column - 1) + "^"


def test_empty_is_an_error():
    with pytest.raises(AllocationModeError, match="empty"):
        parse_allocation_mode("  ")


def test_device_lists_disaggregated_and_colocated():
    alloc = parse_allocation_mode("areno[rollout]:d4t2+fsdp[actor]:d8")
    assert alloc.world_size == 16
    assert alloc.device_lists(16) == {"rollout": list(range(8)), "actor": list(range(8, 16))}
    assert alloc.train_rollout_devices(16) == (list(range(8, 16)), list(range(8)))
    assert not alloc.colocated

    col = parse_allocation_mode("areno:d1t2|fsdp:d2")
    assert col.world_size == 2
    assert col.device_lists(4) == {"rollout": [0, 1], "actor": [0, 1]}
    assert col.train_rollout_devices(2) == ([0, 1], [0, 1])
    assert col.colocated

    three = parse_allocation_mode("areno[rollout]:d2+areno[test-rollout]:d1+fsdp:d1t2|fsdp[ref]:d2")
    assert three.device_lists(5) == {"rollout": [0, 1], "test-rollout": [2], "actor": [3, 4], "ref": [3, 4]}
    assert three.train_rollout_devices(5) == ([3, 4], [0, 1])


def test_more_devices_than_exist_names_both_numbers():
    alloc = parse_allocation_mode("areno[rollout]:d4t2+fsdp[actor]:d8")
    with pytest.raises(AllocationModeError, match="needs 16 devices but only 8 are available"):
        alloc.device_lists(8)


def test_train_rollout_devices_needs_both_kinds():
    with pytest.raises(AllocationModeError, match="must name a train backend"):
        parse_allocation_mode("areno:d2").train_rollout_devices(2)


def test_map_roles_aliases_and_sharing():
    alloc = parse_allocation_mode("areno[rollout]:d2+fsdp[actor]:d2+fsdp[critic]:d1")
    placed = map_roles(alloc, ["policy", "value", "reference"])
    assert placed["policy"] == Component(backend="fsdp", role="actor", dp=2)
    assert placed["value"].role == "critic"
    assert placed["reference"] is placed["policy"]  # unplaced roles share the policy's devices

    direct = parse_allocation_mode("areno:d1|fsdp[policy]:d1")
    assert map_roles(direct, ["policy"])["policy"].role == "policy"


def test_map_roles_errors():
    with pytest.raises(AllocationModeError, match="role 'critic' .* is not a role of the recipe"):
        map_roles(parse_allocation_mode("fsdp:d1+fsdp[critic]:d1"), ["policy"])
    with pytest.raises(AllocationModeError, match="no train backend"):
        map_roles(parse_allocation_mode("areno:d2"), ["policy"])
    with pytest.raises(AllocationModeError, match="recipe role 'reference' is not placed"):
        map_roles(parse_allocation_mode("fsdp[critic]:d1"), ["value", "reference"])


def test_a_role_placed_twice_or_an_idle_inference_role_is_refused():
    """walk23: `fsdp[actor]` beside `fsdp[policy]` (one role, once by its alias) trained the policy over both
    components' devices, and an inference role other than rollout (`areno[gen]`) reserved devices nothing used."""
    with pytest.raises(AllocationModeError, match=r"role 'policy' placed twice \(fsdp\[actor\]:d1 and fsdp\[policy\]"):
        map_roles(parse_allocation_mode("areno:d1+fsdp[actor]:d1+fsdp[policy]:d1"), ["policy"])
    with pytest.raises(AllocationModeError, match=r"areno\[gen\]:d1: the inference role 'gen' .* write areno:d1$"):
        check_supported(parse_allocation_mode("areno:d1+areno[gen]:d1+fsdp:d1"))
    check_supported(parse_allocation_mode("areno[rollout]:d1+fsdp:d1"))
