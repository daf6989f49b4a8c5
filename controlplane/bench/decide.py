"""``elasticctl bench decide``: fault to recorded decision, through the real service.

``members`` simulated members join one job and heartbeat at 1 Hz through NATS into the control
plane (``elasticctl serve``, its own process, as deployed). Once the first generation runs, a
backup is complete and the ingest has caught up with it (``backup_caught_up_s``: the heartbeats
queued behind a backup of 4,096 ranks keep it seconds behind on two cores), faults are
injected one after another, alternating a crash (the launcher reports ``member.exited``) and a
hang (the member stops heartbeating). Each fault's latency runs

- crash: from the moment the exit was reported (the ``member.exited`` envelope's
  ``emitted_at``, taken just before it is published);
- hang: from the moment its heartbeat timeout expired (its last heartbeat's ``recorded_at``
  plus the policy's timeout);

to the moment the decision was appended: the commit time PostgreSQL records for the
transaction that stored its ``reallocation.issued`` (``track_commit_timestamp``, which the
benchmark turns on in the PostgreSQL it starts; it is taken as the commit is written, just
before the write-ahead log is flushed). The same faults are also timed to the moment the
``Reallocate`` command reached the members (``command_*``): what they wait for besides (the
fold of the decision, the command built and published). With an external PostgreSQL that
does not record commit times, the command's arrival is all there is to go by, and the
figures say so (``measured_to``). All clocks are this machine's (an embedded PostgreSQL's
too). The simulated world answers each reallocation with the first step of the new
generation, so incidents resolve and the next fault opens a new one. With ``mesh`` (``--mesh
dp=64,tp=8,pp=8``) the job's policy declares that mesh (``tp`` node-local; the members' layout
puts a node-local group on each node), and the decider reasons in replicas: a spare takes the
lost rank's coordinate, and once the spares are used the damaged replica is dropped and its
survivors take later faults' ranks. Each member's events
reach the stream in the order of their ``seq``, as a real member's do; ``sequence_gaps``
counts the gaps the ingest recorded all the same (0 expected).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats
import nats.js.errors
import psycopg
import sqlalchemy as sa
from nats.aio.client import Client

from controlplane.bench import loadgen
from controlplane.bench.members import SimMember, SimulatedJob
from controlplane.bench.stack import serving, stack
from controlplane.bus import ensure_stream, unacknowledged
from controlplane.publish import Outgoing
from controlplane.settings import Settings, libpq_url
from controlplane.store.postgres import PostgresEventStore
from schemas.commands import COMMAND_ADAPTER, Reallocate, Start
from schemas.events import Mesh
from schemas.subjects import command_subject

#: A hang's latency runs from the expiry of this timeout, so its length does not enter the
#: figures; it only has to outlast a stall of the simulated world or of the ingest (on a
#: loaded 2-core machine, digesting the 12,000-event backup of 4,096 ranks can hold the
#: heartbeats back for seconds, and a shorter timeout then fails every member at once).
HANG_TIMEOUT_S = 6.0
#: The events the latencies are computed from.
_MEASURED_TYPES = ("member.exited", "fault.detected", "reallocation.issued")


def parse_mesh(text: str) -> Mesh:
    """``dp=64,tp=8,pp=8`` -> that mesh (dimensions outermost first; ``tp`` node-local when
    present); ValueError with a message otherwise."""
    dims: list[tuple[str, int]] = []
    for part in text.split(","):
        name, sep, degree = part.strip().partition("=")
        if not sep or not degree.strip().isdigit():
            raise ValueError(f"mesh {text!r}: expected name=degree,... (e.g. dp=64,tp=8,pp=8)")
        dims.append((name.strip(), int(degree)))
    local = ["tp"] if any(name == "tp" for name, _ in dims) else []
    return Mesh.model_validate({"dims": dims, "node_local": local}, strict=False)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _layout(members: int, spares: int) -> list[SimMember]:
    """8 members per node, 16 nodes per rack (the last rack may be partial)."""
    out = []
    for i in range(members):
        node, rack = i // 8, i // 128
        out.append(SimMember(f"m{i}", f"n{node}", f"r{rack}"))
    racks = max(1, (members + 127) // 128)
    for s in range(spares):
        out.append(SimMember(f"spare{s}", f"sn{s}", f"r{s % racks}", role="spare"))
    return out


class _World:
    """The simulated members' side: heartbeats, commands, faults."""

    def __init__(self, publisher: loadgen.Publisher, job: SimulatedJob) -> None:
        #: The simulated members' connection to NATS, open for the whole run (as a member's
        #: client stays connected): a crash's trigger is not kept waiting by a connection's
        #: set-up.
        self.publisher = publisher
        self.job = job
        self.silent: set[str] = set()
        self.step = 0
        self.commands: list[Start | Reallocate] = []
        #: command_id -> when the command reached the members (this machine's clock).
        self.arrivals: dict[str, float] = {}
        self.arrived = asyncio.Event()
        self._sending = asyncio.Lock()

    async def send(self, build: Callable[[], list[Outgoing]]) -> list[Outgoing]:
        """Publish what ``build`` makes, one send at a time, and return it: the envelopes are
        built (their ``seq`` and ``emitted_at`` given) once it is this send's turn, so each
        member's events reach the stream in ``seq`` order, as one member's connection keeps
        them. (Built before, a heartbeat could overtake the setup's backup: a sequence gap,
        then events accepted late.)"""
        async with self._sending:
            messages = build()
            if messages:
                await self.publisher.send(loadgen.frames(messages))
        return messages

    async def send_one(self, member: str, type_: str, payload: dict[str, Any]) -> None:
        """``send`` of one event of ``member``."""
        await self.send(lambda: [self.job.envelope(member, type_, payload)])

    async def on_command(self, msg: Any) -> None:
        arrived = time.time()  # before parsing: the member has it now
        command = COMMAND_ADAPTER.validate_json(msg.data)
        known = {str(c.command_id) for c in self.commands}
        wanted = Reallocate if self.commands else Start
        if isinstance(command, wanted) and str(command.command_id) not in known:
            self.commands.append(command)
            self.arrivals[str(command.command_id)] = arrived
            self.arrived.set()

    async def next_command(self, count: int, wait_s: float = 120.0) -> Start | Reallocate:
        deadline = time.monotonic() + wait_s
        while len(self.commands) < count:
            self.arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no command #{count} within {wait_s:g}s")
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                continue
        return self.commands[count - 1]

    async def heartbeats(self, stop: asyncio.Event, slices: int = 20) -> None:
        """Every member not silent, once a second, spread over the second as real members'
        clocks are (a slice every 1/``slices`` s), not in one synchronized burst."""
        started = time.monotonic()
        tick = 0
        while not stop.is_set():

            def beat(tick: int = tick) -> list[Outgoing]:
                alive = [m for m in self.job.members if m not in self.silent]
                return [
                    self.job.envelope(m, "member.heartbeat", {"step": self.step, "phase": "train"})
                    for m in alive[tick % slices :: slices]
                ]

            await self.send(beat)
            tick += 1
            left = started + tick / slices - time.monotonic()
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), left)


async def _until_stored(database_url: str, job_id: str, backups: int) -> None:
    """Wait until the control plane committed ``backups`` backup events of the job."""
    query = (
        "SELECT count(*) FROM events WHERE job_id = %s"
        " AND type IN ('backup.snapshot', 'backup.replicated')"
    )
    async with await psycopg.AsyncConnection.connect(libpq_url(database_url)) as conn:
        for _ in range(1200):
            row = await (await conn.execute(query, (job_id,))).fetchone()
            if row is not None and row[0] >= backups:
                return
            await asyncio.sleep(0.05)
    raise TimeoutError("the backup was not stored within 60s")


async def _until_caught_up(nc: Any, settings: Settings, behind: int, timeout_s: float) -> float:
    """Wait until the ingest has fewer than ``behind`` messages not yet committed (pending or
    unacknowledged at its durable consumer; it acknowledges after the commit) three looks in
    a row; return the seconds waited."""
    js = nc.jetstream()
    started = time.monotonic()
    streak = 0
    while streak < 3:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the ingest did not catch up within {timeout_s:g}s")
        try:
            info = await js.consumer_info(settings.stream, settings.ingest_durable)
        except nats.js.errors.NotFoundError:  # not created yet, or being re-created
            streak = 0
        else:
            streak = streak + 1 if unacknowledged(info) < behind else 0
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def _scenario(
    url: str,
    database_url: str,
    job_id: str,
    *,
    members: int,
    faults: int,
    progress: bool,
    mesh: Mesh | None = None,
) -> tuple[dict[str, float], float]:
    """Run the job and its faults; return when each command reached the members, and how
    long the ingest took to catch up with the backup before the faults."""
    job = SimulatedJob(None, job_id, _layout(members, spares=max(2, faults // 2)))
    world = _World(await loadgen.Publisher.connect(url), job)
    nc: Client | None = None  # connected inside the try: a failed start closes the publisher
    policy = {
        "world_size": members,
        "min_world": 1,
        "max_world": members,
        "backup_interval": 10,
        "redundancy": 2,
        "heartbeat_timeout_s": {"init": 30.0, "train": HANG_TIMEOUT_S, "waiting": 30.0,
                                "backup": 30.0, "restore": 30.0},
        "recovery_deadline_s": 120.0,
        "max_decisions_per_incident": 100,
    }  # fmt: skip
    if mesh is not None:
        policy["mesh"] = mesh.model_dump(mode="json")
    stop = asyncio.Event()
    beating: asyncio.Task[None] | None = None
    try:
        nc = await nats.connect(url)
        settings = Settings()  # names the stream and consumer as the service (same environment)
        await ensure_stream(nc.jetstream(), settings)
        await nc.subscribe(command_subject(job_id), cb=world.on_command)
        if progress:
            _progress(f"{len(job.members)} members join")
        names = list(job.members)
        await world.send(lambda: job.joining(names, policy))
        beating = asyncio.create_task(world.heartbeats(stop))
        start = await world.next_command(1)
        assert isinstance(start, Start)
        for m in start.world:
            job.members[m].generation = start.generation
        world.step = 10
        if progress:
            _progress(f"generation 1 runs {len(start.world)} ranks; backing up step 10")

        def back_up() -> list[Outgoing]:
            out: list[Outgoing] = []
            for shard, owner in enumerate(start.world):
                checksum = f"crc32:{shard:08x}"
                out.append(job.envelope(owner, "backup.snapshot", {
                    "step": 10, "shard": shard, "nbytes": 1 << 20, "checksum": checksum,
                    "seconds": 0.01}))  # fmt: skip
                for holder in start.placement[shard]:
                    out.append(job.envelope(holder, "backup.replicated", {
                        "step": 10, "shard": shard, "owner": owner, "nbytes": 1 << 20,
                        "checksum": checksum, "seconds": 0.01}))  # fmt: skip
            return out

        backup = await world.send(back_up)
        sent = time.monotonic()
        await _until_stored(database_url, job_id, len(backup))
        # ... and the heartbeats that queued up behind it committed too (a backup of 4,096
        # ranks puts the ingest seconds behind on two cores), then digested (folded, a
        # turn): the faults land on the heartbeat load alone.
        await _until_caught_up(nc, settings, max(100, members // 4), timeout_s=120.0)
        caught_up_s = time.monotonic() - sent
        if progress:
            _progress(f"the ingest caught up {caught_up_s:.1f}s after the backup was sent")
        await asyncio.sleep(1.0)

        current: Start | Reallocate = start
        for k in range(faults):
            victim = current.world[(k * 7919) % len(current.world)]
            if k % 2 == 0:
                world.silent.add(victim)
                # Its emitted_at (the trigger) is taken when the send's turn comes.
                # ... reported by the launcher of its node (the only source believed).
                exit_ = {"member": victim, "signal": 9}
                await world.send(
                    lambda v=victim, p=exit_: [  # type: ignore[misc]
                        job.envelope(v, "member.exited", p, by=job.launcher(v))
                    ]
                )
                how = "crash"
            else:
                world.silent.add(victim)
                how = "hang"
            command = await world.next_command(k + 2)
            assert isinstance(command, Reallocate)
            if progress:
                _progress(
                    f"fault {k + 1}/{faults}: {how} of {victim} -> generation"
                    f" {command.generation} ({command.mode}, {len(command.world)} ranks)"
                )
            for m in command.world:
                job.members[m].generation = command.generation
            lead = command.world[0]
            await world.send_one(lead, "train.step", {
                "step": command.restore_step + 1, "loss": 1.0, "step_seconds": 0.01,
                "samples": 8})  # fmt: skip
            current = command
            await asyncio.sleep(1.0)
    finally:
        stop.set()
        if beating is not None:
            await beating
        if nc is not None:
            await nc.close()
        await world.publisher.close()
    return world.arrivals, caught_up_s


@dataclass(frozen=True, slots=True)
class _Latency:
    """One fault, in milliseconds: trigger -> the decision appended, and where the time
    went; trigger -> its command in the members' hands."""

    kind: str
    #: Trigger -> the decision's commit (or, without commit times, ``command_ms``).
    total_ms: float
    #: Trigger -> the decider's turn began (the ``emitted_at`` of its decisions): ingest of
    #: the exit and waiting for a quiet turn, or waking after the timeout expired.
    to_turn_ms: float
    #: The turn up to the commit: decide, append (or, without commit times, up to the
    #: command's arrival).
    turn_ms: float
    #: Trigger -> the ``Reallocate`` command reached the members (after the commit: commands
    #: are published only once recorded, and the decision folded).
    command_ms: float
    #: A crash's exit event, from published to committed by the ingest.
    ingest_ms: float | None = None


def _commit_times(store: PostgresEventStore, positions: list[int]) -> dict[int, float] | None:
    """When the transaction that stored each of ``positions`` committed (Unix seconds), or
    None where PostgreSQL does not record commit times (or not for every one of them)."""
    with store.engine.connect() as conn:
        if conn.execute(sa.text("SHOW track_commit_timestamp")).scalar_one() != "on":
            return None
        rows = conn.execute(
            sa.text(
                "SELECT position, pg_xact_commit_timestamp(xmin) FROM events"
                " WHERE position = ANY(:positions)"
            ),
            {"positions": positions},
        ).all()
    known = {int(p): at.timestamp() for p, at in rows if at is not None}
    return known if len(known) == len(set(positions)) else None  # all, or none of them


def _latencies(
    store: PostgresEventStore, job_id: str, arrivals: dict[str, float]
) -> tuple[list[_Latency], bool]:
    """Each fault's trigger to its decision's commit and to its command reaching the
    members; and whether commit times were known (else both end at the command)."""
    # Only what the figures need: the heartbeats (most of the log) are not read back.
    log = store.read(job_id=job_id, types=list(_MEASURED_TYPES))
    by_position = {s.position: s for s in log}
    decisions = [s.position for s in log if s.event.type == "reallocation.issued"]
    commits = _commit_times(store, decisions)
    out = []
    for stored in log:
        if stored.event.type != "fault.detected":
            continue
        payload = stored.event.payload
        decision = next(
            s for s in log if s.position > stored.position and s.event.type == "reallocation.issued"
        )
        evidence = payload.evidence[0]
        ingest = None
        if payload.reason == "exited":
            assert evidence.position is not None
            exit_event = by_position[evidence.position]
            trigger = exit_event.event.emitted_at.timestamp()
            ingest = (exit_event.recorded_at.timestamp() - trigger) * 1000
        else:
            assert evidence.at is not None
            trigger = evidence.at.timestamp() + HANG_TIMEOUT_S
        turn = decision.event.emitted_at.timestamp()
        arrived = arrivals[str(decision.event.payload.command_id)]
        appended = arrived if commits is None else commits[decision.position]
        out.append(
            _Latency(
                "crash" if payload.reason == "exited" else "hang",
                (appended - trigger) * 1000,
                (turn - trigger) * 1000,
                (appended - turn) * 1000,
                (arrived - trigger) * 1000,
                ingest,
            )
        )
    return out, commits is not None


def _count(store: PostgresEventStore, job_id: str, type_: str) -> int:
    """How many events of ``type_`` the job's log holds (counted by PostgreSQL)."""
    query = sa.text("SELECT count(*) FROM events WHERE job_id = :job AND type = :type")
    with store.engine.connect() as conn:
        return int(conn.execute(query, {"job": job_id, "type": type_}).scalar_one())


def _gaps(store: PostgresEventStore, job_id: str) -> int:
    """Sequence gaps the ingest recorded for the job (the simulated members publish each
    member's events in order, so any is the control plane's or the world's fault)."""
    query = sa.text("SELECT count(*) FROM seq_gaps WHERE job_id = :job")
    with store.engine.connect() as conn:
        return int(conn.execute(query, {"job": job_id}).scalar_one())


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def run_decide_bench(
    *, members: int, faults: int, progress: bool = True, mesh: Mesh | None = None
) -> dict[str, Any]:
    """Run the benchmark and return its figures (``mesh``: the job's mesh, of ``members``
    ranks)."""
    if mesh is not None and mesh.size != members:
        raise ValueError(f"the mesh {mesh.describe()} has {mesh.size} ranks, not {members}")
    # ELASTIC_BENCH_LOG_LEVEL=INFO shows the service's decisions (its log is quiet otherwise).
    level = {"ELASTIC_LOG_LEVEL": os.environ.get("ELASTIC_BENCH_LOG_LEVEL", "WARNING")}
    with (
        stack(commit_times=True) as services,
        serving(services, ELASTIC_RENDEZVOUS_PORT="0", **level),
    ):
        job_id = f"bench-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        arrivals, caught_up_s = asyncio.run(
            _scenario(
                services.nats_url,
                services.database_url,
                job_id,
                members=members,
                faults=faults,
                progress=progress,
                mesh=mesh,
            )
        )
        elapsed = time.monotonic() - started
        store = PostgresEventStore.from_url(services.database_url)
        try:
            measured, committed = _latencies(store, job_id, arrivals)
            heartbeats = _count(store, job_id, "member.heartbeat")
            gaps = _gaps(store, job_id)
        finally:
            store.close()
    latencies = [m.total_ms for m in measured]
    to_command = [m.command_ms for m in measured]

    def median(kind: str, part: str) -> float | None:
        values = [getattr(m, part) for m in measured if m.kind == kind]
        return round(statistics.median(values), 1) if values else None

    return {
        "members": members,
        "mesh": mesh.describe() if mesh is not None else None,
        "faults": faults,
        "decisions": len(latencies),
        "p50_ms": round(statistics.median(latencies), 1),
        "p99_ms": round(_percentile(latencies, 0.99), 1),
        "max_ms": round(max(latencies), 1),
        "latencies_ms": [round(x, 1) for x in latencies],
        # "commit": the figures above end when the decision committed; "command": when its
        # command reached the members (PostgreSQL recorded no commit times).
        "measured_to": "commit" if committed else "command",
        "command_p50_ms": round(statistics.median(to_command), 1),
        "command_p99_ms": round(_percentile(to_command, 0.99), 1),
        "command_latencies_ms": [round(x, 1) for x in to_command],
        # Per fault: [trigger -> turn, turn -> commit], and for a crash the exit's own
        # trip (published -> committed by the ingest) inside the first.
        "legs_ms": [
            [round(m.to_turn_ms, 1), round(m.turn_ms, 1)]
            + ([round(m.ingest_ms, 1)] if m.ingest_ms is not None else [])
            for m in measured
        ],
        # Medians of the two legs, per kind of fault (see _Latency).
        "crash_to_turn_ms": median("crash", "to_turn_ms"),
        "crash_turn_ms": median("crash", "turn_ms"),
        "hang_to_turn_ms": median("hang", "to_turn_ms"),
        "hang_turn_ms": median("hang", "turn_ms"),
        "heartbeats_per_s": round(heartbeats / elapsed, 1),
        "sequence_gaps": gaps,
        # From the backup sent to the ingest caught up with it (the faults start after).
        "backup_caught_up_s": round(caught_up_s, 1),
        "seconds": round(elapsed, 1),
        **services.where,
    }
