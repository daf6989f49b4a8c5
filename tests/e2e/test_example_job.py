"""The example trained by real processes under the launcher, with NATS, PostgreSQL and the
control plane: replicated backups where the control plane placed them, heartbeats through a
slow step, silence from a stopped rank."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from controlplane.core.catalog import unpacked
from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from schemas.common import JobState
from tests.integration.helpers import running_controlplane, terminate, wait_until

pytestmark = pytest.mark.usefixtures("clean_stream")

ROOT = Path(__file__).resolve().parents[2]
#: The hang test's heartbeat interval and train-phase timeout: sub-second heartbeats (soft
#: state, no write each) and hang detection in about a second.
INTERVAL_S = 0.25
TIMEOUT_S = 1.0
#: The step after which rank 2 stops (SIGSTOP): in the train phase, past a backup, a second
#: or more into training, so that the control plane heard it beat in training (15 steps take
#: about 0.4 s: a rank that joined last could hang before one of its beats was taken, and
#: the evidence would rightly be its join).
HANG_STEP = 60
EXAMPLE = str(ROOT / "examples" / "train.py")


def launch(
    settings: Settings, job_id: str, *, steps: int, faults: list[str], policy: str
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", "4", "--spares", "1",
        "--nodes", "4", "--racks", "2", "--job-id", job_id, "--policy", policy,
    ]  # fmt: skip
    for fault in faults:
        command += ["--fault", fault]
    command += [EXAMPLE, "--steps", str(steps)]
    env = {**os.environ, "ELASTIC_NATS_URL": settings.nats_url, "ELASTIC_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(command, env=env, cwd=ROOT)


def of(store: PostgresEventStore, job_id: str, type_: str, member: str | None = None) -> list:  # type: ignore[type-arg]
    # Backup reports come back as their members sent them, also those packed in catalogs.
    events = unpacked(store.read(job_id=job_id, types=[type_, "backup.catalog"]))
    return [
        s for s in events if s.event.type == type_ and (member is None or s.event.member == member)
    ]


async def test_four_ranks_and_a_spare_train_with_backups_where_they_were_placed(settings, pg_store):
    job_id = f"job-ex-{uuid.uuid4().hex[:6]}"
    async with running_controlplane(settings) as cp:
        proc = launch(
            settings, job_id, steps=40, faults=["slow@12:rank=1:2s"],
            policy="backup_interval=10,redundancy=2,heartbeat_interval_s=0.2,"
                   "liveness_summary_interval_s=1",
        )  # fmt: skip
        try:
            await wait_until(lambda: proc.poll() is not None, 180, "the job to finish")
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0
        view = cp.views[job_id]
        assert view.state is JobState.COMPLETED

    [started] = [s.event.payload for s in of(pg_store, job_id, "generation.started")]
    assert len(started.world) == 4 and "s0" not in started.world
    assert pg_store.count_dead_letters() == 0, pg_store.dead_letters()[:3]
    racks = {m.member_id: m.rack for m in view.members.values()}
    # One record per rank per backup: each owner names the holders that kept its copy.
    assert of(pg_store, job_id, "backup.replicated") == []
    # Every backup step: every shard snapshotted and kept on exactly its placed holders.
    for step in (10, 20, 30, 40):
        snapshots = {
            s.event.payload.shard: s.event.payload
            for s in of(pg_store, job_id, "backup.snapshot")
            if s.event.payload.step == step
        }
        assert sorted(snapshots) == [0, 1, 2, 3]
        for shard, holders in enumerate(started.placement):
            assert sorted(snapshots[shard].holders) == sorted(holders), (step, shard)
            owner = started.world[shard]
            assert {racks[owner], *(racks[h] for h in holders)} == {"rack0", "rack1"}
    # The control plane's catalog agrees: its newest steps are complete.
    assert view.last_complete_backup == 40
    assert all(view.backups[s].is_complete(2) for s in (30, 40))

    # Training worked, on the same samples everywhere. The log holds one step record per step
    # for the job (rank 0's) and each other rank's first step of the generation only.
    first = started.world[0]
    losses = [s.event.payload.loss for s in of(pg_store, job_id, "train.step", first)]
    assert len(losses) == 40 and losses[-1] < losses[0] * 0.5
    for other in started.world[1:]:
        assert [s.event.payload.step for s in of(pg_store, job_id, "train.step", other)] == [1]

    # Heartbeats went on through rank 1's slow step (2 s after step 12): heartbeats are soft
    # state, and the summaries (one a second here) of the windows inside that step show
    # its heartbeats, none more than a few intervals apart. The job's step 13 (rank 0's,
    # waiting for rank 1 in its collectives) took those 2 s, and the summaries say so.
    slow = started.world[1]
    [after12] = [s for s in of(pg_store, job_id, "train.step", first) if s.event.payload.step == 12]
    [after13] = [s for s in of(pg_store, job_id, "train.step", first) if s.event.payload.step == 13]
    assert (after13.event.emitted_at - after12.event.emitted_at).total_seconds() >= 1.9
    assert after13.event.payload.step_seconds >= 1.9
    assert of(pg_store, job_id, "member.heartbeat") == []
    step_times = {
        entry.member: entry.max_step_s
        for s in of(pg_store, job_id, "liveness.summary")
        for entry in s.event.payload.rows()
        if entry.max_step_s >= 1.9
    }
    assert first in step_times, "no summary saw rank 0's 2 s step"
    inside = [
        (s.event.payload.regular, entry)
        for s in of(pg_store, job_id, "liveness.summary")
        if s.event.payload.since is not None
        and after12.event.emitted_at < s.event.payload.since
        and s.event.payload.at < after13.event.emitted_at
        for entry in s.event.payload.rows()
        if entry.member == slow
    ]
    assert inside, "no summary window inside the slow step"
    # Listed in full, or named as regular: no silence over the bound (two intervals).
    assert all(
        regular.bound_ms < 600
        if regular is not None and slow in regular.members
        else e.beats >= 3 and e.max_gap_s < 0.6
        for regular, e in inside
    ), inside


async def test_a_stopped_rank_falls_silent_and_is_detected(settings, pg_store):
    job_id = f"job-hang-{uuid.uuid4().hex[:6]}"
    policy = (
        f"backup_interval=10,redundancy=2,heartbeat_interval_s={INTERVAL_S},"
        f'heartbeat_timeout_s={{"init":30,"train":{TIMEOUT_S},"waiting":10,"backup":10,'
        '"restore":10}'
    )
    async with running_controlplane(settings):
        proc = launch(
            settings, job_id, steps=100000, faults=[f"hang@{HANG_STEP}:rank=2"], policy=policy
        )
        try:
            await wait_until(
                lambda: of(pg_store, job_id, "fault.detected"), 120, "the hang to be detected"
            )
        finally:
            terminate(proc)
    started = of(pg_store, job_id, "generation.started")[0].event.payload
    hung = started.world[2]
    detected = of(pg_store, job_id, "fault.detected")[0]
    assert detected.event.payload.members == [hung]
    assert detected.event.payload.reason == "heartbeat_timeout"
    # The job's last step was the hang step (rank 0's step records; the hung rank stored
    # only its first step) ...
    job_steps = of(pg_store, job_id, "train.step", started.world[0])
    assert max(s.event.payload.step for s in job_steps) == HANG_STEP
    assert [s.event.payload.step for s in of(pg_store, job_id, "train.step", hung)] == [1]
    # Its last heartbeat the control plane heard (soft state: the evidence is the summary
    # recorded just before the decision), in the train phase: it hangs past a backup step,
    # after many heartbeats of its training.
    [evidence] = detected.event.payload.evidence
    assert evidence.what == "liveness.summary", evidence
    assert "in phase train" in detected.event.payload.detail
    assert evidence.position is not None and evidence.position < detected.position
    last = evidence.at
    assert last is not None
    silent = (detected.recorded_at - last).total_seconds()
    assert silent > TIMEOUT_S
    # The hang was detected within a fraction of a second of the timeout: the SIGSTOP came
    # right after its hang step (its last event), at most one heartbeat after its last one.
    stopped = max(s.event.emitted_at for s in job_steps)
    took = (detected.recorded_at - stopped).total_seconds()
    print(f"hang detected {took:.2f} s after the SIGSTOP ({silent:.2f} s after its last"
          f" heartbeat; timeout {TIMEOUT_S:g} s, heartbeats every {INTERVAL_S:g} s)")  # fmt: skip
    assert took < TIMEOUT_S + 1.0, took
    # ... while the others' heartbeats went on in that silence: the summary recorded just
    # before the decision heard each of them within a few intervals of it.
    [summary] = [s for s in of(pg_store, job_id, "liveness.summary")
                 if s.position == evidence.position]  # fmt: skip
    heard = {e.member: e for e in summary.event.payload.rows()}
    for other in (m for m in started.world if m != hung):
        gap = (summary.event.payload.at - heard[other].last_at).total_seconds()
        assert not heard[other].assumed and gap < 4 * INTERVAL_S, (other, gap)
    assert of(pg_store, job_id, "member.heartbeat") == []
