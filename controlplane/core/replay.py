"""Re-decide a recorded log: does the decider, given what the members said, decide the same?

The service decides on the job's view folded up to the log's last position, at a time it
records as the decisions' ``emitted_at``, and appends them as one batch behind that position
(optimistic concurrency makes sure nothing came in between). So for each recorded batch of
decisions, the view folded from every earlier event of the job, and ``decide`` at the batch's
``emitted_at``, must give the same events, ids included. Pure: the log is an argument.

``counterfactual(log, overrides)`` asks what the decider would have decided under another
policy (see the comment above it).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from controlplane.core.catalog import unpacked
from controlplane.core.compact import expand, placed
from controlplane.core.decide import Context, Decided, decide, envelope, next_deadline
from controlplane.core.detect import SILENCE_BEATS
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.core.restore import restore_digests
from controlplane.core.timeline import timeline
from controlplane.core.view import Incident, JobView
from schemas.common import CONTROLPLANE_SOURCE, Phase
from schemas.events import (
    OBSERVATION_TYPES,
    EnvelopeBase,
    FaultDetected,
    GenerationStarted,
    JobPolicy,
    JobRegistered,
    MemberExited,
    MemberHeartbeat,
    MemberHeartbeatEvent,
    MemberJoined,
    ReallocationIssued,
)


@dataclass(frozen=True, slots=True)
class Redecided:
    """One recorded batch of decisions and what the decider decides in its place."""

    recorded: tuple[StoredEvent, ...]
    redecided: tuple[Decided, ...]
    #: Position of a recorded ``reallocation.issued`` that carries its digests (logs before
    #: fold revision 5) -> the digests the fold takes from the log's catalogs instead, which a
    #: decision now leaves to it: the two must agree.
    derived: Mapping[int, list[str]] = field(default_factory=dict)
    #: The world and placement in force before the batch: what a decision's lists are
    #: written against (``core.compact``), so that a list recorded whole (logs before fold
    #: revision 5) and one written against them compare as the lists they are.
    base: tuple[Sequence[str], Sequence[Sequence[str]]] = ((), ())

    @property
    def matches(self) -> bool:
        recorded = _expanded(_comparable_recorded(self.recorded, self.derived), self.base)
        return recorded == _expanded(_comparable_decided(self.redecided), self.base)


def decision_batches(log: Sequence[StoredEvent]) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of the control plane's batches in one job's log:
    consecutive decisions of one decider run with one ``emitted_at``. What it recorded as
    observed (``liveness.summary``, and the store's ``backup.catalog``) is no decision: it
    is folded as an input, like the members' events."""
    out = []
    i = 0
    while i < len(log):
        first = log[i].event
        if first.source != CONTROLPLANE_SOURCE or first.type in OBSERVATION_TYPES:
            i += 1
            continue
        j = i + 1
        while j < len(log):
            e = log[j].event
            if (
                e.source != CONTROLPLANE_SOURCE
                or e.type in OBSERVATION_TYPES
                or e.emitted_at != first.emitted_at
                or e.incarnation != first.incarnation
            ):
                break
            j += 1
        out.append((i, j))
        i = j
    return out


def redecide(log: Sequence[StoredEvent], context: Context | None = None) -> list[Redecided]:
    """Re-run the decider before every recorded batch of one job's log (in position order).

    ``context`` defaults to the one each batch was decided with: the rendezvous base is an
    input like the clock (it changes with the leader), read from the batch's
    ``generation.started`` when it has one.
    """
    out: list[Redecided] = []
    view: JobView | None = None
    current = context if context is not None else Context()
    done = 0
    for start, end in decision_batches(log):
        if start > done:
            view = fold(view, log[done:start])
        batch = tuple(log[start:end])
        if context is None:
            current = _recorded_context(batch) or current
        now = batch[0].event.emitted_at
        decided = decide(view, now, current) if view is not None else []
        base = (view.world, view.placement) if view is not None else ((), ())
        out.append(Redecided(batch, tuple(decided), _derived_digests(view, batch), base))
        view = fold(view, batch)  # go on from what was recorded
        done = end
    return out


def _recorded_context(batch: Sequence[StoredEvent]) -> Context | None:
    for stored in batch:
        event = stored.event
        if event.type == "generation.started":
            payload = event.payload
            suffix = f"/{event.job_id}/{payload.generation}"
            if payload.rendezvous.endswith(suffix):
                return Context(rendezvous=payload.rendezvous[: -len(suffix)])
            return Context()
    return None


def _derived_digests(view: JobView | None, batch: Sequence[StoredEvent]) -> dict[int, list[str]]:
    """The digests the fold of ``view`` gives each ``reallocation.issued`` of ``batch`` that
    recorded its own (see ``Redecided.derived``)."""
    if view is None:
        return {}
    out = {}
    for s in batch:
        p = s.event.payload
        if isinstance(p, ReallocationIssued) and p.digests:
            plan = p.plan if p.plan_spans is None else expand(p.plan_spans, view.world)
            out[s.position] = list(restore_digests(view, p.restore_step, plan))
    return out


def _expanded(
    batch: list[tuple[str, str, Any]], base: tuple[Sequence[str], Sequence[Sequence[str]]]
) -> list[tuple[str, str, Any]]:
    """``batch`` (comparable payloads, in order) with each decision's lists whole: written
    against the world and placement in force (``base``, then each generation's)."""
    world, placement = base
    for _, type_, payload in batch:
        if type_ == "reallocation.issued":
            if payload.get("world_spans") is not None:
                payload["world"] = expand(payload["world_spans"], world)
            if payload.get("plan_spans") is not None:
                payload["plan"] = expand(payload["plan_spans"], world)
            payload["world_spans"] = payload["plan_spans"] = None
        elif type_ == "generation.started":
            new = payload["world"]
            if payload.get("world_spans") is not None:
                new = payload["world"] = expand(payload["world_spans"], world)
            if payload.get("placement_changes") is not None:
                previous = {m: tuple(h) for m, h in zip(world, placement, strict=False)}
                payload["placement"] = [
                    list(h) for h in placed(new, payload["placement_changes"], previous)
                ]
            payload["world_spans"] = payload["placement_changes"] = None
            world, placement = new, payload["placement"]
    return batch


def _comparable_recorded(
    batch: Sequence[StoredEvent], derived: Mapping[int, list[str]] | None = None
) -> list[tuple[str, str, Any]]:
    out = []
    for s in batch:
        payload = s.event.payload.model_dump(mode="json")
        if derived and s.position in derived and derived[s.position] == payload["digests"]:
            payload["digests"] = []  # recorded as the fold derives them: the same decision
        out.append((s.event.event_id, s.event.type, payload))
    return out


def _comparable_decided(batch: Sequence[Decided]) -> list[tuple[str, str, Any]]:
    return [(d.event_id, d.type, d.payload.model_dump(mode="json")) for d in batch]


# --------------------------------------------------------------------------- counterfactual
#
# What would the decider have decided under another policy? The recorded decisions are
# dropped and the decider runs over the members' events alone, as the service runs it: after
# each batch of member events (events recorded at one time, at that time) and just after each
# of its deadlines (``next_deadline`` + ``DEADLINE_TICK``, as the service wakes), with the
# job's policy changed by the overrides.
#
# The members' events are what they did under the recorded decisions. Each belongs to the
# generation whose decision it answers: its envelope's generation, the one it restores or
# resumes, the one of the command it acks. Those of a generation g the recording started are
# replayed relative to when the counterfactual starts generation g: shifted by (its start -
# the recorded start), and not at all when it never does. The others (generation 0: joins,
# what came before the first start) are replayed at their recorded times. So a decision
# taken 3 s later is answered 3 s later, and the members of a world that waits for that
# decision are silent in between. This is exact up to the first decision that differs;
# after it, it is a model: the members answer as they answered the recorded decision of the
# same generation (the same command id: ids derive from the generation), whatever the
# counterfactual decided. The result says from when on (``replay_until``).
#
# What a decision caused is told apart from what the world did by cause, not by generation
# alone: a launcher's ``member.exited`` of a member it fenced names the generation it fenced it
# for (``fenced_by``), and a member's fault report in a generation a recorded decision had
# already ended (after that decision's start, in log order) is that decision's consequence:
# the collective errors its fencing released in the survivors. Both answer that decision and
# move with it. A log from launchers that did not say ``fenced_by`` has the fencing inferred:
# a SIGKILL exit, after a recorded start, of a member a recorded detection before that start
# found failed. Without this, the recorded fencing exit replayed at its recorded time would be
# taken for an independent crash, and a longer timeout would "detect" the hang at the moment
# the recorded decision killed it.

#: The counterfactual decider runs this long after a deadline, as the service wakes (at the
#: deadline itself detection finds nothing: it compares "silent > timeout").
DEADLINE_TICK = timedelta(milliseconds=1)
#: Shorthand override: ``heartbeat_timeout=X`` sets the train phase's heartbeat timeout (the
#: phase a training rank is in; the others keep theirs), ``heartbeat_timeout.PHASE=X`` one
#: phase's (init, train, backup, restore, waiting).
HEARTBEAT_TIMEOUT = "heartbeat_timeout"
_COUNTERFACTUAL_INCARNATION = "counterfactual"


class PolicyError(ValueError):
    """Overrides that do not make a valid policy (an unknown key, a bad value)."""


def policy_keys() -> list[str]:
    """Every key ``override_policy`` accepts."""
    phases = [f"{HEARTBEAT_TIMEOUT}.{p.value}" for p in Phase]
    return [*JobPolicy.model_fields, HEARTBEAT_TIMEOUT, *phases]


def override_policy(policy: JobPolicy, overrides: Mapping[str, object]) -> JobPolicy:
    """``policy`` with the fields in ``overrides`` replaced, validated as a ``JobPolicy``.

    Keys are the policy's fields (``redundancy``, ``recovery_deadline_s``, …;
    ``heartbeat_timeout_s`` replaces the whole per-phase map, where a phase left out falls
    back to ``train``), plus ``heartbeat_timeout`` (the train phase's timeout) and
    ``heartbeat_timeout.PHASE`` (one phase's), applied after the fields. Values are what JSON
    gives (numbers, strings, objects); an unknown key or a bad value raises ``PolicyError``.
    """
    data = policy.model_dump(mode="json", by_alias=True)
    phases: dict[str, object] = {}
    known = set(JobPolicy.model_fields)
    for key, value in overrides.items():
        name, dot, phase = key.partition(".")
        if name == HEARTBEAT_TIMEOUT:
            phase = phase if dot else Phase.TRAIN.value
            if phase not in {p.value for p in Phase}:
                raise PolicyError(
                    f"unknown phase {phase!r} in {key!r}: one of"
                    f" {', '.join(p.value for p in Phase)}"
                )
            phases[phase] = value
        elif dot or name not in known:
            raise PolicyError(
                f"unknown policy key {key!r}: the keys are {', '.join(policy_keys())}"
            )
        else:
            data[name] = value
    if phases:
        timeouts = data.get("heartbeat_timeout_s")
        data["heartbeat_timeout_s"] = {
            **(timeouts if isinstance(timeouts, dict) else {}),
            **phases,
        }
    try:
        text = json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"policy: {exc}") from None
    try:
        return JobPolicy.model_validate_json(text)
    except ValueError as exc:  # pydantic's ValidationError (the core does not import pydantic)
        errors = exc.errors(include_url=False) if hasattr(exc, "errors") else []
        if not errors:
            raise PolicyError(f"policy: {exc}") from None
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"]) or "policy"
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise PolicyError(f"policy {where}: {first['msg']}{more}") from None


@dataclass(frozen=True, slots=True)
class IncidentFacts:
    """What a side-by-side comparison shows of one incident (times of the log it is from)."""

    incident_id: str
    kind: str
    members: tuple[str, ...]
    #: Why it was detected: the ``reason`` of each of its ``fault.detected``, in order.
    reasons: tuple[str, ...]
    #: The earliest evidence (the fault itself), else the detection.
    fault_at: datetime
    detected_at: datetime
    decided_at: datetime | None
    #: The last decision: mode, generation, world, restore step and its source.
    mode: str | None
    generation: int | None
    world: tuple[str, ...]
    restore_step: int | None
    restore_from: str | None
    first_step_at: datetime | None
    downtime_s: float | None
    steps_lost: int | None
    outcome: str | None
    decisions: int

    @property
    def decision(self) -> str | None:
        """The last decision in words, e.g. ``shrink to 3 (gen 3), restore step 75 (memory)``."""
        if self.mode is None:
            return None
        return (
            f"{self.mode} to {len(self.world)} (gen {self.generation}), restore step"
            f" {self.restore_step} ({self.restore_from})"
        )


def incident_facts(incident: Incident, reasons: Sequence[str] = ()) -> IncidentFacts:
    """The facts of one incident of a folded view."""
    line = timeline(incident)
    fault, detected = line.points["fault"], line.points["detected"]
    first_step = line.points["first_step"]
    decision = incident.decisions[-1] if incident.decisions else None
    assert fault is not None and detected is not None
    return IncidentFacts(
        incident_id=incident.incident_id,
        kind=incident.kind,
        members=tuple(incident.members),
        reasons=tuple(reasons),
        fault_at=fault.at,
        detected_at=detected.at,
        decided_at=decision.at if decision is not None else None,
        mode=decision.mode.value if decision is not None else None,
        generation=decision.generation if decision is not None else None,
        world=decision.world if decision is not None else (),
        restore_step=decision.restore_step if decision is not None else None,
        restore_from=decision.restore_from.value if decision is not None else None,
        first_step_at=first_step.at if first_step is not None else None,
        downtime_s=incident.downtime_s if incident.downtime_s is not None else line.downtime_s,
        steps_lost=incident.steps_lost if incident.steps_lost is not None else line.steps_lost,
        outcome=incident.outcome,
        decisions=len(incident.decisions),
    )


@dataclass(frozen=True, slots=True)
class Counterfactual:
    """The recorded job and the same job re-decided under another policy."""

    job_id: str
    overrides: Mapping[str, object]
    #: The policy the recording registered (None: it registered none).
    recorded_policy: JobPolicy | None
    #: The policy the counterfactual decider registered.
    policy: JobPolicy
    recorded: JobView
    replayed: JobView
    recorded_incidents: tuple[IncidentFacts, ...]
    incidents: tuple[IncidentFacts, ...]
    #: The counterfactual decisions (positions of the counterfactual log).
    decisions: tuple[StoredEvent, ...]
    #: Member events replayed, and those never replayed: they answered recorded decisions
    #: (of a generation) that the counterfactual never made.
    member_events: int
    unplayed: int
    #: Until when it is a replay of the recording (``replay_until``); a simulation after.
    replay_until: datetime | None = None
    notes: tuple[str, ...] = ()

    def pairs(self) -> list[tuple[IncidentFacts | None, IncidentFacts | None]]:
        """Recorded and counterfactual incidents side by side, the n-th with the n-th."""
        return list(itertools.zip_longest(self.recorded_incidents, self.incidents))


@dataclass(order=True, slots=True)
class _Due:
    """A member event due at ``at`` in the counterfactual (``order``: its recorded position)."""

    at: datetime
    order: int
    stored: StoredEvent = field(compare=False)


def _script_generation(event: EnvelopeBase, commands: Mapping[str, int], started: int) -> int:
    """The generation whose decision ``event`` answers (0: none): its envelope's generation,
    the one its payload restores or resumes, the one of the command it acks, the one its
    launcher fenced it for, or (a fault report in a generation already ended) ``started``,
    the newest generation the recording started before it (see the comment above)."""
    generation = event.generation
    payload = event.payload
    if event.type in ("restore.completed", "train.resumed"):
        generation = max(generation, payload.generation)
    elif event.type == "command.acked":
        generation = max(generation, commands.get(str(payload.command_id), 0))
    elif event.type == "member.exited" and payload.fenced_by is not None:
        generation = max(generation, payload.fenced_by)
    elif event.type == "member.fault" and 0 < generation < started:
        generation = started
    return generation


@dataclass(slots=True)
class _Causes:
    """The recording's decisions, as the members' events answer them: where each generation
    was started (log order), the commands' generations, and the members each recorded
    detection found failed (for fencing exits a launcher did not name)."""

    starts: list[tuple[int, int]] = field(default_factory=list)  # (position, generation)
    commands: dict[str, int] = field(default_factory=dict)
    #: member -> the positions of the recorded detections that named it, in log order.
    detected: dict[str, list[int]] = field(default_factory=dict)
    fenced: int = 0
    inferred: int = 0
    faults: int = 0

    def _start(self, position: int) -> tuple[int, int, int]:
        """The newest generation recorded started before ``position``: its generation, its
        position and the position of the start before it (zeros: none)."""
        i = bisect.bisect_left(self.starts, (position, 0))
        if not i:
            return 0, 0, 0
        at, generation = self.starts[i - 1]
        return generation, at, self.starts[i - 2][0] if i > 1 else 0

    def of(self, stored: StoredEvent) -> StoredEvent:
        """``stored``, with the fencing its launcher did not name inferred (see above)."""
        event = stored.event
        payload = event.payload
        if not isinstance(payload, MemberExited) or payload.fenced_by is not None:
            return stored
        if payload.signal != _SIGKILL:
            return stored
        generation, at, before = self._start(stored.position)
        found = self.detected.get(payload.member, ())
        # Detected in the incident that start decided (after the start before it).
        if not generation or not any(before < p < at for p in found):
            return stored
        self.inferred += 1
        inferred = payload.model_copy(update={"fenced_by": generation})
        return replace(stored, event=event.model_copy(update={"payload": inferred}))

    def script(self, stored: StoredEvent) -> int:
        event = stored.event
        started, _, _ = self._start(stored.position)
        generation = _script_generation(event, self.commands, started)
        if event.type == "member.exited" and event.payload.fenced_by is not None:
            self.fenced += 1
        elif event.type == "member.fault" and generation > event.generation:
            self.faults += 1
        return generation

    def note(self) -> str | None:
        if not (self.fenced or self.faults):
            return None
        said = self.fenced - self.inferred
        parts = []
        if self.fenced:
            parts.append(
                f"{self.fenced} fencing exit(s) ({said} named by their launcher, {self.inferred}"
                " inferred: a SIGKILL after the decision that left a detected member out)"
            )
        if self.faults:
            parts.append(
                f"{self.faults} fault report(s) sent in a generation a recorded decision had"
                " already ended (the errors its fencing released)"
            )
        return (
            " and ".join(parts) + " replayed as consequences of those decisions: they move"
            " with the counterfactual's decision of the same generation, or are not replayed"
        )


_SIGKILL = 9


class _Replay:
    """The counterfactual's log, view and clock, with member events due by time."""

    def __init__(
        self,
        *,
        job_id: str,
        policy: JobPolicy,
        context: Context,
        tick: timedelta,
        scripts: dict[int, list[StoredEvent]],
        recorded_starts: Mapping[int, datetime],
    ) -> None:
        self.job_id = job_id
        self.policy = policy
        self.context = context
        self.tick = tick
        self.scripts = scripts
        self.recorded_starts = recorded_starts
        self.due: list[_Due] = []
        self.view: JobView | None = None
        self.position = 0
        self.seq = 0
        self.clock: datetime | None = None
        self.decisions: list[StoredEvent] = []
        self.reasons: dict[str, list[str]] = {}
        self.played = 0

    def schedule(self, at: datetime, stored: StoredEvent) -> None:
        heapq.heappush(self.due, _Due(at, stored.position, stored))

    def _started(self, generation: int, at: datetime) -> None:
        """The counterfactual started ``generation`` at ``at``: its script is now due."""
        script = self.scripts.pop(generation, None)
        if not script:
            return
        shift = at - self.recorded_starts[generation]
        for stored in script:
            # Never before the decision it answers (an event recorded ahead of its start).
            self.schedule(max(stored.recorded_at + shift, at), stored)

    def pending_scripts(self) -> bool:
        """Recorded decisions of generations the counterfactual has not reached yet."""
        current = self.view.generation if self.view is not None else 0
        return any(g > current for g in self.scripts)

    def fold(self, events: Sequence[EnvelopeBase], at: datetime) -> None:
        stored = []
        for event in events:
            self.position += 1
            stored.append(StoredEvent(self.position, at, event))
        self.view = fold(self.view, stored)
        self.clock = at

    def decide(self, at: datetime) -> bool:
        """Run the decider at ``at`` and record what it decides; True when it decided."""
        view = self.view
        if view is None:
            return False
        if view.policy is None and view.requested_policy != self.policy:
            # The decider registers the policy the members asked for: ask for this one.
            view = self.view = replace(view, requested_policy=self.policy)
        decided = decide(view, at, self.context)
        self.clock = at
        if not decided:
            return False
        events = []
        for d in decided:
            self.seq += 1
            events.append(envelope(self.job_id, d, at, self.seq, _COUNTERFACTUAL_INCARNATION))
        first = self.position + 1
        self.fold(events, at)
        assert self.view is not None
        for i, event in enumerate(events):
            self.decisions.append(StoredEvent(first + i, at, event))
            payload = event.payload
            if isinstance(payload, FaultDetected):
                self.reasons.setdefault(str(payload.incident_id), []).append(payload.reason.value)
            elif isinstance(payload, GenerationStarted):
                self._started(payload.generation, at)
        return True

    def deadlines(self, before: datetime | None, horizon: datetime) -> None:
        """Run the decider just after each deadline due before ``before`` (None: after the
        last member event: up to ``horizon``, or on while recorded decisions wait for the
        counterfactual to make them); stop early when a decision makes member events due."""
        while self.view is not None:
            deadline = next_deadline(self.view)
            if deadline is None:
                return
            at = max(deadline, self.clock or deadline) + self.tick
            if before is not None and at >= before:
                return
            if before is None and at > horizon and not self.pending_scripts():
                return
            queued = len(self.due)
            if not self.decide(at):
                return  # a deadline is a lower bound: nothing more until the next event
            if len(self.due) != queued:
                return

    def run(self, horizon: datetime) -> None:
        while True:
            before = self.due[0].at if self.due else None
            queued = len(self.due)
            self.deadlines(before, horizon)
            if len(self.due) != queued:
                continue  # a decision made member events due: maybe before ``before``
            if not self.due:
                return
            at = self.due[0].at
            batch = []
            while self.due and self.due[0].at == at:
                batch.append(heapq.heappop(self.due).stored.event)
            self.played += len(batch)
            self.fold(batch, at)
            self.decide(at)


def counterfactual(
    log: Sequence[StoredEvent],
    overrides: Mapping[str, object],
    *,
    context: Context | None = None,
    tick: timedelta = DEADLINE_TICK,
) -> Counterfactual:
    """Re-decide one job's log (in position order) under its policy changed by ``overrides``
    (see ``override_policy``), from the members' events alone; see the comment above."""
    if not log:
        raise ValueError("counterfactual of an empty log")
    job_id = log[0].event.job_id
    recorded_starts: dict[int, datetime] = {}
    causes = _Causes()
    recorded_policy: JobPolicy | None = None
    recorded_reasons: dict[str, list[str]] = {}
    recorded_decisions: list[StoredEvent] = []
    for stored in log:
        event = stored.event
        if event.job_id != job_id:
            raise ValueError(f"the log holds jobs {job_id!r} and {event.job_id!r}: pick one")
        if event.source != CONTROLPLANE_SOURCE:
            continue
        payload = event.payload
        if event.type not in OBSERVATION_TYPES:
            recorded_decisions.append(stored)
        if isinstance(payload, GenerationStarted):
            if payload.generation not in recorded_starts:
                recorded_starts[payload.generation] = stored.recorded_at
                causes.starts.append((stored.position, payload.generation))
        elif isinstance(payload, ReallocationIssued):
            causes.commands[str(payload.command_id)] = payload.generation
        elif isinstance(payload, JobRegistered) and recorded_policy is None:
            recorded_policy = payload.policy
        elif isinstance(payload, FaultDetected):
            recorded_reasons.setdefault(str(payload.incident_id), []).append(payload.reason.value)
            for member in payload.members:
                causes.detected.setdefault(member, []).append(stored.position)
    causes.starts.sort()

    # The backup reports a catalog packs are members' events like the others.
    members = [causes.of(s) for s in unpacked(log) if s.event.source != CONTROLPLANE_SOURCE]
    notes: list[str] = []
    requested = next(
        (
            s.event.payload.policy
            for s in members
            if isinstance(s.event.payload, MemberJoined) and s.event.payload.policy is not None
        ),
        None,
    )
    base = recorded_policy or requested or JobPolicy()
    if recorded_policy is not None and requested is not None and recorded_policy != requested:
        notes.append("the recorded registration's policy differs from the one the members"
                     " asked for; the counterfactual starts from the recorded one")  # fmt: skip
    if recorded_policy is None:
        notes.append("the log has no job.registered: the counterfactual starts from the"
                     " policy the members asked for, else the defaults")  # fmt: skip
    policy = override_policy(base, overrides)
    if context is None:
        context = _first_context(log) or Context()
    beats, resolution = summary_heartbeats(log, policy)
    if beats:
        members = sorted([*members, *beats], key=lambda s: (s.recorded_at, s.position))
        notes.append(_resolution_note(policy, resolution, len(beats)))
    # The members' compute times (straggler detection) are in the summaries alone: those
    # that carry them are replayed as they are, at the times they were recorded.
    computed = [
        s
        for s in log
        if s.event.type == "liveness.summary"
        and s.event.source == CONTROLPLANE_SOURCE
        and any(seconds is not None for _, seconds in s.event.payload.computed())
    ]
    if computed:
        notes.append(
            f"compute times replayed from {len(computed)} liveness summaries (a member's"
            " sustained compute time is known at each summary's time)"
        )
    # Under ``auto`` timeouts the heartbeat gaps are in the interval summaries alone too.
    gaps = []
    if policy.heartbeat_timeout_mode == "auto":
        kept = {s.position for s in computed}
        gaps = [
            s
            for s in log
            if s.event.type == "liveness.summary"
            and s.event.source == CONTROLPLANE_SOURCE
            and s.event.payload.reason == "interval"
            and s.position not in kept
        ]
        notes.append(
            f"heartbeat gaps replayed from {len(gaps) + len(computed)} liveness summaries"
            " (each phase's auto timeout is derived at each summary's time)"
        )
    if computed or gaps:
        members = sorted([*members, *computed, *gaps], key=lambda s: (s.recorded_at, s.position))

    scripts: dict[int, list[StoredEvent]] = {}
    replay = _Replay(
        job_id=job_id,
        policy=policy,
        context=context,
        tick=tick,
        scripts=scripts,
        recorded_starts=recorded_starts,
    )
    for stored in members:
        generation = causes.script(stored)
        if generation in recorded_starts:
            scripts.setdefault(generation, []).append(stored)
        else:  # before any decision, or of a generation the recording never started
            replay.schedule(stored.recorded_at, stored)
    # After the members' last event, deadlines run up to the log's end (and on while
    # recorded answers wait for a decision the counterfactual has not made yet).
    replay.run(horizon=max(s.recorded_at for s in log))
    caused = causes.note()
    if caused:
        notes.append(caused)
    until = replay_until(recorded_decisions, replay.decisions)
    notes.append(_until_note(until))
    unplayed = sum(len(s) for s in scripts.values())
    if unplayed:
        notes.append(
            f"{unplayed} member events answered recorded decisions of generations"
            f" {sorted(scripts)} that the counterfactual never made: not replayed"
        )
    recorded = fold(None, log)
    if replay.view is None:
        raise ValueError("the log has no member events to re-decide")
    return Counterfactual(
        job_id=job_id,
        overrides=dict(overrides),
        recorded_policy=recorded_policy,
        policy=policy,
        recorded=recorded,
        replayed=replay.view,
        recorded_incidents=_facts(recorded, recorded_reasons),
        incidents=_facts(replay.view, replay.reasons),
        decisions=tuple(replay.decisions),
        member_events=replay.played,
        unplayed=unplayed,
        replay_until=until,
        notes=tuple(notes),
    )


def replay_until(
    recorded: Sequence[StoredEvent], decided: Sequence[StoredEvent]
) -> datetime | None:
    """When the counterfactual stops being a replay: the time of the first of its decisions
    that differs from the recording's (ids, payloads, times), or of the first one only one
    side made; None when it decided exactly as recorded. The job's registration is left out:
    it records the policy, which the counterfactual changes on purpose."""
    recorded = [s for s in recorded if s.event.type != "job.registered"]
    decided = [s for s in decided if s.event.type != "job.registered"]
    for r, d in itertools.zip_longest(recorded, decided):
        if r is None:
            return d.event.emitted_at
        if d is None:
            return r.event.emitted_at
        a, b = r.event, d.event
        if (a.event_id, a.type, a.emitted_at, a.payload) != (
            b.event_id, b.type, b.emitted_at, b.payload
        ):  # fmt: skip
            return min(a.emitted_at, b.emitted_at)
    return None


def _until_note(until: datetime | None) -> str:
    if until is None:
        return "a replay throughout: the counterfactual decided as recorded"
    return (
        f"a replay until {until.isoformat()}, where its decisions first differ from the"
        " recording's; a simulation after it: the members answer each decision as they"
        " answered the recorded one of the same generation, shifted with it (the recorded"
        " phase durations are the model)"
    )


# Heartbeats are soft state (core/liveness.py): a log records them only as summaries, each
# member's first and last heartbeat in a window and its largest gap. The counterfactual
# replays them as heartbeats at those times, and inside a window (between the first and the
# last, but for the largest gap) every half of the shortest limit it applies, so that no
# silence appears that the summary rules out. A silence longer than every window spans a
# window's end: its start (the last heartbeat of one window) and its end (the first of the
# next) are exact, so a timeout at or above the resolution (the longest window) is decided
# exactly. A shorter limit is not: inside a window only the largest gap is known.


def summary_heartbeats(
    log: Sequence[StoredEvent], policy: JobPolicy
) -> tuple[list[StoredEvent], float]:
    """``member.heartbeat`` events at the times the log's ``liveness.summary`` events show
    (see above), and the summaries' resolution (the longest window, in seconds)."""
    out: list[StoredEvent] = []
    resolution = 0.0
    limit = min([*_timeouts(policy), SILENCE_BEATS * policy.heartbeat_interval_s])
    fill = timedelta(seconds=limit / 2)
    #: member -> (node, incarnation) of its last join: a columnar summary lists only the
    #: view's processes, without naming them (``LivenessRow``).
    joined: dict[str, tuple[str, str]] = {}
    for stored in log:
        event = stored.event
        if event.type == "member.joined":
            node, _, member = event.source.partition("/")
            joined[member] = (node, event.incarnation)
            continue
        if event.type != "liveness.summary" or event.source != CONTROLPLANE_SOURCE:
            continue
        summary = event.payload
        if summary.since is not None:
            resolution = max(resolution, (summary.at - summary.since).total_seconds())
        for entry in summary.rows():
            node, incarnation = entry.node, entry.incarnation
            if node is None or incarnation is None:
                if entry.member not in joined:
                    continue  # never joined in this log: nothing to replay it as
                node, incarnation = joined[entry.member]
            times: set[datetime] = {entry.last_at}
            if entry.first_at is not None:
                gap_end = None
                if entry.max_gap_at is not None:
                    gap_end = entry.max_gap_at + timedelta(seconds=entry.max_gap_s)
                times.add(entry.first_at)
                cuts = [entry.first_at, entry.last_at]
                if gap_end is not None and entry.max_gap_at is not None:
                    times.update((entry.max_gap_at, gap_end))
                    if entry.first_at <= entry.max_gap_at and gap_end <= entry.last_at:
                        cuts = [entry.first_at, entry.max_gap_at, gap_end, entry.last_at]
                for start, end in zip(cuts[::2], cuts[1::2], strict=True):
                    at = start + fill
                    while at < end:
                        times.add(at)
                        at += fill
            for n, at in enumerate(sorted(times), start=1):
                out.append(
                    StoredEvent(
                        stored.position,
                        at,
                        MemberHeartbeatEvent(
                            event_id=str(
                                uuid.uuid5(_SUMMARY_BEATS, f"{event.event_id}/{entry.member}/{n}")
                            ),
                            job_id=event.job_id,
                            type="member.heartbeat",
                            v=1,
                            source=f"{node}/{entry.member}",
                            incarnation=incarnation,
                            seq=n,
                            generation=entry.generation,
                            emitted_at=at,
                            payload=MemberHeartbeat(step=0, phase=entry.phase),
                        ),
                    )
                )
    return out, resolution


_SUMMARY_BEATS = uuid.UUID("5f0c2d7e-8a41-4c55-9a43-0b7f3b1d2c10")


def _timeouts(policy: JobPolicy) -> list[float]:
    """The heartbeat timeouts ``policy`` may apply (under ``auto``, down to its floor)."""
    fixed = list(policy.heartbeat_timeout_s.values())
    if policy.heartbeat_timeout_mode == "auto":
        fixed.extend(policy.heartbeat_floor(phase) for phase in Phase)
    return fixed


def _resolution_note(policy: JobPolicy, resolution: float, beats: int) -> str:
    shortest = min(_timeouts(policy))
    said = (
        f"heartbeats replayed from liveness summaries ({beats} heartbeats at the times they"
        f" show; resolution {resolution:g}s, the longest window)"
    )
    if shortest >= resolution:
        return (
            f"{said}: exact for the heartbeat timeouts (the shortest, {shortest:g}s, is at or"
            f" above it); a peer's report corroborated by silence"
            f" ({SILENCE_BEATS} intervals of {policy.heartbeat_interval_s:g}s) and the phase"
            " between summaries are modelled"
        )
    return (
        f"{said}: NOT exact for a heartbeat timeout of {shortest:g}s, below the resolution:"
        " inside a window only each member's largest gap is known, so a shorter silence"
        " there is not replayed"
    )


def _facts(view: JobView, reasons: Mapping[str, list[str]]) -> tuple[IncidentFacts, ...]:
    incidents = sorted(view.incidents.values(), key=lambda i: i.opened_position)
    return tuple(incident_facts(i, reasons.get(i.incident_id, ())) for i in incidents)


def _first_context(log: Sequence[StoredEvent]) -> Context | None:
    for stored in log:
        if stored.event.type == "generation.started":
            return _recorded_context([stored])
    return None
