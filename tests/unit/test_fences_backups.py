"""Generations are fences, for backups and steps (issue 21, scenarios 1 and 6).

A step's backup belongs to the world of the generation that took it: it is complete only when
every shard of that world has its verified copies. What an abandoned generation did beyond the
restore step of a later one is recorded in the log and discounted as stale, never counted; a
new generation's timeline (the job's step, the accounting, growth) starts at its restore step.

Jobs are built with ``tests.scenario.Scenario``: generation 1 runs ``w00 w01`` (rack0) and
``w10 w11`` (rack1), one per node, with complete backups at steps 10 and 20 and last step 23.
With redundancy 2 the placement of that world is:

    shard 0 (w00) -> w01, w10    shard 1 (w01) -> w00, w11
    shard 2 (w10) -> w11, w00    shard 3 (w11) -> w10, w01
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from controlplane.core.decide import Decided
from controlplane.core.fold import fold
from controlplane.core.restore import plan_restore
from controlplane.core.timeline import timeline
from controlplane.core.view import ReplicaCopy, ShardBackup, StepBackup
from schemas.common import JobState, ReallocationMode, RestoreFrom
from tests.scenario import Scenario

S = JobState
JOB = "job1"
RESOLVED = ["incident.resolved", "job.state_changed"]


def running(spares: int = 1, **policy: Any) -> Scenario:
    """Generation 1 RUNNING four workers, complete backups at steps 10 and 20, last step 23;
    every member heartbeats at t=1."""
    s = Scenario(JOB, **{"world_size": 4, "min_world": 2, **policy})
    s.cluster(2, 2, spares)
    return s.start_and_train()


def only(decided: list[Decided], type_: str) -> Any:
    [payload] = [d.payload for d in decided if d.type == type_]
    return payload


def kinds(decided: list[Decided]) -> list[str]:
    return [d.type for d in decided]


def reasons(decided: list[Decided]) -> list[str]:
    return [d.payload.reason for d in decided if d.type == "job.state_changed"]


def checksum(step: int, shard: int) -> str:
    return f"crc32:{step:04x}{shard:04x}"  # what ``Scenario.backup`` reports


def snapshot(s: Scenario, owner: str, step: int, shard: int, *, gen: int) -> Any:
    payload = {"step": step, "shard": shard, "nbytes": 100, "checksum": checksum(step, shard),
               "seconds": 0.01}  # fmt: skip
    return s.ev.make("backup.snapshot", payload, source=s._src(owner), generation=gen)


def replica(s: Scenario, holder: str, owner: str, step: int, shard: int, *, gen: int) -> Any:
    payload = {"step": step, "shard": shard, "owner": owner, "nbytes": 100,
               "checksum": checksum(step, shard), "seconds": 0.01}  # fmt: skip
    return s.ev.make("backup.replicated", payload, source=s._src(holder), generation=gen)


def assert_replays(s: Scenario) -> None:
    """Folding the whole log from position 0 reproduces the live view."""
    assert fold(None, s.log) == s.v


# --------------------------------------------------------------------------- scenario 1


def test_scenario_1_late_backups_of_an_abandoned_generation_complete_no_step():
    """w01 dies during the backup of step 30; generation 2 restores step 20. The survivors'
    generation-1 events for step 30 arrive afterwards (shard 0's snapshot first). At
    generation 2's step 25 w10 dies: the job shrinks and restores step 20 (four shards for
    three ranks, re-partitioned), never step 30, which the new timeline never reached."""
    s = running(spares=1)
    s.step(30)
    s.at(2)
    s.exited("w01")
    first = only(s.decide(), "reallocation.issued")
    assert (first.generation, first.restore_step) == (2, 20)
    assert first.world == ["w00", "spare0", "w10", "w11"]
    # Generation 1's backup of step 30, from the survivors, late.
    s.add(
        snapshot(s, "w00", 30, 0, gen=1),
        replica(s, "w10", "w00", 30, 0, gen=1),
        snapshot(s, "w10", 30, 2, gen=1),
        replica(s, "w11", "w10", 30, 2, gen=1),
        replica(s, "w00", "w10", 30, 2, gen=1),
        snapshot(s, "w11", 30, 3, gen=1),
        replica(s, "w10", "w11", 30, 3, gen=1),
    )
    s.at(3)
    s.heartbeat_all()
    s.recover()
    assert kinds(s.decide()) == RESOLVED
    s.step(25)
    s.at(4)
    s.exited("w10")
    decided = s.decide()
    second = only(decided, "reallocation.issued")
    assert second.mode is ReallocationMode.SHRINK
    assert second.world == ["w00", "spare0", "w11"]
    assert (second.restore_step, second.restore_from) == (20, RestoreFrom.MEMORY)
    assert second.reason == "shrink to 3 without w10 (no spare); restore step 20"
    assert reasons(decided)[1:] == [
        "shrink to 3 without w10 (no spare); restore step 20",
        "generation 3: 3 members restore step 20 from memory",
    ]
    # Every shard of generation 1's world, each from a survivor's verified copy.
    assert dict(enumerate(second.plan)) == {0: "w00", 1: "w00", 2: "w11", 3: "w11"}
    assert second.digests == []  # the fold takes them from the catalog
    decision = s.v.incidents[str(second.incident_id)].decisions[-1]
    assert list(decision.digests) == [checksum(20, n) for n in range(4)]
    # The late events are in the log, discounted as stale; they made no step 30, so step 10
    # was not evicted for it.
    stale = [d for d in s.v.discounts if d.reason == "stale_generation"]
    assert [(d.type, d.source) for d in stale] == [
        ("backup.snapshot", "node-0-0/w00"),
        ("backup.replicated", "node-1-0/w10"),
        ("backup.snapshot", "node-1-0/w10"),
        ("backup.replicated", "node-1-1/w11"),
        ("backup.replicated", "node-0-0/w00"),
        ("backup.snapshot", "node-1-1/w11"),
        ("backup.replicated", "node-1-0/w10"),
    ]
    assert stale[0].detail == (
        "backup.snapshot of step 30 (shard 0) from generation 1: generation 2 restored step 20,"
        " abandoning what generation 1 did after it"
    )
    assert s.v.discount_counts["stale_generation"] == 7
    assert s.v.last_complete_backup == 20
    assert sorted(s.v.backups) == [10, 20]
    assert (s.v.backups[20].generation, s.v.backups[20].num_shards) == (1, 4)
    assert_replays(s)


# --------------------------------------------------------------------------- scenario 6


@pytest.mark.parametrize("when", ["repeat", "at_first_step"])
def test_scenario_6_steps_lost_counts_only_steps_of_the_current_timeline(when):
    """w01 dies at step 23 and generation 2 restores step 20 (3 steps lost). Then w10 dies:
    after generation 2's step 22 (``repeat``: 2 steps lost), or in the batch of its first
    step, 21 (``at_first_step``: 1 step lost). Before, the job's step stayed at generation 1's
    23 and both faults counted 3."""
    s = running(spares=2)
    s.at(2)
    s.exited("w01")
    first = only(s.decide(), "reallocation.issued")
    assert first.restore_step == 20
    assert s.v.last_step == 20  # generation 2 starts at its restore step
    s.at(3)
    s.heartbeat_all()
    s.recover()
    if when == "repeat":
        resolved = s.decide()
        assert only(resolved, "incident.resolved").steps_lost == 3
        s.step(22)
        s.at(4)
        s.exited("w10")
        decided = s.decide()
    else:
        s.exited("w10")
        decided = s.decide()
        assert only(decided[:2], "incident.resolved").steps_lost == 3
    lost = {"repeat": 2, "at_first_step": 1}[when]
    realloc = only(decided, "reallocation.issued")
    assert (realloc.generation, realloc.restore_step) == (3, 20)
    assert realloc.reason == "replace w10 with spare1; restore step 20"
    assert reasons(decided)[-2:] == [
        "replace w10 with spare1; restore step 20",
        "generation 3: 4 members restore step 20 from memory",
    ]
    incident = s.v.incidents[s.v.open_incident or ""]
    assert incident.step_at_fault == 20 + lost
    s.at(5)
    s.heartbeat_all()
    s.recover()
    resolved = s.decide()
    assert only(resolved, "incident.resolved").steps_lost == lost
    assert timeline(s.v.incidents[incident.incident_id]).steps_lost == lost
    assert_replays(s)


# --------------------------------------------------------------------------- the catalog


def test_a_late_replica_of_the_restored_step_under_the_new_generation_counts_in_its_record():
    """Shard 1's copy on w11 of step 20 is reported only after generation 2 (which restores
    step 20) started, under generation 2: the holder reports under the generation it moved to.
    It counts in generation 1's record of step 20 (generation 2 started after that step), which
    then is complete; it does not replace that record with a new one of generation 2."""
    s = Scenario(JOB, world_size=4, min_world=2)
    s.cluster(2, 2, spares=2)
    s.decide()
    s.at(1)
    s.heartbeat_all()
    s.step(10)
    s.backup(10)
    s.step(20)
    assert s.v.placement[1] == ("w00", "w11")
    events = [snapshot(s, owner, 20, n, gen=1) for n, owner in enumerate(s.v.world)]
    for n, owner in enumerate(s.v.world):
        events += [
            replica(s, h, owner, 20, n, gen=1) for h in s.v.placement[n] if (n, h) != (1, "w11")
        ]
    s.add(*events)
    s.step(23)
    assert s.v.last_complete_backup == 10  # shard 1 has one of its two copies reported
    s.at(2)
    s.exited("w01")
    first = only(s.decide(), "reallocation.issued")
    assert (first.restore_step, first.plan[1]) == (20, "w00")  # restorable: w00's copy
    s.add(replica(s, "w11", "w01", 20, 1, gen=2))
    backup = s.v.backups[20]
    assert (backup.generation, backup.num_shards) == (1, 4)
    assert sorted(backup.shards[1].verified_holders()) == ["w00", "w11"]
    assert s.v.last_complete_backup == 20
    s.at(3)
    s.heartbeat_all()
    s.recover()
    s.decide()
    s.at(4)
    s.exited("w00")  # one of shard 1's holders; w11 still has it
    decided = s.decide()
    realloc = only(decided, "reallocation.issued")
    assert (realloc.restore_step, realloc.plan[1]) == (20, "w11")
    assert realloc.reason == "replace w00 with spare1; restore step 20"
    assert_replays(s)


def test_a_shard_outside_the_world_completes_no_step_and_growth_waits():
    """Step 30: shards 0-2 are backed up, shard 3 is not; w00 also reports a 'shard 7' with
    copies. The world has four ranks: step 30 is not complete, so a member that joined at
    step 23 is not grown in (from step 20) on the strength of it."""
    s = running(spares=0, max_world=5)
    s.at(2)
    s.join("late0", "late-node-0", "rack0", role="spare")
    s.heartbeat_all()
    s.step(30)
    events = []
    for n, owner in enumerate(s.v.world[:3]):
        events.append(snapshot(s, owner, 30, n, gen=1))
        events += [replica(s, h, owner, 30, n, gen=1) for h in s.v.placement[n]]
    events += [
        snapshot(s, "w00", 30, 7, gen=1),
        replica(s, "w01", "w00", 30, 7, gen=1),
        replica(s, "w10", "w00", 30, 7, gen=1),
        # ... and w01 claims rank 2's shard of the step.
        snapshot(s, "w01", 30, 2, gen=1),
    ]
    s.add(*events)
    assert s.decide() == []
    assert s.v.last_complete_backup == 20
    assert s.v.backups[30].satisfied == 3 and not s.v.backups[30].is_complete(2)
    assert s.v.backups[30].shards[2].owner == "w10"
    outside = [d for d in s.v.discounts if d.reason == "shard_outside_world"]
    assert [d.detail for d in outside] == [
        "backup.snapshot of shard 7 at step 30: the world of generation 1 has 4 ranks",
        "backup.replicated of shard 7 at step 30: the world of generation 1 has 4 ranks",
        "backup.replicated of shard 7 at step 30: the world of generation 1 has 4 ranks",
        "backup.snapshot of shard 2 at step 30 owned by w01: rank 2 of generation 1 is w10",
    ]
    # Shard 3 arrives: now the step is complete and the member is grown in at it.
    s.add(snapshot(s, "w11", 30, 3, gen=1))
    s.add(*(replica(s, h, "w11", 30, 3, gen=1) for h in s.v.placement[3]))
    realloc = only(s.decide(), "reallocation.issued")
    assert (realloc.mode, realloc.restore_step) == (ReallocationMode.GROW, 30)
    assert realloc.reason == "grow to 5 with late0 at the backup of step 30"
    assert_replays(s)


def test_growth_counts_from_the_restore_step():
    """Generation 1 reached step 33 (step 30's backup incomplete) when w01 died: generation 2
    restores step 20. A member that joins at its step 22 is grown in at its backup of step
    30, not held back until step 40 by generation 1's abandoned 33."""
    s = running(spares=1, max_world=5)
    s.step(30)
    s.backup(30, replicate=False)
    s.step(33)
    s.at(2)
    s.exited("w01")
    first = only(s.decide(), "reallocation.issued")
    assert first.restore_step == 20
    assert (s.v.last_step, sorted(s.v.backups)) == (20, [10, 20])
    s.at(3)
    s.heartbeat_all()
    s.recover()
    assert kinds(s.decide()) == RESOLVED
    s.step(22)
    s.join("late0", "late-node-0", "rack1", role="spare")
    s.heartbeat_all()
    assert s.v.members["late0"].joined_step == 22
    s.step(30)
    s.backup(30)
    decided = s.decide()
    realloc = only(decided, "reallocation.issued")
    assert (realloc.mode, realloc.generation, realloc.restore_step) == (
        ReallocationMode.GROW,
        3,
        30,
    )
    assert reasons(decided)[0] == "grow to 5 with late0 at the backup of step 30"
    assert_replays(s)


def test_a_member_that_joined_on_the_abandoned_timeline_counts_from_the_restore_step():
    """late0 joined at generation 1's step 23; generation 2 restores step 20: its join step is
    20 on the new timeline (the step the job is at when it is there)."""
    s = running(spares=1, max_world=5)
    s.at(2)
    s.join("late0", "late-node-0", "rack1", role="spare")
    s.heartbeat_all()
    assert s.v.members["late0"].joined_step == 23
    s.exited("w01")
    s.decide()
    assert s.v.members["late0"].joined_step == 20
    assert_replays(s)


def test_a_late_checkpoint_of_an_abandoned_step_is_stale():
    """Redundancy 1: shard 1 lives on w01 and w11. Step 25's checkpoint has three of its four
    shards saved when w01 dies (generation 2 restores hot step 20); the fourth, late, is
    generation 1's and stale. When w11 dies too, no complete state survives: the job stops,
    instead of restoring a checkpoint of a step the new timeline never reached."""
    s = running(spares=2, redundancy=1)
    s.step(25)
    saves = [
        s.ev.make(
            "checkpoint.saved",
            {"step": 25, "shard": n, "shards": 4, "path": f"/ckpt/25/{n}", "nbytes": 100,
             "checksum": "crc32:00", "seconds": 0.1},
            source=s._src(owner),
            generation=1,
        )
        for n, owner in enumerate(s.v.world)
    ]  # fmt: skip
    s.add(*saves[:3])
    s.at(2)
    s.exited("w01")
    first = only(s.decide(), "reallocation.issued")
    assert (first.restore_step, first.restore_from, first.plan[1]) == (
        20,
        RestoreFrom.MEMORY,
        "w11",
    )
    s.add(saves[3])
    assert s.v.checkpoints == {}
    [stale] = [d for d in s.v.discounts if d.reason == "stale_generation"]
    assert stale.detail == (
        "checkpoint.saved of step 25 (shard 3) from generation 1: generation 2 restored step"
        " 20, abandoning what generation 1 did after it"
    )
    s.at(3)
    s.exited("w11")
    decided = s.decide()
    assert kinds(decided) == ["fault.detected", "job.state_changed", "job.stopped"]
    assert only(decided, "job.stopped").reason == (
        "no complete copy of the state survives: every copy of a shard of each backup"
        " (newest complete: step 20) was on failed members, and there is no cold checkpoint"
    )
    assert_replays(s)


# --------------------------------------------------------------------------- the planner


def test_the_planner_takes_only_steps_of_the_current_timeline_whole_in_their_world():
    """A view that holds what the fold no longer makes: a 'complete' step 30 of one shard from
    generation 1 (whose world had four), and one of four shards that generation 2 abandoned
    by restoring step 20. The planner passes over both to step 20."""
    from controlplane.core.restore import of_current_timeline

    s = running(spares=1)
    s.at(2)
    s.exited("w01")
    s.decide()
    view = s.v
    world = dict(enumerate(view.world))
    members = view.members
    alive = {m for m in members if m != "w01"}

    def whole(owner: str, n: int) -> ShardBackup:
        shard = ShardBackup(n, owner, 100, checksum(30, n), view.last_position)
        for holder in ("w10", "w11"):
            shard.replicas[holder] = ReplicaCopy(holder, 100, checksum(30, n), view.last_position)
        return shard

    one = StepBackup(30, 1, 1, {0: whole("w00", 0)}, satisfied=1)
    four = StepBackup(
        30, 1, 4, {n: whole(m, n) for n, m in enumerate(("w00", "w00", "w10", "w11"))}, 4
    )
    assert plan_restore(view, alive, world, members).step == 20
    for bad in (one, four):
        forged = dataclasses.replace(view, backups={**view.backups, 30: bad})
        assert not of_current_timeline(forged, bad)
        plan = plan_restore(forged, alive, world, members)
        assert plan is not None and (plan.step, len(plan.sources)) == (20, 4)
    assert of_current_timeline(view, view.backups[20])
    # A world of three restores generation 1's four shards (re-partitioned on shrink).
    three = {0: "w00", 1: "w10", 2: "w11"}
    plan = plan_restore(view, alive, three, members)
    assert plan is not None and (plan.step, len(plan.sources)) == (20, 4)
