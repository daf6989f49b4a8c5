"""A slow rank, with real processes, NATS and PostgreSQL: a rank made 50% slower is recorded as
slow within 30 s and replaced by the spare, after which the job's steps take what they took
before; a single slow step of another rank is never acted on."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from controlplane.core.fold import fold_noting
from controlplane.core.goodput import GoodputCounter, goodput
from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from schemas.common import FaultReason
from tests.integration.helpers import running_controlplane, terminate, wait_until

pytestmark = pytest.mark.usefixtures("clean_stream")

ROOT = Path(__file__).resolve().parents[2]
#: A small DDP job whose forward takes 40 ms of "device" time (a sleep) besides its CPU work,
#: as an accelerator's would: four ranks of CPU compute on two cores are bound by the cores,
#: so a slower rank's sleep would free a core for the others and hide in the step time.
JOB_SCRIPT = str(ROOT / "tests" / "e2e" / "jobs" / "device_time.py")
#: The step rank 1 becomes 50% slower at, and the one step rank 2 is slow at (a hiccup).
SLOW_STEP = 150
HICCUP_STEP = 60
#: Steps of the new generation the test waits for after the replacement.
STEPS_AFTER = 120
WINDOW_S = 5.0
HEARTBEAT_S = 0.25
POLICY = (
    f"backup_interval=10,redundancy=1,heartbeat_interval_s={HEARTBEAT_S:g},"
    "liveness_summary_interval_s=2,"
    f"slow_window_s={WINDOW_S:g},slow_action=replace"
)
#: A step that is mostly compute (a large batch of a small model: little to all-reduce), so
#: that a 50% slower rank shows in the job's step time.
MODEL = ["--device-ms", "40"]


def _events(store: PostgresEventStore, job_id: str, type_: str) -> list:  # type: ignore[type-arg]
    return list(store.read(job_id=job_id, types=[type_]))


async def test_a_slow_rank_is_flagged_and_replaced_and_a_hiccup_is_not(
    settings: Settings, pg_store
):
    job_id = f"job-slow-{uuid.uuid4().hex[:6]}"
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", "4", "--spares", "1",
        "--nodes", "4", "--racks", "2", "--job-id", job_id, "--policy", POLICY,
        "--fault", f"slow@{SLOW_STEP}:rank=1:1.5", "--fault", f"slow@{HICCUP_STEP}:rank=2:1s",
        JOB_SCRIPT, "--steps", "100000", *MODEL,
    ]  # fmt: skip
    env = {**os.environ, "ELASTIC_NATS_URL": settings.nats_url, "ELASTIC_LOG_LEVEL": "WARNING"}

    def resumed_steps() -> int:
        started = _events(pg_store, job_id, "generation.started")
        if len(started) < 2:
            return 0
        first = started[1].event.payload.world[0]
        g2 = [
            s
            for s in _events(pg_store, job_id, "train.step")
            if s.event.generation == 2 and s.event.source.endswith(f"/{first}")
        ]
        return len(g2)

    async with running_controlplane(settings):
        proc = subprocess.Popen(command, env=env, cwd=ROOT)
        try:
            await wait_until(
                lambda: resumed_steps() >= STEPS_AFTER or proc.poll() is not None,
                300,
                "the slow rank's replacement and the steps after it",
            )
        finally:
            terminate(proc)
    decisions = [
        (s.position, s.event.type, getattr(s.event.payload, "reason", ""),
         getattr(s.event.payload, "detail", ""))
        for s in pg_store.read(job_id=job_id)
        if s.event.source == "controlplane"
        and s.event.type not in ("liveness.summary", "backup.catalog")
    ]  # fmt: skip
    for decision in decisions:
        print(*decision)
    assert pg_store.count_dead_letters() == 0, pg_store.dead_letters()[:3]
    started = [s.event.payload for s in _events(pg_store, job_id, "generation.started")]
    assert len(started) >= 2, "the slow rank was not replaced"
    world1, world2 = started[0].world, started[1].world
    slow_member, hiccup_member = world1[1], world1[2]

    # Recorded once, for the slow rank only: the hiccup of rank 2 (one step 1 s slower) never.
    [slow] = _events(pg_store, job_id, "member.slow")
    p = slow.event.payload
    assert (p.member, p.rank, p.action) == (slow_member, 1, "replace")
    assert p.compute_s > p.threshold_s >= p.baseline_s * 1.2
    assert hiccup_member != p.member
    # ... with its evidence in the log before it, and a replacement by the spare.
    assert p.evidence.position is not None and p.evidence.position < slow.position
    # (Once the test stops the launcher, its members' exits may be detected too.)
    detected, *stopped = _events(pg_store, job_id, "fault.detected")
    assert all(
        d.event.payload.reason is FaultReason.EXITED and "signal 15" in d.event.payload.detail
        for d in stopped
    ), stopped
    assert detected.event.payload.reason is FaultReason.SLOW
    assert detected.event.payload.members == [slow_member]
    realloc, *_ = _events(pg_store, job_id, "reallocation.issued")
    assert realloc.event.payload.mode.value == "replace"
    assert world2[1] == "s0" and slow_member not in world2

    # Flagged within 30 s of the slowdown's onset: the start of its first slow step, when
    # rank 0 reported the step before. No sooner than the window, but for a heartbeat's
    # interval: the first heartbeat that carries a slow step's compute time covers the steps
    # since the one before it, which may have been sent up to an interval before the onset.
    rank0 = world1[0]
    steps1 = {
        s.event.payload.step: s
        for s in _events(pg_store, job_id, "train.step")
        if s.event.generation == 1 and s.event.source.endswith(f"/{rank0}")
    }
    onset = steps1[SLOW_STEP - 1].event.emitted_at
    flagged_s = (slow.event.emitted_at - onset).total_seconds()
    assert WINDOW_S - HEARTBEAT_S <= flagged_s < 30, flagged_s

    # The job's step time: before the slowdown (after the hiccup's step), while slow, and
    # in the new generation (from its tenth step on, past the rebuild's warm-up).
    def median_step(records: list) -> float:  # type: ignore[type-arg]
        return statistics.median(r.event.payload.step_seconds for r in records)

    before = median_step([steps1[n] for n in range(HICCUP_STEP + 10, SLOW_STEP) if n in steps1])
    flagged_step = max(n for n, s in steps1.items() if s.recorded_at <= slow.recorded_at)
    during = median_step([steps1[n] for n in range(SLOW_STEP + 5, flagged_step) if n in steps1])
    first2 = world2[0]
    steps2 = sorted(
        (
            s
            for s in _events(pg_store, job_id, "train.step")
            if s.event.generation == 2 and s.event.source.endswith(f"/{first2}")
        ),
        key=lambda s: s.event.payload.step,
    )
    after = median_step(steps2[10:])
    print(
        f"slow rank flagged {flagged_s:.1f} s after its first slow step; job step time"
        f" {before * 1e3:.1f} ms before, {during * 1e3:.1f} ms slow, {after * 1e3:.1f} ms after"
        f" the replacement (compute {p.compute_s * 1e3:.1f} ms against a baseline of"
        f" {p.baseline_s * 1e3:.1f} ms)"
    )
    assert during > before * 1.15, (before, during)
    assert abs(after - before) <= 0.1 * before, (before, after)

    # Goodput: the steps the slow rank held up, from its detection window on, are the
    # stragglers term (each waited about its compute time less the baseline), never more than
    # the time it was slow (its first slow step to generation 1's last step).
    log = pg_store.read(job_id=job_id)
    view, ignored = fold_noting(None, log)
    counter = GoodputCounter()
    counter.count(log, ignored)
    found = goodput(view, counter, log[-1].recorded_at)
    assert found is not None
    waited = found.seconds["stragglers"]
    slow_for = (max(s.event.emitted_at for s in steps1.values()) - onset).total_seconds()
    steps_in_window = sum(
        1
        for s in steps1.values()
        if s.recorded_at >= slow.recorded_at - timedelta(seconds=p.window_s)
        and s.recorded_at <= slow.recorded_at
    )
    print(
        f"stragglers {waited:.2f} s of {found.wall_s:.1f} s (the window's {steps_in_window}"
        f" steps at {(p.compute_s - p.baseline_s) * 1e3:.1f} ms: about"
        f" {steps_in_window * (p.compute_s - p.baseline_s):.2f} s)"
    )
    assert 0 < waited <= slow_for, (waited, slow_for)
    assert sum(found.seconds.values()) == pytest.approx(found.wall_s)
    assert found.generations[0].seconds["stragglers"] == pytest.approx(waited)
