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
before.

The decider reads the table through the view: ``overlay`` moves each active member's
``last_heartbeat_at`` (and phase) to what the table heard, in place, before ``decide`` runs.
Before any decision is recorded, ``summarize`` turns the table into ``liveness.summary``
events (every member of the job the table holds), appended first: their fold gives the
view exactly the values the decision was taken on, so re-deciding from the log reproduces
it. Between decisions a summary is recorded every ``liveness_summary_interval_s``: the log
then knows each member's liveness at that resolution (the API's last heartbeat, a
counterfactual timeout).

The table keeps times on the millisecond (a heartbeat's arrival is rounded down to it), the
resolution of a summary's columns: the fold of a summary gives the view exactly the times the
table held, hence the values a decision read.

Pure: times are arguments; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from controlplane.core.view import JobView, MemberStatus
from schemas.common import Phase
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

    def source(self, i: int) -> str:
        return f"{self.node}/{self.members[i]}"


def take_beats(table: LivenessTable, view: JobView | None, beats: Beats, at: datetime) -> list[str]:
    """Take the validated ``beats`` of one message that arrived at ``at`` (on the ms) into
    ``table``: each only from its member's current process (its joined incarnation, on the
    node the message is bound to, not a fenced one beating in an older generation), heard
    its ``age_ms`` before ``at``. Why each beat not taken was not."""
    job_id, node = beats.job_id, beats.node
    if view is None:  # (every beat of a job not registered yet: one reason, counted per beat)
        return [f"never joined: {node}'s members of job {job_id}"] * len(beats.members)
    members, generation = view.members, view.generation
    refused: list[str] = []
    for i, member_id in enumerate(beats.members):
        member = members.get(member_id)
        incarnation = beats.incarnation[i]
        if member is None:
            refused.append(f"never joined: {beats.source(i)} of job {job_id}")
        elif member.incarnation != incarnation:
            refused.append(
                f"stale_incarnation: {incarnation} of {beats.source(i)}, which joined"
                f" as {member.incarnation}"
            )
        elif member.node != node:
            refused.append(f"forged node: {member_id} joined on {member.node}, not {node}")
        elif beats.generation[i] < generation and member.status is not MemberStatus.ACTIVE:
            # A fenced member resumed (SIGCONT), beating in the world it was left out of.
            refused.append(
                f"stale_generation: {beats.source(i)} beats in generation"
                f" {beats.generation[i]}, left out of generation {generation}"
            )
        else:
            age = beats.age_ms[i]
            table.observe(
                job_id, member_id, node=node, incarnation=incarnation,
                generation=beats.generation[i],
                at=at - timedelta(milliseconds=age) if age else at,
                step=beats.step[i], phase=beats.phase[i], step_seconds=beats.step_ms[i] / 1000,
            )  # fmt: skip
    return refused


@dataclass(slots=True)
class Heard:
    """What the table heard of one member (its process ``incarnation``)."""

    node: str
    incarnation: str
    generation: int
    phase: Phase
    step: int
    last_at: datetime
    #: Not heard since the table started: counted as heard at its start.
    assumed: bool = False
    #: The current window: its first heartbeat, beats, largest gap and when that began.
    first_at: datetime | None = None
    beats: int = 0
    max_gap_s: float = 0.0
    max_gap_at: datetime | None = None
    max_step_s: float = 0.0


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
        self._jobs: dict[str, dict[str, Heard]] = {}
        #: Job -> when its current window began (its last summary, else the table's start).
        self._windows: dict[str, datetime] = {}
        self.stats = LivenessStats()

    def heard(self, job_id: str, member_id: str) -> Heard | None:
        return self._jobs.get(job_id, {}).get(member_id)

    def members(self, job_id: str) -> dict[str, Heard]:
        return self._jobs.get(job_id, {})

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
    ) -> None:
        """One heartbeat of ``member_id`` (process ``incarnation``) received at ``at``
        (``step_seconds``: the longest step it finished since its previous one)."""
        at = on_the_ms(at)
        members = self._jobs.get(job_id)
        if members is None:
            members = self._jobs[job_id] = {}
        heard = members.get(member_id)
        self.stats.heard += 1
        if heard is None or heard.incarnation != incarnation:
            # A process heard for the first time (a new incarnation replaces the old one).
            members[member_id] = Heard(
                node, incarnation, generation, phase, step, at, first_at=at, beats=1,
                max_step_s=step_seconds,
            )  # fmt: skip
            return
        if at < heard.last_at:
            self.stats.reordered += 1
            return
        if heard.assumed:
            heard.assumed = False  # the assumed time was no heartbeat: no gap from it
        else:
            gap = (at - heard.last_at).total_seconds()
            if gap > heard.max_gap_s:
                heard.max_gap_s = gap
                heard.max_gap_at = heard.last_at
        heard.last_at = at
        if heard.first_at is None:
            heard.first_at = at
        heard.beats += 1
        heard.generation = generation
        heard.phase = phase
        heard.step = max(heard.step, step)
        heard.max_step_s = max(heard.max_step_s, step_seconds)

    def overlay(self, view: JobView) -> None:
        """Move the active members of ``view`` to what the table heard of them (in place:
        ``last_heartbeat_at`` when the table heard later, and the phase then reported).

        An active member the table never heard from, last heard in the log before the
        table's start, counts as heard at the start (and is held in the table from then
        on, so that the summary before a decision records it)."""
        members = self._jobs.get(view.job_id)
        if members is None:
            members = self._jobs[view.job_id] = {}
        started = self.started_at
        active = MemberStatus.ACTIVE
        for member_id, member in view.members.items():
            if member.status is not active:
                continue
            heard = members.get(member_id)
            if heard is None or heard.incarnation != member.incarnation:
                last = member.last_heartbeat_at or member.joined_at
                if last >= started:
                    continue
                heard = members[member_id] = Heard(
                    member.node,
                    member.incarnation,
                    member.generation,
                    member.phase,
                    member.step,
                    started,
                    assumed=True,
                )
            current = member.last_heartbeat_at
            if current is None or heard.last_at > current:
                member.last_heartbeat_at = heard.last_at
                member.phase = heard.phase

    def summary_due(self, job_id: str, interval_s: float) -> datetime:
        """When the job's next interval summary is due."""
        return self._windows.get(job_id, self.started_at) + timedelta(seconds=interval_s)

    def summarize(self, view: JobView, now: datetime, reason: str) -> list[LivenessSummary]:
        """The job's summary at ``now`` (split in parts of ``SUMMARY_COLUMN_MEMBERS``): every
        member the table holds whose process is the view's, in columns; at an interval, the
        members heard regularly named only (``regular``, see ``RegularMembers``). Empty when
        there is none."""
        members = self._jobs.get(view.job_id, {})
        listed: list[tuple[str, Heard]] = []
        for member_id in sorted(members):
            heard = members[member_id]
            member = view.members.get(member_id)
            if member is None or member.incarnation != heard.incarnation:
                continue
            listed.append((member_id, heard))
        if not listed:
            return []
        since = self._windows.get(view.job_id, self.started_at)
        regular = None
        if reason == "interval":
            bound_s = REGULAR_BEATS * view.effective_policy.heartbeat_interval_s
            regular, listed = _regular(listed, since, now, bound_s)
        epoch = ms_of(now)  # rounded down to the millisecond
        size = SUMMARY_COLUMN_MEMBERS
        chunks = [listed[i : i + size] for i in range(0, len(listed), size)] or [[]]
        return [
            LivenessSummary(
                reason=reason,  # type: ignore[arg-type]  # "interval" | "decision"
                since=since,
                at=now,
                part=i,
                parts=len(chunks),
                columns=_columns(epoch, chunk) if chunk else None,
                regular=regular if i == 1 else None,
            )
            for i, chunk in enumerate(chunks, start=1)
        ]

    def summarized(self, job_id: str, now: datetime) -> None:
        """A summary of the job at ``now`` was recorded: a new window begins."""
        self._windows[job_id] = now
        for heard in self._jobs.get(job_id, {}).values():
            heard.first_at = None
            heard.beats = 0
            heard.max_gap_s = 0.0
            heard.max_gap_at = None
            heard.max_step_s = 0.0

    def forget(self, job_id: str, keep: set[str]) -> None:
        """Drop the job's members not in ``keep`` (they left the view)."""
        members = self._jobs.get(job_id)
        if members:
            for member_id in [m for m in members if m not in keep]:
                del members[member_id]


def _regular(
    listed: list[tuple[str, Heard]], since: datetime, now: datetime, bound_s: float
) -> tuple[RegularMembers | None, list[tuple[str, Heard]]]:
    """``listed`` split into the members heard regularly over ``[since, now]`` (see
    ``RegularMembers``: in the window's most common generation and phase, every silence at
    most ``bound_s``, the longest step within a quarter of the median's) and the others."""
    bound = timedelta(milliseconds=round(bound_s * 1000))
    start, end = since + bound, now - bound
    steady = [
        (m, h)
        for m, h in listed
        if not h.assumed
        and h.first_at is not None
        and h.first_at <= start
        and h.last_at >= end
        and h.max_gap_s <= bound.total_seconds()
    ]
    if not steady:
        return None, listed
    common = Counter((h.generation, h.phase) for _, h in steady).most_common(1)[0][0]
    steps = sorted(h.max_step_s for _, h in steady)
    slow = steps[len(steps) // 2] * 1.25
    names = {m for m, h in steady if (h.generation, h.phase) == common and h.max_step_s <= slow}
    if not names:
        return None, listed
    chosen = [h for m, h in listed if m in names]
    regular = RegularMembers(
        members=sorted(names),
        bound_ms=round(bound_s * 1000),
        generation=common[0],
        phase=common[1],
        step_min=min(h.step for h in chosen),
        step_max=max(h.step for h in chosen),
        max_step_ms=round(max(h.max_step_s for h in chosen) * 1000),
    )
    return regular, [(m, h) for m, h in listed if m not in names]


def _columns(epoch: int, listed: list[tuple[str, Heard]]) -> LivenessColumns:
    """``listed`` members' windows as columns, times in milliseconds from ``epoch``."""

    def offset(at: datetime | None) -> int | None:
        return None if at is None else ms_of(at) - epoch

    return LivenessColumns(
        epoch_ms=epoch,
        members=[m for m, _ in listed],
        generation=[h.generation for _, h in listed],
        last_ms=[ms_of(h.last_at) - epoch for _, h in listed],
        assumed=[i for i, (_, h) in enumerate(listed) if h.assumed],
        first_ms=[offset(h.first_at) for _, h in listed],
        beats=[h.beats for _, h in listed],
        max_gap_ms=[round(h.max_gap_s * 1000) for _, h in listed],
        max_gap_at_ms=[offset(h.max_gap_at) for _, h in listed],
        phase=[h.phase for _, h in listed],
        step=[h.step for _, h in listed],
        max_step_ms=[round(h.max_step_s * 1000) for _, h in listed],
    )
