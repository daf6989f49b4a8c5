"""Response models of the read-only REST API (``/api/v1``): the contract the page and clients read.

Everything here is derived from the log (``controlplane.core``); times are UTC, durations in
seconds, and every point of a timeline names the log position of the event behind it, so a
reader can fetch that event from ``/jobs/{job}/events``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.common import JobState, Phase, ReallocationMode, RestoreFrom, Role


class ApiModel(BaseModel):
    """Base of every response: immutable, no unknown fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Problem(ApiModel):
    """A 4xx answer: what was wrong with the request."""

    detail: str


class JobSummary(ApiModel):
    """One row of ``GET /jobs``."""

    job_id: str
    name: str = ""
    state: JobState
    generation: int
    world_size: int
    last_step: int
    last_loss: float | None = None
    incidents: int
    open_incident: str | None = None
    events: int
    last_position: int
    registered_at: datetime | None = None
    last_event_at: datetime | None = None


class JobList(ApiModel):
    jobs: list[JobSummary]


class StateChangeOut(ApiModel):
    position: int
    at: datetime
    from_state: JobState
    to_state: JobState
    reason: str


class JobDetail(JobSummary):
    """``GET /jobs/{job}``: the summary, the policy and the state-machine history."""

    policy: dict[str, Any] | None = None
    completed_step: int | None = None
    history: list[StateChangeOut]


class EventOut(ApiModel):
    """One stored event: the envelope as published plus what the store added."""

    position: int
    recorded_at: datetime
    event_id: str
    job_id: str
    type: str
    v: int
    source: str
    #: One run of the producing process; ``seq`` counts within it.
    incarnation: str = ""
    seq: int
    generation: int
    emitted_at: datetime
    payload: dict[str, Any]


class EventPage(ApiModel):
    """``GET /jobs/{job}/events``: a page; pass ``next_after`` as ``after`` for the next one."""

    events: list[EventOut]
    #: The position to pass as ``after`` for the next page; None when this page was the last.
    next_after: int | None = None


class TimelinePoint(ApiModel):
    """A point of an incident's timeline and the event behind it."""

    name: str
    position: int
    at: datetime


class PhaseOut(ApiModel):
    """A phase between two consecutive points (None until both are reached)."""

    name: str
    start: str
    end: str
    seconds: float | None = None


class DecisionOut(ApiModel):
    """One reallocation decided for an incident (a cascade has several)."""

    position: int
    at: datetime
    command_id: str
    generation: int
    mode: ReallocationMode
    world: list[str]
    restore_step: int
    restore_from: RestoreFrom
    reason: str = ""
    #: Steps its generation's loop does not run (inclusive ranges): every batch the job's
    #: rollbacks skipped so far.
    skip: list[tuple[int, int]] = Field(default_factory=list)


class IncidentSummary(ApiModel):
    """One row of ``GET /jobs/{job}/incidents``."""

    incident_id: str
    kind: str
    opened_at: datetime
    opened_position: int
    members: list[str]
    reasons: list[str]
    outcome: str | None = None
    downtime_s: float | None = None
    steps_lost: int | None = None
    decisions: int
    #: A loss anomaly's first step (kind ``anomaly``): its decisions restore a backup before
    #: it. None for other incidents.
    anomaly_step: int | None = None


class IncidentTimeline(IncidentSummary):
    """``GET /jobs/{job}/incidents/{incident}``: the points, phases and decisions."""

    #: In DESIGN.md order (fault, detected, decided, acked, restored, first_step); points not
    #: reached are left out.
    points: list[TimelinePoint]
    phases: list[PhaseOut]
    step_at_fault: int
    resolved_at: datetime | None = None
    resolved_position: int | None = None
    #: Positions of the detections (``fault.detected``, ``anomaly.detected``) behind it.
    detections: list[int]
    history: list[DecisionOut]


class MemberOut(ApiModel):
    member_id: str
    node: str
    rack: str
    host: str
    role: Role
    status: str
    rank: int | None = None
    phase: Phase
    step: int
    last_heartbeat_at: datetime | None = None
    joined_at: datetime
    failed_reason: str | None = None
    #: Its launcher announced it (``member.launched``): only then may it enter the world.
    announced: bool = False
    #: Members whose fault report names this one and waits for corroboration.
    suspected_by: list[str] = Field(default_factory=list)
    #: A shrink dropped its replica (a mesh job): it waits as a warm spare until a later
    #: generation gives it a rank again.
    demoted: bool = False


class DiscountOut(ApiModel):
    """An event stored in the log that the control plane did not believe, and why."""

    position: int
    type: str
    source: str
    reason: str
    detail: str


class ShardOut(ApiModel):
    shard: int
    owner: str | None = None
    nbytes: int
    verified_holders: list[str]


class BackupOut(ApiModel):
    step: int
    generation: int
    complete: bool
    shards: list[ShardOut]


class Cluster(ApiModel):
    """``GET /jobs/{job}/cluster``: members, topology, backups, state."""

    job_id: str
    state: JobState
    generation: int
    world: list[str]
    rendezvous: str
    #: ``placement[r]``: the members holding copies of rank ``r``'s shard.
    placement: list[list[str]]
    placement_note: str = ""
    members: list[MemberOut]
    #: rack -> node -> members on it.
    topology: dict[str, dict[str, list[str]]]
    backups: list[BackupOut]
    last_complete_backup: int | None = None
    #: The newest discounted events (at most 100), oldest first.
    discounts: list[DiscountOut] = Field(default_factory=list)
    #: Every discounted event of the job, counted by reason.
    discount_counts: dict[str, int] = Field(default_factory=dict)


class LossPoint(ApiModel):
    step: int
    #: Mean of the ranks' reported losses at this step (the newest generation's report wins).
    loss: float
    at: datetime


class LossCurve(ApiModel):
    """``GET /jobs/{job}/loss``: the loss by step and where faults happened, for the page."""

    points: list[LossPoint]
    #: incident id -> the step the job had reached when it opened.
    faults: dict[str, int] = Field(default_factory=dict)


class Health(ApiModel):
    status: str
    database: bool
    last_position: int


class IncidentCostOut(ApiModel):
    """What one incident cost: its window by phase and the recomputation it caused."""

    incident_id: str
    kind: str
    outcome: str | None = None
    #: detection, decision, restore, resume (seconds).
    phases: dict[str, float]
    recomputation_s: float
    steps_lost: int | None = None
    cost_s: float = Field(description="Its window and its recomputation, in seconds.")
    ettr_lost: float = Field(description="cost_s over the job's wall time.")


class GenerationGoodputOut(ApiModel):
    """One generation: from its generation.started to the next one's (or the job's end)."""

    generation: int
    started_at: datetime
    ended_at: datetime
    wall_s: float
    seconds: dict[str, float]
    productive_steps: int
    recomputed_steps: int
    ettr: float | None = None
    goodput_steps_per_s: float | None = None


class GoodputOut(ApiModel):
    """``GET /jobs/{job}/goodput``: the job's wall time by term (docs/design.md, "Goodput
    accounting"), ETTR, and the cost of each incident and generation."""

    job_id: str
    started_at: datetime
    ended_at: datetime
    final: bool = Field(description="The job ended: ended_at is its end, not the time asked.")
    wall_s: float
    seconds: dict[str, float] = Field(
        description="productive, recomputation, backup, stragglers, detection, decision,"
        " restore, resume, waiting, idle: seconds, summing to wall_s."
    )
    ettr: float | None = Field(None, description="productive / wall.")
    productive_steps: int
    recomputed_steps: int
    goodput_steps_per_s: float | None = None
    incidents: list[IncidentCostOut]
    generations: list[GenerationGoodputOut]
    not_measured: list[str]
