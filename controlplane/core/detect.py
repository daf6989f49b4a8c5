"""Fault detection: which members have failed, by the evidence in a job view at time ``now``.

Pure: the view and the time are arguments. A member has failed when its launcher reported its
exit (the fold believes an exit only from the launcher of the member's node), when it reported
an error of its own (an exception, running out of memory), when peers reported a fault that
names it *and* that is corroborated (see below), or when its last heartbeat is older than the
timeout of the phase it last reported (backup and restore get their own, longer timeouts), or
when it was recorded as slow (``member.slow``, ``core/straggler.py``) in the current generation
with the policy's action ``replace``, or when its peers waited for it in a step's collectives
past the step timeout (``core/stall.py``). A member already named by a ``fault.detected`` is not
found again, so detection is idempotent.

A peer naming a suspect is evidence, not proof: one member (or one node's credential) must not
be able to fence a healthy peer. Generations are fences: a report counts only while the
generation it names is current, and only from an active member of that generation's world
(the fold discounts the rest, ``stale_report`` / ``reporter_not_in_world``). Such a report,
made since the suspect joined, fences the suspect only when one of these holds:

- the suspect is silent: no heartbeat for ``SILENCE_BEATS`` heartbeat intervals of the policy
  (a healthy member's heartbeat thread beats every interval, whatever its phase);
- it exited (its launcher reported it: that finding is an exit);
- reporters on at least ``INDEPENDENT_NODES`` different nodes name it (one node's credential
  can forge reports from every member of that node, not from another node's).

Until then the report waits in the view (``Member.last_fault``); ``report_deadline`` says when
the silence would corroborate it, so the decider wakes then.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.core.stall import stalled
from controlplane.core.timeouts import Threshold, fixed
from controlplane.core.view import FaultReport, Heartbeat, JobView, Member, MemberStatus
from schemas.common import FaultKind, FaultReason, Phase

#: Faults a member reports about itself: it cannot go on.
SELF_FAULTS = frozenset({FaultKind.EXCEPTION, FaultKind.OOM, FaultKind.NAN_LOSS, FaultKind.OTHER})
#: Faults a member reports about peers (named as suspects).
PEER_FAULTS = frozenset({FaultKind.COLLECTIVE_ERROR, FaultKind.TIMEOUT, FaultKind.RESTORE_FAILED})
#: A suspect silent for this many heartbeat intervals corroborates a report naming it.
SILENCE_BEATS = 3
#: Reports from members on this many different nodes corroborate each other.
INDEPENDENT_NODES = 2
_WHERE: dict[str, str] = {
    FaultKind.COLLECTIVE_ERROR: "in a collective",
    FaultKind.TIMEOUT: "in a collective",
    FaultKind.RESTORE_FAILED: "while restoring from it",
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One failed member, why, and the events that show it."""

    member: str
    reason: FaultReason
    detail: str
    #: (member the evidence is about or from, what it is, log position or None, when)
    evidence: tuple[tuple[str, str, int | None, datetime | None], ...]
    #: The heartbeat timeout applied (a heartbeat timeout's finding only).
    threshold: Threshold | None = None


#: Names of UTC (as PostgreSQL and zoneinfo spell it: psycopg stamps ``recorded_at`` with
#: ``ZoneInfo("Etc/UTC")``).
_UTC_NAMES = frozenset({"UTC", "Etc/UTC", "Etc/Universal", "Universal", "Etc/Zulu", "Zulu"})


def _in_zone_of(moment: datetime, like: datetime | None) -> datetime:
    """``moment`` in the time zone of ``like`` when that zone is UTC under another tzinfo
    object: aware datetimes of one tzinfo object compare without two ``utcoffset()`` calls
    (a sixteenth of the cost), and in UTC that comparison is exact. Otherwise unchanged."""
    zone = like.tzinfo if like is not None else None
    if zone is None or zone is moment.tzinfo or str(zone) not in _UTC_NAMES:
        return moment
    return moment.astimezone(zone)


def _watched(member: Member) -> bool:
    """Members whose failure matters and is not yet detected."""
    return member.detected_position is None and (
        member.status is MemberStatus.ACTIVE or member.status is MemberStatus.EXITED
    )


def threshold(view: JobView, phase: Phase) -> Threshold:
    """The heartbeat timeout in force for ``phase`` and how it was derived: the one the fold
    derived from the log's gaps (``auto``), else the policy's fixed one."""
    derived = view.thresholds.get(phase)
    if derived is not None:
        return derived
    policy = view.effective_policy
    note = " (auto: no gaps recorded yet)" if policy.heartbeat_timeout_mode == "auto" else ""
    return fixed(policy, phase, note)


def heartbeat_timeout(view: JobView, phase: Phase) -> float:
    """Seconds of silence after which a member in ``phase`` has failed."""
    return threshold(view, phase).seconds


def silence_limit(view: JobView) -> float:
    """Seconds without a heartbeat after which a suspect named by a peer counts as silent."""
    return SILENCE_BEATS * view.effective_policy.heartbeat_interval_s


def _accusations(view: JobView, reporters: list[Member]) -> dict[str, list[Member]]:
    """Suspect -> the members whose current report names it (about a peer, naming the
    current generation, and made since the suspect joined), in the order given. (The fold
    keeps a peer report only from an active member of the world of the generation it
    names, while that generation is current; one kept stops counting once a newer
    generation starts.)"""
    members = view.members
    generation = view.generation
    out: dict[str, list[Member]] = {}
    for reporter in reporters:
        report = reporter.last_fault
        if report is None or report.kind not in PEER_FAULTS or report.generation != generation:
            continue
        for suspect_id in dict.fromkeys(report.suspects):
            suspect = members.get(suspect_id)
            # A report from before the suspect's current incarnation joined is stale.
            if (
                suspect is None
                or suspect_id == reporter.member_id
                or not _watched(suspect)
                or report.position < suspect.joined_position
            ):
                continue
            out.setdefault(suspect_id, []).append(reporter)
    return out


def accusations(view: JobView) -> dict[str, list[str]]:
    """Suspect -> the members whose report names it and still waits (not detected yet)."""
    reporters = [m for m in view.members.values() if m.last_fault is not None]
    if not reporters:
        return {}
    return {
        suspect: [a.member_id for a in sorted(accusers, key=_report_position)]
        for suspect, accusers in _accusations(view, reporters).items()
    }


def report_deadline(view: JobView) -> datetime | None:
    """When the silence of a suspect that a waiting report names would corroborate it."""
    reporters = [m for m in view.members.values() if m.last_fault is not None]
    if not reporters:
        return None
    limit = timedelta(seconds=silence_limit(view))
    deadlines = []
    for suspect_id in _accusations(view, reporters):
        suspect = view.members[suspect_id]
        # Only a member of the world opens an incident (a spare's failure is no decision).
        if suspect.status is MemberStatus.ACTIVE and suspect.rank is not None:
            deadlines.append(view.last_heard(suspect) + limit)
    return min(deadlines, default=None)


def _corroborated(
    view: JobView, suspect: Member, accusers: list[Member], now: datetime
) -> Finding | None:
    """The finding against ``suspect`` when the reports naming it are corroborated."""
    accusers = sorted(accusers, key=_report_position)  # the earliest evidence first
    first = accusers[0]
    report = first.last_fault
    assert report is not None
    what = f"{first.member_id} lost {suspect.member_id} {_WHERE[report.kind]}: {report.detail}"
    cited = tuple(_cite(a.member_id, a.last_fault) for a in accusers)
    nodes = sorted({a.node for a in accusers})
    if len(nodes) >= INDEPENDENT_NODES:
        return Finding(
            suspect.member_id,
            FaultReason.REPORTED,
            f"{what}; corroborated by {len(accusers)} reporters on {len(nodes)} nodes"
            f" ({', '.join(a.member_id for a in accusers[:8])})"[:4096],
            cited,
        )
    heartbeat = view.heartbeats.get(suspect.member_id)
    last = heartbeat.at if heartbeat is not None else suspect.joined_at
    silent = (now - last).total_seconds()
    limit = silence_limit(view)
    if silent >= limit:
        heard = _heard(suspect, heartbeat)
        return Finding(
            suspect.member_id,
            FaultReason.REPORTED,
            f"{what}; corroborated by its silence: no heartbeat for {silent:.1f}s"
            f" ({SILENCE_BEATS} intervals of {view.effective_policy.heartbeat_interval_s:g}s)"[
                :4096
            ],
            (*cited, heard),
        )
    return None


def _report_position(member: Member) -> int:
    return member.last_fault.position if member.last_fault is not None else -1


_Cited = tuple[str, str, int | None, datetime | None]


def _heard(member: Member, heartbeat: Heartbeat | None) -> _Cited:
    """The evidence of when ``member`` was last heard: its last heartbeat, else its join."""
    if heartbeat is None:
        return (member.member_id, "member.joined", member.joined_position, member.joined_at)
    return (member.member_id, heartbeat.evidence, heartbeat.position, heartbeat.at)


def _cite(member_id: str, report: FaultReport | None) -> _Cited:
    assert report is not None
    return (member_id, "member.fault", report.position, report.at)


def detect(view: JobView, now: datetime) -> list[Finding]:
    """Every member that has failed and was not yet named by a ``fault.detected``."""
    findings: dict[str, Finding] = {}
    members = view.members
    timeouts = {phase: threshold(view, phase) for phase in Phase}
    # Silent past its limit <=> last heard before ``now - limit``: one comparison per member.
    cutoffs = {phase: now - timedelta(seconds=t.seconds) for phase, t in timeouts.items()}
    # One pass picks the few members worth a closer look: reporters, members not yet
    # detected that exited, and those silent past the shortest timeout (the closer look
    # applies the timeout of each one's phase). A plain loop: attribute reads of slotted
    # members are what Python 3.11 specializes best (chains of ``map`` over attrgetters and
    # ``operator`` functions cost about twice as much at 4,096 members).
    latest_cutoff = max(cutoffs.values())
    heartbeats = view.heartbeats
    heard = next(iter(heartbeats.values()), None)
    latest_cutoff = _in_zone_of(latest_cutoff, heard.at if heard is not None else None)
    reporters: list[Member] = []
    exited: list[Member] = []
    # Never heard from, or not since the latest cutoff: (member, its last heartbeat).
    quiet: list[tuple[Member, Heartbeat | None]] = []
    active, gone = MemberStatus.ACTIVE, MemberStatus.EXITED
    for member_id, member in members.items():
        if member.last_fault is not None:
            reporters.append(member)
        if member.detected_position is not None:
            continue
        status = member.status
        if status is active:
            heartbeat = heartbeats.get(member_id)
            if heartbeat is None or heartbeat.at < latest_cutoff:
                quiet.append((member, heartbeat))
        elif status is gone:
            exited.append(member)
    silent_members: list[tuple[Member, Heartbeat | None, float, Threshold]] = []
    for member in exited:
        how = (
            f"killed by signal {member.exit_signal}"
            if member.exit_signal
            else f"exited with status {member.exit_code}"
        )
        findings[member.member_id] = Finding(
            member.member_id,
            FaultReason.EXITED,
            f"{member.member_id} {how}",
            ((member.member_id, "member.exited", member.exited_position, member.exited_at),),
        )
    for member, heartbeat in quiet:
        if heartbeat is None:
            last, phase = member.joined_at, Phase.INIT
        else:
            last, phase = heartbeat.at, heartbeat.phase
        if last < cutoffs[phase]:
            silent = (now - last).total_seconds()
            silent_members.append((member, heartbeat, silent, timeouts[phase]))

    for reporter in reporters:
        report = reporter.last_fault
        assert report is not None
        if report.kind in SELF_FAULTS and _watched(reporter):
            findings.setdefault(
                reporter.member_id,
                Finding(
                    reporter.member_id,
                    FaultReason.REPORTED,
                    f"{reporter.member_id} reported {report.kind}: {report.detail}"[:4096],
                    ((reporter.member_id, "member.fault", report.position, report.at),),
                ),
            )
    if reporters:
        for suspect_id, accusers in _accusations(view, reporters).items():
            if suspect_id in findings:
                continue  # its exit (or its own report) already shows it
            finding = _corroborated(view, members[suspect_id], accusers, now)
            if finding is not None:
                findings[suspect_id] = finding

    for member, heartbeat, silent, limit in silent_members:
        if member.member_id in findings:
            continue
        phase = heartbeat.phase if heartbeat is not None else Phase.INIT
        findings[member.member_id] = Finding(
            member.member_id,
            FaultReason.HEARTBEAT_TIMEOUT,
            f"{member.member_id} silent for {silent:.1f}s in phase {phase.value}"
            f" (timeout {limit.seconds:g}s{_derived(limit)})"[:4096],
            (_heard(member, heartbeat),),
            limit,
        )
    generation = view.generation
    for member_id, mark in view.slow.items():
        slow = members.get(member_id)
        if (
            mark.generation != generation
            or mark.action != "replace"
            or member_id in findings
            or slow is None
            or slow.status is not active
            or slow.rank is None
            or slow.detected_position is not None
        ):
            continue
        # Recorded as slow, and the policy replaces it: alive, but out of the world.
        findings[member_id] = Finding(
            member_id,
            FaultReason.SLOW,
            mark.reason[:4096],
            ((member_id, "member.slow", mark.position, mark.at),),
        )
    if view.progress and not findings:
        _stalled(view, now, findings)
    return [findings[m] for m in sorted(findings)]


def _stalled(view: JobView, now: datetime, findings: dict[str, Finding]) -> None:
    """The members a stall's waiters waited for past the step timeout (``core/stall.py``)."""
    stall = stalled(view, now)
    if stall is None:
        return
    limit = stall.threshold
    waiter = max(stall.waiters, key=lambda w: view.progress[w].at)
    seen = view.progress[waiter]
    waited = (
        f"{len(stall.waiters)} peer(s) with every gradient of step {stall.step} ready waited"
        f" {stall.waited_s:.1f}s for it in the step's collectives (step timeout"
        f" {limit.seconds:g}s{_derived(limit)})"
    )
    for member_id, p in stall.behind.items():
        rank = view.members[member_id].rank
        where = (
            f"finished step {p.step} {p.since_step_s:.1f}s before its last heartbeat"
            if p.step + 1 == stall.step
            else f"at step {p.step}, behind"
        )
        findings[member_id] = Finding(
            member_id,
            FaultReason.STALLED,
            f"{member_id} (rank {rank}) {where} and had not all its gradients of step"
            f" {stall.step}; {waited}"[:4096],
            (
                (member_id, _PROGRESS, p.position, p.at),
                (waiter, _PROGRESS, seen.position, seen.at),
            ),
            limit,
        )


#: The event that shows where a member was in its steps (its heartbeat, in the decision's
#: summary).
_PROGRESS = "liveness.summary"


def _derived(limit: Threshold) -> str:
    """How ``limit`` was derived, for a detail (nothing for the policy's plain fixed one)."""
    plain = (f"fixed policy {limit.seconds:g}s", f"fixed step timeout {limit.seconds:g}s")
    return "" if limit.how in plain else f": {limit.how}"
