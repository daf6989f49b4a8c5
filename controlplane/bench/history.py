"""A long log, generated: as many rows as ``days`` of a job of ``ranks`` ranks writes.

For the benches that need a log of a large job's age (``bench takeover``: a standby's start
on it; ``bench api``: the API over it). ``history_rows_per_day``: one ``train.step`` a step at
a step a second, a ``backup.catalog`` per 1,024 ranks every ten steps, an interval
``liveness.summary`` every ten seconds, and each rank's ack, restore and resume at
``INCIDENTS_PER_DAY`` incidents a day (Llama 3's rate on 16,384 GPUs). They are written as
the rows of one job that finishes at the history's end (``job.completed``), straight into
the events table (COPY; the log holds that many rows, not that many bytes: a real catalog of
1,024 reports is 77 KB, and 30 days of them at 16,384 ranks would not fit this machine's
disk):

- ``ranks`` 1 (``bench takeover``): a job of one member, registered and started by hand: its
  steps at a step a second, and for every other row a liveness summary of its member (valid
  events of the cheapest kind to generate);
- ``ranks`` above 1 (``bench api``): a job of that many ranks and ``SPARES`` warm spares,
  each announced by its node's launcher and joined, started, and recovered from each of
  ``incidents`` crashes by the real decider (``core.decide``), as the service runs it: a
  liveness summary of the decision (``core.liveness``: every member heard regularly) before
  each decision, a real backup (every rank's report with its sha256 digest and holders,
  packed into catalogs as the store packs them) before each crash, each rank of the new
  world's ack, restore and resume, the new generation's first step, the incident resolved,
  and the lost rank's node starting a new process as a spare. Between incidents: rank 0's
  step a second, and for the rest of the rows a liveness summary naming it (as above).

Times are recorded as a day of the job would have them (the history ends now, the rows
between incidents evenly spread, an incident's a second or two long). The history's views
are folded once and recorded as the leader would have recorded them
(``controlplane.snapshots``): a whole view snapshot at the history's end, and a steps chunk
(``core.steps``) for each snapshot interval of the history.
"""

from __future__ import annotations

import math
import random
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import psycopg

from controlplane.core.records import StoredEvent
from controlplane.core.snapshot import encode_view, fold_version
from controlplane.core.steps import JobSteps, encode_steps
from controlplane.core.view import JobView
from controlplane.postmortem.simlog import SimJob, SimLog, Source
from controlplane.settings import Settings, libpq_url
from controlplane.store.postgres import PostgresEventStore, encode_row
from schemas.common import Phase
from schemas.events import (
    CommandAcked,
    EnvelopeBase,
    LivenessEntry,
    LivenessSummary,
    RestoreCompleted,
    TrainResumed,
    TrainStep,
)

#: Incidents a day (Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs).
INCIDENTS_PER_DAY = 8
#: The one-rank history job's rows before its steps (registration, join, first generation).
HEAD_ROWS = 3
#: Warm spares of a history job of more than one rank.
SPARES = 2
#: Seconds between the leader's view snapshots of the history (the service's default).
SNAPSHOT_INTERVAL_S: float = Settings.model_fields["snapshot_interval_s"].default
#: History rows made, folded and written per batch.
_CHUNK = 50_000
#: The heartbeat interval of a many-rank history job's policy (``bench scale``'s).
_BEAT_S = 0.25


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def history_rows_per_day(ranks: int) -> int:
    """Rows a job of ``ranks`` ranks adds to the log in a day (see the module docstring)."""
    steps = 86_400
    catalogs = steps // 10 * math.ceil(ranks / 1024)
    summaries = 86_400 // 10
    recoveries = INCIDENTS_PER_DAY * 3 * ranks
    return steps + catalogs + summaries + recoveries


@dataclass(frozen=True, slots=True)
class Written:
    """What ``write_history`` wrote."""

    #: The log's last position after it.
    end: int
    job_id: str
    #: Rows of the history (the job's events).
    rows: int
    #: Every member the job had, in order of joining.
    members: tuple[str, ...] = field(repr=False)
    #: Incidents the job recovered from.
    incidents: int


def _standin(job: SimLog, member: str, at: datetime, step: int, generation: int) -> EnvelopeBase:
    """A liveness summary naming ``member`` (of ``generation``, the current one): the row
    that stands in for a catalog, a summary or a recovery event of the job's day."""
    source = job.source(member)
    node = source.source.split("/", 1)[0]
    entry = LivenessEntry.model_construct(
        member=member, node=node, incarnation=source.incarnation, generation=generation,
        last_at=at, assumed=False, first_at=at - timedelta(seconds=10), beats=40,
        max_gap_s=0.3, max_gap_at=at, phase=Phase.TRAIN, step=step, max_step_s=1.0,
    )  # fmt: skip
    summary = LivenessSummary.model_construct(
        reason="interval", since=at - timedelta(seconds=10), at=at, part=1, parts=1,
        members=[entry], columns=None, regular=None,
    )  # fmt: skip
    return job.event(job.control, "liveness.summary", summary, at, generation)


def _step(job: SimLog, member: str, step: int, at: datetime, generation: int) -> EnvelopeBase:
    payload = TrainStep.model_construct(step=step, loss=_loss(step), step_seconds=1.0, samples=8)
    return job.event(job.source(member), "train.step", payload, at, generation)


def _loss(step: int) -> float:
    return round(2.0 / (1.0 + 0.001 * step), 6)


class _Many:
    """A job of ``ranks`` ranks and ``SPARES`` spares, started and recovered by the decider."""

    def __init__(self, job: SimLog, ranks: int) -> None:
        self.job = job
        self.ranks = ranks
        self.rejoined = 0
        self.sim = SimJob(job, _BEAT_S)
        self.where = self.sim.where

    def start(self, at: datetime) -> None:
        """Join the ranks (8 a node, 16 nodes a rack) and the spares; the decider starts it."""
        policy = {
            "world_size": self.ranks, "min_world": 1, "max_world": self.ranks,
            "backup_interval": 10, "redundancy": 2, "heartbeat_interval_s": _BEAT_S,
            "recovery_deadline_s": 300.0,
        }  # fmt: skip
        names = [(f"m{i}", f"n{i // 8}", f"r{i // 128}", "worker") for i in range(self.ranks)]
        racks = max(1, (self.ranks + 127) // 128)
        names += [(f"spare{s}", f"sn{s}", f"r{s % racks}", "spare") for s in range(SPARES)]
        self.sim.join(names, at, policy)
        if not self.turn(at) or self.job.v.generation != 1:
            raise RuntimeError("the decider did not start the history job")

    def turn(self, now: datetime) -> int:
        return self.sim.turn(now)

    def backup(self, step: int, at: datetime) -> None:
        self.sim.backup(step, at)

    def crash(self, victim: str, at: datetime, backup_step: int) -> int:
        """``victim`` is killed at ``at`` just after a backup at ``backup_step``; the world
        recovers; return the step training goes on from (the new generation's first)."""
        job = self.job
        self.backup(backup_step, at)
        at += timedelta(seconds=0.3)
        node, _ = self.where[victim]
        exited = {"member": victim, "signal": 9}
        job.add([job.validated(self.sim.launcher(node), "member.exited", exited, at, 0)], at)
        at += timedelta(seconds=0.01)
        if not self.turn(at) or job.v.open_incident is None:
            raise RuntimeError(f"the decider did not act on {victim}'s exit")
        decision = job.v.incidents[job.v.open_incident].decisions[-1]
        g, restore = decision.generation, decision.restore_step
        for offset, type_, body in (
            (0.1, "command.acked", CommandAcked(command_id=uuid.UUID(decision.command_id))),
            (0.5, "restore.completed",
             RestoreCompleted(generation=g, step=restore, bytes=1 << 30, seconds=0.45)),
            (0.1, "train.resumed", TrainResumed(generation=g, step=restore)),
        ):  # fmt: skip
            at += timedelta(seconds=offset)
            job.add([job.event(job.source(m), type_, body, at, g) for m in decision.world], at)
        at += timedelta(seconds=0.2)
        job.add([_step(job, job.v.world[0], restore + 1, at, g)], at)
        self.turn(at)
        if job.v.open_incident is not None:
            raise RuntimeError("the history's incident did not resolve")
        # The lost rank's node starts a new process: a warm spare.
        self.rejoined += 1
        node, rack = self.where[victim]
        at += timedelta(seconds=2.0)
        self.sim.join([(f"re{self.rejoined}", node, rack, "spare")], at)
        self.turn(at)
        return restore + 1


def _one_rank_head(job: SimLog, at: datetime) -> None:
    """The one-rank history job's first events: its registration, its member's join and its
    first generation (validated as a member's and the decider's are)."""
    node, member = "hist-n0", "h0"
    job.sources[member] = Source(f"{node}/{member}", "hist", seq=0)
    registered = {"name": "history", "policy": {"world_size": 1, "min_world": 1,
                                                "redundancy": 0}}  # fmt: skip
    joined = {"node": node, "rack": "hist-r0", "host": "hist-host", "pid": 1, "role": "worker",
              "device": "cpu", "backup_endpoint": f"{node}:7000"}  # fmt: skip
    started = {"generation": 1, "world": [member], "rendezvous": "tcp://history:1/1",
               "placement": [[]]}  # fmt: skip
    job.add([job.validated(job.control, "job.registered", registered, at, 0),
             job.validated(job.source(member), "member.joined", joined, at, 0),
             job.validated(job.control, "generation.started", started, at, 1)], at)  # fmt: skip


def _history(
    job: SimLog, rows: int, start: datetime, seconds: float, *, ranks: int, incidents: int
) -> Iterator[tuple[list[StoredEvent], frozenset[int]]]:
    """The history's events in batches (see the module docstring), folded."""
    many = _Many(job, ranks) if ranks > 1 else None
    if many is None:
        _one_rank_head(job, start)
    else:
        many.start(start)
    first = job.position - len(job.made) + 1  # the history's first position
    # Rows an incident adds besides the steady ones: its backup's catalogs, the summaries
    # and decisions of its two turns and the rejoin's, the exit, three events per rank of
    # the new world, the first step, the rejoin. Estimated before, counted after: the
    # steady rows fill what is left of ``rows``.
    per_incident = 3 * ranks + math.ceil(ranks / 1024) + 20 if many is not None else 0
    head = job.position - first + 1
    steady = rows - head - incidents * per_incident - 1
    if steady < max(1, 20 * incidents):
        raise ValueError(
            f"{rows:,} rows are too few for a {ranks:,}-rank history with {incidents} incident(s)"
        )
    spacing = seconds / steady
    steps_per_row = min(1.0, seconds / steady)
    at_incident = [round((k + 0.5) * steady / incidents) for k in range(incidents)]
    member = "h0" if many is None else job.v.world[0]
    generation = job.v.generation
    offset = 0  # wall steps minus the job's step (what incidents rolled back)
    wall = 0  # the last step row's wall step
    generation_from = 1  # the current generation's first step
    r = 0
    while True:
        made = job.position - first + 1
        if made >= rows - 1:
            break
        if at_incident and r >= at_incident[0] and many is not None:
            at_incident.pop(0)
            step = wall - offset
            backup = max(generation_from, step - step % 10)
            world = job.v.world
            victim = world[(len(at_incident) * 7919 + 3) % len(world)]
            resumed = many.crash(victim, job.clock, backup)
            offset = wall + 1 - (resumed + 1)
            generation_from = resumed
            member, generation = job.v.world[0], job.v.generation
        at = start + timedelta(seconds=r * spacing)
        step = math.floor((r + 1) * steps_per_row)
        if step > math.floor(r * steps_per_row):
            wall = step
            job.add([_step(job, member, step - offset, at, generation)], at)
        else:
            job.add([_standin(job, member, at, wall - offset, generation)], at)
        r += 1
        if len(job.made) >= _CHUNK:
            yield job.take()
    end = max(job.clock, start + timedelta(seconds=seconds))
    completed = {"step": wall - offset}
    job.add([job.validated(job.control, "job.completed", completed, end, job.v.generation)], end)
    yield job.take()


class _Chunks:
    """The steps chunks of the leader's snapshots of the history: what the events of each
    snapshot interval counted (``core.steps``), and what the last one counted so far."""

    def __init__(self, start: datetime) -> None:
        self.start = start
        self.chunks: list[tuple[int, bytes]] = []
        self.counting = JobSteps()
        self.window = 0

    def count(self, stored: list[StoredEvent], ignored: frozenset[int]) -> None:
        cut = 0
        for k, one in enumerate(stored):
            window = int((one.recorded_at - self.start).total_seconds() // SNAPSHOT_INTERVAL_S)
            if window != self.window:
                self.counting.count(stored[cut:k], ignored)
                if self.counting.seen:
                    at = stored[k - 1].position if k else stored[0].position - 1
                    self.chunks.append((at, encode_steps(self.counting)))
                self.counting, self.window, cut = JobSteps(), window, k
        self.counting.count(stored[cut:], ignored)


_COPY = (
    "COPY events (position, recorded_at, event_id, job_id, type, v, source, incarnation,"
    " seq, generation, emitted_at, payload) FROM STDIN"
)


class History:
    """The events of a history (see the module docstring), made and folded a batch at a
    time by ``batches``: ``rows`` rows of a job of ``ranks`` ranks spread over ``days`` up
    to ``end`` (default now), with ``incidents`` crashes (by default ``INCIDENTS_PER_DAY``
    a day when ``ranks`` is above 1), at the log positions from ``first_position`` on."""

    def __init__(
        self,
        rows: int,
        days: float,
        *,
        ranks: int = 1,
        incidents: int | None = None,
        first_position: int = 1,
        end: datetime | None = None,
    ) -> None:
        if ranks < 1:
            raise ValueError("a history job has at least one rank")
        if incidents is None:
            incidents = round(INCIDENTS_PER_DAY * days) if ranks > 1 else 0
        if ranks == 1 and incidents:
            raise ValueError("a one-rank history job has no spare to recover with")
        if rows < HEAD_ROWS + 1:
            raise ValueError(f"a history has at least {HEAD_ROWS + 1} rows")
        self.rows, self.ranks, self.incidents = rows, ranks, incidents
        self.seconds = days * 86_400
        self.start = (end or datetime.now(UTC)) - timedelta(days=days)
        self.job_id = f"history-{uuid.uuid4().hex[:8]}"
        self._job = SimLog(self.job_id, first_position - 1, random.Random(rows))
        self.first_position = first_position

    def batches(self) -> Iterator[tuple[list[StoredEvent], frozenset[int]]]:
        """The events in log order, a batch at a time, each with the positions of those the
        fold did not believe (``fold_noting``)."""
        return _history(
            self._job, self.rows, self.start, self.seconds,
            ranks=self.ranks, incidents=self.incidents,
        )  # fmt: skip

    @property
    def view(self) -> JobView:
        """The job's view of the events made so far."""
        return self._job.v

    @property
    def end(self) -> int:
        """The last position made."""
        return self._job.position


def write_history(
    database_url: str,
    rows: int,
    days: float,
    *,
    ranks: int = 1,
    incidents: int | None = None,
    progress: bool = False,
) -> Written:
    """Write a ``History`` of ``rows`` rows over ``days`` before now after the log's head,
    and record what a leader would have recorded of it: the view snapshot at its end, and
    the steps of each snapshot interval (``SNAPSHOT_INTERVAL_S``) as its chunk. The log must
    hold no other job's events after its head."""
    History(rows, days, ranks=ranks, incidents=incidents)  # the arguments checked first
    with (
        psycopg.connect(libpq_url(database_url), autocommit=False) as conn,
        ThreadPoolExecutor(1, thread_name_prefix="history-copy") as copier,
    ):

        def write(data: bytes) -> None:
            with conn.cursor().copy(_COPY) as copy:
                copy.write(data)

        pending: Future[None] | None = None
        found = conn.execute("SELECT position FROM log_head WHERE id = 1 FOR UPDATE").fetchone()
        history = History(
            rows, days, ranks=ranks, incidents=incidents,
            first_position=(int(found[0]) if found else 0) + 1,
        )  # fmt: skip
        job_id = history.job_id
        chunks = _Chunks(history.start)
        written = 0
        for stored, ignored in history.batches():
            data = b"".join(
                b"%d\t%s\t%s\n" % (s.position, s.recorded_at.isoformat().encode(),
                                   encode_row(s.event))
                for s in stored
            )  # fmt: skip
            if pending is not None:  # the server writes one batch while the next is made
                pending.result()
            pending = copier.submit(write, data)
            chunks.count(stored, ignored)
            before, written = written, written + len(stored)
            if progress and written // (_CHUNK * 10) > before // (_CHUNK * 10):
                _progress(f"history: {written:,} of about {rows:,} rows")
        if pending is not None:
            pending.result()
        conn.execute("UPDATE log_head SET position = %s WHERE id = 1", (history.end,))
        conn.commit()
    view = history.view
    settle(database_url)
    store = PostgresEventStore.from_url(database_url)
    try:
        store.save_snapshot(
            history.end, fold_version(), {job_id: (view.last_position, encode_view(view))},
            taken_at=datetime.now(UTC), whole=True, steps={job_id: encode_steps(chunks.counting)},
        )  # fmt: skip
    finally:
        store.close()
    # The earlier intervals' chunks, as the leader's snapshots before the last wrote them.
    with psycopg.connect(libpq_url(database_url), autocommit=False) as conn:
        with conn.cursor().copy(
            "COPY snapshot_steps (job_id, position, body) FROM STDIN (FORMAT BINARY)"
        ) as copy:
            copy.set_types(["text", "int8", "bytea"])
            for chunk_at, body in chunks.chunks:
                copy.write_row((job_id, chunk_at, body))
        conn.commit()
    return Written(
        end=history.end,
        job_id=job_id,
        rows=history.end - history.first_position + 1,
        members=tuple(view.members),
        incidents=len(view.incidents),
    )


def settle(database_url: str) -> None:
    """What an operator does after a bulk load: the planner's statistics and the visibility
    map of the events table, now rather than by autovacuum on the same two cores in the
    middle of a measurement (a plan made without statistics, or index-only scans that visit
    the heap until autovacuum has passed)."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) events")


def log_size(database_url: str) -> tuple[int, int]:
    """The log's rows (its last position) and bytes on disk (every partition of the events
    table, with its indexes and TOAST; the table itself when it is not partitioned)."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        found = conn.execute("SELECT position FROM log_head WHERE id = 1").fetchone()
        size = conn.execute(
            "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('events')"
            " WHERE isleaf"
        ).fetchone()
    return (int(found[0]) if found else 0), (int(size[0]) if size and size[0] else 0)
