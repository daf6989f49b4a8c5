"""``elasticctl bench takeover``: a standby takes over from a leader killed on a long log.

The log first gets a *history*: as many rows as ``days`` of a job of ``ranks`` ranks writes in
this design (``history_rows_per_day``: one ``train.step`` a step at a step a second, a
``backup.catalog`` per 1,024 ranks every ten steps, an interval ``liveness.summary`` every
ten seconds, and each rank's ack, restore and resume at eight incidents a day, Llama 3's
rate on 16,384 GPUs), written as the rows of one finished job: its ``train.step`` records at
a step a second, and for the other rows the control plane's liveness summaries of its member
(valid events of the cheapest kinds to generate, so the log holds that many rows, not that
many bytes). The history's views are folded once and recorded as the leader would have
recorded them (``controlplane.snapshots``): a whole view snapshot at the history's end, and
a steps chunk (``core.steps``) for each snapshot interval of the history.

Then a job of ``ranks`` simulated members (as ``bench scale`` runs them: relayed heartbeats,
a step a second, backups) trains against a leader (``elasticctl serve``, its own process,
snapshots every ten seconds, a train timeout of 5 s: no hang is timed here) with a standby
beside it. Once a snapshot covers the running
job, the leader is killed (SIGKILL) and, at once, a member's crash is reported (its node's
launcher's ``member.exited``). What the report says:

- ``takeover_decision_s``: the kill to the commit of the standby's decision on that crash
  (``reallocation.issued``; PostgreSQL's commit time) — the lock passing over, the standby's
  start-up, its ingest and its first decision;
- ``standby_startup_s``, ``standby_started_from``, ``standby_tail_events``: what the
  standby's start-up folded, as it logs it;
- ``api_first_answer_s``: a cold start of ``elasticctl api`` to its first answer for the job
  (``GET /api/v1/jobs/{job}``), None when none came within ``api_wait_s``; then
  ``api_history_loss_s`` and ``api_history_loss_points``: its answer with the history job's
  loss curve (made of the snapshot's steps chunks);
- ``history_rows``, ``log_rows``, ``log_bytes``: the log the standby found.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import nats
import psycopg

from controlplane.bench import loadgen
from controlplane.bench.api import _start_api
from controlplane.bench.decide import _commit_times, _layout, _until_caught_up
from controlplane.bench.members import SimulatedJob
from controlplane.bench.scale import _Fleet
from controlplane.bench.stack import Stack, stack
from controlplane.bus import ensure_stream
from controlplane.core.fold import fold_noting
from controlplane.core.records import StoredEvent
from controlplane.core.snapshot import encode_view, fold_version
from controlplane.core.steps import JobSteps, encode_steps
from controlplane.core.view import JobView
from controlplane.devstack import free_port
from controlplane.settings import Settings, libpq_url
from controlplane.store.postgres import PostgresEventStore, encode_row
from schemas.commands import Reallocate
from schemas.common import CONTROLPLANE_SOURCE, Phase
from schemas.events import (
    EVENT_ADAPTER,
    EnvelopeBase,
    LivenessEntry,
    LivenessSummary,
    LivenessSummaryEvent,
    TrainStep,
    TrainStepEvent,
)
from schemas.ids import new_event_id
from schemas.subjects import command_subject

#: Incidents a day (Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs).
INCIDENTS_PER_DAY = 8
#: The history job's rows before its steps (registration, join, first generation).
_HEAD_ROWS = 3
#: Seconds between the leader's view snapshots of the history (the service's default).
SNAPSHOT_INTERVAL_S: float = Settings.model_fields["snapshot_interval_s"].default
#: History rows written per COPY.
_CHUNK = 50_000


class BenchTakeoverError(RuntimeError):
    """The benchmark could not run as asked."""


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def history_rows_per_day(ranks: int) -> int:
    """Rows a job of ``ranks`` ranks adds to the log in a day (see the module docstring)."""
    steps = 86_400
    catalogs = steps // 10 * math.ceil(ranks / 1024)
    summaries = 86_400 // 10
    recoveries = INCIDENTS_PER_DAY * 3 * ranks
    return steps + catalogs + summaries + recoveries


def _history_events(job_id: str, start: datetime) -> list[EnvelopeBase]:
    """The first events of the finished history job: its registration, its one member's
    join and its first generation (validated as a member's and the decider's are)."""
    node, member = "hist-n0", "h0"
    envelopes: list[dict[str, Any]] = [
        {"source": CONTROLPLANE_SOURCE, "type": "job.registered",
         "payload": {"name": "history", "policy": {"world_size": 1, "min_world": 1,
                                                   "redundancy": 0}}},
        {"source": f"{node}/{member}", "type": "member.joined",
         "payload": {"node": node, "rack": "hist-r0", "host": "hist-host", "pid": 1,
                     "role": "worker", "device": "cpu", "backup_endpoint": f"{node}:7000"}},
        {"source": CONTROLPLANE_SOURCE, "type": "generation.started", "generation": 1,
         "payload": {"generation": 1, "world": [member], "rendezvous": "tcp://history:1/1",
                     "placement": [[]]}},
    ]  # fmt: skip
    return [
        EVENT_ADAPTER.validate_json(json.dumps({
            "event_id": new_event_id(), "job_id": job_id, "v": 1, "incarnation": "hist",
            "seq": i, "generation": e.pop("generation", 0), "emitted_at": start.isoformat(), **e,
        }))
        for i, e in enumerate(envelopes, start=1)
    ]  # fmt: skip


def _rows(
    job_id: str, first: int, count: int, start: datetime, *, steps_per_row: float, spacing: float
) -> list[EnvelopeBase]:
    """History rows ``first`` to ``first + count`` (counted from the first after the head):
    the member's steps at a step a second, one every ``1 / steps_per_row`` rows, and the
    control plane's liveness summaries of it between them (built without validating again:
    the same shapes every time)."""
    out: list[EnvelopeBase] = []
    for row in range(first, first + count):
        step = math.floor((row + 1) * steps_per_row)
        if step > math.floor(row * steps_per_row):
            payload = TrainStep.model_construct(step=step, loss=1.0, step_seconds=1.0, samples=8)
            out.append(
                TrainStepEvent.model_construct(
                    event_id=new_event_id(), job_id=job_id, type="train.step", v=1,
                    source="hist-n0/h0", incarnation="hist", seq=step + 2, generation=1,
                    emitted_at=start + timedelta(seconds=step), payload=payload,
                )
            )  # fmt: skip
            continue
        at = start + timedelta(seconds=row * spacing)
        entry = LivenessEntry.model_construct(
            member="h0", node="hist-n0", incarnation="hist", generation=1, last_at=at,
            assumed=False, first_at=at - timedelta(seconds=10), beats=40, max_gap_s=0.3,
            max_gap_at=at, phase=Phase.TRAIN, step=step, max_step_s=1.0,
        )  # fmt: skip
        summary = LivenessSummary.model_construct(
            reason="interval", since=at - timedelta(seconds=10), at=at, part=1, parts=1,
            members=[entry], columns=None, regular=None,
        )  # fmt: skip
        out.append(
            LivenessSummaryEvent.model_construct(
                event_id=new_event_id(), job_id=job_id, type="liveness.summary", v=1,
                source=CONTROLPLANE_SOURCE, incarnation="hist", seq=row + 4, generation=1,
                emitted_at=at, payload=summary,
            )
        )  # fmt: skip
    return out


def _completed(job_id: str, step: int, start: datetime) -> EnvelopeBase:
    return EVENT_ADAPTER.validate_json(json.dumps({
        "event_id": new_event_id(), "job_id": job_id, "type": "job.completed", "v": 1,
        "source": CONTROLPLANE_SOURCE, "incarnation": "hist", "seq": 3, "generation": 1,
        "emitted_at": (start + timedelta(seconds=step)).isoformat(), "payload": {"step": step},
    }))  # fmt: skip


def write_history(database_url: str, rows: int, days: float, *, progress: bool) -> tuple[int, str]:
    """Write ``rows`` rows of a finished job spread over ``days`` before now, and record what
    a leader would have recorded of them: the view snapshot at their end, and the steps of
    each snapshot interval (``SNAPSHOT_INTERVAL_S``) as its chunk. Return the log's last
    position and the job's id."""
    job_id = f"history-{uuid.uuid4().hex[:8]}"
    start = datetime.now(UTC) - timedelta(days=days)
    head = _history_events(job_id, start)
    seconds = days * 86_400
    spacing = max(1e-3, seconds / max(1, rows))
    steps_per_row = min(1.0, seconds / max(1, rows - len(head) - 1))
    view: JobView | None = None
    position = 0
    copy_sql = (
        "COPY events (position, recorded_at, event_id, job_id, type, v, source, incarnation,"
        " seq, generation, emitted_at, payload) FROM STDIN"
    )
    #: (position, chunk) of every snapshot interval, and what the current one counted.
    chunks: list[tuple[int, bytes]] = []
    counting, window = JobSteps(), 0
    with (
        psycopg.connect(libpq_url(database_url), autocommit=False) as conn,
        ThreadPoolExecutor(1) as copier,
    ):

        def write(data: bytes) -> None:
            with conn.cursor().copy(copy_sql) as copy:
                copy.write(data)

        pending: Future[None] | None = None
        row = conn.execute("SELECT position FROM log_head WHERE id = 1 FOR UPDATE").fetchone()
        position = int(row[0]) if row else 0
        first = position + 1
        made = 0  # history rows made after the head
        events: list[EnvelopeBase] = head
        written = 0
        while written < rows:
            if not events:
                count = min(_CHUNK, rows - written - 1)
                events = _rows(
                    job_id, made, count, start, steps_per_row=steps_per_row, spacing=spacing
                )
                made += count
                if written + len(events) == rows - 1:  # the last row: the job completed
                    events.append(_completed(job_id, math.floor(made * steps_per_row), start))
            stored = []
            data = bytearray()
            for event in events:
                position += 1
                at = start + timedelta(seconds=(position - first) * spacing)
                stored.append(StoredEvent(position, at, event))
                data += b"%d\t%s\t%s\n" % (position, at.isoformat().encode(), encode_row(event))
            if pending is not None:  # the server writes one chunk while the next is built
                pending.result()
            pending = copier.submit(write, bytes(data))
            view, ignored = fold_noting(view, stored)
            # The leader's snapshots of the history, one an interval: their steps chunks.
            cut = 0
            for k, one in enumerate(stored):
                at_window = int((one.recorded_at - start).total_seconds() // SNAPSHOT_INTERVAL_S)
                if at_window != window:
                    counting.count(stored[cut:k], ignored)
                    if counting.seen:
                        chunks.append((stored[k - 1].position if k else position - len(stored),
                                       encode_steps(counting)))  # fmt: skip
                    counting, window, cut = JobSteps(), at_window, k
            counting.count(stored[cut:], ignored)
            written += len(events)
            events = []
            if progress and written > len(head) and written % (_CHUNK * 20) < _CHUNK:
                _progress(f"history: {written:,} of {rows:,} rows")
        if pending is not None:
            pending.result()
        conn.execute("UPDATE log_head SET position = %s WHERE id = 1", (position,))
        conn.commit()
    assert view is not None
    # As an operator would after a bulk load: the planner's statistics, and the visibility
    # map, now rather than by autovacuum on the same two cores in the middle of the run.
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) events")
    store = PostgresEventStore.from_url(database_url)
    try:
        store.save_snapshot(
            position, fold_version(), {job_id: (view.last_position, encode_view(view))},
            taken_at=datetime.now(UTC), whole=True, steps={job_id: encode_steps(counting)},
        )  # fmt: skip
    finally:
        store.close()
    # The earlier intervals' chunks, as the leader's snapshots before the last wrote them.
    with psycopg.connect(libpq_url(database_url), autocommit=False) as conn:
        with conn.cursor().copy(
            "COPY snapshot_steps (job_id, position, body) FROM STDIN (FORMAT BINARY)"
        ) as copy:
            copy.set_types(["text", "int8", "bytea"])
            for chunk_at, body in chunks:
                copy.write_row((job_id, chunk_at, body))
        conn.commit()
    return position, job_id


def _serve(services: Stack, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """``elasticctl serve`` with its log (INFO) in ``log``."""
    return services.serve(log, ELASTIC_LOG_LEVEL="INFO", ELASTIC_RENDEZVOUS_PORT="0", **env)


_FOLDED = re.compile(
    r"folded (\d+) job\(s\) in ([0-9.]+) s: (the whole log|the view snapshot at position \d+),"
    r" and (\d+) event\(s\) after it"
)


def _startup(log: Path) -> tuple[float | None, str | None, int | None]:
    """The standby's start-up as it logged it: seconds, what it started from, tail events."""
    found = _FOLDED.findall(log.read_text(errors="replace"))
    if not found:
        return None, None, None
    _, seconds, source, tail = found[-1]
    return float(seconds), source, int(tail)


def _snapshot_position(database_url: str) -> int:
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute("SELECT position FROM snapshot_head WHERE id = 1").fetchone()
    return int(row[0]) if row else 0


async def _scenario(
    services: Stack, logs: Path, *, ranks: int, interval_s: float, timeout_s: float,
    progress: bool,
) -> dict[str, Any]:  # fmt: skip
    job_id = f"takeover-{uuid.uuid4().hex[:8]}"
    job = SimulatedJob(None, job_id, _layout(ranks, spares=2))
    fleet = _Fleet(
        job, await loadgen.Publisher.connect(services.nats_url),
        await loadgen.Publisher.connect(services.nats_url), interval_s, 10,
    )  # fmt: skip
    policy = {
        "world_size": ranks, "min_world": 1, "max_world": ranks, "backup_interval": 10,
        "redundancy": 2, "heartbeat_interval_s": interval_s,
        "heartbeat_timeout_s": {"init": 60.0, "train": timeout_s, "waiting": 60.0,
                                "backup": 60.0, "restore": 60.0},
        "recovery_deadline_s": 300.0,
    }  # fmt: skip
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    snapshotting = {"ELASTIC_SNAPSHOT_INTERVAL_S": "10"}
    leader = _serve(services, logs / "leader.log", **snapshotting)
    standby: subprocess.Popen[bytes] | None = None
    nc = await nats.connect(services.nats_url)
    try:
        settings = Settings()  # names the stream and consumer as the service does
        await ensure_stream(nc.jetstream(), settings)
        await nc.subscribe(command_subject(job_id), cb=fleet.on_command)
        names = list(job.members)
        if progress:
            _progress(f"{len(names)} members join ({ranks} ranks)")
        await fleet.send(lambda: job.joining(names, policy))
        tasks.append(asyncio.create_task(fleet.heartbeats(stop)))
        start = await fleet.next_command(1, 600.0)
        if start is None:
            raise BenchTakeoverError("the job did not start within 600s")
        tasks.append(asyncio.create_task(fleet.train(stop)))
        await fleet.backed_up.wait()
        await _until_caught_up(nc, settings, max(100, ranks // 4), timeout_s=300.0)
        standby = _serve(services, logs / "standby.log", **snapshotting)
        # A snapshot that holds the running job, and a standby ready to take the lock.
        covered = PostgresEventStore.from_url(services.database_url)
        try:
            job_at = max(
                s.position for s in covered.read(job_id=job_id, types=["generation.started"])
            )
        finally:
            covered.close()
        deadline = time.monotonic() + 120.0
        while _snapshot_position(services.database_url) < job_at:
            if time.monotonic() > deadline:
                raise BenchTakeoverError("the leader recorded no snapshot of the job in 120s")
            await asyncio.sleep(0.5)
        await asyncio.sleep(3.0)
        if standby.poll() is not None:
            raise BenchTakeoverError(f"the standby exited with status {standby.returncode}")
        if progress:
            _progress("killing the leader; a member crashes at once")
        world = fleet.current.world
        victim = world[len(world) // 2]
        fleet.silence(victim)
        exit_ = {"member": victim, "signal": 9}
        before = PostgresEventStore.from_url(services.database_url)
        try:
            head = before.last_position()
        finally:
            before.close()
        killed = time.time()
        leader.send_signal(signal.SIGKILL)
        await fleet.send(
            lambda: [job.envelope(victim, "member.exited", exit_, by=job.launcher(victim))]
        )
        command = await fleet.next_command(len(fleet.commands) + 1, 300.0)
        arrived = time.time()
        if not isinstance(command, Reallocate):
            raise BenchTakeoverError("the standby decided nothing within 300s")
        await fleet.resume(command)
        return {"job_id": job_id, "killed": killed, "arrived": arrived, "head": head}
    finally:
        stop.set()
        for task in tasks:
            with contextlib.suppress(Exception):
                await task
        await nc.close()
        await fleet.events.close()
        await fleet.beats.close()
        for process in (leader, standby):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(30)


def _api_cold_start(
    database_url: str, job_id: str, history_job: str | None, wait_s: float
) -> dict[str, Any]:
    """A cold start of ``elasticctl api``: seconds to its first 200 for the job (None: none in
    ``wait_s``), then to the history job's loss curve, and the curve's points."""
    port = free_port()
    started = time.monotonic()
    api = _start_api(database_url, port)
    out: dict[str, Any] = {"api_first_answer_s": None}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=wait_s) as client:
            while time.monotonic() - started < wait_s:
                if api.poll() is not None:
                    raise BenchTakeoverError(f"the API exited with status {api.returncode}")
                try:
                    response = client.get(f"/api/v1/jobs/{job_id}")
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                if response.status_code == 200:
                    out["api_first_answer_s"] = round(time.monotonic() - started, 3)
                    break
                time.sleep(0.05)
            if history_job is not None and out["api_first_answer_s"] is not None:
                asked = time.monotonic()
                response = client.get(f"/api/v1/jobs/{history_job}/loss")
                response.raise_for_status()
                out["api_history_loss_s"] = round(time.monotonic() - asked, 3)
                out["api_history_loss_points"] = len(response.json()["points"])
        return out
    finally:
        api.terminate()
        try:
            api.wait(30)
        except subprocess.TimeoutExpired:  # still folding the log in its warm-up thread
            api.kill()
            api.wait(30)


def run_takeover_bench(
    *,
    ranks: int = 16_384,
    days: float = 30.0,
    history_rows: int | None = None,
    heartbeat_interval_s: float = 0.25,
    hang_timeout_s: float = 5.0,
    api_wait_s: float = 120.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (see the module's docstring)."""
    if ranks < 2:
        raise ValueError("needs at least 2 ranks")
    rows = history_rows if history_rows is not None else round(history_rows_per_day(ranks) * days)
    if 0 < rows < _HEAD_ROWS + 1:
        raise ValueError(f"a history has no rows or at least {_HEAD_ROWS + 1}")
    # The leader's and the standby's logs (INFO) are kept: the report names where.
    logs = Path(tempfile.mkdtemp(prefix="elastic-takeover-"))
    if progress:
        _progress(f"the control planes' logs: {logs}")
    with stack(commit_times=True) as services:
        began = time.monotonic()
        if progress:
            _progress(f"history: {rows:,} rows ({days:g} days of a {ranks:,}-rank job)")
        history_end, history_job = (
            write_history(services.database_url, rows, days, progress=progress)
            if rows
            else (0, None)
        )
        written_s = time.monotonic() - began
        out = asyncio.run(
            _scenario(services, logs, ranks=ranks, interval_s=heartbeat_interval_s,
                      timeout_s=hang_timeout_s, progress=progress)
        )  # fmt: skip
        startup_s, started_from, tail = _startup(logs / "standby.log")
        store = PostgresEventStore.from_url(services.database_url)
        try:
            # The standby's decision: the first after the leader's last write.
            decision = store.read(
                job_id=out["job_id"], after=out["head"], types=["reallocation.issued"], limit=1
            )[0].position
            commits = _commit_times(store, [decision])
            log_rows = store.last_position()
            with store.engine.connect() as conn:
                log_bytes = conn.exec_driver_sql(
                    "SELECT coalesce(sum(pg_total_relation_size(relid)), 0)"
                    " FROM pg_partition_tree('events') WHERE isleaf"
                ).scalar_one()
        finally:
            store.close()
        if progress:
            _progress("a cold start of the API")
        api = _api_cold_start(services.database_url, out["job_id"], history_job, api_wait_s)
    killed = out["killed"]
    return {
        "ranks": ranks,
        "days": days,
        "history_rows": rows,
        "history_written_s": round(written_s, 1),
        "log_rows": log_rows,
        "log_bytes": int(log_bytes),
        "takeover_decision_s": round(commits[decision] - killed, 3) if commits else None,
        "takeover_command_s": round(out["arrived"] - killed, 3),
        "standby_startup_s": startup_s,
        "standby_started_from": started_from,
        "standby_tail_events": tail,
        "history_end_position": history_end,
        **api,
        "api_wait_s": api_wait_s,
        "logs": str(logs),
        "cpus": os.cpu_count(),
        **services.where,
    }
