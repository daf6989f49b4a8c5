"""``elasticctl bench replay``: rebuild a job's view from a JSONL log file, in events/s.

Writes a job's log through the log file writer: a synthetic job's
(``controlplane.synth.SyntheticJob``: joins, heartbeats, steps, backups and their replicas),
or with ``ranks`` the history of ``days`` of a job of that many ranks as ``bench api`` and
``bench takeover`` generate it (``controlplane.bench.history``: steps, liveness summaries,
real backup catalogs before its incidents, each rank's recovery). Then times what
``elasticctl replay`` does with it (``replay_file``: read the lines, validate each envelope
with the schemas, fold into the job's view; in two processes taking turns where there are
two CPUs). Prints one JSON object: ``events``, ``seconds`` and ``events_per_s`` (the median
of three runs), ``cpu_seconds`` (both processes), the same replay in one process run back to
back with each run (``one_process_*``), and the read+validate and fold parts measured on
their own; for a history, also ``rank_seconds_per_s``: the job's ranks times the seconds its
log spans, replayed per second.
"""

from __future__ import annotations

import itertools
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from controlplane import gctune
from controlplane.bench.history import History, history_rows_per_day
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.postmortem.logfile import encode_line, read_log
from controlplane.postmortem.replay import FOLD_CHUNK, replay_file, replay_processes
from controlplane.synth import SyntheticJob
from schemas.common import CONTROLPLANE_SOURCE
from schemas.events import EVENT_ADAPTER

RUNS = 3
#: Events held in memory to time the fold on its own.
FOLD_ONLY = 200_000


def write_synthetic_log(path: Path, *, events: int, members: int) -> int:
    """Write ``events`` stored events of a synthetic job to ``path``; return the bytes."""
    job = SyntheticJob(
        "job-bench", members=members, racks=4, nodes_per_rack=max(1, members // 16), seed=1
    )
    running = job.envelope(
        CONTROLPLANE_SOURCE,
        "job.state_changed",
        {"from": "PENDING", "to": "RUNNING", "reason": "synthetic"},
    )
    envelopes = itertools.islice(
        itertools.chain(
            job.controlplane_events(), [running], job.member_events(max(events - 3, 0))
        ),
        events,
    )
    with path.open("wb") as out:
        for position, envelope in enumerate(envelopes, start=1):
            event = EVENT_ADAPTER.validate_python(envelope, strict=False)
            # Recorded a little after it was emitted, as by an ingest.
            recorded = event.emitted_at + timedelta(milliseconds=2)
            out.write(encode_line(StoredEvent(position, recorded, event)))
    return path.stat().st_size


def write_history_log(path: Path, *, ranks: int, days: float) -> tuple[int, int]:
    """Write the history of ``days`` of a job of ``ranks`` ranks (``bench.history``) to
    ``path``; return its events and bytes."""
    history = History(round(history_rows_per_day(ranks) * days), days, ranks=ranks)
    events = 0
    with path.open("wb") as out:
        for stored, _ in history.batches():
            out.write(b"".join(map(encode_line, stored)))
            events += len(stored)
    return events, path.stat().st_size


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(fn: Any) -> tuple[float, float, Any]:
    """Wall seconds, CPU seconds (this process and the children it waited for), result."""
    wall, cpu = time.perf_counter(), time.process_time() + _children_cpu()
    result = fn()
    return time.perf_counter() - wall, time.process_time() + _children_cpu() - cpu, result


def run_replay_bench(
    *,
    events: int,
    members: int = 64,
    ranks: int | None = None,
    days: float = 1.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Measure the replay of a ``events``-event log file of a synthetic job of ``members``
    members, or of the history of ``days`` of a job of ``ranks`` ranks; see the module
    docstring."""

    def say(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        path = Path(tmp) / "log.jsonl"
        started = time.perf_counter()
        if ranks is None:
            say(f"writing {events} events to {path} ...")
            size = write_synthetic_log(path, events=events, members=members)
        else:
            say(f"writing the history of {days:g} days of a {ranks:,}-rank job to {path} ...")
            events, size = write_history_log(path, ranks=ranks, days=days)
        say(f"written: {size / 1e6:.1f} MB in {time.perf_counter() - started:.1f}s")

        def replay(processes: int | None = None) -> Any:
            # What `elasticctl replay FILE` runs (commands.replay).
            with gctune.relaxed():
                return replay_file(path, source=str(path), processes=processes)

        def read_only() -> int:
            count = 0
            with path.open("rb") as stream, gctune.relaxed():
                for _ in read_log(stream):
                    count += 1
            return count

        runs = []
        one_process = []  # back to back with the runs, to compare on a busy machine
        for n in range(RUNS):
            wall, cpu, replayed = _timed(replay)
            runs.append((wall, cpu))
            say(f"run {n + 1}: {replayed.events} events in {wall:.2f}s"
                f" ({replayed.events / wall:,.0f}/s)")  # fmt: skip
            assert replayed.events == events, (replayed.events, events)
            wall, cpu, alone = _timed(lambda: replay(processes=1))
            one_process.append((wall, cpu))
            say(f"run {n + 1}, one process: {wall:.2f}s ({events / wall:,.0f}/s)")
            assert alone.view == replayed.view, "one process and two fold differently"
        view = replayed.view
        read_wall = statistics.median(_timed(read_only)[0] for _ in range(RUNS))
        # The fold alone, over events already in memory (as bench ingest measures it; at most
        # FOLD_ONLY of them, to bound the memory).
        with path.open("rb") as stream:
            stored = list(itertools.islice(read_log(stream), FOLD_ONLY))
        fold_walls = []
        with gctune.relaxed():
            for _ in range(RUNS):
                fold_walls.append(_timed(lambda: _fold_chunks(stored))[0])
    seconds = statistics.median(w for w, _ in runs)
    cpu_s = statistics.median(c for _, c in runs)
    shape: dict[str, Any] = (
        {"members": members}
        if ranks is None
        else {
            "ranks": ranks,
            "days": days,
            "rank_seconds_per_s": round(ranks * days * 86_400 / seconds, 1),
            "members": len(view.members),
            "incidents": len(view.incidents),
        }
    )
    return {
        "events": events,
        **shape,
        "seconds": round(seconds, 6),
        "events_per_s": round(events / seconds, 1),
        "cpu_seconds": round(cpu_s, 3),
        "cpu_events_per_s": round(events / cpu_s, 1) if cpu_s > 0 else None,
        "runs_s": [round(w, 3) for w, _ in runs],
        "processes": replay_processes(size),
        # Views handed from one process to the other in the last run (a view dearer to hand
        # over than a part to read is handed over once: replay._TwoProcesses).
        "handovers": replayed.handovers,
        "one_process_events_per_s": round(events / statistics.median(w for w, _ in one_process), 1),
        "one_process_cpu_events_per_s": round(
            events / statistics.median(c for _, c in one_process), 1
        ),
        "file_bytes": size,
        "mb_per_s": round(size / seconds / 1e6, 1),
        "read_events_per_s": round(events / read_wall, 1),
        "fold_events_per_s": round(len(stored) / statistics.median(fold_walls), 1),
        "state": view.state.value,
        "last_step": view.last_step,
        "cpus": os.cpu_count(),
    }


def _fold_chunks(stored: list[StoredEvent]) -> None:
    view = None
    for i in range(0, len(stored), FOLD_CHUNK):
        view = fold(view, stored[i : i + FOLD_CHUNK])
