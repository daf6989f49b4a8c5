"""Heartbeat timeouts per phase: the policy's fixed ones, or derived from the gaps the log shows.

With ``heartbeat_timeout_mode`` ``auto`` a phase's timeout follows the heartbeat gaps the
job's interval ``liveness.summary`` events recorded in that phase over the last
``heartbeat_timeout_window_s``: ``k`` times their ``quantile`` (nearest rank), clamped to
``[floor, ceiling]``. A phase with fewer than ``heartbeat_timeout_min_gaps`` gaps keeps its
fixed timeout. The gaps are what the log records, so the fold derives the timeouts
(``JobView.thresholds``) and a replay of the log derives the same ones.

What a summary says of each member is its largest gap in the window (one observation per
member and window), in the phase the member was in when that gap began (the summary's
``max_gap_phase``; the phase it last reported, in summaries recorded before); the members
it names as heard regularly (``RegularMembers``) count at their largest gap (the bound, in a
summary recorded before that was kept): an upper bound, so a derived timeout errs long. A
decision's summary is not counted: the next interval summary covers its window again.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from schemas.common import Phase
from schemas.events import JobPolicy


class Threshold(NamedTuple):
    """A phase's heartbeat timeout and how it was derived."""

    phase: Phase
    seconds: float
    mode: str  # "fixed" | "auto" (derived from gaps)
    how: str
    gaps: int = 0
    quantile: float | None = None
    gap_s: float | None = None
    k: float | None = None
    floor_s: float | None = None
    ceiling_s: float | None = None


class GapSample(NamedTuple):
    """The gaps (milliseconds, count) one interval summary showed in one phase."""

    at: datetime
    phase: Phase
    gaps: tuple[tuple[int, int], ...]


def fixed_seconds(policy: JobPolicy, phase: Phase) -> float:
    """The policy's fixed timeout of ``phase`` (a phase not listed falls back to train)."""
    timeouts = policy.heartbeat_timeout_s
    return timeouts.get(phase, timeouts.get(Phase.TRAIN, 5.0))


def fixed(policy: JobPolicy, phase: Phase, note: str = "") -> Threshold:
    """The policy's fixed timeout of ``phase`` as a threshold."""
    seconds = fixed_seconds(policy, phase)
    return Threshold(phase, seconds, "fixed", f"fixed policy {seconds:g}s{note}")


def samples_of(summary: Any, members: Mapping[str, Any]) -> list[GapSample]:
    """The gaps an interval ``liveness.summary`` payload shows, per phase, of ``members``'
    current processes (a member assumed heard, or with no gap in the window, shows none)."""
    counts: dict[Phase, dict[int, int]] = {}

    def add(phase: Phase, gap_ms: int, count: int = 1) -> None:
        per = counts.setdefault(phase, {})
        per[gap_ms] = per.get(gap_ms, 0) + count

    for entry in summary.members:
        current = members.get(entry.member)
        if current is None or current.incarnation != entry.incarnation or entry.assumed:
            continue
        gap_ms = round(entry.max_gap_s * 1000)
        if gap_ms > 0:
            add(entry.phase, gap_ms)
    columns = summary.columns
    if columns is not None:
        assumed = set(columns.assumed)
        began = columns.max_gap_phase
        for i, (member, gap_ms, phase) in enumerate(
            zip(columns.members, columns.max_gap_ms, columns.phase, strict=True)
        ):
            if gap_ms > 0 and i not in assumed and member in members:
                add(began[i] or phase if began is not None else phase, gap_ms)
    regular = summary.regular
    if regular is not None:
        named = sum(1 for m in regular.members if m in members)
        gap_ms = regular.max_gap_ms if regular.max_gap_ms is not None else regular.bound_ms
        if named and gap_ms > 0:
            add(regular.phase, gap_ms, named)
    return [
        GapSample(summary.at, phase, tuple(sorted(per.items())))
        for phase, per in sorted(counts.items())
    ]


def window(
    samples: Iterable[GapSample],
    new: Iterable[GapSample],
    at: datetime,
    policy: JobPolicy,
    window_s: float | None = None,
) -> tuple[GapSample, ...]:
    """``samples`` and ``new``, less those older than the window before ``at`` (``window_s``,
    default the policy's ``heartbeat_timeout_window_s``)."""
    if window_s is None:
        window_s = policy.heartbeat_timeout_window_s
    since = at - timedelta(seconds=window_s)
    return tuple(s for s in (*samples, *new) if s.at >= since)


def quantile_ms(gaps: Iterable[tuple[int, int]], q: float) -> tuple[int, int]:
    """The nearest-rank ``q`` quantile of the (gap, count) multiset, and its size."""
    merged: dict[int, int] = {}
    for gap, count in gaps:
        merged[gap] = merged.get(gap, 0) + count
    total = sum(merged.values())
    if total == 0:
        return 0, 0
    rank = max(1, math.ceil(q * total))
    seen = 0
    for gap in sorted(merged):
        seen += merged[gap]
        if seen >= rank:
            return gap, total
    return max(merged), total  # pragma: no cover  (rank <= total)


def derive(samples: Iterable[GapSample], policy: JobPolicy) -> dict[Phase, Threshold]:
    """Every phase's threshold from ``samples`` under an ``auto`` policy."""
    by_phase: dict[Phase, list[tuple[int, int]]] = {}
    for sample in samples:
        by_phase.setdefault(sample.phase, []).extend(sample.gaps)
    k, q = policy.heartbeat_timeout_k, policy.heartbeat_timeout_quantile
    least = policy.heartbeat_timeout_min_gaps
    out: dict[Phase, Threshold] = {}
    for phase in Phase:
        floor, ceiling = policy.heartbeat_floor(phase), policy.heartbeat_ceiling(phase)
        gap_ms, count = quantile_ms(by_phase.get(phase, ()), q)
        if count < least:
            out[phase] = fixed(
                policy, phase,
                f" (auto: {count} gaps in phase {phase.value}, fewer than {least})",
            )  # fmt: skip
            continue
        gap_s = gap_ms / 1000
        seconds, clamp = _clamped(k * gap_s, floor, ceiling)
        how = (
            f"timeout {seconds:g}s = {k:g} x {_q(q)} gap {gap_s:g}s over {count} gaps in phase"
            f" {phase.value}, within [{floor:g}, {ceiling:g}]{clamp}"
        )
        out[phase] = Threshold(phase, seconds, "auto", how, count, q, gap_s, k, floor, ceiling)
    return out


def _clamped(raw: float, floor: float, ceiling: float) -> tuple[float, str]:
    """``raw`` within ``[floor, ceiling]``, and what the clamp did, in words ("" for nothing)."""
    clamp = (
        f", raised to the floor {floor:g}s" if raw < floor
        else f", cut to the ceiling {ceiling:g}s" if raw > ceiling
        else ""
    )  # fmt: skip
    return min(max(raw, floor), ceiling), clamp


def _q(q: float) -> str:
    return "max" if q >= 1 else f"p{q * 100:g}"


def step_samples_of(summary: Any, members: Mapping[str, Any]) -> list[GapSample]:
    """The longest steps an interval ``liveness.summary`` payload shows (each member's
    longest step finished in the window, milliseconds; the members it names as regular at
    their bound, ``RegularMembers.max_step_ms``: an upper bound, so a derived timeout errs
    long), as one sample of phase train (steps are trained)."""
    per: dict[int, int] = {}
    for entry in summary.members:
        ms = round(entry.max_step_s * 1000)
        if ms > 0 and entry.member in members:
            per[ms] = per.get(ms, 0) + 1
    columns = summary.columns
    if columns is not None:
        for member, ms in zip(columns.members, columns.max_step_ms, strict=True):
            if ms > 0 and member in members:
                per[ms] = per.get(ms, 0) + 1
    regular = summary.regular
    if regular is not None and regular.max_step_ms > 0:
        named = sum(1 for m in regular.members if m in members)
        if named:
            per[regular.max_step_ms] = per.get(regular.max_step_ms, 0) + named
    return [GapSample(summary.at, Phase.TRAIN, tuple(sorted(per.items())))] if per else []


def fixed_step(policy: JobPolicy, note: str = "") -> Threshold | None:
    """The policy's fixed step timeout (None: ``step_timeout_s`` 0, never looked for)."""
    seconds = policy.step_timeout_s
    if seconds <= 0:
        return None
    return Threshold(Phase.TRAIN, seconds, "fixed", f"fixed step timeout {seconds:g}s{note}")


def derive_step(samples: Iterable[GapSample], policy: JobPolicy) -> Threshold | None:
    """The step timeout from ``samples`` under an ``auto`` policy: ``step_timeout_k`` times
    the ``step_timeout_quantile`` of the longest steps, within the floor and the ceiling;
    the fixed one below ``step_timeout_min_steps`` of them."""
    k, q = policy.step_timeout_k, policy.step_timeout_quantile
    floor, ceiling = policy.step_timeout_floor_s, policy.step_timeout_ceiling_s
    least = policy.step_timeout_min_steps
    step_ms, count = quantile_ms((g for s in samples for g in s.gaps), q)
    if count < least:
        return fixed_step(policy, f" (auto: {count} steps recorded, fewer than {least})")
    step_s = step_ms / 1000
    seconds, clamp = _clamped(k * step_s, floor, ceiling)
    how = (
        f"step timeout {seconds:g}s = {k:g} x {_q(q)} step {step_s:g}s over {count} longest"
        f" steps, within [{floor:g}, {ceiling:g}]{clamp}"
    )
    return Threshold(Phase.TRAIN, seconds, "auto", how, count, q, step_s, k, floor, ceiling)
