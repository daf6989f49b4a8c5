"""Fold the log into job views: ``fold(view, events) -> view``.

Pure: no I/O, no clock (times come from the events' ``recorded_at``), the input view is never
mutated. For speed the fold works on a private copy that it owns (a transient): the top-level
containers are copied once per call and each member, backup step or incident is copied the first
time this call changes it, so folding a batch costs O(batch + touched), not O(batch x view). A
member's heartbeats are kept beside it (``JobView.heartbeats``), so a liveness summary naming
every member copies one dict, not every member.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import fields
from typing import Any, Protocol, TypeVar

from controlplane.core import timeouts
from controlplane.core.anomaly import spike_threshold
from controlplane.core.catalog import entries, is_catalog
from controlplane.core.compact import expand, placed
from controlplane.core.detect import PEER_FAULTS
from controlplane.core.records import StoredEvent
from controlplane.core.restore import restore_digests
from controlplane.core.statemachine import TERMINAL, can_transition
from controlplane.core.steps import JobSteps
from controlplane.core.view import (
    DEFAULT_POLICY,
    KEEP_COMPLETE_BACKUPS,
    LAUNCHER,
    MAX_ANOMALIES,
    MAX_DISCOUNTS,
    MAX_STEP_LEAD,
    AnomalyReport,
    CheckpointStep,
    Computed,
    Decision,
    Discount,
    DiscountReason,
    FaultReport,
    GenerationRecord,
    Heartbeat,
    Incident,
    JobView,
    Launched,
    Mark,
    Member,
    MemberStatus,
    Progress,
    ReplicaCopy,
    ShardBackup,
    SlowMark,
    StateChange,
    StepBackup,
)
from schemas.common import (
    CONTROLPLANE_SOURCE,
    AnomalyKind,
    FaultKind,
    JobState,
    ReallocationMode,
)

_VIEW_FIELDS = tuple(f.name for f in fields(JobView))
_ACTIVE = MemberStatus.ACTIVE

_T = TypeVar("_T")


def _copier(cls: type[_T]) -> Callable[[_T], _T]:
    """A shallow copy of a ``cls`` instance: its constructor called with every field, in
    order (``dataclasses.replace`` does the same by name, ten times slower; a shrink copies
    thousands of members, every heartbeat batch as many as it names)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    assert all(f.init for f in fields(cls)), f"{cls.__name__} has a field __init__ does not take"  # type: ignore[arg-type]
    get = operator.attrgetter(*names)

    def copy(obj: _T) -> _T:
        return cls(*get(obj))

    return copy


_copy_member = _copier(Member)
_copy_backup = _copier(StepBackup)
_copy_shard = _copier(ShardBackup)
_copy_incident = _copier(Incident)
_copy_decision = _copier(Decision)


def fold(view: JobView | None, events: Iterable[StoredEvent]) -> JobView:
    """Apply ``events`` (all of one job, in log order) to ``view`` and return the new view."""
    return fold_noting(view, events)[0]


def fold_noting(
    view: JobView | None, events: Iterable[StoredEvent]
) -> tuple[JobView, frozenset[int]]:
    """``fold``, and the positions of the events of this call that changed nothing because
    the fold did not believe them: discounted (``JobView.discounts``) or from a source that
    never joined. A reader that counts events itself (the API's loss curve) skips those."""
    iterator = iter(events)
    first = next(iterator, None)
    if first is None:
        if view is None:
            raise ValueError("fold of no events needs a starting view")
        return view, frozenset()
    folder = _Fold(view if view is not None else JobView(job_id=first.event.job_id))
    job_id = folder.view.job_id
    handlers = _HANDLERS
    count = 0
    stored = first
    for stored in itertools.chain((first,), iterator):
        event = stored.event
        if event.job_id != job_id:
            raise ValueError(f"event of job {event.job_id!r} folded into job {job_id!r}")
        handlers[event.type](folder, stored, event.payload)
        count += 1
    # ``stored`` is the last event.
    result = folder.view
    result.last_position = stored.position
    result.last_recorded_at = stored.recorded_at
    result.events += count
    return result, frozenset(folder.ignored)


def by_job(events: Iterable[StoredEvent]) -> dict[str, list[StoredEvent]]:
    """``events`` grouped by job, each job's in log order (jobs in order of first event)."""
    out: dict[str, list[StoredEvent]] = {}
    for stored in events:
        out.setdefault(stored.event.job_id, []).append(stored)
    return out


def fold_jobs(views: Mapping[str, JobView], events: Iterable[StoredEvent]) -> dict[str, JobView]:
    """Fold events of any jobs into a copy of ``views`` (job_id -> view)."""
    out = dict(views)
    for job_id, batch in by_job(events).items():
        out[job_id] = fold(out.get(job_id), batch)
    return out


def fold_jobs_counting(
    views: Mapping[str, JobView],
    events: Iterable[StoredEvent],
    steps: MutableMapping[str, JobSteps],
) -> dict[str, JobView]:
    """``fold_jobs``, and each job's events counted into ``steps`` (``core.steps``: its
    losses by step, from the events the fold believed; a job's entry made when missing)."""
    out = dict(views)
    for job_id, batch in by_job(events).items():
        out[job_id], ignored = fold_noting(out.get(job_id), batch)
        counted = steps.get(job_id)
        if counted is None:
            counted = steps[job_id] = JobSteps()
        counted.count(batch, ignored)
    return out


def _announces(launched: Launched, node: str, role: Any, pid: int, incarnation: str) -> bool:
    """Whether a launcher's announcement is of this process: its node, role and pid, and its
    incarnation when the announcement names one."""
    return (launched.node, launched.role, launched.pid) == (node, role, pid) and (
        launched.incarnation is None or launched.incarnation == incarnation
    )


class _Sender(Protocol):
    """What the checks of a report read of its envelope (an event's, or a packed report's)."""

    @property
    def source(self) -> str: ...
    @property
    def incarnation(self) -> str: ...
    @property
    def generation(self) -> int: ...
    @property
    def type(self) -> str: ...


class _Told(Protocol):
    """What the checks of a report read of it: where the log holds it, and who sent it (a
    ``StoredEvent``, or a report of a catalog, ``core.catalog.Entry``)."""

    @property
    def position(self) -> int: ...
    @property
    def event(self) -> _Sender: ...


class _Fold:
    """A transient: owns a copy of the view and mutates it while applying one call's events."""

    __slots__ = (
        "_by_source",
        "_own_backups",
        "_own_compute",
        "_own_discounts",
        "_own_heartbeats",
        "_own_incidents",
        "_own_launched",
        "_own_members",
        "_own_shards",
        "ignored",
        "view",
    )

    def __init__(self, view: JobView) -> None:
        copy = JobView(**{name: getattr(view, name) for name in _VIEW_FIELDS})
        copy.members = dict(view.members)
        copy.backups = dict(view.backups)
        copy.checkpoints = dict(view.checkpoints)
        copy.incidents = dict(view.incidents)
        copy.history = list(view.history)
        copy.anomalies = list(view.anomalies)
        self.view = copy
        self._own_members: set[str] = set()
        #: source -> the owned member behind it; saves parsing the source on every event.
        self._by_source: dict[str, Member] = {}
        self._own_backups: set[int] = set()
        #: Step -> the shards of that (owned) step this call copied or made.
        self._own_shards: dict[int, set[int]] = {}
        self._own_incidents: set[str] = set()
        # Copied the first time this call changes them (most calls never do).
        self._own_launched = False
        self._own_discounts = False
        self._own_heartbeats = False
        self._own_compute = False
        #: Positions of events this call did not believe (see ``fold_noting``).
        self.ignored: list[int] = []

    # ------------------------------------------------------------------ ownership

    def _member(self, member_id: str) -> Member | None:
        if member_id in self._own_members:
            return self.view.members[member_id]
        member = self.view.members.get(member_id)
        if member is not None:
            member = _copy_member(member)
            self.view.members[member_id] = member
            self._own_members.add(member_id)
        return member

    def _heartbeats(self) -> dict[str, Heartbeat]:
        """The view's heartbeats, owned by this fold (copied on the first change: a dict of
        tuples, copied in C, where a summary used to copy every member it named)."""
        view = self.view
        if not self._own_heartbeats:
            view.heartbeats = dict(view.heartbeats)
            self._own_heartbeats = True
        return view.heartbeats

    def _backup(self, step: int) -> StepBackup | None:
        """The record of backup ``step``, owned by this fold (its shards are not: see
        ``_owned_shard``)."""
        backup = self.view.backups.get(step)
        if backup is not None and step not in self._own_backups:
            backup = _copy_backup(backup)
            backup.shards = dict(backup.shards)
            self.view.backups[step] = backup
            self._own_backups.add(step)
        return backup

    def _owned_shard(self, step: int, backup: StepBackup, shard_no: int) -> ShardBackup | None:
        """Shard ``shard_no`` of ``backup`` (owned), owned by this fold: copied the first time
        this call changes it. A backup of 16,384 ranks whose reports come in several batches
        then copies each shard once, not every shard of the step per batch."""
        shard = backup.shards.get(shard_no)
        owned = self._own_shards.setdefault(step, set())
        if shard is not None and shard_no not in owned:
            shard = backup.shards[shard_no] = _copy_shard(shard)
            shard.replicas = dict(shard.replicas)
            owned.add(shard_no)
        return shard

    def _incident(self, incident_id: str) -> Incident | None:
        incident = self.view.incidents.get(incident_id)
        if incident is not None and incident_id not in self._own_incidents:
            incident = _copy_incident(incident)
            incident.members = list(incident.members)
            incident.reasons = list(incident.reasons)
            incident.detections = list(incident.detections)
            decisions = incident.decisions = [_copy_decision(d) for d in incident.decisions]
            for d in decisions:
                d.acked = dict(d.acked)
                d.restored = dict(d.restored)
                d.resumed = dict(d.resumed)
            self.view.incidents[incident_id] = incident
            self._own_incidents.add(incident_id)
        return incident

    def _discount(self, stored: _Told, reason: DiscountReason, detail: str) -> None:
        """Record that ``stored`` is not believed: it changes nothing but this record."""
        view = self.view
        if not self._own_discounts:
            view.discounts = list(view.discounts)
            view.discount_counts = dict(view.discount_counts)
            self._own_discounts = True
        event = stored.event
        view.discounts.append(Discount(stored.position, event.type, event.source, reason, detail))
        if len(view.discounts) > MAX_DISCOUNTS:
            del view.discounts[0]
        view.discount_counts[reason.value] = view.discount_counts.get(reason.value, 0) + 1
        self.ignored.append(stored.position)

    def _step_lead(self, stored: _Told, member: Member, step: int) -> bool:
        """Whether ``step`` is implausibly far ahead (then discounted): more than
        MAX_STEP_LEAD beyond both the member's last step and the job's newest step."""
        base = member.step if member.step > self.view.last_step else self.view.last_step
        if step <= base + MAX_STEP_LEAD:
            return False
        self._discount(
            stored,
            DiscountReason.STEP_IMPLAUSIBLE,
            f"step {step} of {member.member_id} is more than {MAX_STEP_LEAD} beyond its last"
            f" step {member.step} and the job's newest step {self.view.last_step}",
        )
        return True

    def _anomaly(self, stored: _Told, text: str) -> None:
        anomalies = self.view.anomalies
        anomalies.append(f"#{stored.position} {stored.event.type}: {text}")
        if len(anomalies) > MAX_ANOMALIES:
            del anomalies[0]

    # ------------------------------------------------------------------ member events

    def _joined(self, stored: StoredEvent, p: Any) -> None:
        event = stored.event
        member_id = event.source.partition("/")[2]
        previous = self.view.members.get(member_id)
        if previous is not None and previous.incarnation == event.incarnation:
            # The process already known, announcing itself again: a join is bound to its
            # incarnation, so the member keeps its position (and with it its copies), status,
            # generation and rank. A failed member does not come back by saying it joined.
            self._discount(
                stored,
                DiscountReason.REPEATED_JOIN,
                f"{member_id} joined again as incarnation {event.incarnation}, which joined at"
                f" #{previous.joined_position}: the same process, nothing changes",
            )
            return
        self.view.members[member_id] = Member(
            member_id=member_id,
            node=p.node,
            rack=p.rack,
            host=p.host,
            pid=p.pid,
            role=p.role,
            device=p.device,
            backup_endpoint=p.backup_endpoint,
            incarnation=event.incarnation,
            joined_at=stored.recorded_at,
            joined_position=stored.position,
            # A new process: outside the world until a generation names it.
            rank=None,
            joined_step=self.view.last_step,
            announced_position=self._announcement(
                member_id, p.node, p.role, p.pid, event.incarnation
            ),
        )
        if p.policy is not None and self.view.requested_policy is None:
            self.view.requested_policy = p.policy
        if member_id in self.view.heartbeats:
            del self._heartbeats()[member_id]  # the new process is not heard yet
        self._own_members.add(member_id)
        # The member object was replaced (and may have moved node): drop cached lookups.
        self._by_source = {k: m for k, m in self._by_source.items() if m.member_id != member_id}

    def _announcement(
        self, member_id: str, node: str, role: Any, pid: int, incarnation: str
    ) -> int | None:
        """Position of the launcher's announcement of this process, if it made one (same
        node, role and pid, and the same incarnation when the announcement names one)."""
        launched = self.view.launched.get(member_id)
        if launched is None or not _announces(launched, node, role, pid, incarnation):
            return None
        return launched.position

    def _launched(self, stored: StoredEvent, p: Any) -> None:
        node, _, sender = stored.event.source.partition("/")
        if sender != LAUNCHER:
            self._discount(
                stored,
                DiscountReason.LAUNCH_NOT_FROM_LAUNCHER,
                f"{stored.event.source} is not a launcher: only {node}/{LAUNCHER} announces"
                f" the members it starts on {node}",
            )
            return
        view = self.view
        if not self._own_launched:
            view.launched = dict(view.launched)
            self._own_launched = True
        launched = Launched(node, p.role, p.pid, stored.position, p.incarnation)
        view.launched[p.member] = launched
        # The member may have joined first (its announcement was late): it counts from now.
        member = view.members.get(p.member)
        if (
            member is not None
            and member.announced_position is None
            and _announces(launched, member.node, member.role, member.pid, member.incarnation)
        ):
            owned = self._member(p.member)
            assert owned is not None
            owned.announced_position = stored.position

    def _known_member(
        self, stored: _Told, process: bool = False, *, change: bool = True
    ) -> Member | None:
        """The member that sent ``stored`` (owned by this fold, with ``change``: the caller
        changes it; without, the view's own, copied only if its generation moves: a backup
        report from every rank then copies no member); None (and the event discounted or
        noted) when it cannot be believed. With ``process``, only from the member's current
        process (see ``_other_process``)."""
        source = stored.event.source
        member = self._by_source.get(source)
        if member is None:
            member_id = source.partition("/")[2]
            if not member_id:
                member = None
            elif change:
                member = self._member(member_id)
            else:
                member = self.view.members.get(member_id)
            if member is None:
                self._anomaly(stored, f"from {source}, which never joined")
                self.ignored.append(stored.position)
                return None
            if change:
                self._by_source[source] = member
        if (
            process
            and stored.event.incarnation != member.incarnation
            and self._other_process(stored, member)
        ):
            return None
        generation = stored.event.generation
        # Compared, not max(): this runs for almost every event, and the call costs more.
        # A member's generation never passes the view's (only believed events move it), so
        # only a newer one than the member's can be ahead of the control plane.
        if generation > member.generation:
            if generation > self.view.generation:
                self._discount(
                    stored,
                    DiscountReason.GENERATION_AHEAD,
                    f"generation {generation} from {source}: the newest the control plane"
                    f" issued is {self.view.generation}",
                )
                return None
            if not change:
                owned = self._member(member.member_id)
                assert owned is not None
                self._by_source[source] = member = owned
            member.generation = generation
        return member

    def _heartbeat(self, stored: StoredEvent, p: Any) -> None:
        # Only the process that joined last keeps the member alive.
        member = self._known_member(stored, True)
        if member is None:
            return
        generation = stored.event.generation
        if generation < self.view.generation and member.status is not _ACTIVE:
            # A fenced member resumed (SIGCONT) and still beating in the world it was left out
            # of: stored, and no sign of life in the current one.
            self._stale(stored, member, generation)
            return
        step = p.step
        # Beyond both bounds (the common case is below either: compared inline, every
        # member heartbeats).
        if (
            step > member.step + MAX_STEP_LEAD
            and step > self.view.last_step + MAX_STEP_LEAD
            and self._step_lead(stored, member, step)
        ):
            return
        self._heartbeats()[member.member_id] = Heartbeat(
            stored.recorded_at, stored.position, "member.heartbeat", p.phase
        )
        if step > member.step:  # noqa: PLR1730 (see _known_member)
            member.step = step

    def _liveness(self, stored: StoredEvent, p: Any) -> None:
        """A ``liveness.summary``: each member it lists (its current process) was last heard
        at ``last_at`` in ``phase``, unless the view heard it later, or it is a member left
        out of the world beating in an older generation. Applied whatever else the member's
        status. Only ``JobView.heartbeats`` changes: no member is copied, so a summary naming
        every member of a large job costs a dict copy and an entry per member."""
        if stored.event.source != CONTROLPLANE_SOURCE:
            return  # the decoder refuses it from members; a log may still hold anything
        members = self.view.members
        generation = self.view.generation
        heartbeats = self._heartbeats()
        position = stored.position
        listed = p.members
        columns = p.columns
        rows: Iterable[tuple[str, str | None, int, Any, Any]] = (
            (e.member, e.incarnation, e.generation, e.last_at, e.phase) for e in listed
        )
        if columns is not None:
            rows = itertools.chain(rows, columns.last_heard()) if listed else columns.last_heard()
        for member_id, incarnation, beat_generation, last_at, phase in rows:
            current = members.get(member_id)
            if current is None:
                continue
            # A columnar summary lists only the view's processes (LivenessRow).
            if incarnation is not None and current.incarnation != incarnation:
                continue
            if beat_generation < generation and current.status is not _ACTIVE:
                continue  # a fenced member resumed: no sign of life in the current world
            heard = heartbeats.get(member_id)
            if heard is not None and last_at < heard.at:
                continue
            heartbeats[member_id] = Heartbeat(last_at, position, "liveness.summary", phase)
        self._heard_step(p)
        if p.compute_window_ms is not None:
            self._compute(stored, p)
        self._progress(stored, p)
        if p.reason == "interval":
            policy = self.view.effective_policy
            if policy.heartbeat_timeout_mode == "auto":
                self._gaps(p)
            if policy.step_timeout_mode == "auto":
                self._steps(p)
        regular = p.regular
        if regular is None:
            return
        # Every member named regular was heard at one time in one phase: one entry for all.
        vouched = regular.vouched(p.since, p.at)
        mark = Heartbeat(vouched, position, "liveness.summary", regular.phase)
        stale = regular.generation < generation
        for member_id in regular.members:
            current = members.get(member_id)
            if current is None or (stale and current.status is not _ACTIVE):
                continue
            heard = heartbeats.get(member_id)
            if heard is not None and vouched < heard.at:
                continue
            heartbeats[member_id] = mark

    def _gaps(self, p: Any) -> None:
        """An interval summary's heartbeat gaps: into the window, and each phase's timeout
        derived again (``core/timeouts.py``). New values: nothing shared is changed."""
        view = self.view
        policy = view.effective_policy
        view.gap_samples = timeouts.window(
            view.gap_samples, timeouts.samples_of(p, view.members), p.at, policy
        )
        view.thresholds = timeouts.derive(view.gap_samples, policy)

    def _steps(self, p: Any) -> None:
        """An interval summary's longest steps: into the window, and the step timeout
        derived again (``core/timeouts.py``)."""
        view = self.view
        policy = view.effective_policy
        view.step_samples = timeouts.window(
            view.step_samples, timeouts.step_samples_of(p, view.members), p.at, policy,
            policy.step_timeout_window_s,
        )  # fmt: skip
        view.step_threshold = timeouts.derive_step(view.step_samples, policy)

    def _heard_step(self, p: Any) -> None:
        """The newest step a summary heard a member of the current generation at (a
        spare's heartbeats carry step 0: they change nothing)."""
        view = self.view
        generation = view.generation
        steps = [e.step for e in p.members if e.generation == generation]
        columns, regular = p.columns, p.regular
        if columns is not None:
            steps += [
                s for s, g in zip(columns.step, columns.generation, strict=True) if g == generation
            ]
        if regular is not None and regular.generation == generation:
            steps.append(regular.step_max)
        view.heard_step = max([view.heard_step, *steps])

    def _progress(self, stored: StoredEvent, p: Any) -> None:
        """A summary's progress columns: where each member it lists was in its steps at its
        last heartbeat; a member named regular was progressing (forgotten)."""
        view = self.view
        columns, regular = p.columns, p.regular
        known = view.progress
        if not known and (
            columns is None or (columns.since_step_ms is None and columns.ready_ms is None)
        ):
            return  # nothing known, nothing told: the usual case costs nothing
        progress = dict(known)
        members = view.members
        if regular is not None:
            for member_id in regular.members:
                progress.pop(member_id, None)
        if columns is not None:
            listed = set()
            for member_id, step, generation, at, opened, ready in columns.progress():
                listed.add(member_id)
                if member_id in members:
                    progress[member_id] = Progress(
                        step, generation, at, opened, ready, stored.position
                    )
            for member_id in columns.members:
                if member_id not in listed:
                    progress.pop(member_id, None)
        view.progress = progress

    def _compute(self, stored: StoredEvent, p: Any) -> None:
        """A summary's compute times: each member it lists or names (its current process),
        known over the window or not (then forgotten: a window not covered says nothing)."""
        view = self.view
        if not self._own_compute:
            view.compute = dict(view.compute)
            self._own_compute = True
        compute, members = view.compute, view.members
        window_s = p.compute_window_ms / 1000
        generations = {e.member: e.generation for e in p.members}
        if p.columns is not None:
            generations.update(zip(p.columns.members, p.columns.generation, strict=True))
        regular = p.regular
        for member_id, seconds in p.computed():
            if member_id not in members:
                continue
            if seconds is None:
                compute.pop(member_id, None)
                continue
            generation = generations.get(member_id)
            if generation is None:
                generation = regular.generation if regular is not None else view.generation
            compute[member_id] = Computed(seconds, generation, window_s, stored.position, p.at)

    def _member_slow(self, stored: StoredEvent, p: Any) -> None:
        """``member.slow``: kept per member (the decider acts on it once per generation)."""
        view = self.view
        if stored.event.source != CONTROLPLANE_SOURCE or p.member not in view.members:
            return
        view.slow = {
            **view.slow,
            p.member: SlowMark(
                stored.event.generation, stored.position, stored.recorded_at, p.action, p.reason
            ),
        }

    def _stale(self, stored: StoredEvent, member: Member, generation: int) -> None:
        self._discount(
            stored,
            DiscountReason.STALE_GENERATION,
            f"{stored.event.type} of generation {generation} from {member.member_id}"
            f" ({member.status.value}), after generation {self.view.generation} started",
        )

    def _train_step(self, stored: StoredEvent, p: Any) -> None:
        view = self.view
        member = self._known_member(stored, True)
        step = p.step
        if member is None:
            return
        if stored.event.generation < view.generation:
            # A step of a world the control plane abandoned (the new one restarts from its
            # restore step): it moves neither the job's nor the member's step, nor the loss.
            self._stale(stored, member, stored.event.generation)
            return
        if (
            step > member.step + MAX_STEP_LEAD
            and step > view.last_step + MAX_STEP_LEAD
            and self._step_lead(stored, member, step)
        ):
            return
        if step > member.step:  # noqa: PLR1730 (see _known_member)
            member.step = step
        if step >= view.last_step and stored.event.generation == view.generation:
            if step > view.last_step and view.effective_policy.loss_spike_k > 0:
                self._spike(stored, step, p.loss)
            view.last_step = step
            view.last_loss = p.loss
        if view.open_incident is not None:
            incident = self._incident(view.open_incident)
            assert incident is not None
            if incident.decisions:
                decision = incident.decisions[-1]
                if (
                    decision.first_step_position is None
                    and stored.event.generation == decision.generation
                    and p.step > decision.restore_step
                ):
                    decision.first_step_position = stored.position
                    decision.first_step_at = stored.recorded_at

    def _spike(self, stored: StoredEvent, step: int, loss: float) -> None:
        """Keep the job's newest losses of the current timeline, and take a loss above their
        robust threshold (``core.anomaly.spike_threshold``) as a spike, when no anomaly nor
        incident is pending."""
        view = self.view
        policy = view.effective_policy
        recent = view.recent_losses
        if len(recent) >= policy.loss_spike_window and view.open_incident is None:
            threshold = spike_threshold([x for _, x in recent], policy.loss_spike_k)
            if loss > threshold and view.anomaly is None:
                view.anomaly = AnomalyReport(
                    AnomalyKind.LOSS_SPIKE.value, step, None, stored.position,
                    stored.recorded_at, view.generation,
                    f"loss {loss:.6g} at step {step} above {threshold:.6g} (median + "
                    f"{policy.loss_spike_k:g} x MAD of the {len(recent)} steps before)",
                    loss, threshold,
                )  # fmt: skip
        view.recent_losses = (*recent[-policy.loss_spike_window + 1 :], (step, loss))

    def _train_anomaly(self, stored: StoredEvent, p: Any) -> None:
        """A rank's non-finite step: pending (the earliest step wins) until a decision takes
        it up; believed only from an active member of the current generation's world."""
        view = self.view
        member = self._known_member(stored, True, change=False)
        if member is None:
            return
        generation = stored.event.generation
        if generation != view.generation:
            self._stale(stored, member, generation)
            return
        if member.rank is None or member.status is not _ACTIVE:
            self._discount(
                stored,
                DiscountReason.REPORTER_NOT_IN_WORLD,
                f"{p.kind} from {member.member_id}, not an active member of generation"
                f" {generation}'s world",
            )
            return
        if self._step_lead(stored, member, p.step):
            return
        pending = view.anomaly
        if pending is None or p.step < pending.step:
            view.anomaly = AnomalyReport(
                str(p.kind), p.step, member.member_id, stored.position, stored.recorded_at,
                generation, p.detail,
            )  # fmt: skip

    def _snapshot(self, stored: _Told, p: Any) -> None:
        owner = self._known_member(stored, change=False)
        if owner is None or self._step_lead(stored, owner, p.step):
            return
        # A copy in another process's memory is not in the current one's.
        if stored.event.incarnation != owner.incarnation and self._other_process(stored, owner):
            return
        shard = self._shard(stored, p.step, p.shard, owner.member_id, snapshot=True)
        if shard is None:
            return
        was = shard.is_satisfied(self._redundancy)
        shard.owner = owner.member_id
        shard.nbytes = p.nbytes
        shard.checksum = p.checksum
        shard.snapshot_position = stored.position
        # The holders that answered the owner they keep a copy (logs recorded before say so
        # in each holder's backup.replicated): members of the job, never the owner itself.
        members = self.view.members
        for holder in p.holders:
            if holder == owner.member_id or holder not in members:
                self._anomaly(stored, f"shard {p.shard}: {holder!r} cannot hold its copy")
                continue
            shard.replicas[holder] = ReplicaCopy(holder, p.nbytes, p.checksum, stored.position)
        self._satisfied(p.step, shard, was)

    def _catalog(self, stored: StoredEvent, p: Any) -> None:
        """A ``backup.catalog``: each report it packs, folded as the ``backup.snapshot`` it
        was, at the catalog's position."""
        if not is_catalog(stored.event):
            return  # the decoder refuses it from members; a log may still hold anything
        ignored = self.ignored
        start = len(ignored)
        believed = False
        for report in entries(stored):
            before = len(ignored)
            self._snapshot(report, report)
            believed = believed or len(ignored) == before
        if believed:  # the catalog changed something: it is not an event the fold ignored
            del ignored[start:]

    def _replicated(self, stored: StoredEvent, p: Any) -> None:
        member = self._known_member(stored, change=False)
        if member is None or self._step_lead(stored, member, p.step):
            return
        if stored.event.incarnation != member.incarnation and self._other_process(stored, member):
            return
        shard = self._shard(stored, p.step, p.shard, p.owner, snapshot=False)
        if shard is None:
            return
        holder = member.member_id
        if shard.owner is None:
            shard.owner = p.owner
        elif shard.owner != p.owner:
            self._anomaly(stored, f"shard {p.shard} owned by {shard.owner}, replica says {p.owner}")
            return
        was = shard.is_satisfied(self._redundancy)
        shard.replicas[holder] = ReplicaCopy(holder, p.nbytes, p.checksum, stored.position)
        if shard.checksum is not None and p.checksum != shard.checksum:
            self._anomaly(stored, f"checksum of shard {p.shard} at {holder} does not match owner")
        self._satisfied(p.step, shard, was)

    def _shard(
        self, stored: _Told, step: int, shard_no: int, owner: str, *, snapshot: bool
    ) -> ShardBackup | None:
        """The record (owned by this fold) of shard ``shard_no`` of backup ``step`` that
        ``stored`` reports on, or None when the event counts nowhere (discounted or noted).

        A step's backup belongs to the generation whose world took it, and has a shard per
        rank of that world. That is the envelope's generation, unless the step is at or below
        that generation's restore step: the generation started after it, so the event is a
        late report of an older generation's copy (a holder reports under the generation it
        has moved to) and counts in that generation's record of the step. A generation older
        than the current one is believed only for steps up to the restore step of every later
        generation: beyond it, its timeline was abandoned (stale)."""
        view = self.view
        generation = stored.event.generation
        record = view.started(generation)
        if record is None:
            self._discount(
                stored,
                DiscountReason.STALE_GENERATION,
                f"{stored.event.type} of step {step} (shard {shard_no}) from generation"
                f" {generation}, which never started a world (current: {view.generation})",
            )
            return None
        if generation < view.generation:
            fence = view.fence(generation)
            if fence is not None and fence.restore_step is not None and step > fence.restore_step:
                self._discount(
                    stored,
                    DiscountReason.STALE_GENERATION,
                    f"{stored.event.type} of step {step} (shard {shard_no}) from generation"
                    f" {generation}: generation {fence.generation} restored step"
                    f" {fence.restore_step}, abandoning what generation {generation} did after"
                    f" it",
                )
                return None
        existing = view.backups.get(step)
        restored = record.restore_step
        if restored is not None and step <= restored:
            if snapshot or existing is None or existing.generation >= generation:
                self._anomaly(
                    stored,
                    f"{'snapshot' if snapshot else 'replica'} of step {step} under generation"
                    f" {generation}, which started from step {restored}: no older generation's"
                    f" backup of that step to count it in",
                )
                return None
            maker, size = existing.generation, existing.num_shards
        else:
            maker, size = generation, record.world_size
        if shard_no >= size:
            self._discount(
                stored,
                DiscountReason.SHARD_OUTSIDE_WORLD,
                f"{stored.event.type} of shard {shard_no} at step {step}: the world of"
                f" generation {maker} has {size} ranks",
            )
            return None
        if maker == view.generation and view.world[shard_no] != owner:
            self._discount(
                stored,
                DiscountReason.SHARD_OUTSIDE_WORLD,
                f"{stored.event.type} of shard {shard_no} at step {step} owned by {owner}: rank"
                f" {shard_no} of generation {maker} is {view.world[shard_no]}",
            )
            return None
        if existing is not None and existing.generation > maker:
            self._anomaly(stored, f"backup of generation {maker} after {existing.generation}")
            return None
        if existing is None or existing.generation < maker:
            # A newer generation redoing a step replaces what an older one left behind.
            backup = StepBackup(step=step, generation=maker, num_shards=size)
            view.backups[step] = backup
            self._own_backups.add(step)
            self._own_shards[step] = set()
        else:
            owned = self._backup(step)
            assert owned is not None
            backup = owned
        shard = self._owned_shard(step, backup, shard_no)
        if shard is None:
            shard = backup.shards[shard_no] = ShardBackup(shard=shard_no)
            self._own_shards[step].add(shard_no)
        return shard

    @property
    def _redundancy(self) -> int:
        policy = self.view.policy
        return policy.redundancy if policy is not None else DEFAULT_POLICY.redundancy

    def _satisfied(self, step: int, shard: ShardBackup, was: bool) -> None:
        """Count the shard in or out of its step, and evict once the step completes."""
        backup = self.view.backups[step]
        now = shard.is_satisfied(self._redundancy)
        if now == was:
            return
        backup.satisfied += 1 if now else -1
        if now and backup.satisfied >= backup.num_shards:
            view = self.view
            if view.last_complete_backup is None or step > view.last_complete_backup:
                view.last_complete_backup = step
            self._evict_backups()

    def _evict_backups(self) -> None:
        view = self.view
        complete = sorted(
            (s for s, b in view.backups.items() if b.satisfied >= b.num_shards),
            reverse=True,
        )
        if len(complete) <= KEEP_COMPLETE_BACKUPS:
            return
        oldest_kept = complete[KEEP_COMPLETE_BACKUPS - 1]
        for old in [s for s in view.backups if s < oldest_kept]:
            del view.backups[old]
            self._own_backups.discard(old)

    def _checkpoint(self, stored: StoredEvent, p: Any) -> None:
        member = self._known_member(stored, change=False)
        if member is None or self._step_lead(stored, member, p.step):
            return
        view = self.view
        generation = stored.event.generation
        if generation < view.generation and not view.on_timeline(generation, p.step):
            fence = view.fence(generation)
            assert fence is not None
            self._discount(
                stored,
                DiscountReason.STALE_GENERATION,
                f"checkpoint.saved of step {p.step} (shard {p.shard}) from generation"
                f" {generation}: generation {fence.generation} restored step"
                f" {fence.restore_step}, abandoning what generation {generation} did after it",
            )
            return
        old = view.checkpoints.get(p.step)
        if old is None or old.shards != p.shards:
            entry = CheckpointStep(step=p.step, shards=p.shards)
        else:
            entry = CheckpointStep(step=p.step, shards=p.shards, saved=dict(old.saved))
        entry.saved[p.shard] = p.path
        view.checkpoints[p.step] = entry
        if entry.is_complete:
            # Older checkpoints are superseded (the members delete them too).
            for step in [s for s in view.checkpoints if s < p.step]:
                del view.checkpoints[step]

    def _fault(self, stored: StoredEvent, p: Any) -> None:
        member = self._known_member(stored, True)
        if member is None:
            return
        generation = stored.event.generation
        # A report about peers (and about their copies) is evidence only from an active member
        # of the world of the generation it names, while that generation is current. A fault a
        # member reports about itself is believed whatever generation it names: it comes from
        # the member's current process (checked above) and can fence only that process.
        if p.kind in PEER_FAULTS and not self._reporter_counts(stored, member, p.kind):
            return
        member.last_fault = FaultReport(
            position=stored.position,
            at=stored.recorded_at,
            kind=p.kind,
            detail=p.detail,
            step=p.step,
            suspects=tuple(p.suspects),
            generation=generation,
        )
        if p.kind == FaultKind.RESTORE_FAILED and p.source is not None and p.shard is not None:
            self._refute(p.step, p.shard, p.source)

    def _other_process(self, stored: _Told, member: Member) -> bool:
        """Whether ``stored`` comes from another process (incarnation) than the one of
        ``member`` that joined last (then discounted): an earlier process of the name that
        still speaks (resumed after a stop, or late in the pipeline) is not the member."""
        incarnation = stored.event.incarnation
        if incarnation == member.incarnation:
            return False
        self._discount(
            stored,
            DiscountReason.STALE_INCARNATION,
            f"{stored.event.type} from {member.member_id}'s process {incarnation}: its current"
            f" process is {member.incarnation} (joined at #{member.joined_position})",
        )
        return True

    def _reporter_counts(self, stored: StoredEvent, reporter: Member, kind: str) -> bool:
        """Whether a peer report counts: it names the current generation and, from the first
        world on, its reporter is an active member of that world (else discounted).
        Generation 0 precedes every world: no decision reads its reports (PENDING decides
        no fault), and they are stale once the first generation starts."""
        view = self.view
        generation = stored.event.generation
        member_id = reporter.member_id
        if generation != view.generation:
            mark = view.generation_mark
            since = f" (started at #{mark.position})" if mark is not None else ""
            self._discount(
                stored,
                DiscountReason.STALE_REPORT,
                f"{kind} from {member_id} about generation {generation}: generation"
                f" {view.generation} is current{since}",
            )
            return False
        if generation == 0 or (reporter.rank is not None and reporter.status is _ACTIVE):
            return True
        if reporter.status is not _ACTIVE:
            why = f"it {reporter.status.value}"
            if reporter.failed_reason:
                why += f" ({reporter.failed_reason})"
        else:
            why = "it holds no rank in it (a spare, or a process that joined since)"
        self._discount(
            stored,
            DiscountReason.REPORTER_NOT_IN_WORLD,
            f"{kind} from {member_id}, not an active member of generation {generation}'s"
            f" world: {why}",
        )
        return False

    def _refute(self, step: int | None, shard_no: int, source: str) -> None:
        """A restore refused ``source``'s copy of the shard (it does not hash to the digest its
        owner reported, or ``source`` does not hold it): that copy is never planned from
        again. A shard whose owner's report never came (planned from where the placement sent
        it: ``restore._unreported``) gets a record of its own for it."""
        backup = self._backup(step) if step is not None else None
        if backup is None or not 0 <= shard_no < backup.num_shards:
            return
        shard = backup.shards.get(shard_no)
        if shard is None:
            backup.shards[shard_no] = ShardBackup(shard_no, refuted=(source,))
        elif source not in shard.refuted:
            owned = self._owned_shard(step, backup, shard_no)  # type: ignore[arg-type]
            assert owned is not None
            owned.refuted = (*shard.refuted, source)

    def _exited(self, stored: StoredEvent, p: Any) -> None:
        known = self.view.members.get(p.member)
        if known is None:
            self._anomaly(stored, f"exit of {p.member}, which never joined")
            return
        # Only the launcher that watches the process may say it ended: the one of the node
        # the member joined on.
        launcher = f"{known.node}/{LAUNCHER}"
        if stored.event.source != launcher:
            self._discount(
                stored,
                DiscountReason.EXIT_NOT_FROM_LAUNCHER,
                f"exit of {p.member} reported by {stored.event.source}: only {launcher}, the"
                f" launcher of its node, reports its exit",
            )
            return
        # ... and only of the process it names: an exit of an earlier process of the name
        # (reported after its successor joined) leaves the successor alone. An exit that
        # names neither (an older launcher) is of the current process.
        if (p.incarnation is not None and p.incarnation != known.incarnation) or (
            p.incarnation is None and p.pid is not None and p.pid != known.pid
        ):
            named = f"incarnation {p.incarnation}" if p.incarnation is not None else f"pid {p.pid}"
            self._discount(
                stored,
                DiscountReason.STALE_EXIT,
                f"exit of {p.member}'s process {named}: its current process is incarnation"
                f" {known.incarnation}, pid {known.pid} (joined at #{known.joined_position})",
            )
            return
        member = self._member(p.member)
        assert member is not None
        member.status = MemberStatus.EXITED
        member.exit_code = p.exit_code
        member.exit_signal = p.signal
        member.exited_at = stored.recorded_at
        member.exited_position = stored.position

    def _decision(self, stored: StoredEvent, generation: int) -> Decision | None:
        """The open incident's decision for ``generation``, owned by this fold."""
        view = self.view
        if view.open_incident is None:
            return None
        incident = self._incident(view.open_incident)
        assert incident is not None
        for decision in reversed(incident.decisions):
            if decision.generation == generation:
                return decision
        return None

    def _acked(self, stored: StoredEvent, p: Any) -> None:
        command_id = str(p.command_id)
        view = self.view
        member = self._known_member(stored, True, change=False)
        if member is None:
            return
        member_id = member.member_id
        for incident_id in [view.open_incident] if view.open_incident else []:
            incident = self._incident(incident_id)
            assert incident is not None
            for decision in incident.decisions:
                if decision.command_id == command_id:
                    decision.acked.setdefault(member_id, Mark(stored.position, stored.recorded_at))
                    return
        self._anomaly(stored, f"ack of unknown or closed command {command_id}")

    def _command_refused(self, stored: StoredEvent, p: Any) -> None:
        """A member refused a command that did not verify: kept visible in the anomalies."""
        more = f" (+{p.suppressed} unreported)" if p.suppressed else ""
        claimed = f", claiming command {p.command_id}" if p.command_id else ""
        self._anomaly(stored, f"{stored.event.source} refused a command on {p.subject}"
                              f"{claimed}: {p.reason}{more}")  # fmt: skip

    def _restored(self, stored: StoredEvent, p: Any) -> None:
        member = self._known_member(stored, True, change=False)
        decision = self._decision(stored, p.generation)
        if decision is not None and member is not None:
            decision.restored.setdefault(
                member.member_id, Mark(stored.position, stored.recorded_at)
            )

    def _resumed(self, stored: StoredEvent, p: Any) -> None:
        member = self._known_member(stored, True, change=False)
        decision = self._decision(stored, p.generation)
        if decision is not None and member is not None:
            decision.resumed.setdefault(member.member_id, Mark(stored.position, stored.recorded_at))

    def _train_completed(self, stored: StoredEvent, p: Any) -> None:
        member = self._known_member(stored, True, change=False)
        if member is None or self._step_lead(stored, member, p.step):
            return
        view = self.view
        if view.completed_step is None or p.step > view.completed_step:
            view.completed_step = p.step

    # ------------------------------------------------------------------ decisions

    def _registered(self, stored: StoredEvent, p: Any) -> None:
        view = self.view
        if view.registered_at is not None:
            self._anomaly(stored, "job registered twice; the newer policy applies")
        view.name = p.name
        view.policy = p.policy
        view.registered_at = stored.recorded_at

    def _generation(self, stored: StoredEvent, p: Any) -> None:
        view = self.view
        if p.generation < view.generation:
            self._anomaly(stored, f"generation {p.generation} after {view.generation}")
            return
        view.generation = p.generation
        before = view.world
        world = p.world if p.world_spans is None else expand(p.world_spans, before)
        view.world = tuple(world)
        view.rendezvous = p.rendezvous
        if p.placement_changes is None:
            view.placement = tuple(map(tuple, p.placement))
        else:
            previous = dict(zip(before, view.placement, strict=False))
            view.placement = placed(world, p.placement_changes, previous)
        view.placement_note = p.placement_note
        view.generation_mark = Mark(stored.position, stored.recorded_at)
        if view.started_position is None:
            view.started_position = stored.position
        self._start_timeline(stored, p.generation, len(view.world))
        ranks = dict(zip(world, range(len(world)), strict=True))
        for member_id, member in list(view.members.items()):
            rank = ranks.get(member_id)
            if member.rank != rank:
                owned = self._member(member_id)
                assert owned is not None
                owned.rank = rank
                if rank is not None:
                    owned.demoted_position = None  # a warm spare no more
        missing = [m for m in world if m not in view.members]
        if missing:
            self._anomaly(stored, f"world names members that never joined: {missing[:5]}")

    def _start_timeline(self, stored: StoredEvent, generation: int, world_size: int) -> None:
        """Record ``generation`` in the lineage. A generation issued by a reallocation starts
        its timeline at the restore step: what older generations did beyond it is abandoned,
        so the catalog drops their backups and checkpoints of later steps (their late reports
        are discounted as stale), and the job's step goes back to it, with the join steps
        growth compares with backups: steps lost, a fault's step and growth count from there."""
        view = self.view
        restore = self._restore_step_of(generation)
        lineage = view.lineage
        if lineage and lineage[-1].generation == generation:
            lineage = lineage[:-1]  # the same generation started again: the newer record
        record = GenerationRecord(generation, world_size, restore, stored.position)
        view.lineage = (*lineage, record)
        if view.anomaly is not None and view.anomaly.generation < generation:
            view.anomaly = None  # a report of the world this one replaces
        if restore is None:
            return
        view.last_step = view.heard_step = restore
        if view.recent_losses and view.recent_losses[-1][0] > restore:
            view.recent_losses = tuple(x for x in view.recent_losses if x[0] <= restore)
        for step in [s for s in view.backups if s > restore]:
            del view.backups[step]
            self._own_backups.discard(step)
        for step in [s for s in view.checkpoints if s > restore]:
            del view.checkpoints[step]
        complete = [s for s, b in view.backups.items() if b.satisfied >= b.num_shards]
        if complete:
            view.last_complete_backup = max(complete)
        elif view.last_complete_backup is not None and view.last_complete_backup > restore:
            # None stays for "no hot backup was ever complete" (a total loss then restarts
            # from the initial state); a state that existed keeps it from that.
            view.last_complete_backup = restore
        for member_id in [k for k, m in view.members.items() if m.joined_step > restore]:
            owned = self._member(member_id)
            assert owned is not None
            owned.joined_step = restore

    def _restore_step_of(self, generation: int) -> int | None:
        """The restore step of the open incident's decision that issued ``generation`` (None:
        no reallocation issued it, e.g. the first world)."""
        view = self.view
        incident = view.incidents.get(view.open_incident) if view.open_incident else None
        if incident is None:
            return None
        for decision in reversed(incident.decisions):
            if decision.generation == generation:
                return decision.restore_step
        return None

    def _detection(self, stored: StoredEvent, p: Any, kind: str) -> Incident:
        """The incident a detection (``fault.detected``, ``anomaly.detected``) names, opened
        (of ``kind``) when it is new; its text, position and earliest evidence recorded."""
        view = self.view
        incident_id = str(p.incident_id)
        incident = self._incident(incident_id)
        if incident is None:
            if view.open_incident is not None and view.open_incident != incident_id:
                self._anomaly(stored, f"new incident while {view.open_incident} is open")
            incident = Incident(
                incident_id=incident_id,
                opened_at=stored.recorded_at,
                opened_position=stored.position,
                members=[],
                reasons=[],
                detections=[],
                step_at_fault=view.last_step,
                kind=kind,
            )
            view.incidents[incident_id] = incident
            self._own_incidents.add(incident_id)
            view.open_incident = incident_id
        incident.reasons.append(p.detail)
        incident.detections.append(stored.position)
        for evidence in p.evidence:
            if evidence.at is None:
                continue
            mark = Mark(
                evidence.position if evidence.position is not None else stored.position, evidence.at
            )
            if incident.evidence is None or mark.at < incident.evidence.at:
                incident.evidence = mark
        return incident

    def _fault_detected(self, stored: StoredEvent, p: Any) -> None:
        view = self.view
        incident = self._detection(stored, p, "fault")
        named = set(incident.members)  # a set: an incident may name thousands of members
        for member_id in p.members:
            if member_id not in named:
                named.add(member_id)
                incident.members.append(member_id)
            member = self._member(member_id)
            if member is None:
                continue
            if member.rank is None and member_id in view.world:
                # A new incarnation rejoined: the failed process was the old one.
                continue
            member.detected_position = stored.position
            if member.status is MemberStatus.ACTIVE:
                member.status = MemberStatus.FAILED
                member.failed_reason = p.reason

    def _anomaly_detected(self, stored: StoredEvent, p: Any) -> None:
        """A loss anomaly opens an incident of kind ``anomaly`` (or joins the open one): its
        decisions restore a backup before its step. No member is failed by it."""
        incident = self._detection(stored, p, "anomaly")
        named = set(incident.members)
        incident.members.extend(m for m in p.members if m not in named)
        if incident.anomaly_step is None or p.step < incident.anomaly_step:
            incident.anomaly_step = p.step
        incident.anomalies = (*incident.anomalies, str(p.kind))
        self.view.anomaly = None  # taken up

    def _state_changed(self, stored: StoredEvent, p: Any) -> None:
        view = self.view
        if p.from_ != view.state or not can_transition(view.state, p.to):
            # The log is the truth: apply it, but leave a trace of the inconsistency.
            self._anomaly(stored, f"transition {p.from_}->{p.to} while {view.state}")
        self._set_state(stored, p.to, p.reason)

    def _set_state(self, stored: StoredEvent, to: JobState, reason: str) -> None:
        view = self.view
        view.history.append(
            StateChange(stored.position, stored.recorded_at, view.state, to, reason)
        )
        view.state = to

    def _reallocation(self, stored: StoredEvent, p: Any) -> None:
        view = self.view
        incident_id = str(p.incident_id)
        world = p.world if p.world_spans is None else expand(p.world_spans, view.world)
        plan = p.plan if p.plan_spans is None else expand(p.plan_spans, view.world)
        incident = self._incident(incident_id)
        if incident is None and p.mode is ReallocationMode.GROW:
            # A planned growth has no fault behind it: the decision opens its own record
            # (its members: the world's newcomers, looked up in a set: worlds of 16,384).
            current = set(view.world)
            incident = Incident(
                incident_id=incident_id,
                opened_at=stored.recorded_at,
                opened_position=stored.position,
                members=[m for m in world if m not in current],
                reasons=[p.reason],
                detections=[],
                step_at_fault=view.last_step,
                kind="growth",
            )
            view.incidents[incident_id] = incident
            self._own_incidents.add(incident_id)
            view.open_incident = incident_id
        if incident is None:
            self._anomaly(stored, f"reallocation for unknown incident {p.incident_id}")
            return
        incident.decisions.append(
            Decision(
                position=stored.position,
                at=stored.recorded_at,
                command_id=str(p.command_id),
                generation=p.generation,
                mode=p.mode,
                # One string per member name, not one per decision naming it.
                world=tuple(map(sys.intern, world)),
                restore_step=p.restore_step,
                restore_from=p.restore_from,
                plan=tuple(map(sys.intern, plan)),
                # Recorded (logs before fold revision 5), else what the catalog the log
                # holds says each shard's owner reported: what the decision read.
                digests=tuple(p.digests) or restore_digests(view, p.restore_step, plan),
                rendezvous=p.rendezvous,
                reason=p.reason,
                demoted=tuple(p.demoted),
                skip=tuple((first, last) for first, last in p.skip),
            )
        )
        # The decision in force says which steps the loop skips (each carries the job's list).
        view.skipped = incident.decisions[-1].skip
        for member_id in p.demoted:
            # Survivors of a dropped replica: warm spares (a decision names each at most once).
            member = self._member(member_id)
            if member is not None and member.status is _ACTIVE:
                member.demoted_position = stored.position

    def _resolved(self, stored: StoredEvent, p: Any) -> None:
        incident_id = str(p.incident_id)
        incident = self._incident(incident_id)
        if incident is None:
            self._anomaly(stored, f"resolution of unknown incident {incident_id}")
            return
        self._close(incident, stored, "recovered")
        incident.downtime_s = p.downtime_s
        incident.steps_lost = p.steps_lost

    def _close(self, incident: Incident, stored: StoredEvent, outcome: str) -> None:
        incident.outcome = outcome
        for decision in incident.decisions:  # owned: ``incident`` came from ``_incident``
            decision.compact()
        incident.resolved_at = stored.recorded_at
        incident.resolved_position = stored.position
        if self.view.open_incident == incident.incident_id:
            self.view.open_incident = None

    def _stopped(self, stored: StoredEvent, p: Any) -> None:
        view = self.view
        if view.open_incident is not None:
            incident = self._incident(view.open_incident)
            assert incident is not None
            self._close(incident, stored, "stopped")
        if view.state not in TERMINAL:
            self._set_state(stored, JobState.STOPPED, p.reason)

    def _completed(self, stored: StoredEvent, p: Any) -> None:
        view = self.view
        if p.step is not None:
            view.completed_step = p.step
        if view.state not in TERMINAL:
            self._set_state(stored, JobState.COMPLETED, "training completed")


_HANDLERS: dict[str, Callable[[_Fold, StoredEvent, Any], None]] = {
    "member.joined": _Fold._joined,
    "member.heartbeat": _Fold._heartbeat,
    "liveness.summary": _Fold._liveness,
    "train.step": _Fold._train_step,
    "backup.snapshot": _Fold._snapshot,
    "backup.catalog": _Fold._catalog,
    "backup.replicated": _Fold._replicated,
    "checkpoint.saved": _Fold._checkpoint,
    "member.fault": _Fold._fault,
    "member.exited": _Fold._exited,
    "member.launched": _Fold._launched,
    "command.acked": _Fold._acked,
    "command.refused": _Fold._command_refused,
    "restore.completed": _Fold._restored,
    "train.resumed": _Fold._resumed,
    "train.completed": _Fold._train_completed,
    "train.anomaly": _Fold._train_anomaly,
    "job.registered": _Fold._registered,
    "generation.started": _Fold._generation,
    "fault.detected": _Fold._fault_detected,
    "anomaly.detected": _Fold._anomaly_detected,
    "member.slow": _Fold._member_slow,
    "job.state_changed": _Fold._state_changed,
    "reallocation.issued": _Fold._reallocation,
    "incident.resolved": _Fold._resolved,
    "job.stopped": _Fold._stopped,
    "job.completed": _Fold._completed,
}

__all__ = ["fold", "fold_jobs", "fold_noting"]
