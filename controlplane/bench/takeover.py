"""``elasticctl bench takeover``: a standby takes over from a leader killed on a long log.

The log first gets a *history* (``controlplane.bench.history``): as many rows as ``days`` of
a job of ``ranks`` ranks writes in this design (``history_rows_per_day``: one ``train.step``
a step at a step a second, a ``backup.catalog`` per 1,024 ranks every ten steps, an interval
``liveness.summary`` every ten seconds, and each rank's ack, restore and resume at eight
incidents a day, Llama 3's rate on 16,384 GPUs), written as the rows of one finished job of
one rank: its ``train.step`` records at a step a second, and for the other rows the control
plane's liveness summaries of its member (valid events of the cheapest kinds to generate, so
the log holds that many rows, not that many bytes). The history's views are folded once and
recorded as the leader would have recorded them (``controlplane.snapshots``): a whole view
snapshot at the history's end, and a steps chunk (``core.steps``) for each snapshot interval
of the history.

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
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import nats
import psycopg

from controlplane.bench import loadgen
from controlplane.bench.api import first_answer, start_api, stop_api
from controlplane.bench.decide import _commit_times, _layout, _until_caught_up
from controlplane.bench.history import HEAD_ROWS, history_rows_per_day, log_size, write_history
from controlplane.bench.members import SimulatedJob
from controlplane.bench.scale import _Fleet
from controlplane.bench.stack import Stack, stack
from controlplane.bus import ensure_stream
from controlplane.settings import Settings, libpq_url
from controlplane.store.postgres import PostgresEventStore
from schemas.commands import Reallocate
from schemas.subjects import command_subject


class BenchTakeoverError(RuntimeError):
    """The benchmark could not run as asked."""


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    api, base = start_api(database_url)
    out: dict[str, Any] = {"api_first_answer_s": None}
    try:
        first = first_answer(base, f"/api/v1/jobs/{job_id}", api, wait_s)
        if first is None:
            return out
        out["api_first_answer_s"] = round(first, 3)
        if history_job is not None:
            with httpx.Client(base_url=base, timeout=wait_s) as client:
                asked = time.monotonic()
                response = client.get(f"/api/v1/jobs/{history_job}/loss")
                response.raise_for_status()
                out["api_history_loss_s"] = round(time.monotonic() - asked, 3)
                out["api_history_loss_points"] = len(response.json()["points"])
        return out
    except RuntimeError as exc:  # the API exited
        raise BenchTakeoverError(str(exc)) from exc
    finally:
        stop_api(api)


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
    if 0 < rows < HEAD_ROWS + 1:
        raise ValueError(f"a history has no rows or at least {HEAD_ROWS + 1}")
    # The leader's and the standby's logs (INFO) are kept: the report names where.
    logs = Path(tempfile.mkdtemp(prefix="elastic-takeover-"))
    if progress:
        _progress(f"the control planes' logs: {logs}")
    with stack(commit_times=True) as services:
        began = time.monotonic()
        if progress:
            _progress(f"history: {rows:,} rows ({days:g} days of a {ranks:,}-rank job)")
        history = (
            write_history(services.database_url, rows, days, progress=progress) if rows else None
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
        finally:
            store.close()
        log_rows, log_bytes = log_size(services.database_url)
        if progress:
            _progress("a cold start of the API")
        api = _api_cold_start(
            services.database_url,
            out["job_id"],
            history.job_id if history is not None else None,
            api_wait_s,
        )
    killed = out["killed"]
    return {
        "ranks": ranks,
        "days": days,
        "history_rows": rows,
        "history_written_s": round(written_s, 1),
        "log_rows": log_rows,
        "log_bytes": log_bytes,
        "takeover_decision_s": round(commits[decision] - killed, 3) if commits else None,
        "takeover_command_s": round(out["arrived"] - killed, 3),
        "standby_startup_s": startup_s,
        "standby_started_from": started_from,
        "standby_tail_events": tail,
        "history_end_position": history.end if history is not None else 0,
        **api,
        "api_wait_s": api_wait_s,
        "logs": str(logs),
        "cpus": os.cpu_count(),
        **services.where,
    }
