"""Liveness as soft state: the heartbeats the control plane heard, kept in memory.

Members heartbeat on NATS core subjects (``elastic.hb.<job>.<node>.<member>``), several times
a second, and no heartbeat is written to the log. The leader keeps, per job and member, the
last heartbeat it heard (the time it received it, by its own clock), what it reported
(phase, step, generation) and, over the current *window* (since the job's last
``liveness.summary``), the first heartbeat, the number of beats, the largest gap between
two of them and the longest step it reported (the log's per-rank compute times: no row per
rank per step is stored).

The table is whole again within one timeout after a restart or a takeover: it starts empty,
and every member active in the log counts as heard at the table's start (``assumed``), so a
member is found silent one timeout after that at the earliest, and a live one is heard long
before. The same holds after the heartbeats' connection came back (``resume``).

The decider reads the table through a *probe* (``probe``): the job's view with the table's
liveness in its ``heartbeats`` (a copy: the view itself, the log's, is never changed), on
which it asks ``decide`` whether anything is due and ``next_deadline`` when to look again.
Before any decision is recorded, ``summarize`` turns the table into ``liveness.summary``
events, appended first; the decision is then taken on the view that folded them, which is
what a replay of the log folds: re-deciding from the log reproduces it. A summary names the
members heard regularly through its window (``RegularMembers``: the fold gives each the
window's end less a bound of two heartbeat intervals) and lists the others in full; a
decision's summary names them too when that bound is shorter than every threshold a
decision applies (each phase's timeout, the silence that corroborates a peer's report), so
a named member is as alive on the folded view as it is in the table, and lists every member
in full otherwise. Between decisions a summary is recorded every
``liveness_summary_interval_s``: the log then knows each member's liveness at that
resolution (the API's last heartbeat, a counterfactual timeout).

The table keeps times on the millisecond (a heartbeat's arrival is rounded down to it), the
resolution of a summary's columns, and counts them in whole milliseconds (a beat costs
integer arithmetic, and a summary's columns are differences of them): the fold of a summary
gives the view exactly the times the table held.

Pure: times are arguments; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import operator
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import NamedTuple

from controlplane.core.detect import heartbeat_timeout, silence_limit
from controlplane.core.straggler import MIN_SAMPLES
from controlplane.core.view import Computed, Heartbeat, JobView, MemberStatus, Progress
from schemas.common import MAX_WORLD, Phase
from schemas.events import (
    SUMMARY_COLUMN_MEMBERS,
    LivenessColumns,
    LivenessSummary,
    RegularMembers,
    ms_of,
)

#: An interval summary names a member only (``RegularMembers``) when no silence of its in
#: the window was longer than this many heartbeat intervals.
REGULAR_BEATS = 2
#: The ``evidence`` of a probe's heartbeat: the table's, not yet in the log.
TABLE = "liveness.table"
_ACTIVE = MemberStatus.ACTIVE
#: ``Heartbeat``'s constructor without its keyword-taking wrapper (one call per beat).
_mark = tuple.__new__


def on_the_ms(at: datetime) -> datetime:
    """``at`` rounded down to the millisecond (the resolution of a summary)."""
    extra = at.microsecond % 1000
    return at.replace(microsecond=at.microsecond - extra) if extra else at


class Beats(NamedTuple):
    """The heartbeats of one message, validated and bound to the subject it came on, a list
    per field: one member's own (``age_ms`` 0), or its node's launcher's (``node.heartbeat``),
    which heard each ``age_ms`` before sending."""

    job_id: str
    node: str
    members: list[str]
    incarnation: list[str]
    generation: list[int]
    step: list[int]
    phase: list[Phase]
    #: The longest step each member finished since its previous heartbeat, milliseconds.
    step_ms: list[int]
    age_ms: list[int]
    #: The mean compute time of each member's steps since its previous heartbeat,
    #: milliseconds (None: none; the column None: a sender that reports none).
    compute_ms: list[int | None] | None = None
    #: Each member's milliseconds since its last step and since the next step's gradients
    #: were ready (None: none; the column None: a sender that reports none).
    since_step_ms: list[int | None] | None = None
    ready_ms: list[int | None] | None = None

    def source(self, i: int) -> str:
        return f"{self.node}/{self.members[i]}"


@dataclass(slots=True)
class Heard:
    """What the table heard of one member (its process ``incarnation``); times in whole
    milliseconds since the Unix epoch (``last_at`` is ``last_ms`` as a time)."""

    node: str
    incarnation: str
    generation: int
    phase: Phase
    step: int
    last_at: datetime
    last_ms: int
    #: Not heard since the table started (or since the heartbeats came back): counted as
    #: heard then.
    assumed: bool = False
    #: The window the statistics below are of (``LivenessTable``'s count of the job's
    #: summaries): older ones are reset on the member's next beat, not all at once.
    window: int = 0
    #: The current window: its first heartbeat, beats, largest gap and when that began.
    first_ms: int | None = None
    beats: int = 0
    max_gap_ms: int = 0
    max_gap_at_ms: int | None = None
    #: The phase the member was in when that gap began (its last heartbeat's before it).
    max_gap_phase: Phase | None = None
    max_step_ms: int = 0
    #: Compute times (straggler detection): the generation the samples are of, the first
    #: and the last heartbeat of the unbroken run that carried one, the times of those in
    #: the window, the window's running minimum (a deque of increasing values), and the
    #: sustained value (the window's least, once the run covers the window: None before).
    compute_generation: int = -1
    compute_since_ms: int | None = None
    compute_last_ms: int | None = None
    compute_times: deque[int] | None = None
    compute_mins: deque[tuple[int, int]] | None = None
    sustained_ms: int | None = None
    #: Its last heartbeat's milliseconds since its last step, and since the next step's
    #: gradients were ready (None: none): a stalled step's evidence (``core/stall.py``).
    since_step_ms: int | None = None
    ready_ms: int | None = None

    def progress(self, position: int | None = None) -> Progress:
        """Where it was in its steps at its last heartbeat (``JobView.progress``)."""
        since, ready = self.since_step_ms, self.ready_ms
        return Progress(
            self.step, self.generation, self.last_at, None if since is None else since / 1000,
            None if ready is None else ready / 1000, position,
        )  # fmt: skip

    def _computed(self, ms: int, generation: int, value: int | None, window_ms: int) -> bool:
        """A heartbeat's compute time (``value``, None: none) heard at ``ms``; whether the
        sustained value is known (``sustained_ms``)."""
        if generation != self.compute_generation:
            self._forget_compute()
            self.compute_generation = generation
        if value is None:
            last = self.compute_last_ms
            if last is not None and ms - last > window_ms:
                self._forget_compute()  # no step finished over a window: the run broke
            return self.sustained_ms is not None
        times, mins = self.compute_times, self.compute_mins
        if times is None or mins is None:
            times, mins = self.compute_times, self.compute_mins = deque(), deque()
            self.compute_since_ms = ms
        self.compute_last_ms = ms
        times.append(ms)
        while mins and mins[-1][1] >= value:
            mins.pop()
        mins.append((ms, value))
        cutoff = ms - window_ms
        while times[0] < cutoff:
            times.popleft()
        while mins[0][0] < cutoff:
            mins.popleft()
        since = self.compute_since_ms
        covered = since is not None and since <= cutoff and len(times) >= MIN_SAMPLES
        self.sustained_ms = mins[0][1] if covered else None
        return covered

    def _forget_compute(self) -> None:
        self.compute_since_ms = self.compute_last_ms = self.sustained_ms = None
        self.compute_times = self.compute_mins = None

    def _open(self, window: int) -> None:
        """Start ``window``'s statistics (a summary ended the previous one)."""
        self.window = window
        self.first_ms = None
        self.beats = 0
        self.max_gap_ms = 0
        self.max_gap_at_ms = None
        self.max_gap_phase = None
        self.max_step_ms = 0

    def _beat(self, at: datetime, ms: int, step: int, phase: Phase, step_ms: int) -> None:
        """One more heartbeat of the same process, heard at ``at`` (``ms``), not before the
        last one (the caller checks)."""
        if self.assumed:
            self.assumed = False  # the assumed time was no heartbeat: no gap from it
        else:
            gap = ms - self.last_ms
            if gap > self.max_gap_ms:
                self.max_gap_ms = gap
                self.max_gap_at_ms = self.last_ms
                self.max_gap_phase = self.phase  # the phase it went silent in
        self.last_at = at
        self.last_ms = ms
        if self.first_ms is None:
            self.first_ms = ms
        self.beats += 1
        self.phase = phase
        # Compared, not max(): every beat runs this, and the call costs more.
        if step > self.step:  # noqa: PLR1730
            self.step = step
        if step_ms > self.max_step_ms:  # noqa: PLR1730
            self.max_step_ms = step_ms


def take_beats(table: LivenessTable, view: JobView | None, beats: Beats, at: datetime) -> list[str]:
    """Take the validated ``beats`` of one message that arrived at ``at`` (on the ms) into
    ``table``: each only from its member's current process (its joined incarnation, on the
    node the message is bound to, not a fenced one beating in an older generation), heard
    its ``age_ms`` before ``at``. Why each beat not taken was not."""
    job_id, node = beats.job_id, beats.node
    if view is None:  # (every beat of a job not registered yet: one reason, counted per beat)
        return [f"never joined: {node}'s members of job {job_id}"] * len(beats.members)
    members, generation = view.members, view.generation
    heard_by = table._member_table(job_id)
    marks = table._marks_of(job_id)
    window = table._window_count(job_id)
    window_ms = round(view.effective_policy.slow_window_s * 1000)
    computes = beats.compute_ms
    computed = table._computed_of(job_id) if window_ms > 0 else None
    sinces, readies = beats.since_step_ms, beats.ready_ms
    progress = table._progress_of(job_id) if sinces is not None or readies is not None else None
    at = on_the_ms(at)
    arrived_ms = ms_of(at)
    stats = table.stats
    refused: list[str] = []
    incarnations, generations, ages = beats.incarnation, beats.generation, beats.age_ms
    steps, phases, step_mss = beats.step, beats.phase, beats.step_ms
    for i, member_id in enumerate(beats.members):
        member = members.get(member_id)
        incarnation = incarnations[i]
        if member is None:
            refused.append(f"never joined: {beats.source(i)} of job {job_id}")
            continue
        if member.incarnation != incarnation:
            refused.append(
                f"stale_incarnation: {incarnation} of {beats.source(i)}, which joined"
                f" as {member.incarnation}"
            )
            continue
        if member.node != node:
            refused.append(f"forged node: {member_id} joined on {member.node}, not {node}")
            continue
        beat_generation = generations[i]
        if beat_generation < generation and member.status is not _ACTIVE:
            # A fenced member resumed (SIGCONT), beating in the world it was left out of.
            refused.append(
                f"stale_generation: {beats.source(i)} beats in generation"
                f" {beat_generation}, left out of generation {generation}"
            )
            continue
        age = ages[i]
        ms, when = (arrived_ms - age, at - timedelta(milliseconds=age)) if age else (arrived_ms, at)
        heard = heard_by.get(member_id)
        stats.heard += 1
        phase = phases[i]
        if heard is None or heard.incarnation != incarnation:
            heard_by[member_id] = _first(
                node, incarnation, beat_generation, phase, steps[i], when, ms, step_mss[i],
                window,
            )  # fmt: skip
            heard = heard_by[member_id]
        elif ms < heard.last_ms:
            stats.reordered += 1
            continue
        else:
            if heard.window != window:
                heard._open(window)
            heard.generation = beat_generation
            heard._beat(when, ms, steps[i], phase, step_mss[i])
        marks[member_id] = _mark(Heartbeat, (when, None, TABLE, phase))
        if computed is not None:
            value = None if computes is None else computes[i]
            _mark_compute(computed, member_id, heard, ms, when, value, window_ms)
        if progress is not None:
            heard.since_step_ms = None if sinces is None else sinces[i]
            heard.ready_ms = None if readies is None else readies[i]
            progress[member_id] = heard.progress()
        elif heard.since_step_ms is not None or heard.ready_ms is not None:
            heard.since_step_ms = heard.ready_ms = None
            table._progress_of(job_id).pop(member_id, None)
    return refused


def _mark_compute(  # noqa: PLR0917  (one call per beat)
    computed: dict[str, Computed],
    member_id: str,
    heard: Heard,
    ms: int,
    when: datetime,
    value: int | None,
    window_ms: int,
) -> None:
    """Take a heartbeat's compute time into ``heard`` and its probe mark."""
    generation = heard.generation
    if heard._computed(ms, generation, value, window_ms):
        sustained = heard.sustained_ms
        assert sustained is not None
        computed[member_id] = Computed(sustained / 1000, generation, window_ms / 1000, None, when)
    else:
        computed.pop(member_id, None)


def _first(  # noqa: PLR0917  (one call per new process, positional as Heard's own)
    node: str,
    incarnation: str,
    generation: int,
    phase: Phase,
    step: int,
    at: datetime,
    ms: int,
    step_ms: int,
    window: int,
) -> Heard:
    """The entry of a process heard for the first time (a new incarnation replaces the
    old one's). Every argument positional, in ``Heard``'s field order: keywords cost a
    third more, once per member a turn in a simulation's tables."""
    return Heard(node, incarnation, generation, phase, step, at, ms, False, window, ms, 1, 0,
                 None, None, step_ms)  # fmt: skip


@dataclass(slots=True)
class LivenessStats:
    heard: int = 0
    #: Heartbeats older than the one already heard (reordered in transit).
    reordered: int = 0


class LivenessTable:
    """Every job's members as last heard (see the module docstring)."""

    def __init__(self, started_at: datetime) -> None:
        #: When this table started (the leader's start): active members count as heard then.
        self.started_at = on_the_ms(started_at)
        #: Since when every heartbeat sent could be heard (the start, or the last time the
        #: heartbeats' connection came back: ``resume``).
        self.hearing_since = self.started_at
        self._jobs: dict[str, dict[str, Heard]] = {}
        #: Job -> when its current window began (its last summary, else the table's start).
        self._windows: dict[str, datetime] = {}
        #: Job -> how many windows it had (a ``Heard``'s statistics are of its ``window``).
        self._window_counts: dict[str, int] = {}
        #: Job -> its members in name order (a summary's order), while no member came or went.
        self._sorted: dict[str, list[str]] = {}
        #: Job -> member -> its last heartbeat as a probe shows it (``Heard.last_at`` and
        #: ``phase``, evidence ``TABLE``), kept with every beat: a probe merges them in C.
        self._marks: dict[str, dict[str, Heartbeat]] = {}
        #: Job -> the ``hearing_since`` its members were last adopted at (``_adopt``).
        self._adopted: dict[str, datetime] = {}
        #: Job -> member -> its sustained compute time as a probe shows it (``Computed``),
        #: kept with every beat of a member whose heartbeats cover the window.
        self._computes: dict[str, dict[str, Computed]] = {}
        #: Job -> member -> where it was in its steps at its last heartbeat (``Progress``),
        #: kept with every beat that carries it.
        self._progress: dict[str, dict[str, Progress]] = {}
        self.stats = LivenessStats()

    def heard(self, job_id: str, member_id: str) -> Heard | None:
        return self._jobs.get(job_id, {}).get(member_id)

    def members(self, job_id: str) -> dict[str, Heard]:
        return self._jobs.get(job_id, {})

    def _member_table(self, job_id: str) -> dict[str, Heard]:
        members = self._jobs.get(job_id)
        if members is None:
            members = self._jobs[job_id] = {}
        return members

    def _window_count(self, job_id: str) -> int:
        return self._window_counts.get(job_id, 0)

    def _computed_of(self, job_id: str) -> dict[str, Computed]:
        computed = self._computes.get(job_id)
        if computed is None:
            computed = self._computes[job_id] = {}
        return computed

    def _progress_of(self, job_id: str) -> dict[str, Progress]:
        progress = self._progress.get(job_id)
        if progress is None:
            progress = self._progress[job_id] = {}
        return progress

    def _marks_of(self, job_id: str) -> dict[str, Heartbeat]:
        marks = self._marks.get(job_id)
        if marks is None:
            marks = self._marks[job_id] = {}
        return marks

    def observe(
        self,
        job_id: str,
        member_id: str,
        *,
        node: str,
        incarnation: str,
        generation: int,
        at: datetime,
        step: int,
        phase: Phase,
        step_seconds: float = 0.0,
        compute_seconds: float | None = None,
        window_s: float = 0.0,
        since_step_seconds: float | None = None,
        ready_seconds: float | None = None,
    ) -> None:
        """One heartbeat of ``member_id`` (process ``incarnation``) received at ``at``
        (``step_seconds``: the longest step it finished since its previous one;
        ``compute_seconds``: their mean compute time, kept over ``window_s``, the job's
        ``slow_window_s``; ``since_step_seconds``, ``ready_seconds``: where it is in its
        steps, ``MemberHeartbeat``)."""
        at = on_the_ms(at)
        ms = ms_of(at)
        step_ms = round(step_seconds * 1000)
        members = self._member_table(job_id)
        window = self._window_count(job_id)
        heard = members.get(member_id)
        self.stats.heard += 1
        if heard is None or heard.incarnation != incarnation:
            members[member_id] = _first(
                node, incarnation, generation, phase, step, at, ms, step_ms, window
            )
            heard = members[member_id]
        elif ms < heard.last_ms:
            self.stats.reordered += 1
            return
        else:
            if heard.window != window:
                heard._open(window)
            heard.generation = generation
            heard._beat(at, ms, step, phase, step_ms)
        self._marks_of(job_id)[member_id] = Heartbeat(at, None, TABLE, phase)
        window_ms = round(window_s * 1000)
        if window_ms > 0:
            value = None if compute_seconds is None else round(compute_seconds * 1000)
            _mark_compute(self._computed_of(job_id), member_id, heard, ms, at, value, window_ms)
        heard.since_step_ms = (
            None if since_step_seconds is None else round(since_step_seconds * 1000)
        )
        heard.ready_ms = None if ready_seconds is None else round(ready_seconds * 1000)
        if heard.since_step_ms is not None or heard.ready_ms is not None:
            self._progress_of(job_id)[member_id] = heard.progress()
        else:
            self._progress.get(job_id, {}).pop(member_id, None)

    def probe(self, view: JobView, *, exact: bool = False) -> JobView:
        """``view`` with the table's liveness in its ``heartbeats`` (evidence ``TABLE``, no
        position: it is not in the log). A new view; ``view`` is unchanged.

        A member the table heard has its last heartbeat as the table heard it: the table's
        entries merged over the view's in C, what a turn with nothing due costs. That can
        only make a member look *more* silent than it is (the table heard the member's
        earlier process, a summary of another leader heard it later), so when the probe
        finds something due, the decider asks again of an ``exact`` probe: only active
        members of the view's processes take the table's time, and only when later than the
        log's (an entry of an earlier process is dropped from the table).

        An active member the table never heard from, last heard in the log before the table
        could hear it (``hearing_since``), counts as heard then (and is held in the table
        from then on, so that the summary before a decision records it: ``_adopt``)."""
        job_id = view.job_id
        self._adopt(view)
        merged = dict(view.heartbeats)
        # The compute times the table knows now (a value the log holds of a member whose
        # heartbeats no longer cover the window is not one).
        computed = self._computes.get(job_id)
        compute = dict(computed) if computed else {}
        # Where members are in their steps: the table's, over the log's (older, if any).
        known = self._progress.get(job_id)
        progress = {**view.progress, **known} if known else view.progress
        marks = self._marks.get(job_id)
        if marks and not exact:
            merged.update(marks)
        elif marks:
            table = self._jobs[job_id]
            for member_id, member in view.members.items():
                if member.status is not _ACTIVE:
                    continue
                heard = table.get(member_id)
                if heard is None:
                    continue
                if heard.incarnation != member.incarnation:
                    del table[member_id], marks[member_id]
                    compute.pop(member_id, None)
                    if known and member_id in known:
                        del known[member_id]
                        progress.pop(member_id, None)
                    self._sorted.pop(job_id, None)
                    continue
                current = merged.get(member_id)
                if current is None or heard.last_at > current.at:
                    merged[member_id] = marks[member_id]
        return replace(view, heartbeats=merged, compute=compute, progress=progress)

    def exact_for(self, view: JobView, probe: JobView, member_ids: Iterable[str]) -> bool:
        """Whether the quick ``probe`` of ``view`` holds each of ``member_ids`` (active
        members) as an exact one would: then what it found of them needs no exact probe."""
        table = self._jobs.get(view.job_id, {})
        marks = self._marks.get(view.job_id, {})
        for member_id in member_ids:
            member = view.members.get(member_id)
            if member is None:
                continue
            current = view.heartbeats.get(member_id)
            heard = table.get(member_id)
            if (
                heard is not None
                and heard.incarnation == member.incarnation
                and (current is None or heard.last_at > current.at)
            ):
                current = marks.get(member_id)
            if probe.heartbeats.get(member_id) != current:
                return False
        return True

    def _adopt(self, view: JobView) -> None:
        """Hold every active member of ``view`` whose process the table never heard, last
        heard in the log before ``hearing_since``, as heard then (``assumed``). A pass over
        the members once per job and ``hearing_since`` (the start, each ``resume``): a
        member that joins later joined after it."""
        job_id, since = view.job_id, self.hearing_since
        if self._adopted.get(job_id) == since:
            return
        self._adopted[job_id] = since
        table = self._member_table(job_id)
        marks = self._marks_of(job_id)
        window = self._window_count(job_id)
        heartbeats = view.heartbeats
        since_ms = ms_of(since)
        for member_id, member in view.members.items():
            if member.status is not _ACTIVE:
                continue
            heard = table.get(member_id)
            if heard is not None and heard.incarnation == member.incarnation:
                continue
            current = heartbeats.get(member_id)
            last = current.at if current is not None else member.joined_at
            if last >= since:
                continue
            phase = current.phase if current is not None else Phase.INIT
            table[member_id] = Heard(
                member.node, member.incarnation, member.generation, phase, member.step, since,
                since_ms, assumed=True, window=window,
            )  # fmt: skip
            marks[member_id] = Heartbeat(since, None, TABLE, phase)
            self._sorted.pop(job_id, None)

    def summary_due(self, job_id: str, interval_s: float) -> datetime:
        """When the job's next interval summary is due."""
        return self._windows.get(job_id, self.started_at) + timedelta(seconds=interval_s)

    def summarize(self, view: JobView, now: datetime, reason: str) -> list[LivenessSummary]:
        """The job's summary at ``now`` (split in parts of ``SUMMARY_COLUMN_MEMBERS`` listed
        and ``MAX_WORLD`` named members): every member the table holds whose process is the
        view's, in columns; the members heard regularly named only (``regular``, see
        ``RegularMembers``) in an interval's summary, and in a decision's when naming them
        is safe (``names_regular``). Empty when there is none. Active members never heard
        count as heard at the start (as ``probe``)."""
        job_id = view.job_id
        self._adopt(view)
        table = self._member_table(job_id)
        members = view.members
        names = self._sorted.get(job_id)
        if names is None or len(names) != len(table):
            names = self._sorted[job_id] = sorted(table)
        window = self._window_count(job_id)
        since = self._windows.get(job_id, self.started_at)
        naming = reason == "interval" or names_regular(view)
        bound_ms = round(REGULAR_BEATS * view.effective_policy.heartbeat_interval_s * 1000)
        # Heard regularly: in the window since its start (within the bound), last within the
        # bound of ``now``, no silence longer (the one across the window's start included).
        end = now - timedelta(milliseconds=bound_ms)  # heard at or after it (to the ms above)
        first_by = ms_of(since) + bound_ms
        last_from = ms_of(end) + (1 if end.microsecond % 1000 else 0)
        if not naming:
            first_by = -1  # nobody is
        steady: list[tuple[str, Heard]] = []
        listed: list[tuple[str, Heard]] = []
        for member_id in names:  # one pass: a member's fields are read once
            heard = table[member_id]
            of_view = members.get(member_id)
            if of_view is None or of_view.incarnation != heard.incarnation:
                continue
            if heard.window != window:
                heard._open(window)
            first = heard.first_ms
            if (
                first is not None
                and first <= first_by
                and heard.last_ms >= last_from
                and heard.max_gap_ms <= bound_ms
                and not heard.assumed
            ):
                steady.append((member_id, heard))
            else:
                listed.append((member_id, heard))
        if not steady and not listed:
            return []
        regular: list[RegularMembers] = []
        window_ms = round(view.effective_policy.slow_window_s * 1000)
        computes = window_ms > 0
        if steady:
            regular, listed = _regular(steady, listed, bound_ms, computes)
        epoch = ms_of(now)  # rounded down to the millisecond
        size = SUMMARY_COLUMN_MEMBERS
        chunks = [listed[i : i + size] for i in range(0, len(listed), size)] or [[]]
        parts = max(len(chunks), len(regular))
        chunks += [[]] * (parts - len(chunks))
        return [
            LivenessSummary(
                reason=reason,  # type: ignore[arg-type]  # "interval" | "decision"
                since=since,
                at=now,
                part=i,
                parts=parts,
                columns=_columns(epoch, chunk, computes) if chunk else None,
                regular=regular[i - 1] if i <= len(regular) else None,
                compute_window_ms=window_ms if computes else None,
            )
            for i, chunk in enumerate(chunks, start=1)
        ]

    def summarized(self, job_id: str, now: datetime, reason: str = "interval") -> None:
        """A summary of the job at ``now`` was recorded. An interval's ends the window: a
        new one begins (each member's statistics restart on its next beat, or at the next
        summary). A decision's reports the window so far and leaves it open: the next
        summary covers its time again, so a decision soon after another one (a fault, then
        its resolution a step later) still finds the members heard regularly over a window
        of seconds and names them, where a fresh window of a fraction of an interval would
        have every member not yet heard in it listed in full."""
        if reason == "interval":
            self._windows[job_id] = now
            self._window_counts[job_id] = self._window_count(job_id) + 1

    def resume(self, at: datetime) -> None:
        """Heartbeats sent before ``at`` may have been lost unheard (the connection they come
        on was away): every member counts as heard at ``at`` at the latest, as at the table's
        start, so that no silence the control plane could not hear is judged."""
        at = on_the_ms(at)
        self.hearing_since = max(self.hearing_since, at)
        ms = ms_of(at)
        for job_id, members in self._jobs.items():
            marks = self._marks_of(job_id)
            for member_id, heard in members.items():
                if heard.last_ms < ms:
                    heard.last_at = at
                    heard.last_ms = ms
                    heard.assumed = True
                    marks[member_id] = Heartbeat(at, None, TABLE, heard.phase)

    def forget(self, job_id: str, keep: set[str]) -> None:
        """Drop the job's members not in ``keep`` (they left the view)."""
        members = self._jobs.get(job_id)
        if members:
            marks = self._marks_of(job_id)
            computed = self._computes.get(job_id, {})
            progress = self._progress.get(job_id, {})
            for member_id in [m for m in members if m not in keep]:
                del members[member_id]
                marks.pop(member_id, None)
                computed.pop(member_id, None)
                progress.pop(member_id, None)
            self._sorted.pop(job_id, None)


def names_regular(view: JobView) -> bool:
    """Whether a decision's summary of ``view`` may name the members heard regularly: the
    time the fold gives them (at most ``REGULAR_BEATS`` intervals before the summary) is
    within every threshold a decision applies (each phase's heartbeat timeout, and the
    silence that corroborates a peer's report or takes a node as gone), so that no member
    the table heard regularly is silent on the view that folded the summary."""
    bound = REGULAR_BEATS * view.effective_policy.heartbeat_interval_s
    shortest = min(heartbeat_timeout(view, phase) for phase in Phase)
    return bound < shortest and bound < silence_limit(view)


def _regular(
    steady: list[tuple[str, Heard]],
    others: list[tuple[str, Heard]],
    bound_ms: int,
    computes: bool = False,
) -> tuple[list[RegularMembers], list[tuple[str, Heard]]]:
    """The members heard ``steady``-ly named (``RegularMembers``: those in the window's most
    common generation and phase whose longest step is within a quarter of the median's;
    one a part, ``MAX_WORLD`` names each: a world of 65,536 ranks has spares too), and
    everyone else to list in full (``others`` and the rest of ``steady``, in name order
    as both are)."""
    common = Counter((h.generation, h.phase) for _, h in steady).most_common(1)[0][0]
    steps = sorted(h.max_step_ms for _, h in steady)
    slow = steps[len(steps) // 2] * 1.25
    # Not finished a step for longer than that (and two intervals): a stalled step's
    # evidence, listed with its progress (``core/stall.py``).
    late = max(slow, bound_ms)
    generation, phase = common
    chosen: list[tuple[str, Heard]] = []
    rest: list[tuple[str, Heard]] = []
    for pair in steady:  # (a loop: on Python 3.11 cheaper than two comprehensions)
        h = pair[1]
        since = h.since_step_ms
        if (
            h.generation == generation
            and h.phase is phase
            and h.max_step_ms <= slow
            and (since is None or since <= late)
        ):
            chosen.append(pair)
        else:
            rest.append(pair)
    if not chosen:
        return [], sorted([*others, *steady], key=_NAME)
    step_min = min(h.step for _, h in chosen)
    step_max = max(h.step for _, h in chosen)
    max_step_ms = max(h.max_step_ms for _, h in chosen)
    max_gap_ms = max(h.max_gap_ms for _, h in chosen)
    # The bounds of them all hold for each part's names.
    regular = [
        RegularMembers(
            members=[m for m, _ in part],  # in name order, as ``steady`` is
            bound_ms=bound_ms,
            generation=generation,
            phase=phase,
            step_min=step_min,
            step_max=step_max,
            max_step_ms=max_step_ms,
            max_gap_ms=max_gap_ms,
            compute_ms=_known([h.sustained_ms for _, h in part]) if computes else None,
        )
        for part in (chosen[i : i + MAX_WORLD] for i in range(0, len(chosen), MAX_WORLD))
    ]
    if rest:
        others = sorted([*others, *rest], key=_NAME)
    return regular, others


_NAME = operator.itemgetter(0)


def _columns(
    epoch: int, listed: list[tuple[str, Heard]], computes: bool = False
) -> LivenessColumns:
    """``listed`` members' windows as columns, times in milliseconds from ``epoch``."""
    return LivenessColumns(
        epoch_ms=epoch,
        members=[m for m, _ in listed],
        generation=[h.generation for _, h in listed],
        last_ms=[h.last_ms - epoch for _, h in listed],
        assumed=[i for i, (_, h) in enumerate(listed) if h.assumed],
        first_ms=[None if h.first_ms is None else h.first_ms - epoch for _, h in listed],
        beats=[h.beats for _, h in listed],
        max_gap_ms=[h.max_gap_ms for _, h in listed],
        max_gap_at_ms=[
            None if h.max_gap_at_ms is None else h.max_gap_at_ms - epoch for _, h in listed
        ],
        phase=[h.phase for _, h in listed],
        step=[h.step for _, h in listed],
        max_step_ms=[h.max_step_ms for _, h in listed],
        compute_ms=_known([h.sustained_ms for _, h in listed]) if computes else None,
        max_gap_phase=_gap_phases(listed),
        since_step_ms=_known([h.since_step_ms for _, h in listed]),
        ready_ms=_known([h.ready_ms for _, h in listed]),
    )


def _gap_phases(listed: list[tuple[str, Heard]]) -> list[Phase | None] | None:
    """The ``max_gap_phase`` column: each member's gap's phase where it is not its last
    (None where it is), or None when it is for everyone (the usual case: no bytes)."""
    values = [
        h.max_gap_phase if h.max_gap_phase is not None and h.max_gap_phase is not h.phase else None
        for _, h in listed
    ]
    return values if any(v is not None for v in values) else None


def _known(values: list[int | None]) -> list[int | None] | None:
    """A compute column, or None when it knows no value (a job whose members report none
    pays nothing for it)."""
    return values if any(v is not None for v in values) else None
