"""Mesh-aware placement (issue 23): copies leave the replica, the node and the rack they
protect; and properties over random meshes and failure sets, decider included."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.decide import decide
from controlplane.core.fold import fold
from controlplane.core.mesh import Layout, full_layout, layout
from controlplane.core.placement import Placement, Slot, place
from schemas.common import ReallocationMode, RestoreFrom
from schemas.events import Mesh
from tests.scenario import Scenario


def topology(size: int, per_node: int, nodes_per_rack: int) -> list[Slot]:
    """``size`` members, ``per_node`` per node, ``nodes_per_rack`` nodes per rack."""
    return [
        Slot(f"m{i}", f"n{i // per_node}", f"r{i // per_node // nodes_per_rack}")
        for i in range(size)
    ]


def check_mesh_rule(
    world: Sequence[Slot], placement: Placement, redundancy: int, replicas: Sequence[int]
) -> None:
    """Copies outside the owner's replica and node whenever such members exist; one in the
    owner's rack and one in another rack when the topology allows."""
    n = len(world)
    index = {s.member: i for i, s in enumerate(world)}
    several = len(set(replicas)) > 1
    for r, holders in enumerate(placement.holders):
        owner = world[r]
        at = [index[h] for h in holders]
        assert owner.member not in holders
        assert len(set(holders)) == len(holders) == min(redundancy, n - 1)

        def valid(i: int, r: int = r, owner: Slot = owner) -> bool:
            return world[i].node != owner.node and (not several or replicas[i] != replicas[r])

        candidates = [i for i in range(n) if i != r and valid(i)]
        # Never in the owner's replica or on its node while members outside both remain.
        assert sum(1 for i in at if valid(i)) == min(redundancy, len(candidates))
        if redundancy >= 1 and any(world[i].rack != owner.rack for i in candidates):
            assert any(world[i].rack != owner.rack and valid(i) for i in at), (r, holders)
        if redundancy >= 2 and any(world[i].rack == owner.rack for i in candidates):
            assert any(world[i].rack == owner.rack and valid(i) for i in at), (r, holders)


def covered(world: Sequence[Slot], placement: Placement, failed: set[int]) -> bool:
    """Every shard keeps a copy (its owner's or a holder's) outside ``failed``."""
    names = {i: s.member for i, s in enumerate(world)}
    lost = {names[i] for i in failed}
    return all(
        r not in failed or any(h not in lost for h in holders)
        for r, holders in enumerate(placement.holders)
    )


# --------------------------------------------------------------------------- examples


def test_the_rule_on_the_benchmark_layout():
    """dp=8 x tp=8 x pp=2 (128 ranks), 8 per node, 16 nodes per rack: each rack holds two
    replicas; every copy outside its replica and node, one in its rack, one in another."""
    mesh = Mesh(dims=[("dp", 8), ("tp", 8), ("pp", 2)], node_local=["tp"])
    lay = full_layout(mesh)
    slots = topology(lay.size, 8, 4)
    world = lay.arrange([s.member for s in slots])
    by_name = {s.member: s for s in slots}
    ordered = [by_name[m] for m in world]
    replicas = lay.replica_ids()
    placement = place(ordered, 2, replicas=replicas)
    assert placement.note == ""
    check_mesh_rule(ordered, placement, 2, replicas)
    loads = placement.load()
    assert max(loads.values()) <= 3 and min(loads.values()) >= 1
    # Losing any whole replica, node or rack leaves a copy of every shard.
    for q in range(lay.replicas):
        assert covered(ordered, placement, {r for r in range(lay.size) if replicas[r] == q})
    for node in {s.node for s in ordered}:
        assert covered(ordered, placement, {i for i, s in enumerate(ordered) if s.node == node})
    for rack in {s.rack for s in ordered}:
        assert covered(ordered, placement, {i for i, s in enumerate(ordered) if s.rack == rack})


def test_a_replica_that_fills_its_rack_sends_the_same_rack_copy_elsewhere_and_says_so():
    # One replica per rack: no member of the own rack is outside the replica.
    lay = full_layout(Mesh(dims=[("dp", 2), ("tp", 2)]))
    world = [
        Slot("a", "n0", "r0"),
        Slot("b", "n1", "r0"),
        Slot("c", "n2", "r1"),
        Slot("d", "n3", "r1"),
    ]
    placement = place(world, 2, replicas=lay.replica_ids())
    assert set(placement.holders[0]) == {"c", "d"}
    assert "no other node outside its replica in rack r0" in placement.note


def test_one_replica_places_as_a_flat_world():
    world = topology(4, 1, 2)
    assert place(world, 2, replicas=[0, 0, 0, 0]) == place(world, 2)


def test_inside_the_replica_only_when_nothing_else_is_left():
    # Two replicas of three; only one member outside replica 0, and it is on no other node.
    world = [
        Slot("a", "n0", "r0"),
        Slot("b", "n1", "r0"),
        Slot("c", "n2", "r0"),
        Slot("x", "n3", "r0"),
    ]
    placement = place(world, 2, replicas=[0, 0, 0, 1])
    assert placement.holders[0][0] == "x"
    assert len(placement.holders[0]) == 2
    assert "a copy inside its own replica" in placement.note


def test_a_survivor_that_moved_replica_has_its_copies_checked_again():
    lay = full_layout(Mesh(dims=[("dp", 3), ("tp", 2)]))
    slots = topology(6, 1, 2)
    placement = place(slots, 2, replicas=lay.replica_ids())
    # Rank 0 (m0) failed; m2 (replica 1) takes its rank in replica 0 and replica 1 is dropped.
    new = lay.with_replicas(2)
    world = [Slot("m2", "n2", "r1"), slots[1], slots[4], slots[5]]
    previous = dict(zip([s.member for s in slots], placement.holders, strict=True))
    again = place(world, 2, previous=previous, substitute={"m0": "m2"}, replicas=new.replica_ids())
    check_mesh_rule(world, again, 2, new.replica_ids())


# --------------------------------------------------------------------------- properties

dim_names = st.sampled_from(
    [("dp", "tp"), ("pp", "dp", "tp"), ("dp_replicate", "dp_shard", "tp"), ("pp", "tp")]
)


@st.composite
def meshes(draw: Any) -> Mesh:
    names = draw(dim_names)
    degrees = [draw(st.integers(1, 3)) for _ in names]
    local = draw(st.sampled_from([[], ["tp"]]))
    return Mesh(dims=list(zip(names, degrees, strict=True)), node_local=local)


@st.composite
def placed_meshes(draw: Any) -> tuple[Layout, list[Slot], list[int], int]:
    mesh = draw(meshes())
    lay = full_layout(mesh)
    slots = topology(lay.size, draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    if draw(st.booleans()):
        by_name = {s.member: s for s in slots}
        ordered = [by_name[m] for m in lay.arrange([s.member for s in slots])]
    else:
        ordered = draw(st.permutations(slots))
    return lay, ordered, lay.replica_ids(), draw(st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(placed_meshes())
def test_properties_over_random_meshes(case):
    _, world, replicas, redundancy = case
    placement = place(world, redundancy, replicas=replicas)
    assert place(world, redundancy, replicas=replicas) == placement  # deterministic
    check_mesh_rule(world, placement, redundancy, replicas)
    if redundancy == 0:
        return
    n = len(world)
    several = len(set(replicas)) > 1

    def outside(r: int, i: int) -> bool:
        """Off ``r``'s node and (with several replicas) outside its replica."""
        return world[i].node != world[r].node and (not several or replicas[i] != replicas[r])

    # Losing a whole replica, node or rack leaves a copy of every shard that had members
    # to go to outside it (the topology allows).
    groups = [
        *({i for i in range(n) if replicas[i] == q} for q in set(replicas)),
        *({i for i in range(n) if world[i].node == node} for node in {s.node for s in world}),
        *({i for i in range(n) if world[i].rack == rack} for rack in {s.rack for s in world}),
    ]
    names = [s.member for s in world]
    for failed in groups:
        for r in failed:
            if any(outside(r, i) and i not in failed for i in range(n)):
                holders = placement.holders[r]
                assert any(names.index(h) not in failed for h in holders), (r, failed)


@settings(max_examples=200, deadline=None)
@given(placed_meshes(), st.data())
def test_incremental_placement_after_a_shrink_keeps_the_rule(case, data):
    lay, world, replicas, redundancy = case
    if lay.replicas < 2:
        return
    placement = place(world, redundancy, replicas=replicas)
    dropped = data.draw(st.integers(0, lay.replicas - 1))
    new = lay.with_replicas(lay.replicas - 1)
    dense: list[int | None] = []
    n = 0
    for q in range(lay.replicas):
        dense.append(None if q == dropped else n)
        n += q != dropped
    moved = lay.remap(new, dense)
    out: list[Slot | None] = [None] * new.size
    for r, target in enumerate(moved):
        if target is not None:
            out[target] = world[r]
    shrunk = [s for s in out if s is not None]
    assert len(shrunk) == new.size
    previous = dict(zip([s.member for s in world], placement.holders, strict=True))
    again = place(shrunk, redundancy, previous=previous, replicas=new.replica_ids())
    check_mesh_rule(shrunk, again, redundancy, new.replica_ids())
    # Copies on members that stayed valid stayed where they were.
    for r, holders in enumerate(again.holders):
        before = [h for h in previous[shrunk[r].member] if h in {s.member for s in shrunk}]
        if len(before) == redundancy:
            assert set(holders) == set(before)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 4),
    st.integers(1, 3),
    st.sampled_from([(4, 2), (2, 4), (8, 1)]),
    st.integers(1, 3),
)
def test_balanced_on_regular_clusters(racks, nodes, shape, redundancy):
    """Equal racks: every member holds within two copies of an even share."""
    _, tp = shape
    size = racks * nodes * 4
    if size % tp:
        return
    lay = full_layout(Mesh(dims=[("dp", size // tp), ("tp", tp)], node_local=["tp"]))
    slots = topology(size, 4, nodes)
    by_name = {s.member: s for s in slots}
    world = [by_name[m] for m in lay.arrange([s.member for s in slots])]
    loads = [
        place(world, redundancy, replicas=lay.replica_ids()).load().get(s.member, 0) for s in world
    ]
    even = sum(loads) / len(world)
    assert max(loads) <= math.ceil(even) + 2
    assert min(loads) >= math.floor(even) - 2


# --------------------------------------------------------------------------- the decider


@st.composite
def failing_jobs(draw: Any) -> tuple[Mesh, int, int, list[int], int, int]:
    mesh = draw(meshes())
    per_node = draw(st.integers(1, 3))
    nodes_per_rack = draw(st.integers(1, 3))
    spares = draw(st.integers(0, 2))
    how = draw(st.sampled_from(["ranks", "replica", "node"]))
    if how == "ranks":
        failed = sorted(draw(st.sets(st.integers(0, mesh.size - 1), min_size=1, max_size=3)))
    else:
        failed = [-1 - draw(st.integers(0, mesh.size - 1))]  # the replica/node of that rank
        failed.append(0 if how == "replica" else 1)
    min_world = draw(st.integers(1, mesh.replicas))
    return mesh, per_node, nodes_per_rack, failed, spares, min_world


@settings(max_examples=150, deadline=None)
@given(failing_jobs())
def test_decisions_over_random_meshes_and_failure_sets(case):
    mesh, per_node, nodes_per_rack, failed, spares, min_world = case
    s = Scenario("job1", world_size=mesh.size, max_world=mesh.size, min_world=min_world, mesh=mesh)
    for i, slot in enumerate(topology(mesh.size, per_node, nodes_per_rack)):
        s.join(f"w{i}", slot.node, slot.rack)
    for i in range(spares):
        s.join(f"spare{i}", f"spare-node-{i}", f"r{i}", role="spare")
    s.start_and_train()
    lay = layout(mesh, len(s.v.world))
    assert lay is not None
    before = s.v.world
    whole = failed[0] < 0
    if whole:  # every rank of one replica (or one node)
        rank, node = -1 - failed[0], failed[1]
        replica_ids = lay.replica_ids()
        if node:
            where = s.v.members[before[rank]].node
            failed = [r for r, m in enumerate(before) if s.v.members[m].node == where]
        else:
            failed = [r for r in range(len(before)) if replica_ids[r] == replica_ids[rank]]
        whole = len(failed) < len(before)
    # The rule met everywhere and a complete backup: losing a whole replica or node keeps a
    # copy of every shard.
    rule_met = s.v.placement_note == "" and s.v.last_complete_backup is not None
    victims = [before[r] for r in failed]
    s.at(2)
    for m in victims:
        s.exited(m)
    view = s.v
    decided = decide(view, s.now, s.context)
    assert decide(view, s.now, s.context) == decided  # deterministic
    assert decide(fold(None, s.log), s.now, s.context) == decided  # and from the log
    issued = [d.payload for d in decided if d.type == "reallocation.issued"]
    if not issued:
        # It could not go on: every copy of some shard was lost (it stops), or no spare can
        # take a lost rank and no replica can be dropped (it says so and waits).
        stopped = [d.payload.reason for d in decided if d.type == "job.stopped"]
        if stopped:
            assert "no complete copy of the state survives" in stopped[0]
            assert not (whole and rule_met), "a whole replica or node lost, yet no copy survives"
        else:
            why = [d.payload.reason for d in decided if d.type == "job.state_changed"][-1]
            assert why.startswith("cannot shrink"), why
        return
    [realloc] = issued
    world = realloc.world
    assert len(world) % lay.replica_size == 0 and len(world) // lay.replica_size >= min_world
    assert not set(world) & set(victims)
    assert not set(world) & set(realloc.demoted)
    assert set(realloc.demoted) <= set(before) - set(victims)
    if realloc.mode is ReallocationMode.REPLACE:
        # Each lost rank's coordinate taken, every other rank where it was.
        assert len(world) == len(before)
        assert all(world[r] == m for r, m in enumerate(before) if m not in victims)
    if realloc.restore_from is not RestoreFrom.MEMORY:
        # Only when no backup was ever complete (a world too small for its redundancy).
        assert realloc.restore_from is RestoreFrom.INITIAL and view.last_complete_backup is None
        return
    assert realloc.restore_step == 20 or not (whole and rule_met)
    backup = s.v.backups[realloc.restore_step]
    for shard, source in enumerate(realloc.plan):
        copy = backup.shards[shard]
        assert source not in victims
        assert source == copy.owner or source in copy.replicas
