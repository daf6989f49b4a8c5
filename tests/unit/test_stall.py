"""Stalled steps: a member its peers wait for in a step's collectives, its heartbeats going on,
is found once every waiter waited past the step timeout, and replaced; nothing is found on
evidence that could be a group's own stall, a step that went on, or old news. Jobs run as the
service runs them (``SoftScenario``: heartbeats in the decider's table, summaries recorded
before every decision), so the log re-decides."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from controlplane.core.replay import redecide
from controlplane.core.stall import stalled
from controlplane.decode import decode_heartbeats
from rank_runtime.relay import _Latest, node_message
from schemas.common import FaultReason, JobState, Phase
from schemas.events import LivenessColumns, NodeHeartbeatMessage
from tests.scenario import SoftScenario

JOB = "job1"
WORKERS = ("w00", "w01", "w10", "w11")
#: The step every member finished when the stall begins (at t=STALL_T).
STEP = 30
STALL_T = 10


def job(spares: int = 1, **policy: Any) -> SoftScenario:
    """Generation 1 of four workers (and ``spares``) RUNNING, step 23."""
    policy = {"step_timeout_s": 3.0, "slow_window_s": 0, **policy}
    s = SoftScenario(JOB, world_size=4, min_world=2, liveness_summary_interval_s=2.0, **policy)
    s.cluster(2, 2, spares)
    return s.start_and_train()


def beat(
    s: SoftScenario,
    t: float,
    stuck: tuple[str, ...] = ("w01",),
    *,
    ready_lag: float = 0.2,
    steps: dict[str, int] | None = None,
    phase: str = "train",
) -> None:
    """At ``t``: every active member beats; all finished ``STEP`` at ``STALL_T`` (or their
    ``steps``); the ``stuck`` ones have not their gradients of the next step, the others had
    them ``ready_lag`` seconds after."""
    s.at(t)
    alive = [m for m, member in s.v.members.items() if member.status.value == "active"]
    since = {m: max(0.0, t - STALL_T) for m in alive}
    ready = {m: max(0.0, t - STALL_T - ready_lag) for m in alive if m not in stuck}
    steps = steps or {}
    for m in alive:
        s.heartbeat(m, step=steps.get(m, STEP), phase=phase, since={m: since[m]},
                    ready={m: ready.get(m)})  # fmt: skip


def run(s: SoftScenario, until: float, **kw: Any) -> list[tuple[float, list[Any]]]:
    """A beat and a decider's turn every half second from ``STALL_T`` to ``until``."""
    out = []
    t = float(STALL_T)
    while t <= until:
        beat(s, t, **kw)
        decided = s.decide()
        if decided:
            out.append((t, decided))
        t += 0.5
    return out


def of_type(decided: list[Any], type_: str) -> list[Any]:
    return [d.payload for d in decided if d.type == type_]


def test_a_member_its_peers_wait_for_is_found_stalled_past_the_step_timeout_and_replaced():
    s = job()
    decided = run(s, STALL_T + 8)
    [(t, first), *_] = decided
    # The waiters' gradients were ready at STALL_T + 0.2: found at the first turn past 3 s.
    assert t == STALL_T + 3.5
    [fault] = of_type(first, "fault.detected")
    assert fault.reason is FaultReason.STALLED and fault.members == ["w01"]
    assert "w01 (rank 1) finished step 30" in fault.detail
    assert "3 peer(s) with every gradient of step 31 ready waited 3.3s" in fault.detail
    assert "step timeout 3s" in fault.detail
    [threshold] = fault.thresholds
    assert (threshold.phase, threshold.seconds, threshold.mode) == (Phase.TRAIN, 3.0, "fixed")
    # The evidence is the decision's summary, in the log before it: where each one was.
    assert [e.what for e in fault.evidence] == ["liveness.summary"] * 2
    cited = s.log[fault.evidence[0].position - 1].event
    assert cited.type == "liveness.summary" and cited.payload.reason == "decision"
    [realloc] = of_type(first, "reallocation.issued")
    assert realloc.mode.value == "replace" and realloc.world[1] == "spare0"
    assert s.v.state is JobState.RECOVERING
    # What was recorded is what the log re-decides.
    assert all(r.matches for r in redecide(s.log)), [r for r in redecide(s.log) if not r.matches]


def test_the_decider_wakes_when_the_wait_would_pass_the_timeout():
    from controlplane.core.decide import next_deadline

    s = job()
    beat(s, STALL_T + 1)
    assert s.decide() == []
    deadline = next_deadline(s.table.probe(s.v))
    assert deadline is not None
    assert (deadline - s.now).total_seconds() == pytest.approx(3.0 + 0.2 - 1.0)


@pytest.mark.parametrize(
    "case",
    ["everyone_waits", "most_behind", "step_went_on", "not_training", "unknown", "off"],
)
def test_nothing_is_found_where_the_evidence_shows_no_member_s_own_stall(case):
    s = job(**({"step_timeout_s": 0} if case == "off" else {}))
    kw: dict[str, Any] = {}
    if case == "everyone_waits":  # a group's stall (the network): the collective timeout's
        kw["stuck"] = ()
    elif case == "most_behind":  # three of four: not one member's
        kw["stuck"] = ("w00", "w01", "w10")
    elif case == "step_went_on":  # a member finished the step the others wait in
        kw["steps"] = {"w11": STEP + 1}
    elif case == "not_training":  # a backup is the backup timeout's
        kw["phase"] = "backup"
    if case == "unknown":  # a member that reports nothing of its steps
        t = float(STALL_T)
        while t <= STALL_T + 8:
            beat(s, t)
            s.heartbeat("w11", step=STEP)  # (its last heartbeat carries nothing)
            assert s.decide() == []
            t += 0.5
        return
    assert run(s, STALL_T + 8, **kw) == []
    assert s.v.state is JobState.RUNNING


def test_old_evidence_is_not_judged():
    s = job()
    beat(s, STALL_T + 1)
    probe = s.table.probe(s.v)
    # Heard at STALL_T + 1: a minute later (no heartbeat since) it says nothing of now.
    later = s.now.replace(minute=s.now.minute + 1)
    assert stalled(probe, later) is None
    assert stalled(probe, s.now.replace(second=s.now.second + 3)) is not None


def test_an_auto_step_timeout_follows_the_longest_steps_recorded():
    s = job(step_timeout_mode="auto", step_timeout_k=4, step_timeout_min_steps=8,
            step_timeout_floor_s=1.0)  # fmt: skip
    # Steps of 0.5 s before the stall: interval summaries record each member's longest.
    t = 2.0
    while t < STALL_T:
        s.at(t)
        alive = [m for m, member in s.v.members.items() if member.status.value == "active"]
        s.heartbeat(*alive, step=STEP - 1, step_seconds=0.5)
        assert s.decide() == []
        t += 1
    assert s.v.step_threshold is not None and s.v.step_threshold.seconds == pytest.approx(2.0)
    [(t, first), *_] = run(s, STALL_T + 8)
    assert t == STALL_T + 2.5  # 4 x 0.5 s, not the fixed 3 s
    [fault] = of_type(first, "fault.detected")
    [threshold] = fault.thresholds
    assert threshold.mode == "auto" and threshold.seconds == pytest.approx(2.0)
    assert threshold.how.startswith("step timeout 2s = 4 x p99 step 0.5s over")
    assert all(r.matches for r in redecide(s.log))


def test_below_the_minimum_of_steps_the_fixed_timeout_holds():
    s = job(step_timeout_mode="auto", step_timeout_min_steps=1000)
    [(t, first), *_] = run(s, STALL_T + 8)
    assert t == STALL_T + 3.5
    [fault] = of_type(first, "fault.detected")
    assert "fewer than 1000" in fault.thresholds[0].how


def test_a_stalled_member_is_listed_with_its_progress_never_named_regular():
    s = job()
    beat(s, STALL_T + 2.5)
    [part] = s.table.summarize(s.v, s.now, "interval")
    assert part.columns is not None and part.columns.since_step_ms is not None
    assert set(part.columns.members) == set(WORKERS) | {"spare0"} - set(
        part.regular.members if part.regular else ()
    )
    listed = dict(zip(part.columns.members, part.columns.ready_ms or [], strict=True))
    assert listed["w01"] is None and listed["w00"] == 2300


def test_heartbeats_carry_where_a_member_is_through_its_node_s_launcher():
    heard = [
        ("w00", _Latest(0.0, "i1", 1, STEP, "train", 0.1, None, 4.0, 3.8)),
        ("w01", _Latest(0.0, "i1", 1, STEP, "train", 0.1, None, 4.0, None)),
    ]
    data = node_message(JOB, "n0", "2026-01-01T00:00:00Z", heard, 0.0)
    message = json.loads(data)
    assert message["since_step_ms"] == [4000, 4000] and message["ready_ms"] == [3800, None]
    beats = decode_heartbeats(f"elastic.hb.{JOB}.n0.launcher", data)
    assert not isinstance(beats, str)
    assert beats.since_step_ms == [4000, 4000] and beats.ready_ms == [3800, None]
    # No member reports one: no column at all.
    plain = json.loads(node_message(JOB, "n0", "2026-01-01T00:00:00Z", [
        ("w00", _Latest(0.0, "i1", 1, STEP, "train", 0.1)),
    ], 0.0))  # fmt: skip
    assert "since_step_ms" not in plain and "ready_ms" not in plain
    # A column that does not line up with the members is refused.
    message["ready_ms"] = [1]
    with pytest.raises(ValidationError, match="column ready_ms has 1 values"):
        NodeHeartbeatMessage.model_validate_json(json.dumps(message))
    with pytest.raises(ValidationError, match="column since_step_ms"):
        LivenessColumns.model_validate_json(json.dumps({
            "epoch_ms": 0, "members": ["a"], "generation": [1], "last_ms": [0],
            "first_ms": [None], "beats": [1], "max_gap_ms": [0], "max_gap_at_ms": [None],
            "phase": ["train"], "step": [1], "max_step_ms": [0], "since_step_ms": [],
        }))  # fmt: skip
