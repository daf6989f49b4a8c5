"""Slow ranks: a member whose compute time per step stays above the job's baseline is recorded
(``member.slow``) and, when the policy says so and it pays, replaced by a spare; a hiccup never
is. Jobs run as the service runs them (``SoftScenario``: heartbeats in the decider's table,
summaries recorded before every decision), so the log re-decides and replays."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from controlplane.core.replay import counterfactual, redecide
from controlplane.core.straggler import baseline
from schemas.common import FaultReason, JobState
from schemas.events import HeartbeatMessage, LivenessColumns, NodeHeartbeatMessage
from tests.factories import T0
from tests.scenario import SoftScenario

JOB = "job1"
WORKERS = ("w00", "w01", "w10", "w11")
#: Every worker's compute time per step, and the slow one's (50% slower).
NORMAL_S = 0.100
SLOW_S = 0.150
WINDOW_S = 5.0


def job(spares: int = 1, **policy: Any) -> SoftScenario:
    """Generation 1 of four workers (and ``spares``) RUNNING; backups at 10 and 20, step 23."""
    policy = {"slow_window_s": WINDOW_S, **policy}
    s = SoftScenario(JOB, world_size=4, min_world=2, liveness_summary_interval_s=2.0, **policy)
    s.cluster(2, 2, spares)
    return s.start_and_train()


def run(s: SoftScenario, until: int, compute: Any) -> list[tuple[int, list[Any]]]:
    """Every second up to ``until``: each active member of the world beats with
    ``compute(t, member)`` (spares report none), the decider runs; what it decided, by time."""
    out = []
    t = int((s.now - T0).total_seconds()) + 1
    while t <= until:
        s.at(t)
        world = set(s.v.world)
        alive = [m for m, member in s.v.members.items() if member.status.value == "active"]
        s.heartbeat(*alive, compute={m: compute(t, m) for m in alive if m in world})
        decided = s.decide()
        if decided:
            out.append((t, decided))
        t += 1
    return out


def slow_from(onset: int, member: str = "w01", factor: float = 1.5) -> Any:
    return lambda t, m: NORMAL_S * factor if m == member and t >= onset else NORMAL_S


def of_type(decided: list[Any], type_: str) -> list[Any]:
    return [d.payload for d in decided if d.type == type_]


# --------------------------------------------------------------------------- the detector


def test_the_baseline_is_robust_to_one_outlier():
    base = baseline([0.10, 0.10, 0.11, 5.0], ratio=0.2, mad_k=3.0)
    assert base.median_s == pytest.approx(0.105)
    assert base.threshold_s < 0.2  # a broken member does not drag the baseline up
    # A spread job's threshold follows its spread (k scaled MADs above the median).
    spread = baseline([0.1, 0.2, 0.3, 0.4, 0.5], ratio=0.2, mad_k=3.0)
    assert spread.threshold_s == pytest.approx(0.3 + 3 * 0.1 * 1.4826)


def test_a_millisecond_of_difference_is_the_reports_resolution_not_a_slow_member():
    """A model that computes in under a millisecond a step reads 0 ms on some ranks and 1 ms
    on others (compute times travel on the millisecond): no ratio makes that a straggler."""
    base = baseline([0.0, 0.0], ratio=0.2, mad_k=3.0)
    assert base.threshold_s == pytest.approx(0.005)
    s = job()
    assert run(s, 30, lambda t, m: 0.001 if m == "w01" else 0.0) == []
    # More than five milliseconds above it is the member's.
    assert run(job(), 30, lambda t, m: 0.008 if m == "w01" else 0.001) != []


def test_a_sustained_slowdown_is_flagged_after_the_window_and_replaced_by_a_spare():
    s = job(spares=1, slow_action="replace")
    decided = run(s, 25, slow_from(onset=10))
    [(t, first), *_] = decided
    # Slow from t=10: every heartbeat of the window [10, 15] slow, flagged at t=15.
    assert t == 10 + WINDOW_S
    [slow] = of_type(first, "member.slow")
    assert (slow.member, slow.rank, slow.action) == ("w01", 1, "replace")
    assert slow.compute_s == pytest.approx(SLOW_S) and slow.baseline_s == pytest.approx(NORMAL_S)
    assert slow.threshold_s == pytest.approx(NORMAL_S * 1.2) and slow.peers == 3
    assert slow.window_s == WINDOW_S
    # The evidence is the summary recorded just before the decision, in the log.
    cited = s.log[slow.evidence.position - 1].event
    assert cited.type == "liveness.summary" and cited.payload.reason == "decision"
    # Its numbers: 600 s x 0.05/0.15 lost against 30 s + 3 steps at 0.1 s.
    assert slow.projected_loss_s == pytest.approx(200.0)
    assert slow.recovery_cost_s == pytest.approx(30.3)
    assert "computes 0.150s a step over 5s against the job's 0.100s" in slow.reason
    assert "loses 200.0s of training; a replacement costs 30.3s" in slow.reason
    [fault] = of_type(first, "fault.detected")
    assert fault.reason is FaultReason.SLOW and fault.members == ["w01"]
    assert fault.evidence[0].what == "member.slow"
    [realloc] = of_type(first, "reallocation.issued")
    assert realloc.mode.value == "replace" and realloc.world[1] == "spare0"
    assert "replace w01 with spare0" in realloc.reason
    assert s.v.state is JobState.RECOVERING
    # Recorded once: the job recovers in generation 2, w01 is out of the world.
    assert all(not of_type(d, "member.slow") for _, d in decided[1:])
    # What was recorded is what the log re-decides.
    assert all(r.matches for r in redecide(s.log)), [r for r in redecide(s.log) if not r.matches]


def test_a_single_slow_step_is_never_acted_on():
    s = job(spares=1, slow_action="replace")
    # One heartbeat's mean five times the others' (one long step), then normal again.
    hiccup = lambda t, m: 0.5 if (m, t) == ("w01", 12) else NORMAL_S  # noqa: E731
    assert run(s, 40, hiccup) == []
    assert s.v.slow == {} and s.v.state is JobState.RUNNING
    # The summaries recorded every compute time (the log holds the evidence that it was not).
    assert s.v.compute["w01"].compute_s == pytest.approx(NORMAL_S)


def test_a_slowdown_shorter_than_the_window_is_not_acted_on():
    s = job(spares=1, slow_action="replace")
    brief = lambda t, m: SLOW_S if m == "w01" and 10 <= t < 14 else NORMAL_S  # noqa: E731
    assert run(s, 30, brief) == []


def test_the_ignore_policy_records_the_slow_member_once_and_does_nothing_else():
    s = job(spares=1)  # slow_action defaults to ignore
    decided = run(s, 40, slow_from(onset=10))
    [(t, only)] = decided
    assert t == 15 and [d.type for d in only] == ["member.slow"]
    [slow] = of_type(only, "member.slow")
    assert slow.action == "ignore" and "slow_action ignore" in slow.reason
    assert s.v.state is JobState.RUNNING and "w01" in s.v.world
    assert all(r.matches for r in redecide(s.log))


def test_replace_is_not_taken_when_it_costs_more_than_it_saves():
    s = job(spares=1, slow_action="replace", slow_horizon_s=30.0)
    [(_, only)] = run(s, 30, slow_from(onset=10))
    [slow] = of_type(only, "member.slow")
    # 30 s x 1/3 = 10 s lost, against 30.3 s for a replacement.
    assert slow.action == "ignore" and "not worth it" in slow.reason
    assert slow.projected_loss_s == pytest.approx(10.0)
    assert not of_type(only, "fault.detected")


def test_without_a_warm_spare_a_slow_member_is_only_recorded():
    s = job(spares=0, slow_action="replace")
    [(_, only)] = run(s, 30, slow_from(onset=10))
    [slow] = of_type(only, "member.slow")
    assert slow.action == "ignore" and "no warm spare" in slow.reason


def test_slow_detection_is_off_with_a_zero_window():
    s = job(spares=1, slow_action="replace", slow_window_s=0.0)
    assert run(s, 30, slow_from(onset=5)) == []
    assert s.v.compute == {}


def test_a_counterfactual_replace_of_a_run_that_ignored_its_slow_member():
    s = job(spares=1)
    run(s, 30, slow_from(onset=10))
    assert [e.event.type for e in s.log].count("member.slow") == 1
    result = counterfactual(s.log, {"slow_action": "replace"})
    reasons = [r for i in result.incidents for r in i.reasons]
    assert reasons == ["slow"]
    slow = [d.event.payload for d in result.decisions if d.event.type == "member.slow"]
    assert [x.action for x in slow] == ["replace"]
    assert any("compute times replayed" in n for n in result.notes)
    # Decided at the first summary that showed it (the counterfactual decides at the
    # summaries' times: the recorded one was taken for the recorded decision, at t=15).
    [decided] = [d for d in result.decisions if d.event.type == "member.slow"]
    assert decided.recorded_at == T0 + timedelta(seconds=15)


# --------------------------------------------------------------------------- untrusted input


def beat(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "job_id": JOB, "type": "member.heartbeat", "v": 1, "source": "n0/w01",
        "incarnation": "i1", "generation": 1, "emitted_at": T0.isoformat(), "payload": payload,
    }  # fmt: skip


@pytest.mark.parametrize("value", [-0.1, 3601.0, "nan", "inf"])
def test_a_heartbeat_s_compute_time_must_be_finite_non_negative_and_bounded(value):
    text = json.dumps(beat({"step": 3, "phase": "train", "compute_seconds": value}))
    with pytest.raises(ValidationError):
        HeartbeatMessage.model_validate_json(text.replace('"nan"', "NaN").replace('"inf"', "1e999"))


def test_a_node_s_compute_column_must_align_and_older_launchers_need_none():
    node = {
        "job_id": JOB, "type": "node.heartbeat", "v": 1, "source": "n0/launcher",
        "emitted_at": T0.isoformat(), "members": ["w00", "w01"], "incarnation": ["i", "i"],
        "generation": [1, 1], "age_ms": [0, 0], "step": [3, 3], "phase": ["train", "train"],
        "step_ms": [100, 150],
    }  # fmt: skip
    assert NodeHeartbeatMessage.model_validate_json(json.dumps(node)).compute_ms is None
    assert NodeHeartbeatMessage.model_validate_json(
        json.dumps({**node, "compute_ms": [100, None]})
    ).compute_ms
    for bad in ([100], [100, -1], [100, 3_600_001]):
        with pytest.raises(ValidationError):
            NodeHeartbeatMessage.model_validate_json(json.dumps({**node, "compute_ms": bad}))


def test_a_summary_s_compute_column_must_align():
    columns = {
        "epoch_ms": 0, "members": ["w00"], "generation": [1], "last_ms": [0], "first_ms": [0],
        "beats": [1], "max_gap_ms": [0], "max_gap_at_ms": [None], "phase": ["train"],
        "step": [1], "max_step_ms": [0],
    }  # fmt: skip
    assert LivenessColumns.model_validate_json(
        json.dumps({**columns, "compute_ms": [100]})
    ).compute_ms == [100]
    with pytest.raises(ValidationError):
        LivenessColumns.model_validate_json(json.dumps({**columns, "compute_ms": [100, 100]}))


def test_compute_times_are_bound_to_the_member_s_own_process_and_generation():
    s = job(spares=1)
    run(s, 12, slow_from(onset=5))
    # A heartbeat of the member's process in another generation starts its window again.
    heard = s.table.heard(JOB, "w01")
    assert heard is not None and heard.sustained_ms == round(SLOW_S * 1000)
    s.at(12.5)
    s.table.observe(
        JOB, "w01", node=s.v.members["w01"].node, incarnation=s.v.members["w01"].incarnation,
        generation=2, at=s.now, step=24, phase=s.v.phase("w01"), compute_seconds=SLOW_S,
        window_s=WINDOW_S,
    )  # fmt: skip
    assert heard.sustained_ms is None
