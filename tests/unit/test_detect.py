"""Fault detection: given these events and this time, exactly these findings."""

from __future__ import annotations

import uuid
from datetime import timedelta

from controlplane.core.detect import detect
from controlplane.core.fold import fold
from schemas.common import FaultReason
from tests.factories import T0, Events, recorded

#: recorded() puts event i at T0 + i seconds.


def job(ev: Events, *extra):
    events = [
        ev.cp(
            "job.registered", {"policy": {"heartbeat_timeout_s": {"train": 5.0, "backup": 20.0}}}
        ),
        ev.joined("m0", node="n0"),
        ev.joined("m1", node="n1"),
        ev.joined("m2", node="n2"),
        *extra,
    ]
    return fold(None, recorded(events))


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


def test_a_healthy_job_has_no_findings():
    ev = Events()
    view = job(
        ev,
        *(ev.heartbeat(m, node=n, step=1) for m, n in (("m0", "n0"), ("m1", "n1"), ("m2", "n2"))),
    )
    assert detect(view, at(8)) == []


def test_a_crash_reported_by_the_launcher():
    ev = Events()
    view = job(ev, ev.make("member.exited", {"member": "m1", "signal": 9}, source="n1/launcher"))
    [finding] = detect(view, at(6))
    assert (finding.member, finding.reason) == ("m1", FaultReason.EXITED)
    assert finding.detail == "m1 killed by signal 9"
    assert finding.evidence[0][1:3] == ("member.exited", 5)


def test_a_hang_is_a_heartbeat_timeout_and_a_slow_member_is_not():
    ev = Events()
    view = job(
        ev,
        ev.heartbeat("m0", node="n0", step=1),  # t=5
        ev.heartbeat("m1", node="n1", step=1),  # t=6
        ev.heartbeat("m2", node="n2", step=1),  # t=7
        ev.heartbeat("m2", node="n2", step=1),  # t=8: slow step, but heartbeating
        ev.heartbeat("m1", node="n1", step=1),  # t=9
    )
    assert detect(view, at(9.9)) == []  # m0 silent 4.9 s; m2 took 1 s longer but beats
    [finding] = detect(view, at(10.2))
    assert (finding.member, finding.reason) == ("m0", FaultReason.HEARTBEAT_TIMEOUT)
    assert finding.detail == "m0 silent for 5.2s in phase train (timeout 5s)"
    assert finding.evidence[0][1:3] == ("member.heartbeat", 5)


def test_the_backup_phase_has_its_own_longer_timeout():
    ev = Events()
    view = job(ev, ev.heartbeat("m0", node="n0", step=10, phase="backup"))  # t=5
    found = {f.member for f in detect(view, at(5 + 19))}
    assert "m0" not in found  # 19 s in backup < 20 s
    assert "m0" in {f.member for f in detect(view, at(5 + 21))}


def test_a_peer_names_its_lost_partner_and_a_member_reports_itself():
    ev = Events()
    view = job(
        ev,
        ev.make(
            "member.fault",
            {"kind": "collective_error", "detail": "Connection reset by peer", "suspects": ["m2"]},
            source="n0/m0",
        ),
        ev.make("member.fault", {"kind": "oom", "detail": "CUDA out of memory"}, source="n1/m1"),
        ev.make(
            "member.fault", {"kind": "collective_error", "detail": "who knows"}, source="n2/m2"
        ),
    )
    # m1 is believed about itself at once; m0's word about m2 waits for corroboration.
    findings = {f.member: f for f in detect(view, at(6.5))}
    assert set(findings) == {"m1"}
    assert findings["m1"].reason is FaultReason.REPORTED
    # m2 joined at t=4 and never beat since: silent for 3 heartbeat intervals corroborates.
    findings = {f.member: f for f in detect(view, at(7.0))}
    assert set(findings) == {"m1", "m2"}
    assert findings["m2"].detail == (
        "m0 lost m2 in a collective: Connection reset by peer; corroborated by its silence:"
        " no heartbeat for 3.0s (3 intervals of 1s)"
    )
    assert [e[:3] for e in findings["m2"].evidence] == [
        ("m0", "member.fault", 5),
        ("m2", "member.joined", 4),
    ]


def _accuse(ev: Events, reporter: str, node: str, suspect: str):
    return ev.make(
        "member.fault",
        {"kind": "collective_error", "detail": "reset", "suspects": [suspect]},
        source=f"{node}/{reporter}",
    )


def test_a_report_naming_a_healthy_heartbeating_peer_does_not_fence_it():
    ev = Events()
    beats = [ev.heartbeat("m2", node="n2", step=1) for _ in range(30)]  # t=6..35, every 1 s
    view = job(ev, _accuse(ev, "m0", "n0", "m2"), *beats)  # the report at t=5
    assert "m2" not in {f.member for f in detect(view, at(35.5))}
    # Its silence would corroborate from t=38, when it is silent for 3 intervals.
    assert "m2" not in {f.member for f in detect(view, at(37.9))}
    assert "m2" in {f.member for f in detect(view, at(38.0))}


def test_reports_from_two_nodes_corroborate_each_other_and_one_node_s_do_not():
    ev = Events()
    extra = [ev.joined("m3", node="n0")]  # a second member on node n0
    same_node = job(
        ev, *extra, _accuse(ev, "m0", "n0", "m2"), _accuse(ev, "m3", "n0", "m2"),
        ev.heartbeat("m2", node="n2"),
    )  # fmt: skip
    assert "m2" not in {f.member for f in detect(same_node, at(8.5))}
    ev = Events()
    two_nodes = job(
        ev, _accuse(ev, "m0", "n0", "m2"), _accuse(ev, "m1", "n1", "m2"),
        ev.heartbeat("m2", node="n2"),
    )  # fmt: skip
    [finding] = [f for f in detect(two_nodes, at(7.5)) if f.member == "m2"]
    assert (finding.member, finding.reason) == ("m2", FaultReason.REPORTED)
    assert finding.detail.endswith("corroborated by 2 reporters on 2 nodes (m0, m1)")
    assert [e[:3] for e in finding.evidence] == [
        ("m0", "member.fault", 5),
        ("m1", "member.fault", 6),
    ]


def test_a_member_cannot_accuse_itself_and_an_exit_report_wins():
    ev = Events()
    view = job(
        ev,
        _accuse(ev, "m2", "n2", "m2"),
        _accuse(ev, "m0", "n0", "m1"),
        ev.make("member.exited", {"member": "m1", "signal": 9}, source="n1/launcher"),
        ev.heartbeat("m2", node="n2"),
    )
    found = {f.member: f.reason for f in detect(view, at(8.5)) if f.member != "m0"}
    assert found == {"m1": FaultReason.EXITED}


def test_two_simultaneous_failures():
    ev = Events()
    view = job(
        ev,
        ev.make("member.exited", {"member": "m0", "exit_code": 1}, source="n0/launcher"),
        ev.make("member.exited", {"member": "m2", "signal": 9}, source="n2/launcher"),
        ev.heartbeat("m1", node="n1"),
    )
    assert [f.member for f in detect(view, at(9))] == ["m0", "m2"]


def test_detection_is_idempotent_once_recorded_and_rejoin_starts_afresh():
    ev = Events()
    incident = str(uuid.uuid4())
    view = job(
        ev,
        ev.make("member.exited", {"member": "m1", "signal": 9}, source="n1/launcher"),
        ev.cp(
            "fault.detected",
            {"incident_id": incident, "members": ["m1"], "reason": "exited", "detail": "x"},
        ),
        ev.make(
            "member.fault",
            {"kind": "collective_error", "detail": "reset", "suspects": ["m1"]},
            source="n0/m0",
        ),
        ev.heartbeat("m0", node="n0"),
        ev.heartbeat("m2", node="n2"),
    )
    assert detect(view, at(10)) == []
    # m1 comes back as a new incarnation: the old report does not condemn it.
    view = fold(view, recorded([ev.joined("m1", node="n1", incarnation="inc2")], start=11))
    assert detect(view, at(12)) == []
