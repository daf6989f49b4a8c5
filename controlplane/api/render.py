"""Job views as API responses (``schemas.api``): pure functions of a folded view."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from datetime import datetime

from controlplane.core.decide import natural_key
from controlplane.core.detect import accusations
from controlplane.core.goodput import Goodput
from controlplane.core.timeline import PHASES, POINTS, timeline
from controlplane.core.view import Decision, Heartbeat, Incident, JobView, Member, StepBackup
from schemas.api import (
    BackupOut,
    Cluster,
    DecisionOut,
    DiscountOut,
    GenerationGoodputOut,
    GoodputOut,
    IncidentCostOut,
    IncidentSummary,
    IncidentTimeline,
    JobDetail,
    JobSummary,
    LossCurve,
    LossPoint,
    MemberOut,
    PhaseOut,
    ShardOut,
    StateChangeOut,
    TimelinePoint,
)
from schemas.common import Phase


def _summary_fields(view: JobView) -> dict[str, object]:
    return {
        "job_id": view.job_id,
        "name": view.name,
        "state": view.state,
        "generation": view.generation,
        "world_size": len(view.world),
        "last_step": view.last_step,
        "last_loss": view.last_loss,
        "incidents": len(view.incidents),
        "open_incident": view.open_incident,
        "events": view.events,
        "last_position": view.last_position,
        "registered_at": view.registered_at,
        "last_event_at": view.last_recorded_at,
    }


def job_summary(view: JobView) -> JobSummary:
    """One row of ``GET /jobs``."""
    return JobSummary.model_validate(_summary_fields(view))


def job_detail(view: JobView) -> JobDetail:
    """``GET /jobs/{job}``: the summary, the policy and the state-machine history."""
    return JobDetail.model_validate(
        {
            **_summary_fields(view),
            "policy": view.policy.model_dump(mode="json") if view.policy is not None else None,
            "completed_step": view.completed_step,
            "history": history_out(view),
        }
    )


def history_out(view: JobView) -> list[StateChangeOut]:
    """The job's state-machine transitions, oldest first."""
    return [
        StateChangeOut(
            position=c.position,
            at=c.at,
            from_state=c.from_state,
            to_state=c.to_state,
            reason=c.reason,
        )
        for c in view.history
    ]


def _incident_fields(incident: Incident) -> dict[str, object]:
    derived = timeline(incident)
    return {
        "incident_id": incident.incident_id,
        "kind": incident.kind,
        "opened_at": incident.opened_at,
        "opened_position": incident.opened_position,
        "members": list(incident.members),
        "reasons": list(incident.reasons),
        "outcome": incident.outcome,
        "downtime_s": (
            incident.downtime_s if incident.downtime_s is not None else derived.downtime_s
        ),
        "steps_lost": (
            incident.steps_lost if incident.steps_lost is not None else derived.steps_lost
        ),
        "decisions": len(incident.decisions),
        "anomaly_step": incident.anomaly_step,
    }


def incident_summary(incident: Incident) -> IncidentSummary:
    """One row of ``GET /jobs/{job}/incidents``."""
    return IncidentSummary.model_validate(_incident_fields(incident))


def _decision(decision: Decision) -> DecisionOut:
    return DecisionOut(
        position=decision.position,
        at=decision.at,
        command_id=decision.command_id,
        generation=decision.generation,
        mode=decision.mode,
        world=list(decision.world),
        restore_step=decision.restore_step,
        restore_from=decision.restore_from,
        reason=decision.reason,
        skip=list(decision.skip),
    )


def incident_timeline(incident: Incident) -> IncidentTimeline:
    """``GET /jobs/{job}/incidents/{incident}``: points (by log position), phases, decisions."""
    derived = timeline(incident)
    points = [
        TimelinePoint(name=name, position=mark.position, at=mark.at)
        for name in POINTS
        if (mark := derived.points[name]) is not None
    ]
    phases = [
        PhaseOut(name=phase, start=start, end=end, seconds=derived.phases[phase])
        for phase, (start, end) in zip(PHASES, itertools.pairwise(POINTS), strict=True)
    ]
    return IncidentTimeline.model_validate(
        {
            **_incident_fields(incident),
            "points": points,
            "phases": phases,
            "step_at_fault": incident.step_at_fault,
            "resolved_at": incident.resolved_at,
            "resolved_position": incident.resolved_position,
            "detections": list(incident.detections),
            "history": [_decision(d) for d in incident.decisions],
        }
    )


def member_out(
    member: Member, suspected_by: list[str] | None = None, heartbeat: Heartbeat | None = None
) -> MemberOut:
    """A member as ``GET /jobs/{job}/cluster`` describes it (``heartbeat``: its last, from
    the view's ``heartbeats``)."""
    return MemberOut(
        member_id=member.member_id,
        node=member.node,
        rack=member.rack,
        host=member.host,
        role=member.role,
        status=member.status.value,
        rank=member.rank,
        phase=heartbeat.phase if heartbeat is not None else Phase.INIT,
        step=member.step,
        last_heartbeat_at=heartbeat.at if heartbeat is not None else None,
        joined_at=member.joined_at,
        failed_reason=member.failed_reason,
        announced=member.announced_position is not None,
        suspected_by=suspected_by or [],
        demoted=member.demoted_position is not None,
    )


def _backup(backup: StepBackup, redundancy: int) -> BackupOut:
    return BackupOut(
        step=backup.step,
        generation=backup.generation,
        complete=backup.is_complete(redundancy),
        shards=[
            ShardOut(
                shard=s.shard,
                owner=s.owner,
                nbytes=s.nbytes,
                verified_holders=s.verified_holders(),
            )
            for _, s in sorted(backup.shards.items())
        ],
    )


def _topology(members: Iterable[Member]) -> dict[str, dict[str, list[str]]]:
    """rack -> node -> members, each level in natural order (rack2 before rack10)."""
    grouped: dict[str, dict[str, list[str]]] = {}
    for m in members:
        grouped.setdefault(m.rack, {}).setdefault(m.node, []).append(m.member_id)
    return {
        rack: {
            node: sorted(grouped[rack][node], key=natural_key)
            for node in sorted(grouped[rack], key=natural_key)
        }
        for rack in sorted(grouped, key=natural_key)
    }


def cluster(view: JobView) -> Cluster:
    """``GET /jobs/{job}/cluster``: members, topology, backups and state."""
    redundancy = view.effective_policy.redundancy
    suspects = accusations(view)
    return Cluster(
        job_id=view.job_id,
        state=view.state,
        generation=view.generation,
        world=list(view.world),
        rendezvous=view.rendezvous,
        placement=[list(holders) for holders in view.placement],
        placement_note=view.placement_note,
        members=[
            member_out(m, suspects.get(m.member_id), view.heartbeats.get(m.member_id))
            for m in view.members.values()
        ],
        topology=_topology(view.members.values()),
        backups=[_backup(b, redundancy) for _, b in sorted(view.backups.items())],
        last_complete_backup=view.last_complete_backup,
        discounts=[
            DiscountOut(
                position=d.position, type=d.type, source=d.source, reason=d.reason.value,
                detail=d.detail,
            )
            for d in view.discounts
        ],
        discount_counts=dict(view.discount_counts),
    )  # fmt: skip


def loss_curve(view: JobView, points: Iterable[tuple[int, float, datetime]]) -> LossCurve:
    """``GET /jobs/{job}/loss``: the mean loss by step (``points``: (step, loss, time of its
    last report) in step order) and the step each fault opened at (growth incidents are no
    faults)."""
    return LossCurve(
        points=[LossPoint(step=step, loss=loss, at=at) for step, loss, at in points],
        faults={
            i.incident_id: i.step_at_fault for i in view.incidents.values() if i.kind == "fault"
        },
    )


def _rounded(seconds: dict[str, float]) -> dict[str, float]:
    return {term: round(value, 6) for term, value in seconds.items()}


def goodput(found: Goodput) -> GoodputOut:
    """``GET /jobs/{job}/goodput`` (and ``elasticctl goodput --json``): the breakdown."""
    return GoodputOut(
        job_id=found.job_id,
        started_at=found.started_at,
        ended_at=found.ended_at,
        final=found.final,
        wall_s=round(found.wall_s, 6),
        seconds=_rounded(found.seconds),
        ettr=None if found.ettr is None else round(found.ettr, 6),
        productive_steps=found.productive_steps,
        recomputed_steps=found.recomputed_steps,
        goodput_steps_per_s=None
        if found.goodput_steps_per_s is None
        else round(found.goodput_steps_per_s, 6),
        incidents=[
            IncidentCostOut(
                incident_id=i.incident_id, kind=i.kind, outcome=i.outcome,
                phases=_rounded(i.phases), recomputation_s=round(i.recomputation_s, 6),
                steps_lost=i.steps_lost, cost_s=round(i.cost_s, 6),
                ettr_lost=round(i.ettr_lost, 6),
            )
            for i in found.incidents
        ],
        generations=[
            GenerationGoodputOut(
                generation=g.generation, started_at=g.started_at, ended_at=g.ended_at,
                wall_s=round(g.wall_s, 6), seconds=_rounded(g.seconds),
                productive_steps=g.productive_steps, recomputed_steps=g.recomputed_steps,
                ettr=None if g.ettr is None else round(g.ettr, 6),
                goodput_steps_per_s=None
                if g.goodput_steps_per_s is None
                else round(g.goodput_steps_per_s, 6),
            )
            for g in found.generations
        ],
        not_measured=list(found.not_measured),
    )  # fmt: skip
