"""``elasticctl bench ingest``: publish -> JetStream -> ingest -> PostgreSQL, and the fold.

The control plane runs as its own process (``elasticctl serve``), as deployed; this process
publishes pre-encoded frames (``loadgen``), so the measured rate is the control plane's.
``events_per_s`` is events over the time from the first publish to the commit of the last event
(sustained: the ingest is subscribed before the first publish).
``lost`` and ``duplicated`` are counted in PostgreSQL by (source, incarnation, seq).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import nats
import psycopg

from controlplane import gctune
from controlplane.bench import loadgen
from controlplane.bench.stack import serving, stack
from controlplane.bus import ensure_stream
from controlplane.core.fold import fold
from controlplane.publish import Outgoing
from controlplane.settings import Settings, libpq_url
from controlplane.store.postgres import PostgresEventStore, count_member_events
from controlplane.synth import SyntheticJob


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _count(database_url: str, job_id: str) -> tuple[int, int]:
    """(events, distinct events) the members of ``job_id`` have in the log (an event is
    its source, incarnation and seq, whether stored as a row or packed into a catalog)."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        return count_member_events(conn, job_id)


async def _consumer_ready(url: str, settings: Settings, wait_s: float = 60.0) -> None:
    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + wait_s
        js = nc.jetstream()
        while True:
            try:
                await js.consumer_info(settings.stream, settings.ingest_durable)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each named process; PostgreSQL's include its backends, live
    or ended (the postmaster reaps them: their time is in its ``children_*``)."""
    import psutil

    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            proc = psutil.Process(pid)
            times = proc.cpu_times()
            children = proc.children(recursive=True) if name == "postgres" else []
        except psutil.Error:
            continue
        total = times.user + times.system
        if name == "postgres":
            total += times.children_user + times.children_system
        for child in children:
            try:
                child_times = child.cpu_times()
            except psutil.Error:  # it ended meanwhile: counted once reaped
                continue
            total += child_times.user + child_times.system
        out[name] = total
    return out


async def _ensure_stream(url: str, settings: Settings) -> None:
    nc = await nats.connect(url)
    try:
        await ensure_stream(nc.jetstream(), settings)
    finally:
        await nc.close()


def _groups(serve: subprocess.Popen[bytes], servers: list[Any]) -> dict[str, int]:
    groups = {"controlplane": serve.pid, "publisher": os.getpid()}
    for server in servers:  # embedded ones only: an external server's time is not ours
        if server.pid:
            groups[server.kind] = server.pid
    return groups


def run_ingest_bench(
    *, events: int, members: int = 64, prefill: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Run the benchmark and return its figures."""
    with stack() as services:
        nats_url, database_url = services.nats_url, services.database_url
        job = SyntheticJob(f"bench-{uuid.uuid4().hex[:8]}", members=members, seed=1)
        if progress:
            _progress(f"generating {events:,} events from {members} members")
        messages = []
        for envelope in job.member_events(events):
            subject, data = SyntheticJob.message(envelope)
            messages.append(Outgoing(subject, data, envelope["event_id"]))

        settings = Settings()
        store = PostgresEventStore.from_url(database_url)
        start_position = store.last_position()
        encoded = loadgen.frames(messages)
        if prefill:
            # Fill the stream first, then measure the control plane draining it.
            asyncio.run(_ensure_stream(nats_url, settings))
            if progress:
                _progress(f"publishing {events:,} events before the control plane starts")
            refused = asyncio.run(loadgen.send(nats_url, encoded))
        with serving(services) as serve:
            groups = _groups(serve, services.servers)
            if prefill:
                while store.last_position() == start_position:
                    time.sleep(0.005)
                started, cpu_before = time.monotonic(), _cpu_seconds(groups)
                measured = events - _count(database_url, job.job_id)[1]
                published = started
            else:
                asyncio.run(_consumer_ready(nats_url, settings))
                if progress:
                    _progress(f"publishing {events:,} events")
                cpu_before = _cpu_seconds(groups)
                started = time.monotonic()
                refused = asyncio.run(loadgen.send(nats_url, encoded))
                published = time.monotonic()
                measured = events
            if progress:
                _progress("waiting for the last commit")
            deadline = time.monotonic() + max(60.0, events / 1000)
            # The head position is one row: polling it costs the database nothing. A row is
            # not an event (the store packs a backup's reports into a catalog row), so once
            # the head rests the members' events are counted; the last commit is when it
            # last moved.
            head, moved, counted = store.last_position(), time.monotonic(), -1
            while time.monotonic() < deadline:
                time.sleep(0.01)
                position = store.last_position()
                if position != head:
                    head, moved = position, time.monotonic()
                elif time.monotonic() - moved > 0.05 and counted != head:
                    counted = head  # counted once per resting head
                    if _count(database_url, job.job_id)[1] >= events:
                        break
            committed = moved
            cpu_after = _cpu_seconds(groups)
        count, distinct = _count(database_url, job.job_id)

        stored = list(store.iter_events(job_id=job.job_id, after=start_position))
        store.close()
    gctune.tune_service()  # as the service runs its fold
    fold_times = []
    for _ in range(3):
        fold_started = time.perf_counter()
        view = fold(None, stored)
        fold_times.append(time.perf_counter() - fold_started)
    fold_s = sorted(fold_times)[1]
    return {
        "events": events,
        "members": members,
        "events_per_s": round(measured / (committed - started), 1),
        "prefilled": prefill,
        "publish_s": round(published - started, 3),
        "commit_s": round(committed - started, 3),
        "lost": events - distinct,
        "publish_refused": refused,
        "duplicated": count - distinct,
        "fold_events_per_s": round(len(stored) / fold_s, 1),
        "fold_members": len(view.members),
        # Where the machine's time went, per event, from first publish to last commit.
        "cpu_us_per_event": {
            name: round((cpu_after[name] - cpu_before.get(name, 0.0)) / measured * 1e6, 1)
            for name in cpu_after
        },
        **services.where,
    }
