"""The pure fold: given these events, this view."""

from __future__ import annotations

import copy
import itertools
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.fold import fold, fold_jobs
from controlplane.core.records import StoredEvent
from controlplane.core.view import KEEP_COMPLETE_BACKUPS, MemberStatus, ReplicaCopy, ShardBackup
from controlplane.synth import SyntheticJob
from schemas.common import JobState, Phase
from schemas.events import EVENT_ADAPTER
from tests.factories import T0, Events, recorded

INCIDENT = str(uuid.uuid4())
COMMAND = str(uuid.uuid4())


def cluster(ev: Events, members: int = 4, redundancy: int = 1) -> list:
    """Registration, joins on two racks, generation 0."""
    world = [f"m{i}" for i in range(members)]
    events = [
        ev.cp("job.registered", {"name": "t", "policy": {"redundancy": redundancy, "min_world": 2}})
    ]
    events += [ev.joined(m, node=f"n{i % 2}", rack=f"r{i % 2}") for i, m in enumerate(world)]
    events.append(
        ev.cp(
            "generation.started",
            {"generation": 0, "world": world, "rendezvous": "tcp://cp:1/g0", "placement": []},
        )
    )
    return events


def transition(ev: Events, frm: str, to: str, reason: str = "because") -> object:
    return ev.cp("job.state_changed", {"from": frm, "to": to, "reason": reason})


def test_members_topology_and_heartbeats():
    ev = Events()
    log = recorded([*cluster(ev), ev.heartbeat("m1", node="n1", step=7, phase="backup")])
    view = fold(None, log)
    assert view.policy is not None and view.policy.redundancy == 1
    assert [m.rank for m in view.members.values()] == [0, 1, 2, 3]
    m1 = view.members["m1"]
    assert (m1.node, m1.rack, m1.status) == ("n1", "r1", MemberStatus.ACTIVE)
    heartbeat = view.heartbeats["m1"]
    assert (heartbeat.at, heartbeat.position) == (log[-1].recorded_at, log[-1].position)
    assert (heartbeat.evidence, heartbeat.phase, m1.step) == ("member.heartbeat", Phase.BACKUP, 7)
    assert view.world == ("m0", "m1", "m2", "m3")
    assert view.last_position == len(log) and view.events == len(log)
    assert view.anomalies == []


def test_state_machine_history_and_an_impossible_transition_is_kept_as_an_anomaly():
    ev = Events()
    path = ["PENDING", "RUNNING", "DEGRADED", "REALLOCATING", "RECOVERING", "RUNNING"]
    events = [*cluster(ev)] + [transition(ev, a, b) for a, b in itertools.pairwise(path)]
    view = fold(None, recorded(events))
    assert view.state is JobState.RUNNING
    assert [(h.from_state, h.to_state) for h in view.history] == list(itertools.pairwise(path))
    assert view.anomalies == []
    view = fold(view, recorded([transition(ev, "RUNNING", "RECOVERING")], start=100))
    assert view.state is JobState.RECOVERING  # the log is the truth
    assert "transition" in view.anomalies[-1]


def _backup(
    ev: Events, step: int, members: int, checksum=lambda s, r: f"crc32:{s:04x}{r:04x}", generation=0
):
    out = []
    for r in range(members):
        out.append(
            ev.make(
                "backup.snapshot",
                {
                    "step": step,
                    "shard": r,
                    "nbytes": 10,
                    "checksum": checksum(step, r),
                    "seconds": 0.1,
                },
                source=f"n{r % 2}/m{r}",
                generation=generation,
            )
        )
    for r in range(members):
        holder = (r + 1) % members
        out.append(
            ev.make(
                "backup.replicated",
                {
                    "step": step,
                    "shard": r,
                    "owner": f"m{r}",
                    "nbytes": 10,
                    "checksum": checksum(step, r),
                    "seconds": 0.1,
                },
                source=f"n{holder % 2}/m{holder}",
                generation=generation,
            )
        )
    return out


def test_backup_catalog_completes_and_evicts_old_steps():
    ev = Events()
    events = cluster(ev)
    for step in (10, 20, 30, 40):
        events += _backup(ev, step, 4)
    view = fold(None, recorded(events))
    assert sorted(view.backups) == [30, 40][-KEEP_COMPLETE_BACKUPS:]
    newest = view.newest_complete_backup()
    assert newest is not None and newest.step == 40
    assert newest.shards[2].verified_holders() == ["m3"]
    assert newest.satisfied == newest.num_shards == 4


def test_an_owner_names_the_holders_that_kept_its_copy_in_one_record():
    """The runtime's form: one backup.snapshot per rank per backup, naming the holders that
    answered they keep the copy; the same catalog as a snapshot and a record per holder."""
    ev = Events()
    events = cluster(ev)
    for step in (10, 20):
        for r in range(4):
            events.append(ev.make("backup.snapshot", {
                "step": step, "shard": r, "nbytes": 10, "checksum": f"crc32:{step:04x}{r:04x}",
                "seconds": 0.1, "holders": [f"m{(r + 1) % 4}"]}, source=f"n{r % 2}/m{r}"))  # fmt: skip
    view = fold(None, recorded(events))
    by_replicas = fold(None, recorded([*cluster(Events()), *_backup(Events(), 10, 4),
                                       *_backup(Events(), 20, 4)]))  # fmt: skip
    newest = view.newest_complete_backup()
    assert newest is not None and newest.step == 20 and newest.satisfied == 4
    assert newest.shards[2].verified_holders() == ["m3"]
    assert by_replicas.newest_complete_backup() is not None
    assert [s.verified_holders() for s in newest.shards.values()] == [
        s.verified_holders() for s in by_replicas.newest_complete_backup().shards.values()
    ]
    assert view.anomalies == []
    # A holder that is no member, or the owner itself, holds nothing (and is noted).
    events.append(ev.make("backup.snapshot", {
        "step": 30, "shard": 0, "nbytes": 10, "checksum": "crc32:00300000", "seconds": 0.1,
        "holders": ["m0", "stranger"]}, source="n0/m0"))  # fmt: skip
    view = fold(None, recorded(events))
    assert view.backups[30].shards[0].verified_holders() == []
    assert any("'stranger' cannot hold" in a for a in view.anomalies)
    assert any("'m0' cannot hold" in a for a in view.anomalies)


def test_a_backup_folded_in_two_batches_copies_only_what_the_second_changes():
    """The reports of a large job's backup come in several batches: folding the second
    copies the shards it reports (the view before keeps its own), not every shard of the
    step, nor a member (a report changes none)."""
    ev = Events()
    events = cluster(ev)
    reports = [
        ev.make("backup.snapshot", {
            "step": 10, "shard": r, "nbytes": 10, "checksum": f"crc32:{r:04x}", "seconds": 0.1,
            "holders": [f"m{(r + 1) % 4}"]}, source=f"n{r % 2}/m{r}")
        for r in range(4)
    ]  # fmt: skip
    log = recorded([*events, *reports])
    first = fold(None, log[:-2])
    second = fold(first, log[-2:])
    before, after = first.backups[10], second.backups[10]
    assert before is not after and after.satisfied == 4 and before.satisfied == 2
    assert sorted(before.shards) == [0, 1] and sorted(after.shards) == [0, 1, 2, 3]
    assert after.shards[0] is before.shards[0] and after.shards[1] is before.shards[1]
    assert all(second.members[m] is first.members[m] for m in first.members)
    assert second == fold(None, log)


def test_a_replica_with_the_wrong_checksum_is_not_verified():
    ev = Events()
    events = cluster(ev)
    events += _backup(ev, 10, 4)
    events.append(
        ev.make(
            "backup.replicated",
            {
                "step": 20,
                "shard": 0,
                "owner": "m0",
                "nbytes": 10,
                "checksum": "crc32:dead",
                "seconds": 0.1,
            },
            source="n1/m1",
        )
    )
    events.append(
        ev.make(
            "backup.snapshot",
            {"step": 20, "shard": 0, "nbytes": 10, "checksum": "crc32:beef", "seconds": 0.1},
            source="n0/m0",
        )
    )
    view = fold(None, recorded(events))
    assert view.backups[20].shards[0].verified_holders() == []
    assert not view.backups[20].is_complete(1)
    assert view.newest_complete_backup().step == 10


@settings(max_examples=200, deadline=None)
@given(
    owner=st.none() | st.sampled_from(["a", "b"]),
    copies=st.dictionaries(st.sampled_from(["m1", "m2", "m3", "m4"]), st.sampled_from(["a", "b"])),
    redundancy=st.integers(0, 5),
)
def test_a_shard_is_satisfied_when_enough_holders_are_verified(owner, copies, redundancy):
    """``is_satisfied`` counts what ``verified_holders`` lists (the fold uses the count)."""
    shard = ShardBackup(shard=0, checksum=owner and f"crc32:{owner}")
    for holder, sum_ in copies.items():
        shard.replicas[holder] = ReplicaCopy(holder, 10, f"crc32:{sum_}", 1)
    expected = owner is not None and len(shard.verified_holders()) >= redundancy
    assert shard.is_satisfied(redundancy) is expected


def test_a_newer_generation_redoing_a_step_replaces_it():
    ev = Events()
    events = cluster(ev) + _backup(ev, 10, 4, checksum=lambda s, r: f"crc32:{r:04x}0001")
    events.append(
        ev.cp(
            "generation.started",
            {"generation": 1, "world": ["m0", "m1", "m2"], "rendezvous": "x"},
            generation=1,
        )
    )
    events += _backup(ev, 10, 3, checksum=lambda s, r: f"crc32:{r:04x}0002", generation=1)
    view = fold(None, recorded(events))
    backup = view.backups[10]
    assert (backup.generation, backup.num_shards) == (1, 3)
    assert backup.shards[0].checksum == "crc32:00000002"
    assert backup.is_complete(1)


def incident_log(ev: Events) -> list:
    events = [*cluster(ev), transition(ev, "PENDING", "RUNNING")]
    events += [
        ev.make("train.step", {"step": s, "loss": 1.0 / s, "step_seconds": 0.1, "samples": 8})
        for s in (1, 2, 3)
    ]
    events.append(ev.make("member.exited", {"member": "m3", "signal": 9}, source="n1/launcher"))
    events.append(
        ev.cp(
            "fault.detected",
            {
                "incident_id": INCIDENT,
                "members": ["m3"],
                "reason": "exited",
                "detail": "m3 was killed by signal 9",
            },
        )
    )
    events.append(transition(ev, "RUNNING", "DEGRADED"))
    events.append(
        ev.cp(
            "reallocation.issued",
            {
                "incident_id": INCIDENT,
                "command_id": COMMAND,
                "generation": 1,
                "mode": "shrink",
                "world": ["m0", "m1", "m2"],
                "restore_step": 2,
                "rendezvous": "tcp://cp:1/g1",
                "reason": "no spare; 3 >= min_world",
            },
        )
    )
    events.append(
        ev.cp(
            "generation.started",
            {"generation": 1, "world": ["m0", "m1", "m2"], "rendezvous": "tcp://cp:1/g1"},
            generation=1,
        )
    )
    for m, node in (("m0", "n0"), ("m1", "n1"), ("m2", "n0")):
        events.append(
            ev.make("command.acked", {"command_id": COMMAND}, source=f"{node}/{m}", generation=1)
        )
        events.append(
            ev.make(
                "restore.completed",
                {"generation": 1, "step": 2, "bytes": 10, "seconds": 0.2},
                source=f"{node}/{m}",
                generation=1,
            )
        )
        events.append(
            ev.make(
                "train.resumed", {"generation": 1, "step": 2}, source=f"{node}/{m}", generation=1
            )
        )
    events.append(
        ev.make(
            "train.step", {"step": 3, "loss": 0.3, "step_seconds": 0.1, "samples": 8}, generation=1
        )
    )
    events.append(
        ev.cp("incident.resolved", {"incident_id": INCIDENT, "downtime_s": 2.0, "steps_lost": 1})
    )
    return events


def test_incident_lifecycle():
    ev = Events()
    log = recorded(incident_log(ev))
    view = fold(None, log)
    incident = view.incidents[INCIDENT]
    assert incident.members == ["m3"] and incident.outcome == "recovered"
    assert view.open_incident is None
    assert view.members["m3"].status is MemberStatus.EXITED
    assert view.members["m3"].exit_signal == 9
    [decision] = incident.decisions
    assert decision.generation == 1 and decision.restore_step == 2
    # Open, the incident's decision holds each member's marks; closed, only the last ones.
    [open_decision] = fold(None, log[:-1]).incidents[INCIDENT].decisions
    assert not open_decision.compacted
    assert (
        set(open_decision.acked) == set(open_decision.restored) == set(open_decision.resumed)
        == {"m0", "m1", "m2"}
    )  # fmt: skip
    last_ack = max(s.position for s in log if s.event.type == "command.acked")
    last_restore = max(s.position for s in log if s.event.type == "restore.completed")
    assert decision.compacted and not (decision.acked or decision.restored or decision.resumed)
    assert decision.plan == open_decision.plan  # what the decision sent stays
    assert decision.acked_by_all() == open_decision.acked_by_all()
    assert decision.restored_by_all() == open_decision.restored_by_all()
    assert decision.acked_by_all() is not None and decision.acked_by_all().position == last_ack  # type: ignore[union-attr]
    assert decision.restored_by_all().position == last_restore  # type: ignore[union-attr]
    first_step = next(s for s in log if s.event.type == "train.step" and s.event.generation == 1)
    assert decision.first_step_position == first_step.position
    assert (incident.downtime_s, incident.steps_lost) == (2.0, 1)
    assert view.generation == 1 and view.members["m3"].rank is None
    assert view.last_step == 3 and view.last_loss == 0.3


def test_a_fault_during_recovery_extends_the_same_incident_and_stop_closes_it():
    ev = Events()
    events = incident_log(ev)[:-1]  # not resolved yet
    events.append(
        ev.cp(
            "fault.detected",
            {
                "incident_id": INCIDENT,
                "members": ["m2"],
                "reason": "heartbeat_timeout",
                "detail": "m2 silent for 5.0s",
            },
        )
    )
    events.append(ev.cp("job.stopped", {"reason": "fewer than min_world members can continue"}))
    view = fold(None, recorded(events))
    incident = view.incidents[INCIDENT]
    assert incident.members == ["m3", "m2"] and len(incident.detections) == 2
    assert incident.outcome == "stopped" and view.open_incident is None
    assert view.state is JobState.STOPPED
    assert view.members["m2"].status is MemberStatus.FAILED
    assert view.members["m2"].failed_reason == "heartbeat_timeout"


def test_events_from_members_that_never_joined_are_anomalies():
    ev = Events()
    view = fold(None, recorded([ev.heartbeat("ghost", node="n9")]))
    assert view.members == {}
    assert "never joined" in view.anomalies[0]


def test_fold_does_not_mutate_its_input():
    ev = Events()
    events = incident_log(ev)
    before = fold(None, recorded(events[:12]))
    snapshot = copy.deepcopy(before)
    after = fold(before, recorded(events[12:], start=13))
    assert before == snapshot
    assert after != before


def test_fold_rejects_another_jobs_event():
    view = fold(None, recorded([Events("a").joined("m0")]))
    with pytest.raises(ValueError, match="folded into job"):
        fold(view, recorded([Events("b").joined("m0")], start=2))


def test_fold_jobs_keeps_jobs_apart():
    a, b = Events("a"), Events("b")
    views = fold_jobs({}, recorded([a.joined("m0"), b.joined("m0"), b.joined("m1")]))
    assert sorted(views) == ["a", "b"]
    assert len(views["a"].members) == 1 and len(views["b"].members) == 2


def _synthetic_log(count: int) -> list[StoredEvent]:
    job = SyntheticJob("job-h", members=6, backup_interval=3, seed=5)
    member_events = list(job.member_events(count))
    envelopes = member_events[:6] + job.controlplane_events() + member_events[6:]
    return recorded([EVENT_ADAPTER.validate_python(e, strict=False) for e in envelopes])


_LOG = _synthetic_log(600)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(_LOG) - 1), max_size=8))
def test_folding_in_any_batches_equals_folding_at_once(cuts):
    whole = fold(None, _LOG)
    bounds = [0, *sorted(set(cuts)), len(_LOG)]
    view = None
    for lo, hi in itertools.pairwise(bounds):
        view = fold(view, _LOG[lo:hi])
    assert view == whole
    assert whole.anomalies == []
    assert whole.newest_complete_backup() is not None


def test_recorded_time_not_the_producer_clock_drives_liveness():
    ev = Events()
    late_clock = ev.heartbeat("m0", at=T0.replace(year=2030))
    view = fold(None, recorded([ev.joined("m0"), late_clock]))
    assert view.heartbeats["m0"].at.year == 2026


def test_the_timeline_of_an_incident():
    from controlplane.core.timeline import timeline

    ev = Events()
    events = incident_log(ev)
    # The detection cites the exit event as its evidence, with the time it happened.
    exited_index = next(i for i, e in enumerate(events) if e.type == "member.exited")
    log = recorded(events)
    exited = log[exited_index]
    detected_index = exited_index + 1
    payload = events[detected_index].payload.model_dump(by_alias=True)
    payload["evidence"] = [
        {
            "member": "m3",
            "what": "member.exited",
            "position": exited.position,
            "at": exited.recorded_at,
        }
    ]
    events[detected_index] = ev.cp("fault.detected", payload, seq=events[detected_index].seq)
    view = fold(None, recorded(events))
    t = timeline(view.incidents[INCIDENT])

    positions = {name: (mark.position if mark else None) for name, mark in t.points.items()}
    assert positions["fault"] == exited.position
    assert positions["detected"] == exited.position + 1
    assert [
        positions[p] for p in ("fault", "detected", "decided", "acked", "restored", "first_step")
    ] == sorted(positions.values())
    # recorded() spaces events one second apart, so each phase is the gap in positions.
    assert t.phases["detect"] == 1.0
    assert t.downtime_s == positions["first_step"] - positions["fault"]
    assert sum(t.phases.values()) == t.downtime_s
    assert t.steps_lost == 1  # at step 3 when it failed, restored to step 2
    assert t.outcome == "recovered"


def test_an_unfinished_timeline_has_open_points():
    from controlplane.core.timeline import timeline

    ev = Events()
    events = incident_log(ev)
    cut = next(i for i, e in enumerate(events) if e.type == "command.acked")
    view = fold(None, recorded(events[:cut]))
    t = timeline(view.incidents[INCIDENT])
    assert t.points["decided"] is not None and t.points["acked"] is None
    assert t.phases["ack"] is None and t.downtime_s is None
    assert t.outcome is None
