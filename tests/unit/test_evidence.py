"""Events are evidence bound to their sender (issue 20, item 2), in the pure core.

Each test is an attack or a mistake a member could make, and what the control plane makes of
it: an exit not reported by the member's own launcher, a spare no launcher started, a peer
accused without corroboration, a generation the control plane never issued, a step far beyond
the job's progress. Every discounted event is recorded with its reason, and folding the log
from position 0 gives the live view exactly.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from controlplane.core.decide import next_deadline
from controlplane.core.detect import accusations
from controlplane.core.fold import fold, fold_noting
from controlplane.core.timeline import timeline
from controlplane.core.view import DiscountReason, MemberStatus
from schemas.common import FaultReason, JobState, ReallocationMode
from tests.factories import T0
from tests.scenario import Scenario

S = JobState


def running(spares: int = 1, *, announce_spares: bool = True) -> Scenario:
    """Four workers on two racks of two nodes (``w00 w01 w10 w11``, each on a node of its
    own: ``node-R-N``), ``spares`` spares (``spare0`` on ``spare-node-0``, ...), generation 1,
    backups at steps 10 and 20, last step 23, everyone heartbeating at t=1."""
    s = Scenario("job1", world_size=4, min_world=2)
    s.cluster(2, 2)
    for i in range(spares):
        s.join(f"spare{i}", f"spare-node-{i}", f"rack{i % 2}", role="spare",
               announce=announce_spares)  # fmt: skip
    return s.start_and_train()


def types(decided: list[Any]) -> list[str]:
    return [d.type for d in decided]


def only(decided: list[Any], type_: str) -> Any:
    [payload] = [d.payload for d in decided if d.type == type_]
    return payload


def assert_replays(s: Scenario) -> None:
    """Folding the whole log from position 0 reproduces the live view."""
    assert fold(None, s.log) == s.v


# --------------------------------------------------------------------------- rule 1: exits


def test_an_exit_from_the_member_s_own_node_but_not_its_launcher_is_discounted():
    s = running()
    s.at(2)
    s.join("w01b", "node-0-1", "rack0")  # a second member on w01's node
    s.heartbeat_all()
    for forger in ("node-0-1/w01b", "node-0-1/w01", "node-0-0/launcher", "node-0-0/w00"):
        s.exited("w01", source=forger)
    assert s.decide() == []
    assert s.v.members["w01"].status is MemberStatus.ACTIVE
    assert s.v.state is S.RUNNING and not s.v.incidents
    discounts = s.v.discounts[-4:]
    assert [(d.type, d.source, d.reason) for d in discounts] == [
        ("member.exited", f, DiscountReason.EXIT_NOT_FROM_LAUNCHER)
        for f in ("node-0-1/w01b", "node-0-1/w01", "node-0-0/launcher", "node-0-0/w00")
    ]
    assert discounts[0].detail == (
        "exit of w01 reported by node-0-1/w01b: only node-0-1/launcher, the launcher of its"
        " node, reports its exit"
    )
    assert s.v.discount_counts == {"exit_not_from_launcher": 4}
    assert_replays(s)


def test_the_exit_its_launcher_reports_is_believed_and_replaced_at_once():
    s = running()
    s.at(2)
    s.exited("w01")  # from node-0-1/launcher
    decided = s.decide()
    detected = only(decided, "fault.detected")
    assert (detected.members, detected.reason) == (["w01"], FaultReason.EXITED)
    assert only(decided, "reallocation.issued").mode is ReallocationMode.REPLACE
    assert s.v.discounts == []
    assert_replays(s)


# --------------------------------------------------------------------------- rule 2: spares


def test_a_spare_no_launcher_announced_is_no_candidate_and_counts_once_announced():
    s = running(announce_spares=False)
    s.at(2)
    s.heartbeat_all()
    assert s.v.members["spare0"].announced_position is None
    # A forged announcement (not from a launcher) is discounted and vouches for nothing.
    s.launched("spare0", "spare-node-0", "spare", source="spare-node-0/spare0")
    assert s.v.members["spare0"].announced_position is None
    assert s.v.discounts[-1].reason is DiscountReason.LAUNCH_NOT_FROM_LAUNCHER
    # ... and one for another process (another pid) does not either.
    s.launched("spare0", "spare-node-0", "spare", pid=999)
    assert s.v.members["spare0"].announced_position is None
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.mode is ReallocationMode.SHRINK and "spare0" not in realloc.world
    assert_replays(s)


def test_a_join_before_its_announcement_counts_once_the_announcement_lands():
    s = running(announce_spares=False)
    s.at(2)
    s.heartbeat_all()
    s.launched("spare0", "spare-node-0", "spare")  # the late announcement, the right pid
    assert s.v.members["spare0"].announced_position == s.log[-1].position
    s.exited("w01")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.mode is ReallocationMode.REPLACE
    assert realloc.world == ["w00", "spare0", "w10", "w11"]
    assert_replays(s)


def test_an_announcement_before_the_join_counts_the_join():
    s = running(spares=0)
    s.at(2)
    s.launched("s9", "node-9", "spare")
    s.join("s9", "node-9", "rack0", role="spare", announce=False)
    assert s.v.members["s9"].announced_position == s.log[-2].position
    assert_replays(s)


# --------------------------------------------------------------------------- rule 3: reports


def test_a_fault_naming_a_healthy_heartbeating_peer_does_not_fence_it():
    s = running()
    s.at(2)
    s.fault("w00", "collective_error", suspects=["w11"])
    assert s.decide() == []
    assert accusations(s.v) == {"w11": ["w00"]}  # recorded, waiting
    # The decider wakes when w11's silence would corroborate the report (3 intervals).
    assert next_deadline(s.v) == T0 + timedelta(seconds=1 + 3)
    for t in range(2, 30):
        s.at(t + 0.5)
        s.heartbeat_all()
        assert s.decide() == [], t
    assert s.v.state is S.RUNNING and s.v.members["w11"].status is MemberStatus.ACTIVE
    assert s.v.world == ("w00", "w01", "w10", "w11")
    assert_replays(s)


def test_the_suspect_s_silence_corroborates_a_report():
    s = running()
    s.at(2)
    s.fault("w00", "collective_error", suspects=["w11"])
    s.at(3.9)
    s.heartbeat("w00", "w01", "w10", "spare0")
    assert s.decide() == []
    s.at(4)
    decided = s.decide()
    detected = only(decided, "fault.detected")
    assert (detected.members, detected.reason) == (["w11"], FaultReason.REPORTED)
    assert "corroborated by its silence: no heartbeat for 3.0s" in detected.detail
    assert [(e.member, e.what) for e in detected.evidence] == [
        ("w00", "member.fault"),
        ("w11", "member.heartbeat"),
    ]
    assert only(decided, "reallocation.issued").world == ["w00", "w01", "w10", "spare0"]


def test_reports_from_two_nodes_fence_at_once_two_from_one_node_do_not():
    s = running()
    s.at(2)
    s.join("w10b", "node-1-0", "rack1")  # a second member on w10's node
    s.heartbeat_all()
    s.fault("w10", "collective_error", suspects=["w11"])
    s.fault("w10b", "collective_error", suspects=["w11"])
    # w10b joined after the start: no member of the world, its report is no evidence at all
    # (issue 21: a peer report counts only from an active member of the current world).
    assert s.v.discounts[-1].reason is DiscountReason.REPORTER_NOT_IN_WORLD
    assert s.decide() == []  # one node's credential can forge both
    s.fault("w00", "collective_error", suspects=["w11"])
    detected = only(s.decide(), "fault.detected")
    assert detected.members == ["w11"]
    assert detected.detail.endswith("corroborated by 2 reporters on 2 nodes (w10, w00)")
    assert [e.member for e in detected.evidence] == ["w10", "w00"]
    assert_replays(s)


def test_a_kill_is_decided_as_soon_as_its_launcher_reports_it():
    """A killed rank: its peers' reports wait for corroboration, the exit that follows
    tens of ms later decides at once."""
    s = running()
    s.at(2)
    s.fault("w00", "restore_failed", suspects=["w11"])
    assert s.decide() == []
    s.at(2.03)
    s.exited("w11")
    detected = only(s.decide(), "fault.detected")
    assert (detected.members, detected.reason) == (["w11"], FaultReason.EXITED)


def test_a_member_is_still_believed_about_itself():
    s = running()
    s.at(2)
    s.fault("w10", "oom")
    detected = only(s.decide(), "fault.detected")
    assert (detected.members, detected.reason) == (["w10"], FaultReason.REPORTED)


def test_a_report_from_before_the_current_generation_is_stale():
    s = running()
    s.at(2)
    s.fault("w00", "collective_error", suspects=["w11"])
    s.exited("w01")
    s.decide()  # w01 replaced by spare0: generation 2
    s.recover()
    s.decide()
    assert s.v.generation == 2 and s.v.state is S.RUNNING
    s.at(20)  # w11 silent since t=1, but w00's report is about generation 1
    s.heartbeat_all()
    assert s.decide() == []


# --------------------------------------------------------------------------- rule 4: progress


def test_a_step_of_10_to_the_15_reaches_neither_the_view_nor_an_incident():
    s = running()
    s.at(2)
    s.add(
        s.ev.make("train.step", {"step": 10**15, "loss": 1e9, "step_seconds": 0.1,
                                 "samples": 8}, source="node-0-0/w00", generation=1),
        s.ev.make("member.heartbeat", {"step": 10**15, "phase": "train"},
                  source="node-0-0/w00", generation=1),
    )  # fmt: skip
    _, ignored = fold_noting(None, s.log)
    assert ignored == {s.log[-2].position, s.log[-1].position}
    assert (s.v.last_step, s.v.last_loss) == (23, 1.0)
    assert s.v.members["w00"].step == 23
    assert [d.reason for d in s.v.discounts] == [DiscountReason.STEP_IMPLAUSIBLE] * 2
    assert s.v.discounts[0].detail == (
        "step 1000000000000000 of w00 is more than 10000 beyond its last step 23 and the"
        " job's newest step 23"
    )
    s.exited("w01")
    s.decide()
    s.recover()
    s.decide()
    [incident] = s.v.incidents.values()
    assert incident.step_at_fault == 23 and incident.steps_lost == 3
    assert timeline(incident).steps_lost == 3
    assert_replays(s)


def test_a_step_within_the_bound_is_believed():
    s = running()
    s.at(2)
    s.add(
        s.ev.make("train.step", {"step": 23 + 10_000, "loss": 0.5, "step_seconds": 0.1,
                                 "samples": 8}, source="node-0-0/w00", generation=1),
    )  # fmt: skip
    assert s.v.last_step == 10_023 and s.v.discounts == []


def test_a_generation_the_control_plane_never_issued_is_discounted():
    s = running()
    s.at(2)
    s.add(
        s.ev.make("train.step", {"step": 24, "loss": 0.1, "step_seconds": 0.1, "samples": 8},
                  source="node-0-0/w00", generation=7),
        s.ev.make("member.heartbeat", {"step": 24, "phase": "train"},
                  source="node-0-0/w00", generation=7),
    )  # fmt: skip
    assert (s.v.last_step, s.v.last_loss) == (23, 1.0)
    assert s.v.members["w00"].generation == 1
    assert s.v.heartbeats["w00"].at == T0 + timedelta(seconds=1)
    [d1, _] = s.v.discounts
    assert (d1.type, d1.source, d1.reason) == (
        "train.step",
        "node-0-0/w00",
        DiscountReason.GENERATION_AHEAD,
    )
    assert d1.detail == "generation 7 from node-0-0/w00: the newest the control plane issued is 1"
    assert s.v.discount_counts == {"generation_ahead": 2}
    assert_replays(s)


def test_a_step_from_a_source_that_never_joined_moves_nothing():
    s = running()
    s.at(2)
    s.add(
        s.ev.make("train.step", {"step": 30, "loss": 9.0, "step_seconds": 0.1, "samples": 8},
                  source="node7/attacker", generation=1),
    )  # fmt: skip
    assert (s.v.last_step, s.v.last_loss) == (23, 1.0)
    assert fold_noting(None, s.log)[1] == {s.log[-1].position}


# --------------------------------------------------------------------------- rule 5: visible


def test_the_discount_list_is_bounded_and_the_counts_are_not():
    s = running()
    s.at(2)
    for _ in range(150):
        s.exited("w01", source="node-0-0/w00")
    assert len(s.v.discounts) == 100
    assert s.v.discounts[-1].position == s.log[-1].position
    assert s.v.discount_counts == {"exit_not_from_launcher": 150}
    assert_replays(s)
    # Folded in pieces, the same view.
    view = None
    for i in range(0, len(s.log), 7):
        view = fold(view, s.log[i : i + 7])
    assert view == s.v


def test_discounts_are_served_by_the_api_and_counted_by_prometheus():
    from controlplane.api.metrics import LogMetrics
    from controlplane.api.render import cluster, loss_curve
    from controlplane.api.views import LiveViews

    s = running()
    s.at(2)
    s.exited("w01", source="node-0-1/w01")
    s.add(
        s.ev.make("train.step", {"step": 10**15, "loss": 1e9, "step_seconds": 0.1,
                                 "samples": 8}, source="node-0-0/w00", generation=1),
    )  # fmt: skip
    log = s.log
    live = LiveViews(lambda after, limit: [e for e in log if e.position > after][:limit],
                     lambda: log[-1].position, batch=7)  # fmt: skip
    live.catch_up(force=True)
    entry = live.jobs["job1"]
    assert entry.view == s.v
    served = cluster(entry.view)
    assert [(d.type, d.reason) for d in served.discounts] == [
        ("member.exited", "exit_not_from_launcher"),
        ("train.step", "step_implausible"),
    ]
    assert served.discount_counts == {"exit_not_from_launcher": 1, "step_implausible": 1}
    assert {m.member_id: m.announced for m in served.members} == dict.fromkeys(s.v.members, True)
    # The loss curve has the steps that were believed, and not 10^15.
    assert [p.step for p in loss_curve(entry.view, entry.loss_points()).points] == [10, 20, 23]
    text = LogMetrics(lambda: [entry.view]).exposition().decode()
    assert (
        'elastic_events_discounted_total{job_id="job1",reason="exit_not_from_launcher"} 1.0' in text
    )
    assert 'elastic_events_discounted_total{job_id="job1",reason="step_implausible"} 1.0' in text
    assert 'elastic_events_discounted_total{job_id="job1",reason="generation_ahead"} 0.0' in text
