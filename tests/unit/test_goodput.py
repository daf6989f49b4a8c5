"""Goodput accounting (``core.goodput``) on scripted logs: every second in one term, each
term bounded by the events docs/design.md names."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.core.goodput import INCIDENT_TERMS, TERMS, GoodputCounter, goodput
from controlplane.core.timeline import timeline
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
