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

from controlplane.core.timeouts import GapSample, Threshold
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
    #: A backup (``backup.snapshot``/``backup.replicated``) of a generation older than the
    #: current one, of a step beyond the restore step of a later generation (the timeline it
    #: belongs to was abandoned), or of a generation that never started a world.
    STALE_GENERATION = "stale_generation"
    #: A backup of a shard that is not a rank of its generation's world, or whose owner is
    #: not the member at that rank.
    SHARD_OUTSIDE_WORLD = "shard_outside_world"
    #: A peer report (``member.fault`` of a peer kind) naming a generation that is not the
    #: current one: evidence about an abandoned world.
    STALE_REPORT = "stale_report"
    #: A peer report whose reporter is not an active member of the current generation's world
    #: (fenced, exited, a spare, or a process that rejoined and holds no rank yet).
    REPORTER_NOT_IN_WORLD = "reporter_not_in_world"
    #: A member event from another process (incarnation) than the one that last joined.
    STALE_INCARNATION = "stale_incarnation"
    #: ``member.exited`` of another process (pid or incarnation) than the member's current one.
    STALE_EXIT = "stale_exit"
    #: ``member.joined`` repeating the incarnation already joined: it changes nothing.
    REPEATED_JOIN = "repeated_join"


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
    #: The incarnation the launcher gave the process (``ELASTIC_INCARNATION``), None when the
    #: announcement does not say (an older launcher).
    incarnation: str | None = None


class Mark(NamedTuple):
    """Where and when in the log something happened."""

    position: int
    at: datetime


class GenerationRecord(NamedTuple):
    """One generation as its ``generation.started`` recorded it: the world its backups belong
    to and the step its timeline starts from."""

    generation: int
    #: Ranks in its world: every backup step it takes has this many shards.
    world_size: int
    #: The step it started from (the restore step of the reallocation that issued it); None
    #: when it started fresh (the first world). What an older generation did beyond this step
    #: belongs to a timeline this generation abandoned.
    restore_step: int | None
    #: Log position of its ``generation.started``.
    position: int


class AnomalyReport(NamedTuple):
    """A loss anomaly no decision took up yet (``JobView.anomaly``): a rank's report of a
    non-finite step (``train.anomaly``), or a spike of the job's loss the fold found."""

    #: ``schemas.common.AnomalyKind``'s value.
    kind: str
    step: int
    #: The member that reported it (None: a spike, seen in the job's step records).
    member: str | None
    position: int
    at: datetime
    #: The generation it happened in.
    generation: int
    detail: str
    #: A spike's loss and the threshold it crossed.
    loss: float | None = None
    threshold: float | None = None


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
    #: The generation the report names (its envelope's): a peer report counts only while that
    #: generation is current.
    generation: int


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
    #: The process that joined last (the envelope's ``incarnation``; ``pid`` is its pid): an
    #: exit, a fault or a heartbeat of another process of this name changes nothing.
    incarnation: str
    joined_at: datetime
    joined_position: int
    status: MemberStatus = MemberStatus.ACTIVE
    #: Rank in the current generation, None while outside the world (e.g. a spare).
    rank: int | None = None
    step: int = 0
    last_fault: FaultReport | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    exited_at: datetime | None = None
    exited_position: int | None = None
    failed_reason: str | None = None
    #: Position of the ``fault.detected`` that named this member (its incarnation), if any.
    detected_position: int | None = None
    #: The job's newest step when this member joined (growth waits for a newer backup); a
    #: restore to an older step brings it back to that step.
    joined_step: int = 0
    #: The newest generation this member's events carried (it knows of that generation).
    generation: int = 0
    #: Position of the ``member.launched`` of this member's launcher that vouches for this
    #: process (same node, role and pid), None while no launcher announced it.
    announced_position: int | None = None
    #: Position of the ``reallocation.issued`` that dropped this member's replica (a mesh
    #: shrink) while it survived: a warm spare since, until a generation gives it a rank.
    demoted_position: int | None = None


class Heartbeat(NamedTuple):
    """A member's last heartbeat as the log shows it (``JobView.heartbeats``)."""

    at: datetime
    #: The event that shows it: a stored ``member.heartbeat``, or the ``liveness.summary``
    #: that listed or named the member (heartbeats are soft state, core/liveness.py). None
    #: only in a decider's probe of its in-memory table, never in a folded view.
    position: int | None
    #: The type of that event.
    evidence: str
    #: The phase the member reported then.
    phase: Phase


class Computed(NamedTuple):
    """A member's sustained compute time per step as the log shows it (``JobView.compute``):
    the least of its per-heartbeat mean compute times over a window (straggler detection,
    ``core/straggler.py``)."""

    compute_s: float
    #: The generation its heartbeats were of (the window lies within it).
    generation: int
    #: The window it was taken over, seconds.
    window_s: float
    #: The ``liveness.summary`` that recorded it (None: a decider's probe of its table).
    position: int | None
    at: datetime


class Progress(NamedTuple):
    """Where a member was in its steps at its last heartbeat (``JobView.progress``): the
    evidence of a stalled step (``core/stall.py``)."""

    #: The last step it finished, and the generation it beat in.
    step: int
    generation: int
    #: When that heartbeat was heard.
    at: datetime
    #: Seconds since it finished ``step`` (None: not in phase train), and since the next
    #: step's gradients were ready on it (None: not yet, or not measured).
    since_step_s: float | None
    ready_s: float | None
    #: The ``liveness.summary`` that recorded it (None: a decider's probe of its table).
    position: int | None


class SlowMark(NamedTuple):
    """A ``member.slow`` recorded of a member (``JobView.slow``)."""

    generation: int
    position: int
    at: datetime
    action: str
    reason: str


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
    """Every shard's backup at one step, as the world of one generation took it."""

    step: int
    #: The generation whose world took the step.
    generation: int
    #: The size of that generation's world: the step is complete only when each of its ranks'
    #: shards has its copies.
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
    #: Survivors of the replicas this decision dropped (a mesh shrink): warm spares.
    demoted: tuple[str, ...] = ()
    #: The steps the new generation does not run (inclusive ranges): every range the job's
    #: rollbacks skipped, this one's included.
    skip: tuple[tuple[int, int], ...] = ()
    #: member -> the first event that shows it (position and time).
    acked: dict[str, Mark] = field(default_factory=dict)
    restored: dict[str, Mark] = field(default_factory=dict)
    resumed: dict[str, Mark] = field(default_factory=dict)
    first_step_position: int | None = None
    first_step_at: datetime | None = None
    #: Its incident closed: the per-member marks above were dropped (nothing waits for them
    #: once the incident is over) and what a timeline reads of them kept instead
    #: (``all_acked``, ``all_restored``). A month-long job then holds a few marks per closed
    #: decision, not three per rank of its world (the plan and digests, what the decision
    #: sent, stay).
    compacted: bool = False
    all_acked: Mark | None = None
    all_restored: Mark | None = None

    def acked_by_all(self) -> Mark | None:
        """The ack of the last member of the world to ack (None until every one has)."""
        return self.all_acked if self.compacted else last_of(self.acked, self.world)

    def restored_by_all(self) -> Mark | None:
        """The restore of the last member of the world to restore (None until every one has)."""
        return self.all_restored if self.compacted else last_of(self.restored, self.world)

    def compact(self) -> None:
        """Keep only what is read of a decision once its incident closed (see ``compacted``)."""
        if self.compacted:
            return
        self.all_acked, self.all_restored = self.acked_by_all(), self.restored_by_all()
        self.acked, self.restored, self.resumed = {}, {}, {}
        self.compacted = True


def last_of(marks: dict[str, Mark], world: tuple[str, ...]) -> Mark | None:
    """The mark of the last member of ``world`` to get there; None until all have."""
    if not world or any(m not in marks for m in world):
        return None
    return max((marks[m] for m in world), key=lambda mark: (mark.at, mark.position))


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
    #: "fault", "growth" for a world grown at a backup boundary (no fault behind it), or
    #: "anomaly" for a loss anomaly (a non-finite step, a loss spike) rolled back.
    kind: str = "fault"
    #: The earliest step of a loss anomaly in it (``anomaly.detected``): its decisions
    #: restore a backup strictly before it. None: no anomaly.
    anomaly_step: int | None = None
    #: ``AnomalyKind`` values of its anomalies, in order of detection.
    anomalies: tuple[str, ...] = ()

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
    #: member -> its current process's last heartbeat, as the log shows it (absent: not
    #: heard since it joined; its phase is then ``init``). Kept beside the members, not in
    #: them: a summary moves thousands of members' heartbeats at once, and a fold then copies
    #: this one mapping instead of every member it names.
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    #: member -> its sustained compute time per step, from the newest summary that knew it
    #: (absent: not known over a whole window); straggler detection reads it.
    compute: dict[str, Computed] = field(default_factory=dict)
    #: member -> where it was in its steps at its last heartbeat, from the newest summary
    #: that listed it with the columns of a step's progress (absent: not known, or named
    #: regular: progressing); stall detection reads it.
    progress: dict[str, Progress] = field(default_factory=dict)
    #: The longest steps interval summaries showed over ``step_timeout_window_s`` (kept only
    #: under ``step_timeout_mode`` ``auto``), and the step timeout derived from them (None:
    #: the policy's fixed one).
    step_samples: tuple[GapSample, ...] = ()
    step_threshold: Threshold | None = None
    #: The heartbeat gaps interval summaries showed over the policy's window (kept only under
    #: ``heartbeat_timeout_mode`` ``auto``), and each phase's timeout derived from them
    #: (``core/timeouts.py``; empty: the policy's fixed ones).
    gap_samples: tuple[GapSample, ...] = ()
    thresholds: dict[Phase, Threshold] = field(default_factory=dict)
    #: member -> the newest ``member.slow`` recorded of it.
    slow: dict[str, SlowMark] = field(default_factory=dict)
    #: The newest step of the current timeline: the current generation's newest step, from its
    #: restore step on (a generation issued by a reallocation starts there).
    last_step: int = 0
    #: The newest step a liveness summary heard a member of the current generation at, from
    #: its restore step on: that the job went past a step even while the reports of the
    #: member that reports steps (rank 0) do not come (``restore._unreported``).
    heard_step: int = 0
    last_loss: float | None = None
    completed_step: int | None = None
    backups: dict[int, StepBackup] = field(default_factory=dict)
    #: The newest complete hot backup step of the current timeline (None: no hot backup was
    #: ever complete). A restore to an older step drops the steps beyond it; when none that
    #: was complete remains (a restore from a checkpoint), it is the restore step.
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
    #: Every generation started, oldest first (see ``GenerationRecord``).
    lineage: tuple[GenerationRecord, ...] = ()
    #: A loss anomaly of the current generation that no decision took up yet (the earliest
    #: step reported); ``anomaly.detected`` takes it up, a new generation drops it.
    anomaly: AnomalyReport | None = None
    #: The steps the job's loop does not run (inclusive ranges, ascending): the batches its
    #: rollbacks skipped, as the decision in force says.
    skipped: tuple[tuple[int, int], ...] = ()
    #: (step, loss) of the current timeline's newest job losses, at most the policy's
    #: ``loss_spike_window`` (kept only when it looks for spikes: ``loss_spike_k`` > 0).
    recent_losses: tuple[tuple[int, float], ...] = ()

    def last_heard(self, member: Member) -> datetime:
        """When ``member`` was last heard: its last heartbeat, else its join."""
        heartbeat = self.heartbeats.get(member.member_id)
        return heartbeat.at if heartbeat is not None else member.joined_at

    def phase(self, member_id: str) -> Phase:
        """The phase ``member_id`` last reported (``init`` until it is heard)."""
        heartbeat = self.heartbeats.get(member_id)
        return heartbeat.phase if heartbeat is not None else Phase.INIT

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

    def started(self, generation: int) -> GenerationRecord | None:
        """The record of ``generation`` (None: the log never started it)."""
        for record in reversed(self.lineage):
            if record.generation <= generation:
                return record if record.generation == generation else None
        return None

    def fence(self, generation: int) -> GenerationRecord | None:
        """The later generation than ``generation`` that restored the oldest step, None when
        none restored any: whatever ``generation`` did beyond that generation's restore step
        was abandoned (the current timeline holds steps of ``generation`` only up to it)."""
        fence: GenerationRecord | None = None
        oldest = 0
        for record in reversed(self.lineage):
            if record.generation <= generation:
                break
            restored = record.restore_step
            if restored is not None and (fence is None or restored <= oldest):
                fence, oldest = record, restored
        return fence

    def on_timeline(self, generation: int, step: int) -> bool:
        """Whether step ``step`` as ``generation`` took it is on the current timeline: no later
        generation restored an older step."""
        fence = self.fence(generation)
        return fence is None or fence.restore_step is None or step <= fence.restore_step
