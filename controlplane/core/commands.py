"""Commands owed to the members of a job, derived from its view (pure).

A decision is recorded first and published second; what is owed is therefore a function of the
log: the start of the first generation until every member of its world sent an event of that
generation, the latest reallocation of an open incident until every member of its world acked
it, and a stop while members of a stopped or completed job are still alive. Publishing the
same command again is harmless (members and JetStream de-duplicate by ``command_id``), so a
service calls this after each decision and again after a restart.

``owing`` gives the ids of what is owed and builds each command only when asked: a command of a
4,096-rank world (its world, placement, plan and endpoints) costs milliseconds to build and
encode, and a service that sent it a moment ago does not need it again yet.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.core.decide import decision_id
from controlplane.core.mesh import degrees
from controlplane.core.view import Decision, JobView, MemberStatus
from schemas.commands import Reallocate, Start, Stop
from schemas.common import JobState

Command = Start | Reallocate | Stop
_ENDPOINT = operator.attrgetter("backup_endpoint")


@dataclass(frozen=True, slots=True)
class Owed:
    """A command owed: its id, and how to build it (pure, from the view it was owed by)."""

    command_id: str
    build: Callable[[], Command]


def owed(view: JobView) -> list[Command]:
    """Commands of ``view`` that some member may not have seen yet."""
    return [o.build() for o in owing(view)]


def owing(view: JobView) -> list[Owed]:
    """The commands ``owed`` returns, each built only when its ``build`` is called."""
    if view.state in (JobState.STOPPED, JobState.COMPLETED):
        # Members still alive (spares never needed, ranks that missed the end) are told.
        alive = any(m.status is MemberStatus.ACTIVE for m in view.members.values())
        change = view.history[-1] if view.history else None
        if not alive or change is None:
            return []
        stop_id = decision_id(view.job_id, "stop-command")
        return [
            Owed(
                stop_id,
                lambda: Stop(
                    command_id=uuid.UUID(stop_id),
                    job_id=view.job_id,
                    decision_position=change.position,
                    issued_at=change.at,
                    reason=change.reason,
                    outcome="completed" if view.state is JobState.COMPLETED else "stopped",
                ),
            )
        ]
    if view.open_incident is None:
        return _start(view)
    incident = view.incidents[view.open_incident]
    if not incident.decisions:
        return []
    decision = incident.decisions[-1]
    acked = decision.acked
    if all(m in acked for m in decision.world):
        return []
    return [Owed(decision.command_id, lambda: _reallocate(view, incident.incident_id, decision))]


def _reallocate(view: JobView, incident_id: str, decision: Decision) -> Reallocate:
    placement = list(map(list, view.placement)) if view.generation == decision.generation else []
    return Reallocate.model_construct(
        command_id=uuid.UUID(decision.command_id),
        job_id=view.job_id,
        decision_position=decision.position,
        issued_at=decision.at,
        incident_id=uuid.UUID(incident_id),
        generation=decision.generation,
        mode=decision.mode,
        world=list(decision.world),
        restore_step=decision.restore_step,
        restore_from=decision.restore_from,
        plan=list(decision.plan),
        digests=list(decision.digests),
        placement=placement,
        rendezvous=decision.rendezvous,
        endpoints=_endpoints(view, decision.world),
        incarnations=_incarnations(view, decision.world),
        mesh=_mesh(view, len(decision.world)),
        demoted=list(decision.demoted),
        skip=list(decision.skip),
    )


def _mesh(view: JobView, world_size: int) -> dict[str, int] | None:
    """The degrees of a generation of ``world_size`` ranks on the job's mesh (None: none)."""
    policy = view.policy
    return degrees(policy.mesh, world_size) if policy is not None else None


def _endpoints(view: JobView, world: tuple[str, ...]) -> dict[str, str]:
    members = view.members
    known = list(filter(members.__contains__, world))
    return dict(zip(known, map(_ENDPOINT, map(members.__getitem__, known)), strict=True))


def _incarnations(view: JobView, world: tuple[str, ...]) -> list[str]:
    """The process each rank of ``world`` is (empty when one of them is not known)."""
    members = view.members
    found = [members[m].incarnation for m in world if m in members]
    return found if len(found) == len(world) else []


def _start(view: JobView) -> list[Owed]:
    """The current generation, while a member of its world has not shown it knows it."""
    mark = view.generation_mark
    if view.state is not JobState.RUNNING or mark is None:
        return []
    if any(d.generation == view.generation for i in view.incidents.values() for d in i.decisions):
        return []  # a reallocation formed it: its members were told by the Reallocate
    members = view.members
    if all(m in members and members[m].generation >= view.generation for m in view.world):
        return []
    start_id = decision_id(view.job_id, f"start/{view.generation}")
    return [
        Owed(
            start_id,
            lambda: Start.model_construct(
                command_id=uuid.UUID(start_id),
                job_id=view.job_id,
                decision_position=mark.position,
                issued_at=mark.at,
                generation=view.generation,
                world=list(view.world),
                placement=list(map(list, view.placement)),
                rendezvous=view.rendezvous,
                endpoints=_endpoints(view, view.world),
                incarnations=_incarnations(view, view.world),
                mesh=_mesh(view, len(view.world)),
            ),
        )
    ]
