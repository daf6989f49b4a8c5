"""Loss anomalies: a rank's non-finite step or a spike of the job's loss rolls the job back.

Jobs as in ``test_decide``: generation 1 on two racks of two nodes (``w00 w01 w10 w11``),
complete backups at steps 10 and 20, last step 23, every member heartbeating at t=1.
"""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.core.anomaly import describe, merged, spike_threshold, window
from controlplane.core.commands import owed
from controlplane.core.decide import Decided, decision_id, next_deadline, wakes
from controlplane.core.goodput import GoodputCounter, goodput
from controlplane.core.replay import counterfactual, redecide
from controlplane.core.timeline import timeline
from controlplane.core.view import DiscountReason, MemberStatus
from schemas.commands import Reallocate
from schemas.common import AnomalyAction, AnomalyKind, JobState, ReallocationMode, RestoreFrom
from tests.scenario import Scenario

S = JobState
JOB = "job1"
ROLLBACK = [
    "anomaly.detected",
    "job.state_changed",
    "job.state_changed",
    "reallocation.issued",
    "generation.started",
    "job.state_changed",
]


def running(spares: int = 0, **policy: Any) -> Scenario:
    s = Scenario(JOB, **{"world_size": 4, "min_world": 2, **policy})
    s.cluster(2, 2, spares)
    return s.start_and_train()


def kinds(decided: list[Decided]) -> list[str]:
    return [d.type for d in decided]


def only(decided: list[Decided], type_: str) -> Any:
    [payload] = [d.payload for d in decided if d.type == type_]
    return payload


def non_finite(s: Scenario, member: str, step: int, kind: str = "non_finite_loss") -> None:
    s.add(
        s.ev.make(
            "train.anomaly",
            {"step": step, "kind": kind, "detail": "loss=nan"},
            source=s._src(member),
            generation=s.v.generation,
        )
    )


# --------------------------------------------------------------------------- pure parts


def test_the_skip_window_ends_at_the_anomaly_and_never_reaches_the_restore_step():
    assert window(24, 20, 1) == (24, 24)
    assert window(24, 20, 3) == (22, 24)
    assert window(24, 20, 100) == (21, 24)
    assert window(24, 20, 0) is None
    assert window(20, 20, 1) is None  # nothing after the restore step to skip
    assert merged([(30, 31), (5, 5)], (6, 8)) == ((5, 8), (30, 31))
    assert merged([(5, 9)], (7, 12)) == ((5, 12),)
    assert describe(merged([], (24, 24))) == "24" and describe([(3, 5)]) == "3-5"


def test_the_spike_threshold_is_robust_to_a_few_outliers():
    calm = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.0]
    threshold = spike_threshold(calm, 6)
    assert 1.1 < threshold < 1.3  # 1 + 6 x 0.025
    # One earlier outlier hardly moves it (a mean and a standard deviation would).
    assert spike_threshold([*calm[1:], 40.0], 6) < 1.6
    # A flat loss still has a spread: a rounding-size rise is no spike.
    assert spike_threshold([2.0] * 8, 6) > 2.0 + 1e-3


# --------------------------------------------------------------------------- non-finite


def test_a_non_finite_loss_rolls_the_same_world_back_to_the_backup_before_it():
    s = running()
    s.at(2)
    non_finite(s, "w01", 24)
    assert wakes(s.v, "train.anomaly") and next_deadline(s.v) is not None
    decided = s.decide()
    incident = decision_id(JOB, "incident/1")

    assert kinds(decided) == ROLLBACK
    detected = only(decided, "anomaly.detected")
    assert str(detected.incident_id) == incident
    assert (detected.kind, detected.step, detected.members) == (
        AnomalyKind.NON_FINITE_LOSS, 24, ["w01"],
    )  # fmt: skip
    assert detected.detail == "non_finite_loss at step 24 on w01: loss=nan"
    [evidence] = detected.evidence
    assert (evidence.member, evidence.what) == ("w01", "train.anomaly")

    realloc = only(decided, "reallocation.issued")
    assert realloc.mode is ReallocationMode.ROLLBACK
    assert realloc.world == ["w00", "w01", "w10", "w11"]  # no one failed
    assert (realloc.restore_step, realloc.restore_from) == (20, RestoreFrom.MEMORY)
    assert realloc.plan == realloc.world  # every rank from its own memory
    assert realloc.skip == [(24, 24)]
    assert realloc.reason == (
        "roll back before the non_finite_loss at step 24; skip step 24; restore step 20"
    )

    view = s.v
    assert view.state is S.RECOVERING and view.generation == 2
    assert all(m.status is MemberStatus.ACTIVE for m in view.members.values())
    assert view.anomaly is None and view.skipped == ((24, 24),)
    opened = view.incidents[incident]
    assert (opened.kind, opened.anomaly_step, opened.members) == ("anomaly", 24, ["w01"])
    # The command every rank follows carries the steps to skip.
    [command] = owed(view)
    assert isinstance(command, Reallocate) and command.skip == [(24, 24)]
    assert command.mode is ReallocationMode.ROLLBACK

    s.recover()  # acks, restores, resumes, first step 21
    resolved = s.decide()
    assert kinds(resolved) == ["incident.resolved", "job.state_changed"]
    line = timeline(s.v.incidents[incident])
    assert line.outcome == "recovered" and line.steps_lost == 3  # 21-23 again
    assert all(v is not None for v in line.phases.values())
    # The replay re-decides the rollback exactly.
    assert all(b.matches for b in redecide(s.log))


def test_the_restore_step_is_strictly_before_the_anomaly():
    s = running()
    s.at(2)
    non_finite(s, "w10", 20, "non_finite_grad_norm")  # the step backed up at 20 went wrong
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.restore_step == 10
    assert realloc.skip == [(20, 20)]


@pytest.mark.parametrize(
    ("skip_steps", "skip", "words"),
    [
        (3, [(22, 24)], "skip steps 22-24"),
        (50, [(21, 24)], "skip steps 21-24"),  # never the restore step or before it
        (0, [], "skip no step (anomaly_skip_steps 0)"),
    ],
)
def test_the_policy_says_how_many_batches_are_skipped(skip_steps, skip, words):
    s = running(anomaly_skip_steps=skip_steps)
    s.at(2)
    non_finite(s, "w00", 24)
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.skip == skip
    assert words in realloc.reason


def test_the_policy_may_stop_the_job_instead():
    s = running(anomaly_action=AnomalyAction.STOP)
    s.at(2)
    non_finite(s, "w00", 24)
    decided = s.decide()
    assert kinds(decided) == ["anomaly.detected", "job.stopped"]
    assert only(decided, "job.stopped").reason == (
        "non_finite_loss at step 24 on w00: loss=nan; the policy stops the job on a loss"
        " anomaly (anomaly_action stop)"
    )
    assert s.v.state is S.STOPPED
    assert next(iter(s.v.incidents.values())).outcome == "stopped"


def test_reports_from_outside_the_current_world_are_discounted():
    s = running(spares=1)
    s.at(2)
    non_finite(s, "spare0", 24)  # a spare trains nothing
    s.add(
        s.ev.make(
            "train.anomaly",
            {"step": 22, "kind": "non_finite_loss"},
            source=s._src("w00"),
            generation=0,  # a world long gone
        )
    )
    assert s.v.anomaly is None
    reasons = [d.reason for d in s.v.discounts[-2:]]
    assert reasons == [DiscountReason.REPORTER_NOT_IN_WORLD, DiscountReason.STALE_GENERATION]
    assert s.decide() == []


def test_the_earliest_reported_step_is_rolled_back_and_late_reports_are_stale():
    s = running()
    s.at(2)
    non_finite(s, "w11", 24)
    non_finite(s, "w00", 23)  # another rank saw it a step earlier
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.skip == [(23, 23)] and realloc.restore_step == 20
    # A rank whose report was still on its way names the world the rollback replaced.
    s.add(
        s.ev.make(
            "train.anomaly",
            {"step": 24, "kind": "non_finite_loss"},
            source=s._src("w10"),
            generation=1,
        )
    )
    assert s.v.anomaly is None
    assert s.v.discounts[-1].reason is DiscountReason.STALE_GENERATION
    assert s.decide() == []


def test_a_non_finite_first_step_after_the_rollback_re_decides_in_the_same_incident():
    s = running()
    s.at(2)
    non_finite(s, "w01", 24)
    s.decide()
    incident = s.v.open_incident
    s.recover(first_step=False)
    s.at(3)
    non_finite(s, "w01", 21)  # the replay went wrong again, earlier
    decided = s.decide()
    assert kinds(decided) == [
        "anomaly.detected",
        "job.state_changed",
        "reallocation.issued",
        "generation.started",
        "job.state_changed",
    ]
    realloc = only(decided, "reallocation.issued")
    assert str(realloc.incident_id) == incident and realloc.generation == 3
    assert realloc.restore_step == 20 and realloc.skip == [(21, 21), (24, 24)]
    assert s.v.incidents[incident or ""].anomaly_step == 21


def test_max_rollbacks_stops_an_anomaly_that_keeps_coming_back():
    s = running(max_rollbacks=1)
    s.at(2)
    non_finite(s, "w01", 24)
    s.decide()
    s.recover()
    s.decide()  # resolved
    s.at(3)
    for step in (22, 23):
        s.step(step)
    non_finite(s, "w01", 26)
    decided = s.decide()
    assert kinds(decided) == ["anomaly.detected", "job.stopped"]
    assert "rolled back 1 times (max_rollbacks 1)" in only(decided, "job.stopped").reason


def test_a_later_crash_keeps_the_skipped_steps_in_its_command():
    s = running(spares=1)
    s.at(2)
    non_finite(s, "w01", 24)
    s.decide()
    s.recover()
    s.decide()
    s.at(3)
    s.heartbeat_all()
    s.exited("w10")
    realloc = only(s.decide(), "reallocation.issued")
    assert realloc.mode is ReallocationMode.REPLACE and realloc.skip == [(24, 24)]
    assert realloc.restore_step == 20


# --------------------------------------------------------------------------- spikes


def test_a_loss_spike_rolls_back_before_it_when_the_policy_looks_for_spikes():
    s = Scenario(JOB, world_size=4, min_world=2, loss_spike_k=6, loss_spike_window=8)
    s.cluster(2, 2)
    s.decide()
    s.at(1)
    s.heartbeat_all()
    assert wakes(s.v, "train.step")  # a step record may be a spike
    for step in range(1, 13):
        s.step(step, loss=1.0 + 0.01 * (step % 3))
        if step == 10:
            s.backup(10)
    assert s.decide() == [] and s.v.anomaly is None
    s.at(2)
    s.step(13, loss=9.0)
    assert s.v.anomaly is not None and s.v.anomaly.kind == "loss_spike"
    decided = s.decide()
    detected = only(decided, "anomaly.detected")
    assert detected.kind is AnomalyKind.LOSS_SPIKE and detected.members == []
    assert detected.loss == 9.0 and detected.threshold is not None and detected.threshold < 1.2
    assert detected.detail.startswith("loss_spike at step 13: loss 9 at step 13 above 1.")
    realloc = only(decided, "reallocation.issued")
    assert (realloc.mode, realloc.restore_step, realloc.skip) == (
        ReallocationMode.ROLLBACK, 10, [(13, 13)],
    )  # fmt: skip
    # The window keeps the current timeline's losses only: those beyond step 10 are gone.
    assert [step for step, _ in s.v.recent_losses] == list(range(6, 11))
    assert all(b.matches for b in redecide(s.log))


def test_without_loss_spike_k_a_high_loss_is_no_anomaly():
    s = running()
    s.at(2)
    s.step(24, loss=1e6)
    assert s.v.anomaly is None and s.v.recent_losses == ()
    assert not wakes(s.v, "train.step")
    assert s.decide() == []


def test_goodput_counts_a_rollback_s_replayed_steps_as_recomputed_and_not_its_skipped_ones():
    s = running()
    s.at(2)
    s.step(24)
    s.step(25)
    non_finite(s, "w01", 25)
    s.decide()
    s.at(3)
    s.recover(first_step=False)
    for step in (21, 22, 23, 24, 26, 27):  # 25 skipped
        s.step(step)
    s.decide()
    counter = GoodputCounter()
    counter.count(s.log)
    result = goodput(s.v, counter, s.now)
    assert result is not None
    [incident] = result.incidents
    assert incident.kind == "anomaly"
    # Generation 1 made steps 10 to 25; generation 2 redid 21-24 and made 26-27.
    assert (result.productive_steps, result.recomputed_steps) == (16 + 2, 4)


def test_a_counterfactual_re_decides_the_rollback_under_another_policy():
    s = running()
    s.at(2)
    non_finite(s, "w01", 24)
    s.decide()
    s.recover()
    s.decide()
    wider = counterfactual(s.log, {"anomaly_skip_steps": 3})
    assert wider.replayed.skipped == ((22, 24),)
    [facts] = wider.incidents
    assert (facts.kind, facts.mode, facts.restore_step) == ("anomaly", "rollback", 20)
    stopped = counterfactual(s.log, {"anomaly_action": "stop"})
    assert stopped.replayed.state is S.STOPPED
