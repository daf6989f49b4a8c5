"""Commands owed to the members of a job, derived from its view (pure).

A decision is recorded first and published second; what is owed is therefore a function of the
log: the start of the first generation until every member of its world sent an event of that
generation, the latest reallocation of an open incident until every member of its world acked
it, and a stop while members of a stopped or completed job are still alive. Publishing the
same command again is harmless (members and JetStream de-duplicate by ``command_id``), so a
service calls this after each decision and again after a restart.
"""

from __future__ import annotations

import uuid

from controlplane.core.decide import decision_id
from controlplane.core.view import JobView, MemberStatus
from schemas.commands import Reallocate, Start, Stop
from schemas.common import JobState


def owed(view: JobView) -> list[Start | Reallocate | Stop]:
    """Commands of ``view`` that some member may not have seen yet."""
    if view.state in (JobState.STOPPED, JobState.COMPLETED):
        # Members still alive (spares never needed, ranks that missed the end) are told.
        alive = any(m.status is MemberStatus.ACTIVE for m in view.members.values())
        change = view.history[-1] if view.history else None
        if not alive or change is None:
            return []
        return [
            Stop(
                command_id=uuid.UUID(decision_id(view.job_id, "stop-command")),
                job_id=view.job_id,
                decision_position=change.position,
                issued_at=change.at,
                reason=change.reason,
            )
        ]
    if view.open_incident is None:
        return _start(view)
    incident = view.incidents[view.open_incident]
    if not incident.decisions:
        return []
    decision = incident.decisions[-1]
    if all(m in decision.acked for m in decision.world):
        return []
    placement = [list(h) for h in view.placement] if view.generation == decision.generation else []
    return [
        Reallocate.model_construct(
            command_id=uuid.UUID(decision.command_id),
            job_id=view.job_id,
            decision_position=decision.position,
            issued_at=decision.at,
            incident_id=uuid.UUID(incident.incident_id),
            generation=decision.generation,
            mode=decision.mode,
            world=list(decision.world),
            restore_step=decision.restore_step,
            restore_from=decision.restore_from,
            plan=list(decision.plan),
            placement=placement,
            rendezvous=decision.rendezvous,
            endpoints=_endpoints(view, decision.world),
        )
    ]


def _endpoints(view: JobView, world: tuple[str, ...]) -> dict[str, str]:
    members = view.members
    return {m: members[m].backup_endpoint for m in world if m in members}


def _start(view: JobView) -> list[Start | Reallocate | Stop]:
    """The current generation, while a member of its world has not shown it knows it."""
    mark = view.generation_mark
    if view.state is not JobState.RUNNING or mark is None:
        return []
    if any(d.generation == view.generation for i in view.incidents.values() for d in i.decisions):
        return []  # a reallocation formed it: its members were told by the Reallocate
    members = view.members
    if all(m in members and members[m].generation >= view.generation for m in view.world):
        return []
    return [
        Start.model_construct(
            command_id=uuid.UUID(decision_id(view.job_id, f"start/{view.generation}")),
            job_id=view.job_id,
            decision_position=mark.position,
            issued_at=mark.at,
            generation=view.generation,
            world=list(view.world),
            placement=[list(h) for h in view.placement],
            rendezvous=view.rendezvous,
            endpoints=_endpoints(view, view.world),
        )
    ]
