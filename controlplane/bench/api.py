"""``elasticctl bench api``: the REST API's latency on a big log, under concurrent clients.

The log is one job of ``workers`` ranks and a few warm spares that train (heartbeats, steps,
hot backups replicated to the holders the placement names) and, every ``crash_every`` steps,
lose a rank: the real decider (``controlplane.core.decide``) detects the exit, reallocates the
rank to a spare and resolves the incident when the new generation steps; the lost rank comes
back as a spare. It is appended through the store (COPY, large batches). Then ``elasticctl
api`` starts as its own process, folds the log (``catch_up_s``), and ``clients`` concurrent
clients (asyncio, one keep-alive connection each, each sending its next request when the last
one answered; raw HTTP/1.1, or httpx with ``client="httpx"``) call one route for ``seconds``
after a second of warm-up: the incident timeline (a random incident), then a page of events
(a random cursor; every fourth request filtered by type, every eighth by member). One answer
of each route is validated with the schemas first.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from pydantic import BaseModel

from controlplane.bench import BenchError
from controlplane.bench.stack import stack
from controlplane.core.decide import Context, decide, envelope
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView, MemberStatus
from controlplane.devstack import free_port
from controlplane.settings import DATABASE_URL_ENV
from controlplane.store.port import AppendResult
from controlplane.store.postgres import PostgresEventStore
from schemas.api import EventPage, IncidentTimeline
from schemas.events import EVENT_CLASSES, EnvelopeBase, JobPolicy
from schemas.ids import uuid7

#: Events appended per transaction while filling the log.
FILL_BATCH = 50_000
_START = datetime(2026, 1, 1, tzinfo=UTC)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(slots=True)
class _Source:
    node: str
    rack: str
    incarnation: str
    seq: int = 0


@dataclass(slots=True)
class RecordedJob:
    """A job's log made in memory: member events at simulated times, decided as the service
    decides (after each batch of member events, at the batch's time)."""

    job_id: str
    workers: int = 64
    spares: int = 4
    racks: int = 4
    nodes_per_rack: int = 4
    backup_interval: int = 10
    crash_every: int = 400
    view: JobView | None = None
    now: datetime = _START
    #: What was recorded and not yet handed out by ``take``.
    out: list[EnvelopeBase] = field(default_factory=list)
    sources: dict[str, _Source] = field(default_factory=dict)
    #: node -> its launcher (``<node>/launcher``: announces members, reports exits).
    launchers: dict[str, _Source] = field(default_factory=dict)
    position: int = 0
    recorded: int = 0
    #: Recorded and not yet folded: (recorded time, event).
    unfolded: list[tuple[datetime, EnvelopeBase]] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _cp_seq: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _rejoined: int = 0

    # ------------------------------------------------------------------ recording

    @property
    def v(self) -> JobView:
        """The view of everything recorded (folded on demand, a batch at a time)."""
        return self._fold()

    def _fold(self) -> JobView:
        if self.unfolded:
            stored = [
                StoredEvent(self.position + i, at, e) for i, (at, e) in enumerate(self.unfolded, 1)
            ]
            self.position += len(stored)
            self.view = fold(self.view, stored)
            self.unfolded = []
        assert self.view is not None
        return self.view

    def _event_id(self) -> str:
        # Time-ordered, as members' ids are (``schemas.ids``); the time is the event's.
        return uuid7(int(self.now.timestamp() * 1000), self.rng.getrandbits(74))

    def _event(
        self, member: str, type_: str, payload: dict[str, Any], *, launcher: bool = False
    ) -> EnvelopeBase:
        """An event of ``member`` (``launcher``: of the launcher of its node)."""
        source = self.sources[member]
        if launcher:
            node = source.node
            source = self.launchers.setdefault(node, _Source(node, source.rack, f"l-{node}"))
            member = "launcher"
        source.seq += 1
        return EVENT_CLASSES[type_].model_validate(
            {
                "event_id": self._event_id(),
                "job_id": self.job_id,
                "type": type_,
                "v": 1,
                "source": f"{source.node}/{member}",
                "incarnation": source.incarnation,
                "seq": source.seq,
                # Only decisions change it, and they are folded at once (``_decide``).
                "generation": self.view.generation if self.view is not None else 0,
                "emitted_at": self.now,
                "payload": payload,
            },
            strict=False,
        )

    def _add(self, events: list[EnvelopeBase]) -> None:
        self.unfolded.extend((self.now, e) for e in events)
        self.out.extend(events)
        self.recorded += len(events)

    def _decide(self) -> int:
        """Fold, decide, fold the decisions. Between two calls the roster (world, members)
        does not change, so member events are made from the view of the last call."""
        decided = decide(self.v, self.now, Context(rendezvous="tcp://controlplane:29400"))
        if decided:
            self._add([envelope(self.job_id, d, self.now, next(self._cp_seq)) for d in decided])
            self._fold()
        return len(decided)

    @property
    def _roster(self) -> JobView:
        """The view as of the last decision (see ``_decide``), not folded again."""
        assert self.view is not None
        return self.view

    def _join(self, member: str, node: str, rack: str, role: str, policy: JobPolicy | None) -> None:
        self.sources[member] = _Source(node, rack, uuid.uuid4().hex[:12])
        payload: dict[str, Any] = {
            "node": node, "rack": rack, "host": f"h-{node}", "pid": 1000 + len(self.sources),
            "role": role, "device": "cpu", "backup_endpoint": f"{node}:7000",
        }  # fmt: skip
        if policy is not None:
            payload["policy"] = policy.model_dump(mode="json")
        launched = {"member": member, "role": role, "pid": payload["pid"]}
        self._add([self._event(member, "member.launched", launched, launcher=True),
                   self._event(member, "member.joined", payload)])  # fmt: skip

    def _active(self) -> list[str]:
        return [m for m, s in self._roster.members.items() if s.status is MemberStatus.ACTIVE]

    def start(self) -> None:
        """Join the workers (spread over racks and nodes) and the spares; start the job."""
        policy = JobPolicy(
            min_world=max(1, self.workers // 2),
            max_world=self.workers,
            world_size=self.workers,
            backup_interval=self.backup_interval,
            redundancy=2,
        )
        nodes = [(f"n{r}-{k}", f"rack{r}") for r in range(self.racks)
                 for k in range(self.nodes_per_rack)]  # fmt: skip
        for i in range(self.workers):
            node, rack = nodes[i % len(nodes)]
            self._join(f"w{i}", node, rack, "worker", policy if i == 0 else None)
        for s in range(self.spares):
            self._join(f"spare{s}", f"sp{s}", f"rack{s % self.racks}", "spare", None)
        self._decide()

    def _step(self, step: int, loss: float) -> None:
        world = set(self._roster.world)
        beats = [
            self._event(m, "member.heartbeat",
                        {"step": step, "phase": "train" if m in world else "waiting"})
            for m in self._active()
        ]  # fmt: skip
        steps = [
            self._event(m, "train.step",
                        {"step": step, "loss": loss, "step_seconds": 0.5, "samples": 32})
            for m in self._roster.world
        ]  # fmt: skip
        self._add(beats + steps)

    def _backup(self, step: int) -> None:
        events = []
        roster = self._roster
        for shard, owner in enumerate(roster.world):
            checksum = f"crc32:{step:06x}{shard:04x}"
            events.append(self._event(owner, "backup.snapshot", {
                "step": step, "shard": shard, "nbytes": 4096, "checksum": checksum,
                "seconds": 0.01,
            }))  # fmt: skip
            for holder in roster.placement[shard]:
                events.append(self._event(holder, "backup.replicated", {
                    "step": step, "shard": shard, "owner": owner, "nbytes": 4096,
                    "checksum": checksum, "seconds": 0.01,
                }))  # fmt: skip
        self._add(events)

    def _crash(self, victim: str) -> int:
        """``victim`` is killed; the world recovers; return the step training goes on from."""
        self._add([self._event(victim, "member.exited",
                               {"member": victim, "signal": 9, "exit_code": None},
                               launcher=True)])  # fmt: skip
        if not self._decide():
            raise RuntimeError(f"the decider did not act on {victim}'s exit")
        incident = self.v.incidents[self.v.open_incident or ""]
        decision = incident.decisions[-1]
        g = decision.generation
        for offset, kind, payload in (
            (0.1, "command.acked", {"command_id": decision.command_id}),
            (0.5, "restore.completed",
             {"generation": g, "step": decision.restore_step, "bytes": 4096, "seconds": 0.3}),
            (0.6, "train.resumed", {"generation": g, "step": decision.restore_step}),
        ):  # fmt: skip
            self.now += timedelta(seconds=offset)
            self._add([self._event(m, kind, payload) for m in decision.world])
        self.now += timedelta(seconds=0.2)
        self._step(decision.restore_step + 1, _loss(decision.restore_step + 1))
        self._decide()
        if self.v.open_incident is not None:
            raise RuntimeError("the incident did not resolve")
        # The lost rank's node starts a new process: a warm spare.
        source = self.sources[victim]
        self._rejoined += 1
        self._join(f"re{self._rejoined}", source.node, source.rack, "spare", None)
        self._decide()
        return decision.restore_step + 2

    def run(self) -> Iterator[list[EnvelopeBase]]:
        """Train, back up and recover forever; yield what was recorded, a batch at a time."""
        self.start()
        step, crashes = 1, 0
        while True:
            self.now += timedelta(seconds=0.5)
            self._step(step, _loss(step))
            if step % self.backup_interval == 0:
                self._backup(step)
            if step % self.backup_interval == 0 and self._decide():
                raise RuntimeError(f"an unexpected decision at step {step}")
            if step % self.crash_every == self.crash_every // 2:
                crashes += 1
                world = self.v.world
                step = self._crash(world[(crashes * 7) % len(world)])
            else:
                step += 1
            if len(self.out) >= FILL_BATCH:
                yield self.take()

    def take(self) -> list[EnvelopeBase]:
        """Hand out what was recorded since the last call."""
        out, self.out = self.out, []
        return out


def _loss(step: int) -> float:
    return round(2.0 / (1.0 + 0.01 * step), 6)


def fill(store: PostgresEventStore, job: RecordedJob, events: int, progress: bool) -> int:
    """Append ``events`` events of ``job``; return how many were stored. A batch is appended
    (COPY, in a thread: PostgreSQL does the work) while the next one is recorded."""
    stored = 0
    with ThreadPoolExecutor(1, thread_name_prefix="bench-fill") as writer:
        pending: Future[AppendResult] | None = None
        recorded = 0
        for recorded_batch in job.run():
            batch = recorded_batch[: events - recorded]
            recorded += len(batch)
            if pending is not None:
                stored += len(pending.result().stored)
                if progress:
                    _progress(f"  {stored:,} events stored")
            pending = writer.submit(store.append, batch)
            if recorded >= events:
                break
        if pending is not None:
            stored += len(pending.result().stored)
    return stored


# --------------------------------------------------------------------------- the load


@dataclass(slots=True)
class _Route:
    name: str
    url: Callable[[random.Random], str]
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0


class _RawConnection:
    """One keep-alive HTTP/1.1 connection that sends GETs and reads whole answers: a client
    that costs a few tens of microseconds a request (httpx costs several times the API's
    own time per request, so on a small machine it would measure itself)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> _RawConnection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def get(self, path: str) -> tuple[int, bytes]:
        self._writer.write(f"GET {path} HTTP/1.1\r\nHost: api\r\n\r\n".encode())
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self._reader.readexactly(length)

    async def status(self, path: str) -> int:
        return (await self.get(path))[0]

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()


Getter = Callable[[str], Awaitable[int]]


async def _client(
    get: Getter, route: _Route, rng: random.Random, until: float, measure: float
) -> None:
    """One client: the next request as soon as the last one is answered."""
    while True:
        url = route.url(rng)
        started = time.perf_counter()
        if started >= until:
            return
        status = await get(url)
        elapsed = (time.perf_counter() - started) * 1e3
        if status != 200:
            route.errors += 1
        elif started >= measure:
            route.latencies_ms.append(elapsed)


async def _load(base: str, route: _Route, clients: int, seconds: float, client: str) -> None:
    """``clients`` clients on ``route`` for a second of warm-up and ``seconds`` measured."""
    getters: list[Getter] = []
    closers: list[Callable[[], Awaitable[None]]] = []
    if client == "httpx":
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        pool = httpx.AsyncClient(base_url=base, limits=limits, timeout=60.0)

        async def get(url: str) -> int:
            return (await pool.get(url)).status_code

        getters = [get] * clients
        closers.append(pool.aclose)
    else:
        host, port = base.removeprefix("http://").split(":")
        for _ in range(clients):
            conn = await _RawConnection.open(host, int(port))
            getters.append(conn.status)
            closers.append(conn.close)
    try:
        warm = time.perf_counter() + 1.0
        until = warm + seconds
        await asyncio.gather(
            *(_client(g, route, random.Random(i), until, warm) for i, g in enumerate(getters))
        )
    finally:
        for close in closers:
            await close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _figures(latencies: list[float], seconds: float) -> dict[str, Any]:
    if not latencies:
        return {"requests": 0}
    return {
        "requests": len(latencies),
        "per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(statistics.median(latencies), 2),
        "p99_ms": round(_percentile(latencies, 0.99), 2),
        "max_ms": round(max(latencies), 2),
    }


# --------------------------------------------------------------------------- the API process


def _start_api(database_url: str, port: int, *, hot: bool = True) -> subprocess.Popen[bytes]:
    env = {**os.environ, DATABASE_URL_ENV: database_url, "ELASTIC_LOG_LEVEL": "WARNING"}
    env.pop("ELASTIC_API_TOKENS", None)
    env["ELASTIC_API_HOT_ROUTES"] = "true" if hot else "false"
    command = [sys.executable, "-m", "controlplane", "api", "--host", "127.0.0.1"]
    return subprocess.Popen([*command, "--port", str(port)], env=env)


def _wait_caught_up(base: str, job_id: str, events: int, api: subprocess.Popen[bytes]) -> float:
    """Wait until the API's view of ``job_id`` holds ``events`` events; return how long."""
    started = time.monotonic()
    with httpx.Client(base_url=base, timeout=600.0) as client:
        while True:
            if api.poll() is not None:
                raise RuntimeError(f"the API exited with status {api.returncode}")
            try:
                response = client.get(f"/api/v1/jobs/{job_id}")
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if response.status_code == 200 and response.json()["events"] >= events:
                return time.monotonic() - started
            time.sleep(0.05)


def _check(base: str, routes: list[_Route]) -> None:
    """The answers the load will get are valid (one of each route, through the schemas)."""
    rng = random.Random(-1)
    models: dict[str, type[BaseModel]] = {"timeline": IncidentTimeline, "events": EventPage}
    with httpx.Client(base_url=base) as client:
        for route in routes:
            response = client.get(route.url(rng))
            response.raise_for_status()
            models[route.name].model_validate_json(response.content)


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _measure(
    base: str, api: subprocess.Popen[bytes], routes: list[_Route], options: _Options
) -> dict[str, float]:
    """Run the load on each route; return the API's CPU time per request, per route."""
    cpu: dict[str, float] = {}
    for route in routes:
        if options.progress:
            _progress(
                f"{options.clients} clients on the {route.name} route for {options.seconds:.0f}s"
            )
        before = _cpu_s(api.pid)
        asyncio.run(_load(base, route, options.clients, options.seconds, options.client))
        # The warm-up second is not measured, but the API worked in it too.
        requests = len(route.latencies_ms) * (options.seconds + 1.0) / options.seconds
        cpu[route.name] = round((_cpu_s(api.pid) - before) / max(requests, 1.0) * 1e6, 1)
    return cpu


@dataclass(frozen=True, slots=True)
class _Options:
    clients: int
    seconds: float
    client: str
    progress: bool


def run_api_bench(
    *,
    events: int,
    clients: int = 32,
    seconds: float = 10.0,
    client: str = "raw",
    progress: bool = True,
    compare_plain: bool = False,
) -> dict[str, Any]:
    """Run the benchmark and return its figures. ``compare_plain``: measure again against an
    API without its hot routes (``ELASTIC_API_HOT_ROUTES=false``), on the same log."""
    options = _Options(clients, seconds, client, progress)
    load_before = os.getloadavg()[0]
    with stack() as services:
        store = PostgresEventStore.from_url(services.database_url)
        job = RecordedJob(f"bench-{uuid.uuid4().hex[:8]}")
        if progress:
            _progress(f"recording and appending {events:,} events")
        filled = time.monotonic()
        stored = fill(store, job, events, progress)
        fill_s = time.monotonic() - filled
        store.close()
        hot = _serve_and_measure(services.database_url, job, stored, options, hot=True)
        plain = (
            _serve_and_measure(services.database_url, job, stored, options, hot=False)
            if compare_plain
            else None
        )
    result: dict[str, Any] = {
        "events": stored,
        "clients": clients,
        "client": client,
        "seconds": seconds,
        **hot,
        "fill_s": round(fill_s, 1),
        "fill_events_per_s": round(stored / fill_s, 1),
        # The machine is shared: its load when the benchmark started, and at the end.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        **services.where,
    }
    if plain is not None:
        result["plain"] = plain
        # Requests per second with the hot routes over without, per route (same run).
        result["hot_routes_speedup"] = {
            name: round(route["per_s"] / plain["routes"][name]["per_s"], 2)
            for name, route in hot["routes"].items()
            if plain["routes"][name].get("per_s")
        }
    return result


def _serve_and_measure(
    database_url: str, job: RecordedJob, stored: int, options: _Options, *, hot: bool
) -> dict[str, Any]:
    """Start ``elasticctl api`` over the log (with its hot routes or without), wait for it to
    fold the log, and run the load on both routes; their figures."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api = _start_api(database_url, port, hot=hot)
    try:
        if options.progress:
            _progress(f"starting the API ({'with' if hot else 'without'} its hot routes)")
        catch_up_s = _wait_caught_up(base, job.job_id, stored, api)
        with httpx.Client(base_url=base) as http:
            incidents = [
                i["incident_id"] for i in http.get(f"/api/v1/jobs/{job.job_id}/incidents").json()
            ]
            last = http.get(f"/api/v1/jobs/{job.job_id}").json()["last_position"]
        if not incidents:
            raise BenchError(
                f"{stored:,} events end before the job's first incident (a crash at step"
                f" {job.crash_every // 2}): the timeline route needs one; ask for more events"
            )
        members = list(job.v.members)
        routes = [
            _Route(
                "timeline",
                lambda rng: f"/api/v1/jobs/{job.job_id}/incidents/{rng.choice(incidents)}",
            ),
            _Route("events", lambda rng: _events_url(job.job_id, last, members, rng)),
        ]
        _check(base, routes)
        cpu = _measure(base, api, routes, options)
    finally:
        api.terminate()
        api.wait(30)
    everything = [x for r in routes for x in r.latencies_ms]
    overall = _figures(everything, options.seconds * len(routes))
    return {
        "p50_ms": overall.get("p50_ms"),
        "p99_ms": overall.get("p99_ms"),
        "routes": {
            r.name: {
                **_figures(r.latencies_ms, options.seconds),
                "errors": r.errors,
                "api_cpu_us_per_request": cpu[r.name],
            }
            for r in routes
        },
        "incidents": len(incidents),
        "catch_up_s": round(catch_up_s, 1),
    }


def _events_url(job_id: str, last: int, members: list[str], rng: random.Random) -> str:
    url = f"/api/v1/jobs/{job_id}/events?after={rng.randrange(0, last)}"
    draw = rng.randrange(8)
    if draw == 0:
        return f"{url}&member={rng.choice(members)}"
    if draw in (1, 5):
        return f"{url}&type=train.step"
    return url
