"""``elasticctl bench backlog``: one backup of a large job through the ingest's own steps.

A backup of ``ranks`` ranks is that many ``backup.snapshot`` reports, reaching the ingest
together. Each step the service loop takes for them is timed on its own, in one process
(no NATS: the messages are made here, as a member sends them): ``decode`` (validation, an
envelope per report), ``encode`` (the store's pre-encoding, ``AsyncAppender.encode``),
``append`` (``AsyncAppender.append`` into PostgreSQL, in parts of ``part`` messages as the
loop commits them: sequence rules and cursors, packing into catalogs, the COPY) and ``fold``
(the loop's ``fold_jobs`` of each part's stored events). ``fold_as_events``: the same
catalogs folded with each report rebuilt as its event (``core.catalog.unpacked``), as the
fold read them before it read a catalog's columns. The job (registration, first generation,
every member's join) is folded first; each figure is a median over ``backups`` backups.
With ``collect`` false the garbage collector is off while the steps are timed (the service
tunes it, ``controlplane.gctune``; on, its passes over a heap holding 16,384 members and
their backups land in whichever step allocates when they fall due, mostly the fold).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import random
import statistics
import time
from typing import Any

from controlplane.bench.stack import stack
from controlplane.core.catalog import unpacked
from controlplane.core.fold import fold, fold_jobs
from controlplane.core.records import StoredEvent
from controlplane.decode import decode
from controlplane.store.postgres import AsyncAppender
from controlplane.synth import SyntheticJob
from schemas.events import EVENT_ADAPTER, EnvelopeBase


def _reports(job: SyntheticJob, step: int, rng: random.Random) -> list[tuple[str, bytes]]:
    """Every rank's report of backup ``step`` as published (subject, bytes), with what a real
    report has: a sha256, the seconds its copy took, the holders of its copy."""
    out = []
    for shard, (member, node, _) in enumerate(job.members):
        envelope = job.envelope(f"{node}/{member}", "backup.snapshot", {
            "step": step, "shard": shard, "nbytes": 1 << 20,
            "checksum": "sha256:" + hashlib.sha256(b"%s/%d/%d" % (
                job.job_id.encode(), step, shard)).hexdigest(),
            "seconds": rng.uniform(0.005, 0.05),
            "holders": list(job.placement.holders[shard])})  # fmt: skip
        out.append(SyntheticJob.message(envelope))
    return out


async def _run(
    database_url: str, ranks: int, backups: int, part: int, collect: bool = True
) -> dict[str, Any]:
    job = SyntheticJob(
        "job-backlog", members=ranks, racks=max(1, ranks // 128), nodes_per_rack=16,
        backup_interval=10,
    )  # fmt: skip
    rng = random.Random(7)
    appender = AsyncAppender(database_url)
    phases: dict[str, list[float]] = {
        k: [] for k in ("decode", "encode", "append", "fold", "fold_as_events")
    }
    rows: list[int] = []
    try:
        first = [EVENT_ADAPTER.validate_json(json.dumps(e)) for e in job.controlplane_events()]
        joins: list[EnvelopeBase] = []
        for envelope in job.member_events(ranks):
            event = decode(*SyntheticJob.message(envelope))
            assert isinstance(event, EnvelopeBase), event
            joins.append(event)
        views = fold_jobs({}, (await appender.append(first)).stored)
        views = fold_jobs(views, (await appender.append(joins)).stored)
        for k in range(backups):
            messages = _reports(job, 10 * (k + 1), rng)
            if not collect:
                gc.collect()
                gc.disable()
            t0 = time.perf_counter()
            events = [decode(subject, data) for subject, data in messages]
            t1 = time.perf_counter()
            reports = [e for e in events if isinstance(e, EnvelopeBase)]
            assert len(reports) == len(messages), "a report did not decode"
            encoded = appender.encode(reports)
            t2 = time.perf_counter()
            stored: list[list[StoredEvent]] = []
            for i in range(0, len(reports), part):
                result = await appender.append(reports[i : i + part], encoded=encoded[i : i + part])
                stored.append(result.stored)
            t3 = time.perf_counter()
            before = views
            for batch in stored:
                views = fold_jobs(views, batch)
            t4 = time.perf_counter()
            again = before[job.job_id]
            for batch in stored:
                again = fold(again, list(unpacked(batch)))
            t5 = time.perf_counter()
            gc.enable()
            assert again.backups == views[job.job_id].backups
            for name, took in zip(
                phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
            ):
                phases[name].append(round(took * 1000, 1))
            rows.append(sum(len(b) for b in stored))
    finally:
        gc.enable()
        await appender.close()
    view = views[job.job_id]
    return {
        "ranks": ranks,
        "backups": backups,
        "part": part,
        "collect": collect,
        "rows_per_backup": rows[-1],
        "complete_backup": view.last_complete_backup,
        **{f"{name}_ms": statistics.median(values) for name, values in phases.items()},
        "per_backup_ms": phases,
    }


def run_backlog_bench(
    *, ranks: int, backups: int = 3, part: int = 512, collect: bool = True
) -> dict[str, Any]:
    """Run the benchmark (see the module's docstring) and return its figures."""
    with stack() as services:
        return asyncio.run(_run(services.database_url, ranks, backups, part, collect))
