"""The folded view of one job: members, topology, state machine, backup catalog, incidents.

Views handed out by :func:`controlplane.core.fold.fold` are never mutated afterwards; the fold
copies what it changes (see ``fold.py``). Equality is structural, so a view rebuilt from the log
can be compared with the live one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import NamedTuple

from schemas.common import JobState, Phase, ReallocationMode, RestoreFrom, Role
from schemas.events import JobPolicy

#: Fold anomalies kept per job (events that could not be applied cleanly).
MAX_ANOMALIES = 100
#: Complete backup steps kept in the catalog; older steps are evicted, as the ranks evict them.
KEEP_COMPLETE_BACKUPS = 2
#: The policy a job has before its registration is folded.
DEFAULT_POLICY = JobPolicy()
#: Discounted events kept per job (the newest; ``JobView.discount_counts`` counts them all).
MAX_DISCOUNTS = 100
#: The member name a node's launcher publishes under (``<node>/launcher``); no member has it.
LAUNCHER = "launcher"
#: A member's step (in ``train.step``, ``member.heartbeat`` or a backup) may lead the larger
#: of its own last step and the job's newest step by at most this many steps.
MAX_STEP_LEAD = 10_000


class DiscountReason(StrEnum):
    """Why an event stored in the log was not believed (it changed nothing)."""

    #: ``member.exited`` whose source is not the launcher of the member's node.
    EXIT_NOT_FROM_LAUNCHER = "exit_not_from_launcher"
    #: ``member.launched`` whose source is not a launcher.
    LAUNCH_NOT_FROM_LAUNCHER = "launch_not_from_launcher"
    #: An envelope generation newer than any the control plane issued.
    GENERATION_AHEAD = "generation_ahead"
    #: A step too far beyond the member's and the job's progress.
    STEP_IMPLAUSIBLE = "step_implausible"


@dataclass(frozen=True, slots=True)
class Discount:
    """One event the fold did not believe, and why."""

    position: int
    type: str
    source: str
    reason: DiscountReason
    detail: str


class Launched(NamedTuple):
    """A launcher's announcement (``member.launched``) that it started a member."""

    node: str
    role: Role
    pid: int
    position: int


class Mark(NamedTuple):
    """Where and when in the log something happened."""

    position: int
    at: datetime


class MemberStatus(StrEnum):
    """Whether a member can take part in the job."""

    ACTIVE = "active"
    FAILED = "failed"
    EXITED = "exited"


@dataclass(slots=True)
class FaultReport:
    """A fault a member reported about itself or its peers."""

    position: int
    at: datetime
    kind: str
    detail: str
    step: int | None
    suspects: tuple[str, ...]


@dataclass(slots=True)
class Member:
    """One training process or warm spare, as the log describes it."""

    member_id: str
    node: str
    rack: str
    host: str
    pid: int
    role: Role
    device: str
    backup_endpoint: str
    incarnation: str
    joined_at: datetime
    joined_position: int
    status: MemberStatus = MemberStatus.ACTIVE
    #: Rank in the current generation, None while outside the world (e.g. a spare).
    rank: int | None = None
    last_seen_at: datetime | None = None
    last_heartbeat_at: datetime | None = None
    last_heartbeat_position: int | None = None
    phase: Phase = Phase.INIT
    step: int = 0
    last_fault: FaultReport | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    exited_at: datetime | None = None
    exited_position: int | None = None
    failed_reason: str | None = None
    #: Position of the ``fault.detected`` that named this member (its incarnation), if any.
    detected_position: int | None = None
    #: The job's newest step when this member joined (growth waits for a newer backup).
    joined_step: int = 0
    #: The newest generation this member's events carried (it knows of that generation).
    generation: int = 0
    #: Position of the ``member.launched`` of this member's launcher that vouches for this
    #: process (same node, role and pid), None while no launcher announced it.
    announced_position: int | None = None


@dataclass(slots=True)
class ReplicaCopy:
    """A copy of one shard held by a peer, as the holder reported it."""

    holder: str
    nbytes: int
    checksum: str
    position: int


@dataclass(slots=True)
class ShardBackup:
    """One shard of one backup step: the owner's snapshot and its replicas."""

    shard: int
    owner: str | None = None
    nbytes: int = 0
    checksum: str | None = None
    snapshot_position: int | None = None
    replicas: dict[str, ReplicaCopy] = field(default_factory=dict)
    #: Members whose copy a restore refused (it did not hash to ``checksum``): never a source.
    refuted: tuple[str, ...] = ()

    def verified_holders(self) -> list[str]:
        """Holders whose copy matches the owner's checksum (and no restore refused)."""
        if self.checksum is None:
            return []
        refuted = self.refuted
        return [
            h
            for h, c in self.replicas.items()
            if c.checksum == self.checksum and not (refuted and h in refuted)
        ]

    def is_satisfied(self, redundancy: int) -> bool:
        """The owner's snapshot is known and ``redundancy`` holders have a matching copy."""
        checksum = self.checksum
        if checksum is None:
            return False
        # Counted without building ``verified_holders``: the fold asks twice per backup event.
        verified = 0
        for copy in self.replicas.values():
            if copy.checksum == checksum:
                verified += 1
        return verified >= redundancy


@dataclass(slots=True)
class StepBackup:
    """Every shard's backup at one step of one generation."""

    step: int
    generation: int
    num_shards: int
    shards: dict[int, ShardBackup] = field(default_factory=dict)
    #: Shards with a snapshot and enough verified replicas, kept by the fold as it goes.
    satisfied: int = 0

    def is_complete(self, redundancy: int) -> bool:
        """Every shard has its snapshot and ``redundancy`` verified replicas."""
        if len(self.shards) < self.num_shards:
            return False
        return all(s.is_satisfied(redundancy) for s in self.shards.values())


@dataclass(slots=True)
class CheckpointStep:
    """The shards of one cold checkpoint step that members reported durable."""

    step: int
    shards: int
    #: shard -> path it was written to.
    saved: dict[int, str] = field(default_factory=dict)

    @property
    def is_complete(self) -> bool:
        return len(self.saved) >= self.shards


@dataclass(slots=True)
class Decision:
    """A reallocation recorded for an incident."""

    position: int
    at: datetime
    command_id: str
    generation: int
    mode: ReallocationMode
    world: tuple[str, ...]
    restore_step: int
    restore_from: RestoreFrom
    #: ``plan[s]``: the member shard ``s`` is restored from (memory restores only).
    plan: tuple[str, ...] = ()
    #: ``digests[s]``: what shard ``s`` of the restore step must hash to (parallel to plan).
    digests: tuple[str, ...] = ()
    rendezvous: str = ""
    reason: str = ""
    #: member -> the first event that shows it (position and time).
    acked: dict[str, Mark] = field(default_factory=dict)
    restored: dict[str, Mark] = field(default_factory=dict)
    resumed: dict[str, Mark] = field(default_factory=dict)
    first_step_position: int | None = None
    first_step_at: datetime | None = None


@dataclass(slots=True)
class Incident:
    """One fault (or a planned growth) and everything decided until the job runs again."""

    incident_id: str
    opened_at: datetime
    opened_position: int
    members: list[str]
    reasons: list[str]
    detections: list[int]
    #: The earliest evidence any detection cited (the fault itself), if it cited a time.
    evidence: Mark | None = None
    #: The job's newest step when the incident opened (steps after the restore step are lost).
    step_at_fault: int = 0
    decisions: list[Decision] = field(default_factory=list)
    resolved_at: datetime | None = None
    resolved_position: int | None = None
    downtime_s: float | None = None
    steps_lost: int | None = None
    outcome: str | None = None
    #: "fault", or "growth" for a world grown at a backup boundary (no fault behind it).
    kind: str = "fault"

    @property
    def is_open(self) -> bool:
        """True until the incident is resolved or the job stops."""
        return self.outcome is None


@dataclass(slots=True)
class StateChange:
    """One transition of the job's state machine."""

    position: int
    at: datetime
    from_state: JobState
    to_state: JobState
    reason: str


@dataclass(slots=True)
class JobView:
    """Everything the control plane knows about one job, folded from its log."""

    job_id: str
    name: str = ""
    state: JobState = JobState.PENDING
    policy: JobPolicy | None = None
    registered_at: datetime | None = None
    generation: int = 0
    world: tuple[str, ...] = ()
    rendezvous: str = ""
    #: Where and when the current generation was started.
    generation_mark: Mark | None = None
    #: ``placement[r]``: the members holding copies of rank ``r``'s shard.
    placement: tuple[tuple[str, ...], ...] = ()
    placement_note: str = ""
    members: dict[str, Member] = field(default_factory=dict)
    last_step: int = 0
    last_loss: float | None = None
    completed_step: int | None = None
    backups: dict[int, StepBackup] = field(default_factory=dict)
    #: The newest step whose hot backup was ever complete (None: never).
    last_complete_backup: int | None = None
    #: Cold checkpoint steps: the newest complete one and any newer partial ones.
    checkpoints: dict[int, CheckpointStep] = field(default_factory=dict)
    #: The policy the first joining member asked for (registered by the decider).
    requested_policy: JobPolicy | None = None
    #: Position of the first ``generation.started`` (when the job left PENDING).
    started_position: int | None = None
    incidents: dict[str, Incident] = field(default_factory=dict)
    open_incident: str | None = None
    history: list[StateChange] = field(default_factory=list)
    last_position: int = 0
    last_recorded_at: datetime | None = None
    events: int = 0
    anomalies: list[str] = field(default_factory=list)
    #: member -> the newest announcement of a launcher that it started it.
    launched: dict[str, Launched] = field(default_factory=dict)
    #: The newest events the fold discounted (at most MAX_DISCOUNTS), oldest first.
    discounts: list[Discount] = field(default_factory=list)
    #: Every discounted event of the job, counted by reason.
    discount_counts: dict[str, int] = field(default_factory=dict)

    @property
    def effective_policy(self) -> JobPolicy:
        """The registered policy, or the defaults before registration."""
        return self.policy if self.policy is not None else DEFAULT_POLICY

    def newest_complete_backup(self) -> StepBackup | None:
        """The newest step whose every shard has a snapshot and enough verified replicas."""
        redundancy = self.effective_policy.redundancy
        for step in sorted(self.backups, reverse=True):
            if self.backups[step].is_complete(redundancy):
                return self.backups[step]
        return None

    def newest_complete_checkpoint(self) -> CheckpointStep | None:
        """The newest cold checkpoint with every shard durable."""
        for step in sorted(self.checkpoints, reverse=True):
            if self.checkpoints[step].is_complete:
                return self.checkpoints[step]
        return None
