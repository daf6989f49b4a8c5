"""An incident's recovery timeline, derived from the folded log alone.

Points (DESIGN.md): fault (the earliest evidence) -> detected -> decided (the reallocation) ->
acked by all -> restored by all -> first step of the new generation. Each point carries the log
position of the event behind it; phases are the gaps between consecutive points. A point not
reached yet (or never, when the job stopped) is None and so are the phases around it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from controlplane.core.view import Decision, Incident, Mark

POINTS = ("fault", "detected", "decided", "acked", "restored", "first_step")
PHASES = ("detect", "decide", "ack", "restore", "resume")


@dataclass(frozen=True, slots=True)
class Timeline:
    """The points of one incident, its phases in seconds, and what it cost."""

    incident_id: str
    points: dict[str, Mark | None]
    phases: dict[str, float | None]
    downtime_s: float | None
    steps_lost: int | None
    outcome: str | None


def timeline(incident: Incident) -> Timeline:
    """Derive the timeline of ``incident`` (the decision that counts is the last one)."""
    detected = Mark(incident.opened_position, incident.opened_at)
    fault = incident.evidence if incident.evidence is not None else detected
    decision: Decision | None = incident.decisions[-1] if incident.decisions else None
    decided = Mark(decision.position, decision.at) if decision is not None else None
    acked = decision.acked_by_all() if decision is not None else None
    restored = decision.restored_by_all() if decision is not None else None
    first_step = (
        Mark(decision.first_step_position, decision.first_step_at)
        if decision is not None
        and decision.first_step_position is not None
        and decision.first_step_at is not None
        else None
    )
    points: dict[str, Mark | None] = {
        "fault": fault,
        "detected": detected,
        "decided": decided,
        "acked": acked,
        "restored": restored,
        "first_step": first_step,
    }
    phases: dict[str, float | None] = {}
    for phase, (start, end) in zip(PHASES, itertools.pairwise(POINTS), strict=True):
        a, b = points[start], points[end]
        phases[phase] = None if a is None or b is None else (b.at - a.at).total_seconds()
    downtime = None if first_step is None else (first_step.at - fault.at).total_seconds()
    steps_lost = (
        max(0, incident.step_at_fault - decision.restore_step) if decision is not None else None
    )
    return Timeline(
        incident_id=incident.incident_id,
        points=points,
        phases=phases,
        downtime_s=downtime,
        steps_lost=steps_lost,
        outcome=incident.outcome,
    )
