"""Goodput accounting (``core.goodput``) on scripted logs: every second in one term, each
term bounded by the events docs/design.md names."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.core.goodput import (
    INCIDENT_TERMS,
    TERMS,
    GoodputCounter,
    goodput,
    goodput_types,
)
from controlplane.core.timeline import timeline
from schemas.common import CONTROLPLANE_SOURCE
from schemas.events import ms_of
from tests.factories import T0
from tests.recorded import LAST_STEP, two_incidents_scenario
from tests.scenario import Scenario


def _counted(s: Scenario) -> GoodputCounter:
    counter = GoodputCounter()
    counter.count(s.log)
    return counter


def test_a_two_incident_run_splits_its_wall_time_into_terms():
    s = two_incidents_scenario()
    found = goodput(s.v, _counted(s), s.now + timedelta(hours=1))
    assert found is not None and found.final  # ended: the time asked does not matter
    assert found.started_at == T0 and found.wall_s == pytest.approx(55.5)
    assert set(found.seconds) == set(TERMS)
    assert sum(found.seconds.values()) == pytest.approx(found.wall_s)
    assert all(v >= 0 for v in found.seconds.values())
    assert found.ettr == pytest.approx(found.seconds["productive"] / found.wall_s)
    # registration (t=0) to the first step (t=1).
    assert found.seconds["waiting"] == pytest.approx(1.0)
    # 18 backups (every 5 steps of each world), each rank's copy 0.01 s.
    assert found.seconds["backup"] == pytest.approx(0.18)
    assert found.seconds["stragglers"] == 0  # no member recorded slow
    # Each step of the timeline made once, the steps lost redone.
    assert found.productive_steps == LAST_STEP
    assert found.recomputed_steps == sum(i.steps_lost or 0 for i in found.incidents) == 6

    for incident, cost in zip(s.v.incidents.values(), found.incidents, strict=True):
        line = timeline(incident)
        # The window's terms are the timeline's phases (ack and restore together) ...
        assert cost.phases["detection"] == pytest.approx(line.phases["detect"])
        assert cost.phases["decision"] == pytest.approx(line.phases["decide"])
        assert cost.phases["restore"] == pytest.approx(
            (line.phases["ack"] or 0) + (line.phases["restore"] or 0)
        )
        assert cost.phases["resume"] == pytest.approx(line.phases["resume"])
        # ... and add up to its downtime.
        assert sum(cost.phases.values()) == pytest.approx(line.downtime_s)
        assert cost.cost_s == pytest.approx(line.downtime_s + cost.recomputation_s)
        assert cost.ettr_lost == pytest.approx(cost.cost_s / found.wall_s)
    crash, hang = found.incidents
    assert crash.recomputation_s == pytest.approx(0.7) == hang.recomputation_s
    assert hang.phases["detection"] == pytest.approx(5.0)
    assert sum(found.seconds[t] for t in INCIDENT_TERMS) == pytest.approx(0.8 + 5.8)

    # Generations cover the job from the first one's start, and add up to it.
    assert [g.generation for g in found.generations] == [1, 2, 3]
    for term in TERMS:
        assert sum(g.seconds[term] for g in found.generations) == pytest.approx(found.seconds[term])
    first, second, third = found.generations
    assert first.recomputed_steps == 0 and second.recomputed_steps == third.recomputed_steps == 3
    # The crash's detection and decision fall in generation 1, its restore in generation 2.
    assert first.seconds["restore"] == 0 and second.seconds["restore"] == pytest.approx(0.5)


def _single_generation(last_step: int) -> Scenario:
    """4 workers: registered at t=0, generation 1 started at t=0, steps 1..``last_step`` one
    a second from t=2, a backup (copy 0.01 s a rank) after step 2."""
    s = Scenario("job-gp", world_size=4, min_world=2, backup_interval=2, redundancy=1)
    s.cluster(racks=2, nodes_per_rack=2)
    s.decide()
    for step in range(1, last_step + 1):
        s.at(1 + step)
        s.step(step)
        if step == 2:
            s.backup(step)
    return s


def test_a_running_job_is_accounted_until_now_and_its_tail_is_idle():
    s = _single_generation(4)  # last step at t=5
    found = goodput(s.v, _counted(s), T0 + timedelta(seconds=10))
    assert found is not None and not found.final
    assert found.wall_s == pytest.approx(10.0)
    assert found.seconds["waiting"] == pytest.approx(2.0)  # to the first step (t=2)
    assert found.seconds["productive"] == pytest.approx(3.0 - 0.01)  # t=2..5 less the copy
    assert found.seconds["backup"] == pytest.approx(0.01)
    assert found.seconds["idle"] == pytest.approx(5.0)  # t=5 to now
    assert found.seconds["stragglers"] == 0
    assert found.ettr == pytest.approx(2.99 / 10)
    assert found.incidents == ()
    # The same log counted in two parts counts the same.
    halves = GoodputCounter()
    halves.count(s.log[:20])
    halves.count(s.log[20:])
    assert goodput(s.v, halves, T0 + timedelta(seconds=10)) == found


def test_an_unregistered_job_has_no_breakdown():
    s = Scenario("job-none")
    s.join("w00", "node-0-0", "rack0")
    assert s.v.registered_at is None
    assert goodput(s.v, _counted(s), T0) is None


def test_recomputation_ends_where_the_world_passes_the_highest_step_reported():
    counter = GoodputCounter()
    g = counter._of(2)
    at = T0
    g._step(11, at, high=15)
    # The record of step 15 is missing (retention kept fewer): the end of recomputation lies
    # between step 14's record and step 17's, in proportion.
    g._step(14, at + timedelta(seconds=3), high=None)
    g._step(17, at + timedelta(seconds=6), high=None)
    assert g.recompute_until() == at + timedelta(seconds=4)
    assert g.steps() == (2, 5)  # 16, 17 made; 11..15 redone


# ------------------------------------------------------------------------- stragglers

#: The slow member's numbers: sustained 0.3 s a step against its peers' 0.1 s (threshold
#: 0.12 s): each step waits 0.2 s for it.
SLOW, BASELINE, THRESHOLD = 0.3, 0.1, 0.12


def _slow(s: Scenario, member: str, window_s: float, source: str = CONTROLPLANE_SOURCE) -> None:
    """A ``member.slow`` of ``member`` now, its evidence a summary recorded now."""
    s.add(
        s.ev.make(
            "member.slow",
            {
                "member": member, "rank": s.v.world.index(member), "compute_s": SLOW,
                "baseline_s": BASELINE, "mad_s": 0.0, "threshold_s": THRESHOLD, "peers": 3,
                "window_s": window_s,
                "evidence": {"member": member, "what": "liveness.summary", "at": s.now},
                "action": "ignore", "projected_loss_s": 1.0, "recovery_cost_s": 30.0,
                "reason": "slow",
            },
            source=source, generation=s.v.generation, at=s.now,
        )
    )  # fmt: skip


def _summary(s: Scenario, member: str, compute_s: float, *, regular: bool = False) -> None:
    """A ``liveness.summary`` now naming ``member``'s sustained compute time (in the columns,
    or among the members heard regularly)."""
    epoch = ms_of(s.now)
    ms = round(compute_s * 1000)
    payload: dict[str, object] = {
        "reason": "interval", "at": s.now, "since": s.now - timedelta(seconds=2),
        "compute_window_ms": 4000,
    }  # fmt: skip
    if regular:
        payload["regular"] = {
            "members": [member], "bound_ms": 500, "generation": s.v.generation,
            "phase": "train", "step_min": 0, "step_max": 10_000, "max_step_ms": 1000,
            "compute_ms": [ms],
        }  # fmt: skip
    else:
        payload["columns"] = {
            "epoch_ms": epoch, "members": [member], "generation": [s.v.generation],
            "last_ms": [0], "first_ms": [-2000], "beats": [8], "max_gap_ms": [250],
            "max_gap_at_ms": [None], "phase": ["train"], "step": [0], "max_step_ms": [1000],
            "compute_ms": [ms],
        }  # fmt: skip
    s.add(
        s.ev.make(
            "liveness.summary", payload, source=CONTROLPLANE_SOURCE,
            generation=s.v.generation, at=s.now,
        )
    )  # fmt: skip


def _straggling(source: str = CONTROLPLANE_SOURCE, recover: bool = True) -> Scenario:
    """``_single_generation``'s steps 1..20 (step n at t=1+n), w01 recorded slow at t=11.5
    (after step 10) over a 4 s window, a summary still finding it slow at t=15.5 (after step
    14), and (``recover``) one at t=18.5 (after step 17) finding it under the threshold."""
    s = Scenario("job-gp", world_size=4, min_world=2, backup_interval=2, redundancy=1)
    s.cluster(racks=2, nodes_per_rack=2)
    s.decide()
    for step in range(1, 21):
        s.at(1 + step)
        s.step(step)
        if step == 2:
            s.backup(step)
        if step == 10:
            s.at(11.5)
            _slow(s, "w01", window_s=4.5, source=source)  # the window from t=7 (step 6)
        elif step == 14:
            s.at(15.5)
            _summary(s, "w01", SLOW)
        elif step == 17 and recover:
            s.at(18.5)
            _summary(s, "w01", BASELINE + 0.01, regular=True)  # under the threshold
    return s


def test_steps_a_slow_member_held_up_are_stragglers_time():
    s = _straggling()
    now = T0 + timedelta(seconds=25)
    found = goodput(s.v, _counted(s), now)
    assert found is not None
    # Steps 7..10 (its detection window), 11..14 (to the summary still finding it slow) and
    # 15..17 (to the summary finding it recovered) waited 0.2 s each; none after.
    assert found.seconds["stragglers"] == pytest.approx((4 + 4 + 3) * (SLOW - BASELINE))
    # Taken out of the step time (t=2..21) beside the backup's copy.
    assert found.seconds["productive"] == pytest.approx(19.0 - 0.01 - 2.2)
    assert found.seconds["backup"] == pytest.approx(0.01)
    assert sum(found.seconds.values()) == pytest.approx(found.wall_s) == 25.0
    assert all(v >= 0 for v in found.seconds.values())
    [generation] = found.generations
    assert generation.seconds == pytest.approx(found.seconds)
    # The same log counted in two parts counts the same.
    halves = GoodputCounter()
    halves.count(s.log[:40])
    halves.count(s.log[40:])
    assert goodput(s.v, halves, now) == found


@pytest.mark.parametrize("recover", [True, False])
def test_a_reader_of_only_the_types_a_counter_needs_counts_the_same(recover):
    """The API's reader after a snapshot start fetches ``goodput_types`` (summaries only when
    the view records a member slow)."""
    for s in (_straggling(recover=recover), _single_generation(6)):
        types = goodput_types(bool(s.v.slow))
        assert ("liveness.summary" in types) is bool(s.v.slow)
        read = GoodputCounter()
        read.count([e for e in s.log if e.event.type in types])
        now = T0 + timedelta(seconds=30)
        assert goodput(s.v, read, now) == goodput(s.v, _counted(s), now)


def test_a_member_still_slow_holds_up_every_step_to_the_last():
    s = _straggling(recover=False)
    found = goodput(s.v, _counted(s), T0 + timedelta(seconds=25))
    assert found is not None
    # Steps 7..20 at 0.2 s each (the last summary's value to the generation's last step).
    assert found.seconds["stragglers"] == pytest.approx(14 * (SLOW - BASELINE))
    assert sum(found.seconds.values()) == pytest.approx(found.wall_s)


def test_a_member_slow_not_from_the_control_plane_is_not_counted():
    s = _straggling(source="node-0-1/w01")
    found = goodput(s.v, _counted(s), T0 + timedelta(seconds=25))
    assert found is not None
    assert found.seconds["stragglers"] == 0
    assert found.seconds["productive"] == pytest.approx(19.0 - 0.01)


def test_stragglers_time_is_never_more_than_the_steps_took():
    counter = GoodputCounter()
    g = counter._of(1)
    for step in range(1, 11):  # a step a second
        g._step(step, T0 + timedelta(seconds=step), high=None)
    # 3 s of excess a step, but the steps took 1 s each: at most the time between records.
    g._slow_member("w01", 3.5, 0.5, 0.6, T0 + timedelta(seconds=6))
    assert g.stragglers() == (0.0, pytest.approx(4.0))
    # Retention kept few records: a window starting before the oldest one counts from it.
    sparse = counter._of(2)
    for step in (20, 30):
        sparse._step(step, T0 + timedelta(seconds=step), high=25)
    sparse._slow_member("w01", 0.3, 0.1, 0.12, T0)
    redo, made = sparse.stragglers()
    assert (redo, made) == (pytest.approx(5 * 0.2), pytest.approx(5 * 0.2))  # 21..25, 26..30
