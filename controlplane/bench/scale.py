"""``elasticctl bench scale``: the control plane at a job's size, through the real service.

``ranks`` simulated members (8 a node, 16 nodes a rack, and spares) join one job and then
behave as the design has them behave, against a control plane process (``elasticctl serve``)
as deployed:

- each member heartbeats every ``heartbeat_interval_s``, and each node's launcher sends its
  members' heartbeats in one message an interval on its NATS core subject (``--heartbeats
  node``, as ``elasticctl run`` relays them; ``member``: each member on its own subject),
  spread over the interval as real clocks are (soft state: nothing is stored);
- rank 0 records one ``train.step`` a second (steps at job granularity), and the first rank of
  each new generation its first step;
- every ``backup_interval`` steps each rank records its backup (``backup.snapshot``, naming
  the holders that kept its copy), as the runtime does.

First ``steady_seconds`` of that without faults, then ``seconds`` with ``faults`` injected at
even intervals, alternating a crash (the member's heartbeats stop and its node's launcher
reports ``member.exited``, on a connection of the launchers' own: a launcher is a process of
its own, its report waits for no member's send) and a hang (the member's heartbeats stop).
What the report says:

- ``hang_detect_p50_s`` / ``_p99_s``: a hung member's last heartbeat sent, to the commit of the
  ``fault.detected`` that names it (the timeout in force included);
- ``decide_p50_ms`` / ``_p99_ms``: the fault (a crash: the exit reported; a hang: its last
  heartbeat heard plus the timeout) to the commit of the decision, as ``bench decide`` times it;
- ``db_bytes_per_rank_day``: how much every table of the database grew while the job trained
  without faults (``pg_total_relation_size``: heap, TOAST and indexes), per rank, scaled to a
  day: measured from one backup to the one ``steady_seconds`` later, each once the ingest had
  stored it whole, over the time between the two backups (so the window holds exactly
  ``steady_backups`` backups' rows, and the steps and summaries in between);
  ``db_bytes_per_rank_day_by_relation`` splits that growth by relation (each table's heap,
  its TOAST, each index; each partition of the log on its own);
  ``db_bytes_per_rank_day_by_type`` by event type, as each type's payloads are stored in the
  same window (without the rows' headers, the envelope's columns and the indexes, which the
  total has); ``db_payload_bytes_per_fault``: the payloads the control plane recorded for
  each fault (its detection, decision, generation, incident) in the window with faults;
- ``controlplane_cpu_cores``: the control plane process's CPU time over both phases, per
  second (the simulated members, NATS and PostgreSQL share the machine);
- ``lost`` / ``duplicated``: durable events the members published (JetStream acknowledged
  each) that the log lacks, and stored ones beyond them; ``false_detections``: members found
  failed that no fault was injected into (an overloaded control plane hears heartbeats late).

Commit times come from PostgreSQL (``track_commit_timestamp``, which the benchmark turns on in
the PostgreSQL it starts); with an external one that does not record them the latencies are
not reported (``measured_to`` says so). All clocks are this machine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
import psycopg
from nats.aio.client import Client

from controlplane.bench import loadgen
from controlplane.bench.decide import _commit_times, _layout, _percentile, _until_caught_up
from controlplane.bench.members import SimulatedJob
from controlplane.bench.stack import serving, stack
from controlplane.bus import ensure_stream
from controlplane.publish import Outgoing
from controlplane.settings import Settings, libpq_url
from controlplane.store.postgres import (
    CATALOG_PAYLOADS,
    MEMBER_ROWS,
    PostgresEventStore,
    member_event_counts,
)
from schemas.commands import COMMAND_ADAPTER, Reallocate, Start
from schemas.common import CONTROLPLANE_SOURCE
from schemas.subjects import command_subject

#: Slices of each heartbeat interval: a member beats in one of them (spread, not a burst).
_SLICES = 20
#: How long a fault may wait for its decision before the run gives up on it.
_DECISION_WAIT_S = 60.0


class BenchScaleError(RuntimeError):
    """The benchmark could not run as asked (the job never started, say)."""


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: Every relation of the schema's tables on its own: each table's heap (with its free space
#: and visibility maps), its TOAST (with the TOAST's index) and each of its indexes; a
#: partition is a table of its own. Together: the tables' ``pg_total_relation_size``.
_RELATION_SIZES = """
WITH t AS (
    SELECT c.oid, c.relname, c.reltoastrelid FROM pg_class c
      JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.relkind IN ('r', 'm') AND n.nspname = current_schema()
)
SELECT relname, pg_relation_size(oid) + pg_relation_size(oid, 'fsm')
       + pg_relation_size(oid, 'vm') FROM t
UNION ALL
SELECT relname || ' (toast)', pg_total_relation_size(reltoastrelid) FROM t
 WHERE reltoastrelid <> 0
UNION ALL
SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid) FROM pg_index i
  JOIN t ON t.oid = i.indrelid
"""


async def _whole_backup(
    fleet: _Fleet, nc: Client, settings: Settings, db: psycopg.AsyncConnection[Any]
) -> tuple[int, int]:
    """Once every backup published so far is stored whole (the ingest has fewer than two
    messages not committed, and no backup came meanwhile): how many, and the log's head."""
    while True:
        count = len(fleet.backup_times)
        await _until_caught_up(nc, settings, 2, timeout_s=300.0)
        if len(fleet.backup_times) == count:
            row = await (await db.execute("SELECT position FROM log_head")).fetchone()
            return count, int(row[0]) if row else 0


async def _relation_sizes(conn: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    """Every relation of the database's schema and its size (``_RELATION_SIZES``)."""
    cursor = await conn.execute(_RELATION_SIZES)
    return {str(name): int(size) for name, size in await cursor.fetchall()}


@dataclass
class _Fault:
    kind: str  # "crash" | "hang"
    member: str
    #: A hang: when the member's last heartbeat was sent (this machine's clock, Unix s).
    last_sent: float = 0.0
    #: The decision reached the members (None: it never came within the wait).
    decided: bool = False


@dataclass
class _Fleet:
    """The simulated members' side: heartbeats, steps, backups, commands, faults."""

    job: SimulatedJob
    events: loadgen.Publisher
    beats: loadgen.Publisher
    interval_s: float
    backup_interval: int
    #: Each node's launcher relays its members' heartbeats, one message an interval (else
    #: every member heartbeats on its own subject).
    relay: bool = True
    silent: set[str] = field(default_factory=set)
    commands: list[Start | Reallocate] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    #: A backup was published.
    backed_up: asyncio.Event = field(default_factory=asyncio.Event)
    #: When each backup was published (Unix s), in order.
    backup_times: list[float] = field(default_factory=list)
    _rng: random.Random = field(default_factory=lambda: random.Random(7))
    #: Durable events published and acknowledged (each member's, its launcher's).
    published: int = 0
    refused: int = 0
    beats_sent: int = 0
    #: Heartbeat messages sent (one per member's beat, or per node's relay).
    messages_sent: int = 0
    #: The largest command the members received (bytes).
    command_bytes: int = 0
    step: int = 0
    #: slice -> when it was last sent (Unix s): a member's last heartbeat.
    slice_sent: dict[int, float] = field(default_factory=dict)
    _frames: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    #: A node's relay frame and the beats it carries (rebuilt when the node's members'
    #: generations or silences change).
    _node_frames: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    _nodes: dict[str, list[str]] = field(default_factory=dict)
    _order: dict[str, int] = field(default_factory=dict)
    _sending: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: The launchers' own connection: a launcher is a process of its own, and its report of
    #: a member's exit does not wait for the members' backup reports to be sent (None: the
    #: members' connection, in turn).
    launchers: loadgen.Publisher | None = None

    @property
    def current(self) -> Start | Reallocate:
        return self.commands[-1]

    async def send(self, build: Callable[[], list[Outgoing]]) -> None:
        """Publish what ``build`` makes, one send at a time (each member's events reach the
        stream in ``seq`` order, as one member's connection keeps them)."""
        async with self._sending:
            messages = build()
            if messages:
                self.refused += await self.events.send(loadgen.frames(messages))
                self.published += len(messages)

    async def report(self, build: Callable[[], list[Outgoing]]) -> None:
        """Publish a launcher's report on the launchers' connection, beside the members'
        sends (a launcher's events are in ``seq`` order on it: it sends one at a time)."""
        if self.launchers is None:
            await self.send(build)
            return
        messages = build()
        self.refused += await self.launchers.send(loadgen.frames(messages))
        self.published += len(messages)

    async def on_command(self, msg: Any) -> None:
        self.command_bytes = max(self.command_bytes, len(msg.data))
        command = COMMAND_ADAPTER.validate_json(msg.data)
        if not isinstance(command, Start | Reallocate):
            return
        if any(c.command_id == command.command_id for c in self.commands):
            return  # a re-sent command
        if self.commands and command.generation <= self.current.generation:
            return
        for name in command.world:
            self.job.members[name].generation = command.generation
        self._node_frames.clear()
        self.commands.append(command)
        self.arrived.set()

    async def next_command(self, count: int, wait_s: float) -> Start | Reallocate | None:
        deadline = time.monotonic() + wait_s
        while len(self.commands) < count:
            self.arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), left)
        return self.commands[count - 1]

    def _frame(self, name: str) -> bytes:
        """``name``'s heartbeat as a NATS core ``PUB`` frame, re-encoded when its generation
        changed (its step is the one it had then: the control plane keeps it, decides
        nothing by it)."""
        member = self.job.members[name]
        cached = self._frames.get(name)
        if cached is not None and cached[0] == member.generation:
            return cached[1]
        phase = "train" if member.generation else "waiting"
        message = self.job.beat_message(name, self.step, phase)
        frame = b"PUB %s %d\r\n%s\r\n" % (message.subject.encode(), len(message.data), message.data)
        self._frames[name] = (member.generation, frame)
        return frame

    def silence(self, name: str) -> None:
        """``name`` sends no more heartbeats (it hung, or it died)."""
        self.silent.add(name)
        self._node_frames.pop(self.job.members[name].node, None)

    def _node_frame(self, node: str) -> tuple[bytes, int]:
        """``node``'s relayed heartbeats as a ``PUB`` frame, and how many beats it carries."""
        cached = self._node_frames.get(node)
        if cached is None:
            names = [n for n in self._nodes[node] if n not in self.silent]
            message = self.job.node_beats_message(node, names, self.step)
            frame = b"PUB %s %d\r\n%s\r\n" % (
                message.subject.encode(), len(message.data), message.data)  # fmt: skip
            cached = self._node_frames[node] = (frame, len(names))
        return cached

    def slice_of(self, name: str) -> int:
        key = self.job.members[name].node if self.relay else name
        return self._order[key] % _SLICES

    async def heartbeats(self, stop: asyncio.Event) -> None:
        """Every member not silent (or every node, its launcher relaying), once an interval,
        a slice every ``interval / _SLICES``."""
        names = list(self.job.members)
        for name in names:
            self._nodes.setdefault(self.job.members[name].node, []).append(name)
        units = list(self._nodes) if self.relay else names
        self._order = {unit: i for i, unit in enumerate(units)}
        started = time.monotonic()
        tick = 0
        while not stop.is_set():
            k = tick % _SLICES
            if self.relay:
                built = [self._node_frame(node) for node in units[k::_SLICES]]
                frames = [frame for frame, beats in built if beats]
                beats = sum(beats for _, beats in built)
            else:
                frames = [self._frame(n) for n in units[k::_SLICES] if n not in self.silent]
                beats = len(frames)
            if frames:
                await self.beats.send_core(frames)
                self.beats_sent += beats
                self.messages_sent += len(frames)
            self.slice_sent[k] = time.time()
            tick += 1
            left = started + tick * self.interval_s / _SLICES - time.monotonic()
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), left)

    def _backup(self, step: int) -> list[Outgoing]:
        """Each rank's record of its backup, naming the holders that kept its copy (as the
        runtime reports once its copies are sent), with what a real report has: its state's
        sha256 (a digest of the job, step and shard here: as incompressible as a real one)
        and the seconds its copy took (a float with every bit used, as a clock's difference)."""
        command = self.current
        placement = command.placement
        prefix = f"{self.job.job_id}/{step}/".encode()
        return [
            self.job.envelope(owner, "backup.snapshot", {
                "step": step, "shard": shard, "nbytes": 1 << 20,
                "checksum": "sha256:" + hashlib.sha256(b"%s%d" % (prefix, shard)).hexdigest(),
                "seconds": self._rng.uniform(0.005, 0.05),
                "holders": list(placement[shard]) if shard < len(placement) else []})
            for shard, owner in enumerate(command.world)
        ]  # fmt: skip

    def _step(self, lead: str, step: int) -> list[Outgoing]:
        return [self.job.envelope(lead, "train.step", {
            "step": step, "loss": 1.0, "step_seconds": 1.0, "samples": 8})]  # fmt: skip

    async def train(self, stop: asyncio.Event) -> None:
        """One step a second, recorded by rank 0; a backup every ``backup_interval`` steps."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if stop.is_set():
                return
            self.step += 1
            step, lead = self.step, self.current.world[0]
            await self.send(lambda: self._step(lead, step))  # noqa: B023  (called at once)
            if step % self.backup_interval == 0:
                await self.send(lambda: self._backup(step))  # noqa: B023
                self.backup_times.append(time.time())
                self.backed_up.set()

    async def backups(self, count: int) -> None:
        """Until ``count`` backups were published."""
        while len(self.backup_times) < count:
            self.backed_up.clear()
            await self.backed_up.wait()

    async def resume(self, command: Reallocate) -> None:
        """The new generation's first step (its first rank's), from the restored step on."""
        self.step = command.restore_step + 1
        lead, step = command.world[0], self.step
        await self.send(lambda: self._step(lead, step))


async def _scenario(
    services_nats: str,
    database_url: str,
    job_id: str,
    serve_pid: int,
    *,
    ranks: int,
    seconds: float,
    steady_s: float,
    faults: int,
    interval_s: float,
    timeout_s: float,
    backup_interval: int,
    relay: bool,
    progress: bool,
) -> dict[str, Any]:
    job = SimulatedJob(None, job_id, _layout(ranks, spares=max(2, (faults + 1) // 2)))
    fleet = _Fleet(
        job,
        await loadgen.Publisher.connect(services_nats),
        await loadgen.Publisher.connect(services_nats),
        interval_s,
        backup_interval,
        relay=relay,
        launchers=await loadgen.Publisher.connect(services_nats),
    )
    policy = {
        "world_size": ranks,
        "min_world": 1,
        "max_world": ranks,
        "backup_interval": backup_interval,
        "redundancy": 2,
        "heartbeat_interval_s": interval_s,
        "heartbeat_timeout_s": {"init": 60.0, "train": timeout_s, "waiting": 60.0,
                                "backup": 60.0, "restore": 60.0},
        "recovery_deadline_s": 300.0,
        "max_decisions_per_incident": 100,
    }  # fmt: skip
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    nc: Client | None = None
    injected: list[_Fault] = []
    try:
        nc = await nats.connect(services_nats)
        settings = Settings()  # names the stream and consumer as the service does
        await ensure_stream(nc.jetstream(), settings)
        await nc.subscribe(command_subject(job_id), cb=fleet.on_command)
        names = list(job.members)
        if progress:
            _progress(f"{len(names)} members join ({ranks} ranks)")
        await fleet.send(lambda: job.joining(names, policy))
        tasks.append(asyncio.create_task(fleet.heartbeats(stop)))
        start = await fleet.next_command(1, 300.0)
        if start is None:
            raise BenchScaleError("the job did not start within 300s")
        tasks.append(asyncio.create_task(fleet.train(stop)))
        if progress:
            _progress(f"generation 1 runs {len(start.world)} ranks; waiting for its first backup")
        await fleet.backups(1)
        async with await psycopg.AsyncConnection.connect(
            libpq_url(database_url), autocommit=True
        ) as db:
            # Training without faults, from one backup to another ``periods`` backups later,
            # each measured once the ingest has stored it whole: the log's growth over whole
            # backup intervals (the rows of exactly ``periods`` backups, and the steps and
            # summaries in between), over the time between the two backups' publication.
            periods = max(1, round(steady_s / backup_interval))
            base, p0 = await _whole_backup(fleet, nc, settings, db)
            steady0, cpu_start, s0 = await _relation_sizes(db), _cpu_seconds(serve_pid), time.time()
            published0, beats0 = fleet.published, fleet.beats_sent
            messages0 = fleet.messages_sent
            if progress:
                _progress(f"measuring {periods} backup intervals without faults")
            await fleet.backups(base + periods)
            last, p1 = await _whole_backup(fleet, nc, settings, db)
            if last != base + periods:
                raise BenchScaleError("the ingest fell a backup behind: no steady window")
            steady1 = await _relation_sizes(db)
            steady_window = fleet.backup_times[last - 1] - fleet.backup_times[base - 1]
            cursor = await db.execute(
                "SELECT type, sum(pg_column_size(payload)) FROM events WHERE job_id = %s"
                " AND position > %s AND position <= %s GROUP BY type",
                (job_id, p0, p1),
            )
            by_type = {str(t): int(b) for t, b in await cursor.fetchall()}
            # Then the faults.
            t0 = time.time()
            if progress:
                _progress(f"measuring for {seconds:g}s, {faults} faults")
            for k in range(faults):
                due = t0 + (k + 0.5) * seconds / faults
                await asyncio.sleep(max(0.0, due - time.time()))
                world = fleet.current.world
                victim = world[1 + (k * 7919) % (len(world) - 1)]  # never rank 0 (it records)
                fault = _Fault("crash" if k % 2 == 0 else "hang", victim)
                if fault.kind == "hang":
                    fault.last_sent = fleet.slice_sent.get(fleet.slice_of(victim), time.time())
                fleet.silence(victim)
                if fault.kind == "crash":
                    exit_ = {"member": victim, "signal": 9}
                    await fleet.report(
                        lambda v=victim, p=exit_: [  # type: ignore[misc]
                            job.envelope(v, "member.exited", p, by=job.launcher(v))
                        ]
                    )
                injected.append(fault)
                command = await fleet.next_command(len(fleet.commands) + 1, _DECISION_WAIT_S)
                if not isinstance(command, Reallocate):
                    if progress:
                        _progress(f"fault {k + 1}: no decision within {_DECISION_WAIT_S:g}s")
                    break
                fault.decided = True
                if progress:
                    _progress(f"fault {k + 1}/{faults}: {fault.kind} of {victim} -> generation"
                              f" {command.generation} ({command.mode}, {len(command.world)}"
                              " ranks)")  # fmt: skip
                await fleet.resume(command)
            await asyncio.sleep(max(0.0, t0 + seconds - time.time()))
            t1, cpu1 = time.time(), _cpu_seconds(serve_pid)
            published1, beats1 = fleet.published, fleet.beats_sent
            messages1 = fleet.messages_sent
            stop.set()
            for task in tasks:
                await task
            tasks = []
            await _until_caught_up(nc, settings, 1, timeout_s=300.0)
            cursor = await db.execute(
                "SELECT coalesce(sum(pg_column_size(payload)), 0) FROM events WHERE job_id = %s"
                " AND source = %s AND type NOT IN ('liveness.summary', 'backup.catalog')"
                " AND recorded_at >= to_timestamp(%s) AND recorded_at <= to_timestamp(%s)",
                # Within the window: once the members stop, the control plane finds them all
                # silent, and that decision (naming thousands) is no fault's.
                (job_id, CONTROLPLANE_SOURCE, t0, t1),
            )
            row = await cursor.fetchone()
            decided_bytes = int(row[0]) if row else 0
            own = await (await db.execute(MEMBER_ROWS, {"job": job_id})).fetchall()
            cursor = await db.execute(CATALOG_PAYLOADS, {"job": job_id})
            payloads = [r[0] for r in await cursor.fetchall()]
            stored, distinct = member_event_counts(own, payloads)
    finally:
        stop.set()
        for task in tasks:
            with contextlib.suppress(Exception):
                await task
        if nc is not None:
            await nc.close()
        await fleet.events.close()
        await fleet.beats.close()
        if fleet.launchers is not None:
            await fleet.launchers.close()
    window, steady = t1 - t0, steady_window
    accepted = fleet.published - fleet.refused
    grown = {
        name: size - steady0.get(name, 0)
        for name, size in steady1.items()
        if size != steady0.get(name, 0)
    }
    steady_rate = sum(grown.values()) / steady  # bytes a second without faults
    return {
        "window": window,
        "stopped_at": t1,
        "steady_window": steady,
        "steady_bytes_per_s": steady_rate,
        "decided_bytes": decided_bytes,
        "db_bytes_by_type": by_type,
        "db_bytes_by_relation": grown,
        "cpu_seconds": cpu1 - cpu_start,
        "cpu_window": t1 - s0,
        "steady_backups": periods,
        "events_per_s": (published1 - published0) / (t1 - s0),
        "heartbeats_per_s": (beats1 - beats0) / (t1 - s0),
        "heartbeat_messages_per_s": (messages1 - messages0) / (t1 - s0),
        "lost": max(0, accepted - distinct),
        "duplicated": (stored - distinct) + max(0, distinct - accepted),
        "refused": fleet.refused,
        "command_bytes": fleet.command_bytes,
        "injected": injected,
    }


def _detections(
    store: PostgresEventStore,
    job_id: str,
    injected: list[_Fault],
    timeout_s: float,
    stopped_at: float,
) -> tuple[list[float], list[float], list[float], dict[str, list[str]], bool]:
    """Hang detection (s), and each fault's decision latency (ms, by crash and hang), from
    the log; the members found failed that no fault was injected into; whether commit
    times were known. What was detected after the simulated members stopped (at
    ``stopped_at``, Unix time: they all fall silent then) is not counted."""
    log = store.read(
        job_id=job_id, types=["member.exited", "fault.detected", "reallocation.issued"]
    )
    detections = [
        s
        for s in log
        if s.event.type == "fault.detected" and s.recorded_at.timestamp() < stopped_at
    ]
    decisions = [s for s in log if s.event.type == "reallocation.issued"]
    commits = _commit_times(store, [s.position for s in detections + decisions])
    by_position = {s.position: s for s in log}
    faulted = {f.member: f for f in injected}
    hang_s: list[float] = []
    crash_ms: list[float] = []
    hangs_ms: list[float] = []
    false: dict[str, list[str]] = {}  # reason -> members found failed without a fault
    for detected in detections:
        payload = detected.event.payload
        unfaulted = [m for m in payload.members if m not in faulted]
        if unfaulted:
            false.setdefault(payload.reason, []).extend(unfaulted)
        ours = [faulted[m] for m in payload.members if m in faulted]
        if not ours or commits is None:
            continue
        decision = next((s for s in decisions if s.position > detected.position), None)
        evidence = payload.evidence[0]
        if payload.reason == "exited" and evidence.position in by_position:
            trigger = by_position[evidence.position].event.emitted_at.timestamp()
            if decision is not None:
                crash_ms.append((commits[decision.position] - trigger) * 1000)
        elif payload.reason == "heartbeat_timeout":
            for fault in ours:
                if fault.kind == "hang":
                    hang_s.append(commits[detected.position] - fault.last_sent)
            if decision is not None and evidence.at is not None:
                trigger = evidence.at.timestamp() + timeout_s
                hangs_ms.append((commits[decision.position] - trigger) * 1000)
    return hang_s, crash_ms, hangs_ms, false, commits is not None


def run_scale_bench(
    *,
    ranks: int,
    seconds: float = 60.0,
    steady_seconds: float = 30.0,
    faults: int = 6,
    heartbeat_interval_s: float = 0.25,
    hang_timeout_s: float = 0.75,
    backup_interval: int = 10,
    heartbeats: str = "node",
    progress: bool = True,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (see the module's docstring; ``heartbeats``
    ``node``: each node's launcher relays its members' heartbeats in one message an
    interval, as ``elasticctl run`` does; ``member``: every member heartbeats on its own)."""
    if heartbeats not in ("node", "member"):
        raise ValueError(f"heartbeats: expected node or member, not {heartbeats!r}")
    if faults < 1 or ranks < 2:
        raise ValueError("needs at least 2 ranks and 1 fault")
    if hang_timeout_s <= heartbeat_interval_s:
        raise ValueError("the hang timeout must be longer than the heartbeat interval")
    level = {"ELASTIC_LOG_LEVEL": os.environ.get("ELASTIC_BENCH_LOG_LEVEL", "WARNING")}
    with (
        stack(commit_times=True) as services,
        serving(services, ELASTIC_RENDEZVOUS_PORT="0", **level) as serve,
    ):
        job_id = f"scale-{uuid.uuid4().hex[:8]}"
        out = asyncio.run(
            _scenario(
                services.nats_url,
                services.database_url,
                job_id,
                serve.pid,
                ranks=ranks,
                seconds=seconds,
                steady_s=steady_seconds,
                faults=faults,
                interval_s=heartbeat_interval_s,
                timeout_s=hang_timeout_s,
                backup_interval=backup_interval,
                relay=heartbeats == "node",
                progress=progress,
            )
        )
        store = PostgresEventStore.from_url(services.database_url)
        try:
            hang_s, crash_ms, hangs_ms, false, committed = _detections(
                store, job_id, out["injected"], hang_timeout_s, out["stopped_at"]
            )
        finally:
            store.close()
    injected: list[_Fault] = out["injected"]
    decide_ms = crash_ms + hangs_ms
    window = out["window"]

    def pct(values: list[float], q: float, digits: int) -> float | None:
        return round(_percentile(values, q), digits) if values else None

    return {
        "ranks": ranks,
        "heartbeat_interval_s": heartbeat_interval_s,
        "heartbeats": heartbeats,
        "hang_timeout_s": hang_timeout_s,
        "faults": len(injected),
        "decided": sum(f.decided for f in injected),
        "hang_detect_p50_s": round(statistics.median(hang_s), 3) if hang_s else None,
        "hang_detect_p99_s": pct(hang_s, 0.99, 3),
        "decide_p50_ms": round(statistics.median(decide_ms), 1) if decide_ms else None,
        "decide_p99_ms": pct(decide_ms, 0.99, 1),
        "crash_decide_ms": [round(x, 1) for x in crash_ms],
        "hang_decide_ms": [round(x, 1) for x in hangs_ms],
        "measured_to": "commit" if committed else "none (no commit times recorded)",
        # Training without faults: the tables' growth per rank, scaled to a day.
        "db_bytes_per_rank_day": round(out["steady_bytes_per_s"] / ranks * 86400),
        # Each type's payloads as stored then (no row header, envelope column or index).
        "db_bytes_per_rank_day_by_type": {
            t: round(b / ranks / out["steady_window"] * 86400)
            for t, b in sorted(out["db_bytes_by_type"].items(), key=lambda kv: -kv[1])
        },
        # The same growth by relation: each table's heap, TOAST and indexes (and partitions).
        "db_bytes_per_rank_day_by_relation": {
            name: round(b / ranks / out["steady_window"] * 86400)
            for name, b in sorted(out["db_bytes_by_relation"].items(), key=lambda kv: -kv[1])
        },
        # What the control plane recorded per fault (its detection, decision, generation and
        # incident events: their payloads as stored), for the whole job.
        "db_payload_bytes_per_fault": round(out["decided_bytes"] / max(1, len(injected))),
        "controlplane_cpu_cores": round(out["cpu_seconds"] / out["cpu_window"], 2),
        "heartbeats_per_s": round(out["heartbeats_per_s"], 1),
        "heartbeat_messages_per_s": round(out["heartbeat_messages_per_s"], 1),
        "events_per_s": round(out["events_per_s"], 1),
        "lost": out["lost"],
        "duplicated": out["duplicated"],
        "refused": out["refused"],
        # The largest command the members received (a decision names every rank).
        "command_bytes_max": out["command_bytes"],
        # Members found failed without a fault, by the detection's reason (a few named).
        "false_detections": sum(len(v) for v in false.values()),
        "false_detections_by_reason": {
            reason: {"members": len(names), "e.g.": sorted(names)[:5]}
            for reason, names in false.items()
        },
        "seconds": round(window, 1),
        "steady_seconds": round(out["steady_window"], 1),
        "steady_backups": out["steady_backups"],
        "cpus": os.cpu_count(),
        **services.where,
    }
