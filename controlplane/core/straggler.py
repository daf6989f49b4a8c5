"""Slow ranks: which members of the world compute slower than the job, and what it costs.

In synchronous data parallelism a slow rank makes every rank's step slow: the others wait for
it in their collectives. Only the time a rank spends computing, apart from time blocked in
collectives, singles it out. Each member reports it on its heartbeats (the mean compute time
of the steps since the previous one: ``MemberHeartbeat.compute_seconds``; the session measures
a step from its start to the moment the rank's last gradient is ready, before the wait for the
gradients' all-reduce, see ``rank_runtime.session``). The control plane's table keeps each
member's *sustained* compute time: the least per-heartbeat mean over ``slow_window_s`` (known
once its heartbeats of the current generation cover the whole window, with at least
``MIN_SAMPLES`` of them), and the liveness summaries record it (``JobView.compute``).

A member is slow when its sustained compute time is above the *threshold*: the largest of
``(1 + slow_ratio)`` times the *baseline*, the baseline plus ``slow_mad_k`` scaled median
absolute deviations, and the baseline plus ``MIN_EXTRA_S`` (the reports' resolution is a
millisecond), the baseline being the median of the other members' sustained compute times
(at least ``MIN_PEERS`` of them). Since the sustained value is the least over the window,
every heartbeat of the window was above the threshold: one slow step (a hiccup) raises one
heartbeat's mean and never the least, so it is never acted on.

What follows is the policy's (``slow_action``): ``ignore`` records it; ``replace`` takes it out
of the world for a warm spare, when the goodput it is projected to cost over
``slow_horizon_s`` exceeds what a recovery costs. Projected loss: each step takes at least the
slow member's compute time, of which ``compute - baseline`` is lost, so the job loses at most
``horizon * (compute - baseline) / compute`` seconds of training. Recovery cost: the job's mean
downtime over its resolved fault incidents (``slow_recovery_s`` before it had one), plus the
steps since the newest complete backup, to compute again, at the baseline's time per step.

Pure: the view and the time are arguments.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from controlplane.core.view import JobView, MemberStatus

#: Other members with a sustained compute time a baseline needs.
MIN_PEERS = 2
#: Heartbeats with a compute time a window needs before its least counts as sustained.
MIN_SAMPLES = 3
#: The median absolute deviation of a normal distribution, in standard deviations.
MAD_SCALE = 1.4826
#: The least a member must compute above the baseline to be slow, seconds. Compute times
#: travel on the millisecond (a node's relayed heartbeats, ``compute_ms``): a model whose
#: step computes in under a millisecond reads 0 on one rank and 0.001 on another, which no
#: ratio may take for a member twice as slow.
MIN_EXTRA_S = 0.005


@dataclass(frozen=True, slots=True)
class Baseline:
    """The job's compute time per step, from the members other than the one judged."""

    median_s: float
    mad_s: float
    threshold_s: float
    peers: int


@dataclass(frozen=True, slots=True)
class Slow:
    """A member found slow, the evidence, and what the policy makes of it."""

    member: str
    rank: int
    compute_s: float
    baseline: Baseline
    window_s: float
    #: The ``liveness.summary`` that recorded its compute time (position, time).
    position: int | None
    at: datetime
    action: str
    projected_loss_s: float
    recovery_cost_s: float
    reason: str


def baseline(others: Sequence[float], ratio: float, mad_k: float) -> Baseline:
    """The baseline of ``others`` (at least one value) and the threshold above it."""
    median = statistics.median(others)
    mad = statistics.median([abs(v - median) for v in others]) * MAD_SCALE
    threshold = max(median * (1.0 + ratio), median + mad_k * mad, median + MIN_EXTRA_S)
    return Baseline(median, mad, threshold, len(others))


def recovery_cost(view: JobView, step_s: float) -> tuple[float, str]:
    """What replacing a member is expected to cost, seconds, and how it was estimated."""
    downtimes = [
        i.downtime_s
        for i in view.incidents.values()
        if i.kind == "fault" and i.downtime_s is not None
    ]
    policy = view.effective_policy
    if downtimes:
        downtime = statistics.fmean(downtimes)
        how = f"the job's mean downtime {downtime:.2f}s over {len(downtimes)} incident(s)"
    else:
        downtime = policy.slow_recovery_s
        how = f"slow_recovery_s {downtime:g}s (no recovery measured yet)"
    backed = view.last_complete_backup
    lost = max(0, view.last_step - backed) if backed is not None else view.last_step
    return downtime + lost * step_s, f"{how} + {lost} step(s) since the last backup"


def judge(view: JobView, now: datetime, spares: int) -> list[Slow]:
    """Every member of the current world found slow and not yet recorded as slow in this
    generation (``member.slow``), with the action the policy takes (``spares``: warm spares
    that could replace one; each ``replace`` takes one)."""
    policy = view.effective_policy
    if policy.slow_window_s <= 0:
        return []
    generation = view.generation
    # A value older than a window and an interval summary is no longer the member's.
    stale_s = policy.slow_window_s + policy.liveness_summary_interval_s
    members, compute, recorded = view.members, view.compute, view.slow
    known: dict[str, float] = {}
    for member_id in view.world:
        member = members.get(member_id)
        value = compute.get(member_id)
        if (
            member is None
            or member.rank is None
            or member.status is not MemberStatus.ACTIVE
            or member.detected_position is not None
            or value is None
            or value.generation != generation
            or (now - value.at).total_seconds() > stale_s
        ):
            continue
        known[member_id] = value.compute_s
    if len(known) < MIN_PEERS + 1:
        return []
    out: list[Slow] = []
    for member_id, seconds in known.items():
        mark = recorded.get(member_id)
        if mark is not None and mark.generation == generation:
            continue
        others = [v for m, v in known.items() if m != member_id]
        base = baseline(others, policy.slow_ratio, policy.slow_mad_k)
        if seconds <= base.threshold_s:
            continue
        out.append(_slow(view, member_id, seconds, base, spares))
        if out[-1].action == "replace":
            spares -= 1
    return out


def _slow(view: JobView, member_id: str, seconds: float, base: Baseline, spares: int) -> Slow:
    policy = view.effective_policy
    member = view.members[member_id]
    assert member.rank is not None
    value = view.compute[member_id]
    extra = seconds - base.median_s
    share = extra / seconds if seconds > 0 else 0.0
    loss = policy.slow_horizon_s * share
    cost, how = recovery_cost(view, base.median_s)
    found = (
        f"{member_id} (rank {member.rank}) computes {seconds:.3f}s a step over"
        f" {value.window_s:g}s against the job's {base.median_s:.3f}s (median of"
        f" {base.peers}, MAD {base.mad_s:.3f}s; threshold {base.threshold_s:.3f}s): each step"
        f" waits {extra:.3f}s for it, {share:.0%} of the job's time"
    )
    weighed = (
        f"over slow_horizon_s {policy.slow_horizon_s:g}s that loses {loss:.1f}s of training;"
        f" a replacement costs {cost:.1f}s ({how})"
    )
    if policy.slow_action == "ignore":
        action, why = "ignore", "slow_action ignore: recorded only"
    elif spares <= 0:
        action, why = "ignore", f"{weighed}, but no warm spare can take its rank"
    elif loss <= cost:
        action, why = "ignore", f"{weighed}: not worth it"
    else:
        action, why = "replace", f"{weighed}: replace it with a spare"
    return Slow(
        member_id, member.rank, seconds, base, value.window_s, value.position, value.at,
        action, loss, cost, f"{found}; {why}",
    )  # fmt: skip
