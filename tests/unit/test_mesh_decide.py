"""Mesh-aware decisions (issue 23): replicas, coordinates, demoted survivors, waiting.

A mesh job here runs on racks of nodes with several workers per node (``w<rack><node><k>``),
its policy declaring the mesh; the scenario starts it (generation 1), backs up at steps 10
and 20 with the published placement, and the tests fail members and read the decisions.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from controlplane.api.render import member_out
from controlplane.core.commands import owed
from controlplane.core.decide import Decided, decide, next_deadline
from controlplane.core.fold import fold
from controlplane.core.mesh import Layout, full_layout, layout
from schemas.commands import COMMAND_ADAPTER, Reallocate, Start
from schemas.common import JobState, Phase, ReallocationMode
from schemas.events import JobPolicy, Mesh
from tests.factories import T0
from tests.scenario import Scenario

S = JobState
JOB = "job1"


def mesh_job(
    dims: list[tuple[str, int]],
    *,
    node_local: tuple[str, ...] = (),
    replica_dims: list[str] | None = None,
    racks: int = 2,
    nodes: int = 2,
    per_node: int = 2,
    spares: int = 0,
    min_world: int = 1,
    train: bool = True,
    **policy: Any,
) -> Scenario:
    """A job on ``dims`` with exactly as many workers as the mesh has ranks (racks x nodes x
    per_node), and ``spares`` spares on nodes of their own (rack by rack)."""
    mesh = Mesh(dims=dims, node_local=list(node_local), replica_dims=replica_dims)
    assert racks * nodes * per_node == mesh.size
    s = Scenario(
        JOB, world_size=mesh.size, max_world=mesh.size, min_world=min_world, mesh=mesh, **policy
    )
    for r in range(racks):
        for n in range(nodes):
            for k in range(per_node):
                s.join(f"w{r}{n}{k}", f"node-{r}-{n}", f"rack{r}")
    for i in range(spares):
        s.join(f"spare{i}", f"spare-node-{i}", f"rack{i % racks}", role="spare")
    if train:
        s.start_and_train()
    return s


def only(decided: list[Decided], type_: str) -> Any:
    [payload] = [d.payload for d in decided if d.type == type_]
    return payload


def reasons(decided: list[Decided]) -> list[str]:
    return [d.payload.reason for d in decided if d.type == "job.state_changed"]


def lay_of(s: Scenario) -> Layout:
    found = layout(s.policy.mesh, len(s.v.world))  # type: ignore[arg-type]
    assert found is not None
    return found


def command(s: Scenario) -> Start | Reallocate:
    [cmd] = owed(s.v)
    assert isinstance(cmd, Start | Reallocate)
    # What members receive parses back (the new fields are part of the wire contract).
    parsed = COMMAND_ADAPTER.validate_json(cmd.model_dump_json())
    assert parsed == cmd
    return cmd


def crash(s: Scenario, *members: str, at: float = 2.0) -> list[Decided]:
    s.at(at)
    for m in members:
        s.exited(m)
    return s.decide()


SHAPES = [
    [("dp", 8)],
    [("dp", 4), ("tp", 2)],
    [("pp", 2), ("dp", 2), ("tp", 2)],  # dp in the middle: ranks renumber on a shrink
    [("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)],
]


# --------------------------------------------------------------------------- the layout


def test_rank_and_coordinate_are_row_major_outermost_first():
    lay = full_layout(Mesh(dims=[("pp", 2), ("dp", 3), ("tp", 4)]))
    assert lay.coordinate(0) == (0, 0, 0)
    assert lay.coordinate(1) == (0, 0, 1)  # tp varies fastest
    assert lay.coordinate(4) == (0, 1, 0)
    assert lay.coordinate(12) == (1, 0, 0)
    assert all(lay.rank(lay.coordinate(r)) == r for r in range(lay.size))
    # A replica: one dp coordinate, pp x tp ranks; its places row-major over (pp, tp).
    assert (lay.replicas, lay.replica_size) == (3, 8)
    assert [r for r in range(24) if lay.replica_of(r) == 1] == [4, 5, 6, 7, 16, 17, 18, 19]
    assert all(lay.rank_of(lay.replica_of(r), lay.intra(r)) == r for r in range(24))
    assert lay.replica_ids() == [lay.replica_of(r) for r in range(24)]
    smaller = lay.with_replicas(2)
    assert smaller.as_dict() == {"pp": 2, "dp": 2, "tp": 4}
    dense: list[int | None] = [0, None, 1]
    moved = lay.remap(smaller, dense)
    for r, target in enumerate(moved):
        if lay.replica_of(r) == 1:
            assert target is None
        else:
            assert target is not None
            assert smaller.intra(target) == lay.intra(r)
            assert smaller.replica_of(target) == dense[lay.replica_of(r)]


def test_several_replica_dims_collapse_into_the_outermost_when_shrunk():
    mesh = Mesh(
        dims=[("dp_replicate", 2), ("tp", 2), ("dp", 2)], replica_dims=["dp", "dp_replicate"]
    )
    lay = full_layout(mesh)
    assert (lay.replicas, lay.replica_size) == (4, 2)
    assert mesh.replica_names == ("dp_replicate", "dp")
    three = lay.with_replicas(3)
    assert three.as_dict() == {"dp_replicate": 3, "tp": 2, "dp": 1}
    assert lay.with_replicas(4, lay) is lay
    moved = lay.remap(three, [0, 1, None, 2])
    assert sorted(t for t in moved if t is not None) == list(range(6))


def test_the_policy_refuses_meshes_that_do_not_fit():
    with pytest.raises(ValidationError, match="world_size 6 is not the size of the mesh"):
        JobPolicy(world_size=6, mesh=Mesh(dims=[("dp", 2), ("tp", 2)]))
    with pytest.raises(ValidationError, match="more than max_world"):
        JobPolicy(max_world=2, mesh=Mesh(dims=[("dp", 2), ("tp", 2)]))
    with pytest.raises(ValidationError, match="min_world 3 counts replicas"):
        JobPolicy(min_world=3, mesh=Mesh(dims=[("dp", 2), ("tp", 2)]))
    with pytest.raises(ValidationError, match="twice"):
        Mesh(dims=[("dp", 2), ("dp", 2)])
    with pytest.raises(ValidationError, match="not among the dims"):
        Mesh(dims=[("dp", 2)], node_local=["tp"])
    with pytest.raises(ValidationError, match="more than 65536 ranks"):
        Mesh(dims=[("dp", 65536), ("tp", 2)])
    with pytest.raises(ValidationError):
        Mesh(dims=[("DP", 2)])  # names are lowercase identifiers
    with pytest.raises(ValidationError):
        Mesh(dims=[("dp", 0)])
    with pytest.raises(ValidationError):
        Mesh(dims=[])
    # From a member (JSON), as the first member.joined carries it.
    policy = JobPolicy.model_validate_json(
        '{"max_world": 8, "mesh": {"dims": [["dp", 4], ["tp", 2]], "node_local": ["tp"]}}'
    )
    assert policy.mesh is not None and policy.mesh.replicas == 4
    assert policy.start_world == 8


def test_commands_without_the_new_fields_still_read():
    s = mesh_job([("dp", 4), ("tp", 2)], train=False)
    s.decide()
    raw = command(s).model_dump(mode="json")
    del raw["mesh"]
    parsed = COMMAND_ADAPTER.validate_python(raw, strict=False)
    assert isinstance(parsed, Start) and parsed.mesh is None


# --------------------------------------------------------------------------- start


def test_the_first_world_puts_node_local_groups_on_one_node():
    s = mesh_job([("dp", 2), ("tp", 2), ("pp", 2)], node_local=("tp",), train=False)
    s.decide()
    lay = lay_of(s)
    nodes = {m: s.v.members[m].node for m in s.v.world}
    for r in range(lay.size):
        assert {nodes[s.v.world[p]] for p in lay.local_peers(r)} == {nodes[s.v.world[r]]}
    start = command(s)
    assert start.mesh == {"dp": 2, "tp": 2, "pp": 2}
    assert list(start.mesh) == ["dp", "tp", "pp"]  # in order


def test_a_flat_job_has_no_mesh_in_its_commands():
    s = Scenario(JOB, world_size=2, min_world=1)
    s.join("a", "n0", "r0")
    s.join("b", "n1", "r1")
    s.decide()
    start = command(s)
    assert start.mesh is None


def pending(workers: int, **policy: Any) -> Scenario:
    """A mesh job dp=4 x tp=2 registered at t=0 with only ``workers`` workers joined."""
    mesh = Mesh(dims=[("dp", 4), ("tp", 2)])
    s = Scenario(JOB, world_size=8, max_world=8, mesh=mesh, start_timeout_s=10.0, **policy)
    for i in range(workers):
        s.join(f"w{i}", f"node-{i // 2}", f"rack{i // 4}")
    s.decide()  # registers the job; too few workers to start
    assert s.v.state is S.PENDING
    return s


def test_the_start_timeout_starts_whole_replicas_only():
    s = pending(7, min_world=2)
    s.at(11)
    decided = s.decide()
    started = only(decided, "generation.started")
    assert len(started.world) == 6  # 3 replicas of 2, not 7 ranks
    assert "starting with 3 of the 4 replicas of the mesh dp=4 x tp=2" in reasons(decided)[0]
    assert command(s).mesh == {"dp": 3, "tp": 2}


def test_too_few_whole_replicas_stop_the_start():
    s = pending(7, min_world=4)
    s.at(11)
    stopped = only(s.decide(), "job.stopped")
    assert "3 whole replicas of 2 ranks, fewer than min_world 4 (replicas)" in stopped.reason


# --------------------------------------------------------------------------- replace


@pytest.mark.parametrize("dims", SHAPES)
def test_a_spare_takes_the_exact_coordinate_of_the_lost_rank(dims):
    s = mesh_job(dims, spares=1)
    before = s.v.world
    victim = before[5]
    decided = crash(s, victim)
    realloc = only(decided, "reallocation.issued")
    assert realloc.mode is ReallocationMode.REPLACE
    assert realloc.world == [*before[:5], "spare0", *before[6:]]
    assert realloc.demoted == []
    assert f"at rank 5 ({lay_of(s).describe_rank(5)})" in realloc.reason
    cmd = command(s)
    assert isinstance(cmd, Reallocate)
    assert cmd.mesh == dict(dims) and cmd.demoted == []


def test_a_replacement_goes_to_the_node_of_its_node_local_group():
    # Spares: one on a node of its own, one on the lost rank's node (its tp peer is there).
    s = mesh_job([("dp", 4), ("tp", 2)], node_local=("tp",), spares=1, train=False)
    s.join("spare-local", "node-1-1", "rack1", role="spare")
    s.start_and_train()
    lay = lay_of(s)
    [r] = [r for r, m in enumerate(s.v.world) if m == "w110"]
    peers = [s.v.world[p] for p in lay.local_peers(r) if p != r]
    assert [s.v.members[p].node for p in peers] == ["node-1-1"]
    realloc = only(crash(s, "w110"), "reallocation.issued")
    assert realloc.world[r] == "spare-local"


def test_a_replacement_away_from_its_group_is_said():
    s = mesh_job([("dp", 4), ("tp", 2)], node_local=("tp",), spares=1)
    realloc = only(crash(s, "w110"), "reallocation.issued")
    assert realloc.mode is ReallocationMode.REPLACE
    assert "away from its tp group on node-1-1 (no spare there)" in realloc.reason


# --------------------------------------------------------------------------- shrink


@pytest.mark.parametrize("dims", SHAPES)
def test_a_shrink_drops_the_whole_replica_and_renumbers_densely(dims):
    s = mesh_job(dims)
    lay = lay_of(s)
    before = s.v.world
    victim_rank = 5
    victim = before[victim_rank]
    lost_replica = lay.replica_of(victim_rank)
    decided = crash(s, victim)
    realloc = only(decided, "reallocation.issued")
    assert realloc.mode is ReallocationMode.SHRINK
    new = lay.with_replicas(lay.replicas - 1)
    assert len(realloc.world) == new.size
    # Each kept replica keeps its members at their places; replicas renumbered densely.
    kept = [q for q in range(lay.replicas) if q != lost_replica]
    for dense, q in enumerate(kept):
        for j in range(lay.replica_size):
            assert realloc.world[new.rank_of(dense, j)] == before[lay.rank_of(q, j)]
    survivors = [
        before[lay.rank_of(lost_replica, j)]
        for j in range(lay.replica_size)
        if before[lay.rank_of(lost_replica, j)] != victim
    ]
    assert realloc.demoted == survivors
    assert f"shrink to {lay.replicas - 1} of {lay.replicas} replicas" in realloc.reason
    assert f"their {len(survivors)} other survivors become spares" in realloc.reason
    # The restore plan takes every shard from a survivor that holds it, and the demoted
    # survivors only where no one else holds it.
    backup = s.v.backups[realloc.restore_step]
    for shard, source in enumerate(realloc.plan):
        copy = backup.shards[shard]
        assert source != victim
        assert source == copy.owner or source in copy.replicas
    cmd = command(s)
    assert isinstance(cmd, Reallocate)
    assert cmd.mesh == new.as_dict()
    assert cmd.demoted == survivors
    assert all(m not in cmd.world for m in cmd.demoted)
    # The view: the survivors are warm spares (no rank, active, marked demoted).
    for m in survivors:
        member = s.v.members[m]
        assert member.rank is None and member.demoted_position is not None
        assert member_out(member).demoted  # and the cluster API says so
    # The new generation's placement keeps every shard's copies out of its replica (when
    # there is another replica).
    replica_ids = new.replica_ids()
    index = {m: r for r, m in enumerate(s.v.world)}
    for r, holders in enumerate(s.v.placement):
        assert holders
        if new.replicas > 1:
            assert all(replica_ids[index[h]] != replica_ids[r] for h in holders)


def test_spares_from_a_dropped_replica_are_reused():
    s = mesh_job([("dp", 4), ("tp", 2)])
    realloc = only(crash(s, "w000"), "reallocation.issued")
    [survivor] = realloc.demoted
    s.at(3)
    s.recover()
    s.heartbeat_all()
    assert s.decide() and s.v.state is S.RUNNING
    victim_rank = 3
    victim = s.v.world[victim_rank]
    s.at(4)
    s.heartbeat_all()
    decided = crash(s, victim, at=4.5)
    again = only(decided, "reallocation.issued")
    assert again.mode is ReallocationMode.REPLACE
    assert again.world[victim_rank] == survivor
    assert s.v.members[survivor].rank == victim_rank
    assert s.v.members[survivor].demoted_position is None


def test_a_dropped_replica_fills_the_hole_of_another_in_the_same_decision():
    # Two replicas lose a rank each, no spare: one is dropped, its survivor takes the
    # other's lost rank (3 of 4 replicas go on, not 2).
    s = mesh_job([("dp", 4), ("tp", 2)])
    lay = lay_of(s)
    before = s.v.world
    a, b = before[0], before[2]  # replicas 0 and 1
    assert (lay.replica_of(0), lay.replica_of(2)) == (0, 1)
    realloc = only(crash(s, a, b), "reallocation.issued")
    assert realloc.mode is ReallocationMode.SHRINK
    assert len(realloc.world) == 6
    # Replica 1 (the later of the equally damaged) is dropped; its survivor takes rank 0.
    assert realloc.world[0] == before[3]
    assert realloc.world[1] == before[1]
    assert realloc.demoted == []
    assert f"replace {a} with {before[3]} at rank 0" in realloc.reason


def test_a_replica_that_lost_more_is_dropped_first():
    s = mesh_job([("dp", 2), ("tp", 4)], racks=2, nodes=2, per_node=2, spares=1)
    before = s.v.world
    # Replica 0 loses one rank, replica 1 two; one spare: replica 1 goes.
    realloc = only(crash(s, before[1], before[4], before[5]), "reallocation.issued")
    assert realloc.mode is ReallocationMode.SHRINK
    assert realloc.world == ["spare0" if m == before[1] else m for m in before[:4]]
    assert realloc.demoted == [before[6], before[7]]


# --------------------------------------------------------------------------- cannot shrink


def test_a_layout_that_cannot_shrink_waits_for_a_spare_then_stops():
    long = {p: 100.0 for p in Phase}  # heartbeat deadlines after the wait's
    s = mesh_job(
        [("dp", 2), ("tp", 4)], min_world=2, recovery_deadline_s=30.0, heartbeat_timeout_s=long
    )
    decided = crash(s, "w000")
    assert [d.type for d in decided] == ["fault.detected", "job.state_changed", "job.state_changed"]
    assert s.v.state is S.REALLOCATING
    why = reasons(decided)[-1]
    assert why.startswith("cannot shrink: w000 (rank 0, dp=0 tp=0) failed and no spare can take")
    assert "would leave 1 of 2 replicas, fewer than min_world 2 (replicas)" in why
    assert "waiting for spares to take the lost ranks until 2026-01-01T00:00:32+00:00" in why
    assert "then the job stops" in why
    assert next_deadline(s.v) == T0 + timedelta(seconds=32)
    # Meanwhile nothing more is decided ...
    s.at(20)
    s.heartbeat_all()
    assert s.decide() == []
    # ... until the deadline passes.
    s.at(32.5)
    s.heartbeat_all()
    stopped = only(s.decide(), "job.stopped")
    assert stopped.reason.startswith("no spare came within recovery_deadline_s (30s): cannot")
    assert s.v.state is S.STOPPED


def test_a_spare_that_comes_while_waiting_takes_the_coordinate():
    s = mesh_job([("dp", 2), ("tp", 4)], min_world=2)
    crash(s, "w000")
    rank = 0
    s.at(10)
    s.heartbeat_all()
    s.join("late-spare", "spare-node", "rack0", role="spare")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.mode is ReallocationMode.REPLACE
    assert realloc.world[rank] == "late-spare"
    assert s.v.state is S.RECOVERING


def test_a_failure_while_waiting_is_recorded():
    s = mesh_job([("dp", 2), ("tp", 4)], min_world=2)
    crash(s, "w000")
    s.at(5)
    s.heartbeat_all()
    s.exited("w101")
    decided = s.decide()
    assert [d.type for d in decided] == ["fault.detected"]
    assert s.v.state is S.REALLOCATING


def test_a_mesh_without_a_replica_dimension_cannot_shrink():
    s = mesh_job([("pp", 2), ("tp", 4)], node_local=("tp",))
    why = reasons(crash(s, "w010"))[-1]
    assert "the mesh pp=2 x tp=4 is one replica (no data-parallel replica to drop" in why
    assert s.v.state is S.REALLOCATING


def test_declared_replica_dims_are_honoured():
    # No dim named dp: "fsdp" declared as the replica dimension.
    s = mesh_job([("fsdp", 4), ("tp", 2)], replica_dims=["fsdp"])
    realloc = only(crash(s, s.v.world[0]), "reallocation.issued")
    assert realloc.mode is ReallocationMode.SHRINK and len(realloc.world) == 6
    assert command(s).mesh == {"fsdp": 3, "tp": 2}


def test_a_cascade_while_recovering_re_decides_by_replicas():
    s = mesh_job([("dp", 4), ("tp", 2)])
    crash(s, "w000")
    assert s.v.state is S.RECOVERING
    s.at(3)
    s.exited("w100")
    decided = s.decide()
    # With a mesh the cascade goes back to DEGRADED, then the plan says what it does.
    assert [(d.payload.from_, d.payload.to) for d in decided if d.type == "job.state_changed"][
        :2
    ] == [(S.RECOVERING, S.DEGRADED), (S.DEGRADED, S.REALLOCATING)]
    realloc = only(decided, "reallocation.issued")
    assert realloc.mode is ReallocationMode.REPLACE  # the demoted w001 takes w100's rank
    assert "w001" in realloc.world


# --------------------------------------------------------------------------- grow


def test_growth_adds_whole_replicas_from_demoted_survivors_and_new_members():
    s = mesh_job([("dp", 4), ("tp", 2)])
    realloc = only(crash(s, "w000"), "reallocation.issued")
    [survivor] = realloc.demoted
    s.at(3)
    s.recover()
    s.heartbeat_all()
    s.decide()
    assert s.v.state is S.RUNNING and len(s.v.world) == 6
    # A new worker joins: with the warm spare that makes a whole replica, at the next backup.
    s.at(4)
    s.join("w-new", "node-new", "rack0")
    s.heartbeat_all()
    assert s.decide() == []  # no backup newer than its join yet
    s.step(30)
    s.backup(30)
    decided = s.decide()
    grown = only(decided, "reallocation.issued")
    assert grown.mode is ReallocationMode.GROW
    assert len(grown.world) == 8 and {survivor, "w-new"} <= set(grown.world)
    assert "grow to 4 of 4 replicas (dp=4 x tp=2, 8 ranks)" in grown.reason
    cmd = command(s)
    assert cmd.mesh == {"dp": 4, "tp": 2}
    # The members that ran stay at their places inside their replicas.
    lay = full_layout(s.policy.mesh)  # type: ignore[arg-type]
    new_replica = {lay.replica_of(grown.world.index(m)) for m in (survivor, "w-new")}
    assert new_replica == {3}


def test_one_member_is_not_a_replica():
    s = mesh_job([("dp", 4), ("tp", 2)], spares=0)
    only(crash(s, "w000"), "reallocation.issued")
    s.at(3)
    s.recover()
    s.heartbeat_all()
    s.decide()
    # Kill the demoted survivor: no whole replica can be grown from one new member alone.
    s.at(4)
    s.heartbeat_all()
    s.exited("w001")
    s.join("w-new", "node-new", "rack0")
    s.step(30)
    s.backup(30)
    assert [d.type for d in s.decide()] == []


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("dims", SHAPES)
def test_the_same_view_decides_the_same_and_the_log_replays_it(dims):
    s = mesh_job(dims, spares=1)
    s.at(2)
    s.exited(s.v.world[1])
    s.exited(s.v.world[6])
    view = s.v
    first = decide(view, s.now, s.context)
    assert decide(view, s.now, s.context) == first
    rebuilt = fold(None, s.log)
    assert rebuilt == view
    assert decide(rebuilt, s.now, s.context) == first
    s.decide()
    assert fold(None, s.log) == s.v
