"""Goodput accounting: where a job's wall time went, derived from its log alone.

A job's wall time, from its registration to its end (or ``now``), is cut into disjoint
pieces, each of one term (docs/design.md, "Goodput accounting", defines each by the events
that bound it):

- ``detection``, ``decision``, ``restore`` (ack and restore), ``resume``: an incident's
  window, fault to the first step of the new generation, cut at its timeline's points
  (``core.timeline``); these take precedence over any other term;
- ``waiting``: the registration to the first step of the job (members joining, the first
  group forming, the first build and step);
- ``recomputation``: a generation's steps at or below the highest step an older generation
  reported (work a restore to an older backup made it do again);
- ``productive``: a generation's steps beyond that;
- ``backup``: the copy of each backup into CPU memory, which blocks the loop (the ranks'
  ``backup.snapshot`` ``seconds``, the slowest rank's per backup), taken out of the training
  time it lies in;
- ``stragglers``: the step time the job waited for members the control plane recorded slow
  (``member.slow``): each step of the generation waits ``compute - baseline`` for the slowest
  of them (their sustained compute times, from ``member.slow`` and the ``liveness.summary``
  compute columns after it), taken out of the training time it lies in;
- ``idle``: the rest (a world's time after its last step until its fault or the job's end).

``GoodputCounter`` counts what the view does not keep (each generation's first and last step
records, where it passed the older generations' highest step, its backups' copy time, the
steps its slow members held up) from stored events, in log order; ``goodput(view, counter,
now)`` makes the breakdown. Pure: no I/O, no clock.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, NamedTuple

from controlplane.core.records import StoredEvent
from controlplane.core.timeline import timeline
from controlplane.core.view import JobView
from schemas.common import CONTROLPLANE_SOURCE, JobState

#: The terms of the breakdown, in the order they are shown.
TERMS: Final = (
    "productive",
    "recomputation",
    "backup",
    "stragglers",
    "detection",
    "decision",
    "restore",
    "resume",
    "waiting",
    "idle",
)
#: The terms of an incident's window, in its timeline's order.
INCIDENT_TERMS: Final = ("detection", "decision", "restore", "resume")
#: The event types a counter reads (a reader may fetch only these; ``goodput_types``).
GOODPUT_TYPES: Final = (
    "generation.started",
    "train.step",
    "backup.snapshot",
    "backup.catalog",
    "member.slow",
    "liveness.summary",
)
#: What the log does not carry, so the breakdown does not count it.
NOT_MEASURED: Final = (
    "backup: only the copy of each rank's own state into CPU memory is measured (its"
    " backup.snapshot seconds); the copy of the state every rank has alike and the"
    " replication to peers, which run beside the steps, show as longer steps",
    "stragglers: only members the control plane recorded slow (member.slow) count, from the"
    " detection window before their record on; the time a step waits for them is taken from"
    " their sustained compute times (the least per-heartbeat mean over the window) at the"
    " liveness summaries' resolution, and the step a window began at from step records kept"
    " at 1-s resolution; a member slower than its peers but never recorded slow counts as"
    " productive",
)
#: Step records a generation keeps to find the step it was at a detection window before a
#: ``member.slow`` (at most one a second: an hour's).
RECENT_STEPS: Final = 3600
_RECENT_EVERY: Final = timedelta(seconds=1)
_TERMINAL: Final = (JobState.COMPLETED, JobState.STOPPED)


def goodput_types(slowed: bool) -> tuple[str, ...]:
    """The event types a counter needs of a job: the liveness summaries only when a member of
    it was recorded slow (``slowed``: ``JobView.slow`` is not empty): without one they count
    nothing, and they are most of a large job's log."""
    return GOODPUT_TYPES if slowed else tuple(t for t in GOODPUT_TYPES if t != "liveness.summary")


class StepAt(NamedTuple):
    """A step and when its record was stored."""

    step: int
    at: datetime


@dataclass(slots=True)
class GenerationSteps:
    """What a generation's step and backup records tell, counted in log order."""

    generation: int
    #: When its ``generation.started`` was recorded.
    started_at: datetime | None = None
    #: The highest step an older generation reported before this one's first step (None:
    #: none did): this one's steps at or below it are recomputation.
    high_before: int | None = None
    first: StepAt | None = None
    last: StepAt | None = None
    #: Its last step record at or below ``high_before``, and its first one above it.
    below: StepAt | None = None
    above: StepAt | None = None
    #: The backups' copy seconds (the slowest rank's per step) after a step at or below
    #: ``high_before`` (in recomputation) and after a later one (in productive time).
    backup_recompute_s: float = 0.0
    backup_productive_s: float = 0.0
    #: The newest backup step and its slowest copy so far (not yet added above: it may be
    #: after the generation's last step, in its idle tail).
    pending: tuple[int, float] | None = None
    #: Its members the control plane recorded slow: member -> (baseline, threshold, excess:
    #: the seconds each step waits for it now, 0 once a summary found it under the threshold).
    slow: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    #: The step record the stragglers' seconds are counted up to (``stragglers_*_s``).
    mark: StepAt | None = None
    #: The seconds its steps waited for slow members up to ``mark``, at or below
    #: ``high_before`` (in recomputation) and beyond it (in productive time).
    stragglers_recompute_s: float = 0.0
    stragglers_productive_s: float = 0.0
    #: Its recent step records, at most one a second (``RECENT_STEPS``; emptied once a newer
    #: generation steps: a ``member.slow`` is of the current generation).
    recent: deque[StepAt] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def _step(self, step: int, at: datetime, high: int | None, keep: bool = True) -> None:
        if self.first is None:
            self.first = self.last = StepAt(step, at)
            self.high_before = high
        elif self.last is not None and step > self.last.step:
            self.last = StepAt(step, at)
        else:
            return  # another member's record of a step already counted
        recent = self.recent
        if keep and (not recent or at - recent[-1].at >= _RECENT_EVERY):
            recent.append(self.last)
        h = self.high_before
        if h is not None:
            if step <= h:
                self.below = StepAt(step, at)
            elif self.above is None:
                self.above = StepAt(step, at)

    def _backup(self, step: int, seconds: float) -> None:
        pending = self.pending
        if pending is None or step > pending[0]:
            if pending is not None:
                self._commit(*pending)
            self.pending = (step, seconds)
        elif step == pending[0] and seconds > pending[1]:
            self.pending = (step, seconds)

    def _commit(self, step: int, seconds: float) -> None:
        if self.high_before is not None and step < self.high_before:
            self.backup_recompute_s += seconds
        else:
            self.backup_productive_s += seconds

    def _excess(self) -> float:
        """The seconds each step waits for its slow members now (for the slowest)."""
        return max((e for _, _, e in self.slow.values()), default=0.0)

    def _split(self, step: float, at: datetime, to: StepAt, excess: float) -> tuple[float, float]:
        """(recomputation, productive): the seconds the steps after ``step`` (at ``at``) up to
        ``to`` waited at ``excess`` a step, at most the time between them, split at
        ``high_before`` in proportion of the steps."""
        steps = to.step - step
        if steps <= 0 or excess <= 0:
            return 0.0, 0.0
        seconds = min(steps * excess, _span(at, to.at))
        h = self.high_before
        below = 0.0 if h is None else min(max(h - step, 0.0), steps)
        redo = seconds * below / steps
        return redo, seconds - redo

    def _count(self, step: float, at: datetime, to: StepAt, excess: float) -> None:
        redo, made = self._split(step, at, to, excess)
        self.stragglers_recompute_s += redo
        self.stragglers_productive_s += made

    def _advance(self) -> None:
        """Count the steps since ``mark`` at the current excess, and mark the last one."""
        start, last = self.mark or self.first, self.last
        if last is None:
            return
        if start is not None and self.slow:
            self._count(start.step, start.at, last, self._excess())
        self.mark = last

    def _step_at(self, when: datetime) -> tuple[float, datetime]:
        """The step it was at ``when`` (interpolated between its records around it; its
        oldest record kept when ``when`` is before it), and that record's time or ``when``."""
        recent, last = self.recent, self.last
        assert last is not None
        if not recent:
            return last.step, last.at
        i = bisect_right(recent, when, key=lambda r: r.at)
        if i == 0:
            return recent[0].step, recent[0].at
        a = recent[i - 1]
        b = recent[i] if i < len(recent) else last
        if b.at <= a.at or b.step <= a.step:
            return a.step, a.at
        if when >= b.at:
            return b.step, b.at
        return a.step + (b.step - a.step) * ((when - a.at) / (b.at - a.at)), when

    def _slow_member(
        self, member: str, compute: float, baseline: float, threshold: float, since: datetime
    ) -> None:
        """A ``member.slow``: each step since ``since`` (its detection window's start) waited
        ``compute - baseline`` for it (what more than for the members already slow)."""
        self._advance()
        excess = max(0.0, compute - baseline)
        more = excess - self._excess()
        last = self.last
        if last is not None and more > 0:
            step, at = self._step_at(since)
            self._count(step, at, last, more)
        self.slow[member] = (baseline, threshold, excess)

    def _computed(self, values: dict[str, float]) -> None:
        """A summary's sustained compute times of slow members: the steps since ``mark``
        waited at the excess before it, and each one's excess is its new value's."""
        self._advance()
        slow = self.slow
        for member, value in values.items():
            base, threshold, _ = slow[member]
            slow[member] = (base, threshold, value - base if value > threshold else 0.0)

    def stragglers(self) -> tuple[float, float]:
        """The seconds its steps waited for slow members, in recomputation and in productive
        time (to its last step, at the current excess after ``mark``)."""
        redo, made = self.stragglers_recompute_s, self.stragglers_productive_s
        start, last = self.mark or self.first, self.last
        if self.slow and start is not None and last is not None:
            more_redo, more_made = self._split(start.step, start.at, last, self._excess())
            redo, made = redo + more_redo, made + more_made
        return redo, made

    def backups(self) -> tuple[float, float, float]:
        """Its backups' copy seconds in recomputation, in productive time, and after its
        last step (in its idle tail)."""
        redo, made, tail = self.backup_recompute_s, self.backup_productive_s, 0.0
        if self.pending is not None:
            step, copy = self.pending
            if self.last is not None and step >= self.last.step:
                tail = copy
            elif self.high_before is not None and step < self.high_before:
                redo += copy
            else:
                made += copy
        return redo, made, tail

    def recompute_until(self) -> datetime | None:
        """When it finished its last step at or below ``high_before`` (its first step's
        record when it had none beyond it; interpolated between its records around it when
        the record of that step is missing)."""
        first, last, h = self.first, self.last, self.high_before
        if first is None or last is None:
            return None
        if h is None or first.step > h:
            return first.at
        if last.step <= h:
            return last.at
        below, above = self.below or first, self.above or last
        if below.step >= h or above.step <= below.step:
            return below.at
        fraction = (h - below.step) / (above.step - below.step)
        return below.at + (above.at - below.at) * fraction

    def steps(self, skip: Sequence[tuple[int, int]] = ()) -> tuple[int, int]:
        """(productive, recomputed): its step numbers beyond and at or below
        ``high_before``, less those it skipped (``skip``: the ranges its loop did not run)."""
        if self.first is None or self.last is None:
            return 0, 0
        lo, hi, h = self.first.step, self.last.step, self.high_before
        if h is None or lo > h:
            return hi - lo + 1 - _within(skip, lo, hi), 0
        return (
            max(0, hi - h) - _within(skip, h + 1, hi),
            min(hi, h) - lo + 1 - _within(skip, lo, min(hi, h)),
        )


def _within(skip: Sequence[tuple[int, int]], lo: int, hi: int) -> int:
    """How many steps of ``skip``'s ranges lie in ``[lo, hi]``."""
    return sum(max(0, min(b, hi) - max(a, lo) + 1) for a, b in skip)


@dataclass(slots=True)
class GoodputCounter:
    """Each generation's step and backup records, counted from a job's events in log order."""

    generations: dict[int, GenerationSteps] = field(default_factory=dict)
    #: The generations with a member recorded slow (their summaries are read).
    slowed: set[int] = field(default_factory=set)
    #: The newest generation that stepped (the one keeping recent step records).
    newest: int | None = None

    def _of(self, generation: int) -> GenerationSteps:
        found = self.generations.get(generation)
        if found is None:
            found = self.generations[generation] = GenerationSteps(generation)
        return found

    def _high_before(self, generation: int) -> int | None:
        steps = [
            g.last.step
            for n, g in self.generations.items()
            if n < generation and g.last is not None
        ]
        return max(steps) if steps else None

    def count(self, events: Iterable[StoredEvent], ignored: frozenset[int] = frozenset()) -> None:
        """Count ``events`` (of one job, in log order, after those counted); a step at a
        position in ``ignored`` (the fold did not believe it) is not counted."""
        for stored in events:
            event = stored.event
            kind = event.type
            if kind == "train.step":
                if ignored and stored.position in ignored:
                    continue
                n = event.generation
                g = self._of(n)
                high = None
                if g.first is None:
                    high = self._high_before(n)
                    newest = self.newest
                    if newest is None or n > newest:
                        if newest is not None:
                            self._of(newest).recent.clear()
                        self.newest = n
                g._step(event.payload.step, stored.recorded_at, high, n == self.newest)
            elif kind == "generation.started":
                g = self._of(event.payload.generation)
                if g.started_at is None:
                    g.started_at = stored.recorded_at
            elif kind == "backup.snapshot":
                self._of(event.generation)._backup(event.payload.step, event.payload.seconds)
            elif kind == "backup.catalog":
                seconds = event.payload.columns().seconds
                if seconds:
                    self._of(event.generation)._backup(event.payload.step, max(seconds))
            elif kind == "member.slow":
                if event.source == CONTROLPLANE_SOURCE:
                    p = event.payload
                    self.slowed.add(event.generation)
                    window = timedelta(seconds=p.window_s)
                    since = (p.evidence.at or stored.recorded_at) - window
                    self._of(event.generation)._slow_member(
                        p.member, p.compute_s, p.baseline_s, p.threshold_s, since
                    )
            elif kind == "liveness.summary" and self.slowed and event.source == CONTROLPLANE_SOURCE:
                self._summary(event.payload)

    def _summary(self, p: Any) -> None:
        """A summary part's sustained compute times of members recorded slow in their
        generation (a part lists up to 16k members: one pass over its columns)."""
        if p.compute_window_ms is None:
            return
        slowed, generations = self.slowed, self.generations
        found: dict[int, dict[str, float]] = {}
        columns = p.columns
        if columns is not None and columns.compute_ms is not None:
            for member, n, ms in zip(
                columns.members, columns.generation, columns.compute_ms, strict=True
            ):
                if ms is not None and n in slowed and member in generations[n].slow:
                    found.setdefault(n, {})[member] = ms / 1000
        regular = p.regular
        if regular is not None and regular.compute_ms is not None and regular.generation in slowed:
            n = regular.generation
            slow = generations[n].slow
            for member, ms in zip(regular.members, regular.compute_ms, strict=True):
                if ms is not None and member in slow:
                    found.setdefault(n, {})[member] = ms / 1000
        for n, values in found.items():
            generations[n]._computed(values)


@dataclass(frozen=True, slots=True)
class IncidentCost:
    """What one incident cost the job."""

    incident_id: str
    kind: str
    outcome: str | None
    #: detection, decision, restore, resume: its window's seconds.
    phases: dict[str, float]
    #: The recomputation of the generation its last decision started.
    recomputation_s: float
    steps_lost: int | None
    #: Its window and its recomputation, in seconds.
    cost_s: float
    #: ``cost_s`` over the job's wall time: the part of the ETTR it took away.
    ettr_lost: float


@dataclass(frozen=True, slots=True)
class GenerationGoodput:
    """One generation: from its ``generation.started`` to the next one's (or the end)."""

    generation: int
    started_at: datetime
    ended_at: datetime
    wall_s: float
    seconds: dict[str, float]
    productive_steps: int
    recomputed_steps: int
    ettr: float | None
    goodput_steps_per_s: float | None


@dataclass(frozen=True, slots=True)
class Goodput:
    """A job's wall time by term, and per incident and per generation."""

    job_id: str
    started_at: datetime
    ended_at: datetime
    #: The job ended (completed or stopped): ``ended_at`` is its end, not the time asked.
    final: bool
    wall_s: float
    seconds: dict[str, float]
    #: productive / wall.
    ettr: float | None
    #: Steps of the job's timeline made productively (each step once), and steps redone.
    productive_steps: int
    recomputed_steps: int
    #: Productive steps per second of wall time.
    goodput_steps_per_s: float | None
    incidents: tuple[IncidentCost, ...]
    generations: tuple[GenerationGoodput, ...]
    not_measured: tuple[str, ...] = NOT_MEASURED


class _Piece(NamedTuple):
    start: datetime
    end: datetime
    term: str
    #: Backup copy seconds and seconds waiting for slow members inside it (training pieces
    #: only).
    backup: float = 0.0
    stragglers: float = 0.0
    incident: str | None = None
    generation: int | None = None


def _span(a: datetime, b: datetime) -> float:
    return max(0.0, (b - a).total_seconds())


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _windows(view: JobView, t0: datetime, t1: datetime) -> list[_Piece]:
    """Each incident's window cut at its points, in order, never overlapping."""
    pieces: list[_Piece] = []
    cursor = t0
    for incident in view.incidents.values():
        line = timeline(incident)
        points = line.points
        if incident.resolved_at is not None and points["first_step"] is None:
            end = incident.resolved_at  # closed without a first step: stopped
        else:
            end = t1
        fault = points["fault"]
        assert fault is not None
        start = min(max(fault.at, cursor), t1)
        marks = (points["detected"], points["decided"], points["restored"], points["first_step"])
        for term, mark in zip(INCIDENT_TERMS, marks, strict=True):
            stop = min(max(mark.at if mark is not None else end, start), t1)
            pieces.append(_Piece(start, stop, term, incident=incident.incident_id))
            start = stop
            if mark is None:
                break
        cursor = start
    return pieces


def _without(piece: _Piece, windows: Sequence[_Piece]) -> list[_Piece]:
    """``piece`` less every window, its backup and stragglers seconds shared in proportion."""
    parts = [(piece.start, piece.end)]
    for w in windows:
        if w.end <= piece.start or w.start >= piece.end:
            continue
        parts = [
            part
            for a, b in parts
            for part in ((a, min(b, w.start)), (max(a, w.end), b))
            if part[1] > part[0]
        ]
    whole = _span(piece.start, piece.end)

    def share(seconds: float, a: datetime, b: datetime) -> float:
        return seconds * _span(a, b) / whole if whole else 0.0

    return [
        piece._replace(
            start=a,
            end=b,
            backup=share(piece.backup, a, b),
            stragglers=share(piece.stragglers, a, b),
        )
        for a, b in parts
    ]


def _sum(pieces: Iterable[_Piece], lo: datetime, hi: datetime) -> dict[str, float]:
    """Seconds by term of ``pieces`` within ``[lo, hi]``."""
    out = dict.fromkeys(TERMS, 0.0)
    for p in pieces:
        a, b = max(p.start, lo), min(p.end, hi)
        length = _span(a, b)
        if not length:
            continue
        whole = _span(p.start, p.end)
        # Both taken out of the piece, together at most its length.
        backup = min(length, p.backup * length / whole) if p.backup else 0.0
        slow = min(length - backup, p.stragglers * length / whole) if p.stragglers else 0.0
        out[p.term] += length - backup - slow
        out["backup"] += backup
        out["stragglers"] += slow
    return out


def goodput(view: JobView, counter: GoodputCounter, now: datetime) -> Goodput | None:
    """The breakdown of ``view``'s job at ``now`` (None before it was registered)."""
    t0 = view.registered_at
    if t0 is None:
        return None
    ended = next((c.at for c in view.history if c.to_state in _TERMINAL), None)
    t1 = max(t0, ended if ended is not None else now)
    windows = _windows(view, t0, t1)
    gens = sorted(counter.generations.values(), key=lambda g: g.generation)
    stepped = [g for g in gens if g.first is not None and g.last is not None]
    others: list[_Piece] = []
    first_step = min((g.first.at for g in stepped if g.first is not None), default=t1)
    others.append(_Piece(t0, min(first_step, t1), "waiting"))
    cursor = first_step
    for g in stepped:
        assert g.first is not None and g.last is not None
        split = g.recompute_until()
        assert split is not None
        a = min(max(g.first.at, cursor), t1)
        b = min(max(split, a), t1)
        c = min(max(g.last.at, b), t1)
        redo, made, _ = g.backups()
        slow_redo, slow_made = g.stragglers()
        others.append(_Piece(a, b, "recomputation", redo, slow_redo, generation=g.generation))
        others.append(_Piece(b, c, "productive", made, slow_made, generation=g.generation))
        cursor = c
    pieces = list(windows)
    for piece in others:
        pieces.extend(_without(piece, windows))
    pieces.sort(key=lambda p: p.start)
    idle: list[_Piece] = []
    at = t0
    for p in pieces:
        if p.start > at:
            idle.append(_Piece(at, p.start, "idle"))
        at = max(at, p.end)
    if t1 > at:
        idle.append(_Piece(at, t1, "idle"))
    pieces.extend(idle)

    def tail_moved(seconds: dict[str, float], lo: datetime, hi: datetime) -> dict[str, float]:
        # A backup after a generation's last step lies in its idle tail.
        for g in stepped:
            assert g.last is not None
            if not lo <= g.last.at < hi:
                continue
            tail = g.backups()[2]
            moved = min(seconds["idle"], tail)
            seconds["idle"] -= moved
            seconds["backup"] += moved
        return seconds

    wall = _span(t0, t1)
    seconds = tail_moved(_sum(pieces, t0, t1), t0, t1)
    # The steps each generation's loop skipped (a rollback's), as its decision says.
    skips = {d.generation: d.skip for i in view.incidents.values() for d in i.decisions}
    counts = {g.generation: g.steps(skips.get(g.generation, ())) for g in gens}
    productive_steps = sum(counts[g.generation][0] for g in stepped)
    recomputed_steps = sum(counts[g.generation][1] for g in stepped)

    generations = []
    for n, g in enumerate(gens):
        if g.started_at is None:
            continue
        later = [x.started_at for x in gens[n + 1 :] if x.started_at is not None]
        lo, hi = max(g.started_at, t0), min(later[0] if later else t1, t1)
        span = _span(lo, hi)
        by_term = tail_moved(_sum(pieces, lo, hi), lo, hi)
        made, redone = counts[g.generation]
        generations.append(
            GenerationGoodput(
                generation=g.generation,
                started_at=lo,
                ended_at=max(lo, hi),
                wall_s=span,
                seconds=by_term,
                productive_steps=made,
                recomputed_steps=redone,
                ettr=_ratio(by_term["productive"], span),
                goodput_steps_per_s=_ratio(made, span),
            )
        )

    incidents = []
    for incident in view.incidents.values():
        phases = dict.fromkeys(INCIDENT_TERMS, 0.0)
        for p in windows:
            if p.incident == incident.incident_id:
                phases[p.term] += _span(p.start, p.end)
        redo = 0.0
        if incident.decisions:
            issued = incident.decisions[-1].generation
            redo = sum(
                _sum([p], t0, t1)["recomputation"]
                for p in pieces
                if p.term == "recomputation" and p.generation == issued
            )
        cost = sum(phases.values()) + redo
        incidents.append(
            IncidentCost(
                incident_id=incident.incident_id,
                kind=incident.kind,
                outcome=incident.outcome,
                phases=phases,
                recomputation_s=redo,
                steps_lost=timeline(incident).steps_lost,
                cost_s=cost,
                ettr_lost=_ratio(cost, wall) or 0.0,
            )
        )
    return Goodput(
        job_id=view.job_id,
        started_at=t0,
        ended_at=t1,
        final=ended is not None,
        wall_s=wall,
        seconds=seconds,
        ettr=_ratio(seconds["productive"], wall),
        productive_steps=productive_steps,
        recomputed_steps=recomputed_steps,
        goodput_steps_per_s=_ratio(productive_steps, wall),
        incidents=tuple(incidents),
        generations=tuple(generations),
    )
