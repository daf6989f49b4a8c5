"""Decide how a job goes on: ``decide(view, now, context) -> [Decided]``.

Pure: the view, the time and the context are arguments; nothing is read from a clock, a disk or
a network. One call returns every decision due at ``now``, in log order: it decides a round,
folds that round onto a private copy of the view and decides again, so an exit becomes
``fault.detected``, the state changes, ``reallocation.issued`` and ``generation.started`` in
one batch (one append, one command).

Event ids are derived from the job and from counters in the view (the n-th incident, the n-th
state change, generation g), never from the time or a random source: re-deciding the same view
gives the same events, so a decision repeated after a crash is a duplicate the store skips,
and a replay of the log reproduces the recorded decisions.

The states (DESIGN.md): PENDING -> RUNNING when the workers the policy waits for have joined;
RUNNING -> DEGRADED when a member of the world fails; DEGRADED -> REALLOCATING -> RECOVERING
with a new generation (a spare replaces the failed member, same rack first, else the world
shrinks if ``min_world`` members remain, else STOPPED); RECOVERING -> RUNNING at the first
step of the new generation (the incident is resolved with its timeline); a fault while
RECOVERING re-decides inside the same incident (a cascade); a recovery that misses its
deadline drops the members furthest behind (those the others wait on) and re-decides, and an
incident that needs more than ``max_decisions_per_incident`` decisions stops the job. RUNNING
below ``max_world`` grows at a backup boundary when members joined after the start.

With a mesh (``JobPolicy.mesh``) the decider reasons in replicas (``controlplane.core.mesh``):
the first world puts the workers on the mesh's coordinates (node-local groups on one node);
a spare takes the exact rank (coordinate) of the member it replaces; when the spares do not
cover every lost rank, the fewest whole replicas that leave enough members are dropped (those
that lost most first), the remaining replicas are renumbered densely (each member keeps its
place inside its replica), and the survivors of a dropped replica take the lost ranks the
spares could not, or stay up as warm spares (``demoted``); ``min_world`` counts replicas;
growth adds whole replicas up to the mesh's size. When no spare can take a lost rank and no
replica can be dropped (below ``min_world``, or a mesh without a replica dimension), the
decision says so and waits for a spare up to ``recovery_deadline_s``, then stops.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from controlplane.core.anomaly import Ranges, describe, merged, window
from controlplane.core.detect import (
    Finding,
    detect,
    heartbeat_timeout,
    report_deadline,
    silence_limit,
)
from controlplane.core.fold import fold
from controlplane.core.mesh import Layout, full_layout, layout
from controlplane.core.placement import SilentNode, place_columns, silent_nodes
from controlplane.core.records import StoredEvent
from controlplane.core.restore import plan_restore, refused_sources
from controlplane.core.stall import stall_deadline
from controlplane.core.statemachine import TERMINAL
from controlplane.core.straggler import Slow, judge
from controlplane.core.timeline import timeline
from controlplane.core.view import Decision, Incident, JobView, Member, MemberStatus
from schemas.common import (
    CONTROLPLANE_SOURCE,
    REPORTED_ANOMALIES,
    AnomalyAction,
    AnomalyKind,
    FaultReason,
    JobState,
    Phase,
    ReallocationMode,
    RestoreFrom,
    Role,
    Strict,
)
from schemas.events import (
    EVENT_CLASSES,
    AnomalyDetected,
    EnvelopeBase,
    Evidence,
    FaultDetected,
    GenerationStarted,
    HeartbeatThreshold,
    IncidentResolved,
    JobCompleted,
    JobPolicy,
    JobRegistered,
    JobStateChanged,
    JobStopped,
    MemberSlow,
    Mesh,
    ReallocationIssued,
)

#: Namespace of the ids the decider derives (uuid5 of the job, then of the decision's key).
DECISION_NAMESPACE = uuid.UUID("6f1c2a8e-52a4-4c55-9c38-0e1d3e5b7a91")
#: Rounds one call may take before it stops (a round changes the state; six suffice).
MAX_ROUNDS = 8
_MAX_TEXT = 4096
_MAX_EVIDENCE = 1024
#: Order in which findings of several reasons are recorded.
_REASON_ORDER = (
    FaultReason.EXITED,
    FaultReason.REPORTED,
    FaultReason.HEARTBEAT_TIMEOUT,
    FaultReason.RECOVERY_DEADLINE,
    FaultReason.SLOW,
    FaultReason.STALLED,
)

_S = JobState


@dataclass(frozen=True, slots=True)
class Context:
    """What the decider needs besides the view: where ranks rendezvous."""

    #: Base endpoint of the rendezvous store, e.g. ``tcp://10.0.0.5:29400``; each generation
    #: gets ``<base>/<job>/<generation>``.
    rendezvous: str = ""


@dataclass(frozen=True, slots=True)
class Decided:
    """One decision event: its id, type, the generation it belongs to, and its payload."""

    event_id: str
    type: str
    generation: int
    payload: Strict


def decide(
    view: JobView, now: datetime, context: Context = Context(), *, rounds: int = MAX_ROUNDS
) -> list[Decided]:
    """Every decision due for ``view`` at ``now``, in the order they are to be recorded.

    ``rounds`` stops after that many rounds: ``rounds=1`` answers whether anything is due
    (and which failures are found first) at the cost of a detection, without the plan a
    fault's later rounds make (placement, restore) on a copy of the view."""
    out: list[Decided] = []
    current = view
    flagged = _Flagged()
    for _ in range(min(rounds, MAX_ROUNDS)):
        round_ = _Round(current, now, context, flagged).run()
        if not round_:
            break
        out.extend(round_)
        if _ends_in(round_, _S.RECOVERING):
            break  # what RECOVERING waits for (a step, a deadline) cannot happen at ``now``
        current = fold(
            current,
            [
                StoredEvent(current.last_position + i, now, envelope(current.job_id, d, now, i))
                for i, d in enumerate(round_, start=1)
            ],
        )
    return out


def _ends_in(round_: list[Decided], state: JobState) -> bool:
    last = round_[-1].payload
    return isinstance(last, JobStateChanged) and last.to is state


def envelope(
    job_id: str, decided: Decided, now: datetime, seq: int, incarnation: str = "decide"
) -> EnvelopeBase:
    """The control-plane event that records ``decided``."""
    return EVENT_CLASSES[decided.type](
        event_id=decided.event_id,
        job_id=job_id,
        type=decided.type,
        v=1,
        source=CONTROLPLANE_SOURCE,
        incarnation=incarnation,
        seq=seq,
        generation=decided.generation,
        emitted_at=now,
        payload=decided.payload,
    )


def decision_id(job_id: str, key: str) -> str:
    """The id of the decision ``key`` of ``job_id`` (stable across runs and replays)."""
    return str(uuid.uuid5(uuid.uuid5(DECISION_NAMESPACE, job_id), key))


#: Events that cannot make a decision due: a heartbeat only moves its member's deadline later.
QUIET_TYPES = frozenset({"member.heartbeat"})
#: ... nor, while the job has no open incident, these: ``decide`` reads a step only as the
#: first of a recovering generation (the fold records it in the open incident's decision).
#: Every rank reports each step, so at scale nearly every commit holds some.
QUIET_WITHOUT_INCIDENT = frozenset({"train.step"})


def wakes(view: JobView | None, event_type: str) -> bool:
    """Whether a new event of ``event_type`` may make a decision due for the job of ``view``
    (None: a job not folded yet), at a time when ``decide`` had nothing to do: a service
    asks for a turn after a commit of such an event, and otherwise waits for the next
    deadline (``next_deadline``)."""
    if event_type in QUIET_TYPES:
        return False
    # A step record may be a spike of the job's loss (the fold finds it).
    policy = view.policy if view is not None else None
    if event_type == "train.step" and policy is not None and policy.loss_spike_k > 0:
        return True
    return not (
        event_type in QUIET_WITHOUT_INCIDENT and view is not None and view.open_incident is None
    )


def next_deadline(view: JobView) -> datetime | None:
    """The earliest time at which ``decide`` could act without a new event (None: never).

    A service sleeps until then (or until new events arrive); it is a lower bound, and
    waking early only costs a call that decides nothing.
    """
    if view.state in TERMINAL or view.policy is None:
        return None
    policy = view.policy
    deadlines: list[datetime] = []
    if view.anomaly is not None:  # a loss anomaly waits for its decision: due now
        deadlines.append(view.anomaly.at)
    if view.state is _S.PENDING:
        if view.registered_at is not None:
            deadlines.append(view.registered_at + timedelta(seconds=policy.start_timeout_s))
        return min(deadlines, default=None)
    # The oldest heartbeat per phase decides (one comparison per member, no arithmetic).
    oldest: dict[Phase, datetime] = {}
    members = view.members
    heartbeats = view.heartbeats
    active = MemberStatus.ACTIVE
    for member_id in view.world:
        member = members.get(member_id)
        if member is None or member.status is not active or member.detected_position is not None:
            continue
        heartbeat = heartbeats.get(member_id)
        if heartbeat is None:
            last, phase = member.joined_at, Phase.INIT
        else:
            last, phase = heartbeat.at, heartbeat.phase
        seen = oldest.get(phase)
        if seen is None or last < seen:
            oldest[phase] = last
    for phase, last in oldest.items():
        deadlines.append(last + timedelta(seconds=heartbeat_timeout(view, phase)))
    # A peer's report that waits for its suspect's silence to corroborate it.
    waiting = report_deadline(view)
    if waiting is not None:
        deadlines.append(waiting)
    # Peers waiting in a step's collectives for a member behind (``core/stall.py``).
    if view.progress:
        stall = stall_deadline(view)
        if stall is not None:
            deadlines.append(stall)
    if view.state is _S.RECOVERING and view.open_incident is not None:
        incident = view.incidents[view.open_incident]
        if incident.decisions:
            at = incident.decisions[-1].at
            deadlines.append(at + timedelta(seconds=policy.recovery_deadline_s))
    if policy.mesh is not None and view.state is _S.REALLOCATING and view.history:
        # Waiting for a spare (a mesh that cannot shrink): the job stops at the deadline.
        at = view.history[-1].at
        deadlines.append(at + timedelta(seconds=policy.recovery_deadline_s))
    return min(deadlines, default=None)


def natural_key(text: str) -> tuple[str | int, ...]:
    """Sort ``m2`` before ``m10``: digit runs compare as numbers."""
    parts = re.split(r"(\d+)", text)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def _topology_key(member: Member) -> tuple[object, ...]:
    return (member.rack, member.node, natural_key(member.member_id))


def _spare_like(member: Member) -> bool:
    """A spare, or a survivor of a replica a shrink dropped (a warm spare since)."""
    return member.role is Role.SPARE or member.demoted_position is not None


@dataclass(slots=True)
class _Flagged:
    """Members ``detect`` finds failed at ``now`` (world or not), shared by the rounds of one
    call: none of them may be brought into the world."""

    members: set[str] | None = None


@dataclass(frozen=True, slots=True)
class _Plan:
    mode: ReallocationMode
    world: tuple[str, ...]
    restore_step: int
    restore_from: RestoreFrom
    sources: tuple[str, ...]
    reason: str
    #: Failed member -> the member that takes its rank.
    replacements: dict[str, str] = field(default_factory=dict)
    #: Survivors of the replicas a mesh-aware shrink dropped (warm spares from now on).
    demoted: tuple[str, ...] = ()
    #: The steps the new generation skips (None: those the job skips already).
    skip: Ranges | None = None


@dataclass(frozen=True, slots=True)
class _Wait:
    """No plan yet: the lost ranks wait for a spare (a mesh that cannot shrink), and why."""

    reason: str


class _Round:
    """One round of decisions on one view."""

    def __init__(self, view: JobView, now: datetime, context: Context, flagged: _Flagged) -> None:
        self.flagged = flagged
        self.view = view
        self.now = now
        self.context = context
        self.policy = view.effective_policy
        self.mesh: Mesh | None = self.policy.mesh
        self.out: list[Decided] = []

    # ------------------------------------------------------------------ helpers

    def _emit(self, key: str, type_: str, payload: Strict, generation: int | None = None) -> None:
        self.out.append(
            Decided(
                event_id=decision_id(self.view.job_id, key),
                type=type_,
                generation=self.view.generation if generation is None else generation,
                payload=payload,
            )
        )

    def _state(self, to: JobState, reason: str) -> None:
        view = self.view
        # The n-th state change of the job: unique, and the same on every replay.
        n = len(view.history) + sum(1 for d in self.out if d.type == "job.state_changed") + 1
        self._emit(
            f"state/{n}",
            "job.state_changed",
            JobStateChanged(from_=self._current_state(), to=to, reason=reason[:_MAX_TEXT]),
        )

    def _current_state(self) -> JobState:
        for decided in reversed(self.out):
            if decided.type == "job.state_changed":
                assert isinstance(decided.payload, JobStateChanged)
                return decided.payload.to
        return self.view.state

    def _stop(self, reason: str) -> None:
        self._emit("stopped", "job.stopped", JobStopped(reason=reason[:_MAX_TEXT]))

    def _fresh(self, member: Member) -> bool:
        """Alive by its heartbeats at ``now`` (the test detect applies to the world)."""
        heartbeat = self.view.heartbeats.get(member.member_id)
        if heartbeat is None:
            last, phase = member.joined_at, Phase.INIT
        else:
            last, phase = heartbeat.at, heartbeat.phase
        silent = (self.now - last).total_seconds()
        return silent <= heartbeat_timeout(self.view, phase)

    def _usable(self, member: Member) -> bool:
        """A member outside the world that could join it: started by its launcher (which
        announced this process: a spare, or a worker that joined late, counts only then),
        alive, never failed, fresh, and nothing ``detect`` would hold against it once it is
        in the world."""
        flagged = self._flagged()
        return (
            member.rank is None
            and member.announced_position is not None
            and member.status is MemberStatus.ACTIVE
            and member.detected_position is None
            and member.member_id not in flagged
            and self._fresh(member)
        )

    def _flagged(self) -> set[str]:
        if self.flagged.members is None:
            self.flagged.members = {f.member for f in detect(self.view, self.now)}
        return self.flagged.members

    def _columns(self, members: Sequence[str]) -> tuple[list[str], list[str]]:
        """The nodes and the racks of ``members``."""
        located = [self.view.members[m] for m in members]
        return [m.node for m in located], [m.rack for m in located]

    def _rendezvous(self, generation: int) -> str:
        base = self.context.rendezvous.rstrip("/")
        return f"{base}/{self.view.job_id}/{generation}" if base else ""

    # ------------------------------------------------------------------ the round

    def run(self) -> list[Decided]:
        view = self.view
        if view.state in TERMINAL:
            return []
        if view.policy is None:
            if view.members:
                policy = view.requested_policy or JobPolicy()
                self._emit("registered", "job.registered", JobRegistered(policy=policy))
            return self.out
        if view.state is _S.PENDING:
            self._pending()
        elif view.state is _S.RUNNING:
            self._running()
        elif view.state in (_S.DEGRADED, _S.REALLOCATING):
            self._reallocate()
        elif view.state is _S.RECOVERING:
            self._recovering()
        return self.out

    def _pending(self) -> None:
        if self.mesh is not None:
            self._pending_mesh(self.mesh)
            return
        view, policy = self.view, self.policy
        wanted = policy.start_world
        # With world_size set, exactly that many (the rest wait as candidates); without it,
        # every worker there is, up to max_world.
        most = policy.world_size if policy.world_size is not None else policy.max_world
        workers = sorted(
            (
                m
                for m in view.members.values()
                if m.role is Role.WORKER and m.status is MemberStatus.ACTIVE and self._fresh(m)
            ),
            key=_topology_key,
        )[:most]
        if len(workers) >= wanted:
            self._start(workers, f"{len(workers)} workers joined (the job waits for {wanted})")
            return
        assert view.registered_at is not None
        waited = (self.now - view.registered_at).total_seconds()
        if waited <= policy.start_timeout_s:
            return
        if len(workers) >= policy.min_world:
            self._start(
                workers,
                f"start timeout ({policy.start_timeout_s:g}s): starting with {len(workers)}"
                f" of the {wanted} workers the job waits for",
            )
        else:
            self._stop(
                f"only {len(workers)} of the {wanted} workers the job waits for joined within"
                f" {policy.start_timeout_s:g}s, fewer than min_world {policy.min_world}"
            )

    def _pending_mesh(self, mesh: Mesh) -> None:
        """PENDING with a mesh: the first world waits for the whole mesh; after the start
        timeout it starts with the whole replicas there are (at least ``min_world``)."""
        view, policy = self.view, self.policy
        full = full_layout(mesh)
        per = full.replica_size
        workers = sorted(
            (
                m
                for m in view.members.values()
                if m.role is Role.WORKER and m.status is MemberStatus.ACTIVE and self._fresh(m)
            ),
            key=_topology_key,
        )[: full.size]
        shape = full.describe()
        if len(workers) == full.size:
            self._start(workers, f"{len(workers)} workers joined: the mesh {shape} is whole")
            return
        assert view.registered_at is not None
        waited = (self.now - view.registered_at).total_seconds()
        if waited <= policy.start_timeout_s:
            return
        replicas = len(workers) // per
        if replicas >= policy.min_world:
            self._start(
                workers[: replicas * per],
                f"start timeout ({policy.start_timeout_s:g}s): starting with {replicas} of the"
                f" {full.replicas} replicas of the mesh {shape} ({replicas * per} of"
                f" {full.size} workers)",
            )
        else:
            self._stop(
                f"only {len(workers)} of the {full.size} workers of the mesh {shape} joined"
                f" within {policy.start_timeout_s:g}s: {replicas} whole replicas of {per}"
                f" ranks, fewer than min_world {policy.min_world} (replicas)"
            )

    def _start(self, workers: list[Member], reason: str) -> None:
        generation = self.view.generation + 1
        world = tuple(m.member_id for m in workers)
        if self.mesh is not None:
            on_mesh = layout(self.mesh, len(world))
            assert on_mesh is not None
            world = on_mesh.arrange(list(world))
        self._generation(generation, world)
        self._state(_S.RUNNING, reason)

    def _generation(
        self, generation: int, world: tuple[str, ...], substitute: dict[str, str] | None = None
    ) -> None:
        """Record ``generation``: its world, rendezvous, and a placement that keeps every
        still-valid copy of the current one (replacements stand in for whom they replace)."""
        view = self.view
        previous = dict(zip(view.world, view.placement, strict=False))
        nodes, racks = self._columns(world)
        replicas = None
        if self.mesh is not None:
            on_mesh = layout(self.mesh, len(world))
            if on_mesh is not None and on_mesh.replicas > 1:
                replicas = on_mesh.replica_ids()
        placement = place_columns(
            world,
            nodes,
            racks,
            self.policy.redundancy,
            previous=previous,
            substitute=substitute,
            replicas=replicas,
        )
        self._emit(
            f"generation/{generation}",
            "generation.started",
            GenerationStarted.model_construct(
                generation=generation,
                world=list(world),
                rendezvous=self._rendezvous(generation),
                placement=list(map(list, placement.holders)),
                placement_note=placement.note[:_MAX_TEXT],
            ),
            generation,
        )

    def _findings(self) -> list[Finding]:
        """Failures of members of the current world (a spare's failure opens no incident:
        it simply is no candidate any more)."""
        view = self.view
        members = view.members
        everything = detect(view, self.now)
        self.flagged.members = {f.member for f in everything}
        found = [f for f in everything if members[f.member].rank is not None]
        named = {f.member for f in found}
        rankless = [m for m in map(members.get, view.world) if m is not None and m.rank is None]
        for member in rankless:
            member_id = member.member_id
            # Rejoined under a new incarnation: the process of the world is gone, even if
            # its exit was never reported. (The new process may serve again, as a spare.)
            if member_id not in named:
                found.append(
                    Finding(
                        member_id,
                        FaultReason.EXITED,
                        f"{member_id} came back as a new process (incarnation"
                        f" {member.incarnation}): its process in generation"
                        f" {view.generation} is gone",
                        ((member_id, "member.joined", member.joined_position, member.joined_at),),
                    )
                )
        return sorted(found, key=lambda f: f.member)

    def _running(self) -> None:
        view = self.view
        if view.completed_step is not None:
            self._emit("completed", "job.completed", JobCompleted(step=view.completed_step))
            return
        findings = self._findings()
        if findings:
            n = len(view.incidents) + 1
            incident_id = decision_id(view.job_id, f"incident/{n}")
            self._detected(incident_id, findings)
            self._state(_S.DEGRADED, _summary(findings))
            return
        if self._pending_anomaly():
            n = len(view.incidents) + 1
            self._anomaly(decision_id(view.job_id, f"incident/{n}"), _S.DEGRADED, opens=True)
            return
        slow = judge(view, self.now, self._warm_spares())
        if slow:
            # Recorded first; a ``replace`` is then a finding of the next round (``detect``).
            for found in slow:
                self._slow(found)
            return
        self._grow()

    def _pending_anomaly(self) -> bool:
        anomaly = self.view.anomaly
        return anomaly is not None and anomaly.generation == self.view.generation

    def _anomaly(self, incident_id: str, to: JobState, *, opens: bool) -> None:
        """Record the pending loss anomaly in ``incident_id`` (``opens``: a new incident) and
        say what follows: ``to`` (the next round rolls back), or the job stops when the policy
        says so or the job rolled back ``max_rollbacks`` times."""
        view, policy = self.view, self.policy
        report = view.anomaly
        assert report is not None
        count = sum(len(i.detections) for i in view.incidents.values()) + 1
        reported = report.kind in REPORTED_ANOMALIES
        who = f" on {report.member}" if reported and report.member else ""
        detail = f"{report.kind} at step {report.step}{who}" + (
            f": {report.detail}" if report.detail else ""
        )
        what = "train.anomaly" if reported else "train.step"
        evidence = (
            [Evidence(member=report.member, what=what, position=report.position, at=report.at)]
            if report.member
            else []
        )
        self._emit(
            f"detected/{count}",
            "anomaly.detected",
            AnomalyDetected(
                incident_id=uuid.UUID(incident_id),
                kind=AnomalyKind(report.kind),
                step=report.step,
                members=[report.member] if reported and report.member else [],
                detail=detail[:_MAX_TEXT],
                evidence=evidence,
                loss=report.loss,
                threshold=report.threshold,
            ),
        )
        rollbacks = sum(1 for i in view.incidents.values() if i.anomaly_step is not None)
        if policy.anomaly_action is AnomalyAction.STOP:
            self._stop(f"{detail}; the policy stops the job on a loss anomaly (anomaly_action"
                       " stop)")  # fmt: skip
        elif opens and rollbacks >= policy.max_rollbacks:
            self._stop(f"{detail}; the job rolled back {rollbacks} times (max_rollbacks"
                       f" {policy.max_rollbacks})")  # fmt: skip
        else:
            self._state(to, detail)

    def _skips(self, incident: Incident | None, step: int) -> tuple[Ranges | None, str]:
        """The steps a decision of ``incident`` restoring ``step`` skips (None: those the job
        skips already) and what it does, in words ("" for no rollback)."""
        if incident is None or incident.anomaly_step is None:
            return None, ""
        at = incident.anomaly_step
        kinds = "/".join(dict.fromkeys(incident.anomalies)) or "anomaly"
        span = window(at, step, self.policy.anomaly_skip_steps)
        skip = merged(self.view.skipped, span)
        words = f"roll back before the {kinds} at step {at}"
        if span is None:
            words += "; skip no step (anomaly_skip_steps 0)"
        else:
            words += (
                f"; skip step {describe([span])}"
                if span[0] == span[1]
                else (f"; skip steps {describe([span])}")
            )
        return skip, words

    def _open(self) -> Incident | None:
        view = self.view
        return view.incidents.get(view.open_incident) if view.open_incident else None

    def _warm_spares(self) -> int:
        """Warm spares outside the world that could take a rank now."""
        return sum(
            1 for m in self.view.members.values() if m.rank is None and _spare_like(m)
            and self._usable(m)
        )  # fmt: skip

    def _slow(self, found: Slow) -> None:
        base = found.baseline
        self._emit(
            f"slow/{self.view.generation}/{found.member}",
            "member.slow",
            MemberSlow(
                member=found.member,
                rank=found.rank,
                compute_s=found.compute_s,
                baseline_s=base.median_s,
                mad_s=base.mad_s,
                threshold_s=base.threshold_s,
                peers=base.peers,
                window_s=found.window_s,
                evidence=Evidence(
                    member=found.member, what="liveness.summary", position=found.position,
                    at=found.at,
                ),
                action=found.action,  # type: ignore[arg-type]  # "ignore" | "replace"
                projected_loss_s=found.projected_loss_s,
                recovery_cost_s=found.recovery_cost_s,
                reason=found.reason[:_MAX_TEXT],
            ),
        )  # fmt: skip

    def _detected(self, incident_id: str, findings: list[Finding]) -> None:
        view = self.view
        count = sum(len(i.detections) for i in view.incidents.values())
        for reason in _REASON_ORDER:
            group = [f for f in findings if f.reason is reason]
            if not group:
                continue
            count += 1
            evidence = [
                Evidence(member=member, what=what, position=position, at=at)
                for f in group
                for member, what, position, at in f.evidence
            ][:_MAX_EVIDENCE]
            self._emit(
                f"detected/{count}",
                "fault.detected",
                FaultDetected(
                    incident_id=uuid.UUID(incident_id),
                    members=[f.member for f in group],
                    reason=reason,
                    detail="; ".join(f.detail for f in group)[:_MAX_TEXT],
                    evidence=evidence,
                    thresholds=_thresholds(group),
                ),
            )

    def _reallocate(self) -> None:
        view, policy = self.view, self.policy
        incident = view.incidents.get(view.open_incident) if view.open_incident else None
        if incident is None:
            self._stop(f"{view.state.value} without an open incident: nothing to recover")
            return
        if len(incident.decisions) >= policy.max_decisions_per_incident:
            self._stop(
                f"incident {incident.incident_id}: {len(incident.decisions)} decisions did not"
                f" bring the job back (max_decisions_per_incident"
                f" {policy.max_decisions_per_incident})"
            )
            return
        plan = self._plan()
        if isinstance(plan, str):
            self._stop(plan)
            return
        if isinstance(plan, _Wait):
            self._wait(incident, plan)
            return
        if view.state is _S.DEGRADED:
            self._state(_S.REALLOCATING, plan.reason)
        self._issue(incident.incident_id, plan)

    def _issue(self, incident_id: str, plan: _Plan) -> None:
        generation = self.view.generation + 1
        self._emit(
            f"reallocation/{generation}",
            "reallocation.issued",
            ReallocationIssued.model_construct(
                incident_id=uuid.UUID(incident_id),
                command_id=uuid.UUID(decision_id(self.view.job_id, f"command/{generation}")),
                generation=generation,
                mode=plan.mode,
                world=list(plan.world),
                restore_step=plan.restore_step,
                restore_from=plan.restore_from,
                plan=list(plan.sources),
                # No digests: the fold takes each shard's from the catalog the log holds
                # (``restore_digests``), which is where they came from; a 16,384-rank
                # decision's 1.2 MB of them stayed out of the append a fault waits for.
                rendezvous=self._rendezvous(generation),
                reason=plan.reason[:_MAX_TEXT],
                demoted=list(plan.demoted),
                skip=list(plan.skip if plan.skip is not None else self.view.skipped),
            ),
            generation,
        )
        self._generation(generation, plan.world, plan.replacements)
        self._state(
            _S.RECOVERING,
            f"generation {generation}: {len(plan.world)} members restore step"
            f" {plan.restore_step} from {plan.restore_from.value}",
        )

    def _wait(self, incident: Incident, wait: _Wait) -> None:
        """Wait for a spare (a mesh that cannot shrink): say so on entering REALLOCATING, stop
        once ``recovery_deadline_s`` has passed since, record new failures meanwhile."""
        view, policy = self.view, self.policy
        limit = policy.recovery_deadline_s
        if view.state is _S.DEGRADED:
            until = self.now + timedelta(seconds=limit)
            self._state(
                _S.REALLOCATING,
                f"{wait.reason}; waiting for spares to take the lost ranks until"
                f" {until.isoformat()} (recovery_deadline_s {limit:g}s), then the job stops",
            )
            return
        since = view.history[-1].at if view.history else self.now
        if (self.now - since).total_seconds() > limit:
            self._stop(f"no spare came within recovery_deadline_s ({limit:g}s): {wait.reason}")
            return
        findings = self._findings()
        if findings:  # a failure while waiting: the next plan counts it
            self._detected(incident.incident_id, findings)

    def _candidates(self, dead: dict[str, SilentNode]) -> list[Member]:
        """Members outside the world that could take a rank, off the nodes taken as gone:
        spares (and warm spares of dropped replicas) first, then by topology."""
        return sorted(
            # Outside the world first (a cheap test; ``_usable`` asks it again).
            [
                m
                for m in self.view.members.values()
                if m.rank is None and m.node not in dead and self._usable(m)
            ],
            key=lambda m: (not _spare_like(m), _topology_key(m)),
        )

    def _plan(self) -> _Plan | _Wait | str:
        """The new world and where its state comes from, or why the job cannot go on."""
        if self.mesh is not None:
            return self._mesh_plan(self.mesh)
        view, policy = self.view, self.policy
        members = view.members
        # The members of the world that are not active.
        active = MemberStatus.ACTIVE
        failed = [m for m in view.world if members[m].status is not active]
        # A node whose found-silent member has silent company is gone as a whole: no
        # replacement comes from it, and its silent members serve no restore.
        dead = self._silent_nodes()
        candidates = sorted(
            # Outside the world first (a cheap test; ``_usable`` asks it again).
            [
                m
                for m in members.values()
                if m.rank is None and m.node not in dead and self._usable(m)
            ],
            key=lambda m: (m.role is not Role.SPARE, _topology_key(m)),
        )
        replacements: dict[str, str] = {}
        for member_id in failed:
            if not candidates:
                break
            gone = members[member_id]
            best = min(
                candidates,
                key=lambda m: (
                    m.rack != gone.rack,
                    m.node == gone.node,
                    m.role is not Role.SPARE,
                    _topology_key(m),
                ),
            )
            candidates.remove(best)
            replacements[member_id] = best.member_id
        dropped = [m for m in failed if m not in replacements]
        # The world without the dropped, each failed member renamed to its replacement.
        leaving = set(dropped)
        staying = [m for m in view.world if m not in leaving] if leaving else view.world
        world = tuple(map(replacements.get, staying, staying))
        survivors = len(view.world) - len(failed)
        if len(world) < policy.min_world:
            return (
                f"too few members to go on: {survivors} survive and {len(replacements)} spares"
                f" can replace {len(failed)} failed ({', '.join(failed[:8])}), fewer than"
                f" min_world {policy.min_world}"
            )
        mode = ReallocationMode.SHRINK if dropped else ReallocationMode.REPLACE
        unheard = frozenset(m for node in dead.values() for m, _ in node.silent)
        incident = self._open()
        before = incident.anomaly_step if incident is not None else None
        restore = self._restore_point(world, unheard, before=before)
        if isinstance(restore, str):
            return restore
        step, source, sources = restore
        skip, rollback = self._skips(incident, step)
        if rollback and not failed:
            mode = ReallocationMode.ROLLBACK
        parts = [rollback] if rollback else []
        parts += [f"replace {f} with {r}" for f, r in replacements.items()]
        if dropped:
            parts.append(f"shrink to {len(world)} without {', '.join(dropped[:8])} (no spare)")
        parts.extend(
            f"{node.describe()} (no replacement from it, no restore from its silent members)"
            for node in list(dead.values())[:8]
        )
        reason = "; ".join(parts) or "re-form the world"
        return _Plan(
            mode,
            world,
            step,
            source,
            sources,
            f"{reason}; restore step {step}",
            replacements,
            skip=skip,
        )

    def _silent_nodes(self) -> dict[str, SilentNode]:
        """The nodes of the open incident's members found silent (heartbeat timeout) that
        have other members silent past ``silence_limit`` (``placement.silent_nodes``)."""
        view = self.view
        incident = view.incidents.get(view.open_incident) if view.open_incident else None
        if incident is None:
            return {}
        members = view.members
        timed_out = FaultReason.HEARTBEAT_TIMEOUT
        found = [
            m
            for m in incident.members
            if (member := members.get(m)) is not None
            and member.status is MemberStatus.FAILED
            and member.failed_reason == timed_out
        ]
        if not found:
            return {}
        return silent_nodes(
            members, found, self.now, silence_limit(view), heartbeats=view.heartbeats
        )

    def _mesh_plan(self, mesh: Mesh) -> _Plan | _Wait | str:
        """``_plan`` by replicas: spares take the lost ranks' coordinates; when they are too
        few, the fewest whole replicas are dropped (the most damaged first) and their
        survivors take the remaining lost ranks or become warm spares; when no replica can be
        dropped, a wait (or, past the deadline, a stop)."""
        view, policy = self.view, self.policy
        members = view.members
        world = view.world
        lay = layout(mesh, len(world))
        if lay is None:
            return (
                f"generation {view.generation}'s world of {len(world)} ranks is not whole"
                f" replicas of the mesh {mesh.describe()} ({mesh.replica_size} ranks each)"
            )
        active = MemberStatus.ACTIVE
        failed = [r for r, m in enumerate(world) if members[m].status is not active]
        dead = self._silent_nodes()
        candidates = self._candidates(dead)
        replica_of = lay.replica_ids()
        lost: dict[int, list[int]] = {}
        for r in failed:
            lost.setdefault(replica_of[r], []).append(r)
        flagged = self._flagged()

        def reusable(member: Member) -> bool:
            return (
                member.status is active
                and member.detected_position is None
                and member.member_id not in flagged
                and member.node not in dead
                and self._fresh(member)
            )

        # Dropping a damaged replica removes its lost ranks and frees its survivors: drop the
        # fewest (those that lost most first, then the last) until the lost ranks left are
        # no more than the members that can take them.
        order = sorted(lost, key=lambda q: (-len(lost[q]), -q))
        dropped: list[int] = []
        survivors: list[str] = []
        freed: list[Member] = []
        holes = len(failed)
        ranks_of: dict[int, list[int]] = {}
        while holes > len(candidates) + len(freed):
            q = order[len(dropped)]
            dropped.append(q)
            holes -= len(lost[q])
            if not ranks_of:  # the ranks of every damaged replica, in one pass
                for r, of in enumerate(replica_of):
                    if of in lost:
                        ranks_of.setdefault(of, []).append(r)
            for r in ranks_of[q]:
                member_id = world[r]
                member = members[member_id]
                if member.status is active:
                    survivors.append(member_id)
                    if reusable(member):
                        freed.append(member)
        kept = lay.replicas - len(dropped)
        if dropped and kept < policy.min_world:
            return _Wait(self._cannot_shrink(lay, failed, candidates, dropped, kept))
        # The lost ranks of the kept replicas, in rank order, each to the best member left:
        # on its node-local group's node, in its rack, off its node, a spare first.
        dropping = set(dropped)
        pool = candidates + freed
        replacements: dict[str, str] = {}
        notes: list[str] = []
        local = [lay.names[a] for a in lay.local_axes]
        for r in failed:
            if replica_of[r] in dropping:
                continue
            gone = members[world[r]]
            peers = (
                {
                    members[world[p]].node
                    for p in lay.local_peers(r)
                    if p != r and members[world[p]].status is active
                }
                if local
                else set()
            )
            best = min(
                pool,
                key=lambda m: (
                    bool(peers) and m.node not in peers,
                    m.rack != gone.rack,
                    m.node == gone.node,
                    not _spare_like(m),
                    _topology_key(m),
                ),
            )
            pool.remove(best)
            replacements[world[r]] = best.member_id
            if peers and best.node not in peers:
                notes.append(
                    f"rank {r} ({lay.describe_rank(r)}) runs on {best.node}, away from its"
                    f" {'/'.join(local)} group on {', '.join(sorted(peers)[:2])} (no spare there)"
                )
        taken = set(replacements.values())
        demoted = tuple(m for m in survivors if m not in taken)
        receivers: dict[int, str] | None = None
        new = lay
        if not dropped:
            new_world = tuple(map(replacements.get, world, world))
        else:
            new = lay.with_replicas(kept, full_layout(mesh))
            dense: list[int | None] = [None] * lay.replicas
            n = 0
            for q in range(lay.replicas):
                if q not in dropping:
                    dense[q] = n
                    n += 1
            out = [""] * new.size
            receivers = {}
            for r, target in enumerate(lay.remap(new, dense)):
                if target is not None:
                    member_id = world[r]
                    out[target] = receivers[r] = replacements.get(member_id, member_id)
            new_world = tuple(out)
        unheard = frozenset(m for node in dead.values() for m, _ in node.silent)
        incident = self._open()
        before = incident.anomaly_step if incident is not None else None
        # The survivors that leave the world serve only shards no one else holds.
        restore = self._restore_point(
            new_world, unheard, receivers, avoid=frozenset(demoted), before=before
        )
        if isinstance(restore, str):
            return restore
        step, source, sources = restore
        skip, rollback = self._skips(incident, step)
        parts = [rollback] if rollback else []
        parts += [
            f"replace {world[r]} with {replacements[world[r]]} at rank {r} ({lay.describe_rank(r)})"
            for r in failed
            if world[r] in replacements
        ][:8]
        if dropped:
            which = ", ".join(
                f"{lay.describe_replica(q)} (lost {', '.join(world[r] for r in lost[q][:4])})"
                for q in sorted(dropped)[:8]
            )
            parts.append(
                f"shrink to {kept} of {lay.replicas} replicas ({new.describe()},"
                f" {len(new_world)} ranks) without {which}: too few spares; their"
                f" {len(demoted)} other survivors become spares"
            )
        parts.extend(notes[:4])
        parts.extend(
            f"{node.describe()} (no replacement from it, no restore from its silent members)"
            for node in list(dead.values())[:8]
        )
        reason = "; ".join(parts) or "re-form the world"
        mode = ReallocationMode.SHRINK if dropped else ReallocationMode.REPLACE
        if rollback and not failed:
            mode = ReallocationMode.ROLLBACK
        return _Plan(
            mode,
            new_world,
            step,
            source,
            sources,
            f"{reason}; restore step {step}",
            replacements,
            demoted,
            skip,
        )

    def _cannot_shrink(
        self,
        lay: Layout,
        failed: list[int],
        candidates: list[Member],
        dropped: list[int],
        kept: int,
    ) -> str:
        """Why a mesh's lost ranks cannot go on without a spare, for a person to read."""
        world = self.view.world
        lost = ", ".join(f"{world[r]} (rank {r}, {lay.describe_rank(r)})" for r in failed[:8])
        more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
        spares = (
            f"only {len(candidates)} spare(s) for {len(failed)} lost ranks"
            if candidates
            else "no spare can take their coordinates"
        )
        if not lay.replica_axes or lay.replicas == 1:
            why = (
                f"the mesh {lay.describe()} is one replica (no data-parallel replica to drop"
                f" and go on without)"
            )
        else:
            which = ", ".join(lay.describe_replica(q) for q in sorted(dropped)[:8])
            why = (
                f"dropping the replicas that lost them ({which}) would leave {kept} of"
                f" {lay.replicas} replicas, fewer than min_world {self.policy.min_world}"
                f" (replicas)"
            )
        return f"cannot shrink: {lost}{more} failed and {spares}; {why}"

    def _restore_point(
        self,
        world: tuple[str, ...],
        unheard: frozenset[str] = frozenset(),
        receivers: dict[int, str] | None = None,
        *,
        avoid: frozenset[str] = frozenset(),
        before: int | None = None,
    ) -> tuple[int, RestoreFrom, tuple[str, ...]] | str:
        """Newest step whose every shard survives (hot first, then cold), or why none does;
        members in ``unheard`` (silent on a node taken as gone) are no source. ``receivers``
        maps a shard to the member that will need it (default: rank ``s`` of ``world``).
        ``before``: a rollback's, strictly before that step (a loss anomaly's), else the
        initial state (the job replays from its seed)."""
        view = self.view
        members = view.members
        active = MemberStatus.ACTIVE
        alive = {k for k, m in members.items() if m.status is active and k not in unheard}
        if receivers is None:
            receivers = dict(enumerate(world))
        hot = plan_restore(view, alive, receivers, members, avoid, before=before)
        if hot is not None:  # hot first (seconds), even when a cold checkpoint is newer
            return hot.step, RestoreFrom.MEMORY, hot.sources
        cold = view.newest_complete_checkpoint()
        if cold is not None and (before is None or cold.step < before):
            return cold.step, RestoreFrom.CHECKPOINT, ()
        if view.last_complete_backup is None or before is not None:
            return 0, RestoreFrom.INITIAL, ()
        return (
            f"no complete copy of the state survives: every copy of a shard of each backup"
            f" (newest complete: step {view.last_complete_backup}) was on failed members, and"
            f" there is no cold checkpoint"
        )

    def _recovering(self) -> None:
        view, policy = self.view, self.policy
        incident: Incident | None = (
            view.incidents.get(view.open_incident) if view.open_incident else None
        )
        if incident is None or not incident.decisions:
            self._stop("RECOVERING without a recorded decision: nothing to wait for")
            return
        decision = incident.decisions[-1]
        # The new generation stepping resolves the incident first: a fault seen in the same
        # batch then opens a new incident instead of blurring this one's timeline.
        if decision.first_step_position is not None:
            line = timeline(incident)
            self._emit(
                f"resolved/{incident.incident_id}",
                "incident.resolved",
                IncidentResolved(
                    incident_id=uuid.UUID(incident.incident_id),
                    phases={k: max(0.0, v) for k, v in line.phases.items() if v is not None},
                    downtime_s=max(0.0, line.downtime_s or 0.0),
                    steps_lost=line.steps_lost or 0,
                ),
            )
            self._state(_S.RUNNING, f"generation {decision.generation} took its first step")
            return
        # With a mesh, a cascade re-enters DEGRADED: the next decision (a plan, or a wait for a
        # spare) then says on entering REALLOCATING what it does.
        reopen = _S.DEGRADED if self.mesh is not None else _S.REALLOCATING
        findings = self._findings()
        if findings:
            self._detected(incident.incident_id, findings)
            self._state(reopen, f"while recovering: {_summary(findings)}")
            return
        if self._pending_anomaly():  # the new generation's steps went wrong too: re-decide
            self._anomaly(incident.incident_id, reopen, opens=False)
            return
        refused = refused_sources(view, decision)
        if refused:  # a copy of the plan is not there, or not what its owner reported
            what = ", ".join(f"shard {s} from {m}" for s, m in refused[:8])
            self._state(
                reopen,
                f"while recovering: the restore refused {what} (not held there, or not the"
                f" recorded digest): plan without it",
            )
            return
        late = (self.now - decision.at).total_seconds()
        if late <= policy.recovery_deadline_s:
            return
        waiting = [
            m
            for m in decision.world
            if m not in decision.resumed and view.members[m].status is MemberStatus.ACTIVE
        ]
        # Those furthest behind hold the others up (a group forms once every member acked, a
        # world steps once every member restored): a member that acked and waits for one that
        # never did is not late, and dropping it too would stop a job its spares could save.
        behind = min((_stage(m, decision) for m in waiting), default=0)
        laggards = [m for m in waiting if _stage(m, decision) == behind]
        if not laggards:
            self._stop(
                f"generation {decision.generation} took no step within"
                f" {policy.recovery_deadline_s:g}s although every member resumed"
            )
            return
        findings = [
            Finding(
                m,
                FaultReason.RECOVERY_DEADLINE,
                f"{m} did not resume generation {decision.generation} within"
                f" {policy.recovery_deadline_s:g}s ({_progress(m, decision)})",
                ((m, "reallocation.issued", decision.position, decision.at),),
            )
            for m in laggards
        ]
        self._detected(incident.incident_id, findings)
        self._state(reopen, f"recovery deadline missed: {_summary(findings)}")

    def _grow(self) -> None:
        if self.mesh is not None:
            self._grow_mesh(self.mesh)
            return
        view, policy = self.view, self.policy
        room = policy.max_world - len(view.world)
        due = self._growth_candidates(room, demoted=False)[:room]
        if not due:
            return
        world = (*view.world, *(m.member_id for m in due))
        restore = self._restore_point(world)
        if isinstance(restore, str) or restore[1] is not RestoreFrom.MEMORY:
            return  # grow only from a whole hot backup; try again at the next one
        step, source, sources = restore
        names = ", ".join(m.member_id for m in due[:8])
        reason = f"grow to {len(world)} with {names} at the backup of step {step}"
        self._state(_S.REALLOCATING, reason)
        n = len(view.incidents) + 1
        self._issue(
            decision_id(view.job_id, f"incident/{n}"),
            _Plan(ReallocationMode.GROW, world, step, source, sources, reason),
        )

    def _growth_candidates(self, room: int, *, demoted: bool) -> list[Member]:
        """Members that may join a growing world, in topology order: joined after the start
        (or, with ``demoted``, dropped from a replica) and covered by the newest complete
        backup; none when there is no room, no start or no backup."""
        view = self.view
        backup = view.last_complete_backup
        if room <= 0 or view.started_position is None or backup is None:
            return []
        started = view.started_position
        return sorted(
            [
                m
                for m in view.members.values()
                if (m.joined_position > started or (demoted and m.demoted_position is not None))
                and backup >= m.joined_step
                and self._usable(m)
            ],
            key=_topology_key,
        )

    def _grow_mesh(self, mesh: Mesh) -> None:
        """Growth by whole replicas, up to the mesh's size: members that joined after the
        start and warm spares of dropped replicas fill new replicas at a backup boundary."""
        view, policy = self.view, self.policy
        lay = layout(mesh, len(view.world))
        if lay is None:
            return
        full = full_layout(mesh)
        per = lay.replica_size
        room = min(full.replicas - lay.replicas, (policy.max_world - len(view.world)) // per)
        due = self._growth_candidates(room, demoted=True)
        grown = min(room, len(due) // per)
        if grown <= 0:
            return
        due = due[: grown * per]
        new = lay.with_replicas(lay.replicas + grown, full)
        out = [""] * new.size
        for r, target in enumerate(lay.remap(new, list(range(lay.replicas)))):
            assert target is not None
            out[target] = view.world[r]
        places = new.intra_fill_order()
        fresh = iter(due)
        for q in range(lay.replicas, lay.replicas + grown):
            for j in places:
                out[new.rank_of(q, j)] = next(fresh).member_id
        world = tuple(out)
        restore = self._restore_point(world, receivers=dict(enumerate(view.world)))
        if isinstance(restore, str) or restore[1] is not RestoreFrom.MEMORY:
            return  # grow only from a whole hot backup; try again at the next one
        step, source, sources = restore
        names = ", ".join(m.member_id for m in due[:8])
        reason = (
            f"grow to {lay.replicas + grown} of {full.replicas} replicas ({new.describe()},"
            f" {len(world)} ranks) with {names} at the backup of step {step}"
        )
        self._state(_S.REALLOCATING, reason)
        n = len(view.incidents) + 1
        self._issue(
            decision_id(view.job_id, f"incident/{n}"),
            _Plan(ReallocationMode.GROW, world, step, source, sources, reason),
        )


def _stage(member: str, decision: Decision) -> int:
    """How far ``member`` got in ``decision``'s recovery: 0 never acked, 1 acked, 2 restored,
    3 resumed."""
    if member in decision.resumed:
        return 3
    if member in decision.restored:
        return 2
    return 1 if member in decision.acked else 0


#: What each stage short of resuming says of a member late at the recovery deadline.
_PROGRESS = ("never acked", "acked, not restored", "restored, not resumed")


def _progress(member: str, decision: Decision) -> str:
    return _PROGRESS[_stage(member, decision)]


def _summary(findings: list[Finding]) -> str:
    text = "; ".join(f.detail for f in findings[:8])
    if len(findings) > 8:
        text += f"; and {len(findings) - 8} more"
    return text


def _thresholds(findings: list[Finding]) -> list[HeartbeatThreshold] | None:
    """The threshold in force for each of ``findings`` (heartbeat and step timeouts; None:
    other)."""
    out = []
    for f in findings:
        t = f.threshold
        if t is None:
            return None
        out.append(
            HeartbeatThreshold(
                phase=t.phase, seconds=t.seconds, mode=t.mode,  # type: ignore[arg-type]
                gaps=t.gaps, quantile=t.quantile, gap_s=t.gap_s, k=t.k, floor_s=t.floor_s,
                ceiling_s=t.ceiling_s, how=t.how[:_MAX_TEXT],
            )
        )  # fmt: skip
    return out
