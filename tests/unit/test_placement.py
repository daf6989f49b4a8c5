"""Backup placement: the rule, its fallbacks, and properties over random topologies."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.placement import Placement, Slot, place


def grid(racks: int, nodes_per_rack: int, per_node: int = 1) -> list[Slot]:
    return [
        Slot(f"m{r}.{n}.{k}", f"node{r}.{n}", f"rack{r}")
        for r in range(racks)
        for n in range(nodes_per_rack)
        for k in range(per_node)
    ]


def racks_of(world: list[Slot], placement: Placement, shard: int) -> set[str]:
    where = {s.member: s.rack for s in world}
    return {where[placement.world[shard]], *(where[h] for h in placement.holders[shard])}


def test_the_rule_on_a_regular_cluster():
    world = grid(racks=2, nodes_per_rack=2)
    placement = place(world, redundancy=2)
    by_member = {s.member: s for s in world}
    for holders, owner in zip(placement.holders, world, strict=True):
        first, second = (by_member[h] for h in holders)
        assert first.rack == owner.rack and first.node != owner.node
        assert second.rack != owner.rack
    assert set(placement.load().values()) == {2}
    assert placement.note == ""


def test_three_holders_spread_over_three_racks():
    world = grid(racks=3, nodes_per_rack=2)
    placement = place(world, redundancy=3)
    assert all(len(racks_of(world, placement, r)) == 3 for r in range(len(world)))


def test_a_single_holder_goes_to_another_rack():
    world = grid(racks=2, nodes_per_rack=2)
    placement = place(world, redundancy=1)
    assert all(len(racks_of(world, placement, r)) == 2 for r in range(len(world)))
    assert placement.note == ""


def test_no_other_node_in_the_rack_is_said():
    world = [Slot("a", "n0", "r0"), Slot("b", "n1", "r1"), Slot("c", "n2", "r1")]
    placement = place(world, redundancy=2)
    assert set(placement.holders[0]) == {"b", "c"}
    assert "shard 0: no other node in rack r0" in placement.note


def test_too_few_members_places_what_it_can_and_says_so():
    world = [Slot("a", "n0", "r0"), Slot("b", "n0", "r0")]
    placement = place(world, redundancy=2)
    assert placement.holders[0] == ("b",)
    assert "holders 1 of 2 wanted" in placement.note
    assert "owner's own node n0" in placement.note


def test_one_rack_is_said():
    placement = place(grid(racks=1, nodes_per_rack=3), redundancy=2)
    assert "one rack only" in placement.note


def test_zero_redundancy_and_bad_input():
    assert all(h == () for h in place(grid(2, 2), 0).holders)
    with pytest.raises(ValueError, match="redundancy"):
        place(grid(2, 2), -1)
    with pytest.raises(ValueError, match="twice"):
        place([Slot("a", "n0", "r0"), Slot("a", "n1", "r1")], 1)


topologies = st.builds(
    lambda racks, nodes, per_node, drop: [
        s for i, s in enumerate(grid(racks, nodes, per_node)) if i not in drop
    ],
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sets(st.integers(0, 47), max_size=10),
).filter(lambda world: len(world) >= 1)


@settings(max_examples=300, deadline=None)
@given(topologies, st.integers(0, 3))
def test_properties_over_random_topologies(world, redundancy):
    placement = place(world, redundancy)
    assert place(world, redundancy) == placement  # deterministic
    assert placement.world == tuple(s.member for s in world)
    check_rule(world, placement, redundancy)


def check_rule(world: list[Slot], placement: Placement, redundancy: int) -> None:
    n = len(world)
    racks = {s.rack for s in world}
    for r, holders in enumerate(placement.holders):
        assert world[r].member not in holders
        assert len(set(holders)) == len(holders)
        assert len(holders) == min(redundancy, n - 1)
        if redundancy >= 1 and len(racks) >= 2 and holders:
            # With two racks or more, no shard has every copy in one rack.
            assert len(racks_of(world, placement, r)) >= 2


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
def test_balanced_on_regular_clusters(racks, nodes, per_node, redundancy):
    """Equal racks: every member holds within one copy of an even share."""
    world = grid(racks, nodes, per_node)
    loads = [place(world, redundancy).load().get(s.member, 0) for s in world]
    even = sum(loads) / len(world)
    assert max(loads) <= math.ceil(even) + 1
    assert min(loads) >= math.floor(even) - 1


def test_a_small_rack_concentrates_copies_and_that_is_visible_in_the_load():
    """Rack diversity wins over balance: the only member of a small rack holds many copies."""
    world = [Slot("lonely", "n0", "r0"), *grid(1, 3, 2)]
    world = [Slot(s.member, s.node, "big") if s.member != "lonely" else s for s in world]
    placement = place(world, redundancy=1)
    assert placement.load()["lonely"] == 6


def test_a_replacement_takes_over_the_copies_of_whom_it_replaces():
    world = grid(racks=2, nodes_per_rack=3)
    before = place(world, redundancy=2)
    gone = world[1]
    spare = Slot("spare", "node0.9", gone.rack)
    after_world = [spare if s == gone else s for s in world]
    previous = dict(zip(before.world, before.holders, strict=True))
    after = place(after_world, 2, previous, {gone.member: spare.member})
    renamed = [tuple(spare.member if h == gone.member else h for h in hs) for hs in before.holders]
    assert list(after.holders) == renamed  # nothing moved but the renamed copies
    check_rule(after_world, after, 2)


def test_a_shrink_moves_only_the_copies_the_lost_member_held():
    world = grid(racks=3, nodes_per_rack=3)
    before = place(world, redundancy=2)
    gone = world[4].member
    after_world = [s for s in world if s.member != gone]
    previous = dict(zip(before.world, before.holders, strict=True))
    after = place(after_world, 2, previous)
    check_rule(after_world, after, 2)
    for slot, holders in zip(after_world, after.holders, strict=True):
        old = previous[slot.member]
        if gone not in old:
            assert holders == old
        else:
            assert set(old) - {gone} <= set(holders)


def test_copies_that_became_invalid_are_placed_again():
    world = [Slot("a", "n0", "r0"), Slot("b", "n1", "r0"), Slot("c", "n2", "r1")]
    # "a" kept both copies in its own rack before: one must move to the other rack.
    after = place(world, 2, {"a": ["b", "x-gone"], "b": ["a", "b"], "c": ["c"]})
    check_rule(world, after, 2)
    assert after.holders[0] == ("b", "c")


@settings(max_examples=200, deadline=None)
@given(topologies, st.integers(1, 3), st.data())
def test_incremental_placement_keeps_the_rule(world, redundancy, data):
    before = place(world, redundancy)
    previous = dict(zip(before.world, before.holders, strict=True))
    drop = data.draw(st.sets(st.sampled_from([s.member for s in world]), max_size=len(world) - 1))
    survivors = [s for s in world if s.member not in drop]
    after = place(survivors, redundancy, previous)
    assert place(survivors, redundancy, previous) == after
    check_rule(survivors, after, redundancy)
    for slot, holders in zip(survivors, after.holders, strict=True):
        kept = [h for h in previous[slot.member] if h not in drop]
        if len(kept) == len(previous[slot.member]) and len(holders) == len(kept):
            assert holders == tuple(kept)  # an untouched shard keeps its copies
