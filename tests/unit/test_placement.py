"""Backup placement: the rule, its fallbacks, and properties over random topologies."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.placement import Placement, Slot, place, silent_nodes
from schemas.common import JobState
from tests.factories import T0
from tests.scenario import Scenario


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


# --------------------------------------------------------------------------- replacements
# Issue 21, scenario 3: the replacement spare must not sit on the node that just died. A node's
# liveness is judged as a whole: once a member is found silent by its heartbeat timeout, the
# other members of its node that are silent past 3 heartbeat intervals (a live member never
# is) are taken as gone too, and no member of that node replaces anyone.


def silent_node_job(*, spare_on_dead_node_beats: bool = False, rack0_spare: bool = False):
    """Generation 1 on w00 (node-0-0), w01 (node-0-1), w10, w11 (rack1); spare0 waits on
    node-0-1, beside w01; spare1 in rack1 (and, with ``rack0_spare``, spare2 on a node of its
    own in rack0). Everyone beats at t=1, with backups at steps 10 and 20; then node-0-1 goes
    silent (unless ``spare_on_dead_node_beats``: then only w01's process hangs) and the
    decider runs every second until it decides."""
    s = Scenario("job1", world_size=4, min_world=2)
    s.cluster(2, 2)
    s.join("spare0", "node-0-1", "rack0", role="spare")
    s.join("spare1", "spare-node-1", "rack1", role="spare")
    if rack0_spare:
        s.join("spare2", "spare-node-2", "rack0", role="spare")
    spares = ["spare0", "spare1", "spare2"] if rack0_spare else ["spare0", "spare1"]
    s.decide()
    s.at(1)
    s.heartbeat("w00", "w01", "w10", "w11")
    s.heartbeat(*spares, phase="waiting")
    for step in (10, 20):
        s.step(step)
        s.backup(step)
    s.step(23)
    silent = {"w01"} if spare_on_dead_node_beats else {"w01", "spare0"}
    t = 2.0
    while True:
        s.at(t)
        s.heartbeat(*(m for m in ("w00", "w10", "w11") if m not in silent))
        s.heartbeat(*(m for m in spares if m not in silent), phase="waiting")
        decided = s.decide()
        if decided:
            return s, decided
        assert t < 10, "nothing decided"
        t += 0.5


def _realloc(decided):
    [payload] = [d.payload for d in decided if d.type == "reallocation.issued"]
    return payload


def test_the_replacement_spare_is_not_on_the_node_that_just_died():
    """spare0 (waiting, 10 s timeout) still looks alive when w01 (train, 5 s) times out on
    the same silent node: before, it took w01's rank and timed out 5 s later (a second
    decision brought spare1). Now spare1 replaces w01 at once and the reason says why."""
    s, decided = silent_node_job()
    assert s.now == T0 + timedelta(seconds=6.5)  # w01 silent 5.5 s > 5 s in train
    [detected] = [d.payload for d in decided if d.type == "fault.detected"]
    assert (detected.members, detected.reason) == (["w01"], "heartbeat_timeout")
    realloc = _realloc(decided)
    assert realloc.world == ["w00", "spare1", "w10", "w11"]
    expected = (
        "replace w01 with spare1; node node-0-1 is silent: w01 timed out, spare0 silent 5.5s"
        " (no replacement from it, no restore from its silent members); restore step 20"
    )
    assert realloc.reason == expected
    [changed] = [
        d.payload
        for d in decided
        if d.type == "job.state_changed" and d.payload.to is JobState.REALLOCATING
    ]
    assert changed.reason == expected
    # Shard 1 (w01's) is held by w00 (rack0) and w11 (spare1's rack): the same-rack holder.
    assert realloc.plan == ["w00", "w11", "w10", "w11"]
    # The world recovers; spare0's own timeout, later, is no fault of the world.
    s.at(7)
    s.recover()
    assert [d.type for d in s.decide()] == ["incident.resolved", "job.state_changed"]
    for t in range(8, 15):
        s.at(t)
        s.heartbeat(*(m for m in s.v.world))
        assert s.decide() == [], f"decided at t={t}"
    [incident] = s.v.incidents.values()
    assert len(incident.decisions) == 1


def test_a_node_whose_spare_keeps_beating_is_alive_and_its_spare_still_replaces():
    """Only w01's process hung: spare0 on the same node beats on, so the node is alive and
    the same-rack spare takes the rank, as before."""
    _, decided = silent_node_job(spare_on_dead_node_beats=True)
    realloc = _realloc(decided)
    assert realloc.world == ["w00", "spare0", "w10", "w11"]
    assert realloc.reason == "replace w01 with spare0; restore step 20"


def test_after_the_silent_node_the_same_rack_is_preferred():
    _, decided = silent_node_job(rack0_spare=True)
    realloc = _realloc(decided)
    assert realloc.world == ["w00", "spare2", "w10", "w11"]
    assert realloc.reason.startswith("replace w01 with spare2; node node-0-1 is silent")


def test_a_silent_member_of_the_dead_node_serves_no_restore():
    """node-a holds w00 (train) and w01 (backup phase: 15 s timeout). It goes silent after
    t=1 and w10 is killed at t=6.5, when w00 times out. w10's shard is held by w11 (rack1) and
    w01 (rack0, like w10's replacement spare1): before, the restore fetched it from w01, a
    silent process; now from w11."""
    s = Scenario("job1", world_size=5, min_world=2)
    for name, node, rack in [("w00", "node-a", "rack0"), ("w01", "node-a", "rack0"),
                             ("w02", "node-b", "rack0"), ("w10", "node-c", "rack1"),
                             ("w11", "node-d", "rack1")]:  # fmt: skip
        s.join(name, node, rack)
    s.join("spare0", "spare-node-0", "rack0", role="spare")
    s.join("spare1", "spare-node-1", "rack0", role="spare")
    s.decide()
    assert s.v.placement[3] == ("w11", "w01")  # w10's shard
    s.at(1)
    s.heartbeat("w00", "w02", "w10", "w11")
    s.heartbeat("w01", phase="backup")
    s.heartbeat("spare0", "spare1", phase="waiting")
    for step in (10, 20):
        s.step(step)
        s.backup(step)
    for t in range(2, 7):
        s.at(t)
        s.heartbeat("w02", "w10", "w11")
        s.heartbeat("spare0", "spare1", phase="waiting")
        assert s.decide() == []
    s.at(6.5)
    s.exited("w10")
    realloc = _realloc(s.decide())
    assert realloc.world == ["spare0", "w01", "w02", "spare1", "w11"]
    assert realloc.reason == (
        "replace w00 with spare0; replace w10 with spare1; node node-a is silent: w00 timed"
        " out, w01 silent 5.5s (no replacement from it, no restore from its silent members);"
        " restore step 20"
    )
    assert realloc.plan[3] == "w11"
    assert "w01" not in realloc.plan  # not even its own shard: it comes from a holder


def test_silent_nodes_judges_a_node_by_all_of_its_members():
    s, _ = silent_node_job()
    members, heartbeats = s.v.members, s.v.heartbeats
    # At t=6.5: w01 was found silent; spare0 (node-0-1) has not beaten for 5.5 s.
    found = silent_nodes(members, ["w01"], s.now, bound_s=3.0, heartbeats=heartbeats)
    assert list(found) == ["node-0-1"]
    assert found["node-0-1"].found == ("w01",)
    assert found["node-0-1"].silent == (("spare0", 5.5),)
    # A bound longer than spare0's silence: the node is not taken as gone.
    assert silent_nodes(members, ["w01"], s.now, bound_s=6.0, heartbeats=heartbeats) == {}
    # Nobody found silent: nothing is judged.
    assert silent_nodes(members, [], s.now, bound_s=3.0, heartbeats=heartbeats) == {}
    # w00's node has no other member.
    assert silent_nodes(members, ["w00"], s.now, bound_s=0.1, heartbeats=heartbeats) == {}
