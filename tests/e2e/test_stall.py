"""A stalled rank, with real processes, NATS and PostgreSQL: a rank whose loop stops for good
after a step while its heartbeats go on (``stall@STEP``) is found by where its peers wait for
it (their gradients of the next step ready, its own not) once they waited past the step
timeout, long before the collective timeout would fail them all, and the spare takes its rank;
the job goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from schemas.common import FaultReason
from tests.integration.helpers import running_controlplane, terminate, wait_until

pytestmark = pytest.mark.usefixtures("clean_stream")

ROOT = Path(__file__).resolve().parents[2]
JOB_SCRIPT = str(ROOT / "tests" / "e2e" / "jobs" / "device_time.py")
STALL_STEP = 40
STEP_TIMEOUT_S = 3.0
#: Steps of the new generation the test waits for.
STEPS_AFTER = 20
POLICY = (
    "backup_interval=10,redundancy=1,heartbeat_interval_s=0.25,liveness_summary_interval_s=2,"
    f"step_timeout_s={STEP_TIMEOUT_S:g}"
)


def _events(store: PostgresEventStore, job_id: str, type_: str) -> list:  # type: ignore[type-arg]
    return list(store.read(job_id=job_id, types=[type_]))


async def test_a_stalled_rank_is_found_by_its_waiting_peers_and_replaced(
    settings: Settings, pg_store
):
    job_id = f"job-stall-{uuid.uuid4().hex[:6]}"
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", "3", "--spares", "1",
        "--nodes", "4", "--racks", "2", "--job-id", job_id, "--policy", POLICY,
        "--fault", f"stall@{STALL_STEP}:rank=1", JOB_SCRIPT, "--steps", "100000",
        "--device-ms", "20",
    ]  # fmt: skip
    env = {**os.environ, "ELASTIC_NATS_URL": settings.nats_url, "ELASTIC_LOG_LEVEL": "WARNING"}

    def resumed_steps() -> int:
        started = _events(pg_store, job_id, "generation.started")
        if len(started) < 2:
            return 0
        first = started[1].event.payload.world[0]
        return sum(
            1
            for s in _events(pg_store, job_id, "train.step")
            if s.event.generation == 2 and s.event.source.endswith(f"/{first}")
        )

    async with running_controlplane(settings):
        proc = subprocess.Popen(command, env=env, cwd=ROOT)
        try:
            await wait_until(
                lambda: resumed_steps() >= STEPS_AFTER or proc.poll() is not None,
                240,
                "the stalled rank's replacement and the steps after it",
            )
        finally:
            terminate(proc)
    for s in pg_store.read(job_id=job_id):
        if s.event.source == "controlplane" and s.event.type not in (
            "liveness.summary", "backup.catalog",
        ):  # fmt: skip
            print(s.position, s.event.type, getattr(s.event.payload, "detail", ""))
    assert pg_store.count_dead_letters() == 0, pg_store.dead_letters()[:3]
    started = [s.event.payload for s in _events(pg_store, job_id, "generation.started")]
    assert len(started) >= 2, "the stalled rank was not replaced"
    world1, world2 = started[0].world, started[1].world
    stuck = world1[1]

    detected, *later = _events(pg_store, job_id, "fault.detected")
    p = detected.event.payload
    assert p.reason is FaultReason.STALLED and p.members == [stuck], p
    assert f"finished step {STALL_STEP}" in p.detail
    assert f"gradient of step {STALL_STEP + 1} ready" in p.detail
    [threshold] = p.thresholds
    assert threshold.seconds == STEP_TIMEOUT_S and threshold.mode == "fixed"
    # Once the test stops the launcher, its members' exits may be detected too.
    assert all(d.event.payload.reason is FaultReason.EXITED for d in later), later
    realloc, *_ = _events(pg_store, job_id, "reallocation.issued")
    assert realloc.event.payload.mode.value == "replace"
    assert stuck not in world2 and world2[1] == "s0"

    # Found past the step timeout after the stall's step (rank 0's record of it), and long
    # before the collective timeout (60 s) would have failed every peer.
    rank0 = world1[0]
    [stalled_step] = [
        s
        for s in _events(pg_store, job_id, "train.step")
        if s.event.generation == 1
        and s.event.source.endswith(f"/{rank0}")
        and s.event.payload.step == STALL_STEP
    ]
    found_s = (detected.recorded_at - stalled_step.recorded_at).total_seconds()
    print(f"stalled rank found {found_s:.2f} s after its last step")
    assert STEP_TIMEOUT_S <= found_s < STEP_TIMEOUT_S + 5, found_s
