"""Stalled steps: members of the world that their peers wait for inside a step's collectives.

A member's heartbeats come from a thread of their own, so a rank stuck in its step (a data
loader on a hung filesystem, a kernel that never returns, a deadlock in user code) still
beats: no heartbeat timeout finds it, while every peer waits for it in the step's
collectives until the collective timeout (minutes) fails them all, naming nobody. Each
heartbeat in phase train therefore says where the member is in its steps
(``MemberHeartbeat.since_step_seconds``, ``ready_seconds``: the time since it finished its
last step, and since every gradient of the next one was ready on it, after which it only
waits for its peers), and the decision's ``liveness.summary`` records it
(``LivenessColumns.since_step_ms`` / ``ready_ms``; a member whose last step is older than the
window's steps is never named regular, so a stall is always listed in full).

The *frontier* is the latest step some member of the world holds its gradients of and waits
in: the members at it (their last step the one before it, their gradients ready) are the
*waiters*. The members behind it (not finished the step before, or finished it and not all
their gradients ready) are what the waiters wait for. When every waiter has waited past the
*step timeout*, the members behind have failed (``FaultReason.STALLED``), provided that:

- every member of the world reports where it is, in phase train, of the current generation,
  heard within ``FRESH_BEATS`` heartbeat intervals (anyone else: its own heartbeat timeout or
  phase decides; nothing is found on old evidence, as after a takeover);
- no member finished the frontier step (then the step went on);
- the members behind are at most half the world: a stall of most of the world is no member's
  own (a shared filesystem, the network), and is left to the collective timeout.

The step timeout is the policy's ``step_timeout_s`` (``fixed``), or under ``auto``
``step_timeout_k`` times a quantile of the longest steps the log's interval summaries show,
within a floor and a ceiling (``core/timeouts.py``). Members whose backward does not report
its gradients (FSDP2, a pipeline) are never waiters: a stall among them is left to the
collective timeout.

Pure: the view and the time are arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.core.timeouts import Threshold, fixed_step
from controlplane.core.view import JobView, MemberStatus, Progress
from schemas.common import Phase

#: Evidence older than this many heartbeat intervals is not judged on.
FRESH_BEATS = 3


@dataclass(frozen=True, slots=True)
class Stall:
    """Members behind the frontier step past the step timeout, and the evidence."""

    #: The step the waiters hold their gradients of.
    step: int
    #: The shortest wait of any waiter (each has waited at least this long), seconds.
    waited_s: float
    waiters: tuple[str, ...]
    #: member -> where it was (its last step, the seconds since).
    behind: dict[str, Progress]
    threshold: Threshold


def step_threshold(view: JobView) -> Threshold | None:
    """The step timeout in force and how it was derived (None: none is looked for)."""
    if view.step_threshold is not None:
        return view.step_threshold
    policy = view.effective_policy
    note = " (auto: no steps recorded yet)" if policy.step_timeout_mode == "auto" else ""
    return fixed_step(policy, note)


def _sides(
    view: JobView, now: datetime | None
) -> tuple[int, list[str], dict[str, Progress]] | None:
    """(frontier step, waiters, members behind) of the current world, or None when the
    evidence does not show a stall shaped as the module docstring says (``now`` None: its
    freshness is not asked)."""
    if not view.progress:
        return None
    fresh = (
        now - timedelta(seconds=FRESH_BEATS * view.effective_policy.heartbeat_interval_s)
        if now is not None
        else None
    )
    members, progress, heartbeats = view.members, view.progress, view.heartbeats
    generation = view.generation
    known: dict[str, Progress] = {}
    for member_id in view.world:
        member = members.get(member_id)
        if member is None or member.status is not MemberStatus.ACTIVE:
            return None
        if member.rank is None or member.detected_position is not None:
            return None  # a recovery of its own is under way
        p = progress.get(member_id)
        heartbeat = heartbeats.get(member_id)
        if (
            p is None
            or p.generation != generation
            or p.since_step_s is None
            or (fresh is not None and p.at < fresh)
            or heartbeat is None
            or heartbeat.phase is not Phase.TRAIN
        ):
            return None
        known[member_id] = p
    ready = [p.step + 1 for p in known.values() if p.ready_s is not None]
    if not ready:
        return None
    frontier = max(ready)
    waiters: list[str] = []
    behind: dict[str, Progress] = {}
    for member_id, p in known.items():
        if p.step >= frontier:
            return None  # someone finished it: the step went on
        if p.step + 1 == frontier and p.ready_s is not None:
            waiters.append(member_id)
        else:
            behind[member_id] = p
    if not behind or 2 * len(behind) > len(known):
        return None
    return frontier, waiters, behind


def _waited_since(progress: Progress) -> datetime:
    """When a waiter's gradients were ready (it has waited since)."""
    assert progress.ready_s is not None
    return progress.at - timedelta(seconds=progress.ready_s)


def _shown(
    view: JobView, now: datetime | None
) -> tuple[Threshold, datetime, int, list[str], dict[str, Progress]] | None:
    """(step timeout, when the latest waiter's gradients were ready, frontier, waiters,
    members behind) of the stall ``view`` shows (None: none, or no timeout)."""
    limit = step_threshold(view)
    if limit is None:
        return None
    sides = _sides(view, now)
    if sides is None:
        return None
    frontier, waiters, behind = sides
    latest = max(_waited_since(view.progress[w]) for w in waiters)
    return limit, latest, frontier, waiters, behind


def stalled(view: JobView, now: datetime) -> Stall | None:
    """The stall of ``view``'s world at ``now``, once every waiter waited past the step
    timeout (None: none)."""
    shown = _shown(view, now)
    if shown is None:
        return None
    limit, latest, frontier, waiters, behind = shown
    waited = (now - latest).total_seconds()
    if waited < limit.seconds:
        return None
    return Stall(frontier, waited, tuple(sorted(waiters)), behind, limit)


def stall_deadline(view: JobView) -> datetime | None:
    """When the stall the view shows would pass the step timeout (None: it shows none; the
    evidence's freshness is for ``stalled`` to judge then)."""
    shown = _shown(view, None)
    return None if shown is None else shown[1] + timedelta(seconds=shown[0].seconds)
