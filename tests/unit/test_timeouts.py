"""Self-calibrating heartbeat timeouts: derived from the gaps the log shows, per phase."""

from __future__ import annotations

import functools
from datetime import timedelta

import pytest

from controlplane.core.detect import detect, heartbeat_timeout, threshold
from controlplane.core.fold import fold
from controlplane.core.liveness import LivenessTable
from controlplane.core.replay import DEADLINE_TICK, counterfactual, redecide
from controlplane.core.timeouts import GapSample, derive, fixed, samples_of
from schemas.common import Phase
from schemas.events import JobPolicy
from tests.factories import T0, Events, recorded
from tests.recorded import HANG_LAST_HEARTBEAT_S, HANG_TIMEOUT_S, two_incidents_scenario
from tests.scenario import SoftScenario

AUTO = {
    "heartbeat_timeout_mode": "auto",
    "heartbeat_timeout_k": 3.0,
    "heartbeat_timeout_quantile": 0.99,
    "heartbeat_timeout_min_gaps": 10,
    "heartbeat_timeout_floor_s": 1.0,
    "heartbeat_timeout_ceiling_s": 30.0,
}


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


def sample(phase: Phase, *gaps: tuple[int, int], t: float = 0.0) -> GapSample:
    return GapSample(at(t), phase, tuple(gaps))


def test_the_threshold_follows_the_distribution_of_gaps():
    policy = JobPolicy(**AUTO)
    # 99 gaps of 200 ms and one of 800 ms: p99 is 200 ms; 100 more of 800 ms: p99 is 800 ms.
    low = derive([sample(Phase.TRAIN, (200, 99), (800, 1))], policy)[Phase.TRAIN]
    assert (low.mode, low.seconds, low.gaps, low.gap_s) == ("auto", pytest.approx(1.0), 100, 0.2)
    high = derive([sample(Phase.TRAIN, (200, 99), (800, 101))], policy)[Phase.TRAIN]
    assert high.seconds == pytest.approx(2.4) and high.gaps == 200
    assert high.how == (
        "timeout 2.4s = 3 x p99 gap 0.8s over 200 gaps in phase train, within [1, 30]"
    )


def test_the_threshold_is_clamped_to_the_floor_and_the_ceiling():
    policy = JobPolicy(**AUTO)
    floor = derive([sample(Phase.TRAIN, (100, 50))], policy)[Phase.TRAIN]
    assert floor.seconds == 1.0 and "raised to the floor 1s" in floor.how
    ceiling = derive([sample(Phase.TRAIN, (20_000, 50))], policy)[Phase.TRAIN]
    assert ceiling.seconds == 30.0 and "cut to the ceiling 30s" in ceiling.how


def test_below_the_minimum_of_gaps_the_fixed_timeout_holds():
    policy = JobPolicy(**AUTO)
    few = derive([sample(Phase.TRAIN, (5000, 9))], policy)[Phase.TRAIN]
    assert (few.mode, few.seconds) == ("fixed", 5.0)
    assert few.how == "fixed policy 5s (auto: 9 gaps in phase train, fewer than 10)"
    assert fixed(JobPolicy(), Phase.BACKUP).how == "fixed policy 15s"


def test_a_slow_heartbeat_phase_derives_its_own():
    policy = JobPolicy(**AUTO)
    derived = derive(
        [sample(Phase.TRAIN, (500, 40)), sample(Phase.BACKUP, (4000, 20), t=1)], policy
    )
    assert derived[Phase.TRAIN].seconds == pytest.approx(1.5)
    assert derived[Phase.BACKUP].seconds == pytest.approx(12.0)
    assert derived[Phase.RESTORE].mode == "fixed"  # no gaps seen there


@pytest.mark.parametrize(
    "fields",
    [
        {"heartbeat_timeout_floor_s": 10.0, "heartbeat_timeout_ceiling_s": 5.0},
        {"heartbeat_timeout_floor_s": 0.0},
        {"heartbeat_timeout_ceiling_s": float("inf")},
        {"heartbeat_timeout_k": -1.0},
        {"heartbeat_timeout_quantile": 1.5},
        {"heartbeat_timeout_mode": "adaptive"},
    ],
)
def test_bad_timeout_policies_are_refused(fields):
    with pytest.raises(ValueError):
        JobPolicy(**{**AUTO, **fields})


def _summary(ev: Events, t: float, rows: list[tuple[str, float, str]], since: float):
    """An interval summary listing (member, largest gap s, phase)."""
    members = [
        {"member": m, "node": f"n{m[1:]}", "incarnation": "inc1", "generation": 0,
         "last_at": at(t).isoformat(), "first_at": at(since).isoformat(), "beats": 10,
         "max_gap_s": gap, "phase": phase, "step": 1}
        for m, gap, phase in rows
    ]  # fmt: skip
    return ev.cp(
        "liveness.summary",
        {"reason": "interval", "since": at(since).isoformat(), "at": at(t).isoformat(),
         "members": members},
    )  # fmt: skip


def _job(policy: dict, summaries: int = 6):
    ev = Events()
    events = [
        ev.cp("job.registered", {"policy": policy}),
        *(ev.joined(f"m{i}", node=f"n{i}") for i in range(3)),
    ]
    for k in range(summaries):  # every 10 s: m0 and m1 in train (0.5 s gaps), m2 in backup
        t = 10.0 * (k + 1)
        rows = [("m0", 0.5, "train"), ("m1", 0.5, "train"), ("m2", 3.0, "backup")]
        events.append(_summary(ev, t, rows, since=t - 10))
    return fold(None, recorded(events, every_s=10.0))


def test_the_fold_derives_each_phases_threshold_from_the_summaries():
    view = _job({**AUTO, "heartbeat_timeout_min_gaps": 6})
    assert threshold(view, Phase.TRAIN).seconds == pytest.approx(1.5)
    assert threshold(view, Phase.BACKUP).seconds == pytest.approx(9.0)
    assert heartbeat_timeout(view, Phase.INIT) == 30.0  # none seen: the fixed one
    # Fixed policies keep nothing.
    assert _job({}).thresholds == {} and _job({}).gap_samples == ()


def test_old_gaps_leave_the_window():
    view = _job({**AUTO, "heartbeat_timeout_min_gaps": 6, "heartbeat_timeout_window_s": 25.0})
    # Three summaries (at 40, 50, 60 s) are within 25 s of the last: 6 gaps in train.
    assert len(view.gap_samples) == 6
    assert threshold(view, Phase.TRAIN).gaps == 6
    assert threshold(view, Phase.BACKUP).mode == "fixed"  # 3 gaps: too few


def test_a_detection_names_the_threshold_in_force():
    view = _job({**AUTO, "heartbeat_timeout_min_gaps": 6})
    # m0 and m1 last heard at 60 s (the last summary); 2 s later they are past their 1.5 s
    # timeout, and m2, in backup, is not past its 9 s one.
    [finding, other] = detect(view, at(62.0))
    assert (finding.member, other.member) == ("m0", "m1") and finding.threshold is not None
    assert finding.threshold.seconds == pytest.approx(1.5)
    assert finding.detail == (
        "m0 silent for 2.0s in phase train (timeout 1.5s: timeout 1.5s = 3 x p99 gap 0.5s"
        " over 12 gaps in phase train, within [1, 30])"
    )
    # With the fixed policy nobody is silent yet.
    assert detect(_job({}), at(62.0)) == []


# -- the recorded two-incident run (heartbeats as soft state) under an auto policy ------------

#: Enough gaps by the hang (one per member and 2 s summary), a factor that clears the run's
#: longest regular silence (its recoveries' 1.5 s without heartbeats: the recording's members
#: do not beat while they recover).
AUTO_RUN = {**AUTO, "heartbeat_timeout_k": 5.0, "heartbeat_timeout_min_gaps": 20}


@functools.cache
def soft(**policy: object):
    return two_incidents_scenario(SoftScenario, liveness_summary_interval_s=2.0, **policy)


def hang_of(log):
    [_, hang] = [e for e in log if e.event.type == "fault.detected"]
    return hang


def test_a_recorded_run_detects_by_the_derived_timeout_and_replays_it():
    log = soft(**AUTO_RUN).log
    assert all(r.matches for r in redecide(log))
    hang = hang_of(log)
    payload = hang.event.payload
    assert payload.reason == "heartbeat_timeout" and payload.members == ["w10"]
    [limit] = payload.thresholds
    # p99 of the train phase's gaps is the recovery's 1.5 s silence: 5 x 1.5 s.
    assert (limit.mode, limit.phase, limit.seconds, limit.gap_s) == ("auto", "train", 7.5, 1.5)
    assert limit.how.startswith("timeout 7.5s = 5 x p99 gap 1.5s over ")
    assert "timeout 7.5s" in payload.detail
    # The decider's turns come a second apart: the first past 40 + 7.5 s.
    assert hang.recorded_at == at(HANG_LAST_HEARTBEAT_S + 8.0)
    # The fixed policy's recording detects it at its 4 s timeout, and names it.
    [fixed_limit] = hang_of(soft().log).event.payload.thresholds
    assert (fixed_limit.mode, fixed_limit.how) == ("fixed", f"fixed policy {HANG_TIMEOUT_S:g}s")
    assert hang_of(soft().log).recorded_at == at(HANG_LAST_HEARTBEAT_S + HANG_TIMEOUT_S + 1)


def test_a_counterfactual_compares_fixed_and_auto_timeouts():
    as_fixed = counterfactual(soft(**AUTO_RUN).log, {"heartbeat_timeout_mode": "fixed"})
    [_, hang] = as_fixed.incidents
    assert hang.detected_at == at(HANG_LAST_HEARTBEAT_S + HANG_TIMEOUT_S) + DEADLINE_TICK
    as_auto = counterfactual(soft().log, AUTO_RUN)
    [_, hang] = as_auto.incidents
    assert hang.members == ("w10",)
    assert hang.detected_at == at(HANG_LAST_HEARTBEAT_S + 7.5) + DEADLINE_TICK


def test_a_gap_counts_in_the_phase_it_began_in():
    """A member silent while it backed up, heard again training: the summary says the gap
    began in the backup phase, and the backup phase's timeout is derived from it."""
    table = LivenessTable(started_at=T0)
    events = Events()
    view = fold(None, recorded([events.joined("m0", incarnation="i1")]))

    def beat(t: float, phase: Phase) -> None:
        table.observe("job1", "m0", node="n0", incarnation="i1", generation=1, at=at(t), step=1,
                      phase=phase, step_seconds=0.0)  # fmt: skip

    beat(1.0, Phase.TRAIN)
    beat(1.5, Phase.BACKUP)
    beat(4.5, Phase.TRAIN)  # 3 s silent, from the backup's heartbeat on
    beat(5.0, Phase.TRAIN)
    [summary] = table.summarize(view, at(5.5), "interval")
    columns = summary.columns
    assert columns is not None
    assert columns.phase == [Phase.TRAIN] and columns.max_gap_ms == [3000]
    assert columns.max_gap_phase == [Phase.BACKUP]
    [sample] = samples_of(summary, view.members)
    assert (sample.phase, sample.gaps) == (Phase.BACKUP, ((3000, 1),))
    # No column when every gap began in the member's last phase (no bytes for the usual case).
    table.summarized("job1", at(5.5))
    beat(6.0, Phase.TRAIN)
    beat(9.5, Phase.TRAIN)
    [summary] = table.summarize(view, at(10.0), "interval")
    assert summary.columns is not None and summary.columns.max_gap_phase is None
