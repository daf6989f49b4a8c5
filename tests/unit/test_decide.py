"""The decider: given this log and this time, exactly these decisions, with these reasons.

Jobs are built with ``tests.scenario.Scenario`` (a controllable clock; decisions recorded the
way the service records them). Unless a test says otherwise a job runs generation 1 on two
racks of two nodes, one worker per node: ``w00 w01`` in rack0, ``w10 w11`` in rack1; spares
join rack by rack (``spare0`` in rack0, ``spare1`` in rack1, each on a node of its own).
With the default redundancy 2 the published placement of that world is:

    shard 0 (w00) -> w01, w10    shard 1 (w01) -> w00, w11
    shard 2 (w10) -> w11, w00    shard 3 (w11) -> w10, w01
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.commands import owed
from controlplane.core.decide import (
    Decided,
    decide,
    decision_id,
    envelope,
    next_deadline,
    wakes,
)
from controlplane.core.fold import fold
from controlplane.core.placement import Slot, place
from controlplane.core.records import StoredEvent
from controlplane.core.replay import decision_batches, redecide
from controlplane.core.statemachine import TERMINAL, can_transition
from controlplane.core.view import JobView, MemberStatus
from schemas.commands import COMMAND_ADAPTER, Reallocate, Stop
from schemas.common import FaultReason, JobState, Phase, ReallocationMode, RestoreFrom
from schemas.events import EVENT_ADAPTER, Evidence, JobPolicy
from tests.factories import T0, Events
from tests.scenario import RENDEZVOUS, Scenario

S = JobState
JOB = "job1"
CRASH = [
    "fault.detected",
    "job.state_changed",
    "job.state_changed",
    "reallocation.issued",
    "generation.started",
    "job.state_changed",
]
CASCADE = [
    "fault.detected",
    "job.state_changed",
    "reallocation.issued",
    "generation.started",
    "job.state_changed",
]
RESOLVED = ["incident.resolved", "job.state_changed"]


# --------------------------------------------------------------------------- helpers


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


def kinds(decided: list[Decided]) -> list[str]:
    return [d.type for d in decided]


def transitions(decided: list[Decided]) -> list[tuple[JobState, JobState]]:
    return [(d.payload.from_, d.payload.to) for d in decided if d.type == "job.state_changed"]


def reasons(decided: list[Decided]) -> list[str]:
    return [d.payload.reason for d in decided if d.type == "job.state_changed"]


def only(decided: list[Decided], type_: str) -> Any:
    [payload] = [d.payload for d in decided if d.type == type_]
    return payload


def plan(realloc: Any) -> dict[int, str]:
    return dict(enumerate(realloc.plan))


def running(spares: int = 0, *, racks: int = 2, nodes: int = 2, **policy: Any) -> Scenario:
    """A job RUNNING generation 1 (one worker per node), complete backups at steps 10 and 20
    with the published placement, last step 23; every member heartbeats at t=1."""
    replicate = policy.pop("replicate", True)
    s = Scenario(JOB, **{"world_size": racks * nodes, "min_world": 2, **policy})
    s.cluster(racks, nodes, spares)
    return s.start_and_train(replicate=replicate)


def position_of(s: Scenario, type_: str, **match: Any) -> int:
    """Log position of the last event of ``type_`` whose payload matches ``match``."""
    [*_, stored] = [
        e
        for e in s.log
        if e.event.type == type_ and all(getattr(e.event.payload, k) == v for k, v in match.items())
    ]
    return stored.position


def report(s: Scenario, kind: str, who: list[str] | None = None) -> None:
    """Members of the open incident's latest decision ack, restore, or resume it."""
    decision = s.v.incidents[s.v.open_incident or ""].decisions[-1]
    g = decision.generation
    payload = {
        "command.acked": {"command_id": decision.command_id},
        "restore.completed": {
            "generation": g,
            "step": decision.restore_step,
            "bytes": 100,
            "seconds": 0.1,
        },
        "train.resumed": {"generation": g, "step": decision.restore_step},
    }[kind]
    members = who if who is not None else list(decision.world)
    s.add(*(s.ev.make(kind, payload, source=s._src(m), generation=g) for m in members))


def alive_tick(s: Scenario, until: float, *, silent: tuple[str, ...] = (), phase="train") -> None:
    """Every whole second up to ``until``: active members except ``silent`` heartbeat, and the
    decider, run each time, decides nothing."""
    t = int((s.now - T0).total_seconds()) + 1
    while t <= until:
        s.at(t)
        alive = [
            m
            for m, member in s.v.members.items()
            if member.status is MemberStatus.ACTIVE and m not in silent
        ]
        s.heartbeat(*alive, phase=phase)
        assert s.decide() == [], f"decided at t={t}"
        t += 1


def crash_w01(spares: int = 2, **policy: Any) -> tuple[Scenario, list[Decided]]:
    """``running``; w01 is killed (signal 9) at t=2 and the decider runs then."""
    s = running(spares, **policy)
    s.at(2)
    s.exited("w01")
    return s, s.decide()


# --------------------------------------------------------------------------- 1. crash


def test_a_crash_is_detected_and_a_same_rack_spare_takes_the_rank():
    s, decided = crash_w01(spares=2)
    incident = decision_id(JOB, "incident/1")
    exit_position = position_of(s, "member.exited")

    assert kinds(decided) == CRASH
    detected = only(decided, "fault.detected")
    assert str(detected.incident_id) == incident
    assert detected.members == ["w01"]
    assert detected.reason is FaultReason.EXITED
    assert detected.detail == "w01 killed by signal 9"
    assert detected.evidence == [
        Evidence(member="w01", what="member.exited", position=exit_position, at=at(2))
    ]
    assert transitions(decided) == [
        (S.RUNNING, S.DEGRADED),
        (S.DEGRADED, S.REALLOCATING),
        (S.REALLOCATING, S.RECOVERING),
    ]
    assert reasons(decided) == [
        "w01 killed by signal 9",
        "replace w01 with spare0; restore step 20",
        "generation 2: 4 members restore step 20 from memory",
    ]

    realloc = only(decided, "reallocation.issued")
    assert str(realloc.incident_id) == incident
    assert str(realloc.command_id) == decision_id(JOB, "command/2")
    assert realloc.generation == 2
    assert realloc.mode is ReallocationMode.REPLACE
    # spare0 shares w01's rack; spare1 (rack1) stays a spare.
    assert realloc.world == ["w00", "spare0", "w10", "w11"]
    assert realloc.restore_step == 20 == s.v.last_complete_backup
    assert realloc.restore_from is RestoreFrom.MEMORY
    # Survivors restore their own shards from memory; shard 1 (w01's) has copies on w00
    # (rack0, like spare0) and w11 (rack1): the same-rack holder serves it.
    assert plan(realloc) == {0: "w00", 1: "w00", 2: "w10", 3: "w11"}
    assert realloc.rendezvous == f"{RENDEZVOUS}/{JOB}/2"

    started = only(decided, "generation.started")
    assert started.generation == 2
    assert started.world == realloc.world
    assert started.rendezvous == f"{RENDEZVOUS}/{JOB}/2"
    members = s.v.members
    slots = [Slot(m, members[m].node, members[m].rack) for m in started.world]
    first = s.of_type("generation.started")[0]
    # spare0 stands in for w01 as owner and as holder; no other copy moves.
    renamed = [["spare0" if h == "w01" else h for h in hs] for hs in first.placement]
    assert started.placement == renamed
    # ... and a placement from scratch would satisfy the rule just as well.
    assert len(place(slots, 2).holders) == 4
    for owner_id, holders in zip(started.world, started.placement, strict=True):
        owner = members[owner_id]  # the rule: one holder in the rack, one outside it
        near, far = (members[h] for h in holders)
        assert near.rack == owner.rack and near.node != owner.node
        assert far.rack != owner.rack

    view = s.v
    assert view.state is S.RECOVERING
    assert (view.generation, view.world) == (2, ("w00", "spare0", "w10", "w11"))
    assert view.members["spare0"].rank == 1 and view.members["spare1"].rank is None
    assert view.members["w01"].status is MemberStatus.EXITED
    assert view.open_incident == incident
    assert [d.event_id for d in decided] == [
        decision_id(JOB, key)
        for key in (
            "detected/1",
            "state/2",
            "state/3",
            "reallocation/2",
            "generation/2",
            "state/4",
        )
    ]


def test_one_round_answers_whether_anything_is_due_and_is_the_full_call_s_first():
    """``rounds=1`` (what the service asks of its probe): the first round alone, the
    detection and the state it leads to, without the plan; nothing when nothing is due."""
    s = running(2)
    s.at(2)
    assert decide(s.v, s.now, s.context, rounds=1) == []
    s.exited("w01")
    first = decide(s.v, s.now, s.context, rounds=1)
    full = decide(s.v, s.now, s.context)
    assert kinds(first) == ["fault.detected", "job.state_changed"]
    assert first == full[: len(first)] and kinds(full) == CRASH


@pytest.mark.parametrize(
    ("failed", "spare", "world"),
    [
        ("w00", "spare0", ["spare0", "w01", "w10", "w11"]),
        ("w11", "spare1", ["w00", "w01", "w10", "spare1"]),
    ],
)
def test_the_spare_in_the_failed_member_s_rack_is_preferred(failed, spare, world):
    s = running(2)
    s.at(2)
    s.exited(failed)
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.world == world
    assert realloc.reason == f"replace {failed} with {spare}; restore step 20"


def test_with_only_an_other_rack_spare_it_still_replaces():
    s = running(0)
    s.join("spare1", "spare-node-1", "rack1", role="spare")
    s.heartbeat("spare1")
    s.at(2)
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert (realloc.mode, realloc.world) == (
        ReallocationMode.REPLACE,
        ["w00", "spare1", "w10", "w11"],
    )
    # Shard 1 is held by w00 (rack0) and w11 (spare1's rack).
    assert plan(realloc)[1] == "w11"


def test_a_spare_that_stopped_heartbeating_is_no_candidate():
    s = running(2)
    s.at(4)
    s.heartbeat(*(m for m in s.v.members if m != "spare0"))
    s.at(6.5)
    s.heartbeat(*(m for m in s.v.members if m != "spare0"))
    assert s.decide() == []  # a silent spare opens no incident
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.world == ["w00", "spare1", "w10", "w11"]


def test_the_replacement_fetches_from_a_holder_on_its_node_before_one_in_its_rack():
    """Redundancy 3 on two racks: shard 1 (w01, rack0) is held by w00, w10 and w11. The only
    spare runs on w11's node: w11 serves it, not w10 (same rack, other node) or w00."""
    s = running(0, redundancy=3)
    s.join("spare0", "node-1-1", "rack1", role="spare")
    s.heartbeat("spare0")
    assert s.v.placement[1] == ("w00", "w10", "w11")
    s.at(2)
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.world == ["w00", "spare0", "w10", "w11"]
    assert plan(realloc) == {0: "w00", 1: "w11", 2: "w10", 3: "w11"}


def test_a_replacement_in_another_rack_fetches_from_a_holder_in_its_rack():
    s = running(0, redundancy=3)
    s.join("spare0", "spare-node", "rack1", role="spare")
    s.heartbeat("spare0")
    s.at(2)
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.world == ["w00", "spare0", "w10", "w11"]
    assert s.v.members[plan(realloc)[1]].rack == "rack1"


def test_a_spare_s_failure_opens_no_incident_and_it_is_no_candidate_any_more():
    s = running(2)
    s.at(2)
    s.exited("spare0")
    assert s.decide() == []
    assert s.v.incidents == {} and s.v.state is S.RUNNING
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.world == ["w00", "spare1", "w10", "w11"]


def test_a_reported_exception_fails_the_reporter_and_a_corroborated_one_the_suspect():
    s = running(2)
    s.at(2)
    s.fault("w00", "exception")
    s.fault("w10", "collective_error", suspects=["w11"])
    # w11 beat at t=1: at t=4 it has been silent for 3 heartbeat intervals, which
    # corroborates w10's report (the others beat at t=3.5).
    s.at(3.5)
    s.heartbeat("w01", "w10", "spare0", "spare1")
    s.at(4)
    decided = s.decide()
    assert kinds(decided) == CRASH
    detected = only(decided, "fault.detected")
    assert (detected.members, detected.reason) == (["w00", "w11"], FaultReason.REPORTED)
    assert detected.detail == (
        "w00 reported exception: boom; w10 lost w11 in a collective: boom; corroborated by its"
        " silence: no heartbeat for 3.0s (3 intervals of 1s)"
    )
    assert [(e.member, e.what) for e in detected.evidence] == [
        ("w00", "member.fault"),
        ("w10", "member.fault"),
        ("w11", "member.heartbeat"),
    ]
    assert only(decided, "reallocation.issued").world == ["spare0", "w01", "w10", "spare1"]


def test_a_crash_followed_by_a_quick_rejoin_is_still_a_fault():
    """The old process is gone even though its exit was folded away by the rejoin; the new
    process is not fenced: with no spare, it takes its old rank back."""
    s = running(0)
    s.at(2)
    s.exited("w01")
    restarted = Events(JOB, incarnation="inc2")
    s.add(restarted.joined("w01", node="node-0-1", rack="rack0", payload={"role": "worker"}))
    s.heartbeat("w01")
    decided = s.decide()
    detected = only(decided, "fault.detected")
    assert detected.members == ["w01"]
    assert detected.detail.startswith("w01 came back as a new process (incarnation inc2)")
    realloc = only(decided, "reallocation.issued")
    assert realloc.world == ["w00", "w01", "w10", "w11"]
    assert s.v.members["w01"].status is MemberStatus.ACTIVE and s.v.members["w01"].rank == 1
    assert s.decide() == []


# --------------------------------------------------------------------------- 2. hang


HANG_TIMEOUTS = {Phase.INIT: 30.0, Phase.TRAIN: 4.0, Phase.BACKUP: 12.0, Phase.RESTORE: 20.0}


@pytest.mark.parametrize(
    ("phase", "limit"),
    [("train", 4.0), ("backup", 12.0), ("restore", 20.0), ("waiting", 4.0)],
    ids=["train", "backup-longer", "restore-longer", "unlisted-falls-back-to-train"],
)
def test_a_hang_is_decided_right_after_the_timeout_of_the_member_s_phase(phase, limit):
    s = running(0, heartbeat_timeout_s=HANG_TIMEOUTS)
    s.at(2)
    s.heartbeat_all()
    s.heartbeat("w10", phase=phase)
    last = position_of(s, "member.heartbeat")
    # Nothing while w10's silence is within its phase's timeout (exactly at it, too).
    alive_tick(s, 2 + limit, silent=("w10",))
    assert s.now == at(2 + limit)

    s.at(2 + limit + 0.5)
    s.heartbeat(*(m for m in s.v.world if m != "w10"))
    decided = s.decide()
    assert kinds(decided) == CRASH
    detected = only(decided, "fault.detected")
    assert detected.members == ["w10"]
    assert detected.reason is FaultReason.HEARTBEAT_TIMEOUT
    assert (
        detected.detail
        == f"w10 silent for {limit + 0.5:.1f}s in phase {phase} (timeout {limit:g}s)"
    )
    assert detected.evidence == [
        Evidence(member="w10", what="member.heartbeat", position=last, at=at(2))
    ]
    realloc = only(decided, "reallocation.issued")
    assert (realloc.mode, realloc.world) == (ReallocationMode.SHRINK, ["w00", "w01", "w11"])


def test_a_member_that_never_heartbeats_times_out_from_its_join():
    s = Scenario(JOB, world_size=2, min_world=1)
    s.join("w00", "n0", "rack0")
    s.join("w01", "n1", "rack1")
    s.decide()
    s.at(1)
    s.heartbeat("w00")
    alive_tick(s, 30, silent=("w01",))  # w01 is still in phase init (30 s)
    s.at(30.5)
    s.heartbeat("w00")
    detected = only(s.decide(), "fault.detected")
    assert detected.members == ["w01"]
    assert detected.detail == "w01 silent for 30.5s in phase init (timeout 30s)"
    assert detected.evidence[0].what == "member.joined"
    assert detected.evidence[0].at == T0


# --------------------------------------------------------------------------- 3. slow


def test_a_slow_member_that_keeps_heartbeating_is_not_failed():
    s = running(1)
    t = 1.0
    while t < 300:  # no train.step for five minutes, a heartbeat every 4.5 s
        t += 4.5
        s.at(t)
        s.heartbeat_all(step=23)
        assert s.decide() == []
    assert s.v.state is S.RUNNING
    assert s.v.incidents == {}
    assert all(m.status is MemberStatus.ACTIVE for m in s.v.members.values())
    assert s.v.last_step == 23


# --------------------------------------------------------------------------- 4. two at once


@pytest.mark.parametrize(
    ("spares", "mode", "world", "sources"),
    [
        (
            2,
            ReallocationMode.REPLACE,
            ["w00", "spare0", "w10", "spare1"],
            {0: "w00", 1: "w00", 2: "w10", 3: "w10"},
        ),
        (0, ReallocationMode.SHRINK, ["w00", "w10"], {0: "w00", 1: "w00", 2: "w10", 3: "w10"}),
    ],
    ids=["two-spares", "shrink"],
)
def test_two_failures_in_different_racks_are_one_incident_and_one_decision(
    spares, mode, world, sources
):
    s = running(spares)
    s.at(2)
    s.exited("w01")
    s.exited("w11")
    decided = s.decide()
    assert kinds(decided) == CRASH
    detected = only(decided, "fault.detected")
    assert detected.members == ["w01", "w11"]
    assert detected.detail == "w01 killed by signal 9; w11 killed by signal 9"
    assert [e.member for e in detected.evidence] == ["w01", "w11"]
    realloc = only(decided, "reallocation.issued")
    assert (realloc.mode, realloc.world, realloc.restore_step) == (mode, world, 20)
    assert plan(realloc) == sources
    [incident] = s.v.incidents.values()
    assert incident.members == ["w01", "w11"]
    assert len(incident.decisions) == 1


def test_two_failures_of_different_kinds_in_one_call_share_the_incident():
    s = running(2)
    s.at(2)
    s.heartbeat(*(m for m in s.v.members if m != "w11"))
    s.exited("w01")
    s.at(6.5)  # w11's last heartbeat was at t=1
    s.heartbeat(*(m for m in s.v.members if m not in ("w01", "w11")))
    decided = s.decide()
    assert kinds(decided) == ["fault.detected", *CRASH]
    first, second = (d.payload for d in decided if d.type == "fault.detected")
    assert (first.members, first.reason) == (["w01"], FaultReason.EXITED)
    assert (second.members, second.reason) == (["w11"], FaultReason.HEARTBEAT_TIMEOUT)
    assert first.incident_id == second.incident_id
    assert (
        reasons(decided)[0]
        == "w01 killed by signal 9; w11 silent for 5.5s in phase train (timeout 5s)"
    )
    assert only(decided, "reallocation.issued").world == ["w00", "spare0", "w10", "spare1"]
    assert len(s.v.incidents) == 1


# --------------------------------------------------------------------------- 5. cascade


def test_a_failure_while_recovering_re_decides_inside_the_same_incident():
    s, _ = crash_w01(spares=2)
    incident = decision_id(JOB, "incident/1")
    s.at(2.5)
    report(s, "command.acked")  # generation 2 is under way ...
    s.at(3)
    s.exited("w10")  # ... when w10 dies
    decided = s.decide()
    assert kinds(decided) == CASCADE
    detected = only(decided, "fault.detected")
    assert (str(detected.incident_id), detected.members) == (incident, ["w10"])
    assert decided[0].event_id == decision_id(JOB, "detected/2")
    assert transitions(decided) == [(S.RECOVERING, S.REALLOCATING), (S.REALLOCATING, S.RECOVERING)]
    assert reasons(decided)[0] == "while recovering: w10 killed by signal 9"
    realloc = only(decided, "reallocation.issued")
    assert str(realloc.incident_id) == incident
    assert realloc.generation == 3 == only(decided, "generation.started").generation
    assert str(realloc.command_id) == decision_id(JOB, "command/3")
    assert realloc.mode is ReallocationMode.REPLACE
    assert realloc.world == ["w00", "spare0", "spare1", "w11"]
    assert realloc.restore_step == 20
    # Shard 2 (w10's) is held by w11 and w00: spare1 (rack1) takes it from w11.
    assert plan(realloc) == {0: "w00", 1: "w00", 2: "w11", 3: "w11"}
    assert len(s.v.incidents) == 1
    assert [d.generation for d in s.v.incidents[incident].decisions] == [2, 3]

    s.at(4)
    s.recover()
    resolved = s.decide()
    assert kinds(resolved) == RESOLVED
    assert str(only(resolved, "incident.resolved").incident_id) == incident
    assert transitions(resolved) == [(S.RECOVERING, S.RUNNING)]
    assert reasons(resolved) == ["generation 3 took its first step"]
    s.at(5)
    s.heartbeat_all()
    assert s.decide() == []
    assert len(s.of_type("incident.resolved")) == 1
    assert s.v.incidents[incident].outcome == "recovered"
    assert s.v.open_incident is None


def test_the_next_fault_after_a_resolution_opens_a_new_incident():
    s, _ = crash_w01(spares=2)
    s.at(3)
    s.recover()
    s.decide()
    s.at(4)
    s.heartbeat_all()
    s.exited("w10")
    detected = only(s.decide(), "fault.detected")
    assert str(detected.incident_id) == decision_id(JOB, "incident/2")
    assert len(s.v.incidents) == 2


# --------------------------------------------------------------------------- 6. backups lost


def replicate_to(s: Scenario, step: int, holders: dict[int, list[str]]) -> None:
    """Every rank snapshots its shard at ``step``; ``holders[shard]`` replicate it."""
    events = []
    for shard, owner in enumerate(s.v.world):
        checksum = f"crc32:{step:04x}{shard:04x}"
        common = {"step": step, "shard": shard, "nbytes": 100, "checksum": checksum}
        events.append(
            s.ev.make(
                "backup.snapshot",
                {**common, "seconds": 0.01},
                source=s._src(owner),
                generation=s.v.generation,
            )
        )
        events += [
            s.ev.make(
                "backup.replicated",
                {**common, "owner": owner, "seconds": 0.01},
                source=s._src(h),
                generation=s.v.generation,
            )
            for h in holders[shard]
        ]
    s.add(*events)


def test_when_the_newest_backup_lost_every_copy_of_a_shard_the_older_complete_one_is_restored():
    """Redundancy 1. Step 10 follows the placement (shard 1 on w11); step 20 was replicated
    elsewhere (shard 1 on w00). w00 and w01 die together: step 20 has no copy of shard 1."""
    s = Scenario(JOB, world_size=4, min_world=2, redundancy=1)
    s.cluster(2, 2, spares=2)
    s.decide()
    ring = {0: ["w10"], 1: ["w11"], 2: ["w00"], 3: ["w01"]}
    assert {r: list(h) for r, h in enumerate(s.v.placement)} == ring
    s.at(1)
    s.heartbeat_all()
    s.step(10)
    replicate_to(s, 10, ring)
    s.step(20)
    replicate_to(s, 20, {**ring, 1: ["w00"]})
    s.step(23)
    assert s.v.last_complete_backup == 20 and sorted(s.v.backups) == [10, 20]
    s.at(2)
    s.exited("w00")
    s.exited("w01")
    decided = s.decide()
    assert kinds(decided) == CRASH
    realloc = only(decided, "reallocation.issued")
    assert realloc.world == ["spare0", "spare1", "w10", "w11"]
    assert (realloc.restore_step, realloc.restore_from) == (10, RestoreFrom.MEMORY)
    assert plan(realloc) == {0: "w10", 1: "w11", 2: "w10", 3: "w11"}
    assert (
        reasons(decided)[1] == "replace w00 with spare0; replace w01 with spare1; restore step 10"
    )


def lose_shard_1_in_a_cascade(checkpoint: int | None) -> tuple[Scenario, list[Decided]]:
    """Redundancy 1: shard 1 lives on w01 and w11. w01 crashes (restore step 20, shard 1 from
    w11); while recovering w11, the only surviving holder, dies too."""
    s = Scenario(JOB, world_size=4, min_world=2, redundancy=1)
    s.cluster(2, 2, spares=2)
    s.decide()
    s.at(1)
    s.heartbeat_all()
    s.step(10)
    s.backup(10)
    if checkpoint is not None:
        s.step(checkpoint)
        s.checkpoint(checkpoint)
    s.step(20)
    s.backup(20)
    s.step(23)
    s.at(2)
    s.exited("w01")
    first = only(s.decide(), "reallocation.issued")
    assert (first.restore_step, plan(first)[1]) == (20, "w11")
    s.at(3)
    s.exited("w11")
    return s, s.decide()


def test_losing_the_only_surviving_holder_falls_back_to_the_cold_checkpoint():
    _, decided = lose_shard_1_in_a_cascade(checkpoint=15)
    assert kinds(decided) == CASCADE
    realloc = only(decided, "reallocation.issued")
    assert realloc.world == ["w00", "spare0", "w10", "spare1"]
    assert (realloc.restore_step, realloc.restore_from) == (15, RestoreFrom.CHECKPOINT)
    assert realloc.plan == []
    assert reasons(decided)[1] == "generation 3: 4 members restore step 15 from checkpoint"


def test_losing_every_copy_with_no_checkpoint_stops_the_job():
    s, decided = lose_shard_1_in_a_cascade(checkpoint=None)
    assert kinds(decided) == ["fault.detected", "job.state_changed", "job.stopped"]
    assert transitions(decided) == [(S.RECOVERING, S.REALLOCATING)]
    assert only(decided, "job.stopped").reason == (
        "no complete copy of the state survives: every copy of a shard of each backup"
        " (newest complete: step 20) was on failed members, and there is no cold checkpoint"
    )
    assert s.v.state is S.STOPPED
    assert s.v.incidents[decision_id(JOB, "incident/1")].outcome == "stopped"
    s.at(100)
    assert s.decide() == []


def test_a_whole_hot_backup_wins_over_a_newer_cold_checkpoint():
    """The issue's order: hot copies first (seconds from memory), the disk only without."""
    s = running(2)
    s.step(25)
    s.checkpoint(25)
    s.at(2)
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert (realloc.restore_step, realloc.restore_from) == (20, RestoreFrom.MEMORY)


def test_an_incomplete_checkpoint_is_not_restored():
    s = running(2)
    s.step(25)
    s.add(
        s.ev.make(
            "checkpoint.saved",
            {"step": 25, "shard": 0, "shards": 4, "path": "/ckpt/25/0", "nbytes": 100,
             "checksum": "crc32:00", "seconds": 0.1},
            source=s._src("w00"),
            generation=1,
        )
    )  # fmt: skip
    s.at(2)
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert (realloc.restore_step, realloc.restore_from) == (20, RestoreFrom.MEMORY)


def test_with_no_complete_backup_ever_the_job_restarts_from_the_initial_state():
    s = running(2, replicate=False)  # snapshots only: no backup ever complete
    assert s.v.last_complete_backup is None
    s.at(2)
    s.exited("w01")
    decided = s.decide()
    assert kinds(decided) == CRASH
    realloc = only(decided, "reallocation.issued")
    assert (realloc.restore_step, realloc.restore_from, realloc.plan) == (
        0,
        RestoreFrom.INITIAL,
        [],
    )
    assert reasons(decided)[1:] == [
        "replace w01 with spare0; restore step 0",
        "generation 2: 4 members restore step 0 from initial",
    ]


# --------------------------------------------------------------------------- 7. too few


def test_too_few_survivors_and_no_spare_stop_the_job():
    s, decided = crash_w01(spares=0, min_world=4)
    assert kinds(decided) == ["fault.detected", "job.state_changed", "job.stopped"]
    assert transitions(decided) == [(S.RUNNING, S.DEGRADED)]
    assert only(decided, "job.stopped").reason == (
        "too few members to go on: 3 survive and 0 spares can replace 1 failed (w01),"
        " fewer than min_world 4"
    )
    assert s.v.state is S.STOPPED


@pytest.mark.parametrize(
    ("spares", "min_world", "mode", "world"),
    [
        (1, 4, ReallocationMode.REPLACE, ["w00", "spare0", "w10", "w11"]),
        (0, 3, ReallocationMode.SHRINK, ["w00", "w10", "w11"]),
    ],
    ids=["spare-replaces", "shrink-to-min-world"],
)
def test_a_spare_replaces_else_the_world_shrinks_down_to_min_world(spares, min_world, mode, world):
    _, decided = crash_w01(spares=spares, min_world=min_world)
    assert kinds(decided) == CRASH
    realloc = only(decided, "reallocation.issued")
    assert (realloc.mode, realloc.world, realloc.restore_step) == (mode, world, 20)
    if mode is ReallocationMode.SHRINK:
        assert realloc.reason == "shrink to 3 without w01 (no spare); restore step 20"
        # Every survivor takes its own shard from its own memory, although ranks moved.
        assert plan(realloc) == {0: "w00", 1: "w11", 2: "w10", 3: "w11"}


# --------------------------------------------------------------------------- 8. deadline


def laggard_w11(**policy: Any) -> Scenario:
    """w01 crashed at t=2; everyone acks at t=3, all but w11 restore (t=4) and resume (t=5),
    then everyone keeps heartbeating until t=62 (the recovery deadline is 60 s)."""
    s, _ = crash_w01(spares=2, **policy)
    s.at(3)
    report(s, "command.acked")
    s.at(4)
    report(s, "restore.completed", ["w00", "spare0", "w10"])
    s.at(5)
    report(s, "train.resumed", ["w00", "spare0", "w10"])
    alive_tick(s, 62)  # exactly at the deadline: nothing yet
    s.at(62.5)
    s.heartbeat_all()
    return s


def test_members_that_miss_the_recovery_deadline_are_dropped_and_the_incident_re_decided():
    s = laggard_w11()
    decision = s.v.incidents[decision_id(JOB, "incident/1")].decisions[-1]
    decided = s.decide()
    assert kinds(decided) == CASCADE
    detected = only(decided, "fault.detected")
    assert str(detected.incident_id) == decision_id(JOB, "incident/1")
    assert detected.members == ["w11"]
    assert detected.reason is FaultReason.RECOVERY_DEADLINE
    assert detected.detail == "w11 did not resume generation 2 within 60s (acked, not restored)"
    assert detected.evidence == [
        Evidence(member="w11", what="reallocation.issued", position=decision.position, at=at(2))
    ]
    assert transitions(decided) == [(S.RECOVERING, S.REALLOCATING), (S.REALLOCATING, S.RECOVERING)]
    assert reasons(decided)[0] == f"recovery deadline missed: {detected.detail}"
    realloc = only(decided, "reallocation.issued")
    assert realloc.generation == 3
    assert realloc.world == ["w00", "spare0", "w10", "spare1"]
    assert s.v.members["w11"].status is MemberStatus.FAILED


def test_an_incident_that_reaches_max_decisions_stops_the_job():
    s = laggard_w11(max_decisions_per_incident=1)
    decided = s.decide()
    assert kinds(decided) == ["fault.detected", "job.state_changed", "job.stopped"]
    assert transitions(decided) == [(S.RECOVERING, S.REALLOCATING)]
    assert only(decided, "job.stopped").reason == (
        f"incident {decision_id(JOB, 'incident/1')}: 1 decisions did not bring the job back"
        " (max_decisions_per_incident 1)"
    )
    assert s.v.state is S.STOPPED


def test_a_world_that_resumed_but_takes_no_step_before_the_deadline_stops():
    s, _ = crash_w01(spares=2)
    s.at(3)
    s.recover(first_step=False)
    alive_tick(s, 62)
    s.at(62.5)
    s.heartbeat_all()
    decided = s.decide()
    assert kinds(decided) == ["job.stopped"]
    assert only(decided, "job.stopped").reason == (
        "generation 2 took no step within 60s although every member resumed"
    )
    assert s.v.state is S.STOPPED


# --------------------------------------------------------------------------- 9. resolution


def test_the_first_step_of_the_new_generation_resolves_the_incident_with_its_timeline():
    s = running(2)
    s.at(2)
    s.exited("w01")  # the fault at t=2
    s.at(2.5)
    s.heartbeat_all()
    assert kinds(s.decide()) == CRASH  # detected and decided at t=2.5
    s.at(3)
    report(s, "command.acked", ["w00", "spare0", "w10"])
    s.at(3.5)
    report(s, "command.acked", ["w11"])  # the last ack
    assert s.decide() == []
    s.at(5.5)
    report(s, "restore.completed")
    s.at(6)
    report(s, "train.resumed")
    assert s.decide() == []
    s.at(7.5)
    s.step(21)
    decided = s.decide()
    assert kinds(decided) == RESOLVED
    resolved = only(decided, "incident.resolved")
    assert str(resolved.incident_id) == decision_id(JOB, "incident/1")
    assert resolved.phases == {
        "detect": 0.5,
        "decide": 0.0,
        "ack": 1.0,
        "restore": 2.0,
        "resume": 2.0,
    }
    assert resolved.downtime_s == 5.5
    assert resolved.steps_lost == 3  # step 23 at the fault, restored to 20
    assert resolved.steps_lost <= s.policy.backup_interval
    assert transitions(decided) == [(S.RECOVERING, S.RUNNING)]
    assert s.v.state is S.RUNNING and s.v.open_incident is None
    incident = s.v.incidents[decision_id(JOB, "incident/1")]
    assert (incident.outcome, incident.downtime_s, incident.steps_lost) == ("recovered", 5.5, 3)


def test_a_step_that_is_not_past_the_restore_step_or_of_an_old_generation_resolves_nothing():
    s, _ = crash_w01(spares=2)
    s.at(3)
    s.recover(first_step=False)
    s.step(20)  # the restore step itself, not a new one
    s.add(
        s.ev.make(
            "train.step",
            {"step": 24, "loss": 1.0, "step_seconds": 0.1, "samples": 8},
            source=s._src("w00"),
            generation=1,
        )
    )
    assert s.decide() == []
    s.step(21)
    assert kinds(s.decide()) == RESOLVED


# --------------------------------------------------------------------------- 10. pending


def test_the_first_joiner_registers_the_job_and_generation_1_waits_for_world_size_workers():
    asked = JobPolicy(world_size=3, min_world=2, backup_interval=7, redundancy=1)
    s = Scenario(JOB)
    s.join("w00", "node-0-0", "rack0", policy=asked)
    decided = s.decide()
    assert kinds(decided) == ["job.registered"]
    assert decided[0].event_id == decision_id(JOB, "registered")
    assert only(decided, "job.registered").policy == asked
    assert (s.v.policy, s.v.registered_at, s.v.state) == (asked, T0, S.PENDING)

    s.at(1)
    s.join("spare0", "spare-node-0", "rack0", role="spare")
    s.join("w10", "node-1-0", "rack1")
    assert s.decide() == []  # two workers (and a spare) of the three
    s.at(2)
    s.join("w01", "node-0-1", "rack0")
    decided = s.decide()
    assert kinds(decided) == ["generation.started", "job.state_changed"]
    started = only(decided, "generation.started")
    assert (started.generation, started.world) == (1, ["w00", "w01", "w10"])  # by topology
    assert started.rendezvous == f"{RENDEZVOUS}/{JOB}/1"
    assert [len(h) for h in started.placement] == [1, 1, 1]
    assert transitions(decided) == [(S.PENDING, S.RUNNING)]
    assert reasons(decided) == ["3 workers joined (the job waits for 3)"]
    assert s.v.members["spare0"].rank is None
    assert s.v.started_position == position_of(s, "generation.started")


def test_nothing_is_decided_before_anyone_joins_and_only_the_first_policy_registers():
    assert decide(JobView(job_id=JOB), T0) == []
    assert next_deadline(JobView(job_id=JOB)) is None
    s = Scenario(JOB, world_size=2)
    s.join("w00", "n0", "rack0")
    s.decide()
    # A later joiner's policy is only a request; the registered one stays.
    s.add(
        s.ev.joined(
            "w01",
            node="n1",
            rack="rack1",
            payload={"policy": JobPolicy(world_size=1).model_dump(mode="json")},
        )
    )
    s.nodes["w01"] = "n1"
    decided = s.decide()
    assert kinds(decided) == ["generation.started", "job.state_changed"]
    assert s.v.policy is not None and s.v.policy.world_size == 2
    assert len(s.of_type("job.registered")) == 1


@pytest.mark.parametrize(
    ("min_world", "expected"),
    [
        (2, ["generation.started", "job.state_changed"]),
        (4, ["job.stopped"]),
    ],
    ids=["starts-with-min-world", "stops-below-min-world"],
)
def test_the_start_timeout_starts_with_at_least_min_world_or_stops(min_world, expected):
    timeouts = {Phase.INIT: 10.0, Phase.TRAIN: 5.0}
    s = Scenario(
        JOB, world_size=4, min_world=min_world, start_timeout_s=30.0, heartbeat_timeout_s=timeouts
    )
    s.join("w00", "node-0-0", "rack0")
    s.join("w01", "node-0-1", "rack0")
    s.join("spare0", "spare-node-0", "rack1", role="spare")  # a spare never fills the world
    s.join("stale", "node-1-1", "rack1")  # a worker that goes silent
    assert kinds(s.decide()) == ["job.registered"]
    s.at(12)
    s.heartbeat("w00", "w01", "spare0", phase="init")
    s.join("w10", "node-1-0", "rack1")
    assert s.decide() == []  # four workers joined, but "stale" (silent 12 s) does not count
    s.at(22)
    s.heartbeat("w00", "w01", "w10", "spare0", phase="init")
    assert next_deadline(s.v) == at(30)
    s.at(30)
    assert s.decide() == []
    s.at(30.5)
    decided = s.decide()
    assert kinds(decided) == expected
    if min_world == 2:
        assert only(decided, "generation.started").world == ["w00", "w01", "w10"]
        assert reasons(decided) == [
            "start timeout (30s): starting with 3 of the 4 workers the job waits for"
        ]
        assert s.v.state is S.RUNNING
    else:
        assert only(decided, "job.stopped").reason == (
            "only 3 of the 4 workers the job waits for joined within 30s, fewer than min_world 4"
        )
        assert s.v.state is S.STOPPED


# --------------------------------------------------------------------------- 11. growth


def test_a_member_joining_while_running_is_grown_in_at_the_next_complete_backup():
    s = running(0, max_world=5)
    s.at(2)
    s.join("late0", "late-node-0", "rack1", role="spare")
    s.heartbeat_all()
    assert s.v.members["late0"].joined_step == 23
    assert s.decide() == []  # the newest complete backup (20) predates its join (step 23)
    s.step(30)
    s.backup(30, replicate=False)
    assert s.decide() == []  # the backup of step 30 is not complete yet
    s.backup(30)
    decided = s.decide()
    assert kinds(decided) == [
        "job.state_changed",
        "reallocation.issued",
        "generation.started",
        "job.state_changed",
    ]
    reason = "grow to 5 with late0 at the backup of step 30"
    assert transitions(decided) == [(S.RUNNING, S.REALLOCATING), (S.REALLOCATING, S.RECOVERING)]
    assert reasons(decided)[0] == reason
    realloc = only(decided, "reallocation.issued")
    incident = decision_id(JOB, "incident/1")
    assert str(realloc.incident_id) == incident
    assert realloc.mode is ReallocationMode.GROW
    assert realloc.world == ["w00", "w01", "w10", "w11", "late0"]
    assert (realloc.generation, realloc.restore_step) == (2, 30)
    assert plan(realloc) == {0: "w00", 1: "w01", 2: "w10", 3: "w11"}
    assert realloc.reason == reason
    assert only(decided, "generation.started").world == realloc.world
    grown = s.v.incidents[incident]
    assert (grown.kind, grown.members, grown.detections) == ("growth", ["late0"], [])

    s.at(3)
    s.recover()
    decided = s.decide()
    assert kinds(decided) == RESOLVED
    assert only(decided, "incident.resolved").steps_lost == 0
    assert s.v.world == ("w00", "w01", "w10", "w11", "late0")


def test_growth_stops_at_max_world():
    s = running(0, max_world=5)
    s.at(2)
    s.join("late1", "late-node-1", "rack1")
    s.join("late0", "late-node-0", "rack0")
    s.heartbeat_all()
    s.step(30)
    s.backup(30)
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.world == ["w00", "w01", "w10", "w11", "late0"]  # rack0 first; room for one
    s.at(3)
    s.recover()
    s.decide()
    s.step(40)
    s.backup(40)
    assert s.decide() == []  # late1 stays out: the world is at max_world
    assert s.v.members["late1"].rank is None


def test_no_growth_when_the_world_is_already_at_max_world():
    s = running(0, max_world=4)
    s.at(2)
    s.join("late0", "late-node-0", "rack0", role="spare")
    s.heartbeat_all()
    s.step(30)
    s.backup(30)
    assert s.decide() == []
    assert s.v.incidents == {}


# --------------------------------------------------------------------------- 12. terminal


def test_train_completed_completes_the_job_and_a_terminal_job_decides_nothing():
    s = running(1)
    s.at(2)
    s.add(s.ev.make("train.completed", {"step": 100}, source=s._src("w00"), generation=1))
    decided = s.decide()
    assert kinds(decided) == ["job.completed"]
    assert decided[0].event_id == decision_id(JOB, "completed")
    assert only(decided, "job.completed").step == 100
    assert s.v.state is S.COMPLETED
    assert s.v.history[-1].to_state is S.COMPLETED
    s.exited("w01")
    s.at(1000)
    assert s.decide() == []
    assert next_deadline(s.v) is None


def test_a_stopped_job_decides_nothing():
    s, _ = crash_w01(spares=0, min_world=4)
    assert s.v.state is S.STOPPED
    s.at(5)
    s.exited("w10")
    s.join("spare9", "spare-node-9", "rack0", role="spare")
    s.at(1000)
    assert s.decide() == []
    assert next_deadline(s.v) is None


# --------------------------------------------------------------------------- 13. idempotence


def test_deciding_is_deterministic_stable_and_never_repeats_itself():
    one = running(2)
    one.at(2)
    one.exited("w01")
    view = one.v
    first = decide(view, one.now, one.context)
    assert decide(view, one.now, one.context) == first
    assert view == one.v  # the view handed in is untouched

    # The same history built again (every member event has a new random id): same ids.
    two = running(2)
    two.at(2)
    two.exited("w01")
    assert [d.event_id for d in decide(two.v, two.now, two.context)] == [d.event_id for d in first]

    recorded = one.decide()
    assert recorded == first
    assert decide(one.v, one.now, one.context) == []
    one.at(3)
    one.heartbeat_all()
    assert one.decide() == []
    ids = [s.event.event_id for s in one.log]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------------------- 14. deadlines


def test_next_deadline_is_the_earliest_heartbeat_expiry():
    s = running(1, heartbeat_timeout_s=HANG_TIMEOUTS)
    s.at(2)
    s.heartbeat("w00", "w01", "w11", "spare0")
    s.heartbeat("w10", phase="backup")  # 12 s
    s.at(3)
    s.heartbeat("w00", "w10", "w11")
    # w01's heartbeat at t=2 (train, 4 s) expires first; w10 is no longer in backup.
    deadline = next_deadline(s.v)
    assert deadline == at(6)
    assert decide(s.v, deadline, s.context) == []
    detected = only(decide(s.v, deadline + timedelta(microseconds=1), s.context), "fault.detected")
    assert (detected.members, detected.reason) == (["w01"], FaultReason.HEARTBEAT_TIMEOUT)


def test_next_deadline_follows_the_phase_timeout():
    s = running(0, heartbeat_timeout_s=HANG_TIMEOUTS)
    s.at(2)
    s.heartbeat(*s.v.world, phase="backup")
    s.at(3)
    s.heartbeat(*s.v.world, phase="restore")
    s.heartbeat("w10", phase="backup")
    assert next_deadline(s.v) == at(15)  # w10: backup (12 s) from t=3; others: 20 s
    assert decide(s.v, at(15), s.context) == []
    assert only(decide(s.v, at(15.001), s.context), "fault.detected").members == ["w10"]


def test_next_deadline_is_the_recovery_deadline_when_that_comes_first():
    s, _ = crash_w01(spares=2, heartbeat_timeout_s=HANG_TIMEOUTS)
    s.at(3)
    report(s, "command.acked", ["w00", "spare0", "w10"])
    s.at(40)
    s.heartbeat_all(phase="restore")  # expiries at t=60
    s.at(45)
    s.heartbeat_all(phase="restore")  # expiries at t=65; the recovery deadline is t=62
    deadline = next_deadline(s.v)
    assert deadline == at(62)
    assert decide(s.v, deadline, s.context) == []
    after = decide(s.v, deadline + timedelta(microseconds=1), s.context)
    detected = only(after, "fault.detected")
    assert detected.reason is FaultReason.RECOVERY_DEADLINE
    # w11 never acked; the others acked and wait for it to form the group: w11 alone is late,
    # and the last spare takes its place.
    assert detected.members == ["w11"]
    assert detected.detail == "w11 did not resume generation 2 within 60s (never acked)"
    assert only(after, "reallocation.issued").world == ["w00", "spare0", "w10", "spare1"]
    assert not [e for e in after if e.type == "job.stopped"]


def test_members_equally_behind_at_the_recovery_deadline_are_all_dropped():
    """Every member acked and none restored: nothing tells who holds the others up."""
    s, _ = crash_w01(spares=2, heartbeat_timeout_s=HANG_TIMEOUTS)
    s.at(3)
    report(s, "command.acked")
    alive_tick(s, 62)
    after = decide(s.v, at(62.001), s.context)
    assert only(after, "fault.detected").members == ["w00", "spare0", "w10", "w11"]
    assert only(after, "job.stopped").reason.startswith("too few members to go on")


def test_next_deadline_while_pending_and_before_registration():
    s = Scenario(JOB, world_size=2, start_timeout_s=40.0)
    s.join("w00", "n0", "rack0")
    assert next_deadline(s.v) is None  # not registered yet: the join itself calls for a decision
    s.at(5)
    s.decide()
    assert next_deadline(s.v) == at(45)


# --------------------------------------------------------------------------- 15. commands


def test_a_reallocation_is_owed_until_every_member_of_its_world_acked():
    s, decided = crash_w01(spares=2)
    realloc = only(decided, "reallocation.issued")
    [command] = owed(s.v)
    assert isinstance(command, Reallocate)
    assert command.command_id == realloc.command_id
    assert command.incident_id == realloc.incident_id
    assert command.decision_position == position_of(s, "reallocation.issued")
    assert command.issued_at == at(2)
    assert (command.generation, command.mode, command.world) == (2, realloc.mode, realloc.world)
    assert (command.restore_step, command.restore_from) == (20, RestoreFrom.MEMORY)
    assert command.plan == realloc.plan
    assert command.placement == only(decided, "generation.started").placement
    assert command.rendezvous == realloc.rendezvous
    # Each rank's process: the incarnation of the member's join the view holds.
    assert command.incarnations == [s.v.members[m].incarnation for m in command.world]
    assert len(command.incarnations) == len(command.world) == 4
    assert COMMAND_ADAPTER.validate_json(command.model_dump_json()).model_dump() == (
        command.model_dump()
    )

    s.at(3)
    report(s, "command.acked", ["w00", "spare0", "w10"])
    assert [c.command_id for c in owed(s.v)] == [realloc.command_id]
    report(s, "command.acked", ["w11"])
    assert owed(s.v) == []


def test_a_cascade_owes_only_the_latest_reallocation():
    s, _ = crash_w01(spares=2)
    s.at(3)
    s.exited("w10")
    decided = s.decide()
    [command] = owed(s.v)
    assert command.command_id == only(decided, "reallocation.issued").command_id
    assert command.generation == 3


def test_a_stop_is_owed_while_members_of_a_stopped_job_are_alive():
    s, decided = crash_w01(spares=0, min_world=4)
    [command] = owed(s.v)
    assert isinstance(command, Stop)
    assert str(command.command_id) == decision_id(JOB, "stop-command")
    assert command.decision_position == position_of(s, "job.stopped")
    assert command.issued_at == at(2)
    assert command.reason == only(decided, "job.stopped").reason


def test_no_stop_is_owed_when_no_member_is_alive():
    s = Scenario(JOB, world_size=2, min_world=2)
    s.join("w00", "n0", "rack0")
    s.join("w01", "n1", "rack1")
    s.decide()
    s.at(1)
    s.exited("w00")
    s.exited("w01")
    assert kinds(s.decide()) == ["fault.detected", "job.state_changed", "job.stopped"]
    assert owed(s.v) == []


# --------------------------------------------------------------------------- properties


def copies(view: JobView, step: int, shard: int, alive: set[str]) -> set[str]:
    """Members in ``alive`` with a verified copy of ``shard`` at ``step`` (written out here,
    independent of the code under test)."""
    entry = view.backups[step].shards.get(shard)
    if entry is None or entry.checksum is None:
        return set()
    found = {entry.owner} if entry.owner in alive else set()
    return found | {
        h for h, c in entry.replicas.items() if c.checksum == entry.checksum and h in alive
    }


def covered(view: JobView, step: int, alive: set[str]) -> bool:
    backup = view.backups[step]
    return all(copies(view, step, shard, alive) for shard in range(backup.num_shards))


def check_round(before: JobView, after: JobView, decided: list[Decided], s: Scenario) -> None:
    """What must hold of one decide call: placements, restore points, wire validity."""
    members = after.members
    alive = {m for m, member in members.items() if member.status is MemberStatus.ACTIVE}
    for d in decided:
        # What was decided is a valid event on the wire.
        wire = envelope(JOB, d, s.now, 1)
        assert EVENT_ADAPTER.validate_json(wire.model_dump_json()) == wire
        if d.type == "generation.started":
            racks = {members[m].rack for m in d.payload.world}
            assert len(d.payload.placement) == len(d.payload.world)
            for owner, holders in zip(d.payload.world, d.payload.placement, strict=True):
                assert owner not in holders
                if len(racks) >= 2 and holders:
                    assert len({members[m].rack for m in (owner, *holders)}) >= 2, holders
        if d.type == "reallocation.issued":
            p = d.payload
            assert set(p.world) <= alive
            newer = [step for step in before.backups if step > p.restore_step]
            assert not any(covered(before, step, alive) for step in newer)
            if p.restore_from is RestoreFrom.MEMORY:
                backup = before.backups[p.restore_step]
                sources = plan(p)
                assert sorted(sources) == list(range(backup.num_shards))
                for shard, source in sources.items():
                    assert source in copies(before, p.restore_step, shard, alive)
                    owner = backup.shards[shard].owner
                    if owner in p.world:
                        assert source == owner  # a survivor's own shard: its own memory
            elif p.restore_from is RestoreFrom.CHECKPOINT:
                cold = before.newest_complete_checkpoint()
                assert cold is not None and cold.step == p.restore_step
                assert not any(
                    covered(before, step, alive) for step in before.backups if step >= cold.step
                )
            else:
                assert p.restore_step == 0 and before.last_complete_backup is None
                assert not any(covered(before, step, alive) for step in before.backups)
        if d.type == "job.stopped" and "no complete copy" in d.payload.reason:
            assert not any(covered(before, step, alive) for step in before.backups)


@settings(max_examples=100, deadline=None)
@given(
    racks=st.integers(1, 4),
    nodes=st.integers(1, 4),
    spares=st.integers(0, 3),
    redundancy=st.integers(1, 3),
    failures=st.lists(st.integers(0, 19), min_size=1, max_size=5, unique=True),
    cascade=st.lists(st.integers(0, 19), max_size=3, unique=True),
    later=st.lists(st.integers(0, 19), max_size=3, unique=True),
    partial=st.sets(st.integers(0, 15), max_size=4),
    checkpoint=st.booleans(),
)
def test_properties_over_random_topologies_and_failures(
    *, racks, nodes, spares, redundancy, failures, cascade, later, partial, checkpoint
):
    s = Scenario(JOB, world_size=racks * nodes, min_world=1, redundancy=redundancy)
    workers = s.cluster(racks, nodes, spares)
    everyone = [*workers, *(f"spare{i}" for i in range(spares))]
    s.decide()
    s.at(1)
    s.heartbeat_all()
    s.step(10)
    s.backup(10)
    if checkpoint:
        s.step(15)
        s.checkpoint(15)
    s.step(20)
    # Step 20: the shards in ``partial`` were snapshotted but not replicated yet.
    world = s.v.world
    replicate_to(
        s,
        20,
        {r: [] if r in partial else list(s.v.placement[r]) for r in range(len(world))},
    )
    s.step(23)

    # Round 1 fails members of generation 1; round 2 more of them while recovering (a
    # cascade); round 3, after the recovery and a backup with the new generation's placement.
    for round_, picks in enumerate((failures, cascade, later), start=1):
        if s.v.state in TERMINAL:
            break
        s.at(1 + round_)
        if round_ == 3 and s.v.state is S.RECOVERING:
            s.recover()
            assert kinds(s.decide()) == RESOLVED
            s.step(30)
            s.backup(30)
            s.step(33)
        alive = [m for m in everyone if s.v.members[m].status is MemberStatus.ACTIVE]
        if not picks or not alive:
            continue
        for i in sorted({i % len(alive) for i in picks}):
            s.exited(alive[i])
        before = s.v
        decided = decide(before, s.now, s.context)
        assert decide(before, s.now, s.context) == decided  # deterministic
        assert s.decide() == decided
        check_round(before, s.v, decided, s)
        assert decide(s.v, s.now, s.context) == []
    for d in s.of_type("generation.started"):
        racks_of_world = {s.v.members[m].rack for m in d.world}
        for owner, holders in zip(d.world, d.placement, strict=True):
            if len(racks_of_world) >= 2 and holders:
                assert len({s.v.members[m].rack for m in (owner, *holders)}) >= 2


#: Walk actions; recoveries, training and joins are listed twice to reach RUNNING again often.
WALK = [
    "tick",
    "train",
    "train",
    "exit",
    "hang",
    "fault",
    "collective",
    "recover",
    "recover",
    "ack-some",
    "deadline",
    "join",
    "join",
    "complete",
]
ACTIONS = st.lists(st.tuples(st.sampled_from(WALK), st.integers(0, 30)), min_size=1, max_size=16)


@settings(max_examples=200, deadline=None)
@given(
    actions=ACTIONS,
    racks=st.integers(1, 3),
    spares=st.integers(0, 2),
    min_world=st.integers(1, 3),
    room=st.integers(0, 2),
)
def test_the_decider_never_records_an_invalid_transition(actions, racks, spares, min_world, room):
    s = Scenario(
        JOB, world_size=2 * racks, min_world=min(min_world, 2 * racks), max_world=2 * racks + room
    )
    s.cluster(racks, 2, spares)
    t = 0.0
    joined = 0

    def alive() -> list[str]:
        return [m for m, x in s.v.members.items() if x.status is MemberStatus.ACTIVE]

    def decide_and_check() -> None:
        before = s.v
        decided = s.decide()
        state = before.state
        for d in decided:
            assert state not in TERMINAL, (state, d.type)
            if d.type == "job.state_changed":
                assert d.payload.from_ is state
                assert can_transition(state, d.payload.to), (state, d.payload.to)
                state = d.payload.to
            elif d.type == "job.stopped":
                assert can_transition(state, S.STOPPED), state
                state = S.STOPPED
            elif d.type == "job.completed":
                assert can_transition(state, S.COMPLETED), state
                state = S.COMPLETED
        assert s.v.state is state
        assert not [a for a in s.v.anomalies if "transition" in a]
        assert decide(s.v, s.now, s.context) == []  # nothing decided twice

    decide_and_check()
    for action, pick in actions:
        if s.v.state in TERMINAL:
            break
        t += 1
        s.at(t)
        members = alive()
        target = members[pick % len(members)] if members else None
        world = [m for m in s.v.world if s.v.members[m].status is MemberStatus.ACTIVE]
        if action == "tick":
            s.heartbeat(*members)
        elif action == "train" and s.v.state is S.RUNNING:
            s.heartbeat(*members)
            step = (s.v.last_step // 10 + 1) * 10
            s.step(step)
            s.backup(step)
        elif action == "exit" and target is not None:
            s.exited(target)
        elif action == "hang" and target is not None:
            t += 6
            s.at(t)
            s.heartbeat(*(m for m in members if m != target))
        elif action == "fault" and target is not None:
            s.fault(target, "exception")
        elif action == "collective" and len(world) >= 2:
            s.fault(world[0], "collective_error", suspects=[world[pick % len(world)]])
        elif action in ("recover", "ack-some") and s.v.open_incident is not None:
            decision = s.v.incidents[s.v.open_incident].decisions
            if decision:
                who = [m for m in decision[-1].world if m in members]
                if action == "ack-some":
                    report(s, "command.acked", who[: pick % (len(who) + 1)])
                else:
                    s.recover(members=who)
        elif action == "deadline":
            for _ in range(31):  # 62 s with heartbeats every 2 s
                t += 2
                s.at(t)
                s.heartbeat(*alive())
                decide_and_check()
                if s.v.state in TERMINAL:
                    break
        elif action == "join":
            joined += 1
            s.join(f"late{joined}", f"late-node-{joined}", f"rack{pick % racks}", role="spare")
        elif action == "complete" and s.v.state is S.RUNNING and world:
            s.add(
                s.ev.make(
                    "train.completed",
                    {"step": 50},
                    source=s._src(world[0]),
                    generation=s.v.generation,
                )
            )
        s.heartbeat(*(m for m in alive() if action != "hang" or m != target))
        decide_and_check()
    ids = [e.event.event_id for e in s.log]
    assert len(ids) == len(set(ids))
    assert all(isinstance(uuid.UUID(i), uuid.UUID) for i in ids)


def test_a_rejoined_process_is_no_source_for_what_its_earlier_process_held():
    s = running(0)
    s.at(2)
    s.exited("w01")
    restarted = Events(JOB, incarnation="inc2")
    s.add(restarted.joined("w01", node="node-0-1", rack="rack0", payload={"role": "worker"}))
    s.heartbeat("w01")
    realloc = only(s.decide(), "reallocation.issued")
    sources = plan(realloc)
    assert sources[1] != "w01"  # its shard comes from a holder, not from the new process
    assert "w01" not in sources.values()


# --------------------------------------------------------------------------- re-deciding a log


def test_re_deciding_a_recorded_log_reproduces_every_decision():
    """A crash with a spare, a cascade, a recovery, a hang, a shrink: record it all, then
    re-run the decider before each recorded batch with the batch's time."""
    s, _ = crash_w01(spares=1)
    s.at(2.5)
    s.exited("w10")  # a cascade, no spare left: shrink
    assert s.decide()
    s.at(3)
    s.recover()
    assert s.decide()
    s.at(4)
    s.heartbeat("w00", "spare0", step=21)
    s.at(9.5)  # w11 is silent past its timeout
    s.heartbeat("w00", "spare0", step=21)
    assert s.decide()
    batches = redecide(s.log)
    assert len(batches) == len(decision_batches(s.log)) >= 5
    assert all(b.matches for b in batches)
    assert sum(len(b.recorded) for b in batches) == sum(
        1 for e in s.log if e.event.source == "controlplane"
    )


def test_re_deciding_notices_a_decision_the_decider_would_not_take():
    s, _ = crash_w01(spares=1)
    forged = list(s.log)
    # Move the exit after the decisions: before them, the decider had nothing to decide.
    exit_index = next(i for i, e in enumerate(forged) if e.event.type == "member.exited")
    forged.append(forged.pop(exit_index))
    renumbered = [StoredEvent(i, e.recorded_at, e.event) for i, e in enumerate(forged, 1)]
    assert not all(b.matches for b in redecide(renumbered))


def _steps_of(s: Scenario, step: int) -> list[StoredEvent]:
    """``train.step`` from every member of the world, stored after the log (not folded)."""
    payload = {"step": step, "loss": 0.5, "step_seconds": 0.1, "samples": 8}
    events = [
        s.ev.make("train.step", payload, source=s._src(m), generation=s.v.generation)
        for m in s.v.world
    ]
    return [StoredEvent(len(s.log) + i, s.now, e) for i, e in enumerate(events, start=1)]


def test_a_step_without_an_open_incident_changes_no_decision():
    """Why a commit of steps asks for no turn while the job has no open incident
    (``wakes``): folded or not, they change nothing ``decide`` decides, whether it has
    nothing to do (the world beating), a member to grow by (a spare, once a backup is
    complete), or a hang to detect."""
    s = running()
    s.at(2)
    s.join("w20", "node-2-0", "rack2")  # a worker joining while RUNNING: room to grow
    s.heartbeat_all()
    s.heartbeat("w20")
    seen = []
    for at, backup in ((2.5, False), (3.0, True), (5.5, False), (12.0, False)):
        s.at(at)
        if backup:
            s.step(24)
            s.backup(24)  # complete after w20 joined: the world may grow by it now
        assert s.v.open_incident is None
        with_steps = fold(s.v, _steps_of(s, 25))
        decided = decide(s.v, s.now, s.context)
        assert decide(with_steps, s.now, s.context) == decided, at
        seen.append(kinds(decided))
    # Nothing; the growth (twice: nothing is recorded here); every member silent since t=2.
    assert seen[0] == [] and all("reallocation.issued" in k for k in seen[1:3]), seen
    assert "fault.detected" in seen[3], seen


def test_steps_ask_for_a_turn_only_while_an_incident_is_open():
    s = running(spares=1)
    assert not wakes(s.v, "member.heartbeat") and not wakes(None, "member.heartbeat")
    assert not wakes(s.v, "train.step")
    assert wakes(None, "train.step")  # a job not folded yet
    for kind in ("member.exited", "member.fault", "member.joined", "backup.snapshot"):
        assert wakes(s.v, kind), kind
    s.at(2)
    s.exited("w00")
    s.decide()
    assert s.v.state is S.RECOVERING and wakes(s.v, "train.step")
    s.recover(first_step=False)
    s.step(21)  # the first step of the new generation: what the turn after it resolves
    assert s.v.open_incident is not None and wakes(s.v, "train.step")
    assert kinds(s.decide()) == ["incident.resolved", "job.state_changed"]
    assert s.v.open_incident is None and not wakes(s.v, "train.step")


def test_the_service_asks_for_a_turn_after_a_commit_that_wakes_it():
    from controlplane.decider import Decider
    from controlplane.store.port import AppendResult

    s = running()
    views = {JOB: s.v}
    decider = Decider(
        views=lambda: views, apply=lambda result: None, refresh=None, appender=None,
        publisher=None, context=s.context,
    )  # fmt: skip
    decider.wanted.clear()
    steps = _steps_of(s, 24)
    decider.on_commit(AppendResult(stored=steps))
    assert not decider.wanted.is_set()
    s.at(2)
    s.exited("w00")
    decider.on_commit(AppendResult(stored=[*steps, s.log[-1]]))
    assert decider.wanted.is_set()
    decider.wanted.clear()
    s.decide()  # an incident opens: the new generation's first step is awaited
    views[JOB] = s.v
    decider.on_commit(AppendResult(stored=steps))
    assert decider.wanted.is_set()
